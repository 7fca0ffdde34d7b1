"""The tiny Inkling model disaggregated: prefill and decode engines (real NIXL over UCX on host
memory) give the colocated greedy tokens. Its cache has full-attention, sliding-window
(window 6) and sconv (virtual sliding windows of 3 tokens) groups: prompts longer than the
windows hand over tables whose early sliding pages are already freed (null pages), and the
connector moves only the pages still held."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hybridserve.config import MtpConfig
from tests.disagg.test_pd_engines import GREEDY, _llm, _pd_generate, close_engines  # noqa: F401
from tests.hybridserve.inkling_models import build_inkling, save_inkling, tiny_inkling


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    cfg = tiny_inkling()
    return save_inkling(build_inkling(cfg, seed=3), cfg, tmp_path_factory.mktemp("ink") / "m")


@pytest.mark.parametrize(
    "prefill_tp,decode_tp,mode", [(1, 1, "push"), (2, 1, "pull"), (1, 2, "pull")]
)
def test_inkling_pd_matches_colocated(ckpt, prefill_tp, decode_tp, mode):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(10, 4000, int(n)).tolist() for n in rng.integers(2, 60, 12)]
    colocated = [
        o.outputs[0].token_ids
        for o in _llm(ckpt).generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False
        )  # fmt: skip
    ]
    prefill = _llm(ckpt, prefill_tp, "kv_producer")
    decode = _llm(ckpt, decode_tp, "kv_consumer", mode)
    assert _pd_generate(prefill, decode, prompts, GREEDY) == colocated
    for engine in (prefill.engine, decode.engine):
        assert engine.scheduler.coordinator.pool.num_used == 0
    assert decode.engine.connector.failures == 0


def test_inkling_pd_with_mtp_speculation_matches_colocated(tmp_path):
    # Both engines speculate with 2 MTP heads; the heads' KV caches are two more full-attention
    # entries that travel with the rest. The decode side computes the last prompt token, drafts
    # and verifies: its greedy tokens equal a colocated run without speculation.
    cfg = dataclasses.replace(tiny_inkling(), mtp=MtpConfig(num_heads=2))
    ckpt = save_inkling(build_inkling(cfg, seed=6), cfg, tmp_path / "m")
    rng = np.random.default_rng(6)
    prompts = [rng.integers(10, 4000, int(n)).tolist() for n in rng.integers(2, 60, 8)]
    colocated = [
        o.outputs[0].token_ids
        for o in _llm(ckpt).generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False
        )  # fmt: skip
    ]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    prefill = _llm(ckpt, 1, "kv_producer", speculative_config=spec)
    decode = _llm(ckpt, 1, "kv_consumer", "pull", speculative_config=spec)
    assert _pd_generate(prefill, decode, prompts, GREEDY) == colocated
    assert decode.engine.stats()["spec_num_drafts"] > 0
    for engine in (prefill.engine, decode.engine):
        assert engine.scheduler.coordinator.pool.num_used == 0
