"""The rank layout (handshake form, compatibility), the dual descriptor view and block id ->
descriptor id, pinned with vLLM's worked cases and Nemotron-3-Nano-30B byte offsets
(shared/reference/nixl_hybrid_spec.md 2.5 and 2.10). Pure Python: no JAX, no NIXL."""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest
from disagg_models import base_of, make_layout, make_plan, nano, nano_config, tiny_config

from hybridserve.disagg import (
    RankLayout,
    check_compatible,
    descriptor_ids,
    expand_kernel_ids,
    layout_descriptor_ids,
    local_descriptors,
    local_runs,
    view_size,
)

FA, M = "full_attention", "mamba"
NANO_PAGE = {1: 2_138_112, 2: 1_069_056, 4: 536_576}


# --- descriptor ids ----------------------------------------------------------------------------


def test_worked_case_ratio_one():
    # M = 2 attention regions (T = 1), S = 4 state regions, N = 100
    ids = descriptor_ids([FA, M], [[3, 5], [1, 2]], 1, 100, 100)
    assert ids == [3, 5, 103, 105, 201, 202, 301, 302, 401, 402, 501, 502]


def test_worked_case_kernel_ids_with_ratio_four():
    # N_phys = 400, N_log = 100; [3, 7] are already kernel ids, so they expand with ratio 1
    ids = descriptor_ids([FA, M], [[3, 7], [1, 2]], 1, 400, 100, ratio=1)
    assert ids == [3, 7, 403, 407, 801, 802, 901, 902, 1001, 1002, 1101, 1102]


def test_logical_ids_expand_with_the_given_ratio():
    ids = descriptor_ids([FA, M], [[2], [1]], 1, 400, 100, ratio=4)
    assert ids[:8] == [8, 9, 10, 11, 408, 409, 410, 411]
    assert ids[8:] == [801, 901, 1001, 1101]
    assert expand_kernel_ids([0, 5], 3) == [0, 1, 2, 15, 16, 17]


def test_group_order_and_sections():
    # groups keep plan order; the FA section comes first in the view whatever the group order
    ids = descriptor_ids([M, FA], [[1], [3]], 2, 10, 5)
    fa = 2 * 2 * 10
    assert ids == [fa + s * 5 + 1 for s in range(8)] + [r * 10 + 3 for r in range(4)]
    # without attention the SSM section starts at 0
    assert descriptor_ids([M], [[2]], 1, 10, 5) == [2, 7, 12, 17]
    assert descriptor_ids([FA], [[1]], 1, 10, 5) == [1, 11]


def test_inactive_components_are_skipped():
    ids = descriptor_ids([FA, M], [[3], [1]], 1, 100, 100, active=frozenset({"x", "ssm"}))
    assert ids == [201, 501]


@pytest.mark.parametrize(
    "kinds, ids, message",
    [
        ([FA], [[1], [2]], "block id lists"),
        ([FA], [[100]], "kernel block id out of range"),
        ([M], [[-1]], "Mamba page id out of range"),
        (["sconv"], [[1]], "unknown group kind"),
    ],
)
def test_descriptor_ids_refuses_bad_input(kinds, ids, message):
    with pytest.raises(ValueError, match=message):
        descriptor_ids(kinds, ids, 1, 100, 100)


def test_descriptor_ids_is_independent_of_the_pool_size():
    # 64 logical blocks into a pool of 10**12 kernel blocks: only the ids themselves are built
    start = time.perf_counter()
    ids = descriptor_ids([M, FA], [[7], list(range(1, 65))], 6, 10**12, 10**10, ratio=4)
    assert time.perf_counter() - start < 0.5
    assert len(ids) == 4 * 6 + 12 * 64 * 4
    assert ids[-1] == 11 * 10**12 + 64 * 4 + 3


def test_layout_descriptor_ids_use_the_layouts_ratio():
    p1, d2 = nano(1), nano(2)  # ratio 261 both, but N_phys differs with num_pages
    p4 = nano(4)
    assert p4.ratio == 131 and p1.ratio == 261
    ids = layout_descriptor_ids(p4, [[1], [2], [3], [4], [5]])
    fa = ids[4 * 4 * 6 :]  # 4 Mamba groups first (plan order), then attention
    assert len(fa) == 12 * 131 and fa[:2] == [5 * 131, 5 * 131 + 1]
    assert fa[131] == p4.n_phys + 5 * 131  # V_0
    assert len(layout_descriptor_ids(p1, [[1]] * 5)) == 24 * 4 + 12 * 261
    assert d2.n_phys == 2610


# --- the layout ------------------------------------------------------------------------------


def test_nano_layout_from_plan():
    lay = nano(2, rank=1)
    assert lay.group_kinds == (M, M, M, M, FA)
    assert lay.num_regions == 6 and lay.ratio == 261 and lay.kernel_block == 16
    assert (lay.page_bytes, lay.kernel_page_bytes, lay.kv_half_bytes) == (1_069_056, 4096, 2048)
    assert (lay.kv_heads, lay.head_dim, lay.kv_dtype) == (2, 128, "float8_e4m3fn")
    assert lay.kv_slab.held == range(1, 2)
    x, b, c, ssm = lay.mamba_slabs
    assert [(s.offset, s.size) for s in (x, b, c, ssm)] == [
        (0, 12_288),
        (12_288, 3_072),
        (15_360, 3_072),
        (18_432, 1_048_576),
    ]
    assert x.held == ssm.held == range(32, 64) and b.held == range(4, 8)
    assert (lay.conv_bytes, lay.state_bytes) == (18_432, 1_067_008)
    assert (lay.conv_dtype, lay.ssm_dtype, lay.conv_layout) == ("bfloat16", "float32", "DS")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_nano_descriptor_counts_and_order(tp):
    lay = nano(tp, num_pages=3)
    t, n_phys, n_log = 6, 3 * lay.ratio, 3
    descs = local_descriptors(lay)
    assert len(descs) == view_size(lay) == 2 * t * n_phys + 4 * t * n_log
    kpage, page = lay.kernel_page_bytes, NANO_PAGE[tp]
    a0, a5 = lay.region_bases[0], lay.region_bases[5]
    assert descs[0] == (a0, kpage // 2, 0)  # K_0[0], on device 0 (rank 0)
    assert descs[1] == (a0 + kpage, kpage // 2, 0)  # K_0[1]
    assert descs[n_phys] == (a0 + kpage // 2, kpage // 2, 0)  # V_0[0]
    assert descs[2 * n_phys][0] == lay.region_bases[1]  # K_1[0]
    fa = 2 * t * n_phys
    x_b = 24_576 // tp
    assert descs[fa] == (a0, x_b, 0)  # x_0[0]
    assert descs[fa + 1] == (a0 + page, x_b, 0)  # x_0[1]
    assert descs[fa + n_log] == (a0 + x_b, x_b // 4, 0)  # B_0[0]
    assert descs[-1] == (a5 + 2 * page + lay.conv_bytes, 2_097_152 // tp, 0)  # ssm_5[2]


def test_nano_tp2_byte_exact_descriptors():
    # spec 2.10: kernel block k: K (a + 4096k, 2048), V (a + 4096k + 2048, 2048); Mamba page b
    # (1,069,056): x (.., 12,288), B (+12,288, 3,072), C (+15,360, 3,072), ssm (+18,432, 1 MiB)
    lay = nano(2, num_pages=4)
    a, k, b, n_phys = lay.region_bases[0], 7, 3, lay.n_phys
    descs = local_descriptors(lay)
    assert descs[k] == (a + 4096 * k, 2048, 0)
    assert descs[n_phys + k] == (a + 4096 * k + 2048, 2048, 0)
    fa, page = 12 * n_phys, 1_069_056
    got = [descs[fa + s * 4 + b][:2] for s in range(4)]
    p = a + page * b
    assert got == [(p, 12_288), (p + 12_288, 3_072), (p + 15_360, 3_072), (p + 18_432, 1_048_576)]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_padding_never_covered(tp):
    lay = nano(tp, num_pages=2)
    runs = local_runs(lay)
    fa_runs, ssm_runs = runs[:12], runs[12:]
    for i, base in enumerate(lay.region_bases):
        k, v = fa_runs[2 * i], fa_runs[2 * i + 1]
        # K and V tile each kernel page exactly
        assert (k.addr, k.length, v.addr, v.length) == (
            base,
            lay.kernel_page_bytes // 2,
            base + lay.kernel_page_bytes // 2,
            lay.kernel_page_bytes // 2,
        )
        parts = ssm_runs[4 * i : 4 * i + 4]
        # x, B, C, ssm tile [0, state_bytes) of each page: padding (page - state) never moves
        edges = [(r.addr - base, r.addr - base + r.length) for r in parts]
        assert edges[0][0] == 0 and edges[-1][1] == lay.state_bytes < lay.page_bytes
        assert all(edges[j][1] == edges[j + 1][0] for j in range(3))
        assert all(r.stride == lay.page_bytes and r.count == 2 for r in parts)


def test_views_without_attention_or_without_mamba():
    ssm_only = make_layout(tiny_config(pattern="MM"), 1, 0, num_pages=3)
    assert not ssm_only.has_attention and view_size(ssm_only) == 4 * 2 * 3
    assert len(local_descriptors(ssm_only)) == 24
    attn_only = make_layout(tiny_config(pattern="**"), 1, 0, num_pages=3)
    assert not attn_only.has_mamba
    assert len(local_descriptors(attn_only)) == 2 * 2 * 3 * attn_only.ratio


def test_layout_dict_round_trips():
    lay = nano(4, rank=3, num_pages=7)
    data = lay.to_dict()
    assert json.loads(json.dumps(data)) == data  # plain ints, strings, lists
    assert isinstance(data["region_bases"], list) and isinstance(data["group_layers"][0], list)
    assert RankLayout.from_dict(json.loads(json.dumps(data))) == lay
    msgpack = pytest.importorskip("msgpack")
    assert RankLayout.from_dict(msgpack.unpackb(msgpack.packb(data))) == lay
    padded = nano(1).to_dict()["group_layers"][3]
    assert padded[-1] is None  # the 4th Mamba group has 5 layers + 1 padding slot


def test_layout_from_dict_refuses_unknown_or_missing_fields():
    data = nano(1).to_dict()
    with pytest.raises(ValueError, match="unknown cache layout fields"):
        RankLayout.from_dict({**data, "extra": 1})
    del data["region_bases"]
    with pytest.raises(ValueError, match="region_bases"):
        RankLayout.from_dict(data)


def test_layout_validation():
    lay = nano(2)
    with pytest.raises(ValueError, match="tp_rank"):
        dataclasses.replace(lay, tp_rank=2)
    with pytest.raises(ValueError, match="kernel page"):
        dataclasses.replace(lay, head_dim=64)
    with pytest.raises(ValueError, match="larger than a page"):
        dataclasses.replace(lay, page_bytes=2 * 4096, ratio=2)
    cfg = nano_config()
    with pytest.raises(ValueError, match="2 region bases for 6 regions"):
        RankLayout.from_plan(make_plan(cfg, 1), cfg, tp_rank=0, region_bases=[1, 2], num_pages=4)


def test_layout_refuses_overlapping_regions():
    # A peer's layout arrives over the wire: regions that share bytes would alias two layers.
    lay = nano(1, num_pages=10)
    span = 10 * lay.page_bytes
    touching = [7 * span - i * span for i in range(lay.num_regions)]  # descending, no gap
    assert dataclasses.replace(lay, region_bases=tuple(touching)).region_bases[0] == 7 * span
    one_byte_short = (*touching[:-1], touching[-2] - span + 1)
    with pytest.raises(ValueError, match=f"regions of {span} bytes overlap"):
        dataclasses.replace(lay, region_bases=one_byte_short)
    with pytest.raises(ValueError, match="negative region base"):
        dataclasses.replace(lay, region_bases=(-span, *touching[:-1]))


# --- compatibility -----------------------------------------------------------------------------


def test_compatible_across_tp_ratio_and_pool():
    check_compatible(nano(1, num_pages=5), nano(4, rank=2, num_pages=9, side=1))
    assert nano(1).compatibility_hash() == nano(2, rank=1, side=1).compatibility_hash()
    key = nano(1).compatibility_key()
    assert not {"tp_size", "tp_rank", "region_bases", "num_pages", "ratio"} & set(key)
    assert {"kv_dtype", "conv_layout", "kernel_block", "group_kinds", "n_groups"} <= set(key)


@pytest.mark.parametrize(
    "other, field",
    [
        ({"kv_dtype": "bfloat16"}, "kv_dtype"),
        ({"layout": "SD"}, "conv_layout"),
        ({"kernel_block": 32}, "kernel_block"),
    ],
)
def test_mismatch_names_the_field(other, field):
    local = nano(2)
    remote = nano(1, side=1, **other)
    with pytest.raises(ValueError, match=f"disagree on {field}"):
        check_compatible(local, remote)
    assert local.compatibility_hash() != remote.compatibility_hash()


def test_mismatched_model_names_the_field():
    a = make_layout(tiny_config(n_groups=2), 1, 0)
    b = make_layout(tiny_config(n_groups=4), 1, 0, side=1)
    with pytest.raises(ValueError, match="disagree on n_groups: local 2, remote 4"):
        check_compatible(a, b)
    c = make_layout(tiny_config(pattern="MM**MM"), 1, 0, side=1)
    with pytest.raises(ValueError, match="disagree on group_layers"):
        check_compatible(a, c)


def test_bases_are_per_rank_and_side():
    assert nano(2, rank=1, side=1).region_bases[2] == base_of(1, 1, 2)


def test_modules_are_standard_library_only():
    root = Path(__file__).resolve().parents[2] / "hybridserve" / "disagg"
    allowed = (
        "hybridserve.config",
        "hybridserve.cache.spec",
        "hybridserve.cache.plan",
        "hybridserve.cache.page_layout",
        "hybridserve.disagg.",
    )
    for name in (
        "__init__.py",
        "descriptors.py",
        "dual_ids.py",
        "tp_mapping.py",
        "coarse_view.py",
        "request_spans.py",
    ):
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                assert top in sys.stdlib_module_names or mod.startswith(allowed), (name, mod)


@pytest.mark.parametrize("kv_heads, tps, ok", [(4, (1, 4), True), (2, (1, 2), True),
                                               (2, (1, 4), False), (2, (2, 4), False)])  # fmt: skip
def test_sconv_entries_move_between_tp_sizes_that_share_their_layout(kv_heads, tps, ok):
    # An sconv entry holds max(kv_heads, tp) heads: the same layout at every tp <= kv_heads
    # (P/D moves it like KV), another one above; a mismatch is refused by name at the
    # handshake, not moved into the wrong channels.
    from tests.hybridserve.inkling_models import tiny_inkling

    cfg = tiny_inkling(kv_heads=kv_heads)
    a, b = (make_layout(cfg, tp, 0, side=i, kv_dtype="bfloat16") for i, tp in enumerate(tps))
    assert a.sconv_heads == max(kv_heads, tps[0]) and b.sconv_heads == max(kv_heads, tps[1])
    if ok:
        check_compatible(a, b)
    else:
        with pytest.raises(ValueError, match="disagree on sconv_heads.*tp <= num_key_value"):
            check_compatible(a, b)
