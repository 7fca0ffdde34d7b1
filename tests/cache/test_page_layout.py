"""The page layout (`cache.page_layout`) against the specs' byte counts, and against typed pages
built with numpy independently of it: the typed views (`cache.view`) that read the page layout's
rows and offsets must decode exactly what numpy laid out by the documented shapes
(`[ratio, K|V, heads_local, kb, head_dim]`; DS `x | B | C | ssm | pad`, SD `conv(rows, ch) | ssm`).
DS and SD, TP 1 and 2, heads split and duplicated."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hybridserve.cache.mamba_view import read_mamba
from hybridserve.cache.page_layout import AttentionPage, MambaPage, held_range, page_layouts
from hybridserve.cache.plan import plan_cache
from hybridserve.cache.regions import build_layout
from hybridserve.cache.spec import MambaSpec, layer_specs
from hybridserve.cache.view import kv_pages, read_kv
from hybridserve.config import AttentionConfig, MambaConfig, ModelConfig

KB = 4


def config(kv_heads: int = 2, n_groups: int = 2) -> ModelConfig:
    return ModelConfig(
        architecture="nemotron_h", vocab_size=64, hidden_size=32,
        layer_types=("mamba", "attention", "mamba", "attention"), norm_eps=1e-5,
        attention=AttentionConfig(4, kv_heads, 8), mamba=MambaConfig(4, 8, 8, n_groups, 4, 8),
    )  # fmt: skip


def plan_of(cfg: ModelConfig, tp: int, layout: str):
    specs = layer_specs(cfg, tp, "bfloat16", "bfloat16", "float32", layout)
    return plan_cache(specs, tp, kernel_block_size=KB)


CASES = [(tp, layout, kv) for tp in (1, 2) for layout in ("DS", "SD") for kv in (1, 2)]


@pytest.mark.parametrize("tp,layout,kv_heads", CASES)
def test_slabs_match_the_spec_byte_counts(tp, layout, kv_heads):
    cfg = config(kv_heads=kv_heads, n_groups=kv_heads)
    plan = plan_of(cfg, tp, layout)
    for rank in range(tp):
        for group, page in zip(plan.groups, page_layouts(plan, cfg, rank), strict=True):
            spec = group.spec
            if isinstance(spec, MambaSpec):
                assert isinstance(page, MambaPage)
                x, b, c, ssm = page.slabs
                assert [(s.offset, s.size) for s in page.slabs] == [
                    (0, spec.x_bytes),
                    (spec.x_bytes, spec.bc_bytes),
                    (spec.x_bytes + spec.bc_bytes, spec.bc_bytes),
                    (spec.conv_bytes, spec.ssm_bytes),
                ]
                assert page.state_bytes == spec.state_bytes
                assert page.padding == (spec.state_bytes, plan.page_size_bytes - spec.state_bytes)
                assert (page.x_dim, page.bc_dim, page.ssm_shape) == (
                    spec.x_dim,
                    spec.bc_dim,
                    spec.ssm_shape,
                )
                assert x.held == ssm.held == range(rank * 4 // tp, (rank + 1) * 4 // tp)
                assert b.held == c.held == held_range(kv_heads, tp, rank)
            else:
                assert isinstance(page, AttentionPage)
                k, v = page.slabs
                half = KB * spec.bytes_per_token // 2  # one kernel block's K (or V)
                assert [(k.offset, k.size), (v.offset, v.size)] == [(0, half), (half, half)]
                assert page.kernel_page_bytes * plan.ratio == page.page_bytes
                assert page.page_bytes == plan.page_size_bytes == spec.page_size_bytes
                assert page.heads_local == spec.num_kv_heads
                assert page.row_bytes == spec.head_dim * 2  # bf16
        # a duplicated head/group: each rank holds one, `rank // (tp / n)`
        if kv_heads < tp:
            assert held_range(kv_heads, tp, rank) == range(rank // tp, rank // tp + 1)


@pytest.mark.parametrize("tp,layout,kv_heads", CASES)
def test_views_read_what_numpy_laid_out(tp, layout, kv_heads):
    cfg = config(kv_heads=kv_heads, n_groups=kv_heads)
    plan = plan_of(cfg, tp, layout)
    cache = build_layout(cfg, plan)
    mamba, attn = cache.layers[0], cache.layers[1]
    num_pages, ratio, rows = 3, plan.ratio, cache.page_rows
    rng = np.random.default_rng(tp * 10 + kv_heads)
    m = cfg.mamba
    heads_local, groups_local = m.num_heads // tp, max(1, kv_heads // tp)
    conv_rows = m.conv_kernel - 1

    # global values; rank r holds heads/groups by duplicate-then-split
    kv = rng.standard_normal((num_pages * ratio, 2, kv_heads, KB, 8)).astype(np.float32)
    x = rng.standard_normal((m.num_heads * m.head_dim, conv_rows)).astype(np.float32)
    bc = rng.standard_normal((2, m.n_groups, m.state_size, conv_rows)).astype(np.float32)
    ssm = rng.standard_normal((m.num_heads, m.head_dim, m.state_size)).astype(np.float32)

    def bf16(a: np.ndarray) -> np.ndarray:
        """The bytes of `a` in bfloat16, flat, in `a`'s (row-major) order."""
        return np.asarray(jnp.asarray(a, jnp.bfloat16).view(jnp.uint16)).view(np.uint8).ravel()

    attn_region, mamba_region = [], []
    for r in range(tp):
        kv_r = np.repeat(kv, max(1, tp // kv_heads), axis=2)[:, :, r * attn.kv_heads_local :]
        kv_r = kv_r[:, :, : attn.kv_heads_local]  # [blocks, K|V, heads_local, kb, H]
        attn_region.append(bf16(kv_r))
        x_r = x.reshape(m.num_heads, -1, conv_rows)[r * heads_local : (r + 1) * heads_local]
        x_r = x_r.reshape(-1, conv_rows)
        bc_dup = np.repeat(bc, max(1, tp // m.n_groups), axis=1)
        b_r, c_r = (
            bc_dup[i, r * groups_local : (r + 1) * groups_local].reshape(-1, conv_rows)
            for i in (0, 1)
        )
        if layout == "DS":
            conv = np.concatenate([bf16(x_r), bf16(b_r), bf16(c_r)])
        else:
            conv = bf16(np.concatenate([x_r.T, b_r.T, c_r.T], axis=1))
        ssm_r = ssm[r * heads_local : (r + 1) * heads_local].view(np.uint8).ravel()
        state = np.concatenate([conv, ssm_r])
        page = np.zeros(plan.page_size_bytes, np.uint8)
        page[: state.size] = state
        mamba_region.append(np.tile(page, num_pages))
    width = cache.row_bytes

    def region(per_rank: list[np.ndarray]) -> jnp.ndarray:
        words = np.stack(per_rank).view(np.int32)  # the same bytes, as the region's words
        return jnp.asarray(words.reshape(tp, num_pages * rows, width // 4))

    k_all, v_all = (np.asarray(a, np.float32) for a in kv_pages(region(attn_region), attn, tp))
    np.testing.assert_array_equal(k_all, np.asarray(jnp.asarray(kv[:, 0], jnp.bfloat16), "f4"))
    np.testing.assert_array_equal(v_all, np.asarray(jnp.asarray(kv[:, 1], jnp.bfloat16), "f4"))
    # gathered per token through a block table: tokens 0..ratio*KB of page 1
    table = jnp.arange(ratio)[None] + ratio
    positions = jnp.arange(ratio * KB)[None]
    valid = jnp.ones_like(positions, bool)
    k_tok, _ = read_kv(region(attn_region), attn, tp, table, positions, valid)
    want = kv[ratio : 2 * ratio, 0].transpose(0, 2, 1, 3).reshape(1, ratio * KB, kv_heads, 8)
    np.testing.assert_array_equal(
        np.asarray(k_tok, np.float32), np.asarray(jnp.asarray(want, jnp.bfloat16), "f4")
    )

    *got, _ = read_mamba(region(mamba_region), mamba, tp, jnp.array([2]), rows)
    b_want, c_want = (bc[i].reshape(-1, conv_rows) for i in (0, 1))
    for have, want in zip(got, (x, b_want, c_want), strict=False):
        np.testing.assert_array_equal(
            np.asarray(have, np.float32)[0], np.asarray(jnp.asarray(want, jnp.bfloat16), "f4")
        )
    np.testing.assert_array_equal(np.asarray(got[3])[0], ssm)
