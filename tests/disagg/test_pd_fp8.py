"""P/D with an FP8 KV cache (real NIXL): the tiny ModelOpt FP8 nemotron_h checkpoint (FP8
weights, FP8 KV scales, so its KV cache is e4m3 by default) gives the colocated greedy tokens
when prefilled at TP 1 or 2 and decoded at TP 1 or 2. The pages move as bytes, e4m3 keys and
values included, with the page sizes the plan computes on each side."""

from __future__ import annotations

import pytest
from test_pd_engines import GREEDY, _make_llm, _pd_generate, _prompts

from hybridserve import LLM

PROMPTS = 8


@pytest.fixture(scope="module")
def engines(fp8_checkpoint):
    """`engines(tp, role)`: one engine per setting on the FP8 checkpoint, kept for the module."""
    directory = fp8_checkpoint(True)[0]
    made: dict[tuple, LLM] = {}

    def get(tp: int = 1, role: str | None = None) -> LLM:
        if (tp, role) not in made:
            made[(tp, role)] = _make_llm(directory, tp, role, "pull", None)
        return made[(tp, role)]

    yield get
    for llm in made.values():
        llm.close()


@pytest.fixture(scope="module")
def colocated(engines) -> list[list[int]]:
    llm = engines()
    kv = {g.spec.dtype for g in llm.engine.runner.plan.groups if g.spec.kind == "full_attention"}
    assert kv == {"float8_e4m3fn"}
    prompts = [{"prompt_token_ids": p} for p in _prompts(PROMPTS, seed=5)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 1), (1, 2)])
def test_pd_with_fp8_kv_matches_colocated(engines, colocated, prefill_tp, decode_tp):
    prefill, decode = engines(prefill_tp, "kv_producer"), engines(decode_tp, "kv_consumer")
    failures = decode.engine.connector.failures
    assert _pd_generate(prefill, decode, _prompts(PROMPTS, seed=5), GREEDY) == colocated
    for engine in (prefill.engine, decode.engine):
        assert engine.scheduler.coordinator.pool.num_used == 0
    assert decode.engine.connector.failures == failures
