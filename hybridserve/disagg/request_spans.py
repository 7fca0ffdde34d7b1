"""What one request's transfer moves: a token range per attention group, each side's state page
per Mamba group, as descriptor ids of one read (`SourceRead.span_ids`).

Each side passes its WHOLE block tables: entry j of an attention table holds that side's tokens
`[j*B, (j+1)*B)`, `B = kernel_block * ratio` of that side, and may be the null page outside the
range moved (a sliding window's freed pages, or a decode-side prefix hit's shared pages, which
are not moved at all). For attention group g the read moves the tokens
`[fill_from[g], num_tokens)`:
  fine view:   the kernel blocks `k0 = fill_from[g] // kb` .. `k1 = cdiv(num_tokens, kb)`, each
               side's kernel id `table[k // ratio] * ratio + k % ratio` (its own ratio), merged
               into spans of adjacent ids (`dual_ids`); the two sides may have different ratios.
  coarse view: (equal block sizes) the whole pages `fill_from[g] // B` .. `cdiv(num_tokens, B)`,
               the same page indices on both sides (`coarse_pair_ids`).
A Mamba group moves its state page (the table's first entry) whole. Every page a read touches
must be a real page of that side (not the null page, inside the pool, inside the table);
anything else raises ValueError naming the side and group (a bad peer fails its request, never
the engine). Cost: proportional to the pages in the range, never to the pool or the table.
Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from hybridserve.disagg.coarse_view import coarse_pair_ids
from hybridserve.disagg.descriptors import FA_KINDS, RankLayout
from hybridserve.disagg.dual_ids import dual_ids


class Read(Protocol):
    """What `span_ids` needs of a read (`tp_mapping.SourceRead` is one)."""

    local: RankLayout
    remote: RankLayout
    coarse: bool
    active: frozenset[str]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _page(table: Sequence[int], j: int, layout: RankLayout, where: str) -> int:
    page = table[j]
    if type(page) is not int or not 0 < page < layout.n_log:
        raise ValueError(f"{where}: entry {j} is {page!r}, not a page in [1, {layout.n_log})")
    return page


def _pages(table: Sequence[int], j0: int, j1: int, layout: RankLayout, where: str) -> list[int]:
    """Entries j0..j1-1 of a table, each a real page."""
    if j1 > len(table):
        raise ValueError(f"{where}: {len(table)} pages, the transfer needs {j1}")
    return [_page(table, j, layout, where) for j in range(j0, j1)]


def _kernel_spans(
    table: Sequence[int], k0: int, k1: int, layout: RankLayout, where: str
) -> list[tuple[int, int]]:
    """Kernel ids of kernel blocks k0..k1-1 as half-open spans, adjacent ones merged."""
    ratio = layout.ratio
    spans: list[tuple[int, int]] = []
    if k0 >= k1:
        return spans
    for j, page in enumerate(_pages(table, k0 // ratio, _cdiv(k1, ratio), layout, where)):
        first = (k0 // ratio + j) * ratio  # the page's first kernel block (request-relative)
        lo, hi = max(k0, first) - first, min(k1, first + ratio) - first
        start, stop = page * ratio + lo, page * ratio + hi
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], stop)
        else:
            spans.append((start, stop))
    return spans


def _state_page(table: Sequence[int], layout: RankLayout, where: str) -> list[int]:
    if len(table) != 1:
        raise ValueError(f"{where}: a Mamba group holds one state page, not {len(table)}")
    return [_page(table, 0, layout, where)]


def span_ids(
    read: Read,
    local_tables: Sequence[Sequence[int]],
    remote_tables: Sequence[Sequence[int]],
    fill_from: Sequence[int],
    num_tokens: int,
) -> tuple[list[int], list[int]]:
    """(local ids, remote ids) of `read` for one request (module docstring), equal lengths,
    pairwise equal byte lengths."""
    loc, rem = read.local, read.remote
    kinds = loc.group_kinds
    if not len(local_tables) == len(remote_tables) == len(fill_from) == len(kinds):
        raise ValueError(f"tables and fill_from must match the {len(kinds)} groups")
    if type(num_tokens) is not int or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0: {num_tokens!r}")
    if any(type(f) is not int or f < 0 for f in fill_from):
        raise ValueError(f"fill_from must be ints >= 0: {list(fill_from)!r}")
    sides = ((loc, local_tables, "local"), (rem, remote_tables, "remote"))
    kb = loc.kernel_block
    if read.coarse:
        size = kb * loc.ratio
        pages: tuple[list[list[int]], list[list[int]]] = ([], [])
        for g, kind in enumerate(kinds):
            for out, (layout, tables, side) in zip(pages, sides, strict=True):
                where = f"{side} group {g} ({kind})"
                if kind in FA_KINDS:
                    j0, j1 = fill_from[g] // size, _cdiv(num_tokens, size)
                    out.append(_pages(tables[g], j0, max(j0, j1), layout, where))
                else:
                    out.append(_state_page(tables[g], layout, where))
        return coarse_pair_ids(kinds, *pages, loc.num_regions, loc.n_log, rem.n_log)
    ids = []
    for layout, tables, side in sides:
        spans, states = [], []
        for g, kind in enumerate(kinds):
            where = f"{side} group {g} ({kind})"
            if kind in FA_KINDS:
                k0, k1 = fill_from[g] // kb, _cdiv(num_tokens, kb)
                spans.append(_kernel_spans(tables[g], k0, k1, layout, where))
                states.append([])
            else:
                spans.append([])
                states.append(_state_page(tables[g], layout, where))
        ids.append(
            dual_ids(
                kinds,
                spans,
                states,
                layout.num_regions,
                layout.n_phys,
                layout.n_log,
                read.active,
            )
        )
    return ids[0], ids[1]
