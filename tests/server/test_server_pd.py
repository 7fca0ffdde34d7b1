"""A prefill instance and a decode instance (real NIXL over UCX on loopback, a shared secret),
by HTTP only.

This is what a proxy does: the prompt goes to the prefill instance with `max_tokens: 1` and
`kv_transfer_params: {"do_remote_decode": true}`; its response's `kv_transfer_params` go with
the same prompt to the decode instance, whose greedy output must equal offline generation.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from server_harness import SMALL, ServerProcess, wait_until

from hybridserve import SamplingParams

PROMPT = "class Queue:\n    def __init__(self):\n"
SECRET = "the secret of this test deployment"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")

    def role(name: str) -> str:
        return json.dumps({"kv_connector": "NixlConnector", "kv_role": name, "secret": SECRET})

    prefill = ServerProcess([*SMALL, "--kv-transfer-config", role("kv_producer")], logs, "p")
    decode = ServerProcess([*SMALL, "--kv-transfer-config", role("kv_consumer")], logs, "d")
    try:
        for proc in (prefill.launch(), decode.launch()):  # both load at once
            proc.wait_ready()
        yield prefill, decode
    finally:
        for proc in (prefill, decode):
            proc.stop()


def _prefill(prefill: ServerProcess, path: str, body: dict) -> dict:
    body = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    response = httpx.post(prefill.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    params = response.json()["kv_transfer_params"]
    assert {"block_tables", "num_tokens", "host", "port", "engine_id"} <= set(params)
    return params


def test_completion_through_prefill_then_decode_matches_offline(pair, offline):
    prefill, decode = pair
    params = _prefill(prefill, "/v1/completions", {"prompt": PROMPT})
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    response = httpx.post(
        decode.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=120
    )
    assert response.status_code == 200, response.text
    got = response.json()
    want = offline.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), False
    )[0]
    assert got["choices"][0]["token_ids"] == want.outputs[0].token_ids
    assert got["choices"][0]["text"] == want.outputs[0].text
    assert got["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    stats = decode.stats()
    assert stats["transfer_bytes"] > 0 and stats["transfer_failures"] == 0
    # the decode side read the pages and told the prefill side, which freed them
    assert prefill.idle(timeout=30), prefill.stats()
    assert decode.idle(timeout=30), decode.stats()


def test_streamed_chat_through_prefill_then_decode(pair):
    prefill, decode = pair
    chat = {"messages": [{"role": "user", "content": "Sort a list."}], "temperature": 0}
    chat["max_tokens"] = 8
    params = _prefill(prefill, "/v1/chat/completions", chat)
    colocated = httpx.post(decode.url + "/v1/chat/completions", json=chat, timeout=120).json()
    body = {**chat, "stream": True, "kv_transfer_params": params}
    with httpx.stream("POST", decode.url + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == colocated["choices"][0]["message"]["content"]
    assert wait_until(lambda: prefill.stats()["held_requests"] == 0, 30)
    assert decode.idle(timeout=30) and prefill.idle(timeout=30)


def test_decode_instance_refuses_do_remote_decode(pair):
    _, decode = pair
    body = {"prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True}}
    response = httpx.post(decode.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "kv_producer" in response.json()["error"]["message"]


def test_release_frees_the_held_pages_at_once(pair):
    """What the proxy sends when the decode leg failed: the prefill instance frees the pages
    it holds for the decode side now, not at the end of the lease."""
    prefill, _ = pair
    params = _prefill(prefill, "/v1/completions", {"prompt": PROMPT})
    assert prefill.stats()["held_requests"] == 1
    url = prefill.url + "/v1/kv_transfer/release"
    first = httpx.post(url, json={"kv_transfer_params": params}, timeout=30)
    assert first.status_code == 200 and first.json() == {"released": True}, first.text
    assert prefill.idle(timeout=30), prefill.stats()
    again = httpx.post(url, json={"kv_transfer_params": params}, timeout=30)
    assert again.status_code == 200 and again.json() == {"released": False}
    bad = httpx.post(url, json={"kv_transfer_params": "x"}, timeout=30)
    assert bad.status_code == 400 and "error" in bad.json()


def test_forged_and_replayed_params_are_403(pair):
    """Signed parameters: another prompt's block ids, a foreign side channel, an unsigned or a
    used set are refused with 403 before the decode instance contacts anyone."""
    prefill, decode = pair
    victim = _prefill(prefill, "/v1/completions", {"prompt": "def victim(secret):\n"})
    mine = _prefill(prefill, "/v1/completions", {"prompt": PROMPT + "x"})
    failures = decode.stats()["handshake_failures"]
    url = decode.url + "/v1/completions"
    body = {"prompt": PROMPT + "x", "max_tokens": 4}
    for forged in (
        {**mine, "block_tables": victim["block_tables"]},
        {**mine, "host": "127.0.0.2", "port": 9},
        {**mine, "signature": ""},
        victim,  # someone else's parameters (another prompt) with my prompt
    ):
        reply = httpx.post(url, json={**body, "kv_transfer_params": forged}, timeout=60)
        assert reply.status_code == 403, reply.text
        assert reply.json()["error"]["code"] == "forbidden"
    ok = httpx.post(url, json={**body, "kv_transfer_params": mine}, timeout=120)
    assert ok.status_code == 200, ok.text
    again = httpx.post(url, json={**body, "kv_transfer_params": mine}, timeout=60)
    assert again.status_code == 403 and "replayed" in again.json()["error"]["message"]
    assert decode.stats()["handshake_failures"] == failures
    httpx.post(prefill.url + "/v1/kv_transfer/release", json={"kv_transfer_params": victim})
    assert prefill.idle(timeout=30) and decode.idle(timeout=30)


def test_a_one_token_prompt_is_prefilled_on_the_decode_side(pair, offline):
    prefill, decode = pair
    body = {"prompt": [17], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    params = httpx.post(
        prefill.url + "/v1/completions",
        json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=60,
    ).json()["kv_transfer_params"]
    assert params["local_prefill"] is True and "block_tables" not in params
    reply = httpx.post(
        decode.url + "/v1/completions",
        json={**body, "kv_transfer_params": params, "return_token_ids": True},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    want = offline.generate(
        {"prompt_token_ids": [17]},
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        False,
    )[0]
    assert reply.json()["choices"][0]["token_ids"] == want.outputs[0].token_ids


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads) and of its live children."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(entry) == pid or int(fields[1]) == pid:  # fields[1]: the parent's pid
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def test_an_idle_pair_costs_under_two_percent_of_a_core(pair):
    """After the traffic above, 30 s with nothing in flight: the NIXL progress threads and the
    handshake listeners wait instead of polling."""
    prefill, decode = pair
    assert prefill.idle(timeout=30) and decode.idle(timeout=30)
    pids = [prefill.proc.pid, decode.proc.pid]
    before, start = [_cpu_seconds(p) for p in pids], time.monotonic()
    time.sleep(30)
    spent = [_cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)]
    share = [s / (time.monotonic() - start) for s in spent]
    message = f"idle share of a core: prefill {share[0]:.3f}, decode {share[1]:.3f}"
    assert max(share) < 0.02, message
