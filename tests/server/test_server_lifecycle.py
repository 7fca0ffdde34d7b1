"""`hybridserve serve` flags, start-up errors, and a graceful shutdown that drains requests."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_harness import SMALL, ServerProcess, wait_until


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybridserve.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_help_names_the_flags_and_the_conv_layout_variable():
    proc = _serve("--help")
    assert proc.returncode == 0
    for flag in (
        "--tensor-parallel-size",
        "--max-model-len",
        "--block-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--dtype",
        "--backend",
        "--host",
        "--port",
        "--served-model-name",
        "--kv-transfer-config",
        "--max-queue",
        "--request-timeout",
        "--max-body-bytes",
        "HYBRIDSERVE_SSM_CONV_LAYOUT",
    ):
        assert flag in proc.stdout, flag


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"kv_role": "kv_producer", "kv_buffer_size": 5}', "unknown keys ['kv_buffer_size']"),
        ('{"kv_role": "kv_prefill"}', "kv_role must be one of"),
        ('{"kv_connector": "LMCache"}', "is not supported"),
        ('{"kv_role": ', "not valid JSON"),
        ('["kv_producer"]', "must be a JSON object"),
        ('{"lease_s": "long"}', "wrong type"),
    ],
)
def test_bad_kv_transfer_config_is_refused_before_loading(config, message):
    start = time.monotonic()
    proc = _serve("--kv-transfer-config", config)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "hybridserve serve: error:" in proc.stderr
    assert time.monotonic() - start < 60


def test_missing_model_and_conflicting_models():
    proc = _serve("/nonexistent/model")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = _serve("/a/model", "--model", "/b/model")
    assert proc.returncode == 2 and "two models" in proc.stderr


def test_sigterm_drains_the_request_in_flight(tmp_path):
    server = ServerProcess([*SMALL, "--served-model-name", "toy", "alias"], tmp_path, "drain")
    server.start()
    try:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [
            "toy",
            "alias",
        ]
        body = {"model": "alias", "prompt": "def ", "max_tokens": 100, "ignore_eos": True}
        body["stream"] = True
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]

        def refused() -> bool:
            try:
                httpx.get(server.url + "/health", timeout=2)
            except httpx.TransportError:
                return True
            return False

        assert wait_until(refused, 30)
        assert server.proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        server.kill()
    assert rest[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in [first, *rest[:-1]]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["model"] == "alias" for e in events)
    log = server.log()
    assert "completion_tokens=100 finish=length" in log and "Shutting down" in log
