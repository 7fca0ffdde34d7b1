"""HybridModel: a decoder assembled from a config's layer pattern.

One class serves nemotron_h, bamba and granitemoehybrid: the families differ only in which
mixers the pattern holds, whether each block has a second (feed-forward) half, and the scalar
multipliers, all of which the `ModelConfig` carries.

  h_0 = embed(tokens) * embedding_multiplier
  h  += residual_multiplier * mixer_i(norm_i(h))          for each block i
  h  += residual_multiplier * ffn_i(ffn_norm_i(h))        when the family has one
  logits = lm_head(norm_f(h)) / logits_scaling
Multimodal configs add an hMLP image stem and dMel audio embeddings (`layers.multimodal`); their
outputs replace h_0 at the prompt's placeholder tokens (no embedding multiplier on them).
With `sconv` (Inkling), each block is (attention mixers; `sc_*` short convs, `SconvConfig`):
  x = norm_i(h);  k, v = sc_kv(x W_k), sc_kv(x W_v);  h += r * sc_out(attention(x W_q, k, v))
  h += r * sc_ffn(ffn_i(ffn_norm_i(h)))

The cache is functional: `model(tokens, inputs, regions) -> (hidden, regions)`, where regions
are the raw buffers of the paged hybrid cache (see `hybridserve.cache.view`); each
cached layer reads and writes its own region through the static layout in `inputs`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from backends.fused import Norm
from backends.protocol import Ops
from hybridserve.cache.spec import mtp_entries
from hybridserve.config import ModelConfig
from hybridserve.layers.linear import param, transposed
from hybridserve.layers.multimodal import DmelEncoder, HmlpPatchEncoder
from hybridserve.layers.norm import RMSNorm
from hybridserve.layers.quantized import apply_fp8
from hybridserve.layers.step_input import StepInput
from hybridserve.models.block import Block
from hybridserve.models.mtp import MtpHead


class HybridModel(nnx.Module):
    """The decoder (see the module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ops: Ops,
        *,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        self.config = cfg
        self.embed = param(
            rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype, fan_in=1
        )
        self.layers = nnx.List(
            [Block(cfg, i, ops, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)]
        )
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.norm_eps, ops, dtype=dtype)
        self.mtp = nnx.data(
            nnx.List([MtpHead(cfg, e, ops, dtype=dtype, rngs=rngs) for e in mtp_entries(cfg)])
            if cfg.mtp is not None
            else None
        )
        v, a = cfg.vision, cfg.audio
        self.vision = nnx.data(
            HmlpPatchEncoder(v.channels, v.sub_patch, v.widths, dtype=dtype, rngs=rngs)
            if v is not None
            else None
        )
        self.audio = nnx.data(
            DmelEncoder(
                cfg.hidden_size,
                sample_rate=a.sample_rate,
                n_fft=a.n_fft,
                hop=a.hop,
                n_mels=a.n_mels,
                mel_bins=a.mel_bins,
                mel_range=a.mel_range,
                dtype=dtype,
                rngs=rngs,
            )
            if a is not None
            else None
        )
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype)
        )
        self.head_rows = False  # `prepare`: the lm_head stored as rows [V, D]
        if cfg.quant is not None:  # an FP8 checkpoint's projections and experts in e4m3
            apply_fp8(self, cfg.quant.fp8_params)

    def prepare(self, mesh: Mesh) -> None:
        """Ready the loaded weights for serving on `mesh`, once, in the runner: each block's
        input projections merged per TP rank (`layers.merged`; checkpoints keep them apart);
        at TP 1 the dense projections and the lm_head as rows for the fused decode path
        (`Block.prepare`, `logits(..., normed=False)`)."""
        for layer in self.layers:
            layer.prepare(mesh)
        if mesh.shape["tp"] == 1 and self.lm_head is not None and not self.head_rows:
            self.lm_head = nnx.Param(transposed(self.lm_head[...]), axes=(None, None))
            self.head_rows = True

    def __call__(
        self,
        tokens: jax.Array,
        inputs: StepInput,
        regions: list[jax.Array],
        embeds: jax.Array | None = None,
        embed_mask: jax.Array | None = None,
        final_norm: bool = True,
    ) -> tuple[jax.Array, list[jax.Array]]:
        """tokens [B, T] -> (final hidden states [B, T, D] after norm_f, updated regions);
        `final_norm=False`: before norm_f (for `logits(..., normed=False)`).

        `embeds` [B, T, D] replace the (scaled) token embeddings where `embed_mask` [B, T] is
        set: the multimodal embeddings at their placeholder tokens (`embed_multimodal`)."""
        h = self.embed[...][tokens] * self.config.embedding_multiplier
        if embeds is not None:
            h = jnp.where(embed_mask[..., None], embeds.astype(h.dtype), h)
        regions = list(regions)
        for layer in self.layers:
            h = layer(h, regions, inputs)
        return (self.norm_f(h) if final_norm else h), regions

    def mtp_step(
        self,
        head: int,
        hidden: jax.Array,
        tokens: jax.Array,
        inputs: StepInput,
        regions: list[jax.Array],
    ) -> tuple[jax.Array, list[jax.Array]]:
        """MTP head `head` (0-based) over [B, T] positions: `hidden` the previous head's (or
        the base model's) states, `tokens` the tokens head+1 places ahead. Returns its states
        and the updated regions; `mtp_logits` gives its proposals."""
        regions = list(regions)
        embeds = self.embed[...][tokens] * self.config.embedding_multiplier
        return self.mtp[head](hidden, embeds, regions, inputs), regions

    def mtp_logits(self, head: int, hidden: jax.Array) -> jax.Array:
        """[..., D] states of MTP head `head` -> [..., V] float32 logits of its proposals."""
        return self.logits(self.mtp[head].norm_o(hidden))

    def embed_image(self, image: jax.Array) -> jax.Array:
        """An image [H, W, C] -> its patch embeddings [H/P * W/P, D] (raster order)."""
        if self.vision is None:
            raise ValueError("this model takes no images (its config has no vision encoder)")
        return self.vision(image)

    def embed_audio(self, wave: jax.Array) -> jax.Array:
        """A mono waveform [S] at the config's sample rate -> its frame embeddings [F, D]."""
        if self.audio is None:
            raise ValueError("this model takes no audio (its config has no audio encoder)")
        return self.audio(wave)

    def logits(self, hidden: jax.Array, normed: bool = True) -> jax.Array:
        """[..., D] -> [..., V] float32 logits; `normed=False`: `hidden` is before norm_f,
        which then runs inside the lm_head's `linear` (one kernel at decode)."""
        if self.lm_head is not None and not self.head_rows:
            h = hidden if normed else self.norm_f(hidden)
            y = h @ self.lm_head[...]
        else:  # rows [V, D]: the tied embedding, or the lm_head after `prepare`
            rows = self.embed[...] if self.lm_head is None else self.lm_head[...]
            norm = None if normed else Norm(self.norm_f.weight[...], self.norm_f.eps)
            y = self.norm_f.ops.linear(hidden, rows, None, norm)
        return y.astype(jnp.float32) / self.config.logits_scaling
