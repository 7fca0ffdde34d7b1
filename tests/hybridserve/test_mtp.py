"""Speculative decoding with MTP heads through the engine (tiny Inkling with 8 heads, 3 of them
drafting; all 8 drafting, on heads that predict the model: test_mtp_trained).

- Greedy: the speculative output equals plain greedy decoding token for token (continuous
  batching, chunked prefill, prefix-cache hits), with the real heads proposing (random
  weights: most drafts are rejected, so the rollback path runs constantly). The plain
  reference is greedy decoding from one-pass logits of the whole sequence (no paged decode, no
  batching; the engine's plain decoding equals it, test_inkling_engine).
- Perfect drafts (an oracle replaying the plain greedy run): every verifying step emits k + 1.
- Sampling: the joint distribution of the first three output tokens matches the exact one
  computed from the model's logits (chi-square), with oracle drafts that are often accepted
  and often rejected: through the engine with as many requests as a power calculation asks for
  to catch the classic fault of rejection sampling (at a rejection, drawing from p instead of
  the residual) with probability 0.99; and over 20,000 sequences with `verify` called directly
  in batches, as the engine calls it (the engine not under test), which catches a tenth of that
  fault. The same test with the 8 real heads drafting is `test_mtp_trained`'s.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chi_square import p_value, sample_size
from engine_shapes import pool_of

from hybridserve import LLM, SamplingParams
from hybridserve.config import MtpConfig
from hybridserve.runner.sampler import filtered_logits
from hybridserve.runner.speculative import verify
from tests.hybridserve.inkling_models import (
    build_inkling,
    one_pass_greedy,
    save_inkling,
    tiny_inkling,
)

K = 3
HEADS = 8  # the model's heads: K of them draft
# Three seats (five prompts queue), chunks of 16 tokens; every engine of the module keeps the
# pool of these settings, so the programs of its rows carry from engine to engine.
SETTINGS = dict(dtype="float32", max_model_len=128, max_num_seqs=3, max_prefill_chunk=16)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    cfg = dataclasses.replace(tiny_inkling(), mtp=MtpConfig(num_heads=HEADS))
    return save_inkling(build_inkling(cfg, seed=4), cfg, tmp_path_factory.mktemp("mtp") / "m")


def _llm(ckpt: str, spec: dict | None = None, **kw) -> LLM:
    return LLM(ckpt, **{**SETTINGS, **kw}, progress=False, speculative_config=spec)


@pytest.fixture(scope="module")
def reference(ckpt) -> LLM:
    """A plain engine, for its runner's one-pass logits (the module's references)."""
    return _llm(ckpt)


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


PLAIN_TOKENS = 1 + 4 * (K + 1)  # the prefill token, then four steps of k + 1


@pytest.fixture(scope="module")
def plain(reference) -> list[list[int]]:
    """The plain greedy continuations of `_prompts()`, PLAIN_TOKENS each, from one-pass logits
    (a shorter run is their prefix)."""
    return [one_pass_greedy(reference.engine.runner, p, PLAIN_TOKENS) for p in _prompts()]


def test_greedy_mtp_equals_plain_decoding(ckpt, plain):
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    llm = _llm(ckpt, {"method": "mtp", "num_speculative_tokens": K})
    assert _run(llm, _prompts(), params) == [out[:14] for out in plain]
    s = llm.engine.stats()
    assert s["spec_num_drafts"] > 20 * K  # the heads proposed, and were verified
    assert s["prefix_cache_hit_tokens"] >= 16  # the shared 32-token prefix, in 16-token units


def test_perfect_drafts_yield_k_plus_one_tokens_per_step(ckpt, plain):
    params = SamplingParams(temperature=0.0, max_tokens=PLAIN_TOKENS, ignore_eos=True)
    prompts = _prompts()
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


def _recorded(llm: LLM) -> list[tuple[tuple[int, ...], list[int]]]:
    """Every draft list the engine proposes, with the tokens its request held then."""
    seen, runner = [], llm.engine.runner
    propose = runner.spec.propose

    def record(states, rooms):
        drafts = propose(states, rooms)
        seen.extend((tuple(states[r].token_ids), d) for r, d in drafts.items() if d)
        return drafts

    runner.spec.propose = record
    return seen


def test_drafts_after_rejections_equal_drafts_computed_afresh(ckpt):
    """The heads' caches hold no guesses once the tokens are known: after rejected drafts,
    each proposal equals the one a fresh engine makes from the same tokens (its prefill
    computes every head position with the true look-ahead tokens). Without the re-run of the
    last k - 1 positions from the kept hidden states, the heads attend to entries computed with
    rejected drafts: then only about half of these proposals matched (10 of 26 in full)."""
    spec = {"method": "mtp", "num_speculative_tokens": K}
    llm = _llm(ckpt, spec)
    seen = _recorded(llm)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = _prompts()[1:3]
    outs = _run(llm, prompts, params)
    assert llm.engine.stats()["spec_acceptance_rate"] < 0.9  # drafts were rejected
    # no prefix cache there: a hit would reuse head entries a run of other tokens guessed
    fresh = _llm(ckpt, spec, enable_prefix_caching=False)
    fresh_seen = _recorded(fresh)
    later = [(ids, d) for ids, d in seen if len(ids) > min(map(len, prompts)) + 2]
    assert len(later) >= 6 and outs
    for ids, drafts in later:
        fresh_seen.clear()
        first = SamplingParams(temperature=0.0, max_tokens=K + 2, ignore_eos=True)
        _run(fresh, [list(ids[:-1])], first)  # prefill, then the same last token sampled
        (fresh_ids, fresh_drafts) = fresh_seen[0]  # as many drafts as there is room for
        assert (fresh_ids, fresh_drafts[: len(drafts)]) == (ids, drafts), len(ids)


@dataclasses.dataclass(frozen=True)
class Chain:
    """The first three output tokens after `PROMPT` at temperature 1 with top-k `TOP_K`, of
    requests of four tokens drafted by an oracle: the model's raw logits after each prefix in
    the support, the exact joint probabilities of the 64 outcomes, and the drafts (each
    prefix's most likely next token, one-hot q).

    The engine drafts min(k, max_tokens - n_out - 1) tokens: after the first token (the
    prefill's, never drafted) two drafts for the second and third; after a rejection at the
    second, one draft for the third. Every token the cells count is a drafted one but the
    first; the fourth (a bonus token or a residual draw) is not counted."""

    logits: dict[tuple[int, ...], np.ndarray]  # prefix (output tokens so far) -> [V] logits
    probs: dict[tuple[int, ...], np.ndarray]  # prefix -> [V] the filtered distribution
    best: dict[tuple[int, ...], int]  # prefix -> the oracle's draft after it

    @property
    def cells(self) -> list[tuple[int, int, int]]:
        first = np.flatnonzero(self.probs[()])
        return [
            (int(a), int(b), int(c))
            for a in first
            for b in np.flatnonzero(self.probs[(int(a),)])
            for c in np.flatnonzero(self.probs[(int(a), int(b))])
        ]

    def exact(self) -> np.ndarray:
        """P(a, b, c) of every cell: sampling one token at a time."""
        p = self.probs
        return np.array([p[()][a] * p[(a,)][b] * p[(a, b)][c] for a, b, c in self.cells])

    def resampling_fault(self) -> np.ndarray:
        """P(a, b, c) of a verifier that, at a rejected draft d, draws from p instead of the
        residual: P(x) = p(d) [x = d] + (1 - p(d)) p(x) at the drafted positions b and c."""

        def faulty(prefix: tuple[int, ...], x: int) -> float:
            p, d = self.probs[prefix], self.best[prefix]
            return p[d] * (x == d) + (1 - p[d]) * p[x]

        return np.array(
            [self.probs[()][a] * faulty((a,), b) * faulty((a, b), c) for a, b, c in self.cells]
        )

    def oracle(self, ids: list[int], k: int) -> list[int]:
        """The drafts after `ids` (the prompt and the output so far)."""
        out, drafts = list(ids[len(PROMPT) :]), []
        while len(drafts) < k:
            drafts.append(self.best.get(tuple(out + drafts), 0))
        return drafts


TOP_K, PROMPT, ALPHA, MAX_TOKENS = 4, list(range(100, 111)), 1e-3, 4


@pytest.fixture(scope="module")
def chain(reference) -> Chain:
    runner = reference.engine.runner
    logits, probs, best = {}, {}, {}
    one = jnp.ones(1)

    def visit(prefix: tuple[int, ...]) -> None:
        row = jnp.asarray(runner.sequence_logits(PROMPT + list(prefix)))[-1:]
        f = filtered_logits(row, one, jnp.full(1, TOP_K), one, jnp.zeros(1))
        logits[prefix] = np.asarray(row[0])
        probs[prefix] = np.asarray(jax.nn.softmax(f, axis=-1)[0], np.float64)
        best[prefix] = int(np.argmax(probs[prefix]))
        if len(prefix) < 2:
            for t in np.flatnonzero(probs[prefix]):
                visit((*prefix, int(t)))

    visit(())
    return Chain(logits, probs, best)


def _counts(chain: Chain, outputs: list[tuple[int, ...]]) -> np.ndarray:
    index = {c: i for i, c in enumerate(chain.cells)}
    assert all(o in index for o in outputs)  # nothing outside the support
    return np.bincount([index[o] for o in outputs], minlength=len(index)).astype(float)


def test_sampled_output_distribution_is_exact(chain, ckpt):
    """Through the engine (drafts, verification, rollback, per-request keys), with the sample
    size a power calculation gives for catching `Chain.resampling_fault` at ALPHA with
    probability 0.99 (a few hundred requests on this model). Grosser faults, such as accepting
    every draft or sharing one key between requests, show with fewer; smaller ones are the
    direct test's below (20,000 sequences), and the real heads' drafts are
    `test_mtp_trained`'s. Eight seats on the three-seat pool: the rows of up to four are the
    perfect-drafts test's programs."""
    exact = chain.exact()
    fault = chain.resampling_fault()
    n = sample_size(exact, fault, ALPHA, 0.99)
    assert n <= 600, f"the power calculation asks for {n} requests"
    spec = {"method": "oracle", "num_speculative_tokens": K, "oracle": chain.oracle}
    llm = _llm(ckpt, spec, max_num_seqs=8, cache=pool_of(ckpt, SETTINGS))
    params = SamplingParams(
        temperature=1.0, top_k=TOP_K, max_tokens=MAX_TOKENS, ignore_eos=True, seed=None
    )
    got = _run(llm, [PROMPT] * n, params)
    s = llm.engine.stats()
    assert 0.2 < s["spec_acceptance_rate"] < 0.9  # both branches of the verifier ran often
    counts = _counts(chain, [tuple(g[:3]) for g in got])
    assert counts.sum() == n
    assert p_value(counts, exact) > ALPHA
    assert p_value(counts, fault) < ALPHA  # these draws do tell the fault apart


def _verify_rows(chain, prefixes, num) -> tuple[np.ndarray, np.ndarray, jax.Array, np.ndarray]:
    """The inputs of `verify` for rows that draft `num` tokens after their prefix (one-hot q;
    the slots past the drafts hold copies, which `verify` ignores), on the vocabulary the
    supports span (top-k over it is top-k over the full vocabulary: it holds every token of
    every support). Returns (drafts, target logits, q), drafts in that vocabulary's ids."""
    vocab = sorted({0, *itertools.chain(*(np.flatnonzero(p) for p in chain.probs.values()))})
    col = {t: i for i, t in enumerate(vocab)}
    sub = {k: v[vocab] for k, v in chain.logits.items()}
    drafts = np.array([chain.oracle(PROMPT + list(p), 2) for p in prefixes])
    rows = zip(prefixes, drafts, strict=True)
    target = np.stack([np.stack([sub[p], sub.get((*p, d[0]), sub[p]), sub[p]]) for p, d in rows])
    local = np.vectorize(col.get)(drafts).astype(np.int32)
    q = jax.nn.one_hot(local, len(vocab)) * (np.arange(2)[None, :] < num[:, None])[..., None]
    return local, target, q, np.asarray(vocab)


def test_rejection_sampling_on_the_models_distributions_is_exact(chain):
    """The engine's verification steps (see `Chain`) replayed in batches with `verify` itself:
    20,000 sequences, the first token drawn from p, then steps of min(2, MAX_TOKENS - n_out -
    1) oracle drafts until three tokens are out. At this size the check catches a tenth of
    `Chain.resampling_fault` with probability 0.99 (the engine test, all of it)."""
    n = 20_000
    exact = chain.exact()
    weak = 0.9 * exact + 0.1 * chain.resampling_fault()
    assert sample_size(exact, weak, ALPHA, 0.99) <= n
    key = jax.random.key(11)
    p1 = chain.probs[()]
    first = jax.random.choice(key, len(p1), (n,), p=jnp.asarray(p1 / p1.sum()))
    outs = [(int(a),) for a in np.asarray(first)]
    step = 0
    while live := [i for i, o in enumerate(outs) if len(o) < 3]:
        prefixes = [outs[i] for i in live]
        num = np.array([min(2, MAX_TOKENS - len(p) - 1) for p in prefixes], np.int32)
        drafts, target, q, vocab = _verify_rows(chain, prefixes, num)
        m = len(live)
        tokens, emitted = verify(
            jnp.asarray(drafts), jnp.asarray(q, jnp.float32), jnp.asarray(num),
            jnp.asarray(target), jnp.ones(m), jnp.full((m,), TOP_K, jnp.int32), jnp.ones(m),
            jnp.zeros(m), jax.random.split(jax.random.fold_in(key, step), m),
        )  # fmt: skip
        for i, toks, e in zip(live, np.asarray(tokens), np.asarray(emitted), strict=True):
            outs[i] = (*outs[i], *vocab[toks[:e]].tolist())[:3]
        step += 1
    assert step == 2  # a step of two drafts, then one of one draft for the rows it rejected
    counts = _counts(chain, outs)
    assert p_value(counts, exact) > ALPHA
    assert p_value(counts, weak) < ALPHA
