"""Draft verification: greedy matching, and rejection sampling checked for exactness with a
chi-square test against a toy Markov chain's exact sequence probabilities (the target p and the
draft q differ and depend on the previous token; 12,000 sequences of 3 tokens, 125 outcomes)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from hybridserve.runner.speculative import verify, verify_greedy

V, K = 5, 2


def _params(bsz: int, temperature: float):
    t = jnp.full((bsz,), temperature, jnp.float32)
    return t, jnp.zeros((bsz,), jnp.int32), jnp.ones((bsz,), jnp.float32), jnp.zeros((bsz,))


def test_greedy_accepts_the_matching_prefix_then_the_argmax():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((4, K + 1, V)), jnp.float32)
    best = np.asarray(jnp.argmax(logits, -1))
    drafts = best[:, :K].copy()
    drafts[1, 1] = (drafts[1, 1] + 1) % V  # row 1: second draft wrong
    drafts[2, 0] = (drafts[2, 0] + 1) % V  # row 2: first draft wrong
    num = jnp.asarray([K, K, K, 1], jnp.int32)  # row 3: one draft only
    q = jnp.full((4, K, V), 1.0 / V)
    keys = jax.random.split(jax.random.key(0), 4)
    tokens, emitted = verify(jnp.asarray(drafts), q, num, logits, *_params(4, 0.0), keys)
    tokens, emitted = np.asarray(tokens), np.asarray(emitted)
    assert emitted.tolist() == [K + 1, 2, 1, 2]
    assert tokens[0].tolist() == best[0].tolist()  # perfect drafts: k + 1 tokens
    assert tokens[1].tolist() == [drafts[1, 0], best[1, 1], -1]
    assert tokens[2].tolist() == [best[2, 0], -1, -1]
    assert tokens[3].tolist() == [drafts[3, 0], best[3, 1], -1]


def _chain(seed: int, sharp: float) -> np.ndarray:
    """Row-stochastic [V + 1, V]: the next token's distribution given the previous one (row V:
    the start)."""
    w = np.exp(sharp * np.random.default_rng(seed).standard_normal((V + 1, V)))
    return w / w.sum(1, keepdims=True)


def _speculative_sequences(p: np.ndarray, q: np.ndarray, n: int, length: int, seed: int):
    rng = np.random.default_rng(seed)
    seqs = [[] for _ in range(n)]
    key = jax.random.key(seed)
    while min(map(len, seqs)) < length:
        last = np.array([s[-1] if s else V for s in seqs])
        d0 = np.array([rng.choice(V, p=q[c]) for c in last])
        d1 = np.array([rng.choice(V, p=q[c]) for c in d0])
        drafts = np.stack([d0, d1], 1)
        q_probs = np.stack([q[last], q[d0]], 1)
        target = np.log(np.stack([p[last], p[d0], p[d1]], 1))
        key, sub = jax.random.split(key)
        tokens, emitted = verify(
            jnp.asarray(drafts, jnp.int32), jnp.asarray(q_probs, jnp.float32),
            jnp.full((n,), K, jnp.int32), jnp.asarray(target, jnp.float32),
            *_params(n, 1.0), jax.random.split(sub, n),
        )  # fmt: skip
        for s, toks, m in zip(seqs, np.asarray(tokens), np.asarray(emitted), strict=True):
            s.extend(toks[:m].tolist())
    return [tuple(s[:length]) for s in seqs]


def test_rejection_sampling_reproduces_the_target_distribution():
    p, q = _chain(1, 1.0), _chain(2, 1.5)  # the draft is a different, sharper chain
    n, length = 12_000, 3
    seqs = _speculative_sequences(p, q, n, length, seed=3)
    outcomes = list(itertools.product(range(V), repeat=length))
    index = {o: i for i, o in enumerate(outcomes)}
    counts = np.bincount([index[s] for s in seqs], minlength=len(outcomes))
    exact = np.array([p[V, a] * p[a, b] * p[b, c] for a, b, c in outcomes])
    # Merge rare outcomes (expected count < 5) into one bin, as the test requires.
    rare = exact * n < 5
    obs = np.append(counts[~rare], counts[rare].sum())
    exp = np.append(exact[~rare], exact[rare].sum()) * n
    result = stats.chisquare(obs, exp)
    assert result.pvalue > 1e-3, result
    # Not vacuous: the draft chain's own distribution is rejected by the same test.
    draft_exact = np.array([q[V, a] * q[a, b] * q[b, c] for a, b, c in outcomes])
    draft_exp = np.append(draft_exact[~rare], draft_exact[rare].sum()) * n
    assert stats.chisquare(obs, draft_exp * exp.sum() / draft_exp.sum()).pvalue < 1e-6


def test_perfect_drafts_are_all_accepted():
    p = _chain(4, 1.0)
    n = 2000
    rng = np.random.default_rng(5)
    last = rng.integers(0, V, n)
    d0 = np.array([rng.choice(V, p=p[c]) for c in last])
    d1 = np.array([rng.choice(V, p=p[c]) for c in d0])
    tokens, emitted = verify(
        jnp.asarray(np.stack([d0, d1], 1), jnp.int32),
        jnp.asarray(np.stack([p[last], p[d0]], 1), jnp.float32),
        jnp.full((n,), K, jnp.int32),
        jnp.asarray(np.log(np.stack([p[last], p[d0], p[d1]], 1)), jnp.float32),
        *_params(n, 1.0), jax.random.split(jax.random.key(6), n),
    )  # fmt: skip
    assert (np.asarray(emitted) == K + 1).all()
    np.testing.assert_array_equal(np.asarray(tokens)[:, :K], np.stack([d0, d1], 1))


def test_greedy_only_verification_equals_the_general_one():
    # verify_greedy (no sorting, no distributions) against verify with temperature 0, on
    # random logits with drafts that match the argmax for a random number of leading places.
    rng = np.random.default_rng(9)
    bsz, k, vocab = 16, 4, 50
    logits = jnp.asarray(rng.normal(size=(bsz, k + 1, vocab)), jnp.float32)
    best = np.asarray(jnp.argmax(logits, -1))
    drafts = rng.integers(0, vocab, (bsz, k))
    for b in range(bsz):
        m = rng.integers(0, k + 1)
        drafts[b, :m] = best[b, :m]
    drafts = jnp.asarray(drafts, jnp.int32)
    num = jnp.asarray(rng.integers(0, k + 1, bsz), jnp.int32)
    keys = jax.random.split(jax.random.key(1), bsz)
    want = verify(drafts, jnp.zeros((bsz, k, vocab)), num, logits, *_params(bsz, 0.0), keys)
    got = verify_greedy(drafts, num, logits)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert len(set(np.asarray(got[1]).tolist())) > 2  # several acceptance lengths occurred
