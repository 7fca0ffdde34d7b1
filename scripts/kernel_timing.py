"""Timing and reporting shared by `bench_kernels.py` and its peers (`kernel_peers.py`): the
median of timed loops for JAX and for torch, the relative error of a result against ours, and
the run's rows (printed as they come, kept in `ROWS` for the JSON)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

ROWS: list[dict] = []


def timed(fn: Callable, *args, iters: int = 20) -> float:
    """Median seconds per call of a jitted fn (warmup first; loops of `iters` calls)."""
    jax.block_until_ready(fn(*args))
    loops = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        loops.append((time.perf_counter() - start) / iters)
    return statistics.median(loops)


def rel_err(got, ref) -> float:
    """Relative L2 error of `got` against `ref` (JAX or torch arrays), in float64."""
    got, ref = (np.asarray(_host(a), np.float64) for a in (got, ref))
    if not np.isfinite(got).all():
        return float("nan")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def _host(a) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor
        return a.detach().float().cpu().numpy()
    return np.asarray(jnp.asarray(a, jnp.float32))


def timed_torch(fn: Callable[[], object], iters: int) -> float:
    """Median seconds per call of a torch callable (warmup first; CUDA synchronised)."""
    import torch

    fn()
    torch.cuda.synchronize()
    loops = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - start) / iters)
    return statistics.median(loops)


def row(section: str, variant: str, seconds: float, **extra) -> None:
    ROWS.append({"section": section, "variant": variant, "ms": seconds * 1e3, **extra})
    cols = " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()
    )
    print(f"{section:<18} {variant:<34} {seconds * 1e3:9.3f} ms  {cols}", flush=True)
