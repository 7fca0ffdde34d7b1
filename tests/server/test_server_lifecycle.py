"""`hybridserve serve` flags, start-up errors, and a graceful shutdown that drains requests."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_harness import SMALL, ServerProcess, wait_until

from hybridserve.cli import main
from hybridserve.engine import LLMEngine


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
def test_bad_kv_transfer_config_is_refused_before_loading(config, message, capsys, monkeypatch):
    """In this process (the command's own exit is checked below): the error comes before any
    model is loaded."""

    def load(*args, **kwargs):
        raise AssertionError("the engine was built before the config was checked")

    monkeypatch.setattr(LLMEngine, "__init__", load)
    assert main(["serve", "--kv-transfer-config", config]) == 2
    err = capsys.readouterr().err
    assert message in err and "hybridserve serve: error:" in err


def test_the_command_exits_2_on_a_bad_kv_transfer_config():
    start = time.monotonic()
    proc = _serve("--kv-transfer-config", '{"kv_role": "kv_prefill"}')
    assert proc.returncode == 2, proc.stderr
    assert "kv_role must be one of" in proc.stderr and "hybridserve serve: error:" in proc.stderr
    assert time.monotonic() - start < 60


def test_missing_model_and_conflicting_models():
    proc = _serve("/nonexistent/model")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = _serve("/a/model", "--model", "/b/model")
    assert proc.returncode == 2 and "two models" in proc.stderr


def _stream(url: str, body: dict, first: threading.Event, out: list[str]) -> None:
    """Read one streamed completion into `out`; set `first` at its first event."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line:
                out.append(line)
                first.set()


def test_sigterm_drains_with_the_listener_open(tmp_path):
    """Two long streams, one at a time (--max-num-seqs 1): after SIGTERM both finish, while
    new requests get 503 with Retry-After (not a refused connection); then the server exits."""
    args = [*SMALL, "--max-num-seqs", "1", "--served-model-name", "toy", "alias"]
    server = ServerProcess(args, tmp_path, "drain")
    server.start()
    streams: list[list[str]] = [[], []]
    try:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [
            "toy",
            "alias",
        ]
        body = {"model": "alias", "prompt": "def ", "max_tokens": 200, "ignore_eos": True}
        body["stream"] = True
        started = [threading.Event(), threading.Event()]
        threads = [
            threading.Thread(target=_stream, args=(server.url, body, started[i], streams[i]))
            for i in range(2)
        ]
        threads[0].start()
        assert started[0].wait(120)
        threads[1].start()
        assert wait_until(lambda: server.stats()["queue_depth"] == 2, 30)
        server.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 503, 10)
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "a"}, timeout=30)
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "unavailable"
        assert server.stats()["queue_depth"] >= 1  # the drain was still under way

        def gone() -> bool:
            try:
                httpx.get(server.url + "/health", timeout=2)
            except httpx.TransportError:
                return True
            return False

        assert wait_until(gone, 60)
        assert server.proc.wait(60) in (0, -signal.SIGTERM)
        for thread in threads:
            thread.join(60)
    finally:
        server.kill()
    for lines in streams:
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert all(e["model"] == "alias" for e in events)
    log = server.log()
    assert log.count("completion_tokens=200 finish=length") == 2
    assert "draining: 2 requests in flight" in log and "Shutting down" in log
