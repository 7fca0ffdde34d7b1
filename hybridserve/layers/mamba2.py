"""The Mamba2 mixer.

For an input u [B, T, D]:
  z, x, b, c, dt = u W_z, u W_x, u W_b, u W_c, u W_dt          (x: [Hs, P], b, c: [G, Ns])
  x, b, c = silu(causal_depthwise_conv_W([x | b | c]))         (conv state: last W-1 inputs)
  dt = softplus(dt + dt_bias), clipped to the config's [dt_min, dt_max] (no clamp by default)
  a = -exp(A_log)
  s_t = exp(dt_t a) s_{t-1} + dt_t (x_t outer b_t);  y_t = s_t c_t + D x_t   (per head)
  out = W_out (gated_group_rmsnorm(y, z))                      (norm of y * silu(z) per group)
Prefill runs the chunked SSD scan from the carried state; one-token decode runs the recurrent
update. The input projection is loaded as five kernels (the checkpoint loader splits HF's fused
`in_proj`), which the runner merges into one per-rank kernel (`merge_projections`,
`layers.merged`): one GEMM per step.
The conv states of x, b and c and the ssm state live in the request's state page of the layer's
region (see `cache.mamba_view`); conv weights are kept per x / b / c so that TP shards them with
their heads and groups. A decode step updates the ssm state where it lies
(`Ops.mamba2_step_paged`, per TP rank over its own shard) and moves only the conv state through
a gather and a scatter; prefill reads and writes whole state pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from backends.protocol import Ops
from hybridserve.cache.mamba_view import (
    in_place,
    read_conv,
    read_mamba,
    state_offset,
    write_conv,
    write_mamba,
)
from hybridserve.cache.view import MambaAccess, duplicate
from hybridserve.config import MambaConfig
from hybridserve.layers.linear import Einsum, param
from hybridserve.layers.merged import MergedProjection
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
        hs, p, g, ns, w = cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.state_size, cfg.conv_kernel
        kw = dict(dtype=dtype, rngs=rngs, bias=cfg.use_bias)
        self.in_z = Einsum("btd,dhp->bthp", (hidden, hs, p), ("embed", "ssm_heads", None), **kw)
        self.in_x = Einsum("btd,dhp->bthp", (hidden, hs, p), ("embed", "ssm_heads", None), **kw)
        self.in_b = Einsum("btd,dgn->btgn", (hidden, g, ns), ("embed", "ssm_groups", None), **kw)
        self.in_c = Einsum("btd,dgn->btgn", (hidden, g, ns), ("embed", "ssm_groups", None), **kw)
        self.in_dt = Einsum("btd,dh->bth", (hidden, hs), ("embed", "ssm_heads"), **kw)
        # Depthwise conv taps per channel of x, B and C (tap W-1 is the current token).
        shapes = {
            "x": ((hs, p), "ssm_heads"),
            "b": ((g, ns), "ssm_groups"),
            "c": ((g, ns), "ssm_groups"),
        }
        self.conv_weight = nnx.Dict(
            {
                k: param(rngs, (*shp, w), (ax, None, None), dtype, fan_in=w)
                for k, (shp, ax) in shapes.items()
            }
        )
        self.conv_bias = (
            nnx.Dict(
                {
                    k: param(None, shp, (ax, None), dtype, init="zeros")
                    for k, (shp, ax) in shapes.items()
                }
            )
            if cfg.use_conv_bias
            else None
        )
        self.dt_bias = param(None, (hs,), ("ssm_heads",), jnp.float32, init="zeros")
        self.A_log = param(None, (hs,), ("ssm_heads",), jnp.float32, init="zeros")
        self.D = param(None, (hs,), ("ssm_heads",), jnp.float32, init="ones")
        self.norm_weight = param(None, (cfg.intermediate_size,), (None,), dtype, init="ones")
        self.out_proj = Einsum("bthp,hpd->btd", (hs, p, hidden), ("ssm_heads", None, "embed"), **kw)
        self.in_proj: MergedProjection | None = nnx.data(None)  # `merge_projections`
        self.cfg = cfg
        self.eps = eps
        self.ops = ops

    def merge_projections(self, mesh: Mesh) -> None:
        """Replace in_z, in_x, in_b, in_c and in_dt by one kernel merged per TP rank of `mesh`
        (`layers.merged`); the five are dropped. Idempotent."""
        if self.in_proj is not None:
            return
        names = {"z": "in_z", "x": "in_x", "b": "in_b", "c": "in_c", "dt": "in_dt"}
        self.in_proj = nnx.data(
            MergedProjection({k: getattr(self, v) for k, v in names.items()}, mesh)
        )
        for attr in names.values():
            setattr(self, attr, None)

    def _project(self, u: jax.Array) -> dict[str, jax.Array]:
        """z, x [B, T, Hs, P], b, c [B, T, G, Ns] and dt [B, T, Hs] (before its bias)."""
        if self.in_proj is not None:
            return self.in_proj(u)
        z, x, b, c = self.in_z(u), self.in_x(u), self.in_b(u), self.in_c(u)
        return {"z": z, "x": x, "b": b, "c": c, "dt": self.in_dt(u)}

    def __call__(
        self, u: jax.Array, region: jax.Array, inputs: StepInput, layer: int
    ) -> tuple[jax.Array, jax.Array]:
        cfg, ops = self.cfg, self.ops
        acc = inputs.layout.layers[layer]
        tp = inputs.layout.tp
        pages = inputs.tables[acc.group]
        bsz, t, _ = u.shape
        hs, p = cfg.num_heads, cfg.head_dim
        proj = self._project(u)
        z = proj["z"]
        seqs = {k: proj[k] for k in ("x", "b", "c")}
        dt = jax.nn.softplus(proj["dt"].astype(jnp.float32) + self.dt_bias[...])
        if cfg.dt_min > 0.0 or cfg.dt_max < float("inf"):
            dt = jnp.clip(dt, cfg.dt_min, cfg.dt_max)
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))
        page_rows = inputs.layout.page_rows
        fresh = inputs.fresh  # a row at position 0 starts from zero state (the page is reused)
        # one-token decode updates the ssm state in place; only the conv state moves
        paged = t == 1 and in_place(acc) and (tp == 1 or inputs.layout.mesh is not None)
        if paged:
            x_st, b_st, c_st, conv_rows = read_conv(region, acc, tp, pages, page_rows)
        else:
            x_st, b_st, c_st, ssm_state, region = read_mamba(region, acc, tp, pages, page_rows)
            ssm_state = jnp.where(fresh[:, None, None, None], 0, ssm_state)
        states = {
            k: jnp.where(fresh[:, None, None], 0, st)
            for k, st in (("x", x_st), ("b", b_st), ("c", c_st))
        }
        outs = {}
        for key, seq in seqs.items():
            weight = self.conv_weight[key][...]
            weight = weight.reshape(-1, weight.shape[-1])
            bias = None if self.conv_bias is None else self.conv_bias[key][...].reshape(-1)
            flat = seq.reshape(bsz, t, -1)
            if t == 1:
                y, states[key] = ops.causal_conv1d_step(
                    flat[:, 0], states[key].astype(flat.dtype), weight, bias, "silu"
                )
                y = y[:, None]
            else:
                y, states[key] = ops.causal_conv1d(
                    flat, states[key].astype(flat.dtype), weight, bias, inputs.lengths, "silu"
                )
            outs[key] = y.reshape(seq.shape)
        xs, bs, cs = outs["x"], outs["b"], outs["c"]
        if paged:
            region = write_conv(
                region, acc, tp, pages, page_rows, states["x"], states["b"], states["c"], conv_rows
            )
            step = (xs[:, 0], dt[:, 0], a, bs[:, 0], cs[:, 0], self.D[...])
            y, region = self._step_in_place(region, acc, pages, fresh, inputs, *step)
            y = y[:, None]
        elif t == 1:
            y, ssm_state = ops.mamba2_step(
                ssm_state, xs[:, 0], dt[:, 0], a, bs[:, 0], cs[:, 0], self.D[...]
            )
            y = y[:, None]
        else:
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
            cfg.intermediate_size // cfg.n_groups,
        )
        out = self.out_proj(y.reshape(bsz, t, hs, p).astype(u.dtype))
        if not paged:
            region = write_mamba(
                region,
                acc,
                tp,
                pages,
                page_rows,
                states["x"],
                states["b"],
                states["c"],
                ssm_state,
            )
        return out, region

    def _step_in_place(
        self,
        region: jax.Array,
        acc: MambaAccess,
        pages: jax.Array,
        fresh: jax.Array,
        inputs: StepInput,
        x: jax.Array,
        dt: jax.Array,
        a: jax.Array,
        b: jax.Array,
        c: jax.Array,
        d: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        """`mamba2_step_paged` over the region: y [B, Hs, P] and the region. At TP > 1 each
        rank updates its own heads' states in its own shard (`shard_map`); B and C groups
        fewer than tp are duplicated first, as their pages hold them."""
        layout = inputs.layout
        tp = layout.tp
        fresh = fresh.astype(jnp.int32)

        def step(shard, pages, fresh, x, dt, a, b, c, d):
            return self.ops.mamba2_step_paged(
                shard, pages, fresh, x, dt, a, b, c, d, state_offset(acc), layout.page_rows
            )

        if tp == 1:
            return step(region, pages, fresh, x, dt, a, b, c, d)
        dup = acc.group_dup(tp)
        b, c = duplicate(b, 1, dup), duplicate(c, 1, dup)
        heads, shard = P(None, "tp", None), P("tp", None, None)
        specs = (shard, P(), P(), heads, P(None, "tp"), P("tp"), heads, heads, P("tp"))
        run = jax.shard_map(
            step, mesh=layout.mesh, in_specs=specs, out_specs=(heads, shard), check_vma=False
        )
        return run(region, pages, fresh, x, dt, a, b, c, d)
