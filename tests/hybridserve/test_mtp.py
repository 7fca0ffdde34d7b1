"""Speculative decoding with MTP heads through the engine (tiny Inkling with 3 heads).

- Greedy: the speculative output equals the plain output token for token (continuous batching,
  chunked prefill, prefix-cache hits), with the real heads proposing (random weights: most
  drafts are rejected, so the rollback path runs constantly).
- Perfect drafts (an oracle replaying the plain greedy run): every verifying step emits k + 1.
- Sampling: over 10,000 requests, the joint distribution of the first three output tokens
  matches the exact one computed from the model's logits (chi-square), with drafts that are
  often accepted and often rejected.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from hybridserve import LLM, SamplingParams
from hybridserve.config import MtpConfig
from hybridserve.runner.sampler import filtered_logits
from tests.hybridserve.inkling_models import build_inkling, save_inkling, tiny_inkling

K = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    cfg = dataclasses.replace(tiny_inkling(), mtp=MtpConfig(num_heads=K))
    return save_inkling(build_inkling(cfg, seed=4), cfg, tmp_path_factory.mktemp("mtp") / "m")


def _llm(ckpt: str, spec: dict | None = None, **kw) -> LLM:
    kw = {"max_model_len": 128, "max_num_seqs": 3, "max_prefill_chunk": 16, **kw}
    return LLM(ckpt, dtype="float32", progress=False, speculative_config=spec, **kw)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(10, 4000, 32).tolist()
    return [rng.integers(10, 4000, n).tolist() for n in (5, 23, 40)] + [
        shared + rng.integers(10, 4000, 7).tolist(),
        shared + rng.integers(10, 4000, 3).tolist(),
    ]


def test_greedy_mtp_equals_plain_decoding(ckpt):
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    plain = _run(_llm(ckpt), _prompts(), params)
    llm = _llm(ckpt, {"method": "mtp", "num_speculative_tokens": K})
    assert _run(llm, _prompts(), params) == plain
    s = llm.engine.stats()
    assert s["spec_num_drafts"] > 20 * K  # the heads proposed, and were verified
    assert s["prefix_cache_hit_tokens"] >= 16  # the shared 32-token prefix, in 16-token units


def test_perfect_drafts_yield_k_plus_one_tokens_per_step(ckpt):
    params = SamplingParams(temperature=0.0, max_tokens=1 + 4 * (K + 1), ignore_eos=True)
    prompts = _prompts()
    plain = _run(_llm(ckpt), prompts, params)
    replay = {tuple(p): out for p, out in zip(prompts, plain, strict=True)}

    def oracle(ids: list[int], k: int) -> list[int]:
        for prompt, out in replay.items():
            if tuple(ids[: len(prompt)]) == prompt:
                return out[len(ids) - len(prompt) :][:k]
        raise AssertionError("unknown sequence")

    llm = _llm(ckpt, {"method": "oracle", "num_speculative_tokens": K, "oracle": oracle})
    assert _run(llm, prompts, params) == plain
    s = llm.engine.stats()
    # after the prefill token, 4 verifying steps per request, each accepting all K drafts
    assert s["spec_num_drafts"] == s["spec_num_accepted"] == 4 * K * len(prompts)
    assert s["spec_tokens_per_step"] == K + 1


def test_sampled_output_distribution_is_exact(ckpt):
    # top-k 4 at temperature 1: the first three output tokens take 4 x 4 x 4 values, whose
    # exact probabilities come from the model's logits (each filtered as the sampler does).
    # Drafts: the most likely next tokens (one-hot q), accepted with probability p(d).
    top_k, prompt = 4, list(range(100, 111))
    runner = _llm(ckpt).engine.runner

    def dist(seq: list[int]) -> np.ndarray:
        logits = jnp.asarray(runner.sequence_logits(seq))[-1:]
        one = jnp.ones(1)
        f = filtered_logits(logits, one, jnp.full(1, top_k), one, jnp.zeros(1))
        return np.asarray(jnp.exp(f - jnp.max(f)) / jnp.sum(jnp.exp(f - jnp.max(f))))[0]

    exact, best = {}, {}
    p1 = dist(prompt)
    for a in np.flatnonzero(p1):
        p2 = dist(prompt + [int(a)])
        best[(int(a),)] = int(np.argmax(p2))
        for b in np.flatnonzero(p2):
            p3 = dist(prompt + [int(a), int(b)])
            best[(int(a), int(b))] = int(np.argmax(p3))
            for c in np.flatnonzero(p3):
                exact[(int(a), int(b), int(c))] = p1[a] * p2[b] * p3[c]

    def oracle(ids: list[int], k: int) -> list[int]:
        out = list(ids[len(prompt) :])
        drafts = []
        while len(drafts) < k:
            key = tuple(out + drafts)
            drafts.append(best.get(key, 0))
        return drafts

    n = int(os.environ.get("MTP_CHI_SQUARE_N", 10_000))
    llm = _llm(ckpt, {"method": "oracle", "num_speculative_tokens": 2, "oracle": oracle},
               max_num_seqs=1024, max_num_batched_tokens=8192)  # fmt: skip
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True, seed=None)
    got = _run(llm, [prompt] * n, params)
    s = llm.engine.stats()
    assert 0.2 < s["spec_acceptance_rate"] < 0.9  # both branches of the verifier ran often
    cells = sorted(exact)
    counts = np.array([sum(tuple(g) == c for g in got) for c in cells], float)
    assert counts.sum() == n  # nothing outside the support
    expected = np.array([exact[c] for c in cells], np.float64)
    expected *= n / expected.sum()  # float32 probabilities: renormalise
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    if (~big).any():  # the rare cells pooled into one
        obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
    assert stats.chisquare(obs, exp).pvalue > 1e-3
