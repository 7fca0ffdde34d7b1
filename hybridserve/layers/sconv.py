"""The short convolution (sconv) of the Inkling blocks, with its state in the paged cache.

For an input u [B, T, C] (C channels; a causal depthwise conv of W taps):
  `y[t, c] = sum_{j < W} w[c, j] * u[t - (W - 1) + j, c]  (+ b[c])`,  u before position 0 = 0.
The state is the last W - 1 inputs. It is kept per token, as a virtual sliding-window layer
(`cache.spec.SconvSpec`): each entry holds E = 2 * kv_heads * head_dim channels of every token in
pages laid out like attention pages (channels [0, E/2) as "K", [E/2, E) as "V"), so a step
gathers the W - 1 inputs before its first token through the block table, convolves, and writes
its own inputs at their positions. Nothing needs rolling back when later tokens are discarded:
the inputs at a position are rewritten when that position is computed again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from backends.protocol import Ops
from hybridserve.cache.view import read_kv, write_kv
from hybridserve.config import SconvConfig
from hybridserve.layers.linear import param
from hybridserve.layers.step_input import StepInput


class ShortConv(nnx.Module):
    """One sconv site over `channels` channels (see the module docstring)."""

    def __init__(
        self,
        channels: int,
        cfg: SconvConfig,
        ops: Ops,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs | None,
    ) -> None:
        self.channels, self.width = channels, cfg.width
        self.weight = param(rngs, (channels, cfg.width), (None, None), dtype, fan_in=cfg.width)
        self.bias = param(None, (channels,), (None,), dtype, init="zeros") if cfg.bias else None
        self.ops = ops

    def __call__(
        self,
        u: jax.Array,
        regions: list[jax.Array],
        inputs: StepInput,
        entries: tuple[int, ...],
    ) -> jax.Array:
        """u [B, T, C] -> y [B, T, C]; reads and replaces the regions of `entries`."""
        layout, tp = inputs.layout, inputs.layout.tp
        accs = [layout.layers[e] for e in entries]
        u = u.astype(accs[0].dtype).astype(u.dtype)  # as later steps will read it back
        b, t, c = u.shape
        rows = self.width - 1
        # Write the new inputs first, then read the W-1 earlier ones (positions before the
        # chunk: the write does not touch them). In this order the read depends on the write
        # and XLA updates the donated region in place; a read of the old region followed by an
        # independent write makes it copy the whole buffer instead (every step, and bytes a
        # P/D transfer writes into the region meanwhile are lost when the copy is written back).
        acc0 = accs[0]
        width = 2 * acc0.kv_heads * acc0.head_dim
        padded = jnp.pad(u, ((0, 0), (0, 0), (0, len(accs) * width - c)))
        halves = padded.reshape(b, t, len(accs), 2, acc0.kv_heads, acc0.head_dim)
        for i, acc in enumerate(accs):
            regions[acc.region] = write_kv(
                regions[acc.region],
                acc,
                tp,
                inputs.tables[acc.group],
                inputs.positions,
                inputs.valid,
                halves[:, :, i, 0].astype(acc.dtype),
                halves[:, :, i, 1].astype(acc.dtype),
            )
        prev = inputs.positions[:, :1] - rows + jnp.arange(rows)[None, :]  # [B, W-1]
        prev_valid = (prev >= 0) & (inputs.lengths[:, None] > 0)
        state = []
        for acc in accs:
            k, v = read_kv(regions[acc.region], acc, tp, inputs.tables[acc.group], prev, prev_valid)
            state += [k.reshape(b, rows, -1), v.reshape(b, rows, -1)]
        state = jnp.concatenate(state, axis=-1)[..., :c].astype(u.dtype)  # [B, W-1, C]
        weight = self.weight[...]
        bias = None if self.bias is None else self.bias[...]
        y, _ = self.ops.causal_conv1d(u, state, weight, bias, inputs.lengths, None, "SD")
        return y
