"""`mamba2_decode_paged` as two Pallas kernels on states that stay in the cache region.

1. The conv step in place. A grid over (row, block of `bc` channels). Each program reads its
   channels' conv state (W-1 values each, 16-bit values two to a word or 32-bit one) straight
   from the region's words at its page's offsets, and its channels of x|B|C from the projection
   `cols`:
     window[c] = [state[c, 0..W-2], u[c]],  v[c] = silu(bias[c] + sum_k w[c, k] window[c, k])
   and stores the new state `window[c, 1..W-1]` over the old, whole words at a time: element e
   of the state (channel c, tap t; e = c (W-1) + t in DS, t C + c in SD) takes `window[c,
   t+1]`, and a word packs elements (2q, 2q+1). A program's channels own whole words (bc is
   even and C is even), so no two programs write one word; within a program, every load of the
   old state happens before a barrier and every store after it. v goes out as one [B, C] array.
2. The ssm step in place (`ssd_paged.step_packed`): x, B and C read from v at their offsets,
   dt = softplus(raw + dt_bias) from `cols`, a = -exp(A_log), and y * silu(z) with z from
   `cols`, all inside the kernel.
So a decode step's Mamba2 mixer between its projections is two kernels, with no gather, no
scatter, no slice and no elementwise kernel around them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from backends.fused import MambaDecode
from backends.pallas._common import interpret, next_pow2, triton_params
from backends.pallas.ssd_paged import Packed, step_packed
from backends.protocol import register
from backends.xla.mamba_decode import check_geometry
from backends.xla.mamba_decode import mamba2_decode_paged as decode_reference

F32 = jnp.float32
BLOCK_C = 256  # channels per conv program


def _conv_kernel(
    pages_ref,
    fresh_ref,
    cols_ref,
    w_ref,
    *refs,
    ch: int,
    taps: int,
    bc: int,
    ds: bool,
    per_word: int,
    state_dtype: jnp.dtype,
    offset: int,
    xbc: int,
    width: int,
    page_rows: int,
    has_bias: bool,
    interpreted: bool,
):
    if has_bias:
        bias_ref, region_ref, v_ref, out_ref = refs
    else:
        region_ref, v_ref, out_ref = refs  # out_ref: region_ref's buffer (aliased)
    i, j = pl.program_id(0), pl.program_id(1)
    page, live = pages_ref[i], fresh_ref[i] == 0
    dtype = cols_ref.dtype

    def element(c, t):  # index of state element (channel c, tap t)
        return c * taps + t if ds else t * ch + c

    def word_at(f):  # a word of the page -> (region row, column)
        f = offset + f
        return page * page_rows + f // width, f % width

    def load_state(c, t, mask):  # state values (float32) of elements (c, t)
        e = element(c, t)
        r, w = word_at(e // per_word)
        raw = plgpu.load(region_ref.at[0, r, w], mask=mask & live, other=0)
        if per_word == 1:
            return jax.lax.bitcast_convert_type(raw, F32)
        bits = jax.lax.shift_right_logical(raw, (e % 2) * 16) & 0xFFFF
        return jax.lax.bitcast_convert_type(jax.lax.shift_left(bits, 16), F32)

    def bits_of(v):  # a value as the state stores it: its 16 (or 32) bits in an int32
        raw = jax.lax.bitcast_convert_type(v.astype(state_dtype).astype(F32), jnp.int32)
        return raw if per_word == 1 else jax.lax.shift_right_logical(raw, 16)

    # the conv output of this program's channels
    c = j * bc + jax.lax.broadcasted_iota(jnp.int32, (bc,), 0)
    c_ok = c < ch
    wp = next_pow2(taps + 1)
    t = jax.lax.broadcasted_iota(jnp.int32, (wp,), 0)
    cc, tt = c[:, None], t[None, :]
    old = load_state(cc, tt, c_ok[:, None] & (tt < taps)).astype(dtype).astype(F32)
    u = plgpu.load(cols_ref.at[i, xbc + c], mask=c_ok, other=0).astype(F32)
    window = jnp.where(tt == taps, u[:, None], old)
    w = plgpu.load(w_ref.at[cc, tt], mask=c_ok[:, None] & (tt <= taps), other=0).astype(F32)
    acc = jnp.sum(window * w, axis=1)
    if has_bias:
        acc = acc + plgpu.load(bias_ref.at[c], mask=c_ok, other=0).astype(F32)
    v = acc / (1.0 + jnp.exp(-acc))  # silu
    plgpu.store(v_ref.at[i, c], v.astype(v_ref.dtype), mask=c_ok)

    # the new state, word by word: element (c, t) <- window[c, t + 1]
    words = bc * taps // per_word
    q = jax.lax.broadcasted_iota(jnp.int32, (next_pow2(words),), 0)
    q_ok = q < words
    if ds:  # this program's words are one run
        first = (j * bc * taps) // per_word + q
    else:  # one run per tap row
        run = bc // per_word
        first = ((q // run) * ch + j * bc) // per_word + q % run
    packed = jnp.zeros(q.shape, jnp.int32)
    valid = q_ok
    for s in range(per_word):  # element s of each word
        if ds:
            e = first * per_word + s
            ec, et = e // taps, e % taps
        else:
            ec, et = j * bc + (q % run) * per_word + s, q // run
        ok = q_ok & (ec < ch)
        valid = ok if s == 0 else valid  # a word is whole: its first element decides
        from_u = et + 1 == taps
        shifted = load_state(ec, et + 1, ok & ~from_u).astype(dtype).astype(F32)
        new_u = plgpu.load(cols_ref.at[i, xbc + ec], mask=ok & from_u, other=0).astype(F32)
        value = bits_of(jnp.where(from_u, new_u, shifted))
        packed = packed | (jax.lax.shift_left(value, 16 * s) if s else value)
    if not interpreted:  # (interpret mode runs a program's loads and stores in order)
        plgpu.debug_barrier()  # every old word above is read before any is overwritten
    r, wcol = word_at(first)
    plgpu.store(out_ref.at[0, r, wcol], packed, mask=valid & (page > 0))


def conv_in_place(
    region: jax.Array,
    pages: jax.Array,
    fresh: jax.Array,
    cols: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    geo: MambaDecode,
    block_c: int = BLOCK_C,
) -> tuple[jax.Array, jax.Array]:
    """Step 1 of the module docstring: (v [B, C] in cols' dtype, the region)."""
    bsz, ch = cols.shape[0], geo.channels
    per_word = 4 // jnp.dtype(geo.conv_dtype).itemsize
    bc = min(block_c, next_pow2(ch))
    kernel = functools.partial(
        _conv_kernel,
        ch=ch,
        taps=geo.conv_width - 1,
        bc=bc,
        ds=geo.conv_layout == "DS",
        per_word=per_word,
        state_dtype=jnp.dtype(geo.conv_dtype),
        offset=geo.conv_offset,
        xbc=geo.xbc_offset,
        width=region.shape[2],
        page_rows=geo.page_rows,
        has_bias=bias is not None,
        interpreted=interpret(),
    )
    args = [pages.astype(jnp.int32), fresh.astype(jnp.int32), cols, weight]
    if bias is not None:
        args.append(bias)
    v, region = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bsz, ch), cols.dtype),
            jax.ShapeDtypeStruct(region.shape, region.dtype),
        ),
        grid=(bsz, pl.cdiv(ch, bc)),
        input_output_aliases={len(args): 1},
        interpret=kernel.keywords["interpreted"],
        compiler_params=triton_params(num_warps=4),
        name="conv_step_paged",
    )(*args, region)
    return v, region


def supported(geo: MambaDecode) -> bool:
    """Does the kernel take this geometry? (16-bit bfloat16 or 32-bit float32 conv states with
    an even channel count; anything else runs the reference.)"""
    return jnp.dtype(geo.conv_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(F32)) and (
        geo.channels % 2 == 0
    )


@register("mamba2_decode_paged", "pallas")
def mamba2_decode_paged(
    region: jax.Array,
    pages: jax.Array,
    fresh: jax.Array,
    cols: jax.Array,
    conv_weight: jax.Array,
    conv_bias: jax.Array | None,
    dt_bias: jax.Array,
    a_log: jax.Array,
    d: jax.Array,
    geo: MambaDecode,
) -> tuple[jax.Array, jax.Array]:
    if not supported(geo):
        return decode_reference(
            region, pages, fresh, cols, conv_weight, conv_bias, dt_bias, a_log, d, geo
        )
    check_geometry(geo, cols, region)  # conv state in whole words, states apart, columns
    v, region = conv_in_place(region, pages, fresh, cols, conv_weight, conv_bias, geo)
    hp, gn = geo.heads * geo.head_dim, geo.groups * geo.state_size
    packed = Packed(0, hp, hp + gn, geo.dt_offset, geo.z_offset, geo.dt_min, geo.dt_max)
    shape = (geo.heads, geo.head_dim, geo.groups, geo.state_size)
    y, region = step_packed(
        region,
        pages,
        fresh,
        v,
        cols,
        dt_bias,
        a_log,
        d,
        shape,
        packed,
        geo.ssm_offset,
        geo.page_rows,
    )
    return y.reshape(cols.shape[0], hp), region
