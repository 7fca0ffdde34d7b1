"""FP8 ops (`backends.fp8`): the xla references against numpy with ml_dtypes' e4m3 (an
implementation we did not write), then every backend against xla, and paged attention over
e4m3 KV pages.

Tolerances: the reference against numpy, float32: 1e-5 of the largest |output| (summation
order; both round the same e4m3 codes, so no fp8 rounding enters). Backends against xla: as
the shared suite (float32 2e-5, bfloat16 2e-2 of the largest |output|).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from paged_inputs import paged_inputs
from test_shared_suite import BACKENDS, _both, _check, _ops, _rng

from backends import fp8
from backends.fused import Norm
from backends.protocol import get_op

E4M3 = ml_dtypes.float8_e4m3fn


def _np_fake_quant(x: np.ndarray, scale: float | np.ndarray) -> np.ndarray:
    v = np.clip(x.astype(np.float32) / np.float32(scale), -448, 448)
    return v.astype(E4M3).astype(np.float32) * np.float32(scale)


def test_quantize_saturates_and_rounds_like_ml_dtypes():
    """Values past 448 * scale saturate (a plain cast gives NaN); the rest round as ml_dtypes
    rounds (nearest even), subnormals included."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000) * 50, [1e6, -1e6, 3e-4, -2e-5]])
    scale = np.float32(0.37)
    got = np.asarray(fp8.quantize(jnp.asarray(x, jnp.float32), scale).astype(jnp.float32))
    want = np.clip(x.astype(np.float32) / scale, -448, 448).astype(E4M3).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert got[-4] == 448 and got[-3] == -448
    assert np.isnan(np.asarray(jnp.asarray([1e6], jnp.float32).astype(jnp.float8_e4m3fn), float))
    normal = (np.abs(x / scale) >= 2**-6) & (np.abs(x / scale) <= 448)
    rel = np.abs(got * scale - x)[normal] / np.abs(x)[normal]
    assert rel.max() <= 2**-4  # the bound the module docstring states


def _linear_inputs(rng, m, k, n, per_row):
    x = rng.standard_normal((m, k)).astype(np.float32) * 2
    w = rng.standard_normal((n, k)).astype(np.float32)
    w_scale = np.abs(w).max(axis=1) / 448 if per_row else np.float32(np.abs(w).max() / 448)
    w8 = (w / (w_scale[:, None] if per_row else w_scale)).astype(E4M3)
    return x, w8, np.asarray(w_scale, np.float32), np.float32(np.abs(x).max() / 300)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("x_quant", [True, False])
def test_fp8_linear_reference_matches_numpy(per_row, x_quant):
    rng = _rng("fp8_linear", per_row, x_quant)
    x, w8, ws, xs = _linear_inputs(rng, 7, 48, 20, per_row)
    bias = rng.standard_normal(20).astype(np.float32)
    got = get_op("fp8_linear", "xla")(
        jnp.asarray(x), jnp.asarray(w8), jnp.asarray(ws), jnp.asarray(xs) if x_quant else None,
        jnp.asarray(bias), activation="silu",
    )  # fmt: skip
    h = _np_fake_quant(x, xs) if x_quant else x
    y = (h @ w8.astype(np.float32).T) * (ws[None, :] if per_row else ws) + bias
    want = y / (1 + np.exp(-y))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_fp8_grouped_matmul_reference_matches_numpy():
    rng = _rng("fp8_gmm")
    sizes = np.array([3, 0, 5, 2], np.int32)
    e, k, n, m = len(sizes), 32, 24, int(sizes.sum()) + 2  # two rows past the groups
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((e, k, n)).astype(np.float32)
    ws = (np.abs(w).max(axis=(1, 2)) / 448).astype(np.float32)
    w8 = (w / ws[:, None, None]).astype(E4M3)
    xs = rng.uniform(0.005, 0.02, e).astype(np.float32)
    got = np.asarray(
        get_op("fp8_grouped_matmul", "xla")(
            *map(jnp.asarray, (x, w8, ws, xs, sizes))  # noqa: B008
        )
    )
    want = np.zeros((m, n), np.float32)
    start = 0
    for j, size in enumerate(sizes):
        rows = slice(start, start + size)
        want[rows] = (_np_fake_quant(x[rows], xs[j]) @ w8[j].astype(np.float32)) * ws[j]
        start += size
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert not got[sizes.sum() :].any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_linear_backends_match_xla(backend, rows, dtype):
    """With the fused norm (group RMSNorm) and residual, per-row weight scales; one row is the
    pallas GEMV over e4m3 rows, five its reference."""
    ref_op, op = _ops("fp8_linear", backend)
    rng = _rng("fp8_linear_backend", rows, str(dtype))
    x, w8, ws, xs = _linear_inputs(rng, rows, 64, 24, True)
    residual = jnp.asarray(rng.standard_normal((rows, 24)), dtype)
    norm_w = jnp.asarray(rng.uniform(0.5, 1.5, 64), dtype)
    static = {"norm": Norm(norm_w, 1e-5, group_size=16), "scale": 0.5}
    arrays = (jnp.asarray(x, dtype), jnp.asarray(w8), jnp.asarray(ws), jnp.asarray(xs))
    wrap = lambda f: lambda x, w, s, t, r, **kw: f(x, w, s, t, residual=r, **kw)  # noqa: E731
    ref, got = _both(wrap(ref_op), wrap(op), static, *arrays, residual)
    assert got.dtype == ref.dtype == dtype
    _check(got, ref, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_grouped_matmul_backends_match_xla(backend, dtype):
    """Negative and subnormal e4m3 weights, an empty expert, rows past the groups (zeros), K
    and N not whole tiles."""
    ref_op, op = _ops("fp8_grouped_matmul", backend)
    rng = _rng("fp8_gmm_backend", str(dtype))
    sizes = np.array([2, 4, 0, 3], np.int32)
    x = jnp.asarray(rng.standard_normal((11, 40)), dtype)
    w8 = jnp.asarray(rng.standard_normal((4, 40, 20)) * 60, jnp.float8_e4m3fn)
    ws = jnp.asarray(rng.uniform(0.001, 0.01, 4), jnp.float32)
    xs = jnp.asarray(rng.uniform(0.005, 0.02, 4), jnp.float32)
    ref, got = _both(ref_op, op, {}, x, w8, ws, xs, jnp.asarray(sizes))
    _check(got, ref, dtype)
    assert not np.asarray(got, np.float32)[sizes.sum() :].any()


@pytest.mark.parametrize("rel", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_reads_e4m3_pages(backend, rel):
    """bf16 queries over e4m3 K/V pages (NaN bytes in every slot no query may see), against
    the xla reference on the same pages."""
    from backends.protocol import RelativeBias

    ref_op, op = _ops("paged_attention", backend)
    rng = _rng("paged_fp8", rel)
    page, bsz, t = 8, 3, 5
    starts, kv_len = np.array([0, 11, 2 * page]), np.array([t, 11 + t, 2 * page + 1])
    arrays, kv_len, rq, tab = paged_inputs(
        rng, bsz, t, 8, 2, 64, page, jnp.bfloat16, starts, kv_len
    )
    q, kp, vp, table, pos = arrays
    pages = (kp.astype(jnp.float8_e4m3fn), vp.astype(jnp.float8_e4m3fn))
    assert np.isnan(np.asarray(pages[0], np.float32)).any()  # the poison survives the cast
    static = {"scale": 64**-0.5, "sliding_window": None}
    args = (q, *pages, table, pos, kv_len)
    if rel:
        static["rel_bias"] = RelativeBias(num_buckets=12, num_exact=3, max_distance=20)
        with_rel = lambda f: lambda *a, **kw: f(*a[:6], rel_q=a[6], rel_table=a[7], **kw)  # noqa: E731
        ref, got = _both(with_rel(ref_op), with_rel(op), static, *args, rq, tab)
    else:
        ref, got = _both(ref_op, op, static, *args)
    assert got.dtype == jnp.bfloat16
    _check(got, ref, jnp.bfloat16)
    assert np.isfinite(np.asarray(jax.numpy.asarray(got, jnp.float32))).all()
