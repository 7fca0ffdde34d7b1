"""Which remote ranks a decode rank reads, which byte slices, and which descriptor ids.

Block ids -> descriptor ids (`descriptor_ids`), per group in plan order, region-major:
  attention (kernel ids `k = p*ratio + j` of logical ids p, with the ratio OF THE SIDE INDEXED):
      `r*N_phys + k`, r in 0..2T-1 (r = 2i for K_i, 2i+1 for V_i)
  mamba (logical ids b): `2T*N_phys + (4i + j)*N_log + b`, j in (x, B, C, ssm), i in 0..T-1
  (the `2T*N_phys` term only when the model has an attention group).
Coarse view (`coarse_view`, `descriptors.coarse_runs`), chosen by `plan_reads` for a pair that
needs no slicing (equal TP, ratio, page and state bytes, conv layout): logical ids, attention
`i*N_log + p`, Mamba `T*N_log + i*N_log + b` (the `T*N_log` only with attention), then merge
levels k = 1..L (L <= 6, attention only): the 2^k pages from p at `B_k + i*(N_log-2^k+1) + p`,
`B_k = (1+m)*T*N_log + T*((k-1)*(N_log+1) - 2^k + 2)` (m = 1 with Mamba). Per request, joint
runs of consecutive (local, remote) pages are cut into power-of-two pieces, one id per piece
and region on each side (`coarse_view.coarse_pair_ids`). A 64-page consecutive
Nemotron-3-Nano-30B request at TP2 -> TP2 (fp8 KV, ratio 261): 30 ids per side (6 attention,
one 64-page piece per region, + 24 Mamba), 408 unmerged, 200,544 in the dual view.
Per-request cost: proportional to the ids produced, never to N_phys or N_log; the dual view's
attention ids are emitted as `range`s of adjacent kernel blocks (`list += range`, C speed).

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
from collections.abc import Mapping, Sequence
from typing import Literal

from hybridserve.disagg.coarse_view import (
    coarse_descriptor_ids as coarse_descriptor_ids,  # re-exported
)
from hybridserve.disagg.coarse_view import coarse_pair, coarse_pair_ids
from hybridserve.disagg.descriptors import (
    DS_HINT,
    FA_KINDS,
    DescRun,
    RankLayout,
    check_compatible,
    coarse_runs,
    expand_runs,
    slabs,
    view_runs,
)
from hybridserve.disagg.dual_ids import check_ids, dual_ids, kernel_spans
from hybridserve.disagg.dual_ids import descriptor_ids as descriptor_ids  # re-exported
from hybridserve.disagg.dual_ids import expand_kernel_ids as expand_kernel_ids  # re-exported
from hybridserve.disagg.dual_ids import (
    layout_descriptor_ids as layout_descriptor_ids,  # re-exported
)
from hybridserve.disagg.request_spans import span_ids

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


View = Literal["fine", "coarse"]


@dataclasses.dataclass(frozen=True)
class SourceRead:
    """What decode rank `local.tp_rank` reads from remote rank `remote_rank`.

    `view` says which descriptor view both lists use:
      "fine":   `local_runs` / `remote_runs` are each a FULL dual view of their own side (the
                `local_descriptors` order, their own T/N_phys/N_log), entry for entry the same
                byte length, each entry cut to the slice this pair moves.
      "coarse": each is the coarse view of its side (`descriptors.coarse_runs`: whole attention
                pages, whole state pages less padding, then the attention merge levels of 2^k
                whole pages), for a pair that needs no slicing.
    `active` names the components this source gives ("kv", "x", "B", "C", "ssm"); the fine
    `descriptor_ids` skips the others (their entries still point at valid, duplicate bytes of
    this source, so preparing them is harmless). A coarse read is always fully active.
    """

    remote_rank: int
    active: frozenset[str]
    local_runs: tuple[DescRun, ...]
    remote_runs: tuple[DescRun, ...]
    local: RankLayout
    remote: RankLayout
    view: View = "fine"

    @property
    def serves_attention(self) -> bool:
        return "kv" in self.active

    @property
    def coarse(self) -> bool:
        return self.view == "coarse"

    def local_descriptors(self) -> list[tuple[int, int, int]]:
        """This source's local descriptor list (split in the fine view), on the local device:
        `2T*N_phys + 4T*N_log` entries (fine) or `descriptors.coarse_view_size` (coarse)."""
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

        Both take LOGICAL page ids per group (plan order). Coarse view: `coarse_pair_ids` (a
        piece of 2^k pages consecutive on both sides is one id per region, level-k on each side;
        each side indexes its own view). Fine view: attention ids expand with each side's own
        ratio; when the ratios differ, the two kernel lists (both starting at the request's
        first token) are cut to the shorter. Lists that do not cover the same tokens
        raise: unequal lengths at equal ratios (always so in the coarse view), or, at unequal
        ratios, a sliding-window group or lists that are not aligned (e.g. a partial prefix
        hit); Mamba lists must be equally long. Cost: proportional to the ids returned
        (coarse: one pass over the pages, then `T` ids per piece; a 64-page consecutive Nano
        request: 30 per side), never to N_phys or N_log.
        """
        loc, rem = self.local, self.remote
        kinds = loc.group_kinds
        if not len(local_ids_per_group) == len(remote_ids_per_group) == len(kinds):
            raise ValueError(f"block id lists per group must match the {len(kinds)} groups")
        lr, rr = loc.ratio, rem.ratio
        if self.view == "coarse":  # equal ratios: aligned lists have equal lengths
            for g, (kind, lids, rids) in enumerate(
                zip(kinds, local_ids_per_group, remote_ids_per_group, strict=True)
            ):
                if len(lids) != len(rids):
                    _pair_kernels(g, kind, lids, rids, lr, rr)  # raises, naming the group
            return coarse_pair_ids(
                kinds,
                local_ids_per_group,
                remote_ids_per_group,
                loc.num_regions,
                loc.n_log,
                rem.n_log,
            )
        kernels = [
            _pair_kernels(g, kind, lids, rids, lr, rr)
            if len(lids) != len(rids) or lr != rr
            else len(lids) * lr  # equal ratios and lengths: aligned (Mamba: unused)
            for g, (kind, lids, rids) in enumerate(
                zip(kinds, local_ids_per_group, remote_ids_per_group, strict=True)
            )
        ]
        return (
            _side_ids(loc, local_ids_per_group, kernels, self.active),
            _side_ids(rem, remote_ids_per_group, kernels, self.active),
        )

    def span_ids(
        self,
        local_tables: Sequence[Sequence[int]],
        remote_tables: Sequence[Sequence[int]],
        fill_from: Sequence[int],
        num_tokens: int,
    ) -> tuple[list[int], list[int]]:
        """(local ids, remote ids) of one request that moves, in every attention group g, the
        tokens `[fill_from[g], num_tokens)` and every Mamba group's state page; both sides
        pass whole block tables, null pages allowed outside the range (`request_spans`:
        what a P/D transfer moves, windows and decode-side prefix hits included)."""
        return span_ids(self, local_tables, remote_tables, fill_from, num_tokens)


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """Every read of decode rank `local.tp_rank` from one prefill engine (TP `remote_tp`)."""

    local: RankLayout
    remote_tp: int
    reads: tuple[SourceRead, ...]

    @property
    def remote_ranks(self) -> list[int]:
        return [s.remote_rank for s in self.reads]

    def request_ids(
        self,
        local_ids_per_group: Sequence[Sequence[int]],
        remote_ids_per_group: Sequence[Sequence[int]],
    ) -> list[tuple[list[int], list[int]]]:
        """`SourceRead.descriptor_ids` of every read, in order: the per-request control-plane
        work of this decode rank (what a benchmark times)."""
        return [r.descriptor_ids(local_ids_per_group, remote_ids_per_group) for r in self.reads]


def request_ids(
    read: SourceRead,
    local_ids_per_group: Sequence[Sequence[int]],
    remote_ids_per_group: Sequence[Sequence[int]],
) -> tuple[list[int], list[int]]:
    """`read.descriptor_ids(...)`: the (local, remote) ids of one request, for benchmarks."""
    return read.descriptor_ids(local_ids_per_group, remote_ids_per_group)


def plan_reads(
    local: RankLayout, remotes: Mapping[int, RankLayout], *, allow_coarse: bool = True
) -> ReadPlan:
    """The transfer plan of decode rank `local.tp_rank` given the layouts advertised by the
    prefill ranks (keyed by remote rank; at least the `source_ranks`, one shared tp_size).

    A pair that needs no slicing (`coarse_pair`: equal TP, ratio, page bytes and components)
    reads in the coarse view unless `allow_coarse` is False (then every read is fine)."""
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
            local_pieces[ls.name] = (
                ls.offset + (lo - ls.held.start) * ls.unit,
                (hi - lo) * ls.unit,
            )
            remote_pieces[rs.name] = (
                rs.offset + (lo - rs.held.start) * rs.unit,
                (hi - lo) * rs.unit,
            )
            span = range(lo, hi)
            if span not in seen[ls.name]:
                if any(max(lo, s.start) < min(hi, s.stop) for s in seen[ls.name]):
                    raise ValueError(f"remote {ls.name} slices overlap partially")  # defensive
                seen[ls.name].append(span)
                active.add(ls.name)
        if allow_coarse and coarse_pair(local, remote):
            read = SourceRead(
                q,
                frozenset(active),
                coarse_runs(local),
                coarse_runs(remote),
                local,
                remote,
                "coarse",
            )
        else:
            read = SourceRead(
                q,
                frozenset(active),
                view_runs(local, local_pieces),
                view_runs(remote, remote_pieces),
                local,
                remote,
            )
        reads.append(read)
    for s in mine:
        if sum(len(span) for span in seen[s.name]) != len(s.held):
            raise ValueError(f"the sources do not cover this rank's {s.name} units")
    return ReadPlan(local, remote_tp, tuple(reads))


def _pair_kernels(
    g: int, kind: str, lids: Sequence[int], rids: Sequence[int], lr: int, rr: int
) -> int:
    """Kernel blocks (attention) or pages (Mamba) the pair moves in group `g`: for attention
    `n = min(len(lids)*lr, len(rids)*rr)`, refused unless both lists cover the same tokens
    (equal ratios: equal lengths; else full attention, differing by less than one page)."""
    if kind in FA_KINDS:
        nl, nr = len(lids) * lr, len(rids) * rr
        n = min(nl, nr)
        if nl != nr and (lr == rr or kind != "full_attention" or max(nl, nr) - n >= max(lr, rr)):
            raise ValueError(
                f"group {g} ({kind}): {len(lids)} local pages (ratio {lr}) do not cover "
                f"the same tokens as {len(rids)} remote pages (ratio {rr}); trim the "
                "lists to the same tokens first (e.g. remote[-len(local):])"
            )
        return n
    if kind != "mamba":
        raise ValueError(f"unknown group kind {kind!r}")
    if len(lids) != len(rids):
        raise ValueError(f"group {g} (mamba): {len(lids)} != {len(rids)} pages")
    return len(lids)


def _side_ids(
    layout: RankLayout,
    ids_per_group: Sequence[Sequence[int]],
    kernels: Sequence[int],
    active: frozenset[str],
) -> list[int]:
    """Dual-view ids of one side: logical ids checked against `N_log`, attention expanded with
    this side's ratio and cut to `kernels[g]` kernel blocks."""
    spans = []
    for kind, ids, n in zip(layout.group_kinds, ids_per_group, kernels, strict=True):
        check_ids(ids, layout.n_log, "page")
        spans.append(kernel_spans(ids, layout.ratio, n) if kind in FA_KINDS else [])
    return dual_ids(
        layout.group_kinds,
        spans,
        ids_per_group,
        layout.num_regions,
        layout.n_phys,
        layout.n_log,
        active,
    )


def _check_tp(local_tp: int, remote_tp: int) -> None:
    if local_tp < 1 or remote_tp < 1 or (local_tp % remote_tp and remote_tp % local_tp):
        raise ValueError(f"TP sizes {local_tp} and {remote_tp}: one must divide the other")
