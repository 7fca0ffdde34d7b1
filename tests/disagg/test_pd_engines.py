"""Prefill and decode engines (real NIXL, UCX on host memory) give the colocated greedy tokens.

Both engines live in this process (separate NIXL agents, separate cache pools); the transfer is
a real NIXL READ from the prefill engine's region buffers into the decode engine's.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.config import KVTransferConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _llm(directory, tp=1, role=None, **kw):
    return LLM(
        directory,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        tensor_parallel_size=tp,
        progress=False,
        kv_transfer_config=KVTransferConfig(kv_role=role) if role else None,
        **kw,
    )


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=int(rng.integers(2, 60))).tolist() for _ in range(n)]


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
    result = decode.generate(handed, params, use_tqdm=False)
    deadline = time.monotonic() + 10  # the prefill side frees on the decode side's notification
    while prefill.engine.scheduler.held and time.monotonic() < deadline:
        prefill.engine.poll_transfers()
        time.sleep(0.001)
    return [o.outputs[0].token_ids for o in result]


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 1), (1, 2)])
def test_pd_matches_colocated_for_32_requests(hf_checkpoint, prefill_tp, decode_tp):
    directory = hf_checkpoint("nemotron_h")[0]
    prompts = _prompts(32)
    colocated = [
        o.outputs[0].token_ids
        for o in _llm(directory).generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False
        )
    ]
    prefill = _llm(directory, prefill_tp, "kv_producer")
    decode = _llm(directory, decode_tp, "kv_consumer")
    assert _pd_generate(prefill, decode, prompts, GREEDY) == colocated
    for engine in (prefill.engine, decode.engine):
        assert engine.scheduler.coordinator.pool.num_used == 0
        assert not engine.scheduler.held
    assert decode.engine.connector.failures == 0
