"""The cache regions: one page read through the Mamba view and the attention view is the same
bytes; region buffers keep their addresses across jitted steps."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridserve.cache.mamba_view import read_mamba, write_mamba
from hybridserve.cache.plan import plan_cache
from hybridserve.cache.regions import build_layout
from hybridserve.cache.spec import layer_specs
from hybridserve.cache.view import kv_pages
from hybridserve.config import AttentionConfig, MambaConfig, ModelConfig
from hybridserve.core.outputs import ScheduledChunk, SchedulerOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from check_region_copies import REGION_TYPES, TYPED_VIEWS, region_copies  # noqa: E402

CFG = ModelConfig(
    architecture="nemotron_h", vocab_size=64, hidden_size=32,
    layer_types=("mamba", "attention", "mamba", "attention"), norm_eps=1e-5,
    attention=AttentionConfig(4, 2, 8), mamba=MambaConfig(4, 8, 8, 2, 4, 8),
)  # fmt: skip


@pytest.mark.parametrize("layout", ["DS", "SD"])
def test_mamba_slabs_that_split_words_round_trip(layout):
    """A pure state-space model whose conv slabs are not whole words (head_dim 3, state 5:
    bf16 slabs of 18 and 30 bytes): its page is rounded up to whole words and every state
    reads back exactly what was written, through the bytes path, beside random neighbours."""
    cfg = ModelConfig(
        architecture="nemotron_h", vocab_size=64, hidden_size=32,
        layer_types=("mamba", "mamba"), norm_eps=1e-5, attention=None,
        mamba=MambaConfig(2, 3, 5, 1, 4, 8),
    )  # fmt: skip
    plan = plan_cache(layer_specs(cfg, 1, "bfloat16", "bfloat16", layout=layout), 1)
    cache_layout = build_layout(cfg, plan)
    assert plan.page_size_bytes % 4 == 0 and plan.page_size_bytes >= plan.groups[0].spec.state_bytes
    acc, rows, width = cache_layout.layers[0], cache_layout.page_rows, cache_layout.row_bytes
    rng = np.random.default_rng(1)
    noise = rng.integers(0, 256, (1, 5 * rows, width), dtype=np.uint8)
    region = jnp.asarray(noise.view(np.int32))
    m = cfg.mamba
    x = jnp.asarray(rng.standard_normal((2, m.num_heads * m.head_dim, 3)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((2, m.n_groups * m.state_size, 3)), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((2, m.n_groups * m.state_size, 3)), jnp.bfloat16)
    ssm = jnp.asarray(rng.standard_normal((2, 2, 3, 5)), jnp.float32)
    pages = jnp.array([3, 1])
    region = write_mamba(region, acc, 1, pages, rows, x, b, c, ssm)
    *got, region = read_mamba(region, acc, 1, pages, rows)
    for want, have in zip((x, b, c, ssm), got, strict=True):
        np.testing.assert_array_equal(np.asarray(have), np.asarray(want))
    after = np.asarray(region).view(np.uint8)
    for p in (0, 2, 4):  # pages no request named are untouched
        np.testing.assert_array_equal(
            after[:, p * rows : (p + 1) * rows], noise[:, p * rows : (p + 1) * rows]
        )


@pytest.mark.parametrize("tp,layout", [(1, "DS"), (1, "SD"), (2, "DS")])
def test_mamba_view_and_attention_view_share_bytes(tp, layout):
    plan = plan_cache(layer_specs(CFG, tp, "bfloat16", "bfloat16", layout=layout), tp)
    cache_layout = build_layout(CFG, plan)
    mamba, attn = cache_layout.layers[0], cache_layout.layers[1]
    assert mamba.region == attn.region == 0  # both live in region 0
    num_pages, rows, width = 4, cache_layout.page_rows, cache_layout.row_bytes
    assert rows * width == plan.page_size_bytes
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (tp, num_pages * rows, width), dtype=np.uint8)
    region = jnp.asarray(noise.view(np.int32))  # random bytes, as the region's words
    m = CFG.mamba
    x = jnp.asarray(rng.standard_normal((1, m.intermediate_size, 3)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((1, m.n_groups * m.state_size, 3)), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((1, m.n_groups * m.state_size, 3)), jnp.bfloat16)
    ssm = jnp.asarray(rng.standard_normal((1, 4, 8, 8)), jnp.float32)
    pages = jnp.array([2])
    region = write_mamba(region, mamba, tp, pages, rows, x, b, c, ssm)
    *got, region = read_mamba(region, mamba, tp, pages, rows)
    for want, have in zip((x, b, c, ssm), got, strict=True):
        np.testing.assert_array_equal(np.asarray(have), np.asarray(want))
    # The same page through the attention view: K and V of its kernel blocks, per rank.
    spec = [g.spec for g in plan.groups if g.kind == "mamba"][0]
    kernel_ids = jnp.arange(plan.ratio)[None] + 2 * plan.ratio
    # The paged view (what paged_attention reads) at those blocks: [1, ratio*kb, K, H] each.
    k, v = (
        np.asarray(pages)[np.asarray(kernel_ids)[0]]
        .transpose(0, 2, 1, 3)
        .reshape(1, -1, attn.kv_heads, attn.head_dim)
        for pages in kv_pages(region, attn, tp)
    )
    kb, heads = plan.kernel_block_size, attn.kv_heads_local
    per_rank = []
    for r in range(tp):
        # HND within each half: [heads, kb tokens, head_dim]
        kr = np.asarray(k)[0].reshape(plan.ratio, kb, tp, heads, 8)[:, :, r].transpose(0, 2, 1, 3)
        vr = np.asarray(v)[0].reshape(plan.ratio, kb, tp, heads, 8)[:, :, r].transpose(0, 2, 1, 3)
        page_bytes = np.concatenate([kr, vr], axis=1).view(np.uint8).reshape(-1)
        per_rank.append(page_bytes)
    state = np.asarray(region)[:, 2 * rows : 3 * rows].reshape(tp, -1).view(np.uint8)
    state = state[:, : spec.state_bytes]
    for r in range(tp):
        np.testing.assert_array_equal(per_rank[r][: spec.state_bytes], state[r])
        # and the ssm bytes of rank r are the ssm values of its heads
        ssm_bytes = state[r, mamba.page.ssm.offset : mamba.page.ssm.end]
        ssm_r = np.ascontiguousarray(ssm_bytes).view(np.float32).reshape(spec.ssm_shape)
        np.testing.assert_array_equal(ssm_r, np.asarray(ssm)[0, r * 4 // tp : (r + 1) * 4 // tp])


def test_region_addresses_fixed_across_steps(hf_checkpoint):
    from hybridserve.config import CacheConfig
    from hybridserve.runner.factory import make_runner

    runner = make_runner(
        str(hf_checkpoint("nemotron_h")[0]),
        dtype="float32",
        cache=CacheConfig(num_pages=32),
        max_model_len=64,
    )
    before = runner.region_addresses()
    tables = runner.scratch_tables(40)
    ids = list(range(3, 23))
    runner.compute_logits(
        SchedulerOutput((ScheduledChunk("a", tuple(ids), 0, tables, True),), page_copies=((5, 9),))
    )
    for step in range(10):
        runner.compute_logits(
            SchedulerOutput((ScheduledChunk("a", (7,), 20 + step, tables, True),))
        )
    jax.block_until_ready(runner.regions)
    assert runner.region_addresses() == before


@pytest.mark.parametrize(
    "family,tp", [("nemotron_h", 1), ("nemotron_h", 2), ("inkling", 1), ("inkling", 2)]
)
def test_steps_update_the_regions_in_place(hf_checkpoint, tmp_path, family, tp):
    """No compiled step copies a whole region (prefill chunks, decode steps, a page copy): the
    step writes exactly the rows it owns, so bytes a P/D transfer writes into other pages of
    the region while the step runs survive it. (A read of the old region followed by an
    independent write, or a scatter through a reshaped view, made XLA copy the whole buffer
    and write it back at the end: transferred pages were lost under load.) For Nemotron-H,
    whose other values are all smaller than a region shard, no typed view of a whole shard is
    copied either (at TP 2 the K/V pages were, every attention layer, every step, until each
    rank attended over its own shard)."""
    from hybridserve.config import CacheConfig
    from hybridserve.runner.factory import make_runner
    from tests.hybridserve.inkling_models import build_inkling, save_inkling, tiny_inkling

    if family == "inkling":
        cfg = tiny_inkling()
        path = save_inkling(build_inkling(cfg, seed=1), cfg, tmp_path / "m")
    else:
        path = str(hf_checkpoint(family)[0])
    runner = make_runner(
        path, dtype="float32", tp=tp, cache=CacheConfig(num_pages=96), max_model_len=64
    )
    compiled: list[str] = []
    step = runner._step

    def spy(*args, **kwargs):  # the keyword arguments are the static ones
        program = step.lower(*args, **kwargs).compile()
        compiled.append(program.as_text())
        return program(*args)

    runner._step = spy
    tables = runner.scratch_tables(40)
    prompt = tuple(range(3, 23))
    runner.compute_logits(
        SchedulerOutput((ScheduledChunk("a", prompt, 0, tables, True),), page_copies=((5, 9),))
    )
    runner.compute_logits(SchedulerOutput((ScheduledChunk("a", (7,), 20, tables, True),)))
    region_bytes = runner.regions[0].nbytes // tp  # one rank's shard
    assert len(compiled) == 2
    kinds = TYPED_VIEWS if family == "nemotron_h" else REGION_TYPES
    for hlo in compiled:
        assert not region_copies(hlo, region_bytes, kinds)


def test_region_copies_finds_a_copy_of_a_shard_in_the_regions_storage_type():
    """The HLO check above would pass vacuously if it missed the regions' element type (it
    matched bytes alone while the regions became words)."""
    lines = [
        "  %copy.3 = s32[2,8,4]{2,1,0} copy(s32[2,8,4]{2,1,0} %param.1)",
        "  %copy.4 = u8[256]{0} copy(u8[256]{0} %p)",
        "  %copy.5 = s32[2,8,2]{2,1,0} copy(s32[2,8,2]{2,1,0} %param.2)",  # half a shard
        "  %copy.6 = f32[4,16]{1,0} copy(f32[4,16]{1,0} %dot.1)",  # a typed value, as many bytes
    ]
    found = region_copies("\n".join(lines), 256)
    assert [line.split(" =")[0].strip() for line in found] == ["%copy.3", "%copy.4"]
