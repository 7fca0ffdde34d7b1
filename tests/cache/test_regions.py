"""The cache regions: one page read through the Mamba view and the attention view is the same
bytes; region buffers keep their addresses across jitted steps."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridserve.cache.plan import plan_cache
from hybridserve.cache.regions import build_layout
from hybridserve.cache.spec import layer_specs
from hybridserve.cache.view import from_raw, kv_pages, read_mamba, write_mamba
from hybridserve.config import AttentionConfig, MambaConfig, ModelConfig
from hybridserve.core.outputs import ScheduledChunk, SchedulerOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from check_region_copies import region_copies  # noqa: E402

CFG = ModelConfig(
    architecture="nemotron_h", vocab_size=64, hidden_size=32,
    layer_types=("mamba", "attention", "mamba", "attention"), norm_eps=1e-5,
    attention=AttentionConfig(4, 2, 8), mamba=MambaConfig(4, 8, 8, 2, 4, 8),
)  # fmt: skip


@pytest.mark.parametrize("tp,layout", [(1, "DS"), (1, "SD"), (2, "DS")])
def test_mamba_view_and_attention_view_share_bytes(tp, layout):
    plan = plan_cache(layer_specs(CFG, tp, "bfloat16", "bfloat16", layout=layout), tp)
    cache_layout = build_layout(CFG, plan)
    mamba, attn = cache_layout.layers[0], cache_layout.layers[1]
    assert mamba.region == attn.region == 0  # both live in region 0
    num_pages, rows, width = 4, cache_layout.page_rows, cache_layout.row_bytes
    assert rows * width == plan.page_size_bytes
    rng = np.random.default_rng(0)
    region = jnp.asarray(rng.integers(0, 256, (tp, num_pages * rows, width), dtype=np.uint8))
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
    state = np.asarray(region)[:, 2 * rows : 3 * rows].reshape(tp, -1)[:, : spec.state_bytes]
    for r in range(tp):
        np.testing.assert_array_equal(per_rank[r][: spec.state_bytes], state[r])
        # and the ssm bytes of rank r are the ssm values of its heads
        ssm_r = from_raw(
            jnp.asarray(state[r : r + 1, None, mamba.page.ssm.offset :]), "float32", spec.ssm_shape
        )
        np.testing.assert_array_equal(
            np.asarray(ssm_r)[0, 0], np.asarray(ssm)[0, r * 4 // tp : (r + 1) * 4 // tp]
        )


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


@pytest.mark.parametrize("family,tp", [("nemotron_h", 1), ("inkling", 1), ("inkling", 2)])
def test_steps_update_the_regions_in_place(hf_checkpoint, tmp_path, family, tp):
    """No compiled step copies a whole region (prefill chunks, decode steps, a page copy): the
    step writes exactly the rows it owns, so bytes a P/D transfer writes into other pages of
    the region while the step runs survive it. (A read of the old region followed by an
    independent write, or a scatter through a reshaped view, made XLA copy the whole buffer
    and write it back at the end: transferred pages were lost under load.)"""
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
    region_bytes = runner.regions[0].size // tp  # one rank's shard
    assert len(compiled) == 2
    for hlo in compiled:
        assert not region_copies(hlo, region_bytes)
