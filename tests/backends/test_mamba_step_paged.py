"""`mamba2_step_paged`: the one-token Mamba2 update on states that live in a cache region.

Each backend's op runs jitted on a random region (random words everywhere, random float32
states on the pages in use: never zeros) and is checked against a numpy reference that decodes
the states from the region's words itself: y within the dtype's tolerance (float32 1e-5,
bfloat16 2e-2 of the output scale, as the other kernel tests), the new states within 1e-5 of
their scale (float32 states), and every other word of the region (other pages, the null page,
the words around each state) bit-for-bit unchanged. Shapes are awkward on purpose: states
that start and end inside a row, a row width that divides nothing, P and Ns not powers of two,
one group for several heads, a padding row on the null page and a fresh row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends.protocol import BackendError, get_op

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
NUM_PAGES = 24


def _page_rows(nh, p, ns, width, offset):
    """Rows a page needs for the state, plus one (words after it)."""
    return -(-(offset + nh * p * ns) // width) + 1


def _case(rng, bsz, nh, g, p, ns, width, offset, dtype):
    rows = NUM_PAGES * _page_rows(nh, p, ns, width, offset)
    region = rng.integers(-(2**31), 2**31 - 1, (1, rows, width), dtype=np.int32)
    words = nh * p * ns
    flat = region.reshape(NUM_PAGES, -1)
    states = rng.standard_normal((NUM_PAGES, words)).astype(np.float32)
    flat[:, offset : offset + words] = states.view(np.int32)
    pages = rng.choice(np.arange(1, NUM_PAGES), bsz, replace=False).astype(np.int32)
    pages[1] = 0  # padding: the null page
    fresh = np.zeros(bsz, np.int32)
    fresh[-1] = 1
    x = rng.standard_normal((bsz, nh, p))
    dt = rng.uniform(0.01, 0.5, (bsz, nh)).astype(np.float32)
    a = -rng.uniform(0.5, 4.0, nh).astype(np.float32)
    b = rng.standard_normal((bsz, g, ns))
    c = rng.standard_normal((bsz, g, ns))
    d = rng.uniform(0.5, 1.5, nh).astype(np.float32)
    args = (region, pages, fresh, jnp.asarray(x, dtype), dt, a, jnp.asarray(b, dtype))
    return args + (jnp.asarray(c, dtype), d)


def _reference(region, pages, fresh, x, dt, a, b, c, d, offset):
    """numpy: decode each row's state from the words, update it, encode it back."""
    region = np.array(region)
    x, b, c = (np.asarray(v, np.float32) for v in (x, b, c))
    bsz, nh, p = x.shape
    ns = b.shape[-1]
    flat = region.reshape(NUM_PAGES, -1)
    rep = nh // b.shape[1]
    ys = np.zeros((bsz, nh, p), np.float32)
    for i in range(bsz):
        state = flat[pages[i], offset : offset + nh * p * ns].view(np.float32).reshape(nh, p, ns)
        state = np.zeros_like(state) if fresh[i] else state
        bh, ch = np.repeat(b[i], rep, axis=0), np.repeat(c[i], rep, axis=0)  # [Hs, Ns]
        new = np.exp(dt[i] * a)[:, None, None] * state
        new = new + (dt[i][:, None] * x[i])[:, :, None] * bh[:, None, :]
        ys[i] = np.einsum("hpn,hn->hp", new, ch) + d[:, None] * x[i]
        if pages[i] != 0:
            flat[pages[i], offset : offset + nh * p * ns] = new.reshape(-1).view(np.int32)
    return ys, region


def _op(backend: str):
    try:
        return jax.jit(get_op("mamba2_step_paged", backend), static_argnums=(9, 10))
    except BackendError as err:
        pytest.skip(str(err))


# (batch, heads, groups, P, Ns, row words, state offset in words)
SHAPES = [(4, 4, 2, 6, 12, 40, 37), (3, 6, 1, 16, 8, 64, 64), (5, 2, 2, 80, 16, 33, 3)]


@pytest.mark.parametrize("backend", ["xla", "pallas", "torch"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_paged_step_matches_numpy(backend, dtype, shape):
    bsz, nh, g, p, ns, width, offset = shape
    rng = np.random.default_rng(abs(hash((bsz, nh, p, width))) % 2**32)
    args = _case(rng, bsz, nh, g, p, ns, width, offset, dtype)
    y, region = _op(backend)(*args, offset, _page_rows(nh, p, ns, width, offset))
    y_ref, region_ref = _reference(*args, offset)
    assert y.dtype == dtype and y.shape == y_ref.shape
    scale = np.abs(y_ref).max()
    np.testing.assert_allclose(np.asarray(y, np.float32), y_ref, atol=TOL[dtype] * scale, rtol=0)
    got = np.asarray(region)
    words = nh * p * ns
    touched = np.zeros(got.reshape(NUM_PAGES, -1).shape, bool)
    for page in args[1][args[1] > 0]:
        touched[page, offset : offset + words] = True
    touched = touched.reshape(got.shape)
    np.testing.assert_array_equal(got[~touched], region_ref[~touched])  # the rest, bit for bit
    new, ref = got[touched].view(np.float32), region_ref[touched].view(np.float32)
    np.testing.assert_allclose(new, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
