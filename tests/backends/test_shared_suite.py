"""The shared op suite: every non-reference backend against the `xla` reference.

Each op runs jitted (as the model calls it) on the same random inputs (never zeros; fixed
seeds) for the reference and for each backend available here (`torch`, `pallas`); a backend
that is missing, or lacks an op, is skipped with the registry's reason. Shapes are awkward on
purpose: window and cache edges, query rows with no visible key, chunk boundaries (T not a
multiple of chunk_size, T = 1), padding rows and zero-length rows, GQA ratios 1/4/8, head dims
64/80/128, conv widths 2..4, one and several ssm groups.

The ops are functional (they return fresh arrays), so instead of poisoning output buffers the
suite checks that every output is finite wherever the reference is, and that padding tokens
of the scan leave the state unchanged.

Tolerances (`TOLERANCE`, absolute, as a fraction of the largest |reference| of each output):
float32 2e-5, bfloat16 2e-2.
"""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_inputs import paged_inputs as _paged_inputs

from backends.protocol import BackendError, RelativeBias, get_op

TOLERANCE = {
    jnp.dtype(jnp.float32): 2e-5,  # float32 throughout: only summation order differs
    jnp.dtype(jnp.bfloat16): 2e-2,  # bfloat16 inputs/outputs: one or two bf16 ulps
}
BACKENDS = ["torch", "pallas"]
FP_DTYPES = [jnp.float32, jnp.bfloat16]


def _ops(op: str, backend: str):
    """(reference, candidate) implementations of `op`; skips when the backend has none."""
    try:
        candidate = get_op(op, backend)
    except BackendError as err:
        pytest.skip(str(err))
    return get_op(op, "xla"), candidate


def _rng(*key: object) -> np.random.Generator:
    """A generator seeded from the test's parameters (crc32: the same in every process)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _check(got, ref, dtype, mask=None):
    """`got` equals `ref` within the dtype's tolerance (on `mask`'s positions), and is finite
    everywhere the reference is."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert got.shape == ref.shape
    finite = np.isfinite(ref)
    assert np.isfinite(got[finite]).all(), "non-finite output where the reference is finite"
    if mask is not None:
        got, ref = got[mask], ref[mask]
    scale = max(np.abs(ref).max(initial=0.0), 1e-6)
    np.testing.assert_allclose(got, ref, rtol=0, atol=TOLERANCE[jnp.dtype(dtype)] * scale)


_REFERENCES: dict[tuple, object] = {}


def _reference(key: tuple, compute):
    """`compute()` (the reference's outputs) once per `key` for the module: every backend's
    case with the same parameters has the same inputs (seeded by them), so the reference is
    computed and compiled once for all backends."""
    if key not in _REFERENCES:
        _REFERENCES[key] = compute()
    return _REFERENCES[key]


def _digest(*arrays) -> tuple:
    return tuple(
        (a.shape, str(a.dtype), zlib.crc32(np.asarray(a).tobytes())) if hasattr(a, "shape") else a
        for a in arrays
    )


def _both(ref_op, op, static: dict, *arrays):
    """Both ops jitted with `static` keyword arguments bound, on the same arrays (the
    reference's outputs computed once for all backends)."""
    run = lambda f: jax.jit(lambda *a: f(*a, **static))(*arrays)  # noqa: E731
    key = (ref_op.__qualname__, repr(sorted(static.items())), _digest(*arrays))
    return _reference(key, lambda: run(ref_op)), run(op)


# --- norms --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FP_DTYPES)
@pytest.mark.parametrize("shape", [(3, 32), (2, 5, 80)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm(backend, shape, dtype):
    ref_op, op = _ops("rms_norm", backend)
    rng = _rng("rms", shape)
    x = jnp.asarray(rng.standard_normal(shape) * 3, dtype)
    w = jnp.asarray(rng.uniform(0.5, 1.5, shape[-1]), dtype)
    ref, got = _both(ref_op, op, {"eps": 1e-5}, x, w)
    assert got.dtype == ref.dtype
    _check(got, ref, dtype)


@pytest.mark.parametrize("dtype", FP_DTYPES)
@pytest.mark.parametrize("inner,group", [(32, 32), (32, 8), (96, 24)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_rms_norm(backend, inner, group, dtype):
    ref_op, op = _ops("gated_rms_norm", backend)
    rng = _rng("gated", inner, group)
    y = jnp.asarray(rng.standard_normal((2, 3, inner)), dtype)
    z = jnp.asarray(rng.standard_normal((2, 3, inner)), dtype)
    w = jnp.asarray(rng.uniform(0.5, 1.5, inner), dtype)
    ref, got = _both(ref_op, op, {"eps": 1e-5, "group_size": group}, y, z, w)
    assert got.dtype == ref.dtype
    _check(got, ref, dtype)


# --- causal conv ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FP_DTYPES)
@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_conv1d(backend, width, t, dtype):
    ref_op, op = _ops("causal_conv1d", backend)
    rng = _rng("conv", width, t)
    bsz, ch = 4, 12
    x = jnp.asarray(rng.standard_normal((bsz, t, ch)), dtype)
    state = jnp.asarray(rng.standard_normal((bsz, ch, width - 1)), dtype)
    w = jnp.asarray(rng.standard_normal((ch, width)), dtype)
    lengths = np.array([t, max(t - 3, 1), 0, 1], np.int32)  # full, padded, zero-length, one
    valid = np.arange(t)[None, :] < lengths[:, None]
    for bias, activation in [(jnp.asarray(rng.standard_normal(ch), dtype), "silu"), (None, None)]:
        static = {"bias": bias, "activation": activation}
        call = lambda f, static=static: jax.jit(  # noqa: E731
            lambda x_, s_, w_, n_: f(x_, s_, w_, lengths=n_, **static)
        )(x, state, w, jnp.asarray(lengths))
        key = ("conv", width, t, str(dtype), activation)
        (y_ref, s_ref), (y, s) = _reference(key, lambda call=call: call(ref_op)), call(op)
        assert y.dtype == y_ref.dtype and s.dtype == s_ref.dtype
        _check(y, y_ref, dtype, mask=valid)  # padding positions hold garbage
        _check(s, s_ref, dtype)
        # A zero-length row keeps its state as it was.
        np.testing.assert_array_equal(
            np.asarray(s[2], np.float32), np.asarray(state[2], np.float32)
        )
    # The SD state layout ([B, W-1, C]): the same results, the new state also in SD.
    y_sd, s_sd = jax.jit(lambda *a: op(*a, None, "SD"))(
        x, jnp.swapaxes(state, 1, 2), w, None, jnp.asarray(lengths)
    )
    _check(y_sd, y, dtype, mask=valid)
    np.testing.assert_array_equal(np.asarray(jnp.swapaxes(s_sd, 1, 2)), np.asarray(s))


@pytest.mark.parametrize("dtype", FP_DTYPES)
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_conv1d_step(backend, width, dtype):
    ref_op, op = _ops("causal_conv1d_step", backend)
    rng = _rng("conv_step", width)
    bsz, ch = 3, 20
    x = jnp.asarray(rng.standard_normal((bsz, ch)), dtype)
    state = jnp.asarray(rng.standard_normal((bsz, ch, width - 1)), dtype)
    w = jnp.asarray(rng.standard_normal((ch, width)), dtype)
    bias = jnp.asarray(rng.standard_normal(ch), dtype)
    for static in [{"bias": bias, "activation": "silu"}, {"bias": None, "activation": None}]:
        call = lambda f, static=static: jax.jit(  # noqa: E731
            lambda x_, s_, w_: f(x_, s_, w_, **static)
        )(x, state, w)
        key = ("conv_step", width, str(dtype), static["activation"])
        (y_ref, s_ref), (y, s) = _reference(key, lambda call=call: call(ref_op)), call(op)
        _check(y, y_ref, dtype)
        _check(s, s_ref, dtype)
    # The SD state layout ([B, W-1, C]): the same results, the new state also in SD.
    y_sd, s_sd = jax.jit(lambda *a: op(*a, None, None, "SD"))(x, jnp.swapaxes(state, 1, 2), w)
    _check(y_sd, y, dtype)
    np.testing.assert_array_equal(np.asarray(jnp.swapaxes(s_sd, 1, 2)), np.asarray(s))


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_rejects_an_unknown_state_layout(backend):
    x, state, w = jnp.ones((2, 3, 4)), jnp.ones((2, 4, 2)), jnp.ones((4, 3))
    with pytest.raises(ValueError, match="state_layout"):
        get_op("causal_conv1d", backend)(x, state, w, None, jnp.array([3, 1]), None, "DSX")
    with pytest.raises(ValueError, match="state_layout"):
        get_op("causal_conv1d_step", backend)(x[:, 0], state, w, None, None, "sd")


# --- Mamba2 --------------------------------------------------------------------------------


def _ssm_inputs(rng, bsz, t, nh, p, g, ns, dtype):
    x = rng.standard_normal((bsz, t, nh, p))
    dt = rng.uniform(0.01, 0.3, (bsz, t, nh))
    a = -rng.uniform(1, 8, nh)
    b = rng.standard_normal((bsz, t, g, ns))
    c = rng.standard_normal((bsz, t, g, ns))
    d = rng.uniform(0.5, 1.5, nh)
    h0 = rng.standard_normal((bsz, nh, p, ns))
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    return (
        jnp.asarray(x, dtype),
        f32(dt),
        f32(a),
        jnp.asarray(b, dtype),
        jnp.asarray(c, dtype),
        f32(d),
        f32(h0),
    )


SCAN_CASES = [  # (T, chunk_size, heads, groups, dtype)
    (1, 8, 4, 1, jnp.float32),
    (7, 8, 8, 2, jnp.float32),
    (8, 8, 4, 1, jnp.float32),
    (21, 8, 4, 1, jnp.float32),
    (21, 8, 8, 2, jnp.float32),
    (33, 16, 8, 2, jnp.float32),
    (1, 8, 8, 2, jnp.bfloat16),
    (21, 8, 8, 2, jnp.bfloat16),
]


@pytest.mark.parametrize("t,chunk,nh,g,dtype", SCAN_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba2_scan(backend, nh, g, t, chunk, dtype):
    ref_op, op = _ops("mamba2_scan", backend)
    args = _ssm_inputs(_rng("scan", nh, g, t, chunk), 3, t, nh, 8, g, 16, dtype)
    (y_ref, h_ref), (y, h) = _both(ref_op, op, {"chunk_size": chunk}, *args)
    assert y.dtype == y_ref.dtype and h.dtype == jnp.float32
    _check(y, y_ref, dtype)
    _check(h, h_ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba2_scan_padding_rows_leave_state_unchanged(backend):
    """Row 0 is padded after 9 of 13 tokens, row 1 is all padding (dt = 0, x = 0)."""
    ref_op, op = _ops("mamba2_scan", backend)
    x, dt, a, b, c, d, h0 = _ssm_inputs(_rng("scan_pad"), 2, 13, 4, 8, 2, 16, jnp.float32)
    valid = np.arange(13)[None, :] < np.array([9, 0])[:, None]
    x = jnp.where(valid[:, :, None, None], x, 0.0)
    dt = jnp.where(valid[:, :, None], dt, 0.0)
    (_, h_ref), (_, h) = _both(ref_op, op, {"chunk_size": 8}, x, dt, a, b, c, d, h0)
    _check(h, h_ref, jnp.float32)
    # Row 1 saw only padding: its state is the initial one.
    np.testing.assert_allclose(np.asarray(h[1]), np.asarray(h0[1]), rtol=1e-6, atol=0)
    # Row 0 equals the scan over its 9 valid tokens alone.
    prefix = [v[:1, :9] for v in (x, dt)] + [a] + [v[:1, :9] for v in (b, c)] + [d, h0[:1]]
    _, h_valid = jax.jit(lambda *v: op(*v, chunk_size=8))(*prefix)
    _check(h[:1], h_valid, jnp.float32)


@pytest.mark.parametrize("dtype", FP_DTYPES)
@pytest.mark.parametrize("nh,g", [(4, 1), (8, 2), (4, 4)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba2_step(backend, nh, g, dtype):
    ref_op, op = _ops("mamba2_step", backend)
    x, dt, a, b, c, d, h0 = _ssm_inputs(_rng("step", nh, g), 3, 1, nh, 8, g, 16, dtype)
    (y_ref, h_ref), (y, h) = _both(ref_op, op, {}, h0, x[:, 0], dt[:, 0], a, b[:, 0], c[:, 0], d)
    assert y.dtype == y_ref.dtype and h.dtype == jnp.float32
    _check(y, y_ref, dtype)
    _check(h, h_ref, dtype)


# --- attention -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FP_DTYPES)
@pytest.mark.parametrize("rel", [False, True])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("ratio,head_dim,page", [(1, 64, 4), (4, 80, 8), (8, 128, 16)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention(backend, ratio, head_dim, page, window, rel, dtype):
    """Rows: a prefill chunk from 0, a chunk ending on a page edge, a decode token at a window
    edge (the rest of its row is padding), a padding row (kv_length 0: no visible key), and a
    chunk continuing a long context."""
    ref_op, op = _ops("paged_attention", backend)
    rng = _rng("paged", ratio, head_dim, page, window, rel)
    bsz, t, kv = 5, 6, 2
    starts = np.array([0, 2 * page - t, 8, 0, 3 * page + 1])
    kv_len = np.array([t, 2 * page, 9, 0, 3 * page + 1 + t])  # row 2: one real token
    arrays, kv_len, rq, tab = _paged_inputs(
        rng, bsz, t, kv * ratio, kv, head_dim, page, dtype, starts, kv_len
    )
    static = {"scale": head_dim**-0.5, "sliding_window": window}
    if rel:
        static["rel_bias"] = RelativeBias(num_buckets=12, num_exact=3, max_distance=20)
        with_rel = lambda f: lambda *a, **kw: f(*a[:6], rel_q=a[6], rel_table=a[7], **kw)  # noqa: E731
        ref, got = _both(with_rel(ref_op), with_rel(op), static, *arrays, kv_len, rq, tab)
    else:
        ref, got = _both(ref_op, op, static, *arrays, kv_len)
    assert got.dtype == ref.dtype
    _check(got, ref, dtype)
    assert np.isfinite(np.asarray(got, np.float32)).all()


# --- MoE ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FP_DTYPES)
@pytest.mark.parametrize("sizes", [(3, 0, 5, 2), (0, 0, 7, 0), (1, 1, 1, 1, 1, 1, 1, 1)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_matmul(backend, sizes, dtype):
    ref_op, op = _ops("grouped_matmul", backend)
    rng = _rng("gmm", sizes)
    sizes = np.array(sizes, np.int32)
    x = jnp.asarray(rng.standard_normal((sizes.sum(), 24)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), 24, 40)), dtype)
    ref, got = _both(ref_op, op, {}, x, w, jnp.asarray(sizes))
    assert got.dtype == ref.dtype
    _check(got, ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_matmul_rows_past_the_groups_are_zero(backend):
    """Rows beyond sum(group_sizes) come back as zeros (ragged_dot's contract), whatever the
    kernel leaves there."""
    ref_op, op = _ops("grouped_matmul", backend)
    rng = _rng("gmm-tail", 1)
    sizes = jnp.asarray([4, 0, 3], jnp.int32)
    x = jnp.asarray(rng.standard_normal((13, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 24, 40)), jnp.float32)
    ref, got = _both(ref_op, op, {}, x, w, sizes)
    _check(got, ref, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got[7:]), 0.0)


# --- outside jit ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_calls_match_jitted(backend):
    """Concrete arrays (no jit) take the backend's eager path (DLPack for torch)."""
    ref_op, op = _ops("paged_attention", backend)
    starts, kv_len = np.array([0, 5]), np.array([3, 8])
    args, kv_len, _, _ = _paged_inputs(
        _rng("eager"), 2, 3, 8, 2, 64, 4, jnp.bfloat16, starts, kv_len
    )
    eager = op(*args, kv_len, 0.125, None)
    assert isinstance(eager, jax.Array) and eager.dtype == jnp.bfloat16
    ref = jax.jit(lambda *a: ref_op(*a, 0.125, None))(*args, kv_len)
    _check(eager, ref, jnp.bfloat16)
    ref_op, op = _ops("mamba2_scan", backend)
    args = _ssm_inputs(_rng("eager_scan"), 2, 11, 4, 8, 2, 16, jnp.float32)
    refs = jax.jit(lambda *a: ref_op(*a, 8))(*args)
    for got, ref in zip(op(*args, 8), refs, strict=True):
        _check(got, ref, jnp.float32)


def test_torch_backend_unavailable_without_torch():
    """Without torch, the backend is reported as not available (and `xla` still loads)."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from backends.protocol import BackendError, RelativeBias, get_op, load_ops\n"
        "load_ops('xla')\n"
        "try:\n    get_op('rms_norm', 'torch')\nexcept BackendError as e:\n    print(e)\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "backend 'torch' is not available here" in out.stdout


def test_tokamax_grouped_matmul_matches_xla() -> None:
    """tokamax's ragged_dot as the grouped matmul (where tokamax is installed: Python 3.12 and
    jax >= 0.11.1, the GPU image) against the xla reference, random bf16 inputs with an empty
    group and rows past the groups' total, rtol 2e-2 (bfloat16 products)."""
    pytest.importorskip("tokamax")
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(40, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(4, 32, 24)) / 8, jnp.bfloat16)
    sizes = jnp.asarray([10, 0, 17, 9], jnp.int32)
    got = get_op("grouped_matmul", "tokamax")(x, w, sizes)
    want = get_op("grouped_matmul", "xla")(x, w, sizes)
    rows = int(sizes.sum())
    np.testing.assert_allclose(
        np.asarray(got[:rows], np.float32),
        np.asarray(want[:rows], np.float32),
        rtol=2e-2,
        atol=2e-2,
    )


def test_tokamax_backend_without_tokamax_is_a_clear_error() -> None:
    """Where tokamax is not installed (the CPU CI), asking for it names the backend."""
    try:
        import tokamax  # noqa: F401
    except ImportError:
        with pytest.raises(BackendError, match="backend 'tokamax' is not available here"):
            get_op("grouped_matmul", "tokamax")
    else:
        pytest.skip("tokamax is installed here")
