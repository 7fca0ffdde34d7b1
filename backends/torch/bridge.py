"""The JAX <-> PyTorch bridge of the `torch` backend: one place where arrays cross over.

`call(fn, out_specs, *arrays)` runs `fn` (torch tensors in, torch tensors out) on JAX arrays:

* Inside `jax.jit` (the engine jits its whole step, so this is the normal path) the arrays are
  tracers and torch cannot see them. The call becomes a `jax.pure_callback` whose result shapes
  and dtypes are given as `jax.ShapeDtypeStruct`s (`vmap_method="sequential"`). On CPU the
  callback receives numpy views of XLA's host buffers; `torch.from_numpy` wraps them without a
  copy, and `Tensor.numpy()` hands the results back without a copy (XLA copies them once into
  its output buffers).
* Outside jit (concrete, single-device arrays) the arrays are exchanged through DLPack:
  `torch.from_dlpack(jax_array)` and `jax.dlpack.from_dlpack(tensor)`, zero copy, on whatever
  device the array lives (CUDA tensors when JAX is on a GPU).

bfloat16: numpy has no bfloat16 of its own; JAX hands the callback `ml_dtypes.bfloat16` arrays,
which `torch.from_numpy` rejects. They cross as their raw 16-bit patterns instead
(`ndarray.view(np.int16)` -> `Tensor.view(torch.bfloat16)` and back), which is still zero copy
and bit-exact; no trip through float32 is needed. The ops themselves upcast to float32 wherever
the protocol asks for float32 arithmetic.

On a GPU the callback path is NOT zero copy: `pure_callback` moves every operand from device to
host and every result back (and serialises the step on the host), so the torch backend inside a
jitted step is a correctness / CPU backend, not a fast GPU one. The zero-copy GPU path in the
installed JAX is `jax.experimental.buffer_callback.buffer_callback`, which passes the callback
the device buffers themselves (DLPack-capable, with the CUDA stream in its `ExecutionContext`),
so torch could run its CUDA kernels on them in place on XLA's stream; it is not wired up here.

Input arrays are never written (JAX arrays are immutable, and the callback's buffers are
read-only), so the ops must not modify their inputs in place.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

# The callback's operand buffers are read-only; torch warns once when it wraps them. The ops
# never write into their inputs.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

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


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """A host array as a torch tensor, zero copy (bfloat16 through its bit pattern)."""
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def to_numpy(t: torch.Tensor, dtype) -> np.ndarray:
    """A torch tensor as a host array of `dtype` (cast first if needed), zero copy when it can."""
    dtype = np.dtype(dtype)
    t = t.detach().to(device="cpu", dtype=torch_dtype(dtype)).contiguous()
    if dtype == ml_dtypes.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _is_concrete(a: jax.Array) -> bool:
    return (
        isinstance(a, jax.Array)
        and not isinstance(a, jax.core.Tracer)
        and len(a.sharding.device_set) == 1
    )


def call(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    out_specs: jax.ShapeDtypeStruct | Sequence[jax.ShapeDtypeStruct],
    *arrays: jax.Array | None,
):
    """Run the torch function `fn` on JAX `arrays` (None passes through as None); the results
    are cast to `out_specs`' dtypes and come back as JAX arrays of those shapes.

    `fn` takes torch tensors positionally (on the CPU inside jit) and returns one tensor or a
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

        def host(*host_arrays: np.ndarray) -> tuple[np.ndarray, ...]:
            outs = run([from_numpy(a) for a in host_arrays])
            return tuple(to_numpy(t, s.dtype) for t, s in zip(outs, specs, strict=True))

        results = jax.pure_callback(host, specs, *operands, vmap_method="sequential")
    return results[0] if single else tuple(results)
