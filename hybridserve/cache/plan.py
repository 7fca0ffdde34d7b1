"""Grouping of the per-layer specs, the one physical pool they share (the HMA), and its size.

Grouping (`plan_cache`): layers with equal specs form buckets; `group_size` is the smallest bucket
(or the largest, when the largest is < 1.5x the smallest); each bucket splits into
`cdiv(n, group_size)` groups by stride, the last one padded. Region i (one physical buffer) holds
layer i of every group, and ONE block pool hands out page ids that are valid in every region.

Page unification: the attention block becomes the smallest multiple of the kernel block whose
page is at least the Mamba state, and Mamba pages are padded to exactly that page:
  `block = A * cdiv(mamba_state_bytes, A * attn_bytes_per_token)`,  `ratio = block / A`.
Logical (scheduler) block ids expand to kernel blocks `L * ratio + j` for attention; Mamba ids
stay logical.

Pages per request (`pages_per_request`, the one rule the coordinator and pool sizing share):
per group `spec.max_pages(n, chunk, block)`: full attention `cdiv(n, block)`, a sliding window
`min(cdiv(n, block), cdiv(window + chunk, block) + 1)`, Mamba 1. Standard library only.
"""

from __future__ import annotations

import dataclasses

from hybridserve.cache.spec import MambaSpec, Spec, canonical_dtype, layer_specs
from hybridserve.config import CacheConfig, ConfigError, ModelConfig


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """Layers sharing one spec and one block table per request. `layers[i]` lives in region i
    (None: a padding slot)."""

    spec: Spec
    layers: tuple[int | None, ...]

    @property
    def kind(self) -> str:
        """ "full_attention", "sliding_window" (sconv too) or "mamba": the spec's kind."""
        return self.spec.kind


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
    token_specs = [g.spec for g in groups if g.spec.holds_tokens]
    mamba_bytes = max(
        (g.spec.state_bytes for g in groups if isinstance(g.spec, MambaSpec)), default=0
    )
    a = kernel_block_size
    per_token = max((s.bytes_per_token for s in token_specs), default=0)
    if per_token:
        blocks = max(-(-mamba_bytes // (a * per_token)), -(-(block_size or a) // a), 1)
        logical = a * blocks
        page = logical * per_token
    else:  # a pure state-space model: one state per page (in whole words), no tokens
        logical, page = block_size or a, -(-mamba_bytes // 4) * 4
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


def pages_per_request(plan: CachePlan, num_tokens: int, chunk: int) -> tuple[int, ...]:
    """Per group, the most pages one request of up to `num_tokens` tokens holds at once when
    computed in steps of at most `chunk` tokens (module docstring)."""
    return tuple(g.spec.max_pages(num_tokens, chunk, plan.block_size) for g in plan.groups)


def make_plan(cfg: ModelConfig, cache: CacheConfig, tp: int, dtype: str) -> CachePlan:
    """The cache plan for `cfg` at TP `tp`; "auto" cache dtypes follow the model dtype, except
    a KV cache the checkpoint quantised (its FP8 KV scales): e4m3 then."""
    kv = canonical_dtype(
        (cfg.kv_cache_dtype or dtype) if cache.kv_dtype == "auto" else cache.kv_dtype
    )
    conv = dtype if cache.conv_dtype == "auto" else cache.conv_dtype
    specs = layer_specs(cfg, tp, kv, conv, cache.ssm_dtype, cache.conv_layout)
    return plan_cache(specs, tp, cache.kernel_block_size, cache.block_size)


def num_pages_for(
    plan: CachePlan,
    cache: CacheConfig,
    max_num_seqs: int,
    max_model_len: int,
    max_prefill_chunk: int,
    available_bytes: int,
) -> int:
    """Pages in the pool: `cache.num_pages` if set; otherwise as many as fit in
    `cache.memory_bytes` per rank, or in `available_bytes` without it (`runner.memory`), but
    no more than `2 * max_num_seqs * per_request + 1`, with `per_request =
    sum(pages_per_request(plan, max_model_len, max_prefill_chunk))` (the rest would only hold
    prefix-cache entries, and a smaller pool keeps every region small)."""
    if cache.num_pages is not None:
        return cache.num_pages
    per_request = sum(pages_per_request(plan, max_model_len, max_prefill_chunk))
    budget = cache.memory_bytes if cache.memory_bytes is not None else available_bytes
    fit = budget // (plan.page_size_bytes * plan.num_regions)
    return max(2, min(fit, 2 * max_num_seqs * per_request + 1))
