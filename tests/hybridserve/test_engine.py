"""The engine end to end on the paged hybrid cache: continuous batching, prefix caching,
streaming, aborts, logprobs, stop strings and TP."""

from __future__ import annotations

import numpy as np
import pytest
from engine_shapes import SERVED, TINY, pool_of

from hybridserve import LLM, SamplingParams
from hybridserve.entrypoints import DEFAULT_MODEL


def _llm(directory, **kw) -> LLM:
    return LLM(directory, **{**TINY, "progress": False, **kw})


@pytest.fixture(scope="module")
def nemotron(hf_checkpoint) -> LLM:
    """One engine on the tiny nemotron_h checkpoint for the tests that need no settings of
    their own (each leaves it with no request unfinished)."""
    return _llm(hf_checkpoint("nemotron_h")[0])


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"prompt_token_ids": rng.integers(3, 512, size=int(rng.integers(lo, hi))).tolist()}
        for _ in range(n)
    ]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_sixteen_concurrent_requests_equal_each_alone(nemotron):
    llm = nemotron
    prompts = _prompts(16)
    params = [
        SamplingParams(
            temperature=1.0, top_p=0.95, max_tokens=int(8 + 3 * i), seed=100 + i, ignore_eos=True
        )
        for i in range(16)
    ]
    together = _tokens(llm.generate(prompts, params, use_tqdm=False))
    alone = [
        _tokens(llm.generate(p, s, use_tqdm=False))[0] for p, s in zip(prompts, params, strict=True)
    ]
    assert together == alone
    assert [len(t) for t in together] == [8 + 3 * i for i in range(16)]


def test_prefix_cache_hit_gives_the_cold_output(hf_checkpoint, nemotron):
    directory = hf_checkpoint("nemotron_h")[0]
    warm = nemotron
    block = warm.engine.runner.plan.block_size
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 512, size=2 * block + 5).tolist()  # two full pages and more
    second = {"prompt_token_ids": shared + rng.integers(3, 512, size=9).tolist()}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    warm.generate({"prompt_token_ids": shared + [5, 6, 7]}, params, use_tqdm=False)
    hit = warm.generate(second, params, use_tqdm=False)[0]
    cold = _llm(directory, enable_prefix_caching=False).generate(second, params, use_tqdm=False)[0]
    assert hit.metrics.num_cached_tokens >= 2 * block
    assert warm.stats()["prefix_cache_hit_rate"] > 0
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    hot_lp = [
        lp[t].logprob
        for lp, t in zip(hit.outputs[0].logprobs, hit.outputs[0].token_ids, strict=True)
    ]
    cold_lp = [
        lp[t].logprob
        for lp, t in zip(cold.outputs[0].logprobs, cold.outputs[0].token_ids, strict=True)
    ]
    np.testing.assert_allclose(hot_lp, cold_lp, atol=1e-4)


def test_tensor_parallel_two_gives_the_same_tokens(hf_checkpoint, nemotron):
    directory = hf_checkpoint("nemotron_h")[0]
    prompts = _prompts(4, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    one = _tokens(nemotron.generate(prompts, params, use_tqdm=False))
    two = _tokens(_llm(directory, tensor_parallel_size=2).generate(prompts, params, use_tqdm=False))
    assert one == two


def test_streaming_and_abort(hf_checkpoint):
    llm = _llm(hf_checkpoint("bamba")[0])
    prompts = _prompts(3, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    final = _tokens(llm.generate(prompts, params, use_tqdm=False))
    pieces: dict[str, list[int]] = {}
    ids = []
    for out in llm.generate_stream(prompts, params):
        if out.request_id not in ids:
            ids.append(out.request_id)
        pieces.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert out.outputs[0].token_ids == pieces[out.request_id]
    assert [pieces[i] for i in ids] == final
    stream = llm.generate_stream(prompts, SamplingParams(max_tokens=200, ignore_eos=True))
    next(stream)
    stream.close()  # aborts the three requests mid-flight
    assert not llm.engine.has_unfinished()
    assert llm.stats()["cache_usage"] == 0.0


def test_logprobs_and_min_p(hf_checkpoint):
    llm = _llm(hf_checkpoint("granitemoehybrid")[0])
    out = llm.generate(
        _prompts(1, seed=9),
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.logprobs) == 6
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        best = max(lp.logprob for lp in entry.values())
        assert len(entry) == 3 and entry[token].logprob == best <= 0.0
        assert entry[token].rank == 1 and sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        assert entry[token].decoded_token is None  # this checkpoint has no tokenizer
    chosen = [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs, strict=True)]
    assert out.cumulative_logprob == pytest.approx(sum(chosen))
    strict = SamplingParams(temperature=1.0, min_p=1.0, max_tokens=6, seed=1, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    p = _prompts(1, seed=9)
    assert _tokens(llm.generate(p, strict, use_tqdm=False)) == _tokens(
        llm.generate(p, greedy, use_tqdm=False)
    )


def test_sampled_logprobs_rank_and_text():
    """vLLM's `Logprob`: a sampled token's rank counts the more likely tokens (so it may be
    past the top entries), and each entry carries its token's text."""
    llm = LLM(DEFAULT_MODEL, **SERVED, progress=False)
    params = SamplingParams(temperature=1.5, max_tokens=12, seed=3, logprobs=2, ignore_eos=True)
    out = llm.generate("def ", params, use_tqdm=False)[0].outputs[0]
    assert out.cumulative_logprob is not None and out.cumulative_logprob < 0
    ranks = []
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        mine = entry[token]
        above = sum(lp.logprob > mine.logprob for t, lp in entry.items() if t != token)
        assert mine.rank >= 1 + above and (mine.rank <= 2) == (token in list(entry)[:2])
        for t, lp in entry.items():
            assert lp.decoded_token == llm.engine.tokenizer.decode([t], skip_special_tokens=False)
        ranks.append(mine.rank)
    assert max(ranks) > 1, "weak test: every sampled token was the most likely"
    plain = llm.generate("def ", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_stop_strings_on_the_default_model():
    llm = LLM(DEFAULT_MODEL, **SERVED, progress=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    text = llm.generate("def ", greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[8:12]
    assert stop and stop in text
    out = llm.generate(
        "def ",
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_a_bad_request_disturbs_nothing(nemotron):
    llm = nemotron
    good = _prompts(2, seed=11)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(
            [*good, {"prompt_token_ids": [1, 10**6]}], SamplingParams(max_tokens=4), use_tqdm=False
        )
    assert not llm.engine.has_unfinished()  # nothing of the batch was queued
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(
            {"prompt_token_ids": [5] * TINY["max_model_len"]}, SamplingParams(), use_tqdm=False
        )
    for kwargs, message in [({"min_p": 2.0}, "min_p"), ({"logprobs": 99}, "logprobs")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    out = llm.generate(good, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 1 for o in out)


def test_no_recompilation_after_warmup(hf_checkpoint):
    directory = hf_checkpoint("nemotron_h")[0]
    llm = _llm(
        directory,
        max_num_seqs=4,
        max_prefill_chunk=32,
        max_num_batched_tokens=64,
        cache=pool_of(directory),  # TINY's pool: the warmup finds most programs compiled
    )
    runner = llm.engine.runner
    programs = runner.warmup(4, 64)
    compiled = runner._step._cache_size()
    assert compiled == programs - 1  # every forward program, plus the page-copy one
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=0, ignore_eos=True)
    llm.generate(_prompts(9, seed=21, lo=1, hi=90), params, use_tqdm=False)
    assert runner._step._cache_size() == compiled
