"""One `hybridserve serve` process shared by the server tests, and the offline reference."""

from __future__ import annotations

import pytest
from server_harness import HEADER_TIMEOUT_S, OFFLINE, SMALL, ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The default model served on loopback (float32, max_model_len 256; request heads must
    arrive within HEADER_TIMEOUT_S)."""
    args = [*SMALL, "--max-queue", "64", "--header-timeout", str(HEADER_TIMEOUT_S)]
    proc = ServerProcess(args, tmp_path_factory.mktemp("logs"), "main")
    with proc:
        yield proc


@pytest.fixture(scope="session")
def offline():
    """`LLM` with the server's settings, in this process: the reference for greedy outputs."""
    from hybridserve import LLM

    return LLM(progress=False, **OFFLINE)
