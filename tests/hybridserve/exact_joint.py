"""The exact distribution of a model's first output tokens under top-k sampling at temperature
1, from its one-pass logits: the reference of the speculative chi-square tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hybridserve.runner.sampler import filtered_logits


def next_token_probs(runner, ids: list[int], top_k: int) -> np.ndarray:
    """[V] float64: the distribution of the token after `ids` at temperature 1, top-k `top_k`,
    from `runner.sequence_logits` (no paged decode, no batching)."""
    one = jnp.ones(1)
    row = jnp.asarray(runner.sequence_logits(list(ids)))[-1:]
    f = filtered_logits(row, one, jnp.full(1, top_k), one, jnp.zeros(1))
    return np.asarray(jax.nn.softmax(f, axis=-1)[0], np.float64)


def exact_joint(runner, prompt: list[int], n: int, top_k: int) -> dict[tuple[int, ...], float]:
    """P(x_1 .. x_n) of every n-token continuation of `prompt` in the support, sampling one
    token at a time (`next_token_probs`)."""
    joint: dict[tuple[int, ...], float] = {}

    def visit(prefix: tuple[int, ...], prob: float) -> None:
        p = next_token_probs(runner, prompt + list(prefix), top_k)
        for t in map(int, np.flatnonzero(p)):
            if len(prefix) + 1 == n:
                joint[(*prefix, t)] = prob * p[t]
            else:
                visit((*prefix, t), prob * p[t])

    visit((), 1.0)
    return joint
