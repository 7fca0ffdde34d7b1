"""How many cache pages fit: the pool sized from device memory, as vLLM sizes its KV cache.

With neither `CacheConfig.num_pages` nor `CacheConfig.memory_bytes` (`--kv-cache-memory`)
given, a device that reports its memory (a GPU) gets a pool of
  pool bytes = utilization * bytes_limit - bytes in use (weights, small buffers)
               - the activation peak of the largest step program
per rank (the least over the mesh's devices), where `utilization` is
`CacheConfig.gpu_memory_utilization` (0.9) of the allocator's limit (JAX's, set by
XLA_PYTHON_CLIENT_MEM_FRACTION) and the activation peak is the compiled program's temporary
and output bytes (its memory analysis: the program is compiled, not run). Devices that report
no memory (the CPU) get `HOST_POOL_BYTES`. Either way `cache.plan.num_pages_for` caps the pool
at what `2 * max_num_seqs` requests of `max_model_len` tokens can use.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from hybridserve.runner.programs import StepRunner, dummy_batch, shapes

HOST_POOL_BYTES = 256 * 2**20  # per rank, where the device reports no memory (the CPU)


def device_budget(mesh: Mesh, utilization: float) -> int | None:
    """`utilization * bytes_limit - bytes_in_use`, the least over the mesh's devices; None
    when a device reports no memory statistics (the CPU)."""
    budgets = []
    for device in mesh.devices.flat:
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        budgets.append(int(utilization * stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return min(budgets)


def activation_bytes(runner: StepRunner, max_num_seqs: int, max_tokens: int) -> int:
    """Temporary and output bytes (less the outputs aliased to donated inputs: the regions)
    of the largest step programs `execute` can run for steps of at most `max_tokens` prompt
    tokens: the one with the most token slots and the prefill program with the most rows (each
    row carries a Mamba state through the scan), from their compiled memory analyses
    (compiled, not run)."""
    todo = shapes(max_num_seqs, max_tokens, runner.pack_limits)
    prefill = [s for s in todo if s[2]] or todo  # the packed (chained) programs
    largest = {max(todo, key=lambda s: s[0] * s[1]), max(prefill, key=lambda s: (s[0], s[1]))}
    peak = 0
    for rows, tokens, packed in largest:
        analysis = runner.compile_step(dummy_batch(runner, rows, tokens, packed)).memory_analysis()
        if analysis is None:
            continue
        outputs = max(0, analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
        peak = max(peak, int(analysis.temp_size_in_bytes + outputs))
    return peak


@dataclasses.dataclass(frozen=True)
class PoolSizing:
    """What a pool sized by memory was sized from, per rank: the bytes the engine may use
    beyond the weights (`utilization * limit - in use`, regions not counted) and the largest
    step program's activations."""

    budget_bytes: int
    activation_bytes: int


def pool_budget(budget: int, activations: int, regions_now: int) -> int:
    """Bytes per rank the pool may take: the device budget measured with `regions_now` bytes
    of (provisional) regions allocated, less the activation peak."""
    return max(0, budget + regions_now - activations)
