"""The chaos tests reuse `tests/server/server_harness.py` (ServerProcess, SMALL)."""

from __future__ import annotations

import sys
from pathlib import Path

SERVER_TESTS = str(Path(__file__).resolve().parent.parent / "server")
if SERVER_TESTS not in sys.path:
    sys.path.insert(0, SERVER_TESTS)
