"""The P/D proxy's routing, against scripted upstream instances (httpx.MockTransport): the two
legs and their bodies, round-robin, dead instances out of rotation and back, errors passed on.
The end-to-end proxy over real servers is in test_proxy_e2e.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from app_harness import Upstreams

from hybridserve.server.proxy import ProxyState, build_proxy


def _run(coro):
    return asyncio.run(coro)


async def _post(state: ProxyState, path: str, body: dict) -> httpx.Response:
    app = build_proxy(state)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://x") as c:
        return await c.post(path, json=body)


def _state(up: Upstreams, prefill=("p1", "p2"), decode=("d1", "d2")) -> ProxyState:
    return ProxyState(
        [f"http://{h}:1" for h in prefill],
        [f"http://{h}:1" for h in decode],
        transport=up.transport(),
    )


def test_two_legs_carry_the_transfer_parameters():
    up = Upstreams()
    body = {"model": "m", "prompt": "def ", "max_tokens": 7, "temperature": 0.0}
    reply = _run(_post(_state(up), "/v1/completions", body))
    assert reply.status_code == 200
    (p_host, p_path, first), (d_host, d_path, second) = up.seen
    assert p_host == "p1" and p_path == d_path == "/v1/completions"
    assert first["max_tokens"] == 1 and first["stream"] is False
    assert first["kv_transfer_params"] == {"do_remote_decode": True}
    assert second == {**body, "kv_transfer_params": {"from": "p1"}}
    assert reply.json()["choices"][0]["text"] == f"decoded by {d_host}"


def test_round_robin_and_streaming():
    up = Upstreams()
    state = _state(up)
    for _ in range(4):
        reply = _run(_post(state, "/v1/chat/completions", {"messages": [], "stream": True}))
        assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n")
    hosts = [h for h, _, _ in up.seen]
    assert hosts == ["p1", "d1", "p2", "d2", "p1", "d1", "p2", "d2"]


def test_dead_instance_leaves_rotation_and_comes_back():
    up = Upstreams()
    state = _state(up)
    up.down = {"p1", "d2"}
    for _ in range(3):
        assert _run(_post(state, "/v1/completions", {"prompt": "x"})).status_code == 200
    assert {h for h, _, _ in up.seen} == {"p2", "d1"}
    assert [i.healthy for i in state.prefill] == [False, True]
    assert [i.healthy for i in state.decode] == [True, False]
    up.down = set()
    _run(state.check_health())
    assert all(i.healthy for i in state.prefill + state.decode)


def test_no_instance_left_is_503_and_upstream_errors_pass_through():
    up = Upstreams()
    up.down = {"p1", "p2"}
    reply = _run(_post(_state(up), "/v1/completions", {"prompt": "x"}))
    assert reply.status_code == 503 and "prefill" in reply.json()["error"]["message"]
    up = Upstreams()
    up.prefill_status = 400
    reply = _run(_post(_state(up), "/v1/completions", {"prompt": "x"}))
    assert reply.status_code == 400 and [h for h, _, _ in up.seen] == ["p1"]


@pytest.mark.parametrize(
    "raw,status",
    [(b"{not json", 400), (b"[1, 2]", 400), (b"\xff\xfe", 400), (b"x" * (2 << 20), 413)],
)
def test_bad_bodies_are_refused_before_any_upstream(raw, status):
    up = Upstreams()

    async def go() -> httpx.Response:
        state = _state(up)
        state.max_body_bytes = 1 << 20  # the 2 MiB body is over it
        app = build_proxy(state)
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as c:
            return await c.post("/v1/completions", content=raw)

    reply = _run(go())
    assert reply.status_code == status and "error" in reply.json()
    assert up.seen == []
