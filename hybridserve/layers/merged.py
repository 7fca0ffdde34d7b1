"""Projections merged per tensor-parallel rank: one GEMM where the checkpoint keeps several.

Checkpoints (and `Einsum` layers) keep e.g. Mamba2's z, x, B, C and dt projections apart, each
kernel `[D, n_i, *rest_i]` with its head/group axis `n_i` sharded over TP. A decode step at
batch 1 is bandwidth-bound, and several narrow GEMVs read their weights slower than one wide
one (and cost a kernel each), so the runner merges them once, after loading:

  W [D, tp, Wr],  W[:, r] = concat_i( K_i[:, held_i(r)].reshape(D, -1) )
  held_i(r) = `cache.page_layout.held_range(n_i, tp, r)`: rank r's n_i/tp entries when tp | n_i,
              else the one entry it duplicates (n_i | tp),
  y = x W  [.., tp, Wr], cut back into the parts: part i as `[.., n_i, *rest_i]` (global
  entries in order; a duplicated part keeps one copy of each entry).

The rank axis is the sharded one, so each rank's GEMM reads exactly its own columns and no
collective is needed; at TP 1 it is a plain concatenation. Biases are merged the same way.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridserve.cache.page_layout import held_range
from hybridserve.layers.linear import Einsum


@dataclasses.dataclass(frozen=True)
class Part:
    """One merged projection: `heads` entries on its sharded axis of `rest` elements each, the
    entries a rank holds (`per_rank`) from offset `offset` of that rank's columns."""

    name: str
    heads: int
    rest: tuple[int, ...]
    per_rank: int
    offset: int

    @property
    def width(self) -> int:
        return self.per_rank * math.prod(self.rest)


class MergedProjection(nnx.Module):
    """`y_i = x K_i (+ b_i)` for every part i in one einsum over a per-rank merged kernel (see
    the module docstring); call it for `{name: y_i [B, T, n_i, *rest_i]}`."""

    def __init__(self, parts: dict[str, Einsum], mesh: Mesh) -> None:
        """Merge `parts` (kernels `[D, n_i, *rest_i]`, as loaded and sharded) for `mesh`'s TP."""
        tp = mesh.shape["tp"]
        self.tp = tp
        layout, offset = [], 0
        for name, proj in parts.items():
            shape = proj.kernel.shape
            per_rank = len(held_range(shape[1], tp, 0, name))
            layout.append(Part(name, shape[1], tuple(shape[2:]), per_rank, offset))
            offset += layout[-1].width
        self.parts = tuple(layout)
        kernels = [p.kernel[...] for p in parts.values()]
        self.kernel = nnx.Param(_merged(kernels, self.parts, tp, mesh, lead=1), axes=_AXES)
        biases = [p.bias for p in parts.values()]
        self.bias = (
            None
            if any(b is None for b in biases)
            else nnx.Param(
                _merged([b[...] for b in biases], self.parts, tp, mesh, lead=0), axes=_AXES[1:]
            )
        )

    def __call__(self, x: jax.Array) -> dict[str, jax.Array]:
        y = jnp.einsum("btd,drw->btrw", x, self.kernel[...])
        if self.bias is not None:
            y = y + self.bias[...]
        out = {}
        for part in self.parts:
            piece = y[..., part.offset : part.offset + part.width]
            piece = piece.reshape(*y.shape[:2], self.tp * part.per_rank, *part.rest)
            dup = self.tp // part.heads if part.heads < self.tp else 1
            if dup > 1:  # each entry is held by dup ranks: keep one copy
                piece = piece.reshape(*y.shape[:2], part.heads, dup, *part.rest)[:, :, :, 0]
            out[part.name] = piece
        return out


_AXES = ("embed", "ranks", None)  # "ranks" is always split over "tp" (`parallel.TP_AXES`)


def _merged(
    arrays: list[jax.Array], parts: tuple[Part, ...], tp: int, mesh: Mesh, lead: int
) -> jax.Array:
    """`arrays` (kernels with `lead`=1 leading D axis, or biases with none) merged to
    `[*lead, tp, Wr]`, sharded on the rank axis."""

    def merge(*arrays: jax.Array) -> jax.Array:
        ranks = []
        for r in range(tp):
            cols = []
            for part, a in zip(parts, arrays, strict=True):
                held = held_range(part.heads, tp, r, part.name)
                piece = a[(slice(None),) * lead + (slice(held.start, held.stop),)]
                cols.append(piece.reshape(*a.shape[:lead], -1))
            ranks.append(jnp.concatenate(cols, axis=-1))
        return jnp.stack(ranks, axis=lead)

    sharding = NamedSharding(mesh, PartitionSpec(*(None,) * lead, "tp", None))
    return jax.jit(merge, out_shardings=sharding)(*arrays)
