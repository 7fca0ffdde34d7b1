"""The `pallas` kernels against the `xla` references (the ground truth), jitted, on random
inputs (never zeros, fixed seeds) at awkward shapes. On CPU the kernels run in interpret mode,
whose outputs start as NaN (Pallas' uninitialised value), so "no NaN/inf anywhere in the
outputs" also catches elements a kernel forgot to write.

Tolerances: float32 within 1e-5 relative to the output scale; bfloat16 within 2e-2."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_export import assert_lowers_to_triton

from backends.protocol import OP_SIGNATURES, BackendError, RelativeBias, get_op, load_ops

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
DTYPES = [jnp.float32, jnp.bfloat16]


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([7, *key])


def _jit(op: str, backend: str, static: tuple[int, ...] = ()):
    return jax.jit(get_op(op, backend), static_argnums=static)


def _finite(*arrays) -> None:
    for a in arrays:
        assert np.isfinite(np.asarray(a, np.float32)).all(), "NaN/inf: an unwritten element?"


def _close(got, ref, rel) -> None:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=0, atol=rel * max(np.abs(ref).max(), 1e-6))


# --- sconv -----------------------------------------------------------------------------------


def _conv_inputs(rng, bsz, t, ch, width, dtype, bias=True):
    x = jnp.asarray(rng.standard_normal((bsz, t, ch)), dtype)
    state = jnp.asarray(rng.standard_normal((bsz, ch, width - 1)), dtype)
    w = jnp.asarray(rng.standard_normal((ch, width)) / np.sqrt(width), dtype)
    b = jnp.asarray(rng.standard_normal(ch), dtype) if bias else None
    return x, state, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_causal_conv1d_matches_xla(width, dtype):
    # T = 37 is not a multiple of the time tile, C = 70 not a multiple of the channel block;
    # lengths: full, 0, 1, and W-2 (< W-1: the new state keeps some of the old state).
    x, state, w, b = _conv_inputs(_rng(1, width), 4, 37, 70, width, dtype)
    lengths = jnp.array([37, 0, 1, width - 2], jnp.int32)
    y, s = _jit("causal_conv1d", "pallas", (5,))(x, state, w, b, lengths, "silu")
    y_ref, s_ref = _jit("causal_conv1d", "xla", (5,))(x, state, w, b, lengths, "silu")
    _finite(y, s)
    assert y.dtype == y_ref.dtype and s.dtype == s_ref.dtype
    for row, n in enumerate(np.asarray(lengths)):
        if n:
            _close(y[row, :n], y_ref[row, :n], TOL[dtype])
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))


@pytest.mark.parametrize("width", [2, 4])
def test_causal_conv1d_one_token_no_bias_no_activation(width):
    x, state, w, _ = _conv_inputs(_rng(2, width), 3, 1, 5, width, jnp.float32)
    lengths = jnp.array([1, 0, 1], jnp.int32)
    y, s = _jit("causal_conv1d", "pallas", (5,))(x, state, w, None, lengths, None)
    y_ref, s_ref = _jit("causal_conv1d", "xla", (5,))(x, state, w, None, lengths, None)
    _finite(y, s)
    _close(y[np.array([0, 2])], y_ref[np.array([0, 2])], 1e-5)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
    np.testing.assert_array_equal(np.asarray(s[1]), np.asarray(state[1]))  # a padding row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_causal_conv1d_step_matches_xla(width, dtype):
    x, state, w, b = _conv_inputs(_rng(3, width), 3, 1, 70, width, dtype)
    x = x[:, 0]
    for bias, act in ((b, "silu"), (None, None)):
        y, s = _jit("causal_conv1d_step", "pallas", (4,))(x, state, w, bias, act)
        y_ref, s_ref = _jit("causal_conv1d_step", "xla", (4,))(x, state, w, bias, act)
        _finite(y, s)
        _close(y, y_ref, TOL[dtype])
        np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))


def test_conv_rejects_bad_width_and_activation():
    x, state, w, b = _conv_inputs(_rng(4), 1, 2, 4, 4, jnp.float32)
    conv = get_op("causal_conv1d", "pallas")
    with pytest.raises(ValueError, match="activation"):
        conv(x, state, w, b, jnp.array([2]), "gelu")
    w5 = jnp.ones((4, 5), jnp.float32)
    with pytest.raises(ValueError, match="width"):
        conv(x, jnp.ones((1, 4, 4)), w5, b, jnp.array([2]), None)


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("shape", [(5, 128, 256), (5, 150, 300)])
def test_causal_conv1d_several_tiles(shape, width):
    # Several time tiles and channel blocks, aligned (T = 2 tiles, C = 2 blocks) and ragged in
    # both; lengths end inside a tile, on a tile boundary, at 0 and below W-1. The state is
    # float32 under bfloat16 x: the reference rounds carried inputs through x's dtype.
    bsz, t, ch = shape
    rng = _rng(5, width, t)
    x, _, w, b = _conv_inputs(rng, bsz, t, ch, width, jnp.bfloat16)
    state = jnp.asarray(rng.standard_normal((bsz, ch, width - 1)), jnp.float32)
    lengths = jnp.array([t, 64, 0, width - 2, 97], jnp.int32)
    for bias, act in ((b, "silu"), (None, None)):
        y, s = _jit("causal_conv1d", "pallas", (5,))(x, state, w, bias, lengths, act)
        y_ref, s_ref = _jit("causal_conv1d", "xla", (5,))(x, state, w, bias, lengths, act)
        _finite(y, s)
        assert y.dtype == y_ref.dtype and s.dtype == s_ref.dtype and s.shape == s_ref.shape
        for row, n in enumerate(np.asarray(lengths)):
            if n:
                _close(y[row, :n], y_ref[row, :n], TOL[jnp.bfloat16])
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))


@pytest.mark.parametrize("split_first", [False, True])
@pytest.mark.parametrize("block_t,block_c", [(16, 32), (4, 512), (256, 128)])
def test_causal_conv1d_other_tiles(block_t, block_c, split_first):
    # The benchmark's tile sweep: small tiles (many programs, ragged everywhere), 4-row tiles
    # (the smallest that keeps the width-4 window after the first tile inside x), one time tile;
    # in one launch, or split (the tiles after the first, then tile 0 and the state into y).
    from backends.pallas.conv import causal_conv1d_tiled

    bsz, t, ch, width = 3, 150, 300, 4
    rng = _rng(9, block_t, block_c)
    x, state, w, b = _conv_inputs(rng, bsz, t, ch, width, jnp.float32)
    lengths = jnp.array([t, 5, 97], jnp.int32)
    conv = functools.partial(
        causal_conv1d_tiled, block_t=block_t, block_c=block_c, split_first=split_first
    )
    y, s = jax.jit(conv, static_argnums=(5,))(x, state, w, b, lengths, "silu")
    y_ref, s_ref = _jit("causal_conv1d", "xla", (5,))(x, state, w, b, lengths, "silu")
    _finite(y, s)
    for row, n in enumerate(np.asarray(lengths)):
        _close(y[row, :n], y_ref[row, :n], TOL[jnp.float32])
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))


# --- mamba2 --------------------------------------------------------------------------------


def _ssm_inputs(rng, bsz, t, nh, p, g, ns, dtype):
    x = jnp.asarray(rng.standard_normal((bsz, t, nh, p)), dtype)
    dt = jnp.asarray(rng.uniform(0.01, 0.3, (bsz, t, nh)), dtype)
    a = jnp.asarray(-rng.uniform(1, 8, nh), jnp.float32)
    b = jnp.asarray(rng.standard_normal((bsz, t, g, ns)), dtype)
    c = jnp.asarray(rng.standard_normal((bsz, t, g, ns)), dtype)
    d = jnp.asarray(rng.uniform(0.5, 1.5, nh), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((bsz, nh, p, ns)), jnp.float32)
    return x, dt, a, b, c, d, h0


# (heads, groups, head dim, state dim): powers of two; heads not a power of two with 3 groups
# and P, Ns that need padding; one group for many heads.
SSM_SHAPES = [(8, 2, 8, 16), (6, 3, 6, 12), (5, 1, 16, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,g,p,ns", SSM_SHAPES)
def test_mamba2_step_matches_xla(nh, g, p, ns, dtype):
    x, dt, a, b, c, d, h0 = _ssm_inputs(_rng(5, nh, g), 3, 1, nh, p, g, ns, dtype)
    args = (h0, x[:, 0], dt[:, 0], a, b[:, 0], c[:, 0], d)
    y, h = _jit("mamba2_step", "pallas")(*args)
    y_ref, h_ref = _jit("mamba2_step", "xla")(*args)
    _finite(y, h)
    assert y.dtype == x.dtype and h.dtype == jnp.float32 and h.shape == h0.shape
    _close(y, y_ref, TOL[dtype])
    _close(h, h_ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "t,chunk,shape",
    [
        (21, 8, SSM_SHAPES[0]),
        (1, 8, SSM_SHAPES[1]),
        (40, 16, SSM_SHAPES[2]),
        (9, 64, (4, 4, 8, 16)),
    ],
)
@pytest.mark.parametrize(
    "one_pass,shared",
    [(False, False), (True, False), (True, True)],
    ids=["two_phase", "one_pass", "one_pass_shared_scores"],
)
def test_mamba2_scan_matches_xla(t, chunk, shape, dtype, one_pass, shared):
    from backends.pallas.ssd import mamba2_scan_tiled

    nh, g, p, ns = shape
    args = _ssm_inputs(_rng(6, t, nh), 2, t, nh, p, g, ns, dtype)
    scan = functools.partial(mamba2_scan_tiled, block_p=4, one_pass=one_pass, shared_scores=shared)
    y, h = jax.jit(scan, static_argnums=(7,))(*args, chunk)
    y_ref, h_ref = _jit("mamba2_scan", "xla", (7,))(*args, chunk)
    _finite(y, h)
    assert y.dtype == args[0].dtype and h.dtype == jnp.float32
    _close(y, y_ref, TOL[dtype])
    _close(h, h_ref, TOL[dtype])


def test_mamba2_scan_padding_rows_leave_the_state_right():
    # A variable-length batch: row 1 has 5 valid tokens of 13, row 2 none (all padding).
    x, dt, a, b, c, d, h0 = _ssm_inputs(_rng(7), 3, 13, 6, 8, 2, 16, jnp.float32)
    valid = jnp.arange(13)[None, :] < jnp.array([13, 5, 0])[:, None]
    x = jnp.where(valid[:, :, None, None], x, 0.0)
    dt = jnp.where(valid[:, :, None], dt, 0.0)
    y, h = _jit("mamba2_scan", "pallas", (7,))(x, dt, a, b, c, d, h0, 8)
    _finite(y, h)
    _, h_short = _jit("mamba2_scan", "xla", (7,))(
        x[1:2, :5], dt[1:2, :5], a, b[1:2, :5], c[1:2, :5], d, h0[1:2], 8
    )
    _close(h[1:2], h_short, 1e-5)
    _close(h[2], h0[2], 1e-6)
    y_ref, h_ref = _jit("mamba2_scan", "xla", (7,))(x, dt, a, b, c, d, h0, 8)
    _close(y, y_ref, 1e-5)
    _close(h, h_ref, 1e-5)


# --- norms ---------------------------------------------------------------------------------


# Leading dims flattened to rows that are not a multiple of the row tile; D = 80/96 (padded to
# 128), D = 1, D = 8192 (a one-row tile); weights in the input dtype and in float32 (promotes).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 80), (2, 3, 96), (5, 1), (3, 8192), (1, 1, 128)])
def test_rms_norm_matches_xla(shape, dtype):
    rng = _rng(8, *shape)
    x = jnp.asarray(rng.standard_normal(shape) * 3 + 0.5, dtype)
    for w_dtype in (dtype, jnp.float32):
        w = jnp.asarray(rng.uniform(0.5, 1.5, shape[-1]), w_dtype)
        got = _jit("rms_norm", "pallas", (2,))(x, w, 1e-5)
        ref = _jit("rms_norm", "xla", (2,))(x, w, 1e-5)
        _finite(got)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        _close(got, ref, TOL[dtype])


# Groups whose size is not a power of two (24, 80, 3), one group, many small groups.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lead,inner,group", [((37,), 96, 24), ((2, 5), 160, 80), ((3,), 64, 64), ((4,), 12, 3)]
)
def test_gated_rms_norm_matches_xla(lead, inner, group, dtype):
    rng = _rng(9, inner, group)
    y = jnp.asarray(rng.standard_normal((*lead, inner)) * 2, dtype)
    z = jnp.asarray(rng.standard_normal((*lead, inner)) * 2, dtype)
    w = jnp.asarray(rng.uniform(0.5, 1.5, inner), dtype)
    got = _jit("gated_rms_norm", "pallas", (3, 4))(y, z, w, 1e-5, group)
    ref = _jit("gated_rms_norm", "xla", (3, 4))(y, z, w, 1e-5, group)
    _finite(got)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    _close(got, ref, TOL[dtype])


def test_gated_rms_norm_rejects_a_bad_group_size():
    y = jnp.ones((2, 12), jnp.float32)
    with pytest.raises(ValueError, match="group_size"):
        get_op("gated_rms_norm", "pallas")(y, y, jnp.ones(12), 1e-5, 5)


# --- grouped matmul ------------------------------------------------------------------------


# Experts with no rows (first, last, in the middle, all but one), M not a multiple of the row
# tile, a row tile spanning many experts, Din/Dout not powers of two (80 -> 128, 200 -> 256,
# Dout = 96 -> two column tiles of 64) and Din > the K tile (a loop over K).
GMM_CASES = [
    ((0, 5, 0, 0, 33, 0, 7, 0), 80, 96),
    ((0, 0, 45, 0), 200, 24),
    ((1,) * 20 + (17,), 24, 40),
    ((3,), 16, 16),
    ((50, 0, 13), 7, 130),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes,din,dout", GMM_CASES)
def test_grouped_matmul_matches_xla(sizes, din, dout, dtype):
    rng = _rng(10, len(sizes), din, dout)
    sizes = jnp.asarray(sizes, jnp.int32)
    x = jnp.asarray(rng.standard_normal((int(sizes.sum()), din)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), din, dout)) / np.sqrt(din), dtype)
    got = _jit("grouped_matmul", "pallas")(x, w, sizes)
    ref = _jit("grouped_matmul", "xla")(x, w, sizes)
    _finite(got)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    _close(got, ref, TOL[dtype])


def test_grouped_matmul_rows_past_the_groups_are_zero():
    # group_sizes sum to 30 < M = 41: ragged_dot leaves the last 11 rows zero.
    rng = _rng(11)
    sizes = jnp.asarray([10, 0, 20], jnp.int32)
    x = jnp.asarray(rng.standard_normal((41, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 24, 40)), jnp.float32)
    got = _jit("grouped_matmul", "pallas")(x, w, sizes)
    _finite(got)
    _close(got, _jit("grouped_matmul", "xla")(x, w, sizes), 1e-5)
    np.testing.assert_array_equal(np.asarray(got[30:]), 0.0)


# --- GPU lowering ----------------------------------------------------------------------------

S = jax.ShapeDtypeStruct


def _one_pass_scan(*args, block_p: int = 32, shared_scores: bool = False):
    from backends.pallas.ssd import mamba2_scan_tiled

    return mamba2_scan_tiled(*args, block_p=block_p, one_pass=True, shared_scores=shared_scores)


def _split_conv(*args):
    from backends.pallas.conv import causal_conv1d_tiled

    return causal_conv1d_tiled(*args, block_t=16, split_first=True)


def _split_scan(*args):
    from backends.pallas.ssd_split import mamba2_scan_split

    return mamba2_scan_split(*args)


BF, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
# Awkward shapes: widths 3 (state not a power of two), C = 70, T = 37/100, P = 6, Ns = 12,
# D = 80/96, groups of 24, M = 5/100, Din = 24/200, Dout = 40/96.
LOWERING_CASES = {
    "causal_conv1d": (
        lambda x, s, w, b, n: get_op("causal_conv1d", "pallas")(x, s, w, b, n, "silu"),
        (S((4, 37, 70), BF), S((4, 70, 2), BF), S((70, 3), BF), S((70,), BF), S((4,), I32)),
    ),
    "causal_conv1d_split_first": (
        lambda x, s, w, b, n: _split_conv(x, s, w, b, n, "silu"),
        (S((4, 37, 70), BF), S((4, 70, 2), BF), S((70, 3), BF), S((70,), BF), S((4,), I32)),
    ),
    "causal_conv1d_step": (
        lambda x, s, w, b: get_op("causal_conv1d_step", "pallas")(x, s, w, b, None),
        (S((4, 70), BF), S((4, 70, 3), BF), S((70, 4), BF), S((70,), BF)),
    ),
    "mamba2_step": (
        lambda *args: get_op("mamba2_step", "pallas")(*args),
        (S((3, 6, 6, 12), F32), S((3, 6, 6), BF), S((3, 6), BF), S((6,), F32))
        + (S((3, 3, 12), BF), S((3, 3, 12), BF), S((6,), F32)),
    ),
    "mamba2_scan": (
        lambda *args: get_op("mamba2_scan", "pallas")(*args, 64),
        (S((2, 100, 6, 64), BF), S((2, 100, 6), BF), S((6,), F32), S((2, 100, 1, 128), BF))
        + (S((2, 100, 1, 128), BF), S((6,), F32), S((2, 6, 64, 128), F32)),
    ),
    "mamba2_scan_one_pass": (
        lambda *args: _one_pass_scan(*args, 64),
        (S((2, 100, 6, 64), BF), S((2, 100, 6), BF), S((6,), F32), S((2, 100, 1, 128), BF))
        + (S((2, 100, 1, 128), BF), S((6,), F32), S((2, 6, 64, 128), F32)),
    ),
    "mamba2_scan_p80_in_slices_of_16": (  # P = 80 unpadded: five slices of 16
        lambda *args: _one_pass_scan(*args, 64, block_p=16),
        (S((1, 100, 6, 80), BF), S((1, 100, 6), BF), S((6,), F32), S((1, 100, 1, 128), BF))
        + (S((1, 100, 1, 128), BF), S((6,), F32), S((1, 6, 80, 128), F32)),
    ),
    "mamba2_scan_p80": (  # the registered op picks slices of 16 for P = 80
        lambda *args: get_op("mamba2_scan", "pallas")(*args, 64),
        (S((1, 100, 6, 80), BF), S((1, 100, 6), BF), S((6,), F32), S((1, 100, 2, 128), BF))
        + (S((1, 100, 2, 128), BF), S((6,), F32), S((1, 6, 80, 128), F32)),
    ),
    "mamba2_scan_shared_scores": (  # c b^T once per group and chunk, P 80 in slices of 16
        lambda *args: _one_pass_scan(*args, 64, block_p=16, shared_scores=True),
        (S((1, 100, 6, 80), BF), S((1, 100, 6), BF), S((6,), F32), S((1, 100, 2, 128), BF))
        + (S((1, 100, 2, 128), BF), S((6,), F32), S((1, 6, 80, 128), F32)),
    ),
    "mamba2_scan_split": (  # one sequence in 4 pieces, joined
        lambda *args: _split_scan(*args, 64, 4),
        (S((1, 100, 6, 80), BF), S((1, 100, 6), BF), S((6,), F32), S((1, 100, 1, 128), BF))
        + (S((1, 100, 1, 128), BF), S((6,), F32), S((1, 6, 80, 128), F32)),
    ),
    "mamba2_step_paged": (
        lambda *args: get_op("mamba2_step_paged", "pallas")(*args, 37, 8),
        (S((1, 512, 48), I32), S((3,), I32), S((3,), I32), S((3, 4, 80), BF), S((3, 4), F32))
        + (S((4,), F32), S((3, 2, 128), BF), S((3, 2, 128), BF), S((4,), F32)),
    ),
    "mamba2_step_paged_16gib_region": (  # offsets past 2**32 bytes: 64-bit indexing
        lambda *args: get_op("mamba2_step_paged", "pallas")(*args, 37, 8),
        (S((1, 2**26, 64), I32), S((3,), I32), S((3,), I32), S((3, 4, 80), BF), S((3, 4), F32))
        + (S((4,), F32), S((3, 2, 128), BF), S((3, 2, 128), BF), S((4,), F32)),
    ),
    "rms_norm": (
        lambda x, w: get_op("rms_norm", "pallas")(x, w, 1e-6),
        (S((3, 37, 80), BF), S((80,), BF)),
    ),
    "gated_rms_norm": (
        lambda y, z, w: get_op("gated_rms_norm", "pallas")(y, z, w, 1e-6, 24),
        (S((37, 96), BF), S((37, 96), BF), S((96,), BF)),
    ),
    "grouped_matmul": (
        lambda x, w, n: get_op("grouped_matmul", "pallas")(x, w, n),
        (S((100, 200), BF), S((6, 200, 96), BF), S((6,), I32)),
    ),
    "paged_attention_decode": (
        lambda q, kp, vp, t, p, n: get_op("paged_attention", "pallas")(
            q, kp, vp, t, p, n, 0.1, None
        ),
        (S((5, 1, 8, 128), BF), S((40, 2, 16, 128), BF), S((40, 2, 16, 128), BF))
        + (S((5, 7), I32), S((5, 1), I32), S((5,), I32)),
    ),
    "paged_attention_rel_window": (
        lambda q, kp, vp, t, p, n, rq, rt: get_op("paged_attention", "pallas")(
            q, kp, vp, t, p, n, 0.1, 48, rq, rt, RelativeBias(20, 8, 512)
        ),
        (S((2, 37, 4, 80), BF), S((40, 1, 32, 80), BF), S((40, 1, 32, 80), BF))
        + (S((2, 7), I32), S((2, 37), I32), S((2,), I32), S((2, 37, 4, 24), BF))
        + (S((20, 24), BF),),
    ),
    "grouped_matmul_f32": (
        lambda x, w, n: get_op("grouped_matmul", "pallas")(x, w, n),
        (S((5, 24), F32), S((3, 24, 40), F32), S((3,), I32)),
    ),
}


@pytest.mark.parametrize("op", sorted(LOWERING_CASES))
def test_kernel_lowers_to_triton_for_gpu(op, monkeypatch):
    """Lower for CUDA on this machine (no GPU needed): the Pallas -> Triton lowering checks the
    power-of-two tile rule and the supported primitives. Compiling to PTX needs a GPU."""
    monkeypatch.setenv("HYBRIDSERVE_PALLAS_INTERPRET", "0")
    # Fresh lambdas: jax caches a traced function's jaxpr, and the interpret choice is made at
    # trace time (the interpret-mode tests above trace the same ops).
    fn, args = LOWERING_CASES[op]
    assert_lowers_to_triton(fn, *args)


# --- registry --------------------------------------------------------------------------------


def _has_pallas(op: str) -> bool:
    try:
        get_op(op, "pallas")
    except BackendError:
        return False
    return True


def test_load_ops_with_fallback_uses_the_pallas_kernels():
    from backends.pallas import conv, moe, norm, ssd

    ops = load_ops("pallas", fallback="xla")
    assert ops.backend == "pallas"
    assert ops.causal_conv1d is conv.causal_conv1d
    assert ops.causal_conv1d_step is conv.causal_conv1d_step
    assert ops.mamba2_step is ssd.mamba2_step
    assert ops.mamba2_scan is ssd.mamba2_scan
    assert ops.rms_norm is norm.rms_norm
    assert ops.gated_rms_norm is norm.gated_rms_norm
    assert ops.grouped_matmul is moe.grouped_matmul
    missing = [op for op in OP_SIGNATURES if not _has_pallas(op)]
    for op in missing:  # not a pallas kernel: the reference, and load_ops("pallas") refuses
        assert getattr(ops, op) is get_op(op, "xla")
    if missing:
        with pytest.raises(BackendError, match=f"has no implementation of op '{missing[0]}'"):
            load_ops("pallas")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,pieces,shape", [(37, 4, SSM_SHAPES[0]), (48, 3, SSM_SHAPES[2])])
def test_mamba2_scan_split_matches_xla(t, pieces, shape, dtype):
    """Sequences cut into pieces scanned side by side and joined (`ssd_split`) equal the
    unsplit xla scan: a length that does not divide (padded last piece), groups, P and N that
    need padding, a random start state."""
    from backends.pallas.ssd_split import mamba2_scan_split

    nh, g, p, ns = shape
    args = _ssm_inputs(_rng(9, t, nh), 2, t, nh, p, g, ns, dtype)
    y, h = jax.jit(mamba2_scan_split, static_argnums=(7, 8))(*args, 8, pieces)
    y_ref, h_ref = _jit("mamba2_scan", "xla", (7,))(*args, 8)
    _finite(y, h)
    assert y.shape == y_ref.shape and y.dtype == args[0].dtype and h.dtype == jnp.float32
    _close(y, y_ref, TOL[dtype])
    _close(h, h_ref, TOL[dtype])
