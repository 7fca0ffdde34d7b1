"""Prefill and decode engines (real NIXL, UCX on host memory) give the colocated greedy tokens.

Both engines live in this process (separate NIXL agents, separate cache pools); the transfer is
a real NIXL READ from the prefill engine's region buffers into the decode engine's. The same
tests run over a connector test double (`in_process_connector`: pages copied in this process,
no NIXL) to show the engine drives any `core.connector.KVConnector`.
"""

from __future__ import annotations

import os
import threading
import time

import in_process_connector
import numpy as np
import pytest
from pd_polling import polling

from hybridserve import LLM, SamplingParams
from hybridserve.config import KVTransferConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
DOUBLE = "in-process"  # a `mode` that means: the in-process connector double, not NIXL
in_process_connector.register()


_OPEN: list[LLM] = []  # the engines the running test made


@pytest.fixture(autouse=True)
def close_engines():
    """Close every engine a test makes: a live NIXL agent's progress thread polls without
    pause, and agents left open would starve the rest of the suite of CPU."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def _llm(directory, tp=1, role=None, mode="pull", kv=None, **kw):
    _OPEN.append(llm := _make_llm(directory, tp, role, mode, kv, **kw))
    return llm


def _make_llm(directory, tp, role, mode, kv, **kw):
    if mode == DOUBLE:
        kv, mode = {"kv_connector": in_process_connector.NAME, **(kv or {})}, "pull"
    return LLM(
        directory,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        tensor_parallel_size=tp,
        progress=False,
        # `generate` hands the prefill outputs over only once all 32 are done (minutes on a busy
        # CPU at TP 2), so the default lease is long; the lease tests set their own.
        kv_transfer_config=(
            KVTransferConfig(kv_role=role, transfer_mode=mode, **{"lease_s": 600.0, **(kv or {})})
            if role
            else None
        ),
        **kw,
    )


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=int(rng.integers(2, 60))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def shared(hf_checkpoint):
    """`shared(tp=1, role=None, mode="pull")`: engines with the default transfer settings on
    the nemotron_h checkpoint, one per distinct setting, kept for the module (the tests that
    share one check its counters as differences) and closed at its end."""
    directory = hf_checkpoint("nemotron_h")[0]
    made: dict[tuple, LLM] = {}

    def get(tp: int = 1, role: str | None = None, mode: str = "pull") -> LLM:
        key = (tp, role, mode if role == "kv_consumer" or mode == DOUBLE else None)
        if key not in made:
            made[key] = _make_llm(directory, tp, role, mode, None)
        return made[key]

    yield get
    for llm in made.values():
        llm.close()


@pytest.fixture(scope="module")
def colocated_32(shared) -> list[list[int]]:
    """The colocated greedy tokens of `_prompts(32)`."""
    outs = shared().generate(
        [{"prompt_token_ids": p} for p in _prompts(32)], GREEDY, use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs]


def _pd_generate(prefill: LLM, decode: LLM, prompts, params):
    outs = prefill.generate(
        [
            {"prompt_token_ids": p, "kv_transfer_params": {"do_remote_decode": True}}
            for p in prompts
        ],
        params,
        use_tqdm=False,
    )
    handed = [
        {"prompt_token_ids": p, "kv_transfer_params": o.kv_transfer_params}
        for p, o in zip(prompts, outs, strict=True)
    ]
    with polling(prefill):
        result = decode.generate(handed, params, use_tqdm=False)
        deadline = time.monotonic() + 10
        while prefill.engine.scheduler.held and time.monotonic() < deadline:
            time.sleep(0.001)
    return [o.outputs[0].token_ids for o in result]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 1), (1, 2)])
def test_pd_matches_colocated_for_32_requests(shared, colocated_32, prefill_tp, decode_tp, mode):
    prefill = shared(prefill_tp, "kv_producer")
    decode = shared(decode_tp, "kv_consumer", mode)
    failures = decode.engine.connector.failures
    assert _pd_generate(prefill, decode, _prompts(32), GREEDY) == colocated_32
    for engine in (prefill.engine, decode.engine):
        assert engine.scheduler.coordinator.pool.num_used == 0
        assert not engine.scheduler.held
    assert decode.engine.connector.failures == failures


@pytest.mark.parametrize("tp", [1, 2])
def test_an_in_process_connector_double_gives_the_colocated_tokens(shared, colocated_32, tp):
    """The engine knows no transport: swapping NIXL for a `KVConnector` that copies the held
    pages in this process gives the colocated tokens and frees every page on both sides."""
    prefill, decode = shared(tp, "kv_producer", DOUBLE), shared(tp, "kv_consumer", DOUBLE)
    assert type(decode.engine.connector).__name__ == "InProcessConnector"
    assert _pd_generate(prefill, decode, _prompts(32), GREEDY) == colocated_32
    for engine in (prefill.engine, decode.engine):
        assert engine.scheduler.coordinator.pool.num_used == 0
        assert not engine.scheduler.held
    assert decode.engine.connector.failures == 0 < decode.engine.connector.bytes_moved


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_transfer_after_the_lease_ended_is_refused(hf_checkpoint, mode):
    """Pages released by an expired lease may be reused: the decode side must not trust them
    (pull: the producer's read_ack says no; push: the producer refuses to write)."""
    directory = hf_checkpoint("nemotron_h")[0]
    prompts = _prompts(4, seed=2)
    prefill = _llm(directory, 1, "kv_producer", kv={"lease_s": 0.05})
    decode = _llm(directory, 1, "kv_consumer", mode, kv={"failure_policy": "fail"})
    outs = prefill.generate(
        [
            {"prompt_token_ids": p, "kv_transfer_params": {"do_remote_decode": True}}
            for p in prompts
        ],
        GREEDY,
        use_tqdm=False,
    )
    time.sleep(0.2)
    prefill.engine.poll_transfers()
    assert not prefill.engine.scheduler.held
    assert prefill.engine.scheduler.coordinator.pool.num_used == 0
    handed = [
        {"prompt_token_ids": p, "kv_transfer_params": o.kv_transfer_params}
        for p, o in zip(prompts, outs, strict=True)
    ]
    with polling(prefill):
        result = decode.generate(handed, GREEDY, use_tqdm=False)
    assert decode.engine.connector.failures == len(prompts)
    why = "no longer held the pages" if mode == "pull" else "no held pages"
    for o in result:
        assert o.outputs[0].finish_reason == "abort"
        assert why in o.outputs[0].stop_reason
    assert decode.engine.scheduler.coordinator.pool.num_used == 0


def test_heartbeats_renew_the_lease_of_waiting_requests(hf_checkpoint):
    # The heartbeat goes out half a second into a 6 s lease, so it arrives before the lease
    # ends even on a loaded machine; past the first deadline the pages are still held.
    directory = hf_checkpoint("nemotron_h")[0]
    lease = 6.0
    prefill = _llm(directory, 1, "kv_producer", kv={"lease_s": lease})
    decode = _llm(directory, 1, "kv_consumer")
    (out,) = prefill.generate(
        [
            {
                "prompt_token_ids": list(range(3, 30)),
                "kv_transfer_params": {"do_remote_decode": True},
            }
        ],
        GREEDY,
        use_tqdm=False,
    )
    params = out.kv_transfer_params
    assert params["lease_s"] == lease
    held = prefill.engine.connector.producer.held[params["req_id"]]
    first = held.deadline  # the end of the lease, in time.monotonic() seconds
    consumer = decode.engine.connector.consumer
    typed = consumer.accept_params(params, list(range(3, 30)))
    with polling(prefill):  # the handshake runs off the engine thread
        while consumer.peer_for(typed) is None:
            time.sleep(0.01)
    time.sleep(0.5)
    consumer.keep_alive([typed])  # a request still waiting for decode pages
    while held.deadline == first and time.monotonic() < first - 0.5:
        prefill.engine.poll_transfers()
        time.sleep(0.01)
    assert held.deadline >= first + 0.4
    time.sleep(max(0.0, first - time.monotonic()) + 0.5)  # past the first deadline
    prefill.engine.poll_transfers()
    assert params["req_id"] in prefill.engine.scheduler.held


def _settle(count, quiet_s: float = 0.5, timeout_s: float = 10.0) -> None:
    """Wait until `count()` has not changed for `quiet_s` seconds (at most `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.05)
        now = count()
        if now != last:
            last, since = now, time.monotonic()


def test_close_releases_the_agent_and_the_handshake_server(hf_checkpoint):
    directory = hf_checkpoint("nemotron_h")[0]
    native = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    handshakes = lambda: sum(t.name == "handshake" for t in threading.enumerate())  # noqa: E731
    _settle(native, quiet_s=2.0)  # threads of engines closed by earlier tests may be ending
    before = native(), handshakes()
    with _make_llm(directory, 1, "kv_producer", "pull", None) as llm:
        opened = native(), handshakes()
        assert opened[0] > before[0] and opened[1] == before[1] + 1
    assert llm.engine.connector is None
    deadline = time.monotonic() + 10  # the handshake thread notices its closed socket
    while handshakes() > before[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handshakes() == before[1]
    assert native() <= opened[0] - 2  # the agent's progress thread and the handshake thread
    llm.close()  # idempotent


@pytest.mark.parametrize("mode", ["pull", "push", DOUBLE])
def test_decode_side_prefix_reuse_takes_the_mamba_state_from_the_transfer(shared, mode):
    """A Mamba hybrid: a second P/D request sharing 2 prefix units with a first one shares the
    decode engine's cached attention pages of those units (no Mamba snapshot is needed there:
    the transfer brings the state after the whole prompt), receives fewer bytes, and gives the
    colocated tokens."""
    prefill = shared(1, "kv_producer", mode)
    decode = shared(1, "kv_consumer", mode)
    coord = decode.engine.scheduler.coordinator
    unit, size = coord.unit, coord.block_size
    assert coord.mamba and unit == size  # whole pages: the hit is all shared
    rng = np.random.default_rng(9)
    first = rng.integers(3, 512, 2 * unit + 14).tolist()
    second = first[: 2 * unit] + rng.integers(3, 512, 14).tolist()
    colocated = [
        o.outputs[0].token_ids
        for o in shared().generate(
            [{"prompt_token_ids": p} for p in (first, second)], GREEDY, use_tqdm=False
        )
    ]
    stats = decode.engine.stats
    before = stats()
    assert _pd_generate(prefill, decode, [first], GREEDY) == colocated[:1]
    alone = stats()["transfer_bytes_received"] - before["transfer_bytes_received"]
    hits = stats()["prefix_cache_hit_tokens"]
    assert _pd_generate(prefill, decode, [second], GREEDY) == colocated[1:]
    assert stats()["prefix_cache_hit_tokens"] - hits == 2 * unit
    second_bytes = stats()["transfer_bytes_received"] - before["transfer_bytes_received"] - alone
    assert 0 < second_bytes < alone
    for engine in (prefill.engine, decode.engine):
        assert engine.scheduler.coordinator.pool.num_used == 0
    assert stats()["transfer_failures"] == before["transfer_failures"]
