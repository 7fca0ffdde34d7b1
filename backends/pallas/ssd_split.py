"""The Mamba2 scan of a few long sequences, cut into pieces scanned side by side.

The one-pass scan (`backends.pallas.ssd`) runs one program per (row, head, slice of P), each
walking its row's chunks in order. With one row of 16k tokens and 128 heads that is 128
programs of 256 sequential chunks each: fewer programs than an H200 has SMs, each bound by its
own chain of chunk steps. `mamba2_scan_split` cuts every sequence into `pieces` rows of equal
length (the last padded with dt = 0, x = 0, which carries the state through unchanged) and scans
them as one batch of rows: row 0 of a sequence from its start state, the others from zeros.
The rows are then joined as packed prefill joins its rows (`backends.ssd_rows`): the state
entering each piece is the chain of the pieces before it (one masked-decay matmul a head), and
each piece's outputs gain `exp(cum_t) (h . c_t)`. The result equals the unsplit scan up to
rounding; the extra work is one pass over y and the [pieces, heads, P, N] states.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from backends.pallas.ssd import mamba2_scan
from backends.ssd_rows import join_rows

F32 = jnp.float32


def mamba2_scan_split(
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
    initial_state: jax.Array,
    chunk_size: int,
    pieces: int,
) -> tuple[jax.Array, jax.Array]:
    """`mamba2_scan` (x [B, T, H, P], dt [B, T, H], a [H], b / c [B, T, G, N], D [H],
    initial_state [B, H, P, N] float32 -> y [B, T, H, P], final state) with every sequence
    cut into `pieces` rows scanned side by side (see the module docstring)."""
    bsz, t, nh, p = x.shape
    if pieces <= 1 or t < 2 * pieces:
        return mamba2_scan(x, dt, a, b, c, d, initial_state, chunk_size)
    length = -(-t // pieces)
    pad = pieces * length - t

    def rows(z: jax.Array) -> jax.Array:  # [B, T, ...] -> [B * pieces, length, ...]
        z = jnp.pad(z, [(0, 0), (0, pad)] + [(0, 0)] * (z.ndim - 2))
        return z.reshape(bsz * pieces, length, *z.shape[2:])

    xs, dts, bs, cs = rows(x), rows(dt), rows(b), rows(c)
    first = jnp.arange(bsz * pieces) % pieces == 0  # the first piece of each sequence
    start = jnp.repeat(initial_state.astype(F32), pieces, axis=0)
    start = jnp.where(first[:, None, None, None], start, 0.0)
    y, final = mamba2_scan(xs, dts, a, bs, cs, d, start, chunk_size)
    y, ends = join_rows(y, final, dts, a, cs, (~first).astype(jnp.int32))
    y = y.reshape(bsz, pieces * length, nh, p)[:, :t]
    return y, ends.reshape(bsz, pieces, *ends.shape[1:])[:, -1]
