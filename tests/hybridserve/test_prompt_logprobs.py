"""`SamplingParams.prompt_logprobs`: each prompt token's log-probability, rank and the most
likely tokens at its position, against transformers' forward pass (float32: 1e-4); chunked
prompts, the prefix cache (which such a request must not read) and preemption's recompute."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from engine_shapes import TINY, pool_of

from hybridserve import LLM, SamplingParams
from hybridserve.core.outputs import ScheduledChunk
from hybridserve.runner.prompt_logprobs import score_chunk, take_scores
from hybridserve.runner.request_state import RequestStates

TOL = 1e-4  # float32 engine against float32 transformers


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    """test_api's engine settings (two seats, chunks of 8 tokens) and transformers' model."""
    directory, hf = hf_checkpoint("nemotron_h")
    kw = {**TINY, "max_num_seqs": 2, "max_prefill_chunk": 8, "cache": pool_of(directory)}
    return LLM(directory, progress=False, **kw), hf


def _reference(hf, ids: list[int]) -> np.ndarray:
    """log_softmax of transformers' logits at every prompt position [P, V]."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def _check(entries, ids: list[int], ref: np.ndarray, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        row, entry = ref[p - 1], entries[p]
        mine = entry[ids[p]]
        assert mine.logprob == pytest.approx(row[ids[p]], abs=TOL)
        # rank: 1 + the more likely tokens (those within TOL of it may count either way)
        above = np.sum(row > row[ids[p]] + TOL), np.sum(row > row[ids[p]] - TOL)
        assert 1 + above[0] <= mine.rank <= 1 + above[1]
        top = list(entry)[:k]  # the k most likely, in rank order, then the prompt token
        assert [entry[t].rank for t in top] == list(range(1, k + 1))
        assert [entry[t].logprob for t in top] == pytest.approx(np.sort(row)[::-1][:k], abs=TOL)
        for t in top:
            assert entry[t].logprob == pytest.approx(row[t], abs=TOL)
        assert len(entry) in (k, k + 1)


def test_prompt_logprobs_match_transformers_over_chunks(model):
    llm, hf = model
    ids = np.random.default_rng(5).integers(3, 512, size=21).tolist()  # chunks 8 + 8 + 5
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3, n=2)
    plain, out = llm.generate([{"prompt_token_ids": ids}] * 2, [greedy, scored], use_tqdm=False)
    assert plain.prompt_logprobs is None
    _check(out.prompt_logprobs, ids, _reference(hf, ids), 3)
    # the sampled tokens are the ones the packed programs give; both choices agree (greedy)
    assert [c.token_ids for c in out.outputs] == [plain.outputs[0].token_ids] * 2


def test_prompt_logprobs_read_no_cached_prefix(model):
    llm, hf = model
    ids = np.random.default_rng(6).integers(3, 512, size=70).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    again = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens > 0, "weak test: the prompt is not cached"
    zero = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": ids}, zero, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0
    _check(out.prompt_logprobs, ids, _reference(hf, ids), 0)
    assert not llm.engine.has_unfinished() and llm.stats()["cache_usage"] == 0.0


def test_scoring_one_token_chunks_and_a_recompute():
    """The runner's bookkeeping alone (random logits, numpy's log_softmax): one-token chunks
    (a decode row's logits), a chunk past the prompt, and a preempted request computing its
    prompt again score each position once."""
    rng = np.random.default_rng(0)
    vocab, ids = 50, rng.integers(0, 50, size=7).tolist()
    states = RequestStates()
    states.add("r", ids, SamplingParams(prompt_logprobs=2), 0, frozenset())
    state = states["r"]
    logits = rng.normal(size=(len(ids) + 1, vocab)).astype(np.float32)
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))

    def chunk(start: int, n: int) -> ScheduledChunk:
        return ScheduledChunk("r", tuple(ids[start : start + n]), start, ((),), False)

    for start, n in [(0, 1), (1, 3), (4, 1)]:  # positions 0..4 score tokens 1..5
        pad = np.zeros((8, vocab), np.float32)
        pad[:n] = logits[start : start + n]
        score_chunk(state, chunk(start, n), jnp.asarray(pad))
    assert take_scores(state) is None  # token 6 is not scored yet
    score_chunk(state, chunk(0, 7), jnp.asarray(logits[:7]))  # a recompute: only position 5 new
    entries = take_scores(state)
    assert take_scores(state) is None  # once
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        assert entries[p][ids[p]].logprob == pytest.approx(ref[p - 1, ids[p]], abs=1e-5)
        assert sorted(list(entries[p])[:2]) == sorted(np.argsort(-ref[p - 1])[:2].tolist())
    assert states.serial == 1
    states.remove("r")
    assert states.serial == 0
