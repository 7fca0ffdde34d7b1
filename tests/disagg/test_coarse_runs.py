"""Merge levels of the coarse view: 2^k consecutive attention pages in one descriptor.

Expected ids are computed here from the view's definition (level sections after the attention
and state sections, one entry per start page that fits), not taken from the implementation; the
byte-level check copies bytes through the merged and the unmerged (level-0) descriptors of the
same prepared lists and compares the results. Pure Python: no JAX, no NIXL."""

from __future__ import annotations

import dataclasses
import random
from bisect import bisect_right

import pytest
from disagg_models import make_layout, nano, nano_config, prefill_ranks, tiny_config

from hybridserve.disagg.coarse_view import coarse_descriptor_ids, coarse_pair_ids
from hybridserve.disagg.descriptors import coarse_runs, coarse_view_size, expand_runs
from hybridserve.disagg.tp_mapping import plan_reads

FA, SW, M = "full_attention", "sliding_window", "mamba"


def level_start(k, t, n_log, mamba):
    """First id of level k: the T*N_log attention pages, the T*N_log state pages (with Mamba),
    then levels 1..k-1 of T*(N_log - 2^j + 1) entries each."""
    return (2 if mamba else 1) * t * n_log + sum(t * (n_log - 2**j + 1) for j in range(1, k))


# --- worked cases --------------------------------------------------------------------------------


def test_worked_case_pieces_4_2_1():
    # T = 2, N_log = 16 on both sides, attention only; local [4..10], remote [8..14]: one joint
    # run of 7 pages -> pieces of 4 (from 4 / 8), 2 (from 8 / 12), 1 (from 10 / 14).
    #   level 1 starts at 2*16 = 32, 15 entries per region; level 2 at 32 + 2*15 = 62, 13 each
    #   4 pages: local 62 + 4 = 66, 66 + 13 = 79; remote 62 + 8 = 70, 83
    #   2 pages: local 32 + 8 = 40, 40 + 15 = 55; remote 32 + 12 = 44, 59
    #   1 page (level 0, i*16 + p): local 10, 26; remote 14, 30
    lids, rids = coarse_pair_ids([FA], [range(4, 11)], [range(8, 15)], 2, 16, 16)
    assert lids == [66, 79, 40, 55, 10, 26]
    assert rids == [70, 83, 44, 59, 14, 30]


def test_worked_case_with_mamba_and_unequal_pools():
    # [FA, M], T = 2; local N_log = 16: attention 0..31, state 32..63, level 1 at 64 (15 per
    # region), level 2 at 64 + 30 = 94 (13 per region). Remote N_log = 8: state 16..31, level 1
    # at 32 (7 per region), level 2 at 32 + 14 = 46 (5 per region).
    # local [4..10], remote [1..7]: pieces 4 (4 / 1), 2 (8 / 5), 1 (10 / 7)
    lids, rids = coarse_pair_ids([FA, M], [range(4, 11), [3]], [range(1, 8), [5]], 2, 16, 8)
    assert lids == [98, 111, 72, 87, 10, 26, 32 + 3, 48 + 3]
    assert rids == [47, 52, 37, 44, 7, 15, 16 + 5, 24 + 5]


def test_joint_runs_break_where_either_side_breaks():
    # local [1, 2, 3, 7, 8], remote [5, 6, 9, 10, 11]: (1,5)(2,6) | (3,9) | (7,10)(8,11)
    # T = 1, N_log = 20 both, attention only: level 1 at 20, 19 per region
    lids, rids = coarse_pair_ids([FA], [[1, 2, 3, 7, 8]], [[5, 6, 9, 10, 11]], 1, 20, 20)
    assert lids == [20 + 1, 3, 20 + 7]
    assert rids == [20 + 5, 9, 20 + 10]
    # descending tables have no joint run: the level-0 ids, in the unmerged order
    lt, rt = [[9, 8, 7], [2]], [[5, 4, 3], [6]]
    lids, rids = coarse_pair_ids([FA, M], lt, rt, 3, 20, 30)
    assert lids == [9, 8, 7, 29, 28, 27, 49, 48, 47, 62, 82, 102]
    assert rids == [5, 4, 3, 35, 34, 33, 65, 64, 63, 96, 126, 156]
    assert lids == coarse_descriptor_ids([FA, M], lt, 3, 20)
    assert rids == coarse_descriptor_ids([FA, M], rt, 3, 30)


def test_pieces_are_capped_at_64_pages():
    # T = 1, N_log = 200, attention only; 130 consecutive pages 0..129 on both sides:
    # 64 + 64 + 2 (not 128 + 2): level 6 from 0 and from 64, level 1 from 128
    b6, b1 = level_start(6, 1, 200, False), level_start(1, 1, 200, False)
    assert (b6, b1) == (200 + 199 + 197 + 193 + 185 + 169, 200)
    lids, rids = coarse_pair_ids([FA], [range(130)], [range(130)], 1, 200, 200)
    assert lids == rids == [b6 + 0, b6 + 64, b1 + 128]
    # 100 pages, local from 0, remote from 20 (N_log 128): 64 + 32 + 4
    lids, rids = coarse_pair_ids([FA], [range(100)], [range(20, 120)], 1, 128, 128)
    start = [level_start(k, 1, 128, False) for k in range(7)]
    assert lids == [start[6], start[5] + 64, start[2] + 96]
    assert rids == [start[6] + 20, start[5] + 84, start[2] + 116]


def test_several_attention_groups_each_merge():
    # [FA, M, SW], T = 2, N_log = 10 both; FA [2, 3], SW [6, 7, 8, 9] -> one piece each
    # level 1 at 2*2*10 = 40 (9 per region), level 2 at 40 + 18 = 58 (7 per region)
    lt, rt = [[2, 3], [1], [6, 7, 8, 9]], [[4, 5], [0], [0, 1, 2, 3]]
    lids, rids = coarse_pair_ids([FA, M, SW], lt, rt, 2, 10, 10)
    assert lids == [42, 51, 21, 31, 64, 71]
    assert rids == [44, 53, 20, 30, 58, 65]


def test_nano_63_pages_use_six_pieces():
    # 63 = 32 + 16 + 8 + 4 + 2 + 1: 6 pieces x 6 regions + 4 Mamba groups x 6 regions = 60 ids
    local = nano(2, num_pages=100)
    (read,) = plan_reads(local, prefill_ranks(nano_config(), 2, num_pages=100)).reads
    tables = [[1], [2], [3], [4], list(range(5, 68))]
    lids, rids = read.descriptor_ids(tables, tables)
    assert len(lids) == len(rids) == 6 * 6 + 24
    ld = read.local_descriptors()
    page = local.page_bytes
    assert [ld[a][1] // page for a in lids[24::6]] == [32, 16, 8, 4, 2, 1]
    assert sum(ld[a][1] for a in lids[24:]) == 6 * 63 * page


@pytest.mark.parametrize(
    "lt, rt, message",
    [
        ([[0, 1, 16]], [[0, 1, 2]], r"page id out of range \[0, 16\)"),
        ([[0, 1, 2]], [[6, 7, 8]], r"page id out of range \[0, 8\)"),
        ([[-1, 0, 1]], [[0, 1, 2]], "page id out of range"),
        ([[0, 1]], [[0, 1, 2]], r"group 0 \(full_attention\): 2 local pages != 3"),
        ([[0], [1]], [[0]], "block id lists per group"),
    ],
)
def test_pair_ids_refuse_bad_input(lt, rt, message):
    with pytest.raises(ValueError, match=message):
        coarse_pair_ids([FA] * len(lt), lt, rt, 2, 16, 8)


def test_read_names_the_group_with_unequal_lists():
    local = nano(2, num_pages=20)
    (read,) = plan_reads(local, prefill_ranks(nano_config(), 2, num_pages=20)).reads
    with pytest.raises(ValueError, match="group 4"):
        read.descriptor_ids([[1]] * 4 + [[5, 6, 7]], [[1]] * 4 + [[5, 6]])
    with pytest.raises(ValueError, match="group 1"):
        read.descriptor_ids([[1], [2, 3], [4], [5], [6]], [[1], [2], [4], [5], [6]])


# --- the view ------------------------------------------------------------------------------------


def test_level_entries_are_2k_whole_pages_of_one_region():
    lay = make_layout(tiny_config(), 1, 0, num_pages=9)  # (M, M, FA), T = 2: levels 1..3
    t, n, page = 2, 9, lay.page_bytes
    descs = expand_runs(coarse_runs(lay), lay.device_id)
    assert len(descs) == coarse_view_size(lay) == 2 * t * n + t * (8 + 6 + 2)
    for k in (1, 2, 3):
        for i, base in enumerate(lay.region_bases):
            for p in range(n - 2**k + 1):
                d = descs[level_start(k, t, n, True) + i * (n - 2**k + 1) + p]
                assert d == (base + p * page, 2**k * page, lay.device_id)
    # levels stop at 64 pages, and at the pool: 64 pages -> 6 levels, 63 pages -> 5
    assert coarse_view_size(dataclasses.replace(lay, num_pages=64)) == 4 * 64 + 2 * sum(
        64 - 2**k + 1 for k in range(1, 7)
    )
    assert coarse_view_size(dataclasses.replace(lay, num_pages=63)) == 4 * 63 + 2 * sum(
        63 - 2**k + 1 for k in range(1, 6)
    )
    big = dataclasses.replace(lay, num_pages=1000)
    assert len(coarse_runs(big)) == 2 * t + 6 * t


# --- bytes ---------------------------------------------------------------------------------------


def random_tables(rng, kinds, n_local, n_remote):
    """Per group, equally long local/remote page lists (pages distinct per side, never page 0);
    attention groups are segments, each consecutive on both sides, on one, or on neither."""
    used = ({0}, {0})
    sizes = (n_local, n_remote)

    def take(side, length, consecutive):
        pool, n = used[side], sizes[side]
        if not consecutive:
            return [take(side, 1, True)[0] for _ in range(length)]
        for _ in range(50):
            a = rng.randrange(1, n - length + 1)
            if pool.isdisjoint(range(a, a + length)):
                pool.update(range(a, a + length))
                return list(range(a, a + length))
        pages = rng.sample([p for p in range(n) if p not in pool], length)
        pool.update(pages)
        return pages

    lt, rt = [], []
    for kind in kinds:
        if kind == M:
            lt.append(take(0, 1, True))
            rt.append(take(1, 1, True))
            continue
        lg, rg = [], []
        for _ in range(rng.randrange(1, 5)):
            room = min(n - len(pool) for n, pool in zip(sizes, used, strict=True)) // 4
            length = max(1, min(rng.choice([1, 2, 3, 5, 8, 13, 20]), room))
            mode = rng.randrange(4)  # bit 0: local consecutive, bit 1: remote consecutive
            lg += take(0, length, bool(mode & 1))
            rg += take(1, length, bool(mode & 2))
        lt.append(lg)
        rt.append(rg)
    return lt, rt


def has_joint_run(kinds, lt, rt):
    """Whether an attention group has two adjacent entries consecutive on both sides."""
    return any(
        lt[g][j + 1] == lt[g][j] + 1 and rt[g][j + 1] == rt[g][j] + 1
        for g, kind in enumerate(kinds)
        if kind != M
        for j in range(len(lt[g]) - 1)
    )


class Memory:
    """Byte arrays of one side's regions, addressed by the descriptors' absolute addresses."""

    def __init__(self, layout, fill=None):
        size = layout.num_pages * layout.page_bytes
        self.bases = sorted(layout.region_bases)
        self.size = size
        self.data = {b: bytearray(fill(size) if fill else size) for b in self.bases}
        self.writes = {b: bytearray(size) for b in self.bases}

    def locate(self, addr, n):
        base = self.bases[bisect_right(self.bases, addr) - 1]
        off = addr - base
        assert off >= 0 and off + n <= self.size, "a descriptor leaves its region"
        return base, off


def copy_through(read, lids, rids, remote_mem):
    """Apply the (local desc, remote desc) copies to a fresh local memory."""
    ld, rd = read.local_descriptors(), read.remote_descriptors()
    local = Memory(read.local)
    assert len(lids) == len(rids)
    for a, b in zip(lids, rids, strict=True):
        (la, n, _), (ra, rn, _) = ld[a], rd[b]
        assert n == rn > 0
        lb, lo = local.locate(la, n)
        rb, ro = remote_mem.locate(ra, n)
        local.data[lb][lo : lo + n] = remote_mem.data[rb][ro : ro + n]
        for e in range(lo, lo + n):
            local.writes[lb][e] += 1
    return local


KIND_SETS = [None, (FA, M, SW), (SW, FA), (M, FA, M, FA)]


@pytest.mark.parametrize("seed", range(12))
def test_merged_descriptors_move_exactly_the_level0_bytes(seed):
    rng = random.Random(seed)
    tp = rng.choice([1, 2, 4])
    kinds = KIND_SETS[seed % len(KIND_SETS)]
    if kinds is None:
        pattern = rng.choice(["M*MM*M", "****", "*MM*MMM", "MM**MM**", "*M"])
    else:
        pattern = "MM**MM**" if M in kinds else "****"
    n_local, n_remote = rng.choice([(64, 64), (48, 130), (150, 70), (100, 100)])
    cfg = tiny_config(pattern=pattern)
    rank = rng.randrange(tp)
    local = make_layout(cfg, tp, rank, num_pages=n_local)
    remote = make_layout(cfg, tp, rank, num_pages=n_remote, side=1)
    if kinds:  # more groups (several attention ones) on the same regions
        t = local.num_regions
        local, remote = (
            dataclasses.replace(lay, group_kinds=kinds, group_layers=((None,) * t,) * len(kinds))
            for lay in (local, remote)
        )
    (read,) = plan_reads(local, {rank: remote}).reads  # equal TP: the one source is `rank`
    assert read.coarse
    lt, rt = random_tables(rng, local.group_kinds, n_local, n_remote)
    source = Memory(remote, fill=rng.randbytes)
    lids, rids = read.descriptor_ids(lt, rt)
    t = local.num_regions
    level0 = (
        coarse_descriptor_ids(local.group_kinds, lt, t, n_local),
        coarse_descriptor_ids(local.group_kinds, rt, t, n_remote),
    )
    merged_mem = copy_through(read, lids, rids, source)
    level0_mem = copy_through(read, *level0, source)
    assert merged_mem.writes == level0_mem.writes  # the same bytes, each written once
    assert all(max(w) <= 1 for w in merged_mem.writes.values())
    assert merged_mem.data == level0_mem.data
    moved = sum(sum(w) for w in merged_mem.writes.values())
    pages = sum(len(ids) for k, ids in zip(local.group_kinds, lt, strict=True) if k != M)
    states = sum(len(ids) for k, ids in zip(local.group_kinds, lt, strict=True) if k == M)
    state = local.state_bytes if local.has_mamba else 0
    assert moved == t * (pages * local.page_bytes + states * state)
    # fewer descriptors whenever some run was merged; never more
    if has_joint_run(local.group_kinds, lt, rt):
        assert len(lids) < len(level0[0])
    else:
        assert (lids, rids) == level0
