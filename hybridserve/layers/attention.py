"""GQA attention with an incremental KV cache; NoPE or (partial) RoPE; an optional learned
relative-position term ("qkvr"); an FP8 KV cache with per-layer scales."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from backends import fp8
from backends.fused import Norm
from backends.protocol import Ops, RelativeBias
from hybridserve.cache.view import AttentionAccess, kv_pages, kv_pages_local, write_kv
from hybridserve.config import AttentionConfig
from hybridserve.layers.linear import Einsum, param
from hybridserve.layers.merged import MergedProjection
from hybridserve.layers.rope import apply_rope
from hybridserve.layers.step_input import StepInput

KvConv = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


class Attention(nnx.Module):
    """`softmax(q k^T * scale + causal mask) v` over the cached and new keys, K kv heads shared
    by N/K query heads each. The KV cache is the layer's region, read and written through the
    request's block table (see `cache.view`).

    With a relative term (`rel_dim` R), query head n of token i also gets `r_n(i) = x_i W_r[n]`
    ([R]) and the logit of key j becomes
      `l[n, i, j] = scale * q_n(i) . k(j) + r_n(i) . E[bucket(i - j)]`,
    E the layer's learned table [rel_buckets, R]; `bucket` is `RelativeBias` (distances below
    `rel_exact` exact, then log-spaced starts up to `rel_max_distance`, the last bucket open).
    The kernels compute `r . E^T` per query tile and add it along the shear (never a [T, S]
    array).

    FP8 KV cache (a float8 cache dtype): keys and values are stored as `e4m3(k / s_k)` and
    `e4m3(v / s_v)` (`backends.fp8.quantize`) with the layer's scales (`k_scale`, `v_scale`
    from an FP8 checkpoint; 1 without them), and the scales fold out of the kernels:
      `q . k = (s_k q) . k_q`,   `sum_j p_j v_j = s_v sum_j p_j v_q(j)`,
    so the attention ops read the e4m3 pages as they are (the same contract as any dtype)."""

    def __init__(
        self,
        hidden: int,
        cfg: AttentionConfig,
        ops: Ops,
        *,
        window: int | None = None,
        kv_scales: bool = False,
        dtype: jnp.dtype,
        rngs: nnx.Rngs | None,
    ) -> None:
        """`window`: keys at distance < window only (a sliding-window layer); None: all.
        `kv_scales`: hold an FP8 checkpoint's per-layer `k_scale` and `v_scale` (float32 [])."""
        n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(dtype=dtype, rngs=rngs, bias=cfg.bias)
        self.q_proj = Einsum("btd,dnh->btnh", (hidden, n, h), ("embed", "heads", None), **kw)
        self.k_proj = Einsum("btd,dkh->btkh", (hidden, k, h), ("embed", "kv_heads", None), **kw)
        self.v_proj = Einsum("btd,dkh->btkh", (hidden, k, h), ("embed", "kv_heads", None), **kw)
        self.o_proj = Einsum("btnh,nhd->btd", (n, h, hidden), ("heads", None, "embed"), **kw)
        if cfg.rel_dim is not None:
            r = cfg.rel_dim
            self.r_proj = Einsum("btd,dnr->btnr", (hidden, n, r), ("embed", "heads", None), **kw)
            self.rel_table = param(rngs, (cfg.rel_buckets, r), (None, None), dtype, fan_in=r)
            self.rel_bias = RelativeBias(cfg.rel_buckets, cfg.rel_exact, cfg.rel_max_distance)
        else:
            self.r_proj = self.rel_table = self.rel_bias = None
        if kv_scales:
            self.k_scale = param(None, (), (), jnp.float32, init="ones")
            self.v_scale = param(None, (), (), jnp.float32, init="ones")
        else:
            self.k_scale = self.v_scale = None
        self.qkv: MergedProjection | None = nnx.data(None)  # `to_rows`
        self.cfg = cfg
        self.window = window
        self.ops = ops

    def to_rows(self, mesh: Mesh) -> None:
        """At TP 1: q, k, v (and r) merged into one projection stored as rows, o_proj as rows
        (`layers.merged`, `Einsum.to_rows`), for `fused`. Idempotent."""
        if self.qkv is not None:
            return
        names = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}
        if self.r_proj is not None:
            names["r"] = "r_proj"
        merged = MergedProjection({k: getattr(self, v) for k, v in names.items()}, mesh)
        merged.to_rows(self.ops)
        self.qkv = nnx.data(merged)
        for attr in names.values():
            setattr(self, attr, None)
        self.o_proj.to_rows(self.ops)

    def fused(
        self,
        h: jax.Array,
        norm: Norm,
        scale: float,
        region: jax.Array,
        inputs: StepInput,
        layer: int,
    ) -> tuple[jax.Array, jax.Array]:
        """The whole residual step `h + scale * attention(norm(h))` over rows (`to_rows`):
        the norm inside the merged q|k|v projection, the residual add inside o_proj."""
        cols = self.qkv.ranks(h, norm)
        q, k, v = (self.qkv.cut(cols, name) for name in ("q", "k", "v"))
        relative = any(part.name == "r" for part in self.qkv.parts)
        rel_q = self.qkv.cut(cols, "r") if relative else None
        out, region = self._attend_all(q, k, v, rel_q, region, inputs, layer, None)
        return self.o_proj(out, residual=h, scale=scale), region

    def __call__(
        self,
        x: jax.Array,
        region: jax.Array,
        inputs: StepInput,
        layer: int,
        kv_conv: KvConv | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """`kv_conv` (the Inkling blocks' sconvs) maps the projected k and v ([B, T, K, H])
        before they are cached and attended to; it gets and returns this layer's region (its
        own state may live in the same region)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        rel_q = None if self.r_proj is None else self.r_proj(x)
        out, region = self._attend_all(q, k, v, rel_q, region, inputs, layer, kv_conv)
        return self.o_proj(out), region

    def _attend_all(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        rel_q: jax.Array | None,
        region: jax.Array,
        inputs: StepInput,
        layer: int,
        kv_conv: KvConv | None,
    ) -> tuple[jax.Array, jax.Array]:
        """This step's keys written, then attention over the pages: (out [B, T, N, H],
        region)."""
        acc = inputs.layout.layers[layer]
        tp = inputs.layout.tp
        if kv_conv is not None:
            k, v, region = kv_conv(k, v, region)
        if self.cfg.rope_theta is not None:
            q = apply_rope(q, inputs.positions, self.cfg.rope_theta, self.cfg.rotary_dim)
            k = apply_rope(k, inputs.positions, self.cfg.rope_theta, self.cfg.rotary_dim)
        table = inputs.tables[acc.group]
        # Write this step's keys first (rounded to the cache dtype, as later steps read them),
        # then attend over the pages: one in-place write of the region per layer.
        k_scale, v_scale = self._kv_scales(acc.dtype)
        if k_scale is None:
            k, v = k.astype(acc.dtype), v.astype(acc.dtype)
        else:
            k, v = fp8.quantize(k, k_scale, acc.dtype), fp8.quantize(v, v_scale, acc.dtype)
            q = (q.astype(jnp.float32) * k_scale).astype(q.dtype)
        region = write_kv(region, acc, tp, table, inputs.positions, inputs.valid, k, v)
        rel_table = None if rel_q is None else self.rel_table[...]
        mesh = inputs.layout.mesh
        where = (table, inputs.positions, inputs.kv_lengths)
        if tp == 1:  # the region as joint K|V pages: no slice copies it
            out = self._attend(q, kv_pages_local(region, acc), None, where, rel_q, rel_table)
        elif mesh is not None and self.cfg.num_heads % tp == 0:
            out = self._per_rank(q, region, where, acc, mesh, rel_q, rel_table)
        else:
            k_pages, v_pages = kv_pages(region, acc, tp)
            out = self._attend(q, k_pages, v_pages, where, rel_q, rel_table)
        if v_scale is not None:
            out = (out.astype(jnp.float32) * v_scale).astype(out.dtype)
        return out, region

    def _kv_scales(self, cache_dtype: str) -> tuple[jax.Array | None, jax.Array | None]:
        """(k_scale, v_scale) for a float8 cache (the checkpoint's, or 1); (None, None) for
        any other cache dtype, which keys and values are simply cast to."""
        if not fp8.is_float8(cache_dtype):
            return None, None
        if self.k_scale is None:
            one = jnp.ones((), jnp.float32)
            return one, one
        return self.k_scale[...], self.v_scale[...]

    def _attend(
        self,
        q: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array | None,
        where: tuple[jax.Array, jax.Array, jax.Array],
        rel_q: jax.Array | None,
        rel_table: jax.Array | None,
    ) -> jax.Array:
        """The attention op over typed pages; `where` = (block table, positions, kv lengths)."""
        table, positions, kv_lengths = where
        return self.ops.paged_attention(
            q,
            k_pages,
            v_pages,
            table,
            positions,
            kv_lengths,
            self.cfg.softmax_scale,
            self.window,
            rel_q,
            rel_table,
            None if rel_q is None else self.rel_bias,
        )

    def _per_rank(
        self,
        q: jax.Array,
        region: jax.Array,
        where: tuple[jax.Array, jax.Array, jax.Array],
        acc: AttentionAccess,
        mesh: Mesh,
        rel_q: jax.Array | None,
        rel_table: jax.Array | None,
    ) -> jax.Array:
        """Tensor parallelism: each rank attends its own query heads over its own shard of the
        region (`shard_map`), which it reads in place. (Read as one global array, the shards
        are copied whole, every layer, every step: `cache.view.kv_pages`.) Its query heads
        [r * N/tp, (r+1) * N/tp) share the KV heads it holds, as in the global computation."""
        heads = P(None, None, "tp", None)
        args = [q, region, *where]
        specs = [heads, P("tp", None, None), P(), P(), P()]
        if rel_q is not None:
            args += [rel_q, rel_table]
            specs += [heads, P()]

        def local(q_r, shard, table, positions, kv_lengths, *rel):
            rel_q_r, rel_table_r = rel if rel else (None, None)
            where_r = (table, positions, kv_lengths)
            pages = kv_pages_local(shard, acc)
            return self._attend(q_r, pages, None, where_r, rel_q_r, rel_table_r)

        run = jax.shard_map(
            local, mesh=mesh, in_specs=tuple(specs), out_specs=heads, check_vma=False
        )
        return run(*args)
