"""The sampler's filters against distributions computed by hand (numpy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridserve.runner.sampler import logprobs, sample

PROBS = np.array([0.5, 0.3, 0.15, 0.05])
N = 4000


def _draw(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0) -> np.ndarray:
    logits = jnp.tile(jnp.log(jnp.asarray(PROBS, jnp.float32)), (N, 1))
    keys = jax.random.split(jax.random.key(0), N)
    full = lambda v, dt: jnp.full((N,), v, dt)
    out = sample(
        logits,
        full(temperature, jnp.float32),
        full(top_k, jnp.int32),
        full(top_p, jnp.float32),
        full(min_p, jnp.float32),
        keys,
    )
    return np.bincount(np.asarray(out), minlength=4) / N


@pytest.mark.parametrize(
    "kwargs,kept",
    [
        ({}, [0, 1, 2, 3]),
        ({"top_k": 3}, [0, 1, 2]),
        ({"top_p": 0.7}, [0, 1]),
        ({"min_p": 0.35}, [0, 1]),
        ({"top_k": 3, "top_p": 0.9}, [0, 1, 2]),
    ],
)
def test_filters_keep_the_right_tokens_with_renormalised_mass(kwargs, kept):
    freq = _draw(**kwargs)
    want = np.zeros(4)
    want[kept] = PROBS[kept] / PROBS[kept].sum()
    np.testing.assert_allclose(freq, want, atol=0.03)


def test_temperature_sharpens_and_zero_is_greedy():
    sharp = PROBS**2 / (PROBS**2).sum()  # temperature 0.5
    np.testing.assert_allclose(_draw(temperature=0.5), sharp, atol=0.03)
    np.testing.assert_array_equal(_draw(temperature=0.0), [1, 0, 0, 0])


def test_logprobs_match_log_softmax():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 10)).astype(np.float32)
    tokens = np.array([4, 0, 9])
    chosen, top_ids, top_lp, rank = logprobs(jnp.asarray(logits), jnp.asarray(tokens), 3)
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(chosen), ref[np.arange(3), tokens], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(top_ids), np.argsort(-ref, axis=-1)[:, :3])
    np.testing.assert_allclose(np.asarray(top_lp), np.sort(ref, -1)[:, ::-1][:, :3], atol=1e-5)
    want_rank = 1 + (ref > ref[np.arange(3), tokens][:, None]).sum(-1)  # 1: the most likely
    np.testing.assert_array_equal(np.asarray(rank), want_rank)
