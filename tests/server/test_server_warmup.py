"""Ready means compiled: `serve` compiles every step program and the small programs between the
steps before `/health` answers, so the first request is as fast as the later ones; and JAX's
persistent compilation cache (on by default) makes a second start load them all.

Both servers run as users run them: the start-up warmup on, XLA at its default optimisation
level (the suite compiles at -O0) and a compilation cache of this test's own, empty at first.
The programs are counted too (`/v1/stats`: jax's monitoring events), so that a compile while
serving shows as a count, not only as time.
"""

from __future__ import annotations

import os
import statistics
import time

import httpx
from server_harness import ServerProcess

SETTINGS = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "256"]
PROMPT = "def parse(path):\n    '''Read the file at path and return its lines.'''\n" * 3
BODY = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "return_token_ids": True}


def _env(cache) -> dict:
    env = {**os.environ, "HYBRIDSERVE_WARMUP": "1", "HYBRIDSERVE_COMPILATION_CACHE": str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's shared cache: not this test's
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "optimization_level" not in f)
    return env


def _start(cache, logs, name: str) -> tuple[ServerProcess, float]:
    """A started server and the seconds from launch to its first healthy answer."""
    begin = time.perf_counter()
    server = ServerProcess([*SETTINGS, "--dtype", "float32"], logs, name, _env(cache))
    server.start(timeout=600)
    return server, time.perf_counter() - begin


def _first_token_s(server: ServerProcess) -> tuple[float, list[int]]:
    """Seconds until the one output token of BODY arrives (its TTFT, seen by the client)."""
    begin = time.perf_counter()
    response = httpx.post(server.url + "/v1/completions", json=BODY, timeout=120)
    elapsed = time.perf_counter() - begin
    assert response.status_code == 200, response.text
    return elapsed, response.json()["choices"][0]["token_ids"]


def test_first_request_is_steady_state_and_a_warm_start_is_3x_faster(tmp_path):
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    logs.mkdir()
    cold, cold_s = _start(cache, logs, "cold")
    try:
        ready = cold.stats()
        assert ready["programs_compiled"] > 10  # the warmup compiled the step programs
        first, tokens = _first_token_s(cold)
        steady = statistics.median(_first_token_s(cold)[0] for _ in range(3))
        after = cold.stats()
    finally:
        cold.stop()
    assert after["programs_compiled"] == ready["programs_compiled"], "a request compiled"
    assert first <= 2 * steady, f"first request {first:.3f} s, steady state {steady:.3f} s"

    warm, warm_s = _start(cache, logs, "warm")
    try:
        stats = warm.stats()
        assert _first_token_s(warm)[1] == tokens
    finally:
        warm.stop()
    assert stats["programs_compiled"] == 0, "a second start compiled instead of loading"
    assert stats["programs_loaded"] == ready["programs_compiled"]
    assert cold_s >= 3 * warm_s, f"cold start {cold_s:.1f} s, warm start {warm_s:.1f} s"
    assert "loaded from the compilation cache" in warm.log()
