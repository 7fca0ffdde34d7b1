"""GQA attention with an incremental KV cache; NoPE or (partial) RoPE; an optional learned
relative-position term ("qkvr")."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from backends.protocol import Ops, RelativeBias
from hybridserve.cache.view import kv_pages, write_kv
from hybridserve.config import AttentionConfig
from hybridserve.layers.linear import Einsum, param
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
    array)."""

    def __init__(
        self,
        hidden: int,
        cfg: AttentionConfig,
        ops: Ops,
        *,
        window: int | None = None,
        dtype: jnp.dtype,
        rngs: nnx.Rngs | None,
    ) -> None:
        """`window`: keys at distance < window only (a sliding-window layer); None: all."""
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
        self.cfg = cfg
        self.window = window
        self.ops = ops

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
        acc = inputs.layout.layers[layer]
        tp = inputs.layout.tp
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if kv_conv is not None:
            k, v, region = kv_conv(k, v, region)
        if self.cfg.rope_theta is not None:
            q = apply_rope(q, inputs.positions, self.cfg.rope_theta, self.cfg.rotary_dim)
            k = apply_rope(k, inputs.positions, self.cfg.rope_theta, self.cfg.rotary_dim)
        table = inputs.tables[acc.group]
        # Write this step's keys first (rounded to the cache dtype, as later steps read them),
        # then attend over the pages: one in-place write of the region per layer.
        k, v = k.astype(acc.dtype), v.astype(acc.dtype)
        region = write_kv(region, acc, tp, table, inputs.positions, inputs.valid, k, v)
        k_pages, v_pages = kv_pages(region, acc, tp)
        rel = (None, None, None)
        if self.r_proj is not None:
            rel = (self.r_proj(x), self.rel_table[...], self.rel_bias)
        out = self.ops.paged_attention(
            q,
            k_pages,
            v_pages,
            table,
            inputs.positions,
            inputs.kv_lengths,
            self.cfg.softmax_scale,
            self.window,
            *rel,
        )
        return self.o_proj(out), region
