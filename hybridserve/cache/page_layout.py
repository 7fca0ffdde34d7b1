"""Where every byte of a page lies: the one copy of the page byte geometry (per TP rank).

A page of the plan is `page_bytes` on every rank, the same in every region; page p of region i
is at byte `p * page_bytes` of that region's shard on each rank. Within a page (plain ints, one
`Slab(name, offset, unit, held)` per component: `held` are the global heads/groups this rank
holds, `unit` bytes each, `size = unit * len(held)` bytes from `offset`):

Attention (full, sliding window, sconv entries: `AttentionPage`)
  `ratio` kernel pages of `kpage = 2 * half` bytes; kernel page j of page p is kernel block
  `k = p * ratio + j`. Each kernel page is `[K | V]`: K at 0, V at `half`, each half head-major
  (HND) `[heads_local, kb, head_dim]`, so that one rank's share of the heads is one contiguous
  range (`unit = kb * head_dim * dtype_bytes`, one head's kernel block):
    half = heads_local * kb * head_dim * dtype_bytes,   page_bytes = ratio * 2 * half.
  A row is one head's one token (`row_bytes = head_dim * dtype_bytes`); in a region seen as rows,
  the row of (kernel block k, K|V kv, local head h, slot s) is
    r = ((k * 2 + kv) * heads_local + h) * kb + s.

Mamba (`MambaPage`), conv rows `R = W - 1`, conv element `cb` bytes, ssm element `sb`:
  DS: `[x (x_local, R) | B (bc_local, R) | C (bc_local, R) | ssm (heads, head_dim, state) | pad]`
    x   = (0,            heads_local * head_dim * R * cb)   unit: one head
    B   = (x.end,        groups_local * state * R * cb)     unit: one group
    C   = (B.end,        groups_local * state * R * cb)
    ssm = (C.end,        heads_local * head_dim * state * sb)
    pad = (ssm.end = state_bytes, page_bytes - state_bytes)
  SD: `[conv (R, conv_local) | ssm | pad]`: the same x/B/C byte ranges are then plain chunks of
  the conv, not its channels (a transfer may move them verbatim between equal TPs only).
The slabs of a page are contiguous from 0 in the order listed (`slabs`); padding holds no data.

Heads/groups per rank (`held_range`): n over TP t is split when t | n (rank r holds
`[r*n/t, (r+1)*n/t)`), else each rank holds ONE, `r // (t/n)` (duplicated). Standard library only.
"""

from __future__ import annotations

import dataclasses

from hybridserve.cache.plan import CachePlan
from hybridserve.cache.spec import MambaSpec, dtype_bytes, global_kv_heads, replicated_size
from hybridserve.config import ModelConfig


def held_range(total: int, tp: int, rank: int, what: str = "heads") -> range:
    """Global indices of `total` heads/groups that rank `rank` of `tp` holds:
    `[rank*total/tp, (rank+1)*total/tp)` when tp | total, else `{rank // (tp/total)}`."""
    n = replicated_size(total, tp, what)
    start = rank * n if total % tp == 0 else rank // (tp // total)
    return range(start, start + n)


@dataclasses.dataclass(frozen=True)
class Slab:
    """One head/group-sharded component of a page on one rank: `unit` bytes per global index in
    `held`, this rank's units from `offset` (bytes into the kernel page for K/V, into the page
    for x/B/C/ssm)."""

    name: str
    offset: int
    unit: int
    held: range

    @property
    def size(self) -> int:
        """Bytes: `unit * len(held)`."""
        return self.unit * len(self.held)

    @property
    def end(self) -> int:
        """The first byte after the slab: `offset + size`."""
        return self.offset + self.size


@dataclasses.dataclass(frozen=True)
class AttentionPage:
    """One rank's attention page: `ratio` kernel pages `[K | V]`, each half `[heads, kb, H]`."""

    kernel_block: int
    head_dim: int
    dtype_bytes: int
    heads: range  # the global KV heads this rank holds
    ratio: int

    @property
    def heads_local(self) -> int:
        return len(self.heads)

    @property
    def row_bytes(self) -> int:
        """One head's K (or V) of one token: `head_dim * dtype_bytes`."""
        return self.head_dim * self.dtype_bytes

    @property
    def k(self) -> Slab:
        """The K half of a kernel page, at 0."""
        return Slab("K", 0, self.kernel_block * self.row_bytes, self.heads)

    @property
    def v(self) -> Slab:
        """The V half of a kernel page, right after K."""
        k = self.k
        return Slab("V", k.end, k.unit, self.heads)

    @property
    def slabs(self) -> tuple[Slab, Slab]:
        return self.k, self.v

    @property
    def half_bytes(self) -> int:
        return self.k.size

    @property
    def kernel_page_bytes(self) -> int:
        return self.v.end

    @property
    def page_bytes(self) -> int:
        return self.ratio * self.kernel_page_bytes

    @property
    def kernel_page_shape(self) -> tuple[int, int, int, int]:
        """A kernel page as a typed array: `(K|V, heads_local, kb, head_dim)`."""
        return (2, self.heads_local, self.kernel_block, self.head_dim)

    def row(self, kernel_block, kv, head, slot):  # noqa: ANN001, ANN201 (ints or int arrays)
        """The region row of (kernel block, K=0|V=1, local head, slot): works on ints and on
        (broadcasting) integer arrays alike: `((k * 2 + kv) * heads_local + h) * kb + s`."""
        return ((kernel_block * 2 + kv) * self.heads_local + head) * self.kernel_block + slot


@dataclasses.dataclass(frozen=True)
class MambaPage:
    """One rank's Mamba state page: `[x | B | C | ssm | pad]` (DS) or `[conv | ssm | pad]` (SD)."""

    heads: range  # the global Mamba heads this rank holds
    groups: range  # the global B/C groups this rank holds
    head_dim: int
    state_size: int
    conv_rows: int  # W - 1
    conv_dtype_bytes: int
    ssm_dtype_bytes: int
    layout: str  # DS | SD
    page_bytes: int

    @property
    def x_dim(self) -> int:
        """Local conv channels of x: `heads_local * head_dim`."""
        return len(self.heads) * self.head_dim

    @property
    def bc_dim(self) -> int:
        """Local conv channels of B (and of C): `groups_local * state_size`."""
        return len(self.groups) * self.state_size

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (len(self.heads), self.head_dim, self.state_size)

    @property
    def x(self) -> Slab:
        return Slab("x", 0, self.head_dim * self.conv_rows * self.conv_dtype_bytes, self.heads)

    @property
    def b(self) -> Slab:
        unit = self.state_size * self.conv_rows * self.conv_dtype_bytes
        return Slab("B", self.x.end, unit, self.groups)

    @property
    def c(self) -> Slab:
        b = self.b
        return Slab("C", b.end, b.unit, self.groups)

    @property
    def ssm(self) -> Slab:
        unit = self.head_dim * self.state_size * self.ssm_dtype_bytes
        return Slab("ssm", self.c.end, unit, self.heads)

    @property
    def slabs(self) -> tuple[Slab, Slab, Slab, Slab]:
        """x, B, C, ssm: contiguous from 0 (in SD x/B/C are byte chunks of the conv)."""
        return self.x, self.b, self.c, self.ssm

    @property
    def conv_bytes(self) -> int:
        """The conv state `[0, conv_bytes)` (x, B, C in DS; `(rows, conv_local)` in SD)."""
        return self.c.end

    @property
    def state_bytes(self) -> int:
        """Conv + ssm: the bytes of a page that are not padding."""
        return self.ssm.end

    @property
    def padding(self) -> tuple[int, int]:
        """(offset, bytes) of the padding at the page's end."""
        return self.state_bytes, self.page_bytes - self.state_bytes


PageLayout = AttentionPage | MambaPage


def attention_page(
    kv_heads: int, head_dim: int, dtype: str, kernel_block: int, ratio: int, tp: int, rank: int
) -> AttentionPage:
    """The attention page of rank `rank` of `tp` for `kv_heads` global KV heads."""
    heads = held_range(kv_heads, tp, rank, "num_key_value_heads")
    return AttentionPage(kernel_block, head_dim, dtype_bytes(dtype), heads, ratio)


def mamba_page(
    *,
    num_heads: int,
    head_dim: int,
    state_size: int,
    n_groups: int,
    conv_rows: int,
    conv_dtype: str,
    ssm_dtype: str,
    layout: str,
    page_bytes: int,
    tp: int,
    rank: int,
) -> MambaPage:
    """The Mamba state page of rank `rank` of `tp` (global head and group counts)."""
    return MambaPage(
        heads=held_range(num_heads, tp, rank, "mamba num_heads"),
        groups=held_range(n_groups, tp, rank, "mamba n_groups"),
        head_dim=head_dim,
        state_size=state_size,
        conv_rows=conv_rows,
        conv_dtype_bytes=dtype_bytes(conv_dtype),
        ssm_dtype_bytes=dtype_bytes(ssm_dtype),
        layout=layout,
        page_bytes=page_bytes,
    )


def page_layouts(plan: CachePlan, cfg: ModelConfig, rank: int = 0) -> tuple[PageLayout, ...]:
    """The page layout of every group of `plan` (plan order) on rank `rank`; the sizes and
    offsets are the same on every rank, only `held` differs."""
    tp = plan.tensor_parallel_size
    out: list[PageLayout] = []
    for group in plan.groups:
        spec = group.spec
        if isinstance(spec, MambaSpec):
            m = cfg.mamba
            page: PageLayout = mamba_page(
                num_heads=m.num_heads,
                head_dim=m.head_dim,
                state_size=m.state_size,
                n_groups=m.n_groups,
                conv_rows=spec.conv_rows,
                conv_dtype=spec.conv_dtype,
                ssm_dtype=spec.ssm_dtype,
                layout=spec.layout,
                page_bytes=plan.page_size_bytes,
                tp=tp,
                rank=rank,
            )
        else:
            kv_heads = global_kv_heads(spec, cfg, tp)
            page = attention_page(
                kv_heads, spec.head_dim, spec.dtype, plan.kernel_block_size, plan.ratio, tp, rank
            )
        out.append(page)
    return tuple(out)
