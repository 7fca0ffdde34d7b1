"""Causal depthwise conv1d ("sconv", width W <= 4) as Pallas kernels, written for bandwidth.

Chunk kernel: grid (batch row b, time tile i, channel block j) of independent programs; x is
read in place (no concatenation or padding pass in XLA) and y written straight into its
[B, T, C] result (no pad, no slice). Program (b, i, j) computes y[b, t0 : t0+BT, c0 : c0+BC]
(t0 = i*BT, c0 = j*BC) from W loads of shifted [BT, BC] windows, window s holding the inputs at
rows t - s (times tap W-1-s), accumulated in float32 in the reference's order, then the bias and
the activation. A `cond` on the tile picks how the windows are read:
- tiles after the first (t0 >= BT >= W-1): plain windows x[t0 - s : t0 - s + BT];
- the first tile: a row gather with clamped row indices, rows t - s < 0 coming from the carried
  state (channel-major [B, C, W-1], column W-1 + t - s) through a complementary masked load, in
  x's dtype, as the reference forms u = [state, x].
The W-1 rows a window reads before its tile are also read by the previous tile's program; they
come from cache, so HBM traffic is one read of x and one write of y. Ragged edges (T not a
multiple of BT, C not a multiple of BC) are handled by masked loads/stores; aligned shapes get
no masks.

New state: the programs of time tile 0 also write new_state[b, c0 : c0+BC, :], the W-1 raw
inputs u[len : len + W-1] ending at the row's last valid token (len clamped to [0, T]): a
u-position p < W-1 is the old state's column p (so lengths < W-1, and 0, keep part or all of
the old state), else x row p - (W-1). One masked [BC] load and store per state column.

Step kernel: grid (batch row, channel block); loads the DS state columns and x, writes y and the
shifted state.

On GPU (Triton) every load/store must be a power-of-two tile: BT and BC are powers of two, and
so are the [BT, BC] windows and [BC] columns; block shapes themselves may be arbitrary (x is
passed as a (T, BC) block, the state as (BC, W-1), the weight as (BC, W), all indexed inside).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from backends.pallas._common import interpret, next_pow2, pad_axis, round_up, triton_params
from backends.protocol import conv_state_to_ds, register

F32 = jnp.float32
BLOCK_T = 64  # chunk kernel: time rows per program
BLOCK_C = 128  # chunk kernel: channels per program
MAX_BLOCK_C = 64  # step kernel: channels per program


def _activate(y: jax.Array, activation: str | None, approx: bool = False) -> jax.Array:
    """The activation in float32; `approx` (Triton only): silu through the hardware tanh,
    `y (1 + tanh(y / 2)) / 2` (relative error ~1e-3: for 16-bit outputs), no division."""
    if activation is None:
        return y
    if activation == "silu" and approx:
        return y * (0.5 + 0.5 * plgpu.approx_tanh(0.5 * y))
    if activation == "silu":
        return y / (1.0 + jnp.exp(-y))
    raise ValueError(f"unsupported conv activation {activation!r} (use 'silu' or None)")


def _check(weight: jax.Array, activation: str | None) -> int:
    width = weight.shape[1]
    if not 2 <= width <= 4:
        raise ValueError(f"causal conv width must be 2..4, got {width}")
    _activate(jnp.zeros(()), activation)  # validates the name
    return width


def _all(*masks):
    """The conjunction of the masks that are not None (None when all are)."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out


def _load(ref, idx, mask):
    return ref[idx] if mask is None else plgpu.load(ref.at[idx], mask=mask, other=0)


def _conv_kernel(
    len_ref, x_ref, s_ref, w_ref, *refs, width, t, ch, bt, bc, activation, approx, part="all"
):
    """One [BT, BC] tile of y (and, on time tile 0, the new state). `part`: "all" (grid
    (b, i, j), a `cond` picks the first tile's reads), "body" (grid (b, i, j) over tiles 1..,
    plain windows only, no state) or "first" (grid (b, j): tile 0 and the new state; y comes in
    aliased as the last input, its other tiles already written by "body")."""
    if part == "first":
        *b_ref, _y_in, y_ref, ns_ref = refs
        i, j = 0, pl.program_id(1)
    elif part == "body":
        *b_ref, y_ref = refs
        ns_ref = None
        i, j = pl.program_id(1) + 1, pl.program_id(2)
    else:
        *b_ref, y_ref, ns_ref = refs
        i, j = pl.program_id(1), pl.program_id(2)
    dtype = x_ref.dtype
    cols = jax.lax.broadcasted_iota(jnp.int32, (bc,), 0)  # channel within the block
    col_ok = (j * bc + cols < ch) if ch % bc else None  # [BC], ragged last channel block
    rows = i * bt + jax.lax.broadcasted_iota(jnp.int32, (bt,), 0)  # time of each output row
    row_ok = (rows < t)[:, None] if t % bt else None  # [BT, 1], ragged last time tile
    col_ok2 = None if col_ok is None else col_ok[None, :]
    # taps[s] multiplies window s, the inputs at t - s.
    taps = [_load(w_ref, (cols, width - 1 - s), col_ok).astype(F32)[None, :] for s in range(width)]

    def window(s: int, first: bool) -> jax.Array:
        """[BT, BC] inputs at rows t - s, in x's dtype."""
        if s == 0 or not first:  # inside x (tiles after the first start at t0 >= BT >= W-1)
            return _load(x_ref, (pl.ds(i * bt - s, bt), pl.ds(0, bc)), _all(row_ok, col_ok2))
        # First tile: a row gather with clamped indices; rows before the chunk come from the
        # state (column W-1 + t - s) through the complementary mask.
        src = rows - s
        in_x = (src >= 0)[:, None]
        xi = jnp.clip(src, 0, t - 1)[:, None]
        win = plgpu.load(x_ref.at[xi, cols[None, :]], mask=_all(in_x, row_ok, col_ok2), other=0)
        si = jnp.clip(src + (width - 1), 0, width - 2)[:, None]
        old = plgpu.load(s_ref.at[cols[None, :], si], mask=_all(~in_x, col_ok2), other=0)
        return jnp.where(in_x, win, old.astype(dtype))

    def accumulate(first: bool) -> jax.Array:
        acc = jnp.zeros((bt, bc), F32)
        for s in reversed(range(width)):  # oldest input first, as the reference sums
            acc = acc + window(s, first).astype(F32) * taps[s]
        if b_ref:
            acc = acc + _load(b_ref[0], (pl.ds(0, bc),), col_ok).astype(F32)[None, :]
        return acc

    if part == "body":
        acc = accumulate(False)
    elif part == "first" or t <= bt:  # the first (or only) time tile
        acc = accumulate(True)
    else:
        acc = jax.lax.cond(i == 0, lambda: accumulate(True), lambda: accumulate(False))
    y = _activate(acc, activation, approx).astype(y_ref.dtype)
    mask = _all(row_ok, col_ok2)
    if mask is None:
        y_ref[...] = y
    else:
        plgpu.store(y_ref.at[pl.ds(0, bt), pl.ds(0, bc)], y, mask=mask)

    if ns_ref is None:
        return
    # New state (time tile 0): u[len + k], k < W-1, with u = [state, x] (u-position p < W-1 is
    # state column p, else x row p - (W-1)).
    first = (i == 0) if part == "all" else None  # "first" programs are all tile 0
    length = jnp.clip(len_ref[0], 0, t)
    for k in range(width - 1):
        src = length + k - (width - 1)
        in_x = src >= 0
        new = plgpu.load(
            x_ref.at[jnp.clip(src, 0, t - 1), pl.ds(0, bc)],
            mask=_all(first, in_x, col_ok),
            other=0,
        )
        si = jnp.clip(length + k, 0, width - 2)
        old = plgpu.load(s_ref.at[cols, si], mask=_all(first, ~in_x, col_ok), other=0)
        new = jnp.where(in_x, new, old.astype(dtype)).astype(ns_ref.dtype)
        plgpu.store(ns_ref.at[cols, k], new, mask=_all(first, col_ok))


@register("causal_conv1d", "pallas")
def causal_conv1d(
    x: jax.Array,
    state: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    lengths: jax.Array,
    activation: str | None,
    state_layout: str = "DS",
) -> tuple[jax.Array, jax.Array]:
    # The kernel reads DS; an SD state ([B, W-1, C], a few KB per row) is transposed around it.
    state = conv_state_to_ds(state, state_layout)
    # Tile 0 launched apart: 0.203 vs 0.221 ms at [8, 2048, 8448] on an H200 (BENCHMARKS.md).
    y, new_state = causal_conv1d_tiled(x, state, weight, bias, lengths, activation,
                                       split_first=True)  # fmt: skip
    return y, conv_state_to_ds(new_state, state_layout)


def causal_conv1d_tiled(
    x: jax.Array,
    state: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    lengths: jax.Array,
    activation: str | None,
    *,
    block_t: int = BLOCK_T,
    block_c: int = BLOCK_C,
    num_warps: int | None = None,
    approx: bool | None = None,
    split_first: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`causal_conv1d` with explicit tiles (powers of two; the benchmark sweeps them). `approx`:
    silu through the hardware tanh (default: on GPU for 16-bit x). `split_first`: two launches
    instead of one `cond` per program, the tiles after the first (plain windows, no state: a
    smaller kernel) and then time tile 0 with the new state, writing into the same y."""
    bsz, t, ch = x.shape
    width = _check(weight, activation)
    if bsz == 0 or t == 0 or ch == 0:  # nothing valid: y is empty, the state carries over
        return jnp.zeros(x.shape, x.dtype), state.astype(x.dtype).astype(state.dtype)
    bc = min(next_pow2(ch), block_c)
    bt = min(next_pow2(t), max(block_t, 4))  # tiles after the first start at t0 >= 4 > W-1
    if approx is None:
        approx = not interpret() and jnp.dtype(x.dtype).itemsize == 2
    kernel = functools.partial(
        _conv_kernel, width=width, t=t, ch=ch, bt=bt, bc=bc, activation=activation, approx=approx
    )
    nt, nc = pl.cdiv(t, bt), pl.cdiv(ch, bc)
    params = triton_params(num_warps or max(1, min(8, bt * bc // 2048)))
    y_shape = jax.ShapeDtypeStruct((bsz, t, ch), x.dtype)
    state_shape = jax.ShapeDtypeStruct((bsz, ch, width - 1), state.dtype)
    args = [lengths.astype(jnp.int32), x, state, weight] + ([] if bias is None else [bias])

    def specs(first_only: bool) -> list[pl.BlockSpec]:
        """Input specs for grid (b, i, j), or (b, j) when `first_only`."""
        at = (lambda f: lambda b, j: f(b, 0, j)) if first_only else (lambda f: f)
        out = [
            pl.BlockSpec((1,), at(lambda b, i, j: (b,))),
            pl.BlockSpec((None, t, bc), at(lambda b, i, j: (b, 0, j))),  # x, indexed inside
            pl.BlockSpec((None, bc, width - 1), at(lambda b, i, j: (b, j, 0))),
            pl.BlockSpec((bc, width), at(lambda b, i, j: (j, 0))),
        ]
        return out + ([] if bias is None else [pl.BlockSpec((bc,), at(lambda b, i, j: (j,)))])

    state_spec = pl.BlockSpec((None, bc, width - 1), lambda b, *g: (b, g[-1], 0))
    if not split_first or nt == 1:
        return pl.pallas_call(
            kernel,
            out_shape=(y_shape, state_shape),
            grid=(bsz, nt, nc),
            in_specs=specs(False),
            out_specs=(pl.BlockSpec((None, bt, bc), lambda b, i, j: (b, i, j)), state_spec),
            interpret=interpret(),
            compiler_params=params,
            name="causal_conv1d",
        )(*args)
    y = pl.pallas_call(
        functools.partial(kernel, part="body"),
        out_shape=y_shape,
        grid=(bsz, nt - 1, nc),
        in_specs=specs(False),
        out_specs=pl.BlockSpec((None, bt, bc), lambda b, i, j: (b, i + 1, j)),
        interpret=interpret(),
        compiler_params=params,
        name="causal_conv1d_body",
    )(*args)
    return pl.pallas_call(
        functools.partial(kernel, part="first"),
        out_shape=(y_shape, state_shape),
        grid=(bsz, nc),
        in_specs=specs(True) + [pl.BlockSpec(memory_space=pl.ANY)],  # y, aliased to output 0
        out_specs=(pl.BlockSpec((None, bt, bc), lambda b, j: (b, 0, j)), state_spec),
        input_output_aliases={len(args): 0},
        interpret=interpret(),
        compiler_params=params,
        name="causal_conv1d_first",
    )(*args, y)


def _step_kernel(x_ref, s_ref, w_ref, b_ref, y_ref, ns_ref, *, width, activation):
    x = x_ref[...]
    # The window in x's dtype, as the reference forms it: W-1 carried inputs, then x.
    cols = [s_ref[:, j].astype(x.dtype) for j in range(width - 1)] + [x]
    acc = b_ref[0, :].astype(jnp.float32)
    for k in range(width):
        acc = acc + cols[k].astype(jnp.float32) * w_ref[k, :].astype(jnp.float32)
    y_ref[...] = _activate(acc, activation).astype(y_ref.dtype)
    for j in range(width - 1):
        ns_ref[:, j] = cols[j + 1].astype(ns_ref.dtype)


@register("causal_conv1d_step", "pallas")
def causal_conv1d_step(
    x: jax.Array,
    state: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    activation: str | None,
    state_layout: str = "DS",
) -> tuple[jax.Array, jax.Array]:
    state = conv_state_to_ds(state, state_layout)
    bsz, ch = x.shape
    width = _check(weight, activation)
    bc = min(next_pow2(ch), MAX_BLOCK_C)
    cp = round_up(ch, bc)
    w_t = pad_axis(weight.T, 1, cp)  # [W, Cp]
    b = jnp.zeros((cp,), jnp.float32) if bias is None else pad_axis(bias, 0, cp)
    kernel = functools.partial(_step_kernel, width=width, activation=activation)
    y, s = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bsz, cp), x.dtype),
            jax.ShapeDtypeStruct((bsz, cp, width - 1), state.dtype),
        ),
        grid=(bsz, cp // bc),
        in_specs=[
            pl.BlockSpec((None, bc), lambda i, j: (i, j)),
            pl.BlockSpec((None, bc, width - 1), lambda i, j: (i, j, 0)),
            pl.BlockSpec((width, bc), lambda i, j: (0, j)),
            pl.BlockSpec((1, bc), lambda i, j: (0, j)),
        ],
        out_specs=(
            pl.BlockSpec((None, bc), lambda i, j: (i, j)),
            pl.BlockSpec((None, bc, width - 1), lambda i, j: (i, j, 0)),
        ),
        interpret=interpret(),
        compiler_params=triton_params(),
        name="causal_conv1d_step",
    )(pad_axis(x, 1, cp), pad_axis(state, 1, cp), w_t, b[None, :])
    return y[:, :ch], conv_state_to_ds(s[:, :ch], state_layout)
