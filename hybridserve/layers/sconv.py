"""The short convolution (sconv) of the Inkling blocks, with its state in the paged cache.

For an input u [B, T, C] (C channels; a causal depthwise conv of W taps):
  `y[t, c] = sum_{j < W} w[c, j] * u[t - (W - 1) + j, c]  (+ b[c])`,  u before position 0 = 0.
The state is the last W - 1 inputs. It is kept per token, as a virtual sliding-window layer
(`cache.spec.SconvSpec`): each entry holds E = 2 * S * head_dim channels of every token
(S = `cache.spec.sconv_heads`) in pages laid out like attention pages, channel
`c = e * E + half * S * head_dim + s * head_dim + j` of entry e as "head" s of its K (half 0)
or V (half 1) half. A step writes its own inputs at their positions, gathers the W - 1 inputs
before its first token through the block table, and convolves. Nothing needs rolling back when
later tokens are discarded: the inputs at a position are rewritten when that position is
computed again.

Tensor parallelism (sconv-aware TP): rank r holds heads `[r * S/tp, (r+1) * S/tp)` of every
entry, no head twice (S >= tp), and computes the conv of exactly those channels in its own
shard of the regions (`shard_map`): each rank computes and stores 1/tp of the channels. The
input arrives replicated (after the output projection's all-reduce, which XLA may turn into a
reduce-scatter, as only each rank's slice is read) and the output is all-gathered over the
channels (`layers.sconv_tp` is the same idea as one standalone op).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from backends.protocol import Ops
from hybridserve.cache.view import AttentionAccess, read_kv, write_kv
from hybridserve.config import SconvConfig
from hybridserve.layers.linear import param
from hybridserve.layers.step_input import StepInput

REGION = P("tp", None, None)


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
        heads, hd, c = accs[0].kv_heads, accs[0].head_dim, u.shape[-1]
        u = u.astype(accs[0].dtype).astype(u.dtype)  # as later steps will read it back

        def by_head(x: jax.Array, axis: int) -> jax.Array:  # channels -> [n, 2, S, hd]
            pad = [(0, 0)] * x.ndim
            pad[axis] = (0, len(accs) * 2 * heads * hd - c)
            x = jnp.pad(x, pad)
            return x.reshape(*x.shape[:axis], len(accs), 2, heads, hd, *x.shape[axis + 1 :])

        weight = by_head(self.weight[...], 0)
        bias = jnp.zeros((c,), weight.dtype) if self.bias is None else self.bias[...]
        rids = sorted({a.region for a in accs})
        tables = tuple(inputs.tables[a.group] for a in accs)
        where = (tables, inputs.positions, inputs.valid, inputs.lengths)
        args = (by_head(u, 2), weight, by_head(bias, 0), tuple(regions[r] for r in rids), where)
        if tp == 1 or layout.mesh is None:
            y, out = self._local(*args, accs, rids, tp)
        else:  # each rank its own heads of every entry, in its own shard of the regions
            local = [dataclasses.replace(a, kv_heads=heads // tp) for a in accs]
            run = jax.shard_map(
                lambda *a: self._local(*a, local, rids, 1),
                mesh=layout.mesh,
                in_specs=(
                    P(None, None, None, None, "tp", None),
                    P(None, None, "tp", None, None),
                    P(None, None, "tp", None),
                    (REGION,) * len(rids),
                    P(),
                ),
                out_specs=(P(None, None, None, None, "tp", None), (REGION,) * len(rids)),
                check_vma=False,
            )
            y, out = run(*args)
        for r, region in zip(rids, out, strict=True):
            regions[r] = region
        return y.reshape(*y.shape[:2], -1)[..., :c]

    def _local(
        self,
        u: jax.Array,
        weight: jax.Array,
        bias: jax.Array,
        regions: tuple[jax.Array, ...],
        where: tuple[tuple[jax.Array, ...], jax.Array, jax.Array, jax.Array],
        accs: list[AttentionAccess],
        rids: list[int],
        tp: int,
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The conv of the heads in `u` [B, T, n, 2, S', hd] (S' heads: all of them, or one
        rank's inside `shard_map` with `tp` = 1), its state in `regions` (those of `rids`)."""
        tables, positions, valid, lengths = where
        regions = list(regions)
        b, t = u.shape[:2]
        rows = self.width - 1
        # Write the new inputs first, then read the W-1 earlier ones (positions before the
        # chunk: the write does not touch them). In this order the read depends on the write
        # and XLA updates the donated region in place; a read of the old region followed by an
        # independent write makes it copy the whole buffer instead (every step, and bytes a
        # P/D transfer writes into the region meanwhile are lost when the copy is written back).
        for i, (acc, table) in enumerate(zip(accs, tables, strict=True)):
            j = rids.index(acc.region)
            k, v = (u[:, :, i, half].astype(acc.dtype) for half in (0, 1))
            regions[j] = write_kv(regions[j], acc, tp, table, positions, valid, k, v)
        prev = positions[:, :1] - rows + jnp.arange(rows)[None, :]  # [B, W-1]
        prev_valid = (prev >= 0) & (lengths[:, None] > 0)
        state = []
        for acc, table in zip(accs, tables, strict=True):
            region = regions[rids.index(acc.region)]
            state.append(jnp.stack(read_kv(region, acc, tp, table, prev, prev_valid), axis=2))
        state = jnp.stack(state, axis=2).reshape(b, rows, -1).astype(u.dtype)  # [B, W-1, C']
        flat = u.reshape(b, t, -1)
        w = weight.reshape(flat.shape[-1], -1)
        y, _ = self.ops.causal_conv1d(flat, state, w, bias.reshape(-1), lengths, None, "SD")
        return y.reshape(u.shape), tuple(regions)
