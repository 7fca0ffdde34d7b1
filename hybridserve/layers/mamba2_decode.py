"""The Mamba2 mixer's one-token decode paths, where the states stay in the cache region.

- `decode_fused` (TP 1, projections as rows): the whole mixer between its two projections is
  the backend's `mamba2_decode_paged`: the conv state stepped in place, then the ssm state,
  with dt, a and the gate y * silu(z) inside (`backends.fused`). It reads x|B|C, dt and z
  straight from the merged projection's columns and gives y * silu(z) [B, Hs * P] to the
  output projection, which takes the group norm and the residual add.
- `decode_ranks` (any TP, merged kernels): each rank's x|B|C columns are contiguous in the
  merged projection and in its state page, so one conv step runs over all of them
  (`read_conv_ranks`), then the in-place ssm step per rank (`step_in_place`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from backends.fused import MambaDecode
from hybridserve.cache.mamba_view import (
    read_conv_ranks,
    state_offset,
    write_conv_ranks,
)
from hybridserve.cache.view import MambaAccess, duplicate
from hybridserve.layers.step_input import StepInput

# `mixer` below is a `layers.mamba2.Mamba2` (which imports this module: typed as its base)
Mamba2 = nnx.Module


def geometry(mixer: Mamba2, acc: MambaAccess, page_rows: int) -> MambaDecode:
    """Where `mamba2_decode_paged` finds the layer's inputs (the merged columns, TP 1) and
    states (its state page: the conv state from byte 0, x|B|C in page order)."""
    cfg, proj = mixer.cfg, mixer.in_proj
    return MambaDecode(
        heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        groups=cfg.n_groups,
        state_size=cfg.state_size,
        conv_width=cfg.conv_kernel,
        xbc_offset=proj.part("x").offset,
        dt_offset=proj.part("dt").offset,
        z_offset=proj.part("z").offset,
        conv_layout=acc.layout,
        conv_dtype=acc.conv_dtype,
        conv_offset=0,
        ssm_offset=state_offset(acc),
        page_rows=page_rows,
        dt_min=cfg.dt_min,
        dt_max=cfg.dt_max,
    )


def decode_fused(
    mixer: Mamba2, cols: jax.Array, region: jax.Array, acc: MambaAccess, inputs: StepInput
) -> tuple[jax.Array, jax.Array]:
    """One token from the merged columns cols [B, Wr] (TP 1): (y * silu(z) [B, 1, Hs * P],
    region): the gated norm's product, which the output projection normalises per group."""
    bias = mixer.conv_bias_merged
    y, region = mixer.ops.mamba2_decode_paged(
        region,
        inputs.tables[acc.group],
        inputs.fresh.astype(jnp.int32),
        cols,
        mixer.conv_merged[...][0],
        None if bias is None else bias[...][0],
        mixer.dt_bias[...],
        mixer.A_log[...],
        mixer.D[...],
        geometry(mixer, acc, inputs.layout.page_rows),
    )
    return y[:, None], region


def decode_ranks(
    mixer: Mamba2, u: jax.Array, region: jax.Array, acc: MambaAccess, inputs: StepInput
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One-token decode over the merged kernels: (y [B, 1, Hs, P], z, region). Each rank's
    x|B|C columns are contiguous in the merged projection and in its state page, so one
    conv step runs over all of them (`read_conv_ranks`), then the in-place ssm step."""
    cfg, layout = mixer.cfg, inputs.layout
    tp, pages, fresh = layout.tp, inputs.tables[acc.group], inputs.fresh
    proj = mixer.in_proj
    cols = proj.ranks(u)[:, 0]  # [B, tp, Wr]
    bsz = cols.shape[0]
    xbc = proj.span(cols, "x", "c")  # [B, tp, Cr]
    state, raw = read_conv_ranks(region, acc, pages, layout.page_rows)  # [tp, B, Cr, W-1]
    state = jnp.where(fresh[None, :, None, None], 0, state)
    channels = xbc.shape[-1]
    conv_state = jnp.swapaxes(state, 0, 1).reshape(bsz, tp * channels, -1)
    weight = mixer.conv_merged[...].reshape(tp * channels, -1)
    bias = None if mixer.conv_bias_merged is None else mixer.conv_bias_merged[...].reshape(-1)
    y, new_state = mixer.ops.causal_conv1d_step(
        xbc.reshape(bsz, -1), conv_state.astype(xbc.dtype), weight, bias, "silu"
    )
    new_state = jnp.swapaxes(new_state.reshape(bsz, tp, channels, -1), 0, 1)
    region = write_conv_ranks(region, acc, pages, layout.page_rows, new_state, raw)
    y = y.reshape(bsz, tp, channels)
    x_part, b_part = proj.part("x"), proj.part("b")
    xr, bcr = x_part.width, b_part.width
    x = y[..., :xr].reshape(bsz, cfg.num_heads, cfg.head_dim)
    # B and C as each rank holds them (split or duplicated): [B, tp * G_r, Ns]
    b = y[..., xr : xr + bcr].reshape(bsz, tp * b_part.per_rank, cfg.state_size)
    c = y[..., xr + bcr :].reshape(bsz, tp * b_part.per_rank, cfg.state_size)
    dt = mixer._dt(proj.cut(cols, "dt"))
    a = -jnp.exp(mixer.A_log[...].astype(jnp.float32))
    step = (x, dt, a, b, c, mixer.D[...])
    y, region = step_in_place(mixer, region, acc, pages, fresh, inputs, *step, ranked=True)
    return y[:, None], proj.cut(cols, "z")[:, None], region


def step_in_place(
    mixer: Mamba2,
    region: jax.Array,
    acc: MambaAccess,
    pages: jax.Array,
    fresh: jax.Array,
    inputs: StepInput,
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
    ranked: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`mamba2_step_paged` over the region: y [B, Hs, P] and the region. At TP > 1 each
    rank updates its own heads' states in its own shard (`shard_map`); B and C groups
    fewer than tp are duplicated first, as their pages hold them (`ranked`: b and c are
    already as the ranks hold them, [B, tp * G_r, Ns])."""
    layout = inputs.layout
    tp = layout.tp
    fresh = fresh.astype(jnp.int32)

    def step(shard, pages, fresh, x, dt, a, b, c, d):
        return mixer.ops.mamba2_step_paged(
            shard, pages, fresh, x, dt, a, b, c, d, state_offset(acc), layout.page_rows
        )

    if tp == 1:
        return step(region, pages, fresh, x, dt, a, b, c, d)
    if not ranked:
        dup = acc.group_dup(tp)
        b, c = duplicate(b, 1, dup), duplicate(c, 1, dup)
    heads, shard = P(None, "tp", None), P("tp", None, None)
    specs = (shard, P(), P(), heads, P(None, "tp"), P("tp"), heads, heads, P("tp"))
    run = jax.shard_map(
        step, mesh=layout.mesh, in_specs=specs, out_specs=(heads, shard), check_vma=False
    )
    return run(region, pages, fresh, x, dt, a, b, c, d)
