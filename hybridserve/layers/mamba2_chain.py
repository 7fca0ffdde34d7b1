"""Mamba2 over packed prefill rows: the states carried from row to row of one sequence.

A packed prefill step (`runner.packed`) cuts a long chunk into rows of T tokens; row i goes on
from row i - 1 when `continues[i]` (then row i - 1 is full). Each row is convolved and scanned
on its own, as if it were a sequence, from a start state of its own, and then joined:

  conv:   the W-1 inputs before a continuing row are the last W-1 raw inputs of the row before
          (`carry_conv`), instead of the cached conv state.
  scan:   a continuing row is scanned from zeros, giving y'_t and the final state f_i. With
          `cum_t` the inclusive cumulative sum of `dt a` over the row and `g_i = exp(cum_T)`,
          the state entering row i and the state it ends with are
            h_i = e_{i-1} if continues[i] else 0,      e_i = f_i + g_i h_i     (per head)
          (a first row was scanned from its cached state: h_i = 0 and e_i = f_i), and its
          outputs gain the inflow the zero start left out (`add_inflow`):
            y_t = y'_t + exp(cum_t) (h_i . c_t).
          This is the chunked scan's own carry (`backends.xla.ssd`), with rows as chunks;
          `chain_states` and `add_inflow` (both: `join_rows`) live in `backends.ssd_rows`
          (the split scan of one long sequence uses them too).
  store:  only the last row of a sequence (`StepInput.last`) writes the state page; the others
          write to the null page, whose rows are dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def carry_conv(raw: jax.Array, state: jax.Array, continues: jax.Array) -> jax.Array:
    """The conv state entering each row: `state` [B, C, W-1] (channel-major, from the cache)
    for first rows, the previous row's last W-1 raw inputs `raw` [B, T, C] for continuing ones
    (`continues` [B] int32)."""
    keep = state.shape[-1]
    tail = jnp.swapaxes(raw[:, raw.shape[1] - keep :], 1, 2)  # [B, C, W-1]
    before = jnp.concatenate([tail[:1], tail[:-1]], axis=0)  # row b: row b - 1's tail
    return jnp.where(continues[:, None, None] > 0, before.astype(state.dtype), state)
