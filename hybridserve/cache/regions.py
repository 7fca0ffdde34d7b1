"""Allocation of the cache regions: by XLA, or (GPU, disaggregated serving) by CUDA's
`cudaMalloc` through torch, handed to JAX with DLPack.

Why two allocators: UCX moves GPU memory between processes with its `cuda_ipc` transport only
when the memory can be exported with `cudaIpcGetMemHandle`. Buffers from every XLA GPU allocator
(BFC, "platform", "cuda_async") refuse that export (measured on H200, jax 0.11: cudaError 1), so
UCX falls back to staging through host memory over TCP (~0.5 GB/s). Memory from `cudaMalloc`
exports fine (cuda_ipc: ~230 GB/s across two H200s). JAX donates the imported buffers to every
step like its own, so the addresses NIXL registered stay valid (`tests` check them per step).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from hybridserve.cache.plan import CachePlan
from hybridserve.cache.spec import FullAttentionSpec, MambaSpec, canonical_dtype
from hybridserve.cache.view import AttentionAccess, CacheLayout, MambaAccess
from hybridserve.config import ModelConfig


def allocate_regions(
    shape: tuple[int, int, int], count: int, sharding: NamedSharding, shareable: bool = False
) -> tuple[list[jax.Array], list[Any]]:
    """`count` zeroed uint8 regions of `shape`, sharded by `sharding` (axis 0 over "tp").

    `shareable` on GPU: every shard is a torch tensor from cudaMalloc on its device, imported
    with DLPack (zero copy); the torch tensors are returned too and must outlive the regions.
    On CPU (or without `shareable`) XLA allocates and the second list is empty.
    Raises RuntimeError when `shareable` is asked on GPU without torch with CUDA.
    """
    devices = list(sharding.addressable_devices)
    if not shareable or devices[0].platform != "gpu":
        return [jnp.zeros(shape, jnp.uint8, device=sharding) for _ in range(count)], []
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
                tensor = torch.zeros(local, dtype=torch.uint8, device="cuda")
                torch.cuda.synchronize()
                shard = jax.device_put(jnp.from_dlpack(tensor), device)
            if shard.unsafe_buffer_pointer() != tensor.data_ptr():
                raise RuntimeError(f"DLPack import of a region shard on {device} copied it")
            shards.append(shard)
            owners.append(tensor)
        regions.append(jax.make_array_from_single_device_arrays(shape, sharding, shards))
    return regions, owners


def shard_buffers(regions: list[jax.Array]) -> list[list[tuple[int, int, int]]]:
    """Per TP rank, the (address, bytes, device id) of every region's shard of that rank."""
    tp = regions[0].shape[0]
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(tp)]
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
    """Per-entry access facts (region, group, local shapes, dtypes) from the cache plan: one
    entry per layer, then the sconv entries (`cache.spec.sconv_entries`)."""
    entries = 1 + max(e for g in plan.groups for e in g.layers if e is not None)
    access: list[AttentionAccess | MambaAccess | None] = [None] * max(entries, cfg.num_layers)
    for g, group in enumerate(plan.groups):
        spec = group.spec
        for region, layer in enumerate(group.layers):
            if layer is None:
                continue
            if isinstance(spec, MambaSpec):
                m = cfg.mamba
                access[layer] = MambaAccess(
                    region,
                    g,
                    spec.x_dim,
                    spec.bc_dim,
                    m.n_groups,
                    m.state_size,
                    spec.conv_rows,
                    canonical_dtype(spec.conv_dtype),
                    spec.ssm_shape,
                    spec.ssm_dtype,
                    spec.layout,
                )
            elif isinstance(spec, FullAttentionSpec):
                a = cfg.attention
                access[layer] = AttentionAccess(
                    region,
                    g,
                    a.num_kv_heads,
                    spec.num_kv_heads,
                    spec.head_dim,
                    canonical_dtype(spec.dtype),
                    plan.kernel_block_size,
                    getattr(spec, "sliding_window", None),
                )
            else:
                raise NotImplementedError(f"no runner support for {type(spec).__name__} yet")
    attention = [a for a in access if isinstance(a, AttentionAccess)]
    row = plan.page_size_bytes
    if attention:
        a = attention[0]
        row = a.head_dim * jnp.dtype(a.dtype).itemsize  # one head, one token
    return CacheLayout(
        tuple(access), plan.tensor_parallel_size, plan.ratio, plan.page_size_bytes, row
    )
