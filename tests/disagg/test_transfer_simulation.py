"""Byte-level simulation of the planned reads against a model of the cache bytes.

Every byte a rank holds for a request is labelled with what it means (region, group, K/V,
token, global head, element byte; or Mamba x/B/C channel and row, ssm head/element), placed by
`hybridserve.cache.page_layout` (its rows and slab offsets: the geometry the device views read
too; `tests/cache/test_page_layout.py` checks it against typed arrays decoded independently of
it, and this module's `rank_units` checks its held heads/groups against duplicate-then-split).
Each prefill rank's memory is filled with its labels; the decode rank executes its `ReadPlan`
(copying bytes descriptor by descriptor through the id pairs); then every byte written must
carry the label the decode rank's own layout expects at that address, be written once, come
from a labelled (non-padding) byte, and every expected state byte and every kernel block holding
the request's tokens must be written. Equal-TP pairs run twice: in the coarse view (whole pages,
`plan_reads` default) and in the fine view."""

from __future__ import annotations

import itertools

import pytest
from disagg_models import base_of, make_plan, tiny_config

from hybridserve.cache.page_layout import AttentionPage, MambaPage, page_layouts
from hybridserve.cache.plan import CachePlan
from hybridserve.cache.spec import MambaSpec
from hybridserve.config import ModelConfig
from hybridserve.disagg import RankLayout, plan_reads

KB = 2  # kernel block (tokens)
TP_PAIRS = [(1, 1), (2, 2), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]  # (prefill, decode)


def rank_units(total: int, tp: int, rank: int) -> list[int]:
    """cache.view: duplicate each of `total` heads/groups `tp/total` times if fewer than tp,
    then split the list over tp ranks."""
    dup = tp // total if total % tp else 1
    full = [u for u in range(total) for _ in range(dup)]
    n = len(full) // tp
    return full[rank * n : (rank + 1) * n]


def memory(
    cfg: ModelConfig,
    plan: CachePlan,
    rank: int,
    bases: list[int],
    ids: list[list[int]],
    tp: int,
) -> dict[int, tuple]:
    """address -> label of every byte of this rank's pages listed in `ids` (per group, whole
    tables: entry j of an attention table holds the request's kernel blocks j*ratio..; the
    null page is left unlabelled, so reading it fails the simulation)."""
    mem: dict[int, tuple] = {}
    page, ratio = plan.page_size_bytes, plan.ratio
    for g, layout in enumerate(page_layouts(plan, cfg, rank)):
        for i, base in enumerate(bases):
            if isinstance(layout, MambaPage):
                _mamba(mem, cfg, layout, rank, tp, [base + b * page for b in ids[g]], (i, g))
            else:
                _attention(mem, cfg, layout, rank, tp, base, ids[g], (i, g), ratio)
    return mem


def _attention(mem, cfg, layout: AttentionPage, rank, tp, base, ids, where, ratio) -> None:
    heads = rank_units(cfg.attention.num_kv_heads, tp, rank)
    assert list(layout.heads) == heads
    row = layout.row_bytes
    # kernel block n of the request (tokens [n*KB, (n+1)*KB)) is table entry n // ratio; the
    # null page (a freed window page) holds nothing
    kids = [p * ratio + j for p in ids for j in range(ratio)]
    for n, kid in enumerate(kids):
        if kid < ratio:
            continue
        for kv, h, s in itertools.product(range(2), range(len(heads)), range(KB)):
            r = layout.row(kid, kv, h, s)
            for e in range(row):
                mem[base + r * row + e] = ("kv", *where, kv, n, heads[h], s, e)


def _mamba(mem, cfg, layout: MambaPage, rank, tp, starts, where) -> None:
    m = cfg.mamba
    heads = rank_units(m.num_heads, tp, rank)
    groups = rank_units(m.n_groups, tp, rank)
    assert (list(layout.heads), list(layout.groups)) == (heads, groups)
    chans = [("x", h, d) for h in heads for d in range(m.head_dim)]
    chans += [(bc, grp, n) for bc in "BC" for grp in groups for n in range(m.state_size)]
    rows, ci, si = layout.conv_rows, layout.conv_dtype_bytes, layout.ssm_dtype_bytes
    for start in starts:
        for c, label in enumerate(chans):
            for row, e in itertools.product(range(rows), range(ci)):
                # DS: channel-major (x, then B, then C: the slabs in order); SD: row-major
                cell = c * rows + row if layout.layout == "DS" else row * len(chans) + c
                mem[start + cell * ci + e] = ("conv", *where, label, row, e)
        for h, p, n, e in itertools.product(
            range(len(heads)), range(m.head_dim), range(m.state_size), range(si)
        ):
            off = layout.ssm.offset + ((h * m.head_dim + p) * m.state_size + n) * si + e
            mem[start + off] = ("ssm", *where, heads[h], p, n, e)


def simulate(
    cfg: ModelConfig, p_tp: int, d_tp: int, layout: str = "DS", allow_coarse: bool = True
) -> int:
    """Run every decode rank's plan for one request (coarse reads for equal TP unless
    `allow_coarse` is False); returns the bytes moved."""
    p_plan = make_plan(cfg, p_tp, "bfloat16", layout, KB)
    d_plan = make_plan(cfg, d_tp, "bfloat16", layout, KB)
    tokens = KB * (max(p_plan.ratio, d_plan.ratio) + 1) + 1

    def request(plan: CachePlan) -> tuple[list[list[int]], int]:
        pages, ids = itertools.count(1), []
        for group in plan.groups:
            n = 1 if group.kind == "mamba" else -(-tokens // (plan.ratio * KB))
            ids.append([next(pages) for _ in range(n)])
        return ids, next(pages) + 1

    p_ids, p_pages = request(p_plan)
    d_ids, d_pages = request(d_plan)
    # a different page for the same data on each side
    d_ids = [[d_pages - 1 - b for b in group] for group in d_ids]

    def rank_layout(plan, tp, rank, side, pages):
        bases = [base_of(side, rank, i) for i in range(plan.num_regions)]
        lay = RankLayout.from_plan(
            plan, cfg, tp_rank=rank, region_bases=bases, num_pages=pages, device_id=10 * side + rank
        )
        return lay, memory(cfg, plan, rank, bases, d_ids if side == 0 else p_ids, tp)

    remotes = {q: rank_layout(p_plan, p_tp, q, 1, p_pages) for q in range(p_tp)}
    moved = 0
    for r in range(d_tp):
        local, expected = rank_layout(d_plan, d_tp, r, 0, d_pages)
        plan = plan_reads(
            local, {q: lay for q, (lay, _) in remotes.items()}, allow_coarse=allow_coarse
        )
        written: dict[int, tuple] = {}
        for read in plan.reads:
            assert read.view == ("coarse" if allow_coarse and p_tp == d_tp else "fine")
            source = remotes[read.remote_rank][1]
            ld, rd = read.local_descriptors(), read.remote_descriptors()
            lids, rids = read.descriptor_ids(d_ids, p_ids)
            assert len(lids) == len(rids)
            for a, b in zip(lids, rids, strict=True):
                (la, n, ldev), (ra, rn, rdev) = ld[a], rd[b]
                assert n == rn > 0 and ldev == r and rdev == 10 + read.remote_rank
                for e in range(n):
                    assert la + e not in written, "a local byte is written twice"
                    written[la + e] = source[ra + e]  # KeyError: read an unlabelled byte
                moved += n
        wrong = [a for a, label in written.items() if expected.get(a) != label]
        assert not wrong, (r, wrong[:3], [written[a] for a in wrong[:3]])
        needed = -(-tokens // KB)
        missing = [
            a for a, label in expected.items() if a not in written and not _beyond(label, needed)
        ]
        assert not missing, (r, [expected[a] for a in missing[:3]])
    return moved


def _beyond(label: tuple, needed: int) -> bool:
    """A K/V byte of a kernel block past the request's tokens (padding of the last page)."""
    return label[0] == "kv" and label[4] >= needed


@pytest.mark.parametrize("p_tp, d_tp", TP_PAIRS)
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("n_groups", [1, 2, 4])
def test_transfers_reproduce_the_decode_layout(p_tp, d_tp, kv_heads, n_groups):
    cfg = tiny_config(kv_heads=kv_heads, n_groups=n_groups)
    moved = simulate(cfg, p_tp, d_tp)
    assert moved > 0
    if p_tp == d_tp:  # the fine view of the same pair moves exactly the same bytes
        assert simulate(cfg, p_tp, d_tp, allow_coarse=False) == moved


@pytest.mark.parametrize("p_tp, d_tp", TP_PAIRS)
def test_attention_group_first_with_a_padding_slot(p_tp, d_tp):
    cfg = tiny_config(pattern="*MM*MMM")  # groups: attention, then 3 Mamba (last padded)
    assert make_plan(cfg, 1).groups[3].layers[-1] is None
    moved = simulate(cfg, p_tp, d_tp)
    assert moved > 0
    if p_tp == d_tp:
        assert simulate(cfg, p_tp, d_tp, allow_coarse=False) == moved


@pytest.mark.parametrize("allow_coarse", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sd_layout_moves_verbatim_at_equal_tp(tp, allow_coarse):
    cfg = tiny_config(kv_heads=2, n_groups=2)
    assert simulate(cfg, tp, tp, layout="SD", allow_coarse=allow_coarse) > 0


@pytest.mark.parametrize("allow_coarse", [True, False])
@pytest.mark.parametrize("pattern", ["MMMM", "****", "*M"])
@pytest.mark.parametrize("tp", [1, 2])
def test_single_kind_models_at_equal_tp(tp, pattern, allow_coarse):
    # only the sections of the kinds present: Mamba-only, attention-only, one of each
    cfg = tiny_config(pattern=pattern)
    assert simulate(cfg, tp, tp, allow_coarse=allow_coarse) > 0


def test_moved_state_bytes_do_not_depend_on_the_split():
    # each decode rank receives each of its state bytes once, whatever the prefill TP (its
    # replicated B/C included): x 8 B and ssm 16 B per head, B and C 8 B each, 4 regions
    cfg = tiny_config(n_groups=1, pattern="MMMM")
    for p_tp, d_tp in TP_PAIRS:
        state = (4 // d_tp) * (8 + 16) + 2 * 8
        assert simulate(cfg, p_tp, d_tp) == d_tp * state * 4, (p_tp, d_tp)
        if p_tp == d_tp:  # coarse by default; the fine view moves the same bytes
            assert simulate(cfg, p_tp, d_tp, allow_coarse=False) == d_tp * state * 4


def test_coarse_state_pages_stop_before_the_padding():
    # at TP4 the tiny hybrid's page (48 B, 3 kernel pages of 16) exceeds the state (40 B): the
    # 8 padding bytes are unlabelled in `memory`, so a coarse read of them fails the simulation
    cfg = tiny_config()
    plan = make_plan(cfg, 4, "bfloat16", "DS", KB)
    state = next(g.spec for g in plan.groups if isinstance(g.spec, MambaSpec)).state_bytes
    assert (plan.page_size_bytes, state) == (48, 40)
    assert simulate(cfg, 4, 4) == simulate(cfg, 4, 4, allow_coarse=False) > 0
