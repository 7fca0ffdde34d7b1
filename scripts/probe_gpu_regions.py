#!/usr/bin/env python
"""Which GPU allocations can hold the cache regions: donated in place by XLA AND shareable by
UCX's cuda_ipc transport (what P/D transfers need on one host).

For each allocation mode (each in a fresh process, since the XLA allocator is fixed at start):
  xla-bfc       XLA's default BFC allocator (XLA_PYTHON_CLIENT_PREALLOCATE=false)
  xla-platform  XLA_PYTHON_CLIENT_ALLOCATOR=platform (one cudaMalloc per buffer)
  xla-async     XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async (cudaMallocAsync pools)
  torch-dlpack  torch.empty on the GPU (cudaMalloc via torch's caching allocator), handed to
                JAX with DLPack
it allocates a 64 MiB region `[1, rows, row_bytes]` uint8, runs 20 donated in-place updates
(like the runner's step: `region.at[0, rows].set(...)`), and reports whether the buffer address
stayed fixed, whether the writes are visible through the original buffer (torch), the time of
one update, and, for the two-GPU machine, asks CUDA whether the pointer can be exported for IPC
(cuIpcGetMemHandle through torch's bindings is not public, so it uses ctypes on libcudart).

    python scripts/probe_gpu_regions.py
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time

MODES = {
    "xla-bfc": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "xla-platform": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
    "xla-async": {"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"},
    "torch-dlpack": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
}
ROWS, ROW_BYTES = 4096, 16384


def _ipc_exportable(ptr: int) -> str:
    """cudaIpcGetMemHandle on `ptr` (the runtime finds the allocation's base)."""
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            rt = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        import glob

        pattern = "lib/python3*/site-packages/nvidia/*/lib/libcudart.so*"
        paths = glob.glob(os.path.join(sys.prefix, pattern))
        if not paths:
            return "no libcudart"
        rt = ctypes.CDLL(paths[0])
    handle = (ctypes.c_byte * 64)()
    err = rt.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr))
    return "yes" if err == 0 else f"no (cudaError {err})"


def probe(mode: str) -> dict:
    import jax
    import jax.numpy as jnp

    keep = None
    if mode == "torch-dlpack":
        import torch

        jax.devices()  # JAX first: its start makes the last GPU current, torch must see GPU 0
        torch.cuda.set_device(0)
        keep = torch.full((1, ROWS, ROW_BYTES), 7, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        region = jax.device_put(jnp.from_dlpack(keep), jax.devices()[0])
    else:
        region = jax.device_put(jnp.full((1, ROWS, ROW_BYTES), 7, jnp.uint8), jax.devices()[0])
    region = jax.block_until_ready(region)
    addr0 = region.unsafe_buffer_pointer()

    def update(region, rows, value):
        return region.at[0, rows].set(value)

    step = jax.jit(update, donate_argnums=0)
    rows = jnp.arange(0, ROWS, 97)
    out = {"mode": mode, "addr_fixed": True, "error": None}
    try:
        value = jnp.full((rows.size, ROW_BYTES), 1, jnp.uint8)
        region = jax.block_until_ready(step(region, rows, value))
        start = time.perf_counter()
        for i in range(20):
            value = jnp.full((rows.size, ROW_BYTES), i + 1, jnp.uint8)
            region = step(region, rows, value)
            if region.unsafe_buffer_pointer() != addr0:
                out["addr_fixed"] = False
        jax.block_until_ready(region)
        out["update_us"] = (time.perf_counter() - start) / 20 * 1e6
    except Exception as err:  # e.g. donation refused
        out["error"] = f"{type(err).__name__}: {str(err)[:200]}"
    out["addr"] = hex(region.unsafe_buffer_pointer())
    if keep is not None:
        import torch

        torch.cuda.synchronize()
        out["writes_visible_in_torch"] = bool(int(keep[0, 0, 0]) == 20)
    out["ipc_exportable"] = _ipc_exportable(region.unsafe_buffer_pointer())
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(probe(sys.argv[2])))
        return
    rows = []
    for mode, env in MODES.items():
        proc = subprocess.run(
            [sys.executable, __file__, "--child", mode],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        rows.append(json.loads(lines[-1]) if lines else {"mode": mode, "error": proc.stderr[-400:]})
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
