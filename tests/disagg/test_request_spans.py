"""Byte-level simulation of one P/D request's transfer as the decode engine asks for it
(`SourceRead.span_ids`): whole block tables with null pages (freed window pages on both sides),
a decode-side prefix hit whose pages must not be touched, and a per-group `fill_from`, over
every TP pair, in the coarse and the fine view. The labelled memories are those of
`test_transfer_simulation` (an independent model of the cache bytes): every byte written must
carry the label the decode rank expects there, be written once and come from a labelled byte
(never from a null page); every byte of the tokens `[fill_from, n)` and every state byte must
arrive; no byte of a shared prefix page is written."""

from __future__ import annotations

import itertools

import pytest
from disagg_models import base_of, make_plan, tiny_config
from test_transfer_simulation import KB, TP_PAIRS, memory

from hybridserve.cache.plan import CachePlan
from hybridserve.disagg import RankLayout, plan_reads

WINDOW = 5


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tables(plan: CachePlan, n: int, first: dict[str, int], pages) -> list[list[int]]:
    """Block tables over `n` tokens, window groups null before token first["sliding_window"]."""
    size = plan.ratio * KB
    out = []
    for group in plan.groups:
        if group.kind == "mamba":
            out.append([next(pages)])
            continue
        start = first.get(group.kind, 0) // size
        out.append([0 if j < start else next(pages) for j in range(cdiv(n, size))])
    return out


def simulate(cfg, p_tp: int, d_tp: int, n: int, hit: int, allow_coarse: bool) -> int:
    p_plan, d_plan = (
        make_plan(cfg, p_tp, "bfloat16", "DS", KB),
        make_plan(cfg, d_tp, "bfloat16", "DS", KB),
    )
    pb, db = p_plan.ratio * KB, d_plan.ratio * KB
    hit = hit // db * db  # whole decode pages
    # the prefill engine last computed a chunk from s = n - 3: it holds its window from s - W
    p_first = {"sliding_window": max(0, n - 3 - WINDOW) // pb * pb}
    d_first = {"sliding_window": max(0, n - WINDOW) // db * db}
    p_tables = tables(p_plan, n, p_first, itertools.count(1))
    d_tables = tables(d_plan, n + 1, d_first, itertools.count(3))
    fill = []
    for group in d_plan.groups:
        if group.kind == "mamba":
            fill.append(0)
        elif group.kind == "sliding_window":
            fill.append(max(hit, (n - WINDOW) // KB * KB))
        else:
            fill.append(hit)
    p_pages = 1 + max(p for t in p_tables for p in t)
    d_pages = 1 + max(p for t in d_tables for p in t)

    def rank(plan, tp, r, side, pages, ids):
        bases = [base_of(side, r, i) for i in range(plan.num_regions)]
        lay = RankLayout.from_plan(
            plan, cfg, tp_rank=r, region_bases=bases, num_pages=pages, device_id=10 * side + r
        )
        return lay, memory(cfg, plan, r, bases, ids, tp)

    remotes = {q: rank(p_plan, p_tp, q, 1, p_pages, p_tables) for q in range(p_tp)}
    moved = 0
    for r in range(d_tp):
        local, expected = rank(d_plan, d_tp, r, 0, d_pages, d_tables)
        plan = plan_reads(local, {q: v[0] for q, v in remotes.items()}, allow_coarse=allow_coarse)
        written: dict[int, tuple] = {}
        for read in plan.reads:
            source = remotes[read.remote_rank][1]
            ld, rd = read.local_descriptors(), read.remote_descriptors()
            lids, rids = read.span_ids(d_tables, p_tables, fill, n)
            assert len(lids) == len(rids)
            for a, b in zip(lids, rids, strict=True):
                (la, size, _), (ra, rsize, _) = ld[a], rd[b]
                assert size == rsize > 0
                for e in range(size):
                    assert la + e not in written, "a local byte is written twice"
                    written[la + e] = source[ra + e]  # KeyError: read an unlabelled byte
                moved += size
        wrong = [a for a, label in written.items() if expected.get(a) != label]
        assert not wrong, (r, [written[a] for a in wrong[:3]])
        for a, label in expected.items():
            if label[0] == "kv":
                kernel, group = label[4], label[2]
                if kernel * KB < hit and d_plan.groups[group].kind == "full_attention":
                    assert a not in written, "a shared prefix page was written"
                if fill[group] // KB <= kernel < cdiv(n, KB):
                    assert a in written, (r, label)
            else:
                assert a in written, (r, label)  # every state byte
    return moved


@pytest.mark.parametrize("p_tp, d_tp", TP_PAIRS)
@pytest.mark.parametrize("pattern", ["*SMS*M", "S*S*"])
def test_a_request_moves_its_window_and_the_rest_of_a_prefix_hit(p_tp, d_tp, pattern):
    cfg = tiny_config(pattern=pattern, window=WINDOW)
    biggest = max(make_plan(cfg, tp, "bfloat16", "DS", KB).ratio for tp in (p_tp, d_tp)) * KB
    n = 3 * biggest + 5
    for hit in (0, biggest + 1):
        moved = simulate(cfg, p_tp, d_tp, n, hit, allow_coarse=True)
        assert moved > 0
        if p_tp == d_tp:  # the fine view moves the same kernel blocks or fewer
            assert 0 < simulate(cfg, p_tp, d_tp, n, hit, allow_coarse=False) <= moved


def test_a_hit_moves_fewer_bytes():
    cfg = tiny_config(pattern="*SMS*M", window=WINDOW)
    size = make_plan(cfg, 1, "bfloat16", "DS", KB).ratio * KB
    n = 4 * size + 3
    assert simulate(cfg, 1, 1, n, 2 * size, True) < simulate(cfg, 1, 1, n, 0, True)


@pytest.mark.parametrize("allow_coarse", [True, False])
def test_a_null_or_missing_source_page_is_refused(allow_coarse):
    cfg = tiny_config(pattern="*SMS*M", window=WINDOW)
    plan = make_plan(cfg, 1, "bfloat16", "DS", KB)
    size = plan.ratio * KB
    lay = RankLayout.from_plan(plan, cfg, tp_rank=0, region_bases=[0, 1 << 30], num_pages=64)
    read = plan_reads(lay, {0: lay}, allow_coarse=allow_coarse).reads[0]
    n = 3 * size
    kinds = [g.kind for g in plan.groups]
    mine = [[10 + j for j in range(4)] if k != "mamba" else [20] for k in kinds]
    theirs = [[30 + j for j in range(3)] if k != "mamba" else [40] for k in kinds]
    fill = [0] * len(kinds)
    assert read.span_ids(mine, theirs, fill, n)[0]
    sliding = kinds.index("sliding_window")
    bad = [list(t) for t in theirs]
    bad[sliding][0] = 0  # the prefill side freed it: the decode side asked from token 0
    with pytest.raises(ValueError, match="remote group .* not a page"):
        read.span_ids(mine, bad, fill, n)
    fill[sliding] = size  # asking from the second page: the null page is not read
    assert read.span_ids(mine, bad, fill, n)[0]
    with pytest.raises(ValueError, match="remote group .* the transfer needs"):
        read.span_ids(mine, theirs, fill, n + size)  # beyond the prefill engine's tokens
    with pytest.raises(ValueError, match="not a page"):
        read.span_ids(mine, [[99] * 3 if k != "mamba" else [1] for k in kinds], fill, n)
    with pytest.raises(ValueError, match="ints"):
        read.span_ids(mine, theirs, ["0"] * len(kinds), n)
    with pytest.raises(ValueError, match="one state page"):
        read.span_ids(
            mine, [t if k != "mamba" else [] for t, k in zip(theirs, kinds, strict=True)], fill, n
        )
