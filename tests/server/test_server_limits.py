"""Back-pressure and timeouts: a full queue answers 429, a slow request is aborted."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from server_harness import ServerProcess, counter, wait_until

TIMEOUT_S = 1.0
# 1000 tokens take several seconds on any CPU: far past the timeout
LONG = {"prompt": "def ", "max_tokens": 1000, "ignore_eos": True}


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    args = ["--max-model-len", "1024", "--max-num-seqs", "4", "--dtype", "float32"]
    args += ["--max-queue", "2", "--request-timeout", str(TIMEOUT_S)]
    with ServerProcess(args, tmp_path_factory.mktemp("logs"), "limited") as proc:
        # compile the one-request shapes first (a first try may time out while compiling), so
        # that admissions below are not held up behind a compiling step
        body = {"prompt": "def ", "max_tokens": 4}
        url = proc.url + "/v1/completions"
        assert wait_until(lambda: httpx.post(url, json=body, timeout=120).status_code == 200, 120)
        yield proc


def test_full_queue_gets_429_with_retry_after(limited):
    url = limited.url + "/v1/completions"
    body = {**LONG, "stream": True}
    with (
        httpx.stream("POST", url, json=body, timeout=120) as first,
        httpx.stream("POST", url, json=body, timeout=120) as second,
    ):
        assert first.status_code == second.status_code == 200  # both admitted
        refused = httpx.post(url, json={"prompt": "a", "max_tokens": 1}, timeout=30)
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        assert httpx.get(limited.url + "/health").status_code == 200
        for response in (first, second):  # both run into the timeout
            assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"
    assert limited.idle(timeout=30), limited.stats()
    assert httpx.post(url, json={"prompt": "a", "max_tokens": 1}).status_code == 200


def test_slow_json_request_gets_504(limited):
    before = limited.metrics()
    start = time.monotonic()
    response = httpx.post(limited.url + "/v1/completions", json=LONG, timeout=120)
    elapsed = time.monotonic() - start
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "request_timeout"
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 10
    assert limited.idle(timeout=30), limited.stats()
    after = limited.metrics()
    finished = "hybridserve:request_success_total"
    timeouts = counter(after, finished, finished_reason="timeout")
    assert timeouts - counter(before, finished, finished_reason="timeout") == 1


def test_slow_stream_ends_with_finish_reason_abort(limited):
    body = {**LONG, "stream": True}
    with httpx.stream("POST", limited.url + "/v1/completions", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("abort", "timeout")
    assert 1 < len(lines) - 1 < 1000
    assert limited.idle(timeout=30), limited.stats()
