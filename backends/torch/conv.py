"""Causal depthwise conv1d in torch (`F.conv1d` with groups=C) and its one-token update."""

from __future__ import annotations

import jax
import torch
import torch.nn.functional as F

from backends.protocol import conv_state_to_ds, register
from backends.torch.bridge import call


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation == "silu":
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r} (use 'silu' or None)")


@register("causal_conv1d", "torch")
def causal_conv1d(
    x: jax.Array,
    state: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    lengths: jax.Array,
    activation: str | None,
    state_layout: str = "DS",
) -> tuple[jax.Array, jax.Array]:
    _activate(torch.zeros(()), activation)  # reject an unknown activation at trace time
    state = conv_state_to_ds(state, state_layout)
    width = weight.shape[1]

    def fn(xt, st, wt, bt, lt):
        bsz, _, ch = xt.shape
        # u: [B, W-1+T, C], the carried inputs followed by the chunk.
        u = torch.cat([st.transpose(1, 2).to(xt.dtype), xt], dim=1)
        y = F.conv1d(
            u.float().transpose(1, 2),
            wt.float()[:, None, :],
            None if bt is None else bt.float(),
            groups=ch,
        )  # [B, C, T]: y[t] = sum_k w[k] u[t + k]
        y = _activate(y, activation).transpose(1, 2).to(xt.dtype)
        # The new state is the W-1 inputs ending at the last valid token of each row.
        idx = (
            lt.long()[:, None] + torch.arange(width - 1, device=xt.device)[None, :]
        )  # [B, W-1] into u
        new_state = torch.gather(u, 1, idx[:, :, None].expand(bsz, width - 1, ch))
        return y, new_state.transpose(1, 2).to(st.dtype)

    specs = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype))
    y, new_state = call(fn, specs, x, state, weight, bias, lengths)
    return y, conv_state_to_ds(new_state, state_layout)


@register("causal_conv1d_step", "torch")
def causal_conv1d_step(
    x: jax.Array,
    state: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    activation: str | None,
    state_layout: str = "DS",
) -> tuple[jax.Array, jax.Array]:
    _activate(torch.zeros(()), activation)
    state = conv_state_to_ds(state, state_layout)

    def fn(xt, st, wt, bt):
        window = torch.cat([st.to(xt.dtype), xt[:, :, None]], dim=2)  # [B, C, W]
        y = (window.float() * wt.float()).sum(2)
        if bt is not None:
            y = y + bt.float()
        return _activate(y, activation).to(xt.dtype), window[:, :, 1:].to(st.dtype)

    specs = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype))
    y, new_state = call(fn, specs, x, state, weight, bias)
    return y, conv_state_to_ds(new_state, state_layout)
