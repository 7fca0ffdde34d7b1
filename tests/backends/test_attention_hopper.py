"""The Hopper (Mosaic GPU) prefill attention kernel, on the CPU: its loop plan against a brute
force over every (row, key) pair, the inputs it declines, and its dispatch from the pallas
backend. The kernel itself runs on sm90 GPUs only (scripts/check_hopper_attention.py checks it
against xla there, with NaN in every slot no query may see); where the CUDA plugin is installed,
a test lowers it for CUDA."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends.pallas import attention, attention_hopper, hopper_plan
from backends.protocol import RelativeBias

SPECS = [RelativeBias(12, 3, 100), RelativeBias(32, 16, 4096)]


def _bucket(starts: tuple[int, ...], d: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.asarray(starts), np.maximum(d, 0), side="right") - 1


@pytest.mark.parametrize("block_k", [64, 128])
@pytest.mark.parametrize("spec", SPECS)
def test_plan_matches_brute_force(block_k, spec):
    """Each loop class holds what the kernel assumes of it: blocks before `whole` are visible
    to every row of the warpgroup, far blocks lie in the last bucket, mid blocks span at most
    two buckets, the bucket table brackets every distance, and [lo, hi) covers every visible
    key."""
    t, tiles = 384, 3
    starts_rows = np.array([0, 4000, 70, 9000])
    valid = np.array([384, 200, 300, 1])  # tokens per row, the rest padding (edge positions)
    pos = np.stack(
        [s + np.minimum(np.arange(t), v - 1) for s, v in zip(starts_rows, valid, strict=True)]
    )
    kv_len = starts_rows + valid
    n_blocks = -(-int(kv_len.max()) // block_k) + 1
    bounds = spec.boundaries()
    plan, lut = jax.jit(hopper_plan.plan_loops, static_argnums=(2, 3, 4, 5))(
        jnp.asarray(pos, jnp.int32), jnp.asarray(kv_len, jnp.int32), tiles, block_k, n_blocks,
        bounds,
    )  # fmt: skip
    plan, lut = np.asarray(plan), np.asarray(lut)
    checked = 0
    for b in range(len(pos)):
        for tile in range(tiles):
            lo, hi = plan[b, tile, :2]
            rows_all = pos[b, tile * 128 : (tile + 1) * 128]
            last_key = min(kv_len[b], rows_all.max() + 1)
            assert hi * block_k >= last_key > (hi - 1) * block_k and lo == 0
            for wg in range(2):
                rows = rows_all[wg * 64 : (wg + 1) * 64]
                whole, far, mid = (
                    plan[b, tile, 2 + wg],
                    plan[b, tile, 4 + wg],
                    plan[b, tile, 6 + wg],
                )
                far_c = np.clip(far, lo, whole)
                mid_c = np.clip(mid, far_c, whole)
                for i in range(lo, hi):
                    keys = i * block_k + np.arange(block_k)
                    d = rows[:, None] - keys[None, :]
                    buckets = _bucket(bounds, d)
                    assert lut[b, tile, wg, i] & 255 == buckets.min()
                    assert lut[b, tile, wg, i] >> 8 == buckets.max()
                    if i < whole:
                        assert (d >= 0).all() and (keys < kv_len[b]).all()
                    if i < far_c:
                        assert (buckets == len(bounds) - 1).all()
                    elif i < mid_c:
                        assert buckets.max() - buckets.min() <= 1
                    checked += 1
    assert checked > 50


def test_supported_names_what_it_declines():
    q = jnp.zeros((1, 128, 8, 128), jnp.bfloat16)
    pages = jnp.zeros((9, 2, 16, 128), jnp.bfloat16)
    assert attention_hopper.supported(q, pages, None) is None
    assert "window" in attention_hopper.supported(q, pages, 64)
    assert "bf16" in attention_hopper.supported(q.astype(jnp.float32), pages, None)
    odd = jnp.zeros((1, 128, 8, 80), jnp.bfloat16)
    assert "head dim" in attention_hopper.supported(odd, pages[..., :80], None)
    assert "page size" in attention_hopper.supported(q, jnp.zeros((9, 2, 12, 128), q.dtype), None)
    wide = jnp.zeros((1, 128, 8, 256), jnp.bfloat16)
    assert "shared memory" in attention_hopper.supported(wide, pages[..., :1], None, 128)
    assert attention_hopper.supported(wide, jnp.zeros((9, 2, 16, 256), wide.dtype), None) is None
    assert attention_hopper.default_block_k(128) == 128
    assert attention_hopper.default_block_k(256) == 64


def test_pallas_takes_it_only_on_hopper(monkeypatch):
    """On the CPU (interpret mode) the pallas backend keeps its Triton-style kernel; the
    switch turns the Hopper kernel off even on an sm90 GPU."""
    attention.hopper_gpu.cache_clear()
    assert not attention.hopper_gpu()
    monkeypatch.setenv(attention.ENV_HOPPER, "0")
    attention.hopper_gpu.cache_clear()
    assert not attention.hopper_gpu()
    attention.hopper_gpu.cache_clear()


@pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None, reason="needs the CUDA plugin"
)
@pytest.mark.parametrize(
    "rel,block_k,page,named",
    [(True, 64, 16, False), (True, 128, 64, False), (False, 128, 32, False), (True, 128, 64, True)],
)
def test_lowers_for_cuda(monkeypatch, rel, block_k, page, named):
    monkeypatch.setenv("HYBRIDSERVE_PALLAS_INTERPRET", "0")
    spec = SPECS[1]
    sds = jax.ShapeDtypeStruct
    b, t, n, k, h = 1, 256, 8, 2, 128
    args = (sds((b, t, n, h), jnp.bfloat16), sds((b * t // page + 1, k, page, h), jnp.bfloat16))
    rest = (sds((b, t // page), jnp.int32), sds((b, t), jnp.int32), sds((b,), jnp.int32))
    rel_args = (sds((b, t, n, 64), jnp.bfloat16), sds((32, 64), jnp.bfloat16))

    def f(q, kp, vp, table, pos, kv_len, rq, emb):
        extra = (rq, emb, spec) if rel else (None, None, None)
        return attention_hopper.prefill_attention_hopper(
            q, kp, vp, table, pos, kv_len, h**-0.5, None, *extra, block_k=block_k,
            named_barriers=named,
        )  # fmt: skip

    lowered = jax.jit(f).trace(*args, args[1], *rest, *rel_args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
