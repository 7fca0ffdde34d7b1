"""The coarse (page-granular) descriptor view: whole pages for rank pairs that need no slicing
(equal TP, ratio, page bytes and conv layout), its ids, its choice by `plan_reads`, and the
per-request id counts of a 64-page Nemotron-3-Nano-30B request. Pure Python: no JAX, no NIXL.
(Speed is measured in benchmarks, not here; `ReadPlan.request_ids` is what they time.)"""

from __future__ import annotations

import dataclasses
import random

import pytest
from disagg_models import make_layout, nano, nano_config, prefill_ranks, tiny_config

from hybridserve.disagg.descriptors import coarse_runs, coarse_view_size, expand_runs
from hybridserve.disagg.tp_mapping import (
    coarse_descriptor_ids,
    coarse_pair,
    kernel_spans,
    plan_reads,
    request_ids,
)

FA, M = "full_attention", "mamba"
NANO_PAGE_TP2, NANO_STATE_TP2 = 1_069_056, 1_067_008


# --- ids ---------------------------------------------------------------------------------------


def test_coarse_worked_case():
    # T = 2, N_log = 100, attention pages [3, 5], state pages [1, 2]:
    #   attention (no ratio expansion): i*100 + p -> i=0: 3, 5; i=1: 103, 105
    #   Mamba: T*N_log + i*100 + b = 200 + i*100 + b -> i=0: 201, 202; i=1: 301, 302
    ids = coarse_descriptor_ids([FA, M], [[3, 5], [1, 2]], 2, 100)
    assert ids == [3, 5, 103, 105, 201, 202, 301, 302]


def test_coarse_group_order_and_sections():
    # groups keep plan order; the attention section comes first whatever the group order
    assert coarse_descriptor_ids([M, FA], [[1], [3]], 2, 10) == [21, 31, 3, 13]
    # without attention the state section starts at 0; without Mamba there is none
    assert coarse_descriptor_ids([M, M], [[2], [4]], 2, 10) == [2, 12, 4, 14]
    assert coarse_descriptor_ids([FA], [[1, 9]], 3, 10) == [1, 9, 11, 19, 21, 29]
    assert coarse_descriptor_ids([FA, M], [[], []], 2, 10) == []


@pytest.mark.parametrize(
    "kinds, ids, message",
    [
        ([FA], [[1], [2]], "block id lists"),
        ([FA], [[100]], "page id out of range"),
        ([FA], [[98, 99, 100]], "page id out of range"),
        ([FA], [[-1, 0, 1]], "page id out of range"),
        ([FA], [[5, 100, 7]], "page id out of range"),
        ([M], [[-1]], "page id out of range"),
        (["sconv"], [[1]], "unknown group kind"),
    ],
)
def test_coarse_ids_refuse_bad_input(kinds, ids, message):
    with pytest.raises(ValueError, match=message):
        coarse_descriptor_ids(kinds, ids, 1, 100)


@pytest.mark.parametrize(
    "table",
    [[7], [5, 6], [6, 5], [10, 11, 12, 13], [10, 12, 11, 13], [13, 12, 11, 10], [0, 2, 4, 9]],
)
def test_coarse_ids_match_the_formula_for_any_table(table):
    # runs of consecutive pages take a `range` path, other tables a comprehension: same ids
    t, n_log = 3, 20
    for kinds in ([FA, M], [M, FA], [M, M], [FA]):
        tables = [table if g == 0 else [19] for g in range(len(kinds))]
        fa = t * n_log if FA in kinds else 0
        expected = [
            (0 if kind == FA else fa) + i * n_log + p
            for kind, ids in zip(kinds, tables, strict=True)
            for i in range(t)
            for p in ids
        ]
        assert coarse_descriptor_ids(kinds, tables, t, n_log) == expected
        assert coarse_descriptor_ids(kinds, [tuple(x) for x in tables], t, n_log) == expected


def test_kernel_spans_merge_adjacent_pages_and_cut():
    # pages 3, 4 (ratio 4) are kernel blocks 12..19, page 7 is 28..31; cut to 10 blocks
    assert kernel_spans([3, 4, 7], 4, 10) == [(12, 20), (28, 30)]
    assert kernel_spans([3, 4, 7], 4, 12) == [(12, 20), (28, 32)]
    assert kernel_spans([5, 2], 1, 2) == [(5, 6), (2, 3)]
    assert kernel_spans([], 4, 0) == []


# --- the view ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_nano_coarse_view_moves_whole_pages_and_no_padding(tp):
    lay = nano(tp, num_pages=3)
    runs = coarse_runs(lay)
    t, page = 6, lay.page_bytes
    # 3 pages: one merge level (2 pages; 4 > 3), 3 - 2 + 1 = 2 entries per region
    assert len(runs) == 3 * t and coarse_view_size(lay) == 2 * t * 3 + t * 2
    for i, base in enumerate(lay.region_bases):
        attn, state, pair = runs[i], runs[t + i], runs[2 * t + i]
        assert (attn.addr, attn.stride, attn.count, attn.length) == (base, page, 3, page)
        assert (state.addr, state.stride, state.count, state.length) == (
            base,
            page,
            3,
            lay.state_bytes,
        )
        assert (pair.addr, pair.stride, pair.count, pair.length) == (base, page, 2, 2 * page)
    # a full attention page is all data (ratio kernel pages of K + V); the state is not
    assert lay.ratio * 2 * lay.kv_half_bytes == page
    assert lay.state_bytes < page
    descs = expand_runs(runs, lay.device_id)
    assert len(descs) == coarse_view_size(lay)
    a5 = lay.region_bases[5]
    assert descs[5 * 3 + 2] == (a5 + 2 * page, page, 0)  # P_5[2]
    assert descs[t * 3 + 5 * 3 + 2] == (a5 + 2 * page, lay.state_bytes, 0)  # S_5[2]
    assert descs[-1] == (a5 + page, 2 * page, 0)  # M^1_5[1]: pages 1 and 2 of region 5


def test_coarse_view_of_single_kind_models():
    ssm_only = make_layout(tiny_config(pattern="MM"), 1, 0, num_pages=3)
    assert [r.length for r in coarse_runs(ssm_only)] == [ssm_only.state_bytes] * 2
    attn_only = make_layout(tiny_config(pattern="**"), 1, 0, num_pages=3)
    page = attn_only.page_bytes
    assert [r.length for r in coarse_runs(attn_only)] == [page] * 2 + [2 * page] * 2
    assert coarse_view_size(ssm_only) == 2 * 3  # state pages are never merged
    assert coarse_view_size(attn_only) == 2 * 3 + 2 * 2


# --- plans ---------------------------------------------------------------------------------------


def test_nano_tp2_to_tp2_request_of_64_pages():
    # T = 6; groups (M, M, M, M, FA): one attention group of 64 pages, 4 Mamba groups of 1 page
    #   attention: 64 pages consecutive on both sides = one piece of 2^6 pages: 1 id per region
    #              = 6 ids (unmerged: 6 regions x 64 pages = 384)
    #   Mamba:     4 groups x 6 regions x 1 page = 24 ids
    #   total 30 per side (unmerged 408; the dual view: 12 x 64 x 261 + 4 x 24 x 1 = 200,544)
    for r in (0, 1):
        local = nano(2, rank=r, num_pages=100)
        remotes = prefill_ranks(nano_config(), 2, num_pages=200)
        plan = plan_reads(local, remotes)
        (read,) = plan.reads
        assert read.view == "coarse" and read.remote_rank == r
        assert local.group_kinds == (M, M, M, M, FA)
        local_tables = [[1], [2], [3], [4], list(range(10, 74))]
        remote_tables = [[101], [102], [103], [104], list(range(120, 184))]
        lids, rids = read.descriptor_ids(local_tables, remote_tables)
        assert len(lids) == len(rids) == 30 == 6 * 1 + 4 * 6 * 1
        assert (lids, rids) == request_ids(read, local_tables, remote_tables)
        assert plan.request_ids(local_tables, remote_tables) == [(lids, rids)]
        unmerged = coarse_descriptor_ids(local.group_kinds, local_tables, 6, 100)
        assert len(unmerged) == 408
        # Mamba groups first (plan order): group g, region i -> T*N_log + i*N_log + b
        assert lids[:6] == [600 + i * 100 + 1 for i in range(6)]
        assert rids[:6] == [1200 + i * 200 + 101 for i in range(6)]
        assert lids[:24] == unmerged[:24]
        # then attention: level 6 (64 pages), region i, first page p. The level sections follow
        # the T*N_log attention pages and T*N_log state pages; level j has T*(N_log - 2^j + 1)
        # entries, N_log - 2^j + 1 per region
        for n_log, p, ids in ((100, 10, lids), (200, 120, rids)):
            base = 2 * 6 * n_log + sum(6 * (n_log - 2**j + 1) for j in range(1, 6))
            assert ids[24:] == [base + i * (n_log - 64 + 1) + p for i in range(6)]
        assert lids[24:] == [3858 + 37 * i + 10 for i in range(6)]  # 1200 + 6*(99+97+93+85+69)
        assert rids[24:] == [8058 + 137 * i + 120 for i in range(6)]  # 2400 + 6*943
        # byte lengths pairwise equal: 64 whole pages for attention, state bytes for Mamba
        ld, rd = read.local_descriptors(), read.remote_descriptors()
        assert len(ld) == 2 * 6 * 100 + 6 * (99 + 97 + 93 + 85 + 69 + 37)
        assert len(rd) == 2 * 6 * 200 + 6 * (199 + 197 + 193 + 185 + 169 + 137)
        lens = [ld[a][1] for a in lids]
        assert lens == [rd[b][1] for b in rids]
        assert lens == [NANO_STATE_TP2] * 24 + [64 * NANO_PAGE_TP2] * 6
        for i, a in enumerate(lids[24:]):
            assert ld[a][0] == local.region_bases[i] + 10 * NANO_PAGE_TP2
        # the fine view of the same pair: one id per kernel block and K/V, x/B/C/ssm
        (fine,) = plan_reads(local, remotes, allow_coarse=False).reads
        flids, frids = fine.descriptor_ids(local_tables, remote_tables)
        assert fine.view == "fine" and len(flids) == len(frids) == 200_544
        fl, fr = fine.local_descriptors(), fine.remote_descriptors()
        assert sum(fl[a][1] for a in flids) == sum(lens) == sum(fr[b][1] for b in frids)


def test_coarse_ids_do_not_depend_on_the_pool_size():
    # 10**10 pages per side: the runs are lazy and the ids only use N_log as an offset
    n, n2 = 10**10, 3 * 10**10

    def huge(num_pages, side):  # regions far enough apart for such a pool
        lay = nano(2, side=side)
        span = num_pages * lay.page_bytes
        bases = tuple((side * lay.num_regions + i) * span for i in range(lay.num_regions))
        return dataclasses.replace(lay, num_pages=num_pages, region_bases=bases)

    local = huge(n, side=0)
    remotes = {0: huge(n2, side=1)}
    (read,) = plan_reads(local, remotes).reads
    assert read.coarse
    lids, rids = read.descriptor_ids([[7]] * 4 + [[5, 6]], [[8]] * 4 + [[9, 10]])
    assert len(lids) == len(rids) == 4 * 6 + 6 * 1  # pages 5, 6 -> 9, 10: one 2-page piece
    assert lids[0] == 6 * n + 7 and rids[0] == 6 * n2 + 8
    # level 1 starts after 2*T*N_log entries, N_log - 1 per region: region 5 of page 5 / 9
    assert lids[-1] == 12 * n + 5 * (n - 1) + 5 and rids[-1] == 12 * n2 + 5 * (n2 - 1) + 9


def test_plan_picks_the_coarse_view_only_without_slicing():
    cfg = nano_config()
    for d_tp, p_tp in [(1, 1), (2, 2), (4, 4)]:
        for r in range(d_tp):
            local = nano(d_tp, rank=r, num_pages=3)
            remotes = prefill_ranks(cfg, p_tp, num_pages=5)  # pool sizes may differ
            assert [read.view for read in plan_reads(local, remotes).reads] == ["coarse"]
            assert coarse_pair(local, remotes[r])
            forced = plan_reads(local, remotes, allow_coarse=False).reads
            assert [read.view for read in forced] == ["fine"]
    for d_tp, p_tp in [(2, 1), (1, 2), (4, 2), (2, 4)]:
        local = nano(d_tp, rank=d_tp - 1)
        plan = plan_reads(local, prefill_ranks(cfg, p_tp))
        assert all(read.view == "fine" and not read.coarse for read in plan.reads)
        assert not any(coarse_pair(local, read.remote) for read in plan.reads)


# --- the fine view against an independent reference --------------------------------------------


def reference_fine_ids(layout, kernel_ids_per_group, active):
    """The dual-view formula, one kernel id at a time."""
    t, n_phys, n_log = layout.num_regions, layout.n_phys, layout.n_log
    fa = 2 * t * n_phys if layout.has_attention else 0
    out = []
    for kind, ids in zip(layout.group_kinds, kernel_ids_per_group, strict=True):
        if kind == FA:
            if "kv" in active:
                out += [r * n_phys + k for r in range(2 * t) for k in ids]
        else:
            parts = ("x", "B", "C", "ssm")
            out += [
                fa + (4 * i + j) * n_log + b
                for i in range(t)
                for j in range(4)
                if parts[j] in active
                for b in ids
            ]
    return out


def kernels(layout, tables, ratio, n):
    """Attention pages -> their first n kernel ids `p*ratio + j`; Mamba pages unchanged."""
    return [
        ids if k == M else [p * ratio + j for p in ids for j in range(ratio)][:n]
        for k, ids in zip(layout.group_kinds, tables, strict=True)
    ]


@pytest.mark.parametrize("seed", range(5))
def test_fine_ids_match_the_per_block_formula(seed):
    rng = random.Random(seed)
    cfg = tiny_config(kv_heads=1, n_groups=2)
    local = make_layout(cfg, 2, 0, num_pages=40)  # KV replicated at TP2: ratios differ
    (read,) = plan_reads(local, prefill_ranks(cfg, 1, num_pages=40)).reads
    lr, rr = local.ratio, read.remote.ratio
    assert lr != rr and read.view == "fine"
    tokens = rng.randrange(1, 6 * 16 * max(lr, rr))
    n_l, n_r = -(-tokens // (16 * lr)), -(-tokens // (16 * rr))
    pages = list(range(40))
    rng.shuffle(pages)
    lt = [pages[:1] if k == M else sorted(pages[1 : 1 + n_l]) for k in local.group_kinds]
    rng.shuffle(pages)
    rt = [pages[:1] if k == M else pages[1 : 1 + n_r] for k in local.group_kinds]
    n = min(n_l * lr, n_r * rr)
    lids, rids = read.descriptor_ids(lt, rt)
    assert lids == reference_fine_ids(local, kernels(local, lt, lr, n), read.active)
    assert rids == reference_fine_ids(read.remote, kernels(local, rt, rr, n), read.active)


def test_fine_ids_skip_inactive_components_as_the_formula_does():
    cfg = tiny_config(kv_heads=2, n_groups=1)  # P2 -> D1: rank 1's B/C duplicate rank 0's
    local = make_layout(cfg, 1, 0, num_pages=12)
    plan = plan_reads(local, prefill_ranks(cfg, 2, num_pages=12))
    assert [read.active for read in plan.reads][1] == {"kv", "x", "ssm"}
    lt = [[3] if k == M else [5, 6] for k in local.group_kinds]
    rt = [[7] if k == M else [9, 11] for k in local.group_kinds]
    for read in plan.reads:
        lr, rr = local.ratio, read.remote.ratio
        n = min(2 * lr, 2 * rr)
        lids, rids = read.descriptor_ids(lt, rt)
        assert lids == reference_fine_ids(local, kernels(local, lt, lr, n), read.active)
        assert rids == reference_fine_ids(read.remote, kernels(local, rt, rr, n), read.active)
