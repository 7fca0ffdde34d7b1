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
are the raw buffers of the paged hybrid cache (see `hybridserve.layers.cache_view`); each
cached layer reads and writes its own region through the static layout in `inputs`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from backends.protocol import Ops
from hybridserve.config import ModelConfig
from hybridserve.kv_spec import sconv_entries
from hybridserve.layers.attention import Attention, KvConv
from hybridserve.layers.linear import param
from hybridserve.layers.mamba2 import Mamba2
from hybridserve.layers.mlp import Mlp
from hybridserve.layers.moe import Moe
from hybridserve.layers.multimodal import DmelEncoder, HmlpPatchEncoder
from hybridserve.layers.norm import RMSNorm
from hybridserve.layers.sconv import ShortConv
from hybridserve.layers.step_input import StepInput


class Block(nnx.Module):
    """One residual block: a mixer (mamba | attention | mlp | moe) and an optional ffn."""

    def __init__(
        self, cfg: ModelConfig, index: int, ops: Ops, *, dtype: jnp.dtype, rngs: nnx.Rngs | None
    ) -> None:
        d, kw = cfg.hidden_size, dict(dtype=dtype, rngs=rngs)
        kind = cfg.layer_types[index]
        self.index, self.kind = index, kind
        self.norm = RMSNorm(d, cfg.norm_eps, ops, dtype=dtype)
        if kind == "mamba":
            self.mixer = Mamba2(d, cfg.mamba, cfg.norm_eps, ops, **kw)
        elif kind in ("attention", "sliding_attention"):
            self.mixer = Attention(d, cfg.attention, ops, window=cfg.window(index), **kw)
        elif kind == "mlp":
            self.mixer = Mlp(d, cfg.mlp, **kw)
        else:
            self.mixer = Moe(d, cfg.moe, ops, **kw)
        self.ffn_norm = RMSNorm(d, cfg.norm_eps, ops, dtype=dtype) if cfg.ffn else None
        if cfg.ffn == "mlp":
            self.ffn = Mlp(d, cfg.mlp, **kw)
        elif cfg.ffn == "moe":
            self.ffn = Moe(d, cfg.moe, ops, **kw)
        else:
            self.ffn = None
        self.residual_multiplier = cfg.residual_multiplier
        self.sconv_entries = sconv_entries(cfg)[index]
        a = cfg.attention
        widths = {"kv": 2 * a.num_kv_heads * a.head_dim if a else 0, "out": d, "ffn": d}
        self.sconv = nnx.data(
            nnx.Dict({s: ShortConv(widths[s], cfg.sconv, ops, **kw) for s in self.sconv_entries})
            if cfg.sconv is not None
            else None
        )

    def __call__(self, h: jax.Array, regions: list[jax.Array], inputs: StepInput) -> jax.Array:
        """Replaces this layer's regions in `regions` (a Python list) when it is cached."""
        x = self.norm(h)
        if self.kind in ("mamba", "attention", "sliding_attention"):
            r = inputs.layout.layers[self.index].region
            extra = {} if self.sconv is None else {"kv_conv": self._kv_conv(regions, inputs)}
            x, regions[r] = self.mixer(x, regions[r], inputs, self.index, **extra)
        else:
            x = self.mixer(x)
        x = self._conv("out", x, regions, inputs)
        h = h + self.residual_multiplier * x
        if self.ffn is not None:
            y = self._conv("ffn", self.ffn(self.ffn_norm(h)), regions, inputs)
            h = h + self.residual_multiplier * y
        return h

    def _conv(
        self, site: str, x: jax.Array, regions: list[jax.Array], inputs: StepInput
    ) -> jax.Array:
        if self.sconv is None:
            return x
        return self.sconv[site](x, regions, inputs, self.sconv_entries[site])

    def _kv_conv(self, regions: list[jax.Array], inputs: StepInput) -> KvConv:
        """The keys and values through one sconv (channels: k's, then v's)."""
        r = inputs.layout.layers[self.index].region

        def conv(k: jax.Array, v: jax.Array, region: jax.Array) -> tuple[jax.Array, ...]:
            b, t, kv, hd = k.shape
            regions[r] = region  # the sconv entries may share the attention layer's region
            u = jnp.concatenate([k.reshape(b, t, -1), v.reshape(b, t, -1)], axis=-1)
            y = self._conv("kv", u, regions, inputs)
            k, v = y[..., : kv * hd].reshape(k.shape), y[..., kv * hd :].reshape(v.shape)
            return k, v, regions[r]

        return conv


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

    def __call__(
        self,
        tokens: jax.Array,
        inputs: StepInput,
        regions: list[jax.Array],
        embeds: jax.Array | None = None,
        embed_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, list[jax.Array]]:
        """tokens [B, T] -> (final hidden states [B, T, D] after norm_f, updated regions).

        `embeds` [B, T, D] replace the (scaled) token embeddings where `embed_mask` [B, T] is
        set: the multimodal embeddings at their placeholder tokens (`embed_multimodal`)."""
        h = self.embed[...][tokens] * self.config.embedding_multiplier
        if embeds is not None:
            h = jnp.where(embed_mask[..., None], embeds.astype(h.dtype), h)
        regions = list(regions)
        for layer in self.layers:
            h = layer(h, regions, inputs)
        return self.norm_f(h), regions

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

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[..., D] -> [..., V] float32 logits."""
        w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return (hidden @ w).astype(jnp.float32) / self.config.logits_scaling
