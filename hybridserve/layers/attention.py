"""GQA attention with an incremental KV cache; NoPE or (partial) RoPE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from backends.protocol import Ops
from hybridserve.config import AttentionConfig
from hybridserve.layers.linear import Einsum
from hybridserve.layers.rope import apply_rope
from hybridserve.layers.step_input import StepInput


class Attention(nnx.Module):
    """`softmax(q k^T * scale + causal mask) v` over the cached and new keys, K kv heads shared
    by N/K query heads each. Cache per layer: `k`, `v` of shape [slots, S, K, H]."""

    def __init__(
        self,
        hidden: int,
        cfg: AttentionConfig,
        ops: Ops,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs | None,
    ) -> None:
        n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(dtype=dtype, rngs=rngs, bias=cfg.bias)
        self.q_proj = Einsum("btd,dnh->btnh", (hidden, n, h), ("embed", "heads", None), **kw)
        self.k_proj = Einsum("btd,dkh->btkh", (hidden, k, h), ("embed", "kv_heads", None), **kw)
        self.v_proj = Einsum("btd,dkh->btkh", (hidden, k, h), ("embed", "kv_heads", None), **kw)
        self.o_proj = Einsum("btnh,nhd->btd", (n, h, hidden), ("heads", None, "embed"), **kw)
        self.cfg = cfg
        self.ops = ops

    def __call__(
        self, x: jax.Array, cache: dict[str, jax.Array], inputs: StepInput
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.cfg.rope_theta is not None:
            q = apply_rope(q, inputs.positions, self.cfg.rope_theta, self.cfg.rotary_dim)
            k = apply_rope(k, inputs.positions, self.cfg.rope_theta, self.cfg.rotary_dim)
        k_cache, v_cache = cache["k"], cache["v"]
        # Padding tokens write out of range, where the scatter drops them.
        write_pos = jnp.where(inputs.valid, inputs.positions, k_cache.shape[1])
        rows = inputs.slots[:, None]
        k_cache = k_cache.at[rows, write_pos].set(k.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[rows, write_pos].set(v.astype(v_cache.dtype), mode="drop")
        out = self.ops.cached_attention(
            q,
            k_cache[inputs.slots],
            v_cache[inputs.slots],
            inputs.positions,
            inputs.kv_lengths,
            self.cfg.softmax_scale,
            self.cfg.sliding_window,
        )
        return self.o_proj(out), {"k": k_cache, "v": v_cache}
