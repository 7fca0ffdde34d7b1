"""Mamba2 scans over rows that continue each other, joined afterwards (backend-independent
maths, plain jax).

A sequence cut into rows of T tokens (packed prefill's rows, `hybridserve.layers.mamba2_chain`,
or one long sequence cut to scan its pieces side by side, `backends.pallas.ssd_split`) is
scanned row by row as if each row were a sequence: a first row from its own start state, a
continuing row from zeros, giving y'_t and the row's final state f_i. With `cum_t` the inclusive
cumulative sum of `dt a` over the row and `g_i = exp(cum_T)`, the state entering row i and the
state it ends with are

    h_i = e_{i-1} if continues[i] else 0,      e_i = f_i + g_i h_i     (per head)

(`chain_states`), and a continuing row's outputs gain the inflow its zero start left out
(`add_inflow`; `join_rows` does both from a scan's outputs):

    y_t = y'_t + exp(cum_t) (h_i . c_t).

This is the chunked scan's own carry (`backends.xla.ssd`), with rows as chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


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


def join_rows(
    y: jax.Array,
    final: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    c: jax.Array,
    continues: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The rows of one scan joined: `y` [B, T, Hs, P] and `final` [B, Hs, P, Ns] as each row
    left them (continuing rows from zeros), with the row's dt [B, T, Hs], a [Hs], c [B, T, G, Ns]
    and `continues` [B] -> (y with the inflow added, e: the state each row ends with)."""
    cum = jnp.cumsum(dt.astype(F32) * a.astype(F32), axis=1)  # [B, T, Hs]
    inflow, ends = chain_states(final, cum[:, -1], continues)
    return add_inflow(y, c, cum, inflow), ends
