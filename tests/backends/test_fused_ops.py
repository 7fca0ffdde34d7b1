"""The fused decode ops (`backends.fused`): `linear` and `mamba2_decode_paged`.

`linear` (norm, projection, bias, activation, residual in one op): the xla reference against
numpy in float64 (float32 inputs, 1e-5 of the output scale), and every backend against the
reference on the same random inputs (float32 2e-5, bfloat16 2e-2 of the output scale: one or
two bf16 ulps, as the shared suite), at M = 1 (the GEMV path), M = 3 (tensor cores, rows
padded) and M = 20 (past the kernel's rows: the reference's GEMM), with K and N that no tile
divides.

`mamba2_decode_paged` (one token of the Mamba2 mixer with its conv and ssm states in place):
each backend on a random region (random words everywhere, random states on the pages in use,
never zeros) against a numpy reference that decodes both states from the words itself: y within
the dtype's tolerance, the new conv state bit-for-bit (it is the old one shifted, plus the
input), the new ssm state within 1e-5 of its scale, and every other word of the region (other
pages, the null page, the words between and after the states) bit-for-bit unchanged. DS and SD
conv layouts, bfloat16 and float32 conv states, a padding row on the null page and a fresh row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from triton_export import assert_lowers_to_triton

from backends.fused import MambaDecode, Norm
from backends.protocol import BackendError, get_op

BACKENDS = ["xla", "torch", "pallas"]
TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2}


def _op(name: str, backend: str):
    try:
        return get_op(name, backend)
    except BackendError as err:
        pytest.skip(str(err))


def _close(got, ref, tol: float) -> None:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape and np.isfinite(got).all()
    scale = max(np.abs(ref).max(), 1e-6)
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol * scale)


# --- linear ---------------------------------------------------------------------------------

CASES = {  # name: (norm kind, bias, activation, residual)
    "plain": (None, False, None, False),
    "group_residual": ("group", False, None, True),
    "rms_relu2": ("rms", False, "relu2", False),
    "gated_residual": ("gated", True, None, True),
    "rms_silu_residual": ("rms", True, "silu", True),
}


def _linear_inputs(case: str, m: int, dtype, k: int = 160, n: int = 50):
    kind, bias, act, res = CASES[case]
    rng = np.random.default_rng([m, k, n, len(case)])
    x = jnp.asarray(rng.standard_normal((m, k)) * 2, dtype)
    w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), dtype)
    norm = None
    if kind is not None:
        weight = jnp.asarray(rng.uniform(0.5, 1.5, k), dtype)
        gate = jnp.asarray(rng.standard_normal((m, k + 24)), dtype) if kind == "gated" else None
        # groups of 40 (no power of two above 8 divides them, as Mamba2's 1280) or of 32
        group = {"group": 40, "gated": 32}.get(kind, 0)
        norm = Norm(weight, 1e-5, gate, 24 if gate is not None else 0, group)
    kwargs = dict(
        bias=jnp.asarray(rng.standard_normal(n), dtype) if bias else None,
        norm=norm,
        activation=act,
        residual=jnp.asarray(rng.standard_normal((m, n)), dtype) if res else None,
        scale=0.5 if res else 1.0,
    )
    return x, w, kwargs


def _linear_numpy(x, w, bias, norm, activation, residual, scale):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    if norm is not None:
        if norm.gate is not None:
            z = np.asarray(norm.gate, np.float64)[
                :, norm.gate_offset : norm.gate_offset + x.shape[1]
            ]
            x = x * z / (1 + np.exp(-z))
        if norm.group_size:
            g = x.reshape(x.shape[0], -1, norm.group_size)
            x = (g / np.sqrt((g * g).mean(-1, keepdims=True) + norm.eps)).reshape(x.shape)
        else:
            x = x / np.sqrt((x * x).mean(-1, keepdims=True) + norm.eps)
        x = x * np.asarray(norm.weight, np.float64)
    y = x @ w.T
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    if activation == "relu2":
        y = np.maximum(y, 0) ** 2
    elif activation == "silu":
        y = y / (1 + np.exp(-y))
    return y if residual is None else np.asarray(residual, np.float64) + scale * y


@pytest.mark.parametrize("case", list(CASES))
def test_linear_reference_against_numpy(case):
    x, w, kw = _linear_inputs(case, 3, jnp.float32)
    got = jax.jit(lambda x, w: get_op("linear", "xla")(x, w, **kw))(x, w)
    _close(got, _linear_numpy(x, w, **kw), 1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 20])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["torch", "pallas"])
def test_linear_matches_the_reference(backend, case, m, dtype):
    op = _op("linear", backend)
    x, w, kw = _linear_inputs(case, m, dtype)
    ref = jax.jit(lambda x, w: get_op("linear", "xla")(x, w, **kw))(x, w)
    got = jax.jit(lambda x, w: op(x, w, **kw))(x, w)
    assert got.dtype == ref.dtype == x.dtype
    _close(got.astype(jnp.float32), ref.astype(jnp.float32), TOL[jnp.dtype(dtype)])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bk", [8, 16, 64])
@pytest.mark.parametrize(
    "case,splits",
    [
        ("plain", 1),
        ("plain", 5),
        ("rms_relu2", 1),
        ("group_residual", 1),
        ("group_residual", 2),
        ("group_residual", 4),
        ("gated_residual", 5),
        ("rms_silu_residual", 1),
    ],
)
def test_linear_chunks_and_splits(case, splits, bk, dtype):
    """Chunks inside the norm's groups (a masked tail where bk does not divide them, one
    masked chunk where bk exceeds them) and K split among programs (float32 partials, the
    epilogue after their sum), against the reference."""
    from backends.pallas.linear import linear_tiled

    x, w, kw = _linear_inputs(case, 2, dtype)
    ref = jax.jit(lambda x, w: get_op("linear", "xla")(x, w, **kw))(x, w)
    got = jax.jit(lambda x, w: linear_tiled(x, w, **kw, bn=8, bk=bk, splits=splits))(x, w)
    assert got.dtype == ref.dtype
    _close(got.astype(jnp.float32), ref.astype(jnp.float32), TOL[jnp.dtype(dtype)])


def test_linear_splits_hold_whole_groups():
    from backends.pallas.linear import linear_tiled

    for case, splits in [("rms_relu2", 2), ("group_residual", 3), ("gated_residual", 2)]:
        x, w, kw = _linear_inputs(case, 1, jnp.float32)
        with pytest.raises(ValueError, match="whole"):
            linear_tiled(x, w, **kw, bn=8, bk=16, splits=splits)


def test_linear_leading_axes_and_bad_shapes():
    op = get_op("linear", "pallas")
    x, w, kw = _linear_inputs("rms_silu_residual", 4, jnp.float32)
    flat = op(x, w, **kw)
    kw3 = dict(kw, residual=kw["residual"].reshape(2, 2, -1))
    assert jnp.array_equal(op(x.reshape(2, 2, -1), w, **kw3).reshape(flat.shape), flat)
    with pytest.raises(ValueError, match="does not contract"):
        op(x[:, :-1], w)
    with pytest.raises(ValueError, match="residual"):
        op(x, w, residual=kw["residual"][:, :-1])
    with pytest.raises(ValueError, match="activation"):
        op(x, w, activation="gelu")


# --- mamba2_decode_paged --------------------------------------------------------------------

HS, P, G, NS, W = 4, 6, 2, 8, 4
WIDTH, PAGES = 7, 12  # row words that divide nothing; pages in the region


def _geometry(layout: str, conv_dtype: str) -> MambaDecode:
    ch = HS * P + 2 * G * NS
    conv_words = ch * (W - 1) * jnp.dtype(conv_dtype).itemsize // 4
    ssm_offset = 2 + conv_words + 3  # words between the states
    rows = -(-(ssm_offset + HS * P * NS + 5) // WIDTH)
    xbc, dt, z = 5, 5 + ch + 2, 5 + ch + 2 + HS + 1  # z after dt
    return MambaDecode(HS, P, G, NS, W, xbc, dt, z, layout, conv_dtype, 2, ssm_offset, rows)


def _decode_case(geo: MambaDecode, seed: int):
    rng = np.random.default_rng(seed)
    ch, taps = geo.channels, geo.conv_width - 1
    region = rng.integers(-(2**31), 2**31 - 1, (1, PAGES * geo.page_rows, WIDTH), dtype=np.int32)
    flat = region.reshape(PAGES, -1)
    np_conv = ml_dtypes.bfloat16 if geo.conv_dtype == "bfloat16" else np.float32
    conv = rng.standard_normal((PAGES, ch * taps)).astype(np_conv)
    n = ch * taps * np.dtype(np_conv).itemsize // 4
    flat[:, geo.conv_offset : geo.conv_offset + n] = conv.view(np.int32).reshape(PAGES, n)
    ssm = rng.standard_normal((PAGES, HS * P * NS)).astype(np.float32)
    flat[:, geo.ssm_offset : geo.ssm_offset + HS * P * NS] = ssm.view(np.int32)
    pages = np.array([3, 0, 7, 9], np.int32)  # a padding row on the null page
    fresh = np.array([0, 0, 0, 1], np.int32)  # a reused page: zero states
    cols = jnp.asarray(rng.standard_normal((4, geo.z_offset + HS * P + 3)), jnp.bfloat16)
    weights = (
        jnp.asarray(rng.standard_normal((ch, geo.conv_width)) / 2, jnp.bfloat16),
        jnp.asarray(rng.standard_normal(ch) / 4, jnp.bfloat16),
        jnp.asarray(rng.standard_normal(HS), jnp.float32),
        jnp.asarray(rng.uniform(-1, 1, HS), jnp.float32),
        jnp.asarray(rng.uniform(0.5, 1.5, HS), jnp.float32),
    )
    return region, pages, fresh, cols, weights, np_conv


def _decode_numpy(geo, region, pages, fresh, cols, weights, np_conv):
    """Decode both states from the words, step them, encode them back."""
    region = np.array(region)
    flat = region.reshape(PAGES, -1)
    cw, cb, dt_bias, a_log, d = (np.asarray(v, np.float64) for v in weights)
    ch, taps = geo.channels, geo.conv_width - 1
    n = ch * taps * np.dtype(np_conv).itemsize // 4
    cols = np.asarray(cols.astype(jnp.float32), np.float64)
    ys = np.zeros((len(pages), HS * P))
    for i, page in enumerate(pages):
        words = flat[page, geo.conv_offset : geo.conv_offset + n].copy()
        state = words.view(np_conv).astype(np.float64)
        state = state.reshape(ch, taps) if geo.conv_layout == "DS" else state.reshape(taps, ch).T
        state = np.zeros_like(state) if fresh[i] else state
        # the window is in the input's dtype (`causal_conv1d_step`): a float32 state rounds
        state = np.asarray(jnp.asarray(state, jnp.bfloat16).astype(jnp.float32), np.float64)
        u = cols[i, geo.xbc_offset : geo.xbc_offset + ch]
        window = np.concatenate([state, u[:, None]], axis=1)
        acc = (window * cw).sum(1) + cb
        v = acc / (1 + np.exp(-acc))
        v = np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32), np.float64)  # as stored
        new_conv = window[:, 1:] if geo.conv_layout == "DS" else window[:, 1:].T
        x = v[: HS * P].reshape(HS, P)
        b = v[HS * P : HS * P + G * NS].reshape(G, NS).repeat(HS // G, 0)
        c = v[HS * P + G * NS :].reshape(G, NS).repeat(HS // G, 0)
        raw = cols[i, geo.dt_offset : geo.dt_offset + HS] + dt_bias
        dt = np.logaddexp(raw, 0)
        s = flat[page, geo.ssm_offset : geo.ssm_offset + HS * P * NS].view(np.float32)
        s = np.zeros((HS, P, NS)) if fresh[i] else s.reshape(HS, P, NS).astype(np.float64)
        new = np.exp(-dt * np.exp(a_log))[:, None, None] * s
        new = new + (dt[:, None] * x)[:, :, None] * b[:, None, :]
        y = (np.einsum("hpn,hn->hp", new, c) + d[:, None] * x).reshape(-1)
        z = cols[i, geo.z_offset : geo.z_offset + HS * P]
        ys[i] = y * z / (1 + np.exp(-z))  # the gate of the gated norm
        if page:
            conv_words = new_conv.reshape(-1).astype(np_conv).view(np.int32)
            flat[page, geo.conv_offset : geo.conv_offset + n] = conv_words
            ssm_words = new.reshape(-1).astype(np.float32).view(np.int32)
            flat[page, geo.ssm_offset : geo.ssm_offset + HS * P * NS] = ssm_words
    return ys, region


@pytest.mark.parametrize("conv_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["DS", "SD"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba2_decode_paged(backend, layout, conv_dtype):
    op = _op("mamba2_decode_paged", backend)
    geo = _geometry(layout, conv_dtype)
    region, pages, fresh, cols, weights, np_conv = _decode_case(geo, 7)
    want_y, want = _decode_numpy(geo, region, pages, fresh, cols, weights, np_conv)
    step = jax.jit(lambda r, *a: op(r, *a, geo))
    y, got = step(jnp.asarray(region), jnp.asarray(pages), jnp.asarray(fresh), cols, *weights)
    assert y.shape == (4, HS * P) and y.dtype == cols.dtype
    _close(y.astype(jnp.float32)[pages > 0], want_y[pages > 0], 2e-2)
    got = np.asarray(got).reshape(PAGES, -1)
    want = want.reshape(PAGES, -1)
    ssm = slice(geo.ssm_offset, geo.ssm_offset + HS * P * NS)
    outside = np.ones(want.shape[1], bool)
    outside[ssm] = False
    assert np.array_equal(got[:, outside], want[:, outside])  # conv words exact, the rest kept
    _close(got[:, ssm].view(np.float32), want[:, ssm].view(np.float32), 1e-5)


# --- the kernels lower for CUDA --------------------------------------------------------------


@pytest.mark.parametrize(
    "case,bk,splits",
    [
        ("plain", 32, 1),
        ("plain", 32, 7),
        ("rms_silu_residual", 32, 1),
        ("group_residual", 64, 1),
        ("group_residual", 64, 4),
        ("gated_residual", 64, 5),
    ],
)
def test_linear_lowers_to_triton(case, bk, splits, monkeypatch):
    from backends.pallas.linear import linear_tiled

    monkeypatch.setenv("HYBRIDSERVE_PALLAS_INTERPRET", "0")
    x, w, kw = _linear_inputs(case, 1, jnp.bfloat16, k=4480, n=1000)
    fn = lambda x, w: linear_tiled(x, w, **kw, bn=4, bk=bk, splits=splits)  # noqa: E731
    assert_lowers_to_triton(fn, x, w)


@pytest.mark.parametrize("layout", ["DS", "SD"])
def test_mamba2_decode_paged_lowers_to_triton(layout, monkeypatch):
    monkeypatch.setenv("HYBRIDSERVE_PALLAS_INTERPRET", "0")
    geo = _geometry(layout, "bfloat16")
    region, pages, fresh, cols, weights, _ = _decode_case(geo, 3)
    op = get_op("mamba2_decode_paged", "pallas")
    assert_lowers_to_triton(
        lambda r, *a: op(r, *a, geo), jnp.asarray(region), pages, fresh, cols, *weights
    )
