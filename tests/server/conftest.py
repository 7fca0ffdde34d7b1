"""One `hybridserve serve` process shared by the server tests, and the offline reference."""

from __future__ import annotations

import pytest
from server_harness import OFFLINE, SMALL, ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The default model served on loopback (float32, max_model_len 256)."""
    proc = ServerProcess([*SMALL, "--max-queue", "64"], tmp_path_factory.mktemp("logs"), "main")
    with proc:
        yield proc


@pytest.fixture(scope="session")
def offline():
    """`LLM` with the server's settings, in this process: the reference for greedy outputs."""
    from hybridserve import LLM

    return LLM(progress=False, **OFFLINE)
