"""`hybridserve proxy` over a real prefill instance and a real decode instance (NIXL over UCX
on loopback): greedy outputs equal those of one `kv_both` instance, streamed and not, for
concurrent requests, and both instances end with every page back in their pools; a failed
decode leg has the prefill instance release its pages at once."""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from app_harness import serve_in_thread, wait_until
from server_harness import SMALL, ProxyProcess, ServerProcess

from hybridserve.server.listener import HTTPLimits
from hybridserve.server.proxy import ProxyState, build_proxy

PROMPTS = [f"def helper_{i}(items):\n    " for i in range(6)]
# Leases and transfer timeouts long enough for a loaded 2-core CI machine, where each of the
# four processes compiles its programs on first use (this test counts failed transfers).
ROLE = (
    '{{"kv_connector": "NixlConnector", "kv_role": "{}", "lease_s": 600, '
    '"transfer_timeout_s": 600}}'
)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    prefill = ServerProcess([*SMALL, "--kv-transfer-config", ROLE.format("kv_producer")], logs, "p")
    decode = ServerProcess([*SMALL, "--kv-transfer-config", ROLE.format("kv_consumer")], logs, "d")
    both = ServerProcess([*SMALL, "--kv-transfer-config", ROLE.format("kv_both")], logs, "b")
    procs = [prefill, decode, both]
    try:
        for proc in procs:
            proc.launch()
        for proc in procs:
            proc.wait_ready()
        proxy = ProxyProcess(["--prefill", prefill.url, "--decode", decode.url], logs, "proxy")
        procs.append(proxy)
        proxy.start()
        yield proxy, prefill, decode, both
    finally:
        for proc in procs:
            proc.stop()


def _complete(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def _chat_stream(url: str, prompt: str) -> str:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events)


def test_proxy_matches_a_kv_both_instance(deployment):
    proxy, prefill, decode, both = deployment
    with ThreadPoolExecutor(6) as pool:
        via_proxy = list(pool.map(lambda p: _complete(proxy.url, p), PROMPTS))
        streamed = list(pool.map(lambda p: _chat_stream(proxy.url, p), PROMPTS[:3]))
    want = [_complete(both.url, p) for p in PROMPTS]
    want_chat = [_chat_stream(both.url, p) for p in PROMPTS[:3]]
    assert via_proxy == want
    assert streamed == want_chat
    assert decode.stats()["transfer_failures"] == 0
    assert decode.stats()["transfer_bytes"] > 0
    assert prefill.idle(30), prefill.stats()
    assert decode.idle(30), decode.stats()


def test_proxy_health_models_and_bad_input(deployment):
    proxy = deployment[0]
    health = httpx.get(proxy.url + "/health", timeout=10)
    assert health.status_code == 200 and all(health.json()["decode"].values())
    models = httpx.get(proxy.url + "/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"]
    bad = httpx.post(proxy.url + "/v1/completions", content=b"{oops", timeout=10)
    assert bad.status_code == 400 and "error" in bad.json()
    # an invalid request is refused by the prefill instance and passed on unchanged
    bad = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "n": 3}, timeout=30)
    assert 400 <= bad.status_code < 500 and "error" in bad.json()


def test_a_failed_decode_leg_frees_the_prefill_pages_at_once(deployment):
    """A proxy whose "decode instance" is the prefill instance itself, which refuses the decode
    leg: the proxy passes the error on and releases the pages the prefill holds, long before
    their lease (600 s here) would."""
    prefill = deployment[1]
    state = ProxyState([prefill.url], [prefill.url])
    body = {"prompt": "def released(x):", "max_tokens": 4}
    with serve_in_thread(build_proxy(state), HTTPLimits()) as url:
        reply = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert 400 <= reply.status_code < 500 and "error" in reply.json(), reply.text
        assert wait_until(lambda: state.stats.releases_sent == 1, 30)
    assert state.stats.release_failures == 0
    assert prefill.idle(30), prefill.stats()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_idle_pd_pair_sleeps(deployment):
    """Nothing in flight for 10 s (the proxy's health checks still arrive): each P/D process
    uses under 2% of a core (NIXL progress threads paused, the engine thread polling slowly).
    A thread that polls without pause takes a whole core; over 10 s a 2% share is 20 clock
    ticks of 10 ms, five health checks arrive, and the window was 30 s before."""
    proxy, prefill, decode, _ = deployment
    _complete(proxy.url, PROMPTS[0])  # after work: an engine loop that never ran cannot spin
    assert prefill.idle(60) and decode.idle(60)
    pids = [prefill.proc.pid, decode.proc.pid]
    before, start = [_cpu_seconds(p) for p in pids], time.monotonic()
    time.sleep(10)
    wall = time.monotonic() - start
    shares = [(_cpu_seconds(p) - b) / wall for p, b in zip(pids, before, strict=True)]
    assert all(share < 0.02 for share in shares), shares
