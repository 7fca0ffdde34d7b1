"""The LLM / SamplingParams surface: batching, slot reuse, sampling and stopping rules."""

from __future__ import annotations

import numpy as np
import pytest
from engine_shapes import TINY, pool_of

from hybridserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(hf_checkpoint):
    """Two seats and chunks of 8 tokens (slot reuse, chunked prefill), on TINY's pool."""
    directory = hf_checkpoint("nemotron_h")[0]
    kw = {**TINY, "max_num_seqs": 2, "max_prefill_chunk": 8, "cache": pool_of(directory)}
    return LLM(directory, **kw)


def _prompts():
    rng = np.random.default_rng(3)
    return [{"prompt_token_ids": rng.integers(3, 512, size=n).tolist()} for n in (5, 17, 9)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batched_generation_equals_one_at_a_time(llm):
    prompts = _prompts()
    together = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))  # 3 prompts, 2 slots
    alone = [_tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    assert together == alone
    assert all(len(t) == 12 for t in together)


def test_outputs_keep_prompt_order_and_metadata(llm):
    prompts = _prompts()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert o.metrics.time_to_first_token > 0


def test_seeded_sampling_is_reproducible(llm):
    p = _prompts()[1]
    a = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=11, ignore_eos=True)
    b = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=12, ignore_eos=True)
    first = _tokens(llm.generate(p, a, use_tqdm=False))
    assert _tokens(llm.generate(p, a, use_tqdm=False)) == first
    assert _tokens(llm.generate(p, b, use_tqdm=False)) != first


def test_top_k_one_is_greedy(llm):
    p = _prompts()[0]
    top1 = SamplingParams(temperature=0.7, top_k=1, max_tokens=12, seed=3, ignore_eos=True)
    assert _tokens(llm.generate(p, top1, use_tqdm=False)) == _tokens(
        llm.generate(p, GREEDY, use_tqdm=False)
    )


def test_stop_token_ids(llm):
    p = _prompts()[2]
    greedy = _tokens(llm.generate(p, GREEDY, use_tqdm=False))[0]
    stop_at = greedy[4]
    out = llm.generate(
        p,
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].token_ids == greedy[: greedy.index(stop_at) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_bad_inputs_are_refused_clearly(llm):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        llm.generate("text needs a tokenizer", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 99999]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * TINY["max_model_len"]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt": "x"}, GREEDY, use_tqdm=False)
    for kwargs, message in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n must be in"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model")


def test_bfloat16_generates(hf_checkpoint):
    llm = LLM(hf_checkpoint("nemotron_h")[0], dtype="bfloat16", max_model_len=64)
    out = llm.generate(_prompts()[0], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12


def test_prefix_unit_reaches_the_scheduler(hf_checkpoint, llm):
    """`LLM(prefix_unit=...)` sets the prefix cache's granularity: a repeated prompt hits on
    whole units of it; a unit that does not divide the block size is refused."""
    directory = hf_checkpoint("nemotron_h")[0]
    plan = llm.engine.runner.plan
    auto = llm.engine.scheduler.prefix_unit
    unit = plan.kernel_block_size
    assert unit != auto and plan.block_size % unit == 0
    kw = {**TINY, "max_num_seqs": 2, "max_prefill_chunk": 8, "cache": pool_of(directory)}
    small = LLM(directory, **kw, prefix_unit=unit)
    assert small.engine.scheduler.prefix_unit == unit
    assert small.engine.config.scheduler.prefix_unit == unit
    prompt = {"prompt_token_ids": list(range(3, 3 + unit + unit // 2))}
    assert auto > len(prompt["prompt_token_ids"])  # the default unit would share nothing
    first = small.generate(prompt, GREEDY, use_tqdm=False)
    again = small.generate(prompt, GREEDY, use_tqdm=False)
    assert _tokens(again) == _tokens(first)
    hits = small.stats()["prefix_cache_hit_tokens"]
    assert hits > 0 and hits % unit == 0
    with pytest.raises(ValueError, match=f"prefix_unit = {unit + 1} must be > 0 and divide"):
        LLM(directory, **kw, prefix_unit=unit + 1)
