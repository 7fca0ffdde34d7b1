"""Grouped (ragged) matmul for mixture-of-experts layers, one torch matmul per expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from backends.protocol import register
from backends.torch.bridge import call


@register("grouped_matmul", "torch")
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    out_dtype = jnp.result_type(x.dtype, w.dtype)

    def fn(xt, wt, st):
        out = torch.zeros(xt.shape[0], wt.shape[2], dtype=torch.float32, device=xt.device)
        ends = torch.cumsum(st.long(), 0).tolist()
        start = 0
        for e, end in enumerate(ends):
            end = min(end, xt.shape[0])  # rows past sum(group_sizes) stay zero, as in ragged_dot
            if end > start:
                out[start:end] = xt[start:end].float() @ wt[e].float()
            start = max(start, end)
        return out

    return call(fn, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), out_dtype), x, w, group_sizes)
