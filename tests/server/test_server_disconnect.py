"""Client disconnects abort their requests and free their pages; a bounded load test."""

from __future__ import annotations

import asyncio
import json
import os
import random

import httpx
import pytest
from server_harness import counter

LONG = {"prompt": "def ", "max_tokens": 240, "ignore_eos": True}


def test_streamed_request_is_aborted_when_the_client_leaves(server):
    before = server.metrics()
    with httpx.Client(timeout=120) as client:
        body = {**LONG, "stream": True}
        with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    assert server.stats()["num_pages_used"] > 0  # it holds pages now
                    break  # leaving the iterator closes the connection
    assert server.idle(timeout=30), server.stats()
    after = server.metrics()
    finished = "hybridserve:request_success_total"
    assert (
        counter(after, finished, finished_reason="abort")
        - counter(before, finished, finished_reason="abort")
        == 1
    )
    generated = "hybridserve:generation_tokens_total"
    assert 1 <= counter(after, generated) - counter(before, generated) < 240


def test_streamed_choices_are_all_aborted_when_the_client_leaves(server):
    """n = 3 streamed: leaving after the first chunk aborts all three requests."""
    before = server.metrics()
    with httpx.Client(timeout=120) as client:
        body = {**LONG, "stream": True, "n": 3, "temperature": 1.0}
        with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break
    assert server.idle(timeout=30), server.stats()
    finished = "hybridserve:request_success_total"
    aborted = [counter(m, finished, finished_reason="abort") for m in (before, server.metrics())]
    assert aborted[1] - aborted[0] == 3


def test_non_streamed_request_is_aborted_when_the_client_leaves(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):  # 240 tokens take longer: the client gives up
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=0.5)
    assert server.idle(timeout=30), server.stats()
    after = server.metrics()
    key = ("hybridserve:http_requests_total", "/v1/completions", "499")
    status = counter(after, key[0], endpoint=key[1], status=key[2])
    assert status - counter(before, key[0], endpoint=key[1], status=key[2]) == 1
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "a"}).status_code == 200


async def _client(http: httpx.AsyncClient, i: int, rng: random.Random, leaves: bool) -> dict:
    """One simulated user; returns what it saw."""
    if leaves:  # a long stream, left after its first chunk
        body = {**LONG, "stream": True, "prompt": f"# {i}\n"}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
        return {"left": True}
    chat = rng.random() < 0.4
    body = {"max_tokens": rng.randint(1, 12), "temperature": rng.choice([0, 0.8])}
    body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": f"question {i}"}]
    else:
        body["prompt"] = rng.choice(["def ", "import ", "class A:\n"]) + str(i)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if rng.random() < 0.5:
        body["stream"], body["stream_options"] = True, {"include_usage": True}
        async with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
    else:
        response = await http.post(path, json=body)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
    assert usage["completion_tokens"] == body["max_tokens"]
    return {"left": False, "path": path, "tokens": usage["completion_tokens"]}


async def _load(url: str, num_requests: int, concurrency: int, leave: float) -> list[dict]:
    rng = random.Random(0)
    plan = [rng.random() < leave for _ in range(num_requests)]
    gate = asyncio.Semaphore(concurrency)
    # idle pooled connections expire well before the server's 5 s keep-alive closes them: a
    # request sent on a connection the server is closing gets ReadError (seen on a loaded host)
    # A connection per request: on a loaded host the server's event loop can lag past its
    # keep-alive timeout, and a request sent on a pooled connection then meets the close
    # (`httpx.ReadError`, seen in a cold CI run); a fresh connection never does.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:

        async def one(i: int) -> dict:
            async with gate:
                return await _client(http, i, random.Random(i), plan[i])

        return await asyncio.gather(*(one(i) for i in range(num_requests)))


def test_load_with_early_disconnects(server):
    """320 requests at concurrency 64, 10% leaving early (HYBRIDSERVE_LOAD=NxC to change)."""
    size = os.environ.get("HYBRIDSERVE_LOAD", "320x64")
    num_requests, concurrency = (int(x) for x in size.split("x"))
    before = server.metrics()
    results = asyncio.run(_load(server.url, num_requests, concurrency, leave=0.1))
    assert server.idle(timeout=60), server.stats()
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return counter(after, name, **labels) - counter(before, name, **labels)

    left = sum(r["left"] for r in results)
    completed = [r for r in results if not r["left"]]
    assert 0 < left < num_requests
    requests = "hybridserve:http_requests_total"
    chat = sum(r["path"] == "/v1/chat/completions" for r in completed)
    assert delta(requests, endpoint="/v1/chat/completions", status="200") == chat
    assert delta(requests, endpoint="/v1/completions", status="200") == num_requests - chat
    finished = "hybridserve:request_success_total"
    # a leaving client's request is aborted, unless its 240 tokens were all generated before
    # the server saw the disconnect (a loaded host: seen once in a cold CI run); most are aborted
    aborted = delta(finished, finished_reason="abort")
    assert delta(finished, finished_reason="length") == len(completed) + left - aborted
    assert left / 2 < aborted <= left
    for status in ("429", "500", "503"):
        for endpoint in ("/v1/completions", "/v1/chat/completions"):
            assert delta(requests, endpoint=endpoint, status=status) == 0
    tokens = sum(r["tokens"] for r in completed)
    generated = delta("hybridserve:generation_tokens_total")
    assert tokens + left <= generated <= tokens + 240 * left
    assert delta("hybridserve:e2e_request_latency_seconds_count") == num_requests
