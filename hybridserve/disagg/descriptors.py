"""One rank's cache layout as NIXL sees it (`RankLayout`, the handshake form) and its dual view.

Memory (per rank): `T` regions, region i at base `A_i`, `num_pages` pages of `page_bytes`; page p
(a logical block id) is at `A_i + p * page_bytes`. Inside a page the bytes lie as
`hybridserve.cache.page_layout` says (its `AttentionPage` / `MambaPage`, built here from the
handshake fields): attention kernel block `k = p*ratio + j` is `[K | V]` at `A_i + k*kpage`
(K_i[k] = `A_i + k*kpage + K.offset`, V_i[k] = `+ V.offset`, `kpage/2` each); a state page
holds the x, B, C, ssm slabs at their offsets (x_i[b] = `A_i + b*page + x.offset`, ...). In SD
the three conv slabs are plain byte chunks of the conv, not its x/B/C channels: valid only when
both sides have the same TP (the conv then moves verbatim); heterogeneous TP needs DS.
Padding is never inside a descriptor.

Dual view (ONE list; `N_phys = num_pages * ratio`, `N_log = num_pages`; a section is present only
when a group of its kind is):
  FA:  for i in 0..T-1: K_i[0..N_phys-1], V_i[0..N_phys-1]          -> 2T * N_phys entries
  SSM: for i in 0..T-1: x_i[0..N_log-1], B_i[..], C_i[..], ssm_i[..]  -> 4T * N_log entries
Descriptor ids (`tp_mapping.descriptor_ids`; per group in plan order, region-major): logical
attention ids expand to kernel ids `k = p*ratio + j`, then `r*N_phys + k` for r in 0..2T-1
(r = 2i + {K:0, V:1}); Mamba ids give `fa + s*N_log + b` for s = 4i + j, j in (x, B, C, ssm),
with `fa = 2T*N_phys` (0 without FA).

Coarse view (page-granular; used for a (local, remote) rank pair that needs no slicing: equal TP,
equal ratio hence equal page bytes, equal conv layout; each page then moves whole):
  FA:  for i in 0..T-1: P_i[0..N_log-1], P_i[p] = `(A_i + p*page, page)`    -> T * N_log entries
       (a full attention page is all data: `ratio` kernel pages of exactly K + V)
  SSM: for i in 0..T-1: S_i[0..N_log-1], S_i[b] = `(A_i + b*page, state)`   -> T * N_log entries
       (x|B|C|ssm are contiguous in DS and SD alike; `state = conv + ssm`, padding excluded)
  LVL: merge levels, attention only: for k in 1..L, for i in 0..T-1: M^k_i[0..N_log-2^k],
       M^k_i[p] = `(A_i + p*page, 2^k * page)` (2^k whole pages from p) -> T*(N_log-2^k+1) each
       `L = min(MERGE_LEVELS, floor(log2 N_log))` (6: up to 64 pages; no level wider than the
       pool, no clipped entry). State pages are never merged (their padding is not data).
       The levels add fewer than `L*T*N_log` entries to the list prepared once per pair.
Coarse ids (`coarse_view`; logical ids, no ratio expansion): attention `i*N_log + p`, Mamba
`fa + i*N_log + b` with `fa = T*N_log` (0 without FA); `2^k` pages from p at level k:
`B_k + i*(N_log - 2^k + 1) + p`, `B_k = (1+m)*T*N_log + T*((k-1)*(N_log+1) - 2^k + 2)` (m = 1
with Mamba, else 0). `coarse_view.coarse_pair_ids` cuts joint runs of consecutive pages (both
sides) into power-of-two pieces. A 64-page consecutive request of Nemotron-3-Nano-30B (fp8
KV at TP 2: ratio 261; T = 6, one attention group, 4 Mamba groups of 1 page) gives `6*1 +
4*6*1 = 30` ids per side (one 64-page piece per region); unmerged `6*64 + 24 = 408`; the dual
view `12*64*261 + 4*24 = 200,544`.

Heads and groups per rank: `page_layout.held_range`. Standard library only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Iterable, Sequence
from typing import Any

from hybridserve.cache.page_layout import (
    AttentionPage,
    MambaPage,
    Slab,
    attention_page,
    mamba_page,
)
from hybridserve.cache.page_layout import held_range as held_range  # re-exported
from hybridserve.cache.plan import CachePlan
from hybridserve.cache.spec import (
    FullAttentionSpec,
    MambaSpec,
    SconvSpec,
    canonical_dtype,
    sconv_heads,
)
from hybridserve.config import ModelConfig

FA_KINDS = ("full_attention", "sliding_window")
GROUP_KINDS = (*FA_KINDS, "mamba")
MAMBA_PARTS = ("x", "B", "C", "ssm")  # j in s = 4i + j
COMPONENTS = ("kv", *MAMBA_PARTS)
ALL_COMPONENTS = frozenset(COMPONENTS)
MERGE_LEVELS = 6  # coarse attention descriptors of up to 2**6 consecutive pages
DS_HINT = "set HYBRIDSERVE_SSM_CONV_LAYOUT=DS on both prefill and decode"
MISMATCH_HINTS = {
    "sconv_heads": " (an sconv entry holds max(num_key_value_heads, tp) heads, one rank's "
    "share each: P/D between different TP sizes needs tp <= num_key_value_heads on both sides)",
}
# Not in the compatibility key: they may differ between prefill and decode (or between ranks).
PER_SIDE_FIELDS = frozenset(
    ("tp_size", "tp_rank", "device_id", "region_bases", "num_pages", "page_bytes", "ratio")
)


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """One rank's cache memory, as advertised in the handshake (`to_dict` / `from_dict`).
    Dtypes are names (`cache.spec.DTYPE_BYTES`); fields of an absent kind stay 0 / ""."""

    tp_size: int
    tp_rank: int
    device_id: int
    region_bases: tuple[int, ...]
    num_pages: int
    page_bytes: int
    ratio: int  # kernel pages per logical page (this side)
    kernel_block: int
    group_kinds: tuple[str, ...]  # CachePlan order
    group_layers: tuple[tuple[int | None, ...], ...]  # group g's layer in region i (None: pad)
    kv_heads: int = 0  # global KV heads
    head_dim: int = 0
    kv_dtype: str = ""
    sliding_window: int = 0
    mamba_heads: int = 0  # global
    mamba_head_dim: int = 0
    state_size: int = 0
    n_groups: int = 0  # global B/C groups
    conv_rows: int = 0  # conv_kernel - 1
    conv_dtype: str = ""
    ssm_dtype: str = ""
    conv_layout: str = ""  # DS | SD
    sconv_heads: int = 0  # global heads of an sconv entry (`cache.spec.sconv_heads`; 0: none)

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"invalid cache layout: {message}")

        need(0 <= self.tp_rank < self.tp_size, f"tp_rank {self.tp_rank} / tp {self.tp_size}")
        need(len(self.region_bases) > 0, "no regions")
        need(self.num_pages > 0 and self.page_bytes > 0, "empty pool")
        need(self.ratio > 0 and self.page_bytes % self.ratio == 0, "page not a ratio multiple")
        span, bases = self.num_pages * self.page_bytes, sorted(self.region_bases)
        need(bases[0] >= 0, f"negative region base {bases[0]}")
        overlap = [(a, b) for a, b in itertools.pairwise(bases) if b - a < span]
        need(not overlap, f"regions of {span} bytes overlap at bases {overlap[:1]}")
        need(len(self.group_kinds) == len(self.group_layers) > 0, "group kinds/layers")
        bad = sorted(set(self.group_kinds) - set(GROUP_KINDS))
        need(not bad, f"unknown group kinds {bad}")
        need(all(len(g) == self.num_regions for g in self.group_layers), "group width != T")
        if self.has_attention:
            need(self.kv_heads > 0 and self.head_dim > 0, "attention dims")
            kpage = self.attention_page.kernel_page_bytes
            need(kpage == self.kernel_page_bytes, "kernel page != K + V")
        if self.has_mamba:
            need(self.mamba_heads % self.tp_size == 0, "mamba heads not divisible by tp")
            need(self.conv_layout in ("DS", "SD"), f"conv layout {self.conv_layout!r}")
            need(self.state_bytes <= self.page_bytes, "Mamba state larger than a page")

    # --- construction and the wire form --------------------------------------------------

    @classmethod
    def from_plan(
        cls,
        plan: CachePlan,
        cfg: ModelConfig,
        *,
        tp_rank: int,
        region_bases: Sequence[int],
        num_pages: int,
        device_id: int = 0,
    ) -> RankLayout:
        """The layout of rank `tp_rank` of an engine built from `plan` (dtypes from its specs)."""
        if len(region_bases) != plan.num_regions:
            raise ValueError(f"{len(region_bases)} region bases for {plan.num_regions} regions")
        kinds = tuple(g.kind for g in plan.groups)
        if any(k not in GROUP_KINDS for k in kinds):
            raise ValueError(f"no transfer support for group kinds {kinds}")
        fields: dict[str, Any] = {}
        attn = [g.spec for g in plan.groups if isinstance(g.spec, FullAttentionSpec)]
        if attn:
            a = cfg.attention
            fields.update(
                kv_heads=a.num_kv_heads,
                head_dim=attn[0].head_dim,
                kv_dtype=canonical_dtype(attn[0].dtype),
                sliding_window=a.sliding_window or 0,
            )
        if any(isinstance(g.spec, SconvSpec) for g in plan.groups):
            fields["sconv_heads"] = sconv_heads(cfg, plan.tensor_parallel_size)
        mamba = [g.spec for g in plan.groups if isinstance(g.spec, MambaSpec)]
        if mamba:
            m, spec = cfg.mamba, mamba[0]
            fields.update(
                mamba_heads=m.num_heads,
                mamba_head_dim=m.head_dim,
                state_size=m.state_size,
                n_groups=m.n_groups,
                conv_rows=spec.conv_rows,
                conv_dtype=canonical_dtype(spec.conv_dtype),
                ssm_dtype=canonical_dtype(spec.ssm_dtype),
                conv_layout=spec.layout,
            )
        return cls(
            tp_size=plan.tensor_parallel_size,
            tp_rank=tp_rank,
            device_id=device_id,
            region_bases=tuple(int(b) for b in region_bases),
            num_pages=num_pages,
            page_bytes=plan.page_size_bytes,
            ratio=plan.ratio,
            kernel_block=plan.kernel_block_size,
            group_kinds=kinds,
            group_layers=tuple(g.layers for g in plan.groups),
            **fields,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain ints/strings/lists (and None in `group_layers`), e.g. for msgpack."""
        out = dataclasses.asdict(self)
        out["region_bases"] = list(self.region_bases)
        out["group_kinds"] = list(self.group_kinds)
        out["group_layers"] = [list(g) for g in self.group_layers]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankLayout:
        """Inverse of `to_dict`; unknown or missing fields raise ValueError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown cache layout fields {unknown}")
        kwargs = dict(data)
        try:
            kwargs["region_bases"] = tuple(data["region_bases"])
            kwargs["group_kinds"] = tuple(data["group_kinds"])
            kwargs["group_layers"] = tuple(tuple(g) for g in data["group_layers"])
            return cls(**kwargs)
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed cache layout: {e}") from None

    def compatibility_key(self) -> dict[str, Any]:
        """What prefill and decode must agree on: model dims, dtypes, kernel block, conv layout,
        groups (kinds and layers, hence T). Not TP, rank, device, bases, pool size or ratio."""
        return {
            f.name: _plain(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name not in PER_SIDE_FIELDS
        }

    def compatibility_hash(self) -> str:
        """A stable sha256 of `compatibility_key()`, for a first-stage handshake check."""
        text = json.dumps(self.compatibility_key(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    # --- geometry --------------------------------------------------------------------------

    @property
    def num_regions(self) -> int:
        return len(self.region_bases)

    @property
    def has_attention(self) -> bool:
        return any(k in FA_KINDS for k in self.group_kinds)

    @property
    def has_mamba(self) -> bool:
        return "mamba" in self.group_kinds

    @property
    def n_phys(self) -> int:
        """Kernel blocks per region: `num_pages * ratio`."""
        return self.num_pages * self.ratio

    @property
    def n_log(self) -> int:
        return self.num_pages

    @property
    def attention_page(self) -> AttentionPage:
        """This rank's attention page (`cache.page_layout`)."""
        return attention_page(
            self.kv_heads,
            self.head_dim,
            self.kv_dtype,
            self.kernel_block,
            self.ratio,
            self.tp_size,
            self.tp_rank,
        )

    @property
    def mamba_page(self) -> MambaPage:
        """This rank's Mamba state page (`cache.page_layout`)."""
        return mamba_page(
            num_heads=self.mamba_heads,
            head_dim=self.mamba_head_dim,
            state_size=self.state_size,
            n_groups=self.n_groups,
            conv_rows=self.conv_rows,
            conv_dtype=self.conv_dtype,
            ssm_dtype=self.ssm_dtype,
            layout=self.conv_layout,
            page_bytes=self.page_bytes,
            tp=self.tp_size,
            rank=self.tp_rank,
        )

    @property
    def kernel_page_bytes(self) -> int:
        return self.page_bytes // self.ratio

    @property
    def kv_slab(self) -> Slab:
        """This rank's heads within a K (or V) half: the K slab, named "kv" (its offsets are
        relative to the half; `view_runs` places it in both halves)."""
        return dataclasses.replace(self.attention_page.k, name="kv")

    @property
    def kv_half_bytes(self) -> int:
        return self.attention_page.half_bytes

    @property
    def mamba_slabs(self) -> tuple[Slab, Slab, Slab, Slab]:
        """x, B, C, ssm of a state page (`MambaPage.slabs`)."""
        return self.mamba_page.slabs

    @property
    def conv_bytes(self) -> int:
        return self.mamba_page.conv_bytes

    @property
    def state_bytes(self) -> int:
        """Conv + ssm: the bytes of a state page that are not padding."""
        return self.mamba_page.state_bytes


def check_compatible(local: RankLayout, remote: RankLayout) -> None:
    """Raise ValueError naming the first field of `compatibility_key` the two sides disagree on."""
    a, b = local.compatibility_key(), remote.compatibility_key()
    for name in sorted(a, key=lambda n: n not in MISMATCH_HINTS):  # the explained ones first
        if a[name] != b[name]:
            raise ValueError(
                f"prefill/decode cache layouts disagree on {name}: "
                f"local {a[name]!r}, remote {b[name]!r}{MISMATCH_HINTS.get(name, '')}"
            )


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


# --- descriptor lists --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DescRun:
    """`count` descriptors `(addr + n*stride, length)` for n in 0..count-1: one sub-region of the
    dual view (one entry per kernel block for K/V, per logical page for x/B/C/ssm)."""

    addr: int
    stride: int
    count: int
    length: int


Pieces = dict[str, tuple[int, int]]  # component -> (offset in the K half or state page, length)


def expand_runs(runs: Iterable[DescRun], device: int) -> list[tuple[int, int, int]]:
    """The `(addr, len, device)` descriptors of `runs`, in order."""
    return [(r.addr + n * r.stride, r.length, device) for r in runs for n in range(r.count)]


def view_runs(layout: RankLayout, pieces: Pieces) -> tuple[DescRun, ...]:
    """The dual view of `layout` (module docstring order) where every page moves, of each
    component, the byte range `pieces[name] = (offset, length)`: K at `A_i + k*kpage + offset`,
    V `kpage/2` further; x/B/C/ssm at `A_i + b*page + offset`."""
    runs = []
    if layout.has_attention:
        off, n = pieces["kv"]
        page = layout.attention_page
        for base in layout.region_bases:
            runs += [
                DescRun(base + half.offset + off, page.kernel_page_bytes, layout.n_phys, n)
                for half in page.slabs
            ]
    if layout.has_mamba:
        for base in layout.region_bases:
            for name in MAMBA_PARTS:
                off, n = pieces[name]
                runs.append(DescRun(base + off, layout.page_bytes, layout.n_log, n))
    return tuple(runs)


def slabs(layout: RankLayout) -> tuple[Slab, ...]:
    """This rank's sharded components: kv (with attention), then x, B, C, ssm (with Mamba)."""
    kv = (layout.kv_slab,) if layout.has_attention else ()
    return kv + (layout.mamba_slabs if layout.has_mamba else ())


def local_runs(layout: RankLayout) -> tuple[DescRun, ...]:
    """The full local dual view as runs (whole K/V halves, whole x/B/C/ssm)."""
    return view_runs(layout, {s.name: (s.offset, s.size) for s in slabs(layout)})


def local_descriptors(layout: RankLayout) -> list[tuple[int, int, int]]:
    """The full local dual view: `2T*N_phys` K/V then `4T*N_log` x/B/C/ssm descriptors."""
    return expand_runs(local_runs(layout), layout.device_id)


def coarse_levels(n_log: int) -> int:
    """The merge levels L of a coarse view of `n_log` pages: `min(MERGE_LEVELS, floor(log2))`."""
    return min(MERGE_LEVELS, n_log.bit_length() - 1)


def coarse_runs(layout: RankLayout) -> tuple[DescRun, ...]:
    """The coarse view of `layout` (module docstring) as runs: per region `(A_i, page, N_log,
    page)` for attention, then per region `(A_i, page, N_log, state_bytes)` for Mamba, then (with
    attention) for k in 1..L per region `(A_i, page, N_log - 2^k + 1, 2^k * page)`."""
    page, n = layout.page_bytes, layout.n_log
    runs: list[DescRun] = []
    if layout.has_attention:
        runs += [DescRun(base, page, n, page) for base in layout.region_bases]
    if layout.has_mamba:
        runs += [DescRun(base, page, n, layout.state_bytes) for base in layout.region_bases]
    if layout.has_attention:
        for k in range(1, coarse_levels(n) + 1):
            w = 1 << k
            runs += [DescRun(base, page, n - w + 1, w * page) for base in layout.region_bases]
    return tuple(runs)


def coarse_view_size(layout: RankLayout) -> int:
    """Entries in the coarse view: `T*N_log` per kind present (attention, Mamba), plus
    `T*(N_log - 2^k + 1)` for each merge level k in 1..L with attention."""
    kinds = int(layout.has_attention) + int(layout.has_mamba)
    t, n = layout.num_regions, layout.n_log
    levels = range(1, coarse_levels(n) + 1) if layout.has_attention else range(0)
    return kinds * t * n + sum(t * (n - (1 << k) + 1) for k in levels)


def view_size(layout: RankLayout) -> int:
    """Entries in the dual view: `2T*N_phys` (with attention) + `4T*N_log` (with Mamba)."""
    fa = 2 * layout.num_regions * layout.n_phys if layout.has_attention else 0
    return fa + (4 * layout.num_regions * layout.n_log if layout.has_mamba else 0)
