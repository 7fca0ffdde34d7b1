"""Verifying draft tokens in one forward pass: greedy matching and rejection sampling.

A step proposes up to k draft tokens `d_0 .. d_{n-1}` (n <= k per row) from a draft
distribution q (the MTP heads); the base model scores the row's last token and the n drafts in
one pass, giving target distributions `p_0 .. p_n` (p_i: the distribution of the token after
d_{i-1}, as `sample` would draw it: temperature, top-k, top-p and min-p applied).

Rejection sampling (exact: the emitted tokens are distributed as sampling from p one token at
a time, whatever q is): for i = 0 .. n-1, accept d_i with probability `min(1, p_i(d_i) /
q_i(d_i))`; at the first rejection i, emit a token drawn from the residual
`max(0, p_i - q_i) / sum(max(0, p_i - q_i))` and stop; if all n are accepted, emit a bonus token
drawn from p_n. Greedy rows (temperature 0) accept d_i while it is p_i's argmax and emit the
argmax at the first mismatch (or after the last draft). Either way a step emits between 1 and
n + 1 tokens: the accepted drafts, then one more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridserve.runner.sampler import filtered_logits


@jax.jit
def verify_greedy(
    drafts: jax.Array, num_drafts: jax.Array, target_logits: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`verify` when every row is greedy (no distributions needed, no sorting): the drafts
    that equal the target's argmax, then the argmax at the first mismatch or after the last."""
    k = drafts.shape[1]
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k + 1]
    ok = (drafts == best[:, :k]) & (jnp.arange(k)[None, :] < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    pos = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    extra = jnp.take_along_axis(best, accepted[:, None], axis=1)
    tokens = jnp.where(pos < accepted[:, None], padded, -1)
    tokens = jnp.where(pos == accepted[:, None], extra, tokens)
    return tokens.astype(jnp.int32), accepted + 1


@jax.jit
def verify(
    drafts: jax.Array,
    draft_probs: jax.Array,
    num_drafts: jax.Array,
    target_logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    keys: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Accept or reject each row's drafts (see the module docstring).

    Args:
      drafts: [B, k] int32 draft tokens (entries past `num_drafts` are ignored).
      draft_probs: [B, k, V] q_i, the distribution each draft was drawn from (ignored for
        greedy rows).
      num_drafts: [B] int32 in [0, k].
      target_logits: [B, k + 1, V] the base model's logits after the last token and each draft.
      temperature, top_k, top_p, min_p: [B] sampling parameters (as in `sample`).
      keys: [B] PRNG keys.
    Returns: tokens [B, k + 1] int32 (the emitted tokens first, then -1) and the number emitted
    per row [B] int32 (1 .. num_drafts + 1).
    """
    bsz, k = drafts.shape
    vocab = target_logits.shape[-1]
    per_pos = lambda a: jnp.repeat(a, k + 1, axis=0)  # noqa: E731  ([B] -> [B * (k+1)])
    flat = filtered_logits(
        target_logits.reshape(bsz * (k + 1), vocab),
        per_pos(temperature),
        per_pos(top_k),
        per_pos(top_p),
        per_pos(min_p),
    )
    p = jax.nn.softmax(flat, axis=-1).reshape(bsz, k + 1, vocab)
    greedy_tok = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k + 1]
    live = jnp.arange(k)[None, :] < num_drafts[:, None]  # [B, k]
    u_key, draw_key = jax.vmap(jax.random.split, out_axes=1)(keys)

    p_d = jnp.take_along_axis(p[:, :k], drafts[:, :, None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs, drafts[:, :, None], axis=-1)[..., 0]
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(u_key)
    sampled_ok = u * q_d < p_d  # u < p / q without dividing (q_d > 0 for a drawn draft)
    greedy = temperature <= 0
    ok = jnp.where(greedy[:, None], drafts == greedy_tok[:, :k], sampled_ok) & live
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # leading accepts

    # The extra token: the residual at the first rejection, or p_n after all n drafts.
    p_a = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
    q_a = jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0]
    rejected = accepted < num_drafts
    residual = jnp.where(rejected[:, None], jnp.maximum(p_a - q_a, 0.0), p_a)
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_a)
    drawn = jax.vmap(jax.random.categorical)(draw_key, jnp.log(residual)).astype(jnp.int32)
    extra = jnp.where(greedy, jnp.take_along_axis(greedy_tok, accepted[:, None], 1)[:, 0], drawn)

    pos = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    tokens = jnp.where(pos < accepted[:, None], padded, -1)
    tokens = jnp.where(pos == accepted[:, None], extra[:, None], tokens)
    return tokens.astype(jnp.int32), accepted + 1
