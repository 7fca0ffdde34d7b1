"""Causal depthwise conv1d over a chunk (from a carried state) and its one-token update."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from backends.protocol import conv_state_to_ds, register


def _activate(y: jax.Array, activation: str | None) -> jax.Array:
    if activation is None:
        return y
    if activation == "silu":
        return jax.nn.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r} (use 'silu' or None)")


@register("causal_conv1d", "xla")
def causal_conv1d(
    x: jax.Array,
    state: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    lengths: jax.Array,
    activation: str | None,
    state_layout: str = "DS",
) -> tuple[jax.Array, jax.Array]:
    state = conv_state_to_ds(state, state_layout)
    _, t, _ = x.shape
    width = weight.shape[1]
    # u: [B, W-1+T, C], the carried inputs followed by the chunk.
    u = jnp.concatenate([jnp.swapaxes(state, 1, 2).astype(x.dtype), x], axis=1)
    u32 = u.astype(jnp.float32)
    w32 = weight.astype(jnp.float32)
    y = sum(u32[:, k : k + t, :] * w32[:, k] for k in range(width))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = _activate(y, activation).astype(x.dtype)
    # The new state is the W-1 inputs ending at the last valid token of each row.
    idx = lengths[:, None] + jnp.arange(width - 1)[None, :]  # [B, W-1] into u
    new_state = jnp.take_along_axis(u, idx[:, :, None], axis=1)
    return y, conv_state_to_ds(jnp.swapaxes(new_state, 1, 2).astype(state.dtype), state_layout)


@register("causal_conv1d_step", "xla")
def causal_conv1d_step(
    x: jax.Array,
    state: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    activation: str | None,
    state_layout: str = "DS",
) -> tuple[jax.Array, jax.Array]:
    state = conv_state_to_ds(state, state_layout)
    window = jnp.concatenate([state.astype(x.dtype), x[:, :, None]], axis=2)  # [B, C, W]
    y = jnp.sum(window.astype(jnp.float32) * weight.astype(jnp.float32), axis=2)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    new_state = conv_state_to_ds(window[:, :, 1:].astype(state.dtype), state_layout)
    return _activate(y, activation).astype(x.dtype), new_state
