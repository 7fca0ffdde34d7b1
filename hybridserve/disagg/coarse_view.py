"""Descriptor ids of the coarse view (`descriptors.coarse_runs`: whole pages, prepared once per
rank pair that needs no slicing) and the test for such a pair (`coarse_pair`).

Ids (logical page ids, no ratio expansion; T regions, N = N_log OF THE SIDE INDEXED):
  attention page p of region i (level 0):   `i*N + p`
  Mamba state page b of region i:            `fa + i*N + b`, `fa = T*N` with attention, else 0
  the 2^k attention pages from p, region i:  `B_k + i*(N - 2^k + 1) + p`  (level k in 1..L)
      `B_k = (1+m)*T*N + T*((k-1)*(N+1) - 2^k + 2)`, m = 1 with Mamba, else 0;
      `L = descriptors.coarse_levels(N)`. The level sections follow the Mamba section, so the
      level-0 and Mamba ids are those of a view without levels.
`coarse_descriptor_ids` gives the level-0 ids of one side (one id per page and region).
`coarse_pair_ids` gives both sides of a read: in each attention group the maximal JOINT runs
(`l[j+1] == l[j]+1` and `r[j+1] == r[j]+1`) are cut greedily into power-of-two pieces, largest
first, at most `2^MERGE_LEVELS` pages; a piece of 2^k pages from (l, r) is, for i in 0..T-1,
the level-k id of l on the local side and of r on the remote side (level 0 for one page; the T
ids of a piece are one strided `range`). Such a piece is in both views: its pages are distinct
ids below N on each side, so `2^k <= N` and `p <= N - 2^k`. Mamba pages are never merged.
E.g. T = 2, N = 16 on both sides, attention only, local pages [4..10], remote [8..14]: pieces
of 4, 2, 1 pages; B_1 = 32, B_2 = 62 -> local [66, 79, 40, 55, 10, 26], remote [70, 83, 44,
59, 14, 30]. Cost: an O(1) or C-speed run check per side, one comprehension over the pages of
an attention group that is not one run on both sides, then proportional to the ids produced (n pages
consecutive on both sides: `T * (n // 64 + popcount(n % 64))` ids, one `range` per piece).
Standard library only.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from itertools import pairwise

from hybridserve.disagg.descriptors import FA_KINDS, MERGE_LEVELS, RankLayout, slabs

_FA = frozenset(FA_KINDS)


def coarse_level_base(k: int, num_regions: int, n_log: int, has_mamba: bool) -> int:
    """`B_k`: the first id of merge level k >= 1 in a coarse view with attention."""
    t = num_regions
    return (1 + has_mamba) * t * n_log + t * ((k - 1) * (n_log + 1) - (1 << k) + 2)


def coarse_descriptor_ids(
    kinds: Sequence[str],
    block_ids_per_group: Sequence[Sequence[int]],
    num_regions: int,
    n_log: int,
) -> list[int]:
    """Level-0 indices into a coarse view, per group in order, logical ids: attention
    `i*n_log + p`, Mamba `fa + i*n_log + b` (i in 0..T-1), `fa = T*n_log` when an attention
    kind is present, else 0. E.g. T=2, n_log=100, [FA, M] with [[3, 5], [1, 2]]:
    [3, 5, 103, 105, 201, 202, 301, 302]. Cost: one list comprehension per group over its
    `T*len(ids)` ids; a single page is one strided `range`, and a run of consecutive pages
    `[a, a+n)` is one `range(s + a, s + a + n)` per region (C speed)."""
    if len(block_ids_per_group) != len(kinds):
        raise ValueError(f"{len(block_ids_per_group)} block id lists for {len(kinds)} groups")
    fa = 0 if _FA.isdisjoint(kinds) else num_regions * n_log
    out: list[int] = []
    for kind, ids in zip(kinds, block_ids_per_group, strict=True):
        run = _checked_run(ids, n_log)
        _level0(out, _section(kind, fa), ids, run, num_regions, n_log)
    return out


def coarse_pair_ids(
    kinds: Sequence[str],
    local_ids_per_group: Sequence[Sequence[int]],
    remote_ids_per_group: Sequence[Sequence[int]],
    num_regions: int,
    local_n_log: int,
    remote_n_log: int,
) -> tuple[list[int], list[int]]:
    """(local ids, remote ids) of one read in the coarse views of two sides with the same
    groups and regions (module docstring): attention joint runs merged into power-of-two
    pieces, Mamba pages one id per region. The two lists have equal byte lengths entry for
    entry, and together cover exactly the bytes of the level-0 ids (`coarse_descriptor_ids`:
    the same pages and regions) in fewer descriptors. Raises on out-of-range ids and on groups
    whose two lists differ in length (naming the group)."""
    if not len(local_ids_per_group) == len(remote_ids_per_group) == len(kinds):
        raise ValueError(f"block id lists per group must match the {len(kinds)} groups")
    t, ln, rn = num_regions, local_n_log, remote_n_log
    has_fa, has_mamba = not _FA.isdisjoint(kinds), "mamba" in kinds
    lfa, rfa = (t * ln, t * rn) if has_fa else (0, 0)
    lout: list[int] = []
    rout: list[int] = []
    levels: tuple[tuple[tuple[int, int], ...], ...] | None = None
    for g, (kind, lids, rids) in enumerate(
        zip(kinds, local_ids_per_group, remote_ids_per_group, strict=True)
    ):
        n = len(lids)
        if n != len(rids):
            raise ValueError(f"group {g} ({kind}): {n} local pages != {len(rids)} remote pages")
        start = _section(kind, lfa), _section(kind, rfa)
        lrun, rrun = _checked_run(lids, ln), _checked_run(rids, rn)
        pieces = _joint_pieces(lids, rids, lrun and rrun) if kind in _FA and n > 1 else None
        if pieces is None:  # Mamba, or no two pages consecutive on both sides: level 0
            _level0(lout, start[0], lids, lrun, t, ln)
            _level0(rout, start[1], rids, rrun, t, rn)
            continue
        if levels is None:  # (first id, stride) of each level, per side
            levels = _levels(t, ln, has_mamba), _levels(t, rn, has_mamba)
        lev_l, lev_r = levels
        for k, lp, rp in pieces:
            o, s = lev_l[k]
            lout += range(o + lp, o + lp + t * s, s)
            o, s = lev_r[k]
            rout += range(o + rp, o + rp + t * s, s)
    return lout, rout


def coarse_pair(local: RankLayout, remote: RankLayout) -> bool:
    """Whether every page of `remote` can move whole into a page of `local`: equal TP and rank,
    equal ratio and page bytes, identical components (`slabs`: heads/groups held, offsets,
    units, hence equal state bytes and conv layout) and the same groups."""
    return (
        local.tp_size == remote.tp_size
        and local.tp_rank == remote.tp_rank
        and local.ratio == remote.ratio
        and local.page_bytes == remote.page_bytes
        and local.num_regions == remote.num_regions
        and local.group_kinds == remote.group_kinds
        and local.conv_layout == remote.conv_layout
        and slabs(local) == slabs(remote)
    )


def _section(kind: str, fa: int) -> int:
    if kind in _FA:
        return 0
    if kind == "mamba":
        return fa
    raise ValueError(f"unknown group kind {kind!r}")


@functools.lru_cache(maxsize=256)
def _levels(t: int, n_log: int, has_mamba: bool) -> tuple[tuple[int, int], ...]:
    """`(first id, stride between regions)` of levels 0..MERGE_LEVELS of an attention section
    (entries past this side's L are never used: a piece fits the pool). Cached per view."""
    steps = [
        (coarse_level_base(k, t, n_log, has_mamba), n_log - (1 << k) + 1)
        for k in range(1, MERGE_LEVELS + 1)
    ]
    return ((0, n_log), *steps)


def _joint_pieces(
    lids: Sequence[int], rids: Sequence[int], both_runs: bool
) -> list[tuple[int, int, int]] | None:
    """`(level, local page, remote page)` of each power-of-two piece of the joint runs, in
    order; None when no two adjacent entries are consecutive on both sides."""
    n = len(lids)
    if both_runs:
        bounds: list[int] = [0, n]
    else:
        cuts = [
            j
            for j, ((a, b), (c, d)) in enumerate(
                zip(pairwise(lids), pairwise(rids), strict=True), 1
            )
            if b - a != 1 or d - c != 1
        ]
        if len(cuts) == n - 1:
            return None
        bounds = [0, *cuts, n]
    pieces = []
    for j, stop in pairwise(bounds):
        while j < stop:
            k = min((stop - j).bit_length() - 1, MERGE_LEVELS)
            pieces.append((k, lids[j], rids[j]))
            j += 1 << k
    return pieces


def _checked_run(ids: Sequence[int], n_log: int) -> bool:
    """Whether `ids` is `[a, a+1, ..., a+n-1]` (n >= 1, in this order); raises when an id is
    outside `[0, n_log)`. O(1) unless the ends say it may be a run (then one C-speed compare)."""
    n = len(ids)
    if n == 0:
        return False
    a = ids[0]
    run = n == 1 or (ids[-1] - a == n - 1 and (n < 3 or list(ids) == list(range(a, a + n))))
    lo, hi = (a, ids[-1]) if run else (min(ids), max(ids))
    if lo < 0 or hi >= n_log:
        raise ValueError(f"page id out of range [0, {n_log}): {lo}..{hi}")
    return run


def _level0(out: list[int], start: int, ids: Sequence[int], run: bool, t: int, n_log: int) -> None:
    """Append the level-0 ids `start + i*n_log + p` of `ids`, region-major."""
    n = len(ids)
    if n == 0:
        return
    span = t * n_log
    if n == 1:  # e.g. a Mamba group: one page, T ids
        out += range(start + ids[0], start + span, n_log)
    elif run:
        a = ids[0]
        for s in range(start + a, start + a + span, n_log):
            out += range(s, s + n)
    else:
        out += [s + b for s in range(start, start + span, n_log) for b in ids]
