"""The MTP draft chain as one device program: k heads, each one block, the lm_head and a draw.

One call per program of an engine step (`spec_decode`, step 5), over that program's rows. Row r
has the base model's hidden states g_0 [T, D] at the step's positions (its first `n_r` valid:
the accepted ones), and a window w_r of its tokens from the step's first position on (the
`known_r` tokens the sequence holds, then room for the drafts). For head i = 0 .. k-1:
  x_i   = w[:, i + 1 : i + 1 + T]             the token i + 1 places after each position
  g_i+1 = head_i(g_i, E[x_i])                 one block; writes head i's KV at valid positions
  l_i   = lm_head(norm_o(g_i+1[r, n_r - 1]))  logits of the token after the row's last
  d_i   = argmax l_i (greedy rows), else a draw from the row's filtered distribution of l_i
          (temperature, top-k, top-p, min-p) with key fold_in(key_r, 7919 + i); q_i is that
          distribution (one-hot for greedy rows), which verification needs
  w[r, known_r + i] = d_i                     so head i + 1 reads draft i as its look-ahead
With the drafts written into the window on the device, no head waits for the host: the chain is
one dispatch, and the host reads k tokens per row once.

Re-run from the hidden-state cache. A head's KV at position t depends on the tokens up to
t + i + 1; where those were drafts, it is only a guess, wrong once a draft is rejected. Those are
the k - 1 positions before the next step's first one. So the chain keeps, per request, the base
model's hidden states g_0 of its last k - 1 computed positions (`history`: [S, k - 1, D], one
slot per request), and each row starts s_r <= k - 1 positions early (where its slot holds
them): the heads recompute those positions with the tokens now known, then the step's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridserve.layers.step_input import StepInput
from hybridserve.runner.sampler import filtered_logits

KEY_SALT = 7919  # head i draws with fold_in(row key, KEY_SALT + i)


def draw_drafts(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    keys: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Draft tokens from head logits [B, V] under each row's sampling params, and the
    distributions they were drawn from [B, V] (one-hot for greedy rows)."""
    greedy = jnp.argmax(logits, axis=-1)
    scaled = filtered_logits(logits, temperature, top_k, top_p, min_p)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled)
    hot = temperature[:, None] <= 0
    picked = jnp.where(hot[:, 0], greedy, drawn)
    q = jnp.where(hot, jax.nn.one_hot(greedy, logits.shape[-1]), jax.nn.softmax(scaled, -1))
    return picked.astype(jnp.int32), q


def with_history(
    hidden: jax.Array, history: jax.Array, read: jax.Array, shift: jax.Array
) -> jax.Array:
    """[B, m + T, D]: row r's s_r = `shift[r]` cached states (slot `read[r]` of `history`
    [S, m, D]; out of range: none) before its T states, left-aligned."""
    m = history.shape[1]
    cached = jnp.take(history, read, axis=0, mode="fill", fill_value=0)
    both = jnp.concatenate([cached.astype(hidden.dtype), hidden], axis=1)
    idx = jnp.arange(both.shape[1])[None, :] + (m - shift)[:, None]
    return jnp.take_along_axis(both, jnp.minimum(idx, both.shape[1] - 1)[..., None], axis=1)


def keep_history(
    history: jax.Array, ext: jax.Array, lengths: jax.Array, write: jax.Array
) -> jax.Array:
    """`history` with slot `write[r]` (out of range: none) set to row r's last m valid states
    of `ext` [B, m + T, D] (`lengths`: valid states per row, the early ones included)."""
    m = history.shape[1]
    idx = jnp.clip(lengths[:, None] - m + jnp.arange(m)[None, :], 0, ext.shape[1] - 1)
    last = jnp.take_along_axis(ext, idx[..., None], axis=1).astype(history.dtype)
    return history.at[write].set(last, mode="drop")


def draft_chain(
    model: object,
    regions: list[jax.Array],
    hidden: jax.Array,
    window: jax.Array,
    known: jax.Array,
    inputs: StepInput,
    sampling: tuple[jax.Array, ...] | None,
    keys: jax.Array | None,
    history: tuple[jax.Array, ...] | None,
    k: int,
) -> tuple[tuple[jax.Array, jax.Array | None, jax.Array | None], list[jax.Array]]:
    """The chain of the module docstring, traced inside the runner's jitted program.

    Args: model (a `HybridModel`); regions (the cache, replaced); hidden [B, T, D] the step's
      base states; window [B, m + T + k + 1] int32 (m = k - 1 with `history`, else 0), from each
      row's first position (s_r early); known [B] int32; inputs (positions from s_r early;
      lengths: the valid positions, the early ones included); sampling (temperature, top_k,
      top_p, min_p) [B] each, or None when every row is greedy; keys [B] PRNG keys (None with
      sampling None); history (states [S, m, D], read slots [B], shifts s [B], write slots
      [B]) or None.
    Returns ((drafts [B, k] int32, q [B, k, V] float32 or None, the new history states or
    None), regions).
    """
    kept = None
    if history is not None:
        states, read, shift, write = history
        hidden = with_history(hidden, states, read, shift)
        kept = keep_history(states, hidden, inputs.lengths, write)
    rows = jnp.arange(hidden.shape[0])
    last = jnp.maximum(inputs.lengths - 1, 0)
    span = hidden.shape[1]
    cols = jnp.arange(window.shape[1])[None, :]
    drafts, qs = [], []
    for head in range(k):
        tokens = jax.lax.dynamic_slice_in_dim(window, head + 1, span, axis=1)
        hidden, regions = model.mtp_step(head, hidden, tokens, inputs, regions)
        logits = model.mtp_logits(head, hidden[rows, last])
        if sampling is None:
            picked = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            head_keys = jax.vmap(lambda key, s=KEY_SALT + head: jax.random.fold_in(key, s))(keys)
            picked, q = draw_drafts(logits, *sampling, head_keys)
            qs.append(q)
        drafts.append(picked)
        window = jnp.where(cols == (known + head)[:, None], picked[:, None], window)
    q = jnp.stack(qs, axis=1) if qs else None
    return (jnp.stack(drafts, axis=1), q, kept), regions
