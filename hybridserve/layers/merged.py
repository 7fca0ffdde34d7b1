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
At TP 1 the runner then stores the kernel as rows `[Wr, D]` (`to_rows`, as `Einsum.to_rows`),
and `ranks` runs through the backend's `linear` op, with the block's norm fused before it.

FP8 parts (`Einsum.to_fp8`) merge into one e4m3 kernel whose weight scale is per column (each
part's per-tensor scale over its columns, merged like the kernels) and whose input scale is the
largest of the parts' (they all see the same input; ModelOpt calibrates them alike).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from backends import fp8
from backends.fused import Norm
from backends.protocol import Ops
from hybridserve.cache.page_layout import held_range
from hybridserve.cache.view import undup
from hybridserve.layers.linear import Einsum, transposed


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
        self.parts = rank_layout({k: p.kernel.shape[1:] for k, p in parts.items()}, tp)
        kernels = [p.kernel[...] for p in parts.values()]
        self.kernel = nnx.Param(_merged(kernels, self.parts, tp, mesh, lead=1), axes=_AXES)
        self.weight_scale: nnx.Param | None = nnx.data(None)
        self.input_scale: nnx.Param | None = nnx.data(None)
        quantized = [name for name, p in parts.items() if p.is_fp8]
        if quantized and len(quantized) != len(parts):
            raise ValueError(
                f"cannot merge FP8 projections {quantized} with high-precision ones "
                f"{sorted(set(parts) - set(quantized))}"
            )
        if quantized:
            columns = [jnp.full(p.kernel.shape[1:], p.weight_scale[...]) for p in parts.values()]
            merged = _merged(columns, self.parts, tp, mesh, lead=0)
            self.weight_scale = nnx.Param(merged, axes=_AXES[1:])
            scales = jnp.stack([p.input_scale[...] for p in parts.values()])
            self.input_scale = nnx.Param(jnp.max(scales), axes=())
        biases = [p.bias for p in parts.values()]
        self.bias = (
            None
            if any(b is None for b in biases)
            else nnx.Param(
                _merged([b[...] for b in biases], self.parts, tp, mesh, lead=0), axes=_AXES[1:]
            )
        )

        self.ops: Ops | None = None  # set by `to_rows`

    def to_rows(self, ops: Ops) -> None:
        """At TP 1: store the kernel as rows `[Wr, D]` and project through `ops.linear`.
        Idempotent."""
        if self.ops is not None:
            return
        if self.tp != 1:
            raise ValueError("rows are for TP 1 (a merged kernel at TP > 1 keeps its rank axis)")
        self.kernel = nnx.Param(transposed(self.kernel[...][:, 0]), axes=(None, None))
        if self.bias is not None:
            self.bias = nnx.Param(self.bias[...][0], axes=(None,))
        if self.weight_scale is not None:
            self.weight_scale = nnx.Param(self.weight_scale[...][0], axes=(None,))
        self.ops = ops

    def __call__(self, x: jax.Array) -> dict[str, jax.Array]:
        y = self.ranks(x)
        return {part.name: self.cut(y, part.name) for part in self.parts}

    def ranks(self, x: jax.Array, norm: Norm | None = None) -> jax.Array:
        """x [B, T, D] -> y [B, T, tp, Wr]: every rank's columns (for `cut` and `span`);
        `norm` (rows only): the `linear` op's norm of x first."""
        quantized = self.weight_scale is not None
        if self.ops is not None:
            bias = None if self.bias is None else self.bias[...]
            if quantized:
                scales = (self.weight_scale[...], self.input_scale[...])
                return self.ops.fp8_linear(x, self.kernel[...], *scales, bias, norm)[..., None, :]
            return self.ops.linear(x, self.kernel[...], bias, norm)[..., None, :]
        if norm is not None:
            raise ValueError("a fused projection needs rows (MergedProjection.to_rows)")
        if quantized:
            scales = (self.weight_scale[...], self.input_scale[...])
            y = fp8.fp8_einsum("btd,drw->btrw", x, self.kernel[...], *scales).astype(x.dtype)
        else:
            y = jnp.einsum("btd,drw->btrw", x, self.kernel[...])
        return y if self.bias is None else y + self.bias[...]

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def cut(self, y: jax.Array, name: str) -> jax.Array:
        """Part `name` of `ranks`'s y [..., tp, Wr] as its global `[..., n, *rest]` (one copy
        of each entry)."""
        part = self.part(name)
        lead = y.shape[:-2]
        piece = y[..., part.offset : part.offset + part.width]
        piece = piece.reshape(*lead, self.tp * part.per_rank, *part.rest)
        # each entry is held by tp * per_rank / heads ranks (1 when split): keep one copy
        return undup(piece, len(lead), self.tp * part.per_rank // part.heads)

    def span(self, y: jax.Array, first: str, last: str) -> jax.Array:
        """Parts `first` .. `last` (adjacent in merge order) of each rank of y [..., tp, Wr]:
        `y[..., a:b]`, per rank as that rank holds them (duplicated entries included)."""
        a, b = self.part(first), self.part(last)
        return y[..., a.offset : b.offset + b.width]


def rank_layout(shapes: dict[str, tuple[int, ...]], tp: int) -> tuple[Part, ...]:
    """The parts of a per-rank merge of arrays `[n_i, *rest_i]` (their sharded axis first)."""
    layout, offset = [], 0
    for name, shape in shapes.items():
        per_rank = len(held_range(shape[0], tp, 0, name))
        layout.append(Part(name, shape[0], tuple(shape[1:]), per_rank, offset))
        offset += layout[-1].width
    return tuple(layout)


def merge_per_rank(arrays: dict[str, jax.Array], mesh: Mesh) -> jax.Array:
    """Arrays `[n_i, *rest_i]` (e.g. conv taps per head) merged to `[tp, Wr]` as the kernels
    are (rank r: each array's `held_range` entries, flattened, side by side), sharded on the
    rank axis."""
    tp = mesh.shape["tp"]
    parts = rank_layout({k: a.shape for k, a in arrays.items()}, tp)
    return _merged(list(arrays.values()), parts, tp, mesh, lead=0)


_AXES = ("embed", "ranks", None)  # "ranks" is always split over "tp" (`parallel.TP_AXES`)


def _merged(
    arrays: list[jax.Array], parts: tuple[Part, ...], tp: int, mesh: Mesh, lead: int
) -> jax.Array:
    """`arrays` (kernels with `lead`=1 leading D axis, or biases with none) merged to
    `[*lead, tp, Wr]`, sharded on the rank axis."""
    sharding = NamedSharding(mesh, PartitionSpec(*(None,) * lead, "tp", None))
    return _merge_program(parts, tp, lead, sharding)(*arrays)


@functools.cache
def _merge_program(parts: tuple[Part, ...], tp: int, lead: int, sharding: NamedSharding):
    """One jitted merge per layout: every runner of a model shape reuses its compiled program."""

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

    return jax.jit(merge, out_shardings=sharding)
