"""The roofline bound of a serving workload: output tokens/s one GPU cannot beat.

For requests of I prompt tokens and O output tokens served C at a time by one GPU:
    prefill_s = 2 * P * I / M         (P: parameters one token reads, M: matmul FLOP/s)
    step_s(C) = bytes(C rows at context I + O/2) / BW      (`decode_cost`, BW: copy bytes/s)
    bound     = C * O / (C * prefill_s + O * step_s(C))    output tokens/s
P counts the weights a one-token decode step reads (`decode_cost.weight_bytes` at batch 1:
one embedding row, top_k / E of the routed experts, no MTP heads or encoders) over their
element size; attention's own FLOPs are left out (3% of a 1024-token prefill of the 9B
shape). A deployment of G GPUs serving C requests is bounded by G times the bound of one GPU
serving C / G.

M and BW are measured on the benchmark's device in a subprocess (`ceilings`: a bf16 matmul of
8192^3 and a 4 GiB copy, back to back; on a CPU smaller), so that the benchmark's own process
never holds the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from backends.protocol import load_ops
from hybridserve.cache.plan import make_plan
from hybridserve.config import CacheConfig
from hybridserve.weights.loader import abstract_model, read_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_state_step import best_time, copy_bandwidth  # noqa: E402
from decode_cost import decode_bytes, weight_bytes  # noqa: E402


def ceilings(env: dict[str, str] | None = None) -> dict:
    """{"matmul_flop_s", "copy_bytes_s", "device"} measured in a subprocess (`env`: variables
    set over this process's environment, e.g. the GPU it may use): this script run as a
    program."""
    out = subprocess.run(
        [sys.executable, __file__],
        capture_output=True,
        text=True,
        env=os.environ | (env or {}),
    )
    if out.returncode != 0:
        raise RuntimeError(f"measuring the ceilings failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure() -> dict:
    """The ceilings on this process's device: a bf16 matmul of 8192^3 and a copy of 4 GiB,
    back to back (float32 1024^3 and 64 MiB on a CPU)."""
    gpu = jax.default_backend() == "gpu"
    n, mib, dtype = (8192, 4096, jnp.bfloat16) if gpu else (1024, 64, jnp.float32)
    a, b = (jax.random.normal(k, (n, n), dtype) for k in jax.random.split(jax.random.key(0)))
    matmul = jax.jit(jnp.matmul)
    return {
        "matmul_flop_s": 2 * n**3 / best_time(lambda: matmul(a, b), 10, repeats=3),
        "copy_bytes_s": copy_bandwidth(mib * 2**20, 20),
        "device": jax.devices()[0].device_kind,
    }


class WorkloadBound:
    """The bound of the module docstring for one model (abstract: no weights are made)."""

    def __init__(self, model_dir: str, dtype: str) -> None:
        cfg = read_config(model_dir)
        self.cfg = cfg
        _, self.params = nnx.split(abstract_model(cfg, load_ops("xla"), jnp.dtype(dtype)))
        self.plan = make_plan(cfg, CacheConfig(), 1, jnp.dtype(dtype).name)
        self.params_per_token = weight_bytes(cfg, self.params, 1) / jnp.dtype(dtype).itemsize

    def tokens_per_s(
        self, ceil: dict, input_len: int, output_len: int, concurrency: int, gpus: int = 1
    ) -> float:
        """Output tokens/s that `gpus` GPUs cannot beat on this workload."""
        c = max(1, int(np.ceil(concurrency / gpus)))
        prefill_s = 2 * self.params_per_token * input_len / ceil["matmul_flop_s"]
        context = input_len + output_len // 2
        step_s = decode_bytes(self.cfg, self.plan, self.params, c, context).total
        step_s /= ceil["copy_bytes_s"]
        return gpus * c * output_len / (c * prefill_s + output_len * step_s)


if __name__ == "__main__":
    print(json.dumps(measure()))
