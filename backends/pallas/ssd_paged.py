"""`mamba2_step_paged` as a Pallas kernel: the one-token Mamba2 update where the state lies.

Each program owns one (batch row, ssm head, block of P) and reads its state tile [bp, Ns]
straight from the cache region (words, int32), at the word offsets its page id gives:
    f = state_offset + h * P * Ns + p * Ns + n,   word (page * page_rows + f // Wd, f % Wd)
(the region's row width Wd need not divide anything; an index array per tile, so a state may
start and end anywhere in a row). Then, as `mamba2_step`,
    s' = exp(dt a) s + dt (x outer b),   y = s' . c + d x
and it stores s' over s through the aliased region (`input_output_aliases`): the state is
read once and written once, with no gather, no scatter and no padding bytes moved. Rows on
page 0 (the null page, padding) are not stored; a `fresh` row reads zeros. Head h reads group
h // (Hs / G) of b and c. Tiles are powers of two with masks (P = 80 takes three tiles of 32
rows; Ns pads to a power of two in registers only). The Triton lowering indexes with 64-bit
offsets when the region exceeds 4 GiB.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from backends.pallas._common import interpret, next_pow2, triton_params
from backends.protocol import register

F32 = jnp.float32
TILE = 4096  # state elements per program (32 a thread at 4 warps)


@dataclasses.dataclass(frozen=True)
class Packed:
    """Where the packed form (`step_packed`) finds x, b, c (offsets into one [B, *] array), the
    raw dt and the gate z (offsets into the projection; y comes back as y * silu(z)), and dt's
    clip range."""

    x_offset: int
    b_offset: int
    c_offset: int
    dt_offset: int
    z_offset: int
    dt_min: float
    dt_max: float


def _kernel(
    pages_ref,
    fresh_ref,
    x_ref,
    dt_ref,
    a_ref,
    b_ref,
    c_ref,
    d_ref,
    *refs,
    p: int,
    ns: int,
    bp: int,
    nsp: int,
    rep: int,
    width: int,
    page_rows: int,
    state_offset: int,
    packed: Packed | None,
):
    # out_ref is region_ref's buffer (aliased): loads read region_ref, stores go to out_ref
    if packed is None:
        region_ref, y_ref, out_ref = refs
        x_off = b_off = c_off = 0
    else:
        dtb_ref, region_ref, y_ref, out_ref = refs
        x_off, b_off, c_off = packed.x_offset, packed.b_offset, packed.c_offset
    i, h, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page = pages_ref[i]
    fresh = fresh_ref[i]
    rows = k * bp + jax.lax.broadcasted_iota(jnp.int32, (bp,), 0)  # [bp] rows of P
    cols = jax.lax.broadcasted_iota(jnp.int32, (nsp,), 0)  # [nsp]
    row_ok, col_ok = rows < p, cols < ns
    tile_ok = row_ok[:, None] & col_ok[None, :]
    word = state_offset + h * (p * ns) + rows[:, None] * ns + cols[None, :]  # within the page
    r_idx = page * page_rows + word // width
    w_idx = word % width
    raw = plgpu.load(region_ref.at[0, r_idx, w_idx], mask=tile_ok & (fresh == 0), other=0)
    state = jax.lax.bitcast_convert_type(raw, F32)
    # x [B, Hs * P], b and c [B, G * Ns] (flat; packed: parts of one array at their offsets)
    x = plgpu.load(x_ref.at[i, x_off + h * p + rows], mask=row_ok, other=0).astype(F32)  # [bp]
    g = h // rep
    b = plgpu.load(b_ref.at[i, b_off + g * ns + cols], mask=col_ok, other=0).astype(F32)
    c = plgpu.load(c_ref.at[i, c_off + g * ns + cols], mask=col_ok, other=0).astype(F32)
    if packed is None:
        dt = dt_ref[i, h].astype(F32)
        a = a_ref[h].astype(F32)
    else:  # dt raw from the projection, a as A_log
        v = dt_ref[i, packed.dt_offset + h].astype(F32) + dtb_ref[h].astype(F32)
        dt = jnp.maximum(v, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(v)))  # softplus
        if packed.dt_min > 0.0 or packed.dt_max < float("inf"):
            dt = jnp.minimum(jnp.maximum(dt, packed.dt_min), packed.dt_max)
        a = -jnp.exp(a_ref[h].astype(F32))
    new = jnp.exp(dt * a) * state + (dt * x)[:, None] * b[None, :]
    new_raw = jax.lax.bitcast_convert_type(new, jnp.int32)
    plgpu.store(out_ref.at[0, r_idx, w_idx], new_raw, mask=tile_ok & (page > 0))
    y = jnp.sum(new * c[None, :], axis=1) + d_ref[h].astype(F32) * x
    if packed is not None:  # the gate of the gated norm: y * silu(z)
        zs = packed.z_offset + h * p + rows
        z = plgpu.load(dt_ref.at[i, zs], mask=row_ok, other=0).astype(F32)
        y = y * (z / (1.0 + jnp.exp(-z)))
    plgpu.store(y_ref.at[i, h, rows], y.astype(y_ref.dtype), mask=row_ok)


@register("mamba2_step_paged", "pallas")
def mamba2_step_paged(
    region: jax.Array,
    pages: jax.Array,
    fresh: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
    state_offset: int,
    page_rows: int,
) -> tuple[jax.Array, jax.Array]:
    args = (region, pages, fresh, x, dt, a, b, c, d, state_offset, page_rows)
    return mamba2_step_paged_tiled(*args, tile=_tile(x.shape[0] * x.shape[1]))


def _tile(programs: int) -> int:
    """State elements per program for `programs` (row, head) pairs. Measured on an H200
    (Nano-9B-v2 layer, BENCHMARKS.md): while the grid is small, larger tiles (batch 8: 4096
    elements at 0.50 of the copy bandwidth, 2048 at 0.36); once it is large, smaller ones
    (batch 64: 2048 at 0.81, 4096 at 0.72)."""
    return TILE if programs < 4096 else TILE // 2


def mamba2_step_paged_tiled(
    region: jax.Array,
    pages: jax.Array,
    fresh: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
    state_offset: int,
    page_rows: int,
    *,
    tile: int = TILE,
    num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
    """`mamba2_step_paged` with explicit tiles: about `tile` state elements per program
    (rows of P times the padded Ns) and `num_warps`; the benchmark sweeps them."""
    bsz, nh, p = x.shape
    groups, ns = b.shape[1], b.shape[2]
    flat = (x.reshape(bsz, -1), dt, a, b.reshape(bsz, -1), c.reshape(bsz, -1), d)
    shape = (nh, p, groups, ns)
    return _launch(
        region,
        pages,
        fresh,
        flat,
        shape,
        state_offset,
        page_rows,
        None,
        None,
        tile=tile,
        num_warps=num_warps,
    )


def step_packed(
    region: jax.Array,
    pages: jax.Array,
    fresh: jax.Array,
    xbc: jax.Array,
    cols: jax.Array,
    dt_bias: jax.Array,
    a_log: jax.Array,
    d: jax.Array,
    shape: tuple[int, int, int, int],
    packed: Packed,
    state_offset: int,
    page_rows: int,
) -> tuple[jax.Array, jax.Array]:
    """`mamba2_step_paged` reading x, b and c from one array `xbc` [B, *] at the offsets of
    `packed`, dt raw from `cols` [B, *] (softplus(raw + dt_bias) inside, clipped as `packed`
    says) and a as `a_log` (a = -exp(a_log)): no slice, no dt or a kernel before it; it gives
    back y * silu(z), z from `cols` too. shape = (Hs, P, G, Ns). Returns the gated y
    [B, Hs, P] in xbc's dtype and the region."""
    flat = (xbc, cols, a_log, xbc, xbc, d)
    return _launch(
        region,
        pages,
        fresh,
        flat,
        shape,
        state_offset,
        page_rows,
        packed,
        dt_bias,
        tile=_tile(xbc.shape[0] * shape[0]),
        num_warps=4,
    )


def _launch(
    region: jax.Array,
    pages: jax.Array,
    fresh: jax.Array,
    flat: tuple[jax.Array, ...],
    shape: tuple[int, int, int, int],
    state_offset: int,
    page_rows: int,
    packed: Packed | None,
    dt_bias: jax.Array | None,
    *,
    tile: int,
    num_warps: int,
) -> tuple[jax.Array, jax.Array]:
    if region.dtype != jnp.int32 or region.ndim != 3 or region.shape[0] != 1:
        raise ValueError(f"region must be int32 words [1, R, Wd], got {region.dtype}{region.shape}")
    x, dt, a, b, c, d = flat
    nh, p, groups, ns = shape
    bsz = x.shape[0]
    if nh % groups:
        raise ValueError(f"{nh} ssm heads do not split into {groups} groups")
    nsp = next_pow2(ns)
    bp = min(next_pow2(p), max(1, tile // nsp))
    kernel = functools.partial(
        _kernel,
        p=p,
        ns=ns,
        bp=bp,
        nsp=nsp,
        rep=nh // groups,
        width=region.shape[2],
        page_rows=page_rows,
        state_offset=state_offset,
        packed=packed,
    )
    args = [pages.astype(jnp.int32), fresh.astype(jnp.int32), x, dt, a.astype(F32), b, c]
    args.append(d.astype(F32))
    if packed is not None:
        args.append(dt_bias.astype(F32))
    y, region = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bsz, nh, p), x.dtype),
            jax.ShapeDtypeStruct(region.shape, region.dtype),
        ),
        grid=(bsz, nh, pl.cdiv(p, bp)),
        input_output_aliases={len(args): 1},
        interpret=interpret(),
        compiler_params=triton_params(num_warps=num_warps),
        name="mamba2_step_paged",
    )(*args, region)
    return y, region
