"""Descriptor ids of the dual view (`descriptors`): block ids -> indices into one rank's list.

Per group in plan order, region-major:
  attention (kernel ids `k = p*ratio + j` of logical ids p, with the ratio OF THE SIDE INDEXED):
      `r*N_phys + k`, r in 0..2T-1 (r = 2i for K_i, 2i+1 for V_i)
  mamba (logical ids b): `2T*N_phys + (4i + j)*N_log + b`, j in (x, B, C, ssm), i in 0..T-1
  (the `2T*N_phys` term only when the model has an attention group).
Attention ids are emitted as `range`s of adjacent kernel blocks (`list += range`, C speed), so
the cost is proportional to the ids produced, never to N_phys or N_log.
Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hybridserve.disagg.descriptors import ALL_COMPONENTS, FA_KINDS, MAMBA_PARTS, RankLayout


def expand_kernel_ids(ids: Iterable[int], ratio: int) -> list[int]:
    """Logical page ids -> kernel block ids `p*ratio + j`, j in 0..ratio-1."""
    return [p * ratio + j for p in ids for j in range(ratio)]


def descriptor_ids(
    kinds: Sequence[str],
    block_ids_per_group: Sequence[Sequence[int]],
    num_regions: int,
    n_phys: int,
    n_log: int,
    ratio: int = 1,
    active: frozenset[str] = ALL_COMPONENTS,
) -> list[int]:
    """Indices into a dual view (module docstring), per group in order.

    Attention groups: ids are expanded `p*ratio + j` (pass ratio=1 for ids that are already
    kernel ids; pass the ratio OF THE SIDE INDEXED for logical ids), then `r*n_phys + k` for
    r in 0..2T-1. Mamba groups: `fa + (4i + j)*n_log + b`, `fa = 2T*n_phys` when an attention
    kind is present, else 0. Components not in `active` ("kv", "x", "B", "C", "ssm") are skipped.
    Cost: proportional to the ids produced, never to the pool.
    """
    if len(block_ids_per_group) != len(kinds):
        raise ValueError(f"{len(block_ids_per_group)} block id lists for {len(kinds)} groups")
    spans: list[list[tuple[int, int]]] = []
    for kind, ids in zip(kinds, block_ids_per_group, strict=True):
        if kind in FA_KINDS:
            if ids and (min(ids) < 0 or max(ids) * ratio + ratio > n_phys):
                lo, hi = min(ids) * ratio, max(ids) * ratio + ratio - 1
                raise ValueError(f"kernel block id out of range [0, {n_phys}): {lo}..{hi}")
            spans.append(kernel_spans(ids, ratio, len(ids) * ratio))
        elif kind == "mamba":
            check_ids(ids, n_log, "Mamba page")
            spans.append([])
        else:
            raise ValueError(f"unknown group kind {kind!r}")
    return dual_ids(kinds, spans, block_ids_per_group, num_regions, n_phys, n_log, active)


def kernel_spans(ids: Iterable[int], ratio: int, limit: int) -> list[tuple[int, int]]:
    """Logical page ids -> the kernel ids `p*ratio + j` as half-open spans `[start, stop)`, the
    first `limit` of them, spans of adjacent pages merged (a contiguous table is one span).
    Cost: one step per page, none per kernel block."""
    spans: list[tuple[int, int]] = []
    left = limit
    for p in ids:
        if left <= 0:
            break
        start = p * ratio
        stop = start + min(ratio, left)
        left -= stop - start
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], stop)
        else:
            spans.append((start, stop))
    return spans


def dual_ids(
    kinds: Sequence[str],
    spans_per_group: Sequence[Sequence[tuple[int, int]]],
    pages_per_group: Sequence[Sequence[int]],
    num_regions: int,
    n_phys: int,
    n_log: int,
    active: frozenset[str],
) -> list[int]:
    """Dual-view ids of checked groups: attention groups read their kernel spans, Mamba groups
    their page ids (the other list of a group is ignored)."""
    fa = 2 * num_regions * n_phys if any(k in FA_KINDS for k in kinds) else 0
    out: list[int] = []
    for kind, spans, ids in zip(kinds, spans_per_group, pages_per_group, strict=True):
        if kind in FA_KINDS:
            if "kv" in active:
                for r in range(2 * num_regions):
                    off = r * n_phys
                    for lo, hi in spans:
                        out += range(off + lo, off + hi)
        else:
            for i in range(num_regions):
                for j, name in enumerate(MAMBA_PARTS):
                    if name in active:
                        s = fa + (4 * i + j) * n_log
                        out += [s + b for b in ids]
    return out


def layout_descriptor_ids(
    layout: RankLayout, logical_ids_per_group: Sequence[Sequence[int]]
) -> list[int]:
    """`descriptor_ids` into `layout`'s own view, logical attention ids expanded with its ratio."""
    return descriptor_ids(
        layout.group_kinds,
        logical_ids_per_group,
        layout.num_regions,
        layout.n_phys,
        layout.n_log,
        layout.ratio,
    )


def check_ids(ids: Sequence[int], n: int, what: str) -> None:
    if ids and (min(ids) < 0 or max(ids) >= n):
        raise ValueError(f"{what} id out of range [0, {n}): {min(ids)}..{max(ids)}")
