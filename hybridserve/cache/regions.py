"""The cache regions: their allocation, the runner's device layout over them (`build_layout`),
and the `CacheRegions` handle a KV connector is given (plan, layouts, arrays, addresses).

Allocation is by XLA, or (GPU, disaggregated serving) by CUDA's `cudaMalloc` through torch,
handed to JAX with DLPack.

Why two allocators: UCX moves GPU memory between processes with its `cuda_ipc` transport only
when the memory can be exported with `cudaIpcGetMemHandle`. Buffers from every XLA GPU allocator
(BFC, "platform", "cuda_async") refuse that export (measured on H200, jax 0.11: cudaError 1), so
UCX falls back to staging through host memory over TCP (~0.5 GB/s). Memory from `cudaMalloc`
exports fine (cuda_ipc: ~230 GB/s across two H200s). JAX donates the imported buffers to every
step like its own, so the addresses NIXL registered stay valid (`tests` check them per step).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from hybridserve.cache.page_layout import AttentionPage, MambaPage, page_layouts
from hybridserve.cache.plan import CachePlan
from hybridserve.cache.spec import MambaSpec, canonical_dtype, global_kv_heads
from hybridserve.cache.view import WORD, WORD_BYTES, AttentionAccess, CacheLayout, MambaAccess
from hybridserve.config import ConfigError, ModelConfig


def allocate_regions(
    shape: tuple[int, int, int], count: int, sharding: NamedSharding, shareable: bool = False
) -> tuple[list[jax.Array], list[Any]]:
    """`count` zeroed regions of words (`cache.view.WORD`) of `shape`, sharded by `sharding`
    (axis 0 over "tp").

    `shareable` on GPU: every shard is a torch tensor from cudaMalloc on its device, imported
    with DLPack (zero copy); the torch tensors are returned too and must outlive the regions.
    On CPU (or without `shareable`) XLA allocates and the second list is empty.
    Raises RuntimeError when `shareable` is asked on GPU without torch with CUDA.
    """
    devices = list(sharding.addressable_devices)
    if not shareable or devices[0].platform != "gpu":
        return [jnp.zeros(shape, WORD, device=sharding) for _ in range(count)], []
    try:
        import torch
    except ImportError as err:
        raise RuntimeError(
            "IPC-shareable GPU regions need torch with CUDA (pip install torch)"
        ) from err
    if not torch.cuda.is_available():
        raise RuntimeError("IPC-shareable GPU regions need torch with CUDA; torch sees no GPU")
    index_of = sharding.devices_indices_map(shape)
    regions, owners = [], []
    for _ in range(count):
        shards = []
        for device in devices:
            rows = index_of[device][0]
            local = (len(range(*rows.indices(shape[0]))), shape[1], shape[2])
            with torch.cuda.device(device.local_hardware_id):
                tensor = torch.zeros(local, dtype=torch.int32, device="cuda")  # WORD
                torch.cuda.synchronize()
                shard = jax.device_put(jnp.from_dlpack(tensor), device)
            if shard.unsafe_buffer_pointer() != tensor.data_ptr():
                raise RuntimeError(f"DLPack import of a region shard on {device} copied it")
            shards.append(shard)
            owners.append(tensor)
        regions.append(jax.make_array_from_single_device_arrays(shape, sharding, shards))
    return regions, owners


RegionBuffer = tuple[int, int, int]  # (device address, bytes, device id; 0 on CPU)


def shard_buffers(regions: list[jax.Array]) -> list[list[RegionBuffer]]:
    """Per TP rank, the (address, bytes, device id) of every region's shard of that rank."""
    tp = regions[0].shape[0]
    out: list[list[RegionBuffer]] = [[] for _ in range(tp)]
    for region in regions:
        for shard in region.addressable_shards:
            rank = shard.index[0].start or 0
            out[rank].append(
                (
                    shard.data.unsafe_buffer_pointer(),
                    shard.data.nbytes,
                    shard.device.id if shard.device.platform != "cpu" else 0,
                )
            )
    return out


def build_layout(cfg: ModelConfig, plan: CachePlan) -> CacheLayout:
    """Per-entry access facts (region, group, page layout, dtypes) from the cache plan: one
    entry per layer, then the MTP heads' and the sconv entries (`cache.spec.layer_specs`).
    The row is one attention head's one token (`AttentionPage.row_bytes`), or the whole page
    without attention."""
    entries = 1 + max(e for g in plan.groups for e in g.layers if e is not None)
    access: list[AttentionAccess | MambaAccess | None] = [None] * max(entries, cfg.num_layers)
    row = plan.page_size_bytes
    for g, (group, page) in enumerate(zip(plan.groups, page_layouts(plan, cfg), strict=True)):
        spec = group.spec
        if isinstance(page, AttentionPage):
            row = page.row_bytes
        for region, layer in enumerate(group.layers):
            if layer is None:
                continue
            if isinstance(page, MambaPage) and isinstance(spec, MambaSpec):
                conv = canonical_dtype(spec.conv_dtype)
                access[layer] = MambaAccess(
                    region, g, cfg.mamba.n_groups, page, conv, spec.ssm_dtype
                )
            elif isinstance(page, AttentionPage):
                window = getattr(spec, "sliding_window", None)
                dtype = canonical_dtype(spec.dtype)
                heads = global_kv_heads(spec, cfg, plan.tensor_parallel_size)
                access[layer] = AttentionAccess(region, g, heads, page, dtype, window)
    if row % WORD_BYTES or plan.page_size_bytes % row:
        raise ConfigError(
            f"cache rows of {row} bytes cannot be stored in {WORD_BYTES}-byte words (a K or V "
            "row is head_dim times the cache dtype's size: it must be a multiple of 4 bytes)"
        )
    return CacheLayout(
        tuple(access), plan.tensor_parallel_size, plan.ratio, plan.page_size_bytes, row
    )


@dataclasses.dataclass(frozen=True)
class CacheRegions:
    """The allocated cache as a KV connector sees it, to register its memory: the plan, the
    model config (global head/group counts), the device layout, the pool size, the region
    arrays (as they were when the handle was taken: every step donates them, the addresses
    stay) and, per TP rank, every region's shard buffer `(address, bytes, device id)` in region
    order. Region i of rank r starts at `buffers[r][i][0]`; page p at `+ p * page_bytes`."""

    plan: CachePlan
    cfg: ModelConfig
    layout: CacheLayout
    num_pages: int
    arrays: tuple[jax.Array, ...]
    buffers: tuple[tuple[RegionBuffer, ...], ...]

    @classmethod
    def of(
        cls, plan: CachePlan, cfg: ModelConfig, layout: CacheLayout, num_pages: int, arrays: list
    ) -> CacheRegions:
        """The handle of live `arrays` (their shard addresses are read now)."""
        buffers = tuple(tuple(rank) for rank in shard_buffers(arrays))
        return cls(plan, cfg, layout, num_pages, tuple(arrays), buffers)

    @property
    def tp(self) -> int:
        return len(self.buffers)

    @property
    def platform(self) -> str:
        """ "gpu" or "cpu": where the regions live."""
        return next(iter(self.arrays[0].devices())).platform

    def bases(self, rank: int) -> tuple[int, ...]:
        """Rank `rank`'s region base addresses, region order."""
        return tuple(b[0] for b in self.buffers[rank])

    def device_id(self, rank: int) -> int:
        return self.buffers[rank][0][2]

    def page_layouts(self, rank: int) -> tuple[AttentionPage | MambaPage, ...]:
        """Per group (plan order), rank `rank`'s page layout (`cache.page_layout`)."""
        return page_layouts(self.plan, self.cfg, rank)
