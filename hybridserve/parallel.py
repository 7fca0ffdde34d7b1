"""Device mesh and the mapping of logical parameter axes onto it (tensor parallelism).

Parameters carry logical axis names (see `hybridserve.layers`). With tensor parallelism of size
tp, the axes in `TP_AXES` are split over the mesh axis "tp" when their size divides by tp, and
replicated otherwise (e.g. 2 KV heads at TP=4, or a single ssm group); the computation is written
for the global arrays, so XLA inserts the collectives and the result does not change.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# "ranks": the rank axis of a kernel merged per TP rank (`layers.merged`), always split
TP_AXES = frozenset(
    {"heads", "kv_heads", "ssm_heads", "ssm_groups", "mlp", "expert_mlp", "vocab", "ranks"}
)


def make_mesh(tensor_parallel_size: int = 1) -> Mesh:
    """A 1-D mesh ("tp",) over the first `tensor_parallel_size` devices."""
    devices = jax.devices()
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} but only {len(devices)} devices are "
            "visible (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    return Mesh(np.array(devices[:tensor_parallel_size]), ("tp",))


def partition_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], tp: int) -> PartitionSpec:
    """Shard the first TP axis that divides evenly; replicate everything else."""
    spec: list[str | None] = [None] * len(shape)
    if tp > 1:
        for i, (axis, size) in enumerate(zip(axes, shape, strict=True)):
            if axis in TP_AXES and size % tp == 0:
                spec[i] = "tp"
                break
    return PartitionSpec(*spec)


def state_shardings(state: nnx.State, mesh: Mesh) -> dict:
    """A pure dict (like `nnx.to_pure_dict(state)`) of NamedShardings for every parameter."""
    tp = mesh.shape["tp"]
    flat = {}
    for path, var in nnx.to_flat_state(state):
        axes = var.get_metadata().get("axes") or (None,) * len(var.shape)
        flat[path] = NamedSharding(mesh, partition_spec(tuple(axes), tuple(var.shape), tp))
    return _unflatten(flat)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _unflatten(flat: dict[tuple, object]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out
