"""Multi-token prediction (MTP) heads: the draft model of speculative decoding.

Head i (i = 1 .. k) at position t reads the previous head's hidden state `g_{i-1}(t)` (`g_0`:
the base model's final hidden state, after norm_f) and the embedding of the token i places
ahead, `x_{t+i}`:
  u      = W_i [norm_h(g_{i-1}(t)) ; norm_e(E[x_{t+i}])]        (W_i: [2D, D])
  g_i(t) = Block_i(u)      (full attention over head i's own cache of earlier positions, then
                            the model's ffn, or `MtpConfig.ffn`; no sconv)
  logits_i(t) = lm_head(norm_o(g_i(t)))                          (the distribution of x_{t+i+1})
After the base model's step at the last position t (whose next token x_{t+1} was just chosen),
head 1 proposes x_{t+2}; head 2, fed head 1's proposal as x_{t+2}, proposes x_{t+3}; and so on.
The heads share the base model's embedding table and lm_head.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
from flax import nnx

from backends.protocol import Ops
from hybridserve.config import ModelConfig
from hybridserve.layers.linear import param
from hybridserve.layers.norm import RMSNorm
from hybridserve.layers.step_input import StepInput
from hybridserve.models.block import Block


class MtpHead(nnx.Module):
    """One chained MTP head (see the module docstring); its KV cache is entry `entry`."""

    def __init__(
        self, cfg: ModelConfig, entry: int, ops: Ops, *, dtype: jnp.dtype, rngs: nnx.Rngs | None
    ) -> None:
        d, eps = cfg.hidden_size, cfg.norm_eps
        self.norm_h = RMSNorm(d, eps, ops, dtype=dtype)
        self.norm_e = RMSNorm(d, eps, ops, dtype=dtype)
        self.proj = param(rngs, (2 * d, d), (None, "embed"), dtype)
        own = cfg if cfg.mtp is None or cfg.mtp.ffn is None else replace(cfg, ffn=cfg.mtp.ffn)
        self.block = Block(own, 0, ops, dtype=dtype, rngs=rngs, entry=entry)
        self.norm_o = RMSNorm(d, eps, ops, dtype=dtype)

    def __call__(
        self,
        hidden: jax.Array,
        embeds: jax.Array,
        regions: list[jax.Array],
        inputs: StepInput,
    ) -> jax.Array:
        """g_{i-1} [B, T, D] and E[x_{t+i}] [B, T, D] -> g_i [B, T, D] (replaces the head's
        region in `regions`). The caller applies `norm_o` and the lm_head for logits."""
        u = jnp.concatenate([self.norm_h(hidden), self.norm_e(embeds)], axis=-1)
        return self.block(u @ self.proj[...], regions, inputs)
