"""Sconv-aware tensor parallelism: a row-parallel projection followed by a short conv.

`y = sconv(h W)`, with h [B, T, F] and W [F, D] split over F across tp devices (the attention
output and MoE output projections), and the sconv (causal depthwise, one filter per channel of
D) carrying a state [B, D, W-1]. Instead of all-reducing the partial products `h_r W_r` and
running the conv on every device over all D channels (each device storing the whole state),
each device
  1. computes its partial product `h_r W_r` [B, T, D],
  2. reduce-scatters it over D: device r receives the full sums of channel slice r [B, T, D/tp],
  3. runs the sconv on its slice with its slice of the weights and of the state
     ([B, D/tp, W-1]: each device stores 1/tp of the state bytes),
  4. all-gathers the conv output over D -> [B, T, D] on every device.
A reduce-scatter plus an all-gather move the same bytes as one all-reduce, and the conv runs
on 1/tp of the channels per device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from backends.protocol import Ops


def projected_sconv(
    h: jax.Array,
    w_out: jax.Array,
    conv_weight: jax.Array,
    conv_bias: jax.Array | None,
    state: jax.Array,
    lengths: jax.Array,
    ops: Ops,
    mesh: Mesh,
    activation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`sconv(h @ w_out)` over the "tp" mesh axis (see the module docstring).

    Args: h [B, T, F] (F split over tp); w_out [F, D]; conv_weight [D, W]; conv_bias [D] or
    None; state [B, D, W-1] (kept split over D); lengths [B] valid tokens per row.
    Returns: y [B, T, D] (replicated) and the new state [B, D, W-1] (split over D).
    """
    tp = mesh.shape["tp"]
    d = w_out.shape[1]
    if d % tp or h.shape[-1] % tp:
        raise ValueError(f"D ({d}) and F ({h.shape[-1]}) must be multiples of tp ({tp})")
    bias = jnp.zeros((d,), conv_weight.dtype) if conv_bias is None else conv_bias

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(None, None, "tp"), P("tp", None), P("tp", None), P("tp"), P(None, "tp"), P()),
        out_specs=(P(), P(None, "tp")),
        check_vma=False,
    )
    def run(h_r, w_r, cw_r, cb_r, st_r, n):
        partial = jnp.einsum("btf,fd->btd", h_r, w_r, preferred_element_type=jnp.float32)
        local = jax.lax.psum_scatter(partial, "tp", scatter_dimension=2, tiled=True)
        y_r, st_new = ops.causal_conv1d(local.astype(h_r.dtype), st_r, cw_r, cb_r, n, activation)
        return jax.lax.all_gather(y_r, "tp", axis=2, tiled=True), st_new

    return run(h, w_out, conv_weight, bias, state, lengths)
