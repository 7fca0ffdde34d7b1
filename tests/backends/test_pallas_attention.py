"""The pallas paged-attention kernel at tile sizes the registered op does not pick on CPU:
small row tiles (so that whole tiles hold only padding tokens, positioned past the row's
cache), one page per key block (the scalar page-id path) and several pages per block. Against
the xla reference on NaN-poisoned caches; float32, tolerance 2e-5 of the output scale."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_inputs import paged_inputs as _paged_inputs
from test_shared_suite import _check, _rng
from triton_export import assert_lowers_to_triton

from backends.pallas.attention import paged_attention_tiled
from backends.protocol import RelativeBias, get_op


@pytest.mark.parametrize("rel", [False, True])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_m,block_k", [(4, 4), (8, 16), (2, 32)])
def test_small_tiles_match_reference(block_m, block_k, window, rel):
    page, t, kv, ratio, hd = 4, 9, 2, 2, 16
    starts = np.array([0, 13, 30, 0])  # a prefill, a decode row (8 padding tokens), a chunk
    kv_len = np.array([t, 14, 30 + t, 0])
    arrays, kv_len, rq, tab = _paged_inputs(
        _rng("small tiles", block_m, block_k, window, rel), 4, t, kv * ratio, kv, hd, page,
        jnp.float32, starts, kv_len,
    )  # fmt: skip
    spec = RelativeBias(num_buckets=12, num_exact=3, max_distance=20) if rel else None
    extra = (rq, tab, spec) if rel else (None, None, None)
    ref = jax.jit(lambda *a: get_op("paged_attention", "xla")(*a, 0.25, window, *extra))(
        *arrays, kv_len
    )
    got = jax.jit(
        lambda *a: paged_attention_tiled(*a, 0.25, window, *extra, block_m=block_m, block_k=block_k)
    )(*arrays, kv_len)
    assert np.isfinite(np.asarray(got)).all(), "a padding tile read a poisoned slot"
    _check(got, ref, jnp.float32)


@pytest.mark.parametrize("block_m,block_k", [(8, 16), (16, 32)])
def test_long_prefill_crosses_every_bias_region(block_m, block_k):
    # 12 buckets over distances up to 64 and a 200-token prefill: the far blocks (last bucket),
    # the mid blocks (at most two buckets per tile), the near blocks and the diagonal all occur.
    page, t, kv, ratio, hd = 8, 200, 1, 2, 16
    starts, kv_len = np.array([0, 37]), np.array([t, 37 + t])
    arrays, kv_len, rq, tab = _paged_inputs(
        _rng("long bias", block_m, block_k), 2, t, kv * ratio, kv, hd, page, jnp.float32,
        starts, kv_len,
    )  # fmt: skip
    spec = RelativeBias(num_buckets=12, num_exact=4, max_distance=64)
    ref = jax.jit(lambda *a: get_op("paged_attention", "xla")(*a, 0.25, None, rq, tab, spec))(
        *arrays, kv_len
    )
    got = jax.jit(
        lambda *a: paged_attention_tiled(
            *a, 0.25, None, rq, tab, spec, block_m=block_m, block_k=block_k
        )
    )(*arrays, kv_len)
    _check(got, ref, jnp.float32)


@pytest.mark.parametrize("rel", [False, True])
@pytest.mark.parametrize("page", [16, 64])
def test_both_page_paths_lower_to_triton(page, rel, monkeypatch):
    """Several pages per key block (a gathered load) and one (a scalar page id) both lower
    for CUDA on this machine (compiling to PTX needs a GPU), with and without the relative
    bias (its far-block loop included: no window)."""
    monkeypatch.setenv("HYBRIDSERVE_PALLAS_INTERPRET", "0")
    s, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    args = (s((2, 40, 8, 128), bf), s((9, 2, page, 128), bf), s((9, 2, page, 128), bf))
    args += (s((2, 4), i32), s((2, 40), i32), s((2,), i32))
    if rel:
        args += (s((2, 40, 8, 32), bf), s((20, 32), bf))
        extra = (RelativeBias(20, 8, 512),)
    else:
        extra = ()
    assert_lowers_to_triton(
        lambda *a: paged_attention_tiled(*a[:6], 0.1, None, *a[6:], *extra, block_k=64), *args
    )


@pytest.mark.parametrize("backend", ["xla", "pallas", "torch"])
@pytest.mark.parametrize("window,rel", [(None, False), (6, True)])
def test_joint_kv_pages_equal_separate(backend, window, rel):
    """The joint form (one [Pg, 2, K, page, H] array, v_pages None: the region's own layout)
    gives what the two arrays give, in each backend; against the xla reference on separate
    pages (NaN-poisoned caches), float32, 2e-5 of the output scale."""
    from backends.protocol import BackendError

    try:
        op = get_op("paged_attention", backend)
    except BackendError as err:
        pytest.skip(str(err))
    page, t, kv, ratio, hd = 4, 5, 2, 3, 16
    starts, kv_len = np.array([0, 11, 3]), np.array([t, 12, 3 + t])
    (q, k_pages, v_pages, table, pos), kv_len, rq, tab = _paged_inputs(
        _rng("joint", backend, window, rel), 3, t, kv * ratio, kv, hd, page, jnp.float32,
        starts, kv_len,
    )  # fmt: skip
    spec = RelativeBias(num_buckets=10, num_exact=3, max_distance=20) if rel else None
    extra = (rq, tab, spec) if rel else (None, None, None)
    joint = jnp.stack([k_pages, v_pages], axis=1)
    got = jax.jit(lambda *a: op(q, a[0], None, *a[1:], 0.25, window, *extra))(
        joint, table, pos, kv_len
    )
    ref = jax.jit(lambda *a: get_op("paged_attention", "xla")(*a, 0.25, window, *extra))(
        q, k_pages, v_pages, table, pos, kv_len
    )
    _check(got, ref, jnp.float32)


def test_joint_kv_pages_lower_to_triton(monkeypatch):
    """The joint form's two BlockSpecs over one array lower for CUDA on this machine."""
    monkeypatch.setenv("HYBRIDSERVE_PALLAS_INTERPRET", "0")
    s, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    args = (s((3, 1, 8, 128), bf), s((40, 2, 2, 16, 128), bf))
    args += (s((3, 7), i32), s((3, 1), i32), s((3,), i32))
    op = get_op("paged_attention", "pallas")
    assert_lowers_to_triton(lambda q, kv, *a: op(q, kv, None, *a, 0.1, None), *args)


@pytest.mark.parametrize("rel", [False, True])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_kv_decode_matches_reference(splits, window, rel):
    """Split-KV decode (each row's key blocks shared among `splits` programs, merged by their
    log-sum-exps): rows with long, short (fewer blocks than splits), window-clipped and no
    context (a padding row: zeros), against the xla reference on NaN-poisoned caches."""
    page, kv, ratio, hd = 4, 2, 4, 16
    starts = np.array([40, 2, 25, 0])
    kv_len = np.array([41, 3, 26, 0])
    arrays, kv_len, rq, tab = _paged_inputs(
        _rng("split kv", splits, window, rel), 4, 1, kv * ratio, kv, hd, page, jnp.float32,
        starts, kv_len,
    )  # fmt: skip
    spec = RelativeBias(num_buckets=12, num_exact=3, max_distance=20) if rel else None
    extra = (rq, tab, spec) if rel else (None, None, None)
    ref = jax.jit(lambda *a: get_op("paged_attention", "xla")(*a, 0.25, window, *extra))(
        *arrays, kv_len
    )
    got = jax.jit(
        lambda *a: paged_attention_tiled(*a, 0.25, window, *extra, block_k=8, splits=splits)
    )(*arrays, kv_len)
    assert np.isfinite(np.asarray(got)).all(), "a split read a poisoned slot"
    _check(got, ref, jnp.float32)


def test_split_kv_lowers_to_triton(monkeypatch):
    """Split-KV decode (a fourth grid axis, two outputs) lowers for CUDA."""
    monkeypatch.setenv("HYBRIDSERVE_PALLAS_INTERPRET", "0")
    s, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    args = (s((1, 1, 40, 128), bf), s((80, 2, 8, 16, 128), bf), s((1, 64), i32))
    args += (s((1, 1), i32), s((1,), i32))
    assert_lowers_to_triton(
        lambda q, kv, *a: paged_attention_tiled(q, kv, None, *a, 0.1, None, splits=9), *args
    )
