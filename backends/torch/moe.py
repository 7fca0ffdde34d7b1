"""Grouped (ragged) matmul for mixture-of-experts layers: torch's grouped matmul kernel (a loop of
per-expert matmuls where it is missing), and the NVFP4 experts dequantised in torch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from backends import nvfp4
from backends.protocol import register
from backends.torch.bridge import call

# (device type, dtype) pairs where torch's `_grouped_mm` raised: they take the loop instead
_NO_GROUPED_MM: set[tuple[str, torch.dtype]] = set()


def _loop(xt: torch.Tensor, wt: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """One matmul per expert; reads the group ends on the host (a device sync on a GPU)."""
    out = torch.zeros(xt.shape[0], wt.shape[2], dtype=torch.float32, device=xt.device)
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = xt[start:end].float() @ wt[e].float()
        start = max(start, end)
    return out


DENSE_ROWS_X_EXPERTS = 1 << 14  # up to this many rows x experts, GPUs take `_dense`


def _dense(xt: torch.Tensor, wt: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Every expert's matmul over every row, each row keeping its own expert's: E times the
    FLOPs of the loop, but no host sync (so CUDA graph capture can take it). For decode-sized
    batches, where the loop's per-expert launches and its sync cost more than the FLOPs."""
    rows = torch.arange(xt.shape[0], device=xt.device)
    expert = torch.searchsorted(ends, rows, right=True)  # E for rows past the last group
    x = xt.float()
    out = torch.zeros(xt.shape[0], wt.shape[2], dtype=torch.float32, device=xt.device)
    for e in range(wt.shape[0]):
        out = torch.where((expert == e)[:, None], x @ wt[e].float(), out)
    return out


def _grouped(xt: torch.Tensor, wt: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """torch's grouped matmul (`_grouped_mm`: one kernel, group ends read on the device, so no
    sync); rows past the last group, which it leaves undefined, are zeroed. Where this device
    and dtype lack it: on a GPU, `_dense` for small batches (no sync), else the loop."""
    key = (xt.device.type, xt.dtype)
    if key not in _NO_GROUPED_MM and hasattr(torch, "_grouped_mm"):
        try:
            out = torch._grouped_mm(xt, wt.to(xt.dtype), offs=ends.int())
        except (RuntimeError, NotImplementedError):
            _NO_GROUPED_MM.add(key)
        else:
            rows = torch.arange(xt.shape[0], device=xt.device)
            return torch.where((rows < ends[-1])[:, None], out, 0)
    if xt.is_cuda and xt.shape[0] * wt.shape[0] <= DENSE_ROWS_X_EXPERTS:
        return _dense(xt, wt, ends)
    return _loop(xt, wt, ends)


@register("grouped_matmul", "torch")
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    out_dtype = jnp.result_type(x.dtype, w.dtype)

    def fn(xt, wt, st):
        # rows past sum(group_sizes) stay zero, as in ragged_dot
        ends = torch.cumsum(st.long(), 0).clamp(max=xt.shape[0])
        return _grouped(xt, wt, ends)

    return call(fn, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), out_dtype), x, w, group_sizes)


def _e2m1(code: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit e2m1 codes, from the magnitude table (a device array)."""
    mag = table[(code & 7).long()]
    return torch.where(code >= 8, -mag, mag)


@register("nvfp4_grouped_matmul", "torch")
def nvfp4_grouped_matmul(
    x: jax.Array,
    codes: jax.Array,
    scales: jax.Array,
    tensor_scale: jax.Array,
    group_sizes: jax.Array,
) -> jax.Array:
    # The scales cross as their e4m3 bit patterns (numpy has no float8) and are read back in
    # torch's float8_e4m3fn.
    scale_bits = jax.lax.bitcast_convert_type(scales, jnp.uint8)

    def fn(xt, ct, st, tt, table):
        e, half, n = ct.shape
        planes = ct.reshape(e, half // 16, 1, 16, n)
        code = torch.cat([planes & 15, planes >> 4], dim=2).reshape(e, 2 * half, n)
        scale = st.view(torch.float8_e4m3fn).float().repeat_interleave(nvfp4.GROUP, dim=1)
        return (_e2m1(code, table) * scale * tt[:, None, None]).to(xt.dtype)

    e, half, n = codes.shape
    spec = jax.ShapeDtypeStruct((e, 2 * half, n), x.dtype)
    table = jnp.asarray(nvfp4.MAGNITUDES, jnp.float32)  # a device array: no host copy
    w = call(fn, spec, x, codes, scale_bits, tensor_scale, table)
    return grouped_matmul(x, w, group_sizes).astype(x.dtype)
