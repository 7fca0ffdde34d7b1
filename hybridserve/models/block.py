"""One residual block of `HybridModel` (see its module docstring for the equations)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from backends.fused import Norm
from backends.protocol import Ops
from hybridserve.cache.spec import sconv_entries
from hybridserve.config import ModelConfig
from hybridserve.layers.attention import Attention, KvConv
from hybridserve.layers.mamba2 import Mamba2
from hybridserve.layers.mlp import Mlp
from hybridserve.layers.moe import Moe
from hybridserve.layers.norm import RMSNorm
from hybridserve.layers.sconv import ShortConv
from hybridserve.layers.step_input import StepInput


class Block(nnx.Module):
    """One residual block: a mixer (mamba | attention | mlp | moe) and an optional ffn."""

    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        ops: Ops,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs | None,
        entry: int | None = None,
    ) -> None:
        """Block `index` of the pattern; `entry` (an MTP head's block): a full-attention block
        without sconvs whose cache is entry `entry` instead."""
        d, kw = cfg.hidden_size, dict(dtype=dtype, rngs=rngs)
        kind = cfg.layer_types[index] if entry is None else "attention"
        self.index, self.kind = (index if entry is None else entry), kind
        self.norm = RMSNorm(d, cfg.norm_eps, ops, dtype=dtype)
        if kind == "mamba":
            self.mixer = Mamba2(d, cfg.mamba, cfg.norm_eps, ops, **kw)
        elif kind in ("attention", "sliding_attention"):
            window = cfg.window(index) if entry is None else None
            kv_scales = cfg.kv_cache_dtype is not None  # the checkpoint's FP8 KV scales
            self.mixer = Attention(d, cfg.attention, ops, window=window, kv_scales=kv_scales, **kw)
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
        self.ops = ops
        self.fused = False  # `prepare`
        self.cfg = cfg  # the sconv entries depend on the TP size (`_conv`)
        sites = sconv_entries(cfg)[index] if entry is None else {}
        a = cfg.attention
        widths = {"kv": 2 * a.num_kv_heads * a.head_dim if a else 0, "out": d, "ffn": d}
        self.sconv = nnx.data(
            nnx.Dict({s: ShortConv(widths[s], cfg.sconv, ops, **kw) for s in sites})
            if cfg.sconv is not None and entry is None
            else None
        )

    def prepare(self, mesh: Mesh) -> None:
        """Merge the mixer's input projections per TP rank (`layers.merged`), where it has any.
        At TP 1 (blocks without short convs) also store the dense projections as rows, so that
        each residual step runs fused (`_fused`: the norm inside the first projection, the
        residual add inside the last). Done once by the runner after loading."""
        if isinstance(self.mixer, Mamba2):
            self.mixer.merge_projections(mesh)
        if self.fused or mesh.shape["tp"] != 1 or self.sconv is not None:
            return
        if isinstance(self.mixer, Mamba2):
            self.mixer.to_rows()
        elif isinstance(self.mixer, Attention):
            self.mixer.to_rows(mesh)
        elif isinstance(self.mixer, Mlp):
            self.mixer.to_rows(self.ops)
        if isinstance(self.ffn, Mlp):
            self.ffn.to_rows(self.ops)
        self.fused = True

    def __call__(self, h: jax.Array, regions: list[jax.Array], inputs: StepInput) -> jax.Array:
        """Replaces this layer's regions in `regions` (a Python list) when it is cached."""
        if self.fused:
            return self._fused(h, regions, inputs)
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

    def _fused(self, h: jax.Array, regions: list[jax.Array], inputs: StepInput) -> jax.Array:
        """`__call__` over rows (`prepare`): each residual step in the layers' fused form."""
        scale = self.residual_multiplier
        norm = Norm(self.norm.weight[...], self.norm.eps)
        if self.kind in ("mamba", "attention", "sliding_attention"):
            r = inputs.layout.layers[self.index].region
            h, regions[r] = self.mixer.fused(h, norm, scale, regions[r], inputs, self.index)
        elif isinstance(self.mixer, Mlp):
            h = self.mixer.fused(h, norm, scale)
        else:
            h = h + scale * self.mixer(self.norm(h))
        if isinstance(self.ffn, Mlp):
            h = self.ffn.fused(h, Norm(self.ffn_norm.weight[...], self.ffn_norm.eps), scale)
        elif self.ffn is not None:
            h = h + scale * self.ffn(self.ffn_norm(h))
        return h

    def _conv(
        self, site: str, x: jax.Array, regions: list[jax.Array], inputs: StepInput
    ) -> jax.Array:
        if self.sconv is None:
            return x
        entries = sconv_entries(self.cfg, inputs.layout.tp)[self.index][site]
        return self.sconv[site](x, regions, inputs, entries)

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
