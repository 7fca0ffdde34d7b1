"""The Mamba2 mixer.

For an input u [B, T, D]:
  z, x, b, c, dt = u W_z, u W_x, u W_b, u W_c, u W_dt          (x: [Hs, P], b, c: [G, Ns])
  x, b, c = silu(causal_depthwise_conv_W([x | b | c]))         (conv state: last W-1 inputs)
  dt = softplus(dt + dt_bias), clipped to the config's [dt_min, dt_max] (no clamp by default)
  a = -exp(A_log)
  s_t = exp(dt_t a) s_{t-1} + dt_t (x_t outer b_t);  y_t = s_t c_t + D x_t   (per head)
  out = W_out (gated_group_rmsnorm(y, z))                      (norm of y * silu(z) per group)
Prefill runs the chunked SSD scan from the carried state; one-token decode runs the recurrent
update. The input projection is kept as five separate kernels so that tensor parallelism can
shard heads and groups; the checkpoint loader splits HF's fused `in_proj`.
Cache per layer: `conv` [slots, C, W-1] (DS layout: x rows, then b, then c) and `ssm`
[slots, Hs, P, Ns] float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from backends.protocol import Ops
from hybridserve.config import MambaConfig
from hybridserve.layers.linear import Einsum, param
from hybridserve.layers.step_input import StepInput


class Mamba2(nnx.Module):
    """Mamba2 mixer (see the module docstring for the equations)."""

    def __init__(
        self,
        hidden: int,
        cfg: MambaConfig,
        eps: float,
        ops: Ops,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs | None,
    ) -> None:
        hs, p, g, ns = cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.state_size
        kw = dict(dtype=dtype, rngs=rngs, bias=cfg.use_bias)
        self.in_z = Einsum("btd,dhp->bthp", (hidden, hs, p), ("embed", "ssm_heads", None), **kw)
        self.in_x = Einsum("btd,dhp->bthp", (hidden, hs, p), ("embed", "ssm_heads", None), **kw)
        self.in_b = Einsum("btd,dgn->btgn", (hidden, g, ns), ("embed", "ssm_groups", None), **kw)
        self.in_c = Einsum("btd,dgn->btgn", (hidden, g, ns), ("embed", "ssm_groups", None), **kw)
        self.in_dt = Einsum("btd,dh->bth", (hidden, hs), ("embed", "ssm_heads"), **kw)
        self.conv_weight = param(
            rngs, (cfg.conv_dim, cfg.conv_kernel), (None, None), dtype, fan_in=cfg.conv_kernel
        )
        self.conv_bias = (
            param(None, (cfg.conv_dim,), (None,), dtype, init="zeros")
            if cfg.use_conv_bias
            else None
        )
        self.dt_bias = param(None, (hs,), ("ssm_heads",), jnp.float32, init="zeros")
        self.A_log = param(None, (hs,), ("ssm_heads",), jnp.float32, init="zeros")
        self.D = param(None, (hs,), ("ssm_heads",), jnp.float32, init="ones")
        self.norm_weight = param(None, (cfg.intermediate_size,), (None,), dtype, init="ones")
        self.out_proj = Einsum("bthp,hpd->btd", (hs, p, hidden), ("ssm_heads", None, "embed"), **kw)
        self.cfg = cfg
        self.eps = eps
        self.ops = ops

    def __call__(
        self, u: jax.Array, cache: dict[str, jax.Array], inputs: StepInput
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        cfg, ops = self.cfg, self.ops
        bsz, t, _ = u.shape
        hs, p, g, ns = cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.state_size
        z, x, b, c = self.in_z(u), self.in_x(u), self.in_b(u), self.in_c(u)
        xbc = jnp.concatenate(
            [x.reshape(bsz, t, hs * p), b.reshape(bsz, t, g * ns), c.reshape(bsz, t, g * ns)], -1
        )
        dt = jax.nn.softplus(self.in_dt(u).astype(jnp.float32) + self.dt_bias[...])
        if cfg.dt_min > 0.0 or cfg.dt_max < float("inf"):
            dt = jnp.clip(dt, cfg.dt_min, cfg.dt_max)
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))
        conv_state, ssm_state = cache["conv"][inputs.slots], cache["ssm"][inputs.slots]
        # A row that starts at position 0 starts from zero state (the slot may be reused).
        fresh = inputs.positions[:, 0] == 0
        conv_state = jnp.where(fresh[:, None, None], 0, conv_state)
        ssm_state = jnp.where(fresh[:, None, None, None], 0, ssm_state)
        bias = None if self.conv_bias is None else self.conv_bias[...]
        if t == 1:
            xbc1, conv_state = ops.causal_conv1d_step(
                xbc[:, 0], conv_state, self.conv_weight[...], bias, "silu"
            )
            xs, bs, cs = self._split(xbc1[:, None])
            y, ssm_state = ops.mamba2_step(
                ssm_state, xs[:, 0], dt[:, 0], a, bs[:, 0], cs[:, 0], self.D[...]
            )
            y = y[:, None]
        else:
            xbc, conv_state = ops.causal_conv1d(
                xbc, conv_state, self.conv_weight[...], bias, inputs.lengths, "silu"
            )
            xs, bs, cs = self._split(xbc)
            valid = inputs.valid
            # Padding tokens get dt = 0 and x = 0: the state passes through them unchanged.
            xs = jnp.where(valid[:, :, None, None], xs, 0)
            dt = jnp.where(valid[:, :, None], dt, 0.0)
            y, ssm_state = ops.mamba2_scan(
                xs, dt, a, bs, cs, self.D[...], ssm_state, cfg.chunk_size
            )
        y = ops.gated_rms_norm(
            y.reshape(bsz, t, hs * p),
            z.reshape(bsz, t, hs * p),
            self.norm_weight[...],
            self.eps,
            cfg.intermediate_size // g,
        )
        out = self.out_proj(y.reshape(bsz, t, hs, p).astype(u.dtype))
        new_cache = {
            "conv": cache["conv"].at[inputs.slots].set(conv_state.astype(cache["conv"].dtype)),
            "ssm": cache["ssm"].at[inputs.slots].set(ssm_state.astype(cache["ssm"].dtype)),
        }
        return out, new_cache

    def _split(self, xbc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        bsz, t, _ = xbc.shape
        i, gn = cfg.intermediate_size, cfg.n_groups * cfg.state_size
        xs = xbc[..., :i].reshape(bsz, t, cfg.num_heads, cfg.head_dim)
        bs = xbc[..., i : i + gn].reshape(bsz, t, cfg.n_groups, cfg.state_size)
        cs = xbc[..., i + gn :].reshape(bsz, t, cfg.n_groups, cfg.state_size)
        return xs, bs, cs
