"""Speculative decoding on a Mamba hybrid (the shipped nemotron_h model: Mamba2, attention, MLP
and MoE layers), float32.

A Mamba state cannot be rewound past a rejected draft, so a verifying step keeps the state from
before its drafts and the next step computes the accepted drafts again (`StepInput.commit`,
`Scheduler.recurrent`). The drafts come from an oracle that replays the plain greedy output
with some tokens replaced by wrong ones, so that steps accept none, some or all of their drafts.
The reference is the same engine settings without speculation.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_shapes import TINY

from hybridserve import LLM, SamplingParams

K = 3
SETTINGS = {**TINY, "max_num_seqs": 3, "max_prefill_chunk": 16, "prefix_unit": 16}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(10, 4000, 24).tolist()
    return [rng.integers(10, 4000, n).tolist() for n in (5, 19, 33)] + [
        shared + rng.integers(10, 4000, 6).tolist(),
        shared + rng.integers(10, 4000, 2).tolist(),
    ]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=1 + 4 * (K + 1), ignore_eos=True)


@pytest.fixture(scope="module")
def plain_llm():
    """The engine without speculation: the reference."""
    with LLM(**SETTINGS, progress=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def plain(plain_llm) -> list[list[int]]:
    return _run(plain_llm, _prompts(), GREEDY)


def _oracle(plain: list[list[int]], wrong_every: int):
    replay = {tuple(p): out for p, out in zip(_prompts(), plain, strict=True)}

    def oracle(ids: list[int], k: int) -> list[int]:
        prompt = next(p for p in replay if tuple(ids[: len(p)]) == p)
        n = len(ids) - len(prompt)
        drafts = list(replay[prompt][n : n + k])
        for j in range(len(drafts)):  # some drafts wrong: a rejection at varying places
            if wrong_every and (n + j) % wrong_every == 0:
                drafts[j] = (drafts[j] + 1) % 4096
        return drafts + [0] * (k - len(drafts))

    return oracle


@pytest.mark.parametrize("wrong_every", [0, 2])
def test_greedy_speculation_on_a_mamba_hybrid_equals_plain(plain, wrong_every):
    spec = {"method": "oracle", "num_speculative_tokens": K, "oracle": _oracle(plain, wrong_every)}
    llm = LLM(**SETTINGS, progress=False, speculative_config=spec)
    try:
        assert _run(llm, _prompts(), GREEDY) == plain
        s = llm.engine.stats()
        assert s["spec_num_drafts"] > 0
        if wrong_every == 0:  # perfect drafts: every verifying step emits k + 1
            assert s["spec_num_accepted"] == s["spec_num_drafts"]
            assert s["spec_tokens_per_step"] == K + 1
        else:  # rejections, and acceptances before them
            assert 0 < s["spec_num_accepted"] < s["spec_num_drafts"]
        assert s["prefix_cache_hit_tokens"] > 0  # the shared 24 tokens
        assert llm.engine.scheduler.coordinator.pool.num_used == 0
    finally:
        llm.close()


def _lookup_reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup by brute force: longest n first, the latest earlier match."""
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        tail = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == tail:
                return tokens[i + n : i + n + k]
    return []


def test_ngram_drafts_match_a_brute_force_lookup():
    from hybridserve.runner.ngram import ngram_drafts

    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, int(rng.integers(1, 30))).tolist()
        k, n_min = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        n_max = n_min + int(rng.integers(0, 3))
        want = _lookup_reference(tokens, k, n_min, n_max)
        assert ngram_drafts(tokens, k, n_min, n_max) == want, (tokens, k, n_min, n_max)


def test_ngram_speculation_on_a_mamba_hybrid_equals_plain(plain_llm):
    """Prompt lookup drafts (no draft model) on the Mamba hybrid, 48 tokens: the random
    model's greedy output falls into loops after a while, so lookups hit and are accepted
    there, and are rejected before."""
    prompts, params = _prompts()[1:4], dataclasses.replace(GREEDY, max_tokens=48)
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}
    want = _run(plain_llm, prompts, params)
    with LLM(**SETTINGS, progress=False, speculative_config=spec) as llm:
        assert _run(llm, prompts, params) == want
        s = llm.engine.stats()
        assert 0 < s["spec_num_accepted"] < s["spec_num_drafts"]
        assert s["spec_tokens_per_step"] > 1.5
