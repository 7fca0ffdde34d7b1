"""The `xla` reference ops against straightforward float64 numpy loops (random inputs, never
zeros). Tolerances: float32 results within 2e-5 relative to the output scale; bfloat16 inputs
within 2e-2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends import protocol
from backends.protocol import BackendError, RelativeBias, get_op, load_ops, register

OPS = load_ops("xla")
RNG = np.random.default_rng(0)


def _close(got, ref, rel=2e-5):
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got, ref, rtol=0, atol=rel * max(np.abs(ref).max(), 1e-6))


def _ssm_reference(x, dt, a, b, c, d, h0):
    """Token-by-token Mamba2 recurrence in float64."""
    bsz, t, nh, p = x.shape
    rep = nh // b.shape[2]
    h = h0.astype(np.float64).copy()
    y = np.zeros((bsz, t, nh, p))
    for s in range(t):
        bh = np.repeat(b[:, s], rep, axis=1)  # [B, Hs, Ns]
        ch = np.repeat(c[:, s], rep, axis=1)
        decay = np.exp(dt[:, s] * a)  # [B, Hs]
        h = decay[:, :, None, None] * h + (dt[:, s, :, None] * x[:, s])[..., None] * bh[:, :, None]
        y[:, s] = np.einsum("bhpn,bhn->bhp", h, ch) + d[None, :, None] * x[:, s]
    return y, h


def _ssm_inputs(bsz, t, nh, p, g, ns):
    x = RNG.standard_normal((bsz, t, nh, p))
    dt = RNG.uniform(0.01, 0.3, (bsz, t, nh))
    a = -RNG.uniform(1, 8, nh)
    b = RNG.standard_normal((bsz, t, g, ns))
    c = RNG.standard_normal((bsz, t, g, ns))
    d = RNG.uniform(0.5, 1.5, nh)
    h0 = RNG.standard_normal((bsz, nh, p, ns))
    return x, dt, a, b, c, d, h0


@pytest.mark.parametrize("t,chunk", [(1, 8), (7, 8), (8, 8), (21, 8), (33, 16), (40, 64)])
@pytest.mark.parametrize("nh,g", [(4, 1), (8, 2), (4, 4)])
def test_mamba2_scan_matches_recurrence(t, chunk, nh, g):
    args = _ssm_inputs(2, t, nh, 8, g, 16)
    y_ref, h_ref = _ssm_reference(*args)
    y, h = OPS.mamba2_scan(*(jnp.asarray(v, jnp.float32) for v in args), chunk_size=chunk)
    _close(y, y_ref)
    _close(h, h_ref)


def test_mamba2_scan_padding_leaves_state_unchanged():
    x, dt, a, b, c, d, h0 = _ssm_inputs(1, 12, 4, 8, 2, 16)
    x[:, 9:], dt[:, 9:] = 0.0, 0.0  # three padding tokens
    _, h_ref = _ssm_reference(x[:, :9], dt[:, :9], a, b[:, :9], c[:, :9], d, h0)
    _, h = OPS.mamba2_scan(*(jnp.asarray(v, jnp.float32) for v in (x, dt, a, b, c, d, h0)), 8)
    _close(h, h_ref)


def test_mamba2_step_matches_recurrence():
    x, dt, a, b, c, d, h0 = _ssm_inputs(3, 1, 8, 8, 2, 16)
    y_ref, h_ref = _ssm_reference(x, dt, a, b, c, d, h0)
    f = lambda v: jnp.asarray(v, jnp.float32)
    y, h = OPS.mamba2_step(f(h0), f(x[:, 0]), f(dt[:, 0]), f(a), f(b[:, 0]), f(c[:, 0]), f(d))
    _close(y, y_ref[:, 0])
    _close(h, h_ref)


def _conv_reference(x, state, w, bias, length):
    u = np.concatenate([state.T, x[:length]], axis=0)  # [W-1+L, C]
    width = w.shape[1]
    y = np.stack([(u[s : s + width] * w.T).sum(0) for s in range(length)]) + bias
    return y / (1 + np.exp(-y)), u[length : length + width - 1].T


@pytest.mark.parametrize("width", [2, 4])
def test_causal_conv1d_with_lengths(width):
    bsz, t, ch = 3, 9, 12
    x = RNG.standard_normal((bsz, t, ch))
    state = RNG.standard_normal((bsz, ch, width - 1))
    w, bias = RNG.standard_normal((ch, width)), RNG.standard_normal(ch)
    lengths = np.array([9, 5, 1])
    y, new_state = OPS.causal_conv1d(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(state, jnp.float32),
        jnp.asarray(w, jnp.float32),
        jnp.asarray(bias, jnp.float32),
        jnp.asarray(lengths),
        "silu",
    )
    for row, n in enumerate(lengths):
        y_ref, s_ref = _conv_reference(x[row], state[row], w, bias, n)
        _close(np.asarray(y)[row, :n], y_ref)
        _close(np.asarray(new_state)[row], s_ref)


def test_causal_conv1d_step_equals_one_token_chunk():
    bsz, ch, width = 2, 10, 4
    x = jnp.asarray(RNG.standard_normal((bsz, ch)), jnp.float32)
    state = jnp.asarray(RNG.standard_normal((bsz, ch, width - 1)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((ch, width)), jnp.float32)
    y, s = OPS.causal_conv1d_step(x, state, w, None, None)
    y2, s2 = OPS.causal_conv1d(x[:, None], state, w, None, jnp.array([1, 1]), None)
    _close(y, np.asarray(y2)[:, 0])
    _close(s, np.asarray(s2))


def _bucket_loop(d: int, spec: RelativeBias) -> int:
    """The bucket of distance d straight from the definition: the last start <= d."""
    return max(i for i, start in enumerate(spec.boundaries()) if start <= d)


def test_relative_bias_buckets():
    spec = RelativeBias(num_buckets=12, num_exact=4, max_distance=64)
    starts = spec.boundaries()
    assert starts[:4] == (0, 1, 2, 3) and len(starts) == 12
    assert all(b > a for a, b in zip(starts, starts[1:], strict=False)) and starts[-1] == 64
    d = np.arange(0, 200)
    expect = [_bucket_loop(int(x), spec) for x in d]
    np.testing.assert_array_equal(np.asarray(spec.bucket(jnp.asarray(d))), expect)
    with pytest.raises(ValueError):
        RelativeBias(num_buckets=4, num_exact=8, max_distance=64)


@pytest.mark.parametrize("rel", [False, True])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("ratio", [1, 4])
def test_paged_attention(window, ratio, rel):
    """Scattered pages, NaN in every slot no query may see, and a relative bias: against a
    per-query float64 loop over the visible keys."""
    bsz, t, kv, hd, page, nblk, n_pages, dr = 2, 5, 2, 16, 4, 3, 9, 6
    nq = kv * ratio
    spec = RelativeBias(num_buckets=6, num_exact=2, max_distance=8) if rel else None
    q = RNG.standard_normal((bsz, t, nq, hd))
    kp = RNG.standard_normal((n_pages, kv, page, hd))
    vp = RNG.standard_normal((n_pages, kv, page, hd))
    table = np.array([[3, 7, 1], [8, 2, 5]], np.int32)
    starts = np.array([0, 4])
    pos = starts[:, None] + np.arange(t)
    kv_len = starts + t
    rq = RNG.standard_normal((bsz, t, nq, dr))
    tab = RNG.standard_normal((6, dr))
    for bi in range(bsz):  # poison every cache slot past the row's keys, and unused pages
        for j in range(kv_len[bi], nblk * page):
            kp[table[bi, j // page], :, j % page] = np.nan
            vp[table[bi, j // page], :, j % page] = np.nan
    kp[[0, 4, 6]] = np.nan
    vp[[0, 4, 6]] = np.nan
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    rel_args = (f32(rq), f32(tab), spec) if rel else (None, None, None)
    out = OPS.paged_attention(
        f32(q),
        f32(kp),
        f32(vp),
        jnp.asarray(table),
        jnp.asarray(pos),
        jnp.asarray(kv_len),
        0.3,
        window,
        *rel_args,
    )
    out = np.asarray(out)
    assert np.isfinite(out).all()
    for bi in range(bsz):
        for ti in range(t):
            p = pos[bi, ti]
            keys = [j for j in range(kv_len[bi]) if j <= p and (window is None or p - j < window)]
            for h in range(nq):
                ks = np.stack([kp[table[bi, j // page], h // ratio, j % page] for j in keys])
                vs = np.stack([vp[table[bi, j // page], h // ratio, j % page] for j in keys])
                logits = ks @ q[bi, ti, h] * 0.3
                if rel:
                    logits += np.array(
                        [rq[bi, ti, h] @ tab[_bucket_loop(p - j, spec)] for j in keys]
                    )
                e = np.exp(logits - logits.max())
                _close(out[bi, ti, h], (e / e.sum()) @ vs)


def test_grouped_matmul():
    sizes = np.array([3, 0, 5, 2])
    x = RNG.standard_normal((sizes.sum(), 6))
    w = RNG.standard_normal((4, 6, 5))
    out = OPS.grouped_matmul(
        jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(sizes)
    )
    expert = np.repeat(np.arange(4), sizes)
    _close(out, np.einsum("md,mdf->mf", x, w[expert]))


@pytest.mark.parametrize("dtype,rel", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
def test_norms(dtype, rel):
    y, z = RNG.standard_normal((3, 32)), RNG.standard_normal((3, 32))
    w = RNG.uniform(0.9, 1.1, 32)
    got = OPS.rms_norm(jnp.asarray(y, dtype), jnp.asarray(w, dtype), 1e-5)
    _close(got, w * y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-5), rel)
    g = (y * z / (1 + np.exp(-z))).reshape(3, 4, 8)
    ref = (g / np.sqrt((g * g).mean(-1, keepdims=True) + 1e-5)).reshape(3, 32) * w
    got = OPS.gated_rms_norm(
        jnp.asarray(y, dtype), jnp.asarray(z, dtype), jnp.asarray(w, dtype), 1e-5, 8
    )
    _close(got, ref, rel)


def test_unknown_backend_and_missing_op_raise_clearly(monkeypatch):
    with pytest.raises(BackendError, match="unknown backend 'cuda'"):
        load_ops("cuda")
    with pytest.raises(BackendError, match="unknown op 'softmax'"):
        register("softmax", "xla")
    get_op("rms_norm", "pallas")  # imports the backend, then pretend it lacks the op
    monkeypatch.delitem(protocol._REGISTRY, ("rms_norm", "pallas"))
    with pytest.raises(BackendError, match="has no implementation of op 'rms_norm'"):
        load_ops("pallas")
    assert load_ops("pallas", fallback="xla").rms_norm is get_op("rms_norm", "xla")


def test_backend_refuses_unsupported_hardware(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(BackendError, match="not for 'tpu'"):
        load_ops("pallas")
    assert load_ops("xla").backend == "xla"
