"""Dense MLPs: squared-ReLU (`down(relu(up x)^2)`) and gated (`down(act(gate x) * up x)`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from backends.fused import Norm
from backends.protocol import Ops
from hybridserve.config import MlpConfig
from hybridserve.layers.linear import Einsum

FUSED_ACTIVATIONS = ("relu2", "silu")  # what `linear` applies itself


def activation(name: str, x: jax.Array) -> jax.Array:
    """The named activation: relu2 (squared ReLU), silu, gelu (exact erf), relu."""
    if name == "relu2":
        return jnp.square(jax.nn.relu(x))
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "relu":
        return jax.nn.relu(x)
    raise ValueError(f"unknown activation {name!r}")


class Mlp(nnx.Module):
    """`down(act(up x))`, or `down(act(gate x) * up x)` when gated. Sharded over F."""

    def __init__(
        self, hidden: int, cfg: MlpConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs | None
    ) -> None:
        f = cfg.intermediate_size
        kw = dict(dtype=dtype, rngs=rngs, bias=cfg.bias)
        self.gate_proj = (
            Einsum("...d,df->...f", (hidden, f), ("embed", "mlp"), **kw) if cfg.gated else None
        )
        self.up_proj = Einsum("...d,df->...f", (hidden, f), ("embed", "mlp"), **kw)
        self.down_proj = Einsum("...f,fd->...d", (f, hidden), ("mlp", "embed"), **kw)
        self.act = cfg.activation

    def to_rows(self, ops: Ops) -> None:
        """The projections as rows (`Einsum.to_rows`, TP 1), for `fused`."""
        for proj in (self.gate_proj, self.up_proj, self.down_proj):
            if proj is not None:
                proj.to_rows(ops)

    def fused(self, h: jax.Array, norm: Norm, scale: float) -> jax.Array:
        """`h + scale * mlp(norm(h))` over rows: the norm (and a plain MLP's activation) inside
        the up projection, the residual add inside the down projection."""
        if self.gate_proj is None:
            act = self.act if self.act in FUSED_ACTIVATIONS else None
            u = self.up_proj(h, norm=norm, activation=act)
            if act is None:
                u = activation(self.act, u)
        else:
            u = activation(self.act, self.gate_proj(h, norm=norm)) * self.up_proj(h, norm=norm)
        return self.down_proj(u, residual=h, scale=scale)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.up_proj(x)
        if self.gate_proj is not None:
            h = activation(self.act, self.gate_proj(x)) * h
        else:
            h = activation(self.act, h)
        return self.down_proj(h)
