"""The JAX <-> PyTorch bridge of the `torch` backend: one place where arrays cross over.

`call(fn, out_specs, *arrays)` runs `fn` (torch tensors in, torch tensors out) on JAX arrays:

* Inside `jax.jit` (the engine jits its whole step, so this is the normal path) the call is a
  `jax.experimental.buffer_callback`: XLA hands the callback its own device buffers, which
  torch wraps through DLPack without a copy, and the results are copied once into XLA's output
  buffers. On a GPU the callback runs while XLA's stream is being filled: the torch kernels are
  queued on that stream (`ExecutionContext.stream`, as a `torch.cuda.ExternalStream`), so they
  run in order with the step's other kernels, no host copy and no synchronisation. On the CPU
  the buffers are host memory and the callback computes them there.
* Outside jit (concrete, single-device arrays) the arrays are exchanged through DLPack:
  `torch.from_dlpack(jax_array)` and `jax.dlpack.from_dlpack(tensor)`, zero copy, on whatever
  device the array lives (CUDA tensors when JAX is on a GPU).

Lifecycle of one call inside a jitted step:
  1. Tracing: `buffer_callback` records the result shapes and dtypes (`out_specs`).
  2. Each execution: XLA calls `_Callback.__call__` with the output buffers, then the inputs
     (absent inputs, None, are not passed to XLA and come back as None).
  3. On a GPU it makes XLA's stream torch's current stream for the duration of the call.
  4. It wraps every buffer as a tensor (`torch.from_dlpack`), runs `fn` under `no_grad`, checks
     the results' count and shapes, and copies each into its output buffer (casting to the
     output dtype).
  5. It returns; nothing it made outlives the call (torch's temporaries go back to torch's
     caching allocator, which on a GPU holds memory beside XLA's pool: lower
     `XLA_PYTHON_CLIENT_MEM_FRACTION` to leave it room).

Input buffers are XLA's and may be shared: the ops must not modify their inputs in place.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from jax.experimental.buffer_callback import buffer_callback

_TORCH_DTYPES = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.float16): torch.float16,
    np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.bool_): torch.bool,
}


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a numpy / JAX dtype."""
    try:
        return _TORCH_DTYPES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"no torch dtype for {dtype}") from None


def _is_concrete(a: jax.Array) -> bool:
    return (
        isinstance(a, jax.Array)
        and not isinstance(a, jax.core.Tracer)
        and len(a.sharding.device_set) == 1
    )


class _Callback:
    """The buffer callback of one `call` inside jit (steps 2-5 of the module docstring);
    `name` (the torch function's) is for diagnostics (`scripts/check_torch_backend.py`)."""

    def __init__(
        self, run: Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]], name: str = ""
    ) -> None:
        self.run = run
        self.name = name

    def __call__(self, ctx, outs, *inputs) -> None:
        on_gpu = any(b.__dlpack_device__()[0] == _DL_CUDA for b in (*inputs, *outs))
        # XLA's stream becomes torch's before any buffer is wrapped (DLPack is told that stream)
        scope = torch.cuda.stream(_external_stream(int(ctx.stream))) if on_gpu else _NO_SCOPE
        with scope:
            tensors = [torch.from_dlpack(b) for b in inputs]
            targets = [torch.from_dlpack(b) for b in outs]
            for target, result in zip(targets, self.run(tensors), strict=True):
                target.copy_(result.to(target.dtype))


_DL_CUDA = 2  # DLPack's device type of CUDA memory
_NO_SCOPE = contextlib.nullcontext()


def _graphs() -> bool:
    """`HYBRIDSERVE_TORCH_GRAPHS=1` (experimental, read at trace time): let XLA trace the torch
    calls into its command buffers (CUDA graphs), so the Python of a callback runs once and its
    kernels are replayed, instead of running on every step. It needs every torch op to be
    capturable (no host syncs, no new device allocations while capturing)."""
    return os.environ.get("HYBRIDSERVE_TORCH_GRAPHS", "0") == "1"


@functools.cache
def _external_stream(handle: int) -> torch.cuda.ExternalStream:
    """torch's handle on one of XLA's streams (a few per device, made once each)."""
    return torch.cuda.ExternalStream(handle)


def call(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    out_specs: jax.ShapeDtypeStruct | Sequence[jax.ShapeDtypeStruct],
    *arrays: jax.Array | None,
):
    """Run the torch function `fn` on JAX `arrays` (None passes through as None); the results
    are cast to `out_specs`' dtypes and come back as JAX arrays of those shapes.

    `fn` takes torch tensors positionally (on the arrays' device) and returns one tensor or a
    tuple matching `out_specs`. Static arguments should be bound with a closure or partial.
    """
    single = isinstance(out_specs, jax.ShapeDtypeStruct)
    specs = (out_specs,) if single else tuple(out_specs)
    present = [i for i, a in enumerate(arrays) if a is not None]

    def run(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        full: list[torch.Tensor | None] = [None] * len(arrays)
        for i, t in zip(present, tensors, strict=True):
            full[i] = t
        with torch.no_grad():
            out = fn(*full)
        out = (out,) if single else tuple(out)
        if len(out) != len(specs):
            raise ValueError(f"{fn.__name__} returned {len(out)} results, expected {len(specs)}")
        for t, spec in zip(out, specs, strict=True):
            if tuple(t.shape) != tuple(spec.shape):
                raise ValueError(f"{fn.__name__}: result shape {tuple(t.shape)} != {spec.shape}")
        return out

    operands = [jnp.asarray(arrays[i]) for i in present]
    if all(_is_concrete(a) for a in operands):
        outs = run([torch.from_dlpack(a) for a in operands])
        results = tuple(
            jax.dlpack.from_dlpack(t.to(torch_dtype(s.dtype)).contiguous())
            for t, s in zip(outs, specs, strict=True)
        )
    else:
        callback = _Callback(run, getattr(fn, "__qualname__", ""))
        results = buffer_callback(
            callback, specs, vmap_method="sequential", command_buffer_compatible=_graphs()
        )(*operands)
    return results[0] if single else tuple(results)
