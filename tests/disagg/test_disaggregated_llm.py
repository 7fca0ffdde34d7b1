"""DisaggregatedLLM: prefill and decode workers in separate processes, real NIXL between them,
and what happens when one side dies or never reads."""

from __future__ import annotations

import dataclasses
import multiprocessing
import time

import numpy as np
import pytest
from engine_shapes import TINY

from hybridserve import LLM, SamplingParams
from hybridserve.config import KVTransferConfig
from hybridserve.entrypoints.disaggregated import DisaggregatedLLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"prompt_token_ids": rng.integers(3, 512, size=int(rng.integers(2, 50))).tolist()}
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def colocated(hf_checkpoint):
    """`colocated(prompts)`: their greedy tokens from one colocated engine (the workers'
    settings), each prompt set computed once for the module."""
    llm = LLM(hf_checkpoint("nemotron_h")[0], **TINY, progress=False)
    done: dict[str, list[list[int]]] = {}

    def tokens(prompts: list[dict]) -> list[list[int]]:
        key = repr(prompts)
        if key not in done:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            done[key] = [o.outputs[0].token_ids for o in outs]
        return done[key]

    return tokens


@pytest.mark.parametrize(
    "prefill_tp,decode_tp,mode",
    [(1, 1, "push"), (2, 1, "pull"), (2, 1, "push"), (1, 2, "pull"), (1, 2, "push")],
)
def test_processes_match_colocated_for_each_tp_and_mode(
    hf_checkpoint, colocated, prefill_tp, decode_tp, mode
):
    """(1, 1, "pull") is test_processes_match_colocated_and_leases_free_unread_pages."""
    directory = hf_checkpoint("nemotron_h")[0]
    prompts = _prompts(32, seed=4)
    want = colocated(prompts)
    with DisaggregatedLLM(
        directory, prefill_tp=prefill_tp, decode_tp=decode_tp, **TINY, transfer_mode=mode
    ) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == want
        stats = llm.stats()
        assert stats["decode"]["pages_used"] == 0 and stats["prefill"]["held"] == 0
        assert stats["decode"]["transfer_failures"] == 0


def test_decode_process_killed_mid_transfer_frees_prefill_pages(hf_checkpoint):
    directory = hf_checkpoint("nemotron_h")[0]
    with DisaggregatedLLM(directory, **TINY, lease_s=2.0) as llm:
        prompts = {f"r{i}": p["prompt_token_ids"] for i, p in enumerate(_prompts(8, seed=6))}
        for req_id, ids in prompts.items():
            llm.prefill.send(
                {
                    "op": "add",
                    "req_id": req_id,
                    "prompt_token_ids": ids,
                    "params": {"max_tokens": 4},
                    "kv": {"do_remote_decode": True},
                }
            )
        handed = 0
        while handed < 8:
            message = llm.prefill.recv(60)
            assert message is not None, "the prefill worker went quiet"
            if "output" in message:
                out = message["output"]
                llm.decode.send(
                    {
                        "op": "add",
                        "req_id": out["req_id"],
                        "prompt_token_ids": prompts[out["req_id"]],
                        "params": {"max_tokens": 4},
                        "kv": out["kv"],
                    }
                )
                handed += 1
        llm.decode.process.kill()  # reads may be in flight
        llm.decode.process.join()
        assert "dead" in llm.stats()["decode"]
        deadline = time.monotonic() + 15
        while llm.stats()["prefill"]["pages_used"] and time.monotonic() < deadline:
            time.sleep(0.2)
        final = llm.stats()["prefill"]
        assert final["pages_used"] == 0 and final["held"] == 0


def test_processes_match_colocated_and_leases_free_unread_pages(hf_checkpoint, colocated):
    """Also: a one-token prompt (nothing to transfer: the decode side prefills it), and a call
    that times out aborts its requests in both workers and leaves the object usable."""
    directory = hf_checkpoint("nemotron_h")[0]
    prompts = [*_prompts(31), {"prompt_token_ids": [7]}]
    want = colocated(prompts)
    with DisaggregatedLLM(directory, **TINY, lease_s=2.0) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == want
        for out in outputs:  # the first token comes from prefill, the rest after the transfer
            m = out.metrics
            assert m.arrival_time < m.first_token_time < m.finished_time
            assert m.num_generated_tokens == GREEDY.max_tokens and m.tokens_per_second > 0
        stats = llm.stats()
        assert stats["decode"]["pages_used"] == 0
        image = {"prompt_token_ids": [5, 6], "multi_modal_data": {"image": [[[0.0]]]}}
        with pytest.raises(ValueError, match="does not carry multimodal inputs"):
            llm.generate([image], GREEDY, use_tqdm=False)  # refused, not sent as plain text
        # A decode side that never reads: the prefill worker frees the pages when the lease ends.
        llm.prefill.send(
            {
                "op": "add",
                "req_id": "orphan",
                "prompt_token_ids": list(range(3, 40)),
                "params": {"max_tokens": 4},
                "kv": {"do_remote_decode": True},
            }
        )
        while (message := llm.prefill.recv(30)) is not None and "output" not in message:
            pass
        assert message["output"]["kv"]["num_tokens"] == 36
        assert llm.stats()["prefill"]["held"] == 1
        deadline = time.monotonic() + 10
        while llm.stats()["prefill"]["pages_used"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert llm.stats()["prefill"]["pages_used"] == 0 and llm.stats()["prefill"]["held"] == 0
        long = dataclasses.replace(GREEDY, max_tokens=70)
        with pytest.raises(TimeoutError, match=r"4 requests unfinished after .* \(aborted\)"):
            llm.generate(prompts[:4], long, use_tqdm=False, timeout=0.05)
        again = llm.generate(prompts[:4], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == want[:4]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            s["pages_used"] or s["held"] for s in llm.stats().values()
        ):
            time.sleep(0.2)
        assert all(s["pages_used"] == 0 and s["held"] == 0 for s in llm.stats().values())


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_dead_prefill_engine_recomputes_or_fails_with_a_reason(hf_checkpoint, colocated, policy):
    directory = hf_checkpoint("nemotron_h")[0]
    prompts = _prompts(4, seed=1)
    kw = dict(**TINY, progress=False)
    prefill = LLM(directory, kv_transfer_config=KVTransferConfig(kv_role="kv_producer"), **kw)
    decode = LLM(
        directory,
        kv_transfer_config=KVTransferConfig(
            kv_role="kv_consumer", failure_policy=policy, handshake_timeout_s=1.0
        ),
        **kw,
    )
    with prefill, decode:
        handed = prefill.generate(
            [{**p, "kv_transfer_params": {"do_remote_decode": True}} for p in prompts],
            GREEDY,
            use_tqdm=False,
        )
        prefill.engine.connector.close()  # the prefill engine dies: no side channel, no agent
        outs = decode.generate(
            [
                {**p, "kv_transfer_params": o.kv_transfer_params}
                for p, o in zip(prompts, handed, strict=True)
            ],
            GREEDY,
            use_tqdm=False,
        )
        if policy == "recompute":
            assert [o.outputs[0].token_ids for o in outs] == colocated(prompts)
        else:
            for o in outs:
                assert o.outputs[0].finish_reason == "abort"
                assert "cannot reach the producer" in o.outputs[0].stop_reason
        assert decode.engine.scheduler.coordinator.pool.num_used == 0


def test_a_worker_that_fails_to_start_stops_the_other(hf_checkpoint):
    """The workers start side by side; a decode engine that cannot be built (TP 3 over 4
    heads) fails the constructor with its error, and the prefill worker, which started, is
    stopped: no worker process is left behind."""
    directory = hf_checkpoint("nemotron_h")[0]
    with pytest.raises(RuntimeError, match="failed to start"):
        DisaggregatedLLM(directory, decode_tp=3, **TINY)
    assert not multiprocessing.active_children()


def test_bad_engine_settings_raise_before_any_worker_starts(hf_checkpoint):
    """The workers' settings go through `EngineConfig.from_kwargs` in the parent: an unknown
    or bad one raises at once, naming it, and no process starts."""
    directory = hf_checkpoint("nemotron_h")[0]
    with pytest.raises(TypeError, match=r"unknown engine settings \['max_num_seq'\]"):
        DisaggregatedLLM(directory, **TINY, max_num_seq=4)
    with pytest.raises(ValueError, match="prefix_unit must be >= 1"):
        DisaggregatedLLM(directory, **TINY, prefix_unit=0)
    with pytest.raises(ValueError, match="failure_policy must be"):
        DisaggregatedLLM(directory, **TINY, failure_policy="retry")
    with pytest.raises(TypeError, match="sets tensor_parallel_size itself"):
        DisaggregatedLLM(directory, **TINY, tensor_parallel_size=2)
    assert not multiprocessing.active_children()
