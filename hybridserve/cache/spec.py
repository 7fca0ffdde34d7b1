"""Per-layer cache specs: what one layer keeps per page, in bytes per TP rank (the HMA's leaves).

Every cached layer declares a spec with its page size in bytes *per TP rank*:
  FullAttention:  a page holds `block_size` tokens of K and V:
                  `block_size * kv_heads_local * 2 * head_dim * dtype_bytes`
  SlidingWindow:  the same page, plus a window (blocks that leave it are freed)
  Sconv:          a virtual sliding-window layer over a short conv's inputs (window W-1), its
                  pages shaped like attention pages (`SconvSpec`)
  Mamba:          a page holds one whole state snapshot `[conv | ssm]` (conv in the DS or SD
                  layout), padded to the plan's page.
Where each byte of a page lies is `cache.page_layout`; grouping and the shared pool are
`cache.plan`. Each spec says its group kind (`kind`) and the most pages one request holds
(`max_pages`), so callers need not branch on its type. Standard library only.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import ClassVar

from hybridserve.config import AttentionConfig, ConfigError, MambaConfig, ModelConfig

DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
CONV_LAYOUT_ENV = "HYBRIDSERVE_SSM_CONV_LAYOUT"


DTYPE_ALIASES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def canonical_dtype(dtype: str) -> str:
    """The array dtype name of a cache dtype (validated; "fp8" and "fp8_e4m3" mean
    float8_e4m3fn, "fp8_e5m2" float8_e5m2: vLLM's spellings)."""
    dtype_bytes(dtype)
    return DTYPE_ALIASES.get(dtype, dtype)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a cache dtype (ConfigError for an unknown name)."""
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

    kind: ClassVar[str] = "full_attention"
    holds_tokens: ClassVar[bool] = True  # pages hold tokens (block tables of kernel blocks)

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

    def max_pages(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """The most pages one request of up to `num_tokens` tokens holds at once, computed in
        steps of at most `chunk` tokens, with `block_size` tokens a page: `cdiv(n, block)`."""
        return -(-num_tokens // block_size)


@dataclasses.dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Attention over the last `sliding_window` tokens: older blocks can be freed."""

    kind: ClassVar[str] = "sliding_window"

    sliding_window: int = 4096

    def max_pages(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """A step over `[s, s + chunk)` holds the pages of `[s - window, s + chunk)`:
        `min(cdiv(n, block), cdiv(window + chunk, block) + 1)`."""
        full = -(-num_tokens // block_size)
        return min(full, -(-(self.sliding_window + chunk) // block_size) + 1)


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

    kind: ClassVar[str] = "mamba"
    holds_tokens: ClassVar[bool] = False  # one state page per request (tables of page ids)

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

    def max_pages(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """One running state page, whatever the length."""
        return 1


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
    """One rank's spec of an attention layer (a window: sliding)."""
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
    """One rank's spec of a Mamba2 layer (heads split over TP, groups split or duplicated)."""
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
    then the MTP heads' (`mtp_entries`), then the sconv entries (`sconv_entries`)."""
    specs: list[Spec | None] = []
    for index, kind in enumerate(cfg.layer_types):
        if kind in ("attention", "sliding_attention"):
            specs.append(attention_spec(cfg.attention, tp, kv_dtype, cfg.window(index)))
        elif kind == "mamba":
            specs.append(mamba_spec(cfg.mamba, tp, conv_dtype, ssm_dtype, layout))
        else:
            specs.append(None)
    if cfg.mtp is not None:
        specs += [attention_spec(cfg.attention, tp, kv_dtype)] * cfg.mtp.num_heads
    if cfg.sconv is not None:
        heads = sconv_heads(cfg, tp) // tp
        sconv = SconvSpec(
            heads, cfg.attention.head_dim, conv_dtype, sliding_window=cfg.sconv.width - 1
        )
        specs += [sconv] * _num_sconv_entries(cfg, tp)
    return specs


def global_kv_heads(spec: FullAttentionSpec, cfg: ModelConfig, tp: int) -> int:
    """The global head count a token-holding spec's pages are split over: the model's KV heads,
    or an sconv entry's `sconv_heads` (never duplicated: `num_kv_heads * tp`)."""
    if isinstance(spec, SconvSpec):
        return spec.num_kv_heads * tp
    return cfg.attention.num_kv_heads


def mtp_entries(cfg: ModelConfig) -> tuple[int, ...]:
    """The cache entries of the MTP heads' attention (one each), right after the model layers
    (before the sconv entries, whose number depends on TP)."""
    if cfg.mtp is None:
        return ()
    return tuple(range(cfg.num_layers, cfg.num_layers + cfg.mtp.num_heads))


def sconv_heads(cfg: ModelConfig, tp: int) -> int:
    """Global "heads" of `head_dim` channels in one sconv entry's K (and V) half at TP `tp`:
    `max(kv_heads, tp)`. Each rank holds `sconv_heads / tp` of them, never a duplicate, so the
    ranks hold disjoint channels: with tp <= kv_heads the entries are laid out as the attention
    pages (the same at every such TP, so P/D across them moves them like KV); with tp >
    kv_heads an entry holds more channels than at TP 1 (one head per rank) and only engines of
    the same TP share the layout (`disagg.descriptors.RankLayout.sconv_heads`)."""
    kv = cfg.attention.num_kv_heads
    replicated_size(kv, tp, "num_key_value_heads")  # one divides the other
    return max(kv, tp)


SCONV_SITES = ("kv", "out", "ffn")


def _num_sconv_entries(cfg: ModelConfig, tp: int) -> int:
    return sum(len(e) for site in sconv_entries(cfg, tp) for e in site.values())


def sconv_entries(cfg: ModelConfig, tp: int = 1) -> list[dict[str, tuple[int, ...]]]:
    """Per model layer, the cache entries of its sconv states at TP `tp`, by site: "kv" (the
    keys then the values), "out" (the attention output) and "ffn" (the ffn output; absent
    without an ffn), each `cdiv(channels, E)` entries of E = 2 * sconv_heads * head_dim
    channels (`sconv_heads`; "kv" has 2 * kv_heads * head_dim channels, "out" and "ffn" the
    hidden size). Entry ids continue after the model layers and the MTP heads' entries, layer
    by layer, site by site. Empty without sconv."""
    if cfg.sconv is None:
        return [{} for _ in cfg.layer_types]
    a = cfg.attention
    width = 2 * sconv_heads(cfg, tp) * a.head_dim
    channels = {"kv": 2 * a.num_kv_heads * a.head_dim, "out": cfg.hidden_size}
    channels["ffn"] = cfg.hidden_size if cfg.ffn else 0
    out, nxt = [], cfg.num_layers + (cfg.mtp.num_heads if cfg.mtp is not None else 0)
    for _ in cfg.layer_types:
        sites = {}
        for site in SCONV_SITES:
            n = -(-channels[site] // width)
            if n:
                sites[site] = tuple(range(nxt, nxt + n))
                nxt += n
        out.append(sites)
    return out
