"""NVFP4 expert weights: the e2m1 / e4m3 decoding against their bit-level definitions, the
quantisation error against the e2m1 grid's own bound (computed here in numpy), the block-planar
packing, and the fused `nvfp4_grouped_matmul` of every backend against dequantise-then-matmul
(float32 within 1e-5, bfloat16 within 2e-2 of the output scale)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from backends import nvfp4
from backends.protocol import get_op


def _weights(seed: int, e: int = 3, k: int = 64, n: int = 40) -> jax.Array:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((e, k, n)) * rng.uniform(0.01, 10, (e, 1, n))  # column scales vary
    w[0, 5, 3] = 80.0  # an outlier: its block gets a large scale
    w[-1, 32:48] = 0.0  # an all-zero scale group
    return jnp.asarray(w, jnp.float32)


def test_e2m1_codes_decode_to_sign_exponent_mantissa():
    for code in range(16):
        sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
        mag = man / 2 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
        assert float(nvfp4.e2m1_value(jnp.uint8(code))) == (-mag if sign else mag)


def test_quantisation_error_is_within_the_e2m1_grid_bound():
    w = _weights(1)
    q = nvfp4.quantize(w)
    assert q.codes.dtype == jnp.uint8 and q.scales.dtype == jnp.float8_e4m3fn
    assert q.codes.shape == (3, 32, 40) and q.scales.shape == (3, 4, 40) and q.shape == w.shape
    got = np.asarray(nvfp4.dequantize(q), np.float64)
    wn = np.asarray(w, np.float64)
    scale = np.repeat(np.asarray(q.scales).astype(np.float64), 16, axis=1)
    full = scale * np.asarray(q.tensor_scale, np.float64)[:, None, None]
    assert np.isfinite(full).all() and (np.asarray(q.scales, np.float32) <= 448).all()
    ratio = np.abs(wn) / np.where(full > 0, full, 1)
    assert (ratio <= 6 * (1 + 1e-6)).all(), "a value was clipped"
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    upper = np.clip(np.searchsorted(grid, ratio, side="right"), 1, 7)
    half_gap = (grid[upper] - grid[upper - 1]) / 2
    bound = half_gap * full * (1 + 1e-5) + 1e-30
    assert (np.abs(got - wn) <= bound).all()
    np.testing.assert_array_equal(got[-1, 32:48], 0.0)  # a zero group stays exactly zero
    assert np.abs(got - wn).max() > 0  # it is a lossy format: the check is not vacuous


def test_packing_is_block_planar_and_round_trips():
    codes = jnp.asarray(np.random.default_rng(2).integers(0, 16, (2, 64, 8)), jnp.uint8)
    packed = nvfp4._pack(codes)
    assert packed.shape == (2, 32, 8)
    c, p = np.asarray(codes), np.asarray(packed)
    for j in range(2):  # byte row 16 j + r: row 32 j + r (low nibble), 32 j + 16 + r (high)
        for r in range(16):
            np.testing.assert_array_equal(p[:, 16 * j + r] & 15, c[:, 32 * j + r])
            np.testing.assert_array_equal(p[:, 16 * j + r] >> 4, c[:, 32 * j + 16 + r])
    np.testing.assert_array_equal(np.asarray(nvfp4.unpack(packed)), c)


def test_e4m3_scales_read_back_exactly_in_the_kernel_decoder():
    from backends.pallas._common import e4m3_value

    bits = np.arange(0, 0x7F, dtype=np.uint8)  # every non-negative finite e4m3 value
    want = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(e4m3_value(jnp.asarray(bits))), want)


def test_k_must_be_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        nvfp4.quantize(jnp.ones((1, 48, 4)))


@pytest.mark.parametrize("backend", ["pallas", "torch"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_fused_matmul_equals_dequantise_then_matmul(backend, dtype, tol):
    q = nvfp4.quantize(_weights(3, e=4, k=96, n=72))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((45, 96)), dtype)
    sizes = jnp.asarray([10, 0, 30, 3], jnp.int32)  # an empty expert; 2 rows past the groups
    dense = nvfp4.dequantize(q).astype(dtype)
    ref = get_op("grouped_matmul", "xla")(x, dense, sizes)
    got = jax.jit(get_op("nvfp4_grouped_matmul", backend))(x, *q, sizes)
    assert got.dtype == dtype and got.shape == (45, 72)
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.abs(ref).max())
    np.testing.assert_array_equal(got[43:], 0.0)
    xla = np.asarray(jax.jit(get_op("nvfp4_grouped_matmul", "xla"))(x, *q, sizes), np.float64)
    np.testing.assert_allclose(xla, ref, rtol=0, atol=tol * np.abs(ref).max())


def test_fused_kernel_lowers_to_triton(monkeypatch):
    from triton_export import assert_lowers_to_triton

    monkeypatch.setenv("HYBRIDSERVE_PALLAS_INTERPRET", "0")
    s = jax.ShapeDtypeStruct
    args = (s((100, 96), jnp.bfloat16), s((6, 48, 72), jnp.uint8))
    args += (s((6, 6, 72), jnp.float8_e4m3fn), s((6,), jnp.float32), s((6,), jnp.int32))
    assert_lowers_to_triton(lambda *a: get_op("nvfp4_grouped_matmul", "pallas")(*a), *args)
