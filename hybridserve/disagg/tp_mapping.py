"""Which remote ranks a decode rank reads, which byte slices, and which descriptor ids.

Block ids -> descriptor ids (`descriptor_ids`), per group in plan order, region-major:
  attention (kernel ids `k = p*ratio + j` of logical ids p, with the ratio OF THE SIDE INDEXED):
      `r*N_phys + k`, r in 0..2T-1 (r = 2i for K_i, 2i+1 for V_i)
  mamba (logical ids b): `2T*N_phys + (4i + j)*N_log + b`, j in (x, B, C, ssm), i in 0..T-1
  (the `2T*N_phys` term only when the model has an attention group).

Heterogeneous TP (D = decode/local TP, P = prefill/remote TP, one must divide the other):
  sources of decode rank r: `[r // (D/P)]` when D >= P, else `[r*a + j for j < a]`, a = P/D.
  Every component (kv heads; Mamba x heads, B groups, C groups, ssm heads) is a run of global
  units (heads or groups, `held_range`); for each source q the moved slice is the overlap
  `[lo, hi)` of the units r holds and q holds:
      remote offset = base_q + (lo - first_q) * unit,
      local offset  = base_r + (lo - first_r) * unit,   length = (hi - lo) * unit.
  E.g. D >= P (t = D/P, o = r % t, sharded groups): x at `o*x_D`, B at `x_P + o*bc_D`,
  C at `x_P + bc_P + o*bc_D`, ssm at `conv_P + o*ssm_D`, K/V at `o*half_D` in each half; with
  replicated groups/heads (count < TP) the overlap is the ONE unit r holds, at its index in q.
  P > D: each source fills its own piece of each local descriptor. A component a source only
  duplicates (GQA heads or replicated B/C groups another source already gives) is inactive
  for it: its ids are skipped, so the bytes arrive once (state x/ssm are never duplicated).
  SD conv layout + unequal TP: ValueError (the x/B/C slices are strided in SD); use DS.
Notifications: a prefill rank frees a request after `D/P` reads when D > P, else after 1.
Standard library only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from hybridserve.disagg.descriptors import (
    ALL_COMPONENTS,
    DS_HINT,
    FA_KINDS,
    MAMBA_PARTS,
    DescRun,
    RankLayout,
    check_compatible,
    expand_runs,
    slabs,
    view_runs,
)


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
    fa = 2 * num_regions * n_phys if any(k in FA_KINDS for k in kinds) else 0
    out: list[int] = []
    for kind, ids in zip(kinds, block_ids_per_group, strict=True):
        if kind in FA_KINDS:
            kids = expand_kernel_ids(ids, ratio) if ratio != 1 else list(ids)
            _check_ids(kids, n_phys, "kernel block")
            if "kv" in active:
                for r in range(2 * num_regions):
                    out += [r * n_phys + k for k in kids]
        elif kind == "mamba":
            _check_ids(ids, n_log, "Mamba page")
            for i in range(num_regions):
                for j, name in enumerate(MAMBA_PARTS):
                    if name in active:
                        s = fa + (4 * i + j) * n_log
                        out += [s + b for b in ids]
        else:
            raise ValueError(f"unknown group kind {kind!r}")
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


def _check_ids(ids: Sequence[int], n: int, what: str) -> None:
    if ids and (min(ids) < 0 or max(ids) >= n):
        raise ValueError(f"{what} id out of range [0, {n}): {min(ids)}..{max(ids)}")


# --- heterogeneous TP --------------------------------------------------------------------------


def source_ranks(local_tp: int, local_rank: int, remote_tp: int) -> list[int]:
    """Remote ranks decode rank `local_rank` reads: `[r // (D/P)]` if D >= P, else the a = P/D
    ranks `r*a + j`."""
    _check_tp(local_tp, remote_tp)
    if local_tp >= remote_tp:
        return [local_rank // (local_tp // remote_tp)]
    a = remote_tp // local_tp
    return [local_rank * a + j for j in range(a)]


def notifications_per_request(prefill_tp: int, decode_tp: int) -> int:
    """Reads (hence notifications) each prefill rank waits for per request: `D/P` if D > P,
    else 1."""
    _check_tp(decode_tp, prefill_tp)
    return decode_tp // prefill_tp if decode_tp > prefill_tp else 1


@dataclasses.dataclass(frozen=True)
class SourceRead:
    """What decode rank `local.tp_rank` reads from remote rank `remote_rank`.

    `local_runs` / `remote_runs` are each a FULL dual view of their own side (the
    `local_descriptors` order, their own T/N_phys/N_log), entry for entry the same byte length,
    each entry cut to the slice this pair moves. `active` names the components this source
    gives ("kv", "x", "B", "C", "ssm"); `descriptor_ids` skips the others (their entries still
    point at valid, duplicate bytes of this source, so preparing them is harmless).
    """

    remote_rank: int
    active: frozenset[str]
    local_runs: tuple[DescRun, ...]
    remote_runs: tuple[DescRun, ...]
    local: RankLayout
    remote: RankLayout

    @property
    def serves_attention(self) -> bool:
        return "kv" in self.active

    def local_descriptors(self) -> list[tuple[int, int, int]]:
        """This source's local (split) descriptor list, on the local device."""
        return expand_runs(self.local_runs, self.local.device_id)

    def remote_descriptors(self) -> list[tuple[int, int, int]]:
        """The remote descriptor list to prepare with this source's agent name."""
        return expand_runs(self.remote_runs, self.remote.device_id)

    def descriptor_ids(
        self,
        local_ids_per_group: Sequence[Sequence[int]],
        remote_ids_per_group: Sequence[Sequence[int]],
    ) -> tuple[list[int], list[int]]:
        """(local ids, remote ids) of one request, equal lengths, pairwise equal byte lengths.

        Both take LOGICAL page ids per group (plan order); attention ids expand with each
        side's own ratio. When the ratios differ, the two kernel lists (both starting at the
        request's first token) are cut to the shorter; a sliding-window group, or lists that
        are not aligned (e.g. a partial prefix hit), raise. Mamba lists must be equally long.
        """
        kinds = self.local.group_kinds
        if not len(local_ids_per_group) == len(remote_ids_per_group) == len(kinds):
            raise ValueError(f"block id lists per group must match the {len(kinds)} groups")
        lr, rr = self.local.ratio, self.remote.ratio
        local_k: list[list[int]] = []
        remote_k: list[list[int]] = []
        for g, (kind, lids, rids) in enumerate(
            zip(kinds, local_ids_per_group, remote_ids_per_group, strict=True)
        ):
            if kind in FA_KINDS:
                lk, rk = expand_kernel_ids(lids, lr), expand_kernel_ids(rids, rr)
                n = min(len(lk), len(rk))
                if len(lk) != len(rk) and (
                    lr == rr or kind != "full_attention" or max(len(lk), len(rk)) - n >= max(lr, rr)
                ):
                    raise ValueError(
                        f"group {g} ({kind}): {len(lids)} local pages (ratio {lr}) do not cover "
                        f"the same tokens as {len(rids)} remote pages (ratio {rr}); trim the "
                        "lists to the same tokens first (e.g. remote[-len(local):])"
                    )
                lk, rk = lk[:n], rk[:n]
            else:
                if len(lids) != len(rids):
                    raise ValueError(f"group {g} (mamba): {len(lids)} != {len(rids)} pages")
                lk, rk = list(lids), list(rids)
            local_k.append(lk)
            remote_k.append(rk)
        return (
            _view_ids(self.local, local_k, self.active),
            _view_ids(self.remote, remote_k, self.active),
        )


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """Every read of decode rank `local.tp_rank` from one prefill engine (TP `remote_tp`)."""

    local: RankLayout
    remote_tp: int
    reads: tuple[SourceRead, ...]

    @property
    def remote_ranks(self) -> list[int]:
        return [s.remote_rank for s in self.reads]


def plan_reads(local: RankLayout, remotes: Mapping[int, RankLayout]) -> ReadPlan:
    """The transfer plan of decode rank `local.tp_rank` given the layouts advertised by the
    prefill ranks (keyed by remote rank; at least the `source_ranks`, one shared tp_size)."""
    if not remotes:
        raise ValueError("no remote layouts")
    remote_tp = next(iter(remotes.values())).tp_size
    for rank, layout in remotes.items():
        if layout.tp_rank != rank or layout.tp_size != remote_tp:
            raise ValueError(
                f"remote layout under rank {rank} says rank {layout.tp_rank} of "
                f"{layout.tp_size}; expected rank {rank} of {remote_tp}"
            )
        check_compatible(local, layout)
    sources = source_ranks(local.tp_size, local.tp_rank, remote_tp)
    missing = [q for q in sources if q not in remotes]
    if missing:
        raise ValueError(f"no layout for remote source ranks {missing}")
    if local.has_mamba and local.conv_layout != "DS" and local.tp_size != remote_tp:
        raise ValueError(
            f"heterogeneous TP (decode {local.tp_size}, prefill {remote_tp}) needs the DS conv "
            f"layout (in {local.conv_layout} one rank's x/B/C channels are not contiguous): "
            f"{DS_HINT}"
        )
    mine = slabs(local)
    seen: dict[str, list[range]] = {s.name: [] for s in mine}
    reads = []
    for q in sources:
        remote = remotes[q]
        local_pieces, remote_pieces, active = {}, {}, set()
        for ls, rs in zip(mine, slabs(remote), strict=True):
            lo, hi = max(ls.held.start, rs.held.start), min(ls.held.stop, rs.held.stop)
            if lo >= hi or ls.unit != rs.unit:
                raise ValueError(f"remote rank {q} holds none of this rank's {ls.name} units")
            local_pieces[ls.name] = (ls.base + (lo - ls.held.start) * ls.unit, (hi - lo) * ls.unit)
            remote_pieces[rs.name] = (rs.base + (lo - rs.held.start) * rs.unit, (hi - lo) * rs.unit)
            span = range(lo, hi)
            if span not in seen[ls.name]:
                if any(max(lo, s.start) < min(hi, s.stop) for s in seen[ls.name]):
                    raise ValueError(f"remote {ls.name} slices overlap partially")  # defensive
                seen[ls.name].append(span)
                active.add(ls.name)
        reads.append(
            SourceRead(
                q,
                frozenset(active),
                view_runs(local, local_pieces),
                view_runs(remote, remote_pieces),
                local,
                remote,
            )
        )
    for s in mine:
        if sum(len(span) for span in seen[s.name]) != len(s.held):
            raise ValueError(f"the sources do not cover this rank's {s.name} units")
    return ReadPlan(local, remote_tp, tuple(reads))


def _view_ids(
    layout: RankLayout, kernel_ids_per_group: Sequence[Sequence[int]], active: frozenset[str]
) -> list[int]:
    return descriptor_ids(
        layout.group_kinds,
        kernel_ids_per_group,
        layout.num_regions,
        layout.n_phys,
        layout.n_log,
        1,
        active,
    )


def _check_tp(local_tp: int, remote_tp: int) -> None:
    if local_tp < 1 or remote_tp < 1 or (local_tp % remote_tp and remote_tp % local_tp):
        raise ValueError(f"TP sizes {local_tp} and {remote_tp}: one must divide the other")
