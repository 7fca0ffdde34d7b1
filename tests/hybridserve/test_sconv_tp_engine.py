"""Sconv-aware tensor parallelism in the engine (`layers.sconv`): at TP 2 and 4 each rank
computes the short convs of its own 1/TP of the channels, in its own shard of the regions, and
holds 1/TP of the sconv cache bytes; the greedy tokens equal the one-device engine's.

The model has 4 KV heads (an sconv entry of 64 channels: S = 4 heads per half), so every TP
here splits the entries without duplicating a head. Fewer KV heads than TP (S = tp, an entry
wider than at TP 1) is checked on the plan below and for logits in test_tp_attention.py."""

from __future__ import annotations

import numpy as np
import pytest
from engine_shapes import INKLING

from hybridserve import LLM, SamplingParams
from hybridserve.cache.page_layout import page_layouts
from hybridserve.cache.plan import make_plan
from hybridserve.cache.spec import SconvSpec
from hybridserve.config import CacheConfig
from hybridserve.layers.sconv import ShortConv
from tests.hybridserve.inkling_models import build_inkling, save_inkling, tiny_inkling

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    cfg = tiny_inkling(kv_heads=4)
    return save_inkling(build_inkling(cfg, seed=5), cfg, tmp_path_factory.mktemp("ink4") / "m")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(10, 4000, n).tolist() for n in (5, 21, 37)]  # past the window of 6


@pytest.fixture(scope="module")
def one_device(ckpt, prompts):
    llm = LLM(ckpt, **INKLING, progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


def sconv_bytes_per_token(llm: LLM) -> tuple[int, int]:
    """(bytes of every sconv entry of one token that one device holds, sconv heads S), from
    the plan, with each region's shard on each device checked to be one rank's pages."""
    runner = llm.engine.runner
    plan, tp = runner.plan, runner.plan.tensor_parallel_size
    for region in runner.regions:
        shards = region.addressable_shards
        assert len({s.device for s in shards}) == tp
        assert all(s.data.nbytes == runner.num_pages * plan.page_size_bytes for s in shards)
    groups = [g for g in plan.groups if isinstance(g.spec, SconvSpec)]
    assert {g.spec.bytes_per_token for g in groups} == {groups[0].spec.bytes_per_token}
    return per_token(plan), groups[0].spec.num_kv_heads * tp


def per_token(plan) -> int:
    """Bytes per token of every sconv entry of `plan`, on one rank."""
    return sum(
        g.spec.bytes_per_token * sum(e is not None for e in g.layers)
        for g in plan.groups
        if isinstance(g.spec, SconvSpec)
    )


@pytest.mark.parametrize("tp", [2, 4])
def test_engine_at_tp_splits_the_sconvs_and_equals_one_device(ckpt, prompts, one_device, tp,
                                                              monkeypatch):  # fmt: skip
    base_llm, base_tokens = one_device
    seen = []
    local = ShortConv._local

    def spy(self, u, weight, bias, regions, *rest):
        seen.append((u.shape[4], [r.shape[0] for r in regions]))  # heads, rank rows
        return local(self, u, weight, bias, regions, *rest)

    monkeypatch.setattr(ShortConv, "_local", spy)
    llm = LLM(ckpt, **INKLING, tensor_parallel_size=tp, progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == base_tokens

    # Every sconv (3 sites x 3 layers per traced program) ran on one rank's heads and shard.
    one, heads = sconv_bytes_per_token(base_llm)
    mine, heads_tp = sconv_bytes_per_token(llm)
    assert heads == heads_tp == 4
    assert seen and {s for s, _ in seen} == {heads // tp}
    assert {n for _, rows in seen for n in rows} == {1}
    # Each device holds 1/TP of the one-device engine's sconv bytes per token.
    assert mine * tp == one, (mine, one)


@pytest.mark.parametrize("kv_heads,tp,held", [(2, 2, 1), (2, 4, 1), (4, 2, 2)])
def test_ranks_hold_disjoint_sconv_heads(kv_heads, tp, held):
    # Ranks never hold an sconv head twice, also with fewer KV heads than ranks (then S = tp
    # heads of the same width: an entry holds tp / kv_heads times the channels of TP 1's).
    cfg = tiny_inkling(kv_heads=kv_heads)
    plan = make_plan(cfg, CacheConfig(), tp, "float32")
    sconv = [i for i, g in enumerate(plan.groups) if isinstance(g.spec, SconvSpec)]
    per_rank = [{tuple(page_layouts(plan, cfg, r)[i].k.held) for i in sconv} for r in range(tp)]
    assert all(len(h) == 1 for h in per_rank)
    ranges = [h.pop() for h in per_rank]
    assert sorted(x for r in ranges for x in r) == list(range(max(kv_heads, tp)))
    assert {len(r) for r in ranges} == {held}
    one = make_plan(cfg, CacheConfig(), 1, "float32")
    channels = 3 * (2 * kv_heads * 8 + 48 + 48) * 4  # 3 layers: kv, out, ffn sites, float32
    width = 2 * max(kv_heads, tp) * 8  # channels of one entry at this TP
    padded = 3 * sum(-(-c // width) * width for c in (2 * kv_heads * 8, 48, 48)) * 4
    assert per_token(plan) * tp == padded >= channels
    if tp <= kv_heads:
        assert per_token(plan) * tp == per_token(one)
