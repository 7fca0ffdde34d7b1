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
          This is the chunked scan's own carry (`backends.xla.ssd`), with rows as chunks.
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


def chain_states(
    final: jax.Array, log_decay: jax.Array, continues: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(h, e) of the module docstring, both [B, Hs, P, Ns] float32, from each row's own final
    state `final` [B, Hs, P, Ns], its log total decay `log_decay` [B, Hs] (= cum_T = log g) and
    `continues` [B].

    The recurrence e_i = f_i + g_i c_i e_{i-1} (c_i = continues[i]) unrolls to one matrix per
    head, e_i = sum_{j <= i} L_ij f_j with L_ij = exp(cum_{j+1} + ... + cum_i) when rows j..i
    are one sequence (no first row among j + 1..i) and 0 otherwise: one batched matmul a layer
    instead of a sequential loop over rows (B is at most a program's rows, 64 by default). The
    exponent is summed from the masked terms (no difference of prefix sums, no cancellation),
    and the matmul runs at full float32 precision."""
    rows = final.shape[0]
    seq = jnp.cumsum(continues <= 0)  # [B] the sequence of each row, counted from its first
    later = jnp.arange(rows)[:, None] > jnp.arange(rows)[None, :]  # [k, j]: k > j
    terms = jnp.where(later[None], log_decay.T.astype(F32)[:, :, None], 0.0)  # [Hs, k, j]
    exponent = jnp.cumsum(terms, axis=1)  # [Hs, i, j] = sum over j < k <= i
    joined = (seq[:, None] == seq[None, :]) & ~later.T  # [i, j]: j <= i, one sequence
    weights = jnp.where(joined[None], jnp.exp(exponent), 0.0)
    ends = jnp.einsum(
        "hij,jhpn->ihpn", weights, final.astype(F32), precision=jax.lax.Precision.HIGHEST
    )
    before = jnp.concatenate([jnp.zeros_like(ends[:1]), ends[:-1]], axis=0)
    inflow = jnp.where(continues[:, None, None, None] > 0, before, 0.0)
    return inflow, ends


def add_inflow(y: jax.Array, c: jax.Array, cum: jax.Array, inflow: jax.Array) -> jax.Array:
    """`y + exp(cum) (inflow . c)` per head: y [B, T, Hs, P], c [B, T, G, Ns] (head h reads
    group h // (Hs / G)), cum [B, T, Hs], inflow [B, Hs, P, Ns]; in y's dtype."""
    b, t, heads, p = y.shape
    groups = c.shape[2]
    per_group = inflow.reshape(b, groups, heads // groups, p, -1)
    term = jnp.einsum("btgn,bgrpn->btgrp", c.astype(F32), per_group).reshape(b, t, heads, p)
    return (y.astype(F32) + jnp.exp(cum)[..., None] * term).astype(y.dtype)
