"""Per-layer cache specs, their grouping, and the one physical pool they share (the HMA).

Every cached layer declares a spec with its page size in bytes *per TP rank*:
  FullAttention:  a page holds `block_size` tokens of K and V:
                  `block_size * kv_heads_local * 2 * head_dim * dtype_bytes`
  SlidingWindow:  the same page, plus a window (blocks that leave it are freed)
  Sconv:          a virtual sliding-window layer over a short conv's inputs (window W-1), its
                  pages shaped like attention pages (`SconvSpec`)
  Mamba:          a page holds one whole state snapshot `[conv | ssm]`, conv in the DS layout
                  `(conv_dim_local, W-1)` (x rows, then B, then C) or SD `(W-1, conv_dim_local)`.

Grouping (`plan_cache`): layers with equal specs form buckets; `group_size` is the smallest bucket
(or the largest, when the largest is < 1.5x the smallest); each bucket splits into
`cdiv(n, group_size)` groups by stride, the last one padded. Region i (one physical buffer) holds
layer i of every group, and ONE block pool hands out page ids that are valid in every region.

Page unification: the attention block becomes the smallest multiple of the kernel block whose
page is at least the Mamba state, and Mamba pages are padded to exactly that page:
  `block = A * cdiv(mamba_state_bytes, A * attn_bytes_per_token)`,  `ratio = block / A`.
Logical (scheduler) block ids expand to kernel blocks `L * ratio + j` for attention; Mamba ids
stay logical. Standard library only.
"""

from __future__ import annotations

import dataclasses
import math
import os

from hybridserve.config import AttentionConfig, ConfigError, MambaConfig, ModelConfig

DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}
CONV_LAYOUT_ENV = "HYBRIDSERVE_SSM_CONV_LAYOUT"


DTYPE_ALIASES = {"fp8": "float8_e4m3fn"}


def canonical_dtype(dtype: str) -> str:
    """The array dtype name of a cache dtype (validated; "fp8" means float8_e4m3fn)."""
    dtype_bytes(dtype)
    return DTYPE_ALIASES.get(dtype, dtype)


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(f"unknown cache dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}") from None


def replicated_size(total: int, tp: int, what: str) -> int:
    """Per-rank count of `total` heads/groups at TP `tp`: split when divisible; when tp is a
    multiple of total, each rank holds one (heads duplicated tp/total times)."""
    if total % tp == 0:
        return total // tp
    if tp % total == 0:
        return 1
    raise ConfigError(
        f"{what} = {total} is not compatible with tensor_parallel_size {tp} "
        "(one must divide the other)"
    )


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec:
    """K and V of `block_size` tokens per page (per rank)."""

    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int = 16

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * 2 * self.head_dim * dtype_bytes(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.bytes_per_token


@dataclasses.dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Attention over the last `sliding_window` tokens: older blocks can be freed."""

    sliding_window: int = 4096


@dataclasses.dataclass(frozen=True)
class SconvSpec(SlidingWindowSpec):
    """A short conv's raw inputs as a virtual sliding-window layer (window `width - 1` tokens).

    One entry holds `2 * num_kv_heads * head_dim` channels per token, laid out exactly like an
    attention page (the first half as "K", the second as "V"), so its pages have the attention
    layers' size and share their pool; a conv over more channels takes several entries
    (`sconv_entries`)."""

    @property
    def channels(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class MambaSpec:
    """One Mamba2 state per page (per rank): conv `[x | B | C]` then ssm, then padding."""

    x_dim: int  # local conv channels of x (heads_local * head_dim)
    bc_dim: int  # local conv channels of B (and of C): groups_local * state_size
    conv_rows: int  # W - 1
    conv_dtype: str
    ssm_shape: tuple[int, int, int]  # (heads_local, head_dim, state_size)
    ssm_dtype: str
    layout: str = "DS"
    groups_replicated: bool = False
    page_size_padded: int | None = None

    @property
    def conv_dim(self) -> int:
        return self.x_dim + 2 * self.bc_dim

    @property
    def conv_shape(self) -> tuple[int, int]:
        if self.layout == "DS":
            return (self.conv_dim, self.conv_rows)
        return (self.conv_rows, self.conv_dim)

    @property
    def x_bytes(self) -> int:
        return self.x_dim * self.conv_rows * dtype_bytes(self.conv_dtype)

    @property
    def bc_bytes(self) -> int:
        return self.bc_dim * self.conv_rows * dtype_bytes(self.conv_dtype)

    @property
    def conv_bytes(self) -> int:
        return self.x_bytes + 2 * self.bc_bytes

    @property
    def ssm_bytes(self) -> int:
        return math.prod(self.ssm_shape) * dtype_bytes(self.ssm_dtype)

    @property
    def state_bytes(self) -> int:
        return self.conv_bytes + self.ssm_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.state_bytes


Spec = FullAttentionSpec | SlidingWindowSpec | SconvSpec | MambaSpec


def conv_layout(explicit: str | None = None) -> str:
    """The conv state layout: `explicit`, else $HYBRIDSERVE_SSM_CONV_LAYOUT, else DS."""
    layout = (explicit or os.environ.get(CONV_LAYOUT_ENV) or "DS").upper()
    if layout not in ("DS", "SD"):
        raise ConfigError(f"{CONV_LAYOUT_ENV} must be DS or SD, got {layout!r}")
    return layout


def attention_spec(
    cfg: AttentionConfig, tp: int, dtype: str, window: int | None = None
) -> FullAttentionSpec:
    heads = replicated_size(cfg.num_kv_heads, tp, "num_key_value_heads")
    if window is not None:
        return SlidingWindowSpec(heads, cfg.head_dim, dtype, sliding_window=window)
    return FullAttentionSpec(heads, cfg.head_dim, dtype)


def mamba_spec(
    cfg: MambaConfig,
    tp: int,
    conv_dtype: str,
    ssm_dtype: str = "float32",
    layout: str | None = None,
) -> MambaSpec:
    if cfg.num_heads % tp:
        raise ConfigError(
            f"mamba num_heads = {cfg.num_heads} is not divisible by tensor_parallel_size {tp}"
        )
    groups = replicated_size(cfg.n_groups, tp, "mamba n_groups")
    return MambaSpec(
        x_dim=cfg.num_heads // tp * cfg.head_dim,
        bc_dim=groups * cfg.state_size,
        conv_rows=cfg.conv_kernel - 1,
        conv_dtype=conv_dtype,
        ssm_shape=(cfg.num_heads // tp, cfg.head_dim, cfg.state_size),
        ssm_dtype=ssm_dtype,
        layout=conv_layout(layout),
        groups_replicated=cfg.n_groups % tp != 0,
    )


def layer_specs(
    cfg: ModelConfig,
    tp: int,
    kv_dtype: str,
    conv_dtype: str,
    ssm_dtype: str = "float32",
    layout: str | None = None,
) -> list[Spec | None]:
    """The spec of every cache entry: one per layer (None for layers without cache: mlp, moe),
    then the sconv entries (`sconv_entries`), then the MTP heads' (`mtp_entries`)."""
    specs: list[Spec | None] = []
    for index, kind in enumerate(cfg.layer_types):
        if kind in ("attention", "sliding_attention"):
            specs.append(attention_spec(cfg.attention, tp, kv_dtype, cfg.window(index)))
        elif kind == "mamba":
            specs.append(mamba_spec(cfg.mamba, tp, conv_dtype, ssm_dtype, layout))
        else:
            specs.append(None)
    if cfg.sconv is not None:
        a = attention_spec(cfg.attention, tp, conv_dtype)
        sconv = SconvSpec(
            a.num_kv_heads, a.head_dim, conv_dtype, sliding_window=cfg.sconv.width - 1
        )
        specs += [sconv] * _num_sconv_entries(cfg)
    if cfg.mtp is not None:
        specs += [attention_spec(cfg.attention, tp, kv_dtype)] * cfg.mtp.num_heads
    return specs


def mtp_entries(cfg: ModelConfig) -> tuple[int, ...]:
    """The cache entries of the MTP heads' attention (one each), after the sconv entries."""
    if cfg.mtp is None:
        return ()
    first = cfg.num_layers + _num_sconv_entries(cfg)
    return tuple(range(first, first + cfg.mtp.num_heads))


SCONV_SITES = ("kv", "out", "ffn")


def _num_sconv_entries(cfg: ModelConfig) -> int:
    return sum(len(e) for site in sconv_entries(cfg) for e in site.values())


def sconv_entries(cfg: ModelConfig) -> list[dict[str, tuple[int, ...]]]:
    """Per model layer, the cache entries of its sconv states, by site: "kv" (the keys then the
    values: one entry), "out" (the attention output) and "ffn" (the ffn output; absent without
    an ffn), each `cdiv(hidden, E)` entries of E = 2 * kv_heads * head_dim channels. Entry ids
    continue after the model layers (entry i < num_layers is layer i's own cache), layer by
    layer, site by site. Empty without sconv."""
    if cfg.sconv is None:
        return [{} for _ in cfg.layer_types]
    width = 2 * cfg.attention.num_kv_heads * cfg.attention.head_dim
    per_hidden = -(-cfg.hidden_size // width)
    sizes = {"kv": 1, "out": per_hidden, "ffn": per_hidden if cfg.ffn else 0}
    out, nxt = [], cfg.num_layers
    for _ in cfg.layer_types:
        sites = {}
        for site in SCONV_SITES:
            if sizes[site]:
                sites[site] = tuple(range(nxt, nxt + sizes[site]))
                nxt += sizes[site]
        out.append(sites)
    return out


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """Layers sharing one spec and one block table per request. `layers[i]` lives in region i
    (None: a padding slot)."""

    spec: Spec
    layers: tuple[int | None, ...]

    @property
    def kind(self) -> str:
        if isinstance(self.spec, MambaSpec):
            return "mamba"
        if isinstance(self.spec, SconvSpec | SlidingWindowSpec):
            return "sliding_window"
        return "full_attention"


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """Groups over shared regions, with unified page size and block sizes."""

    groups: tuple[CacheGroup, ...]
    num_regions: int
    page_size_bytes: int  # every page, per rank
    block_size: int  # logical tokens per attention page
    kernel_block_size: int
    tensor_parallel_size: int

    @property
    def ratio(self) -> int:
        """Kernel (physical) attention blocks per logical block."""
        return self.block_size // self.kernel_block_size

    def region_of(self, layer: int) -> int:
        for group in self.groups:
            if layer in group.layers:
                return group.layers.index(layer)
        raise KeyError(f"layer {layer} has no cache")

    def group_of(self, layer: int) -> int:
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g
        raise KeyError(f"layer {layer} has no cache")


def group_layers(specs: list[Spec | None]) -> list[CacheGroup]:
    """Bucket layers by equal spec, then split the buckets into groups of one size."""
    buckets: dict[Spec, list[int]] = {}
    for layer, spec in enumerate(specs):
        if spec is not None:
            buckets.setdefault(spec, []).append(layer)
    if not buckets:
        return []
    sizes = [len(v) for v in buckets.values()]
    smallest, largest = min(sizes), max(sizes)
    group_size = largest if largest < 1.5 * smallest else smallest
    groups = []
    for spec, layers in buckets.items():
        n = -(-len(layers) // group_size)
        for g in range(n):
            members = layers[g::n]
            groups.append(CacheGroup(spec, tuple(members) + (None,) * (group_size - len(members))))
    return groups


def plan_cache(
    specs: list[Spec | None],
    tp: int = 1,
    kernel_block_size: int = 16,
    block_size: int | None = None,
) -> CachePlan:
    """Group the specs and unify their page sizes (see the module docstring).

    `block_size` (tokens) is a lower bound asked by the user; it is raised to fit a Mamba state.
    """
    groups = group_layers(specs)
    if not groups:
        raise ConfigError("the model has no cached layers")
    token_specs = [g.spec for g in groups if not isinstance(g.spec, MambaSpec)]
    mamba_bytes = max(
        (g.spec.state_bytes for g in groups if isinstance(g.spec, MambaSpec)), default=0
    )
    a = kernel_block_size
    per_token = max((s.bytes_per_token for s in token_specs), default=0)
    if per_token:
        blocks = max(-(-mamba_bytes // (a * per_token)), -(-(block_size or a) // a), 1)
        logical = a * blocks
        page = logical * per_token
    else:  # a pure state-space model: one state per page, no tokens
        logical, page = block_size or a, mamba_bytes
    unified = []
    for g in groups:
        spec = g.spec
        if isinstance(spec, MambaSpec):
            spec = dataclasses.replace(spec, page_size_padded=page)
        else:
            spec = dataclasses.replace(spec, block_size=logical)
            if spec.page_size_bytes != page:
                raise ConfigError(
                    f"attention specs with different bytes per token cannot share "
                    f"pages: {spec.page_size_bytes} != {page}"
                )
        unified.append(CacheGroup(spec, g.layers))
    return CachePlan(tuple(unified), len(groups[0].layers), page, logical, a, tp)
