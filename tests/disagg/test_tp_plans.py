"""Heterogeneous-TP read plans: source ranks, per-pair byte slices (Nemotron-3-Nano-30B numbers
of shared/reference/nixl_hybrid_spec.md 2.10 / 3.3), replicated groups, GQA dedup, the DS
requirement, notification counts and per-request descriptor id pairs."""

from __future__ import annotations

import pytest
from disagg_models import make_layout, nano, nano_config, prefill_ranks, tiny_config

from hybridserve.disagg import (
    local_runs,
    notifications_per_request,
    plan_reads,
    source_ranks,
)
from hybridserve.disagg.descriptors import coarse_runs

FA, M = "full_attention", "mamba"
NANO_PAGE_TP1 = 2_138_112


def rel(runs, layout):
    """(offset from region 0's base, length) of the first run of each view section."""
    base = layout.region_bases[0]
    return [(r.addr - base, r.length) for r in runs]


@pytest.mark.parametrize(
    "d_tp, rank, p_tp, sources",
    [
        (1, 0, 1, [0]),
        (2, 1, 1, [0]),
        (4, 3, 2, [1]),
        (4, 2, 1, [0]),
        (1, 0, 2, [0, 1]),
        (2, 1, 4, [2, 3]),
        (1, 0, 4, [0, 1, 2, 3]),
    ],
)
def test_source_ranks(d_tp, rank, p_tp, sources):
    assert source_ranks(d_tp, rank, p_tp) == sources


def test_notifications_per_request():
    assert notifications_per_request(prefill_tp=1, decode_tp=2) == 2
    assert notifications_per_request(prefill_tp=2, decode_tp=8) == 4
    assert notifications_per_request(prefill_tp=2, decode_tp=2) == 1
    assert notifications_per_request(prefill_tp=4, decode_tp=1) == 1
    with pytest.raises(ValueError, match="one must divide the other"):
        notifications_per_request(prefill_tp=2, decode_tp=3)


@pytest.mark.parametrize("r", [0, 1])
def test_nano_prefill_tp1_to_decode_tp2(r):
    local, remote = nano(2, rank=r), nano(1, side=1)
    plan = plan_reads(local, {0: remote})
    assert plan.remote_ranks == [0] and plan.remote_tp == 1
    (read,) = plan.reads
    assert read.active == {"kv", "x", "B", "C", "ssm"}
    assert read.local_runs == local_runs(local)  # D reads its whole view from one source
    fa, ssm = read.remote_runs[:2], read.remote_runs[12:16]
    # K half of the TP1 kernel page (8192 B, halves 4096): rank r reads its head's 2048 B
    assert rel(fa, remote) == [(r * 2048, 2048), (4096 + r * 2048, 2048)]
    assert all(run.stride == 8192 and run.count == remote.n_phys for run in fa)
    assert rel(ssm, remote) == [
        (r * 12_288, 12_288),
        (24_576 + r * 3_072, 3_072),
        (30_720 + r * 3_072, 3_072),
        (36_864 + r * 1_048_576, 1_048_576),
    ]
    assert all(run.stride == NANO_PAGE_TP1 and run.count == 10 for run in ssm)
    # the same offsets in every region
    a3 = remote.region_bases[3]
    assert read.remote_runs[6].addr == a3 + r * 2048
    assert read.remote_runs[12 + 4 * 3 + 3].addr == a3 + 36_864 + r * 1_048_576
    # every remote Mamba descriptor stays inside [page start, page start + state)
    for n, run in enumerate(read.remote_runs[12:]):
        off = run.addr - remote.region_bases[n // 4]
        assert off >= 0 and off + run.length <= remote.state_bytes


@pytest.mark.parametrize("j", [0, 1])
def test_nano_prefill_tp2_to_decode_tp1(j):
    local = nano(1)
    plan = plan_reads(local, prefill_ranks(nano_config(), 2))
    assert plan.remote_ranks == [0, 1]
    read = plan.reads[j]
    assert read.active == {"kv", "x", "B", "C", "ssm"}  # 2 KV heads: no GQA dedup
    remote = read.remote
    assert rel(read.remote_runs[:2], remote) == [(0, 2048), (2048, 2048)]
    assert rel(read.remote_runs[12:16], remote) == [
        (0, 12_288),
        (12_288, 3_072),
        (15_360, 3_072),
        (18_432, 1_048_576),
    ]
    # the local descriptors are split: source j fills piece j of each
    assert rel(read.local_runs[:2], local) == [(j * 2048, 2048), (4096 + j * 2048, 2048)]
    assert rel(read.local_runs[12:16], local) == [
        (j * 12_288, 12_288),
        (24_576 + j * 3_072, 3_072),
        (30_720 + j * 3_072, 3_072),
        (36_864 + j * 1_048_576, 1_048_576),
    ]
    assert all(run.stride == NANO_PAGE_TP1 for run in read.local_runs[12:])


def test_plan_lists_have_matching_shapes():
    for d_tp, p_tp in [(1, 1), (2, 1), (1, 2), (4, 1), (1, 4), (2, 4)]:
        local = nano(d_tp, rank=d_tp - 1, num_pages=3)
        remotes = prefill_ranks(nano_config(), p_tp, num_pages=5)
        plan = plan_reads(local, remotes, allow_coarse=False)  # (1, 1) would be coarse
        for read in plan.reads:
            assert read.view == "fine"
            assert len(read.local_runs) == len(read.remote_runs) == 12 + 24
            for lr, rr in zip(read.local_runs, read.remote_runs, strict=True):
                assert lr.length == rr.length > 0
            assert len(read.local_descriptors()) == 2 * 6 * 3 * local.ratio + 4 * 6 * 3
            assert len(read.remote_descriptors()) == 2 * 6 * 5 * read.remote.ratio + 4 * 6 * 5
    # the coarse view of TP1 -> TP1: T*N_log attention pages + T*N_log state pages per side,
    # then per merge level k (2^k <= N_log) T*(N_log - 2^k + 1) attention pieces of 2^k pages:
    # local N_log = 3 has level 1 (6 x 2), remote N_log = 5 levels 1 and 2 (6 x 4, 6 x 2)
    (read,) = plan_reads(nano(1, num_pages=3), prefill_ranks(nano_config(), 1, num_pages=5)).reads
    assert read.view == "coarse"
    assert (len(read.local_runs), len(read.remote_runs)) == (6 + 6 + 6, 6 + 6 + 6 + 6)
    assert len(read.local_descriptors()) == 2 * 6 * 3 + 6 * 2
    assert len(read.remote_descriptors()) == 2 * 6 * 5 + 6 * 4 + 6 * 2


def test_equal_tp_moves_whole_subdescriptors():
    local = nano(2, rank=1)
    remotes = prefill_ranks(nano_config(), 2)
    (read,) = plan_reads(local, remotes, allow_coarse=False).reads
    assert read.remote_rank == 1 and read.view == "fine"
    assert read.local_runs == local_runs(local)
    assert read.remote_runs == local_runs(remotes[1])
    (read,) = plan_reads(local, remotes).reads  # by default: whole pages
    assert read.remote_rank == 1 and read.coarse
    assert read.local_runs == coarse_runs(local)
    assert read.remote_runs == coarse_runs(remotes[1])


@pytest.mark.parametrize("r, group", [(0, 0), (1, 0), (2, 1), (3, 1)])
def test_replicated_groups_p1_to_d4(r, group):
    # n_groups = 2 at TP4: ranks 0, 1 hold group 0 and ranks 2, 3 group 1
    cfg = tiny_config(kv_heads=2, n_groups=2)
    local = make_layout(cfg, 4, r)
    (read,) = plan_reads(local, prefill_ranks(cfg, 1)).reads
    remote = read.remote
    x_p, group_bytes = remote.mamba_slabs[0].size, 2 * 2 * 2  # state 2 x rows 2 x bf16
    assert remote.mamba_slabs[1].unit == group_bytes
    b, c = rel(read.remote_runs[5:7], remote)  # after 2 regions x (K, V), then x
    assert b == (x_p + group * group_bytes, group_bytes)
    assert c == (x_p + 2 * group_bytes + group * group_bytes, group_bytes)
    assert read.active == {"kv", "x", "B", "C", "ssm"}


@pytest.mark.parametrize("r", [0, 1])
def test_single_group_p1_to_d2_reads_group_zero(r):
    cfg = tiny_config(kv_heads=2, n_groups=1)
    (read,) = plan_reads(make_layout(cfg, 2, r), prefill_ranks(cfg, 1)).reads
    x_p = read.remote.mamba_slabs[0].size
    b, c = rel(read.remote_runs[5:7], read.remote)
    assert b == (x_p, 8) and c == (x_p + 8, 8)  # both ranks: the one group, B then C


def test_single_group_p2_to_d1_reads_bc_once():
    cfg = tiny_config(kv_heads=2, n_groups=1)
    plan = plan_reads(make_layout(cfg, 1, 0), prefill_ranks(cfg, 2))
    assert [read.active for read in plan.reads] == [
        {"kv", "x", "B", "C", "ssm"},
        {"kv", "x", "ssm"},  # rank 1's B/C duplicate rank 0's
    ]
    ids_local, ids_remote = plan.reads[1].descriptor_ids([[1], [2], [3]], [[4], [5], [6]])
    # 2 Mamba groups x 2 regions x (x, ssm) + 1 attention page x ratio x 2 regions x (K, V)
    assert len(ids_local) == len(ids_remote) == 2 * 2 * 2 + plan.local.ratio * 2 * 2


def test_gqa_dedup_p4_to_d1():
    cfg = tiny_config(kv_heads=2, n_groups=4)  # groups sharded: only the KV heads duplicate
    local = make_layout(cfg, 1, 0)
    plan = plan_reads(local, prefill_ranks(cfg, 4))
    assert plan.remote_ranks == [0, 1, 2, 3]
    assert [read.serves_attention for read in plan.reads] == [True, False, True, False]
    assert all({"x", "B", "C", "ssm"} <= read.active for read in plan.reads)  # state: all 4
    # heads 0 and 1 land in slots 0 and 1 of the local K half
    unit = local.kv_slab.unit
    assert rel(plan.reads[0].local_runs[:1], local) == [(0, unit)]
    assert rel(plan.reads[2].local_runs[:1], local) == [(unit, unit)]
    # a deduplicated source moves no attention ids
    kinds = local.group_kinds
    ids = [[1 + g] for g in range(len(kinds))]
    fa_groups = sum(k == FA for k in kinds)
    l0, _ = plan.reads[0].descriptor_ids(ids, ids)
    l1, r1 = plan.reads[1].descriptor_ids(ids, ids)
    # one page each side: the kernel lists are cut to the shorter (remote ratio 1, local 2)
    kernel = min(local.ratio, plan.reads[1].remote.ratio)
    assert (local.ratio, kernel) == (2, 1)
    assert len(l0) - len(l1) == fa_groups * 2 * 2 * kernel
    assert len(l1) == len(r1)


def test_sd_layout_with_unequal_tp_says_use_ds():
    cfg = tiny_config()
    local = make_layout(cfg, 2, 0, layout="SD")
    with pytest.raises(ValueError, match="HYBRIDSERVE_SSM_CONV_LAYOUT=DS"):
        plan_reads(local, prefill_ranks(cfg, 1, layout="SD"))
    # equal TP: the conv moves verbatim, in three consecutive byte chunks (fine view) or with
    # the ssm as one state descriptor per page (coarse view)
    remotes = prefill_ranks(cfg, 2, layout="SD")
    (read,) = plan_reads(local, remotes, allow_coarse=False).reads
    assert read.local_runs == local_runs(local)
    (read,) = plan_reads(local, remotes).reads
    assert read.coarse and read.local_runs == coarse_runs(local)


def test_plan_refuses_inconsistent_remotes():
    cfg = tiny_config()
    local = make_layout(cfg, 2, 0)
    with pytest.raises(ValueError, match="no layout for remote source ranks"):
        plan_reads(local, {1: make_layout(cfg, 4, 1, side=1)})
    with pytest.raises(ValueError, match="rank 1 of 2"):
        plan_reads(local, {0: make_layout(cfg, 2, 1, side=1)})
    with pytest.raises(ValueError, match="disagree on kv_dtype"):
        plan_reads(local, {0: make_layout(cfg, 1, 0, side=1, kv_dtype="bfloat16")})
    with pytest.raises(ValueError, match="no remote layouts"):
        plan_reads(local, {})


def test_pair_ids_expand_each_side_with_its_own_ratio():
    cfg = tiny_config(kv_heads=1, n_groups=2)
    local = make_layout(cfg, 2, 0, num_pages=16)  # KV replicated at TP2: a smaller ratio
    (read,) = plan_reads(local, prefill_ranks(cfg, 1, num_pages=16)).reads
    lr, rr = local.ratio, read.remote.ratio
    assert lr != rr
    kinds = local.group_kinds
    fa = kinds.index(FA)
    tokens = 3 * 16 * max(lr, rr) - 5
    n_l, n_r = -(-tokens // (16 * lr)), -(-tokens // (16 * rr))
    local_ids = [[1] if k == M else list(range(2, 2 + n_l)) for k in kinds]
    remote_ids = [[1] if k == M else list(range(3, 3 + n_r)) for k in kinds]
    lids, rids = read.descriptor_ids(local_ids, remote_ids)
    assert len(lids) == len(rids)
    n = min(n_l * lr, n_r * rr)
    assert n >= -(-tokens // 16)
    first_fa = [i for i in range(len(lids)) if lids[i] < 2 * 2 * local.n_phys]
    assert len(first_fa) == 4 * n
    # the remote kernel ids come from the REMOTE ratio: logical page 3 starts at 3 * rr
    start = sum(len(ids) * 4 * 2 for k, ids in zip(kinds, remote_ids, strict=True) if k == M)
    assert rids[start] == 3 * rr and lids[start] == 2 * lr
    assert fa == len(kinds) - 1


@pytest.mark.parametrize("allow_coarse", [True, False])
def test_pair_ids_refuse_misaligned_lists(allow_coarse):
    cfg = tiny_config()
    local = make_layout(cfg, 1, 0)
    (read,) = plan_reads(local, prefill_ranks(cfg, 1), allow_coarse=allow_coarse).reads
    assert read.coarse == allow_coarse
    with pytest.raises(ValueError, match="trim the lists"):
        read.descriptor_ids([[1], [2], [3]], [[1], [2], [3, 4]])  # equal ratios, 1 vs 2 pages
    with pytest.raises(ValueError, match="mamba"):
        read.descriptor_ids([[1], [], [3]], [[1], [2], [3]])
    with pytest.raises(ValueError, match="must match the 3 groups"):
        read.descriptor_ids([[1], [2]], [[1], [2]])
