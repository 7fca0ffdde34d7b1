"""The Mamba2 mixer.

For an input u [B, T, D]:
  z, x, b, c, dt = u W_z, u W_x, u W_b, u W_c, u W_dt          (x: [Hs, P], b, c: [G, Ns])
  x, b, c = silu(causal_depthwise_conv_W([x | b | c]))         (conv state: last W-1 inputs)
  dt = softplus(dt + dt_bias), clipped to the config's [dt_min, dt_max] (no clamp by default)
  a = -exp(A_log)
  s_t = exp(dt_t a) s_{t-1} + dt_t (x_t outer b_t);  y_t = s_t c_t + D x_t   (per head)
  out = W_out (gated_group_rmsnorm(y, z))                      (norm of y * silu(z) per group)
Prefill runs the chunked SSD scan from the carried state (the rows of a packed prefill that
continue one sequence are joined by `layers.mamba2_chain`); one-token decode runs the recurrent
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

from backends.fused import Norm
from backends.protocol import Ops
from backends.ssd_rows import join_rows
from hybridserve.cache.mamba_view import (
    in_place,
    read_conv,
    read_mamba,
    write_conv,
    write_mamba,
)
from hybridserve.config import MambaConfig
from hybridserve.layers.linear import Einsum, param
from hybridserve.layers.mamba2_chain import carry_conv
from hybridserve.layers.mamba2_decode import decode_fused, decode_ranks, step_in_place
from hybridserve.layers.merged import MergedProjection, merge_per_rank
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
        self.conv_merged: nnx.Param | None = nnx.data(None)
        self.conv_bias_merged: nnx.Param | None = nnx.data(None)
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
        # the conv taps of each rank's x|B|C channels, in the order of its merged columns and of
        # its state page: one conv per decode step (`_decode_merged`)
        tp, width = mesh.shape["tp"], self.cfg.conv_kernel
        taps = {k: self.conv_weight[k][...] for k in ("x", "b", "c")}
        merged = merge_per_rank(taps, mesh).reshape(tp, -1, width)
        self.conv_merged = nnx.data(nnx.Param(merged, axes=("ranks", None, None)))
        if self.conv_bias is not None:
            biases = {k: self.conv_bias[k][...] for k in ("x", "b", "c")}
            self.conv_bias_merged = nnx.data(
                nnx.Param(merge_per_rank(biases, mesh), axes=("ranks", None))
            )

    def _project(self, u: jax.Array) -> dict[str, jax.Array]:
        """z, x [B, T, Hs, P], b, c [B, T, G, Ns] and dt [B, T, Hs] (before its bias)."""
        if self.in_proj is not None:
            return self.in_proj(u)
        z, x, b, c = self.in_z(u), self.in_x(u), self.in_b(u), self.in_c(u)
        return {"z": z, "x": x, "b": b, "c": c, "dt": self.in_dt(u)}

    def to_rows(self) -> None:
        """At TP 1, after `merge_projections`: the merged input and the output projection as
        rows (`Einsum.to_rows`), for `fused`."""
        self.in_proj.to_rows(self.ops)
        self.out_proj.to_rows(self.ops)

    def __call__(
        self, u: jax.Array, region: jax.Array, inputs: StepInput, layer: int
    ) -> tuple[jax.Array, jax.Array]:
        """The mixer of the normed input u [B, T, D] -> ([B, T, D], region)."""
        acc = inputs.layout.layers[layer]
        tp, t = inputs.layout.tp, u.shape[1]
        # one-token decode updates the ssm state in place; only the conv state moves
        paged = t == 1 and in_place(acc) and (tp == 1 or inputs.layout.mesh is not None)
        if paged and self.in_proj is not None:
            y, z, region = decode_ranks(self, u, region, acc, inputs)
            return self._out(y, z, u), region
        proj = self._project(u)
        y, region = self._mix(proj, region, inputs, layer)
        return self._out(y, proj["z"], u), region

    def fused(
        self,
        h: jax.Array,
        norm: Norm,
        scale: float,
        region: jax.Array,
        inputs: StepInput,
        layer: int,
    ) -> tuple[jax.Array, jax.Array]:
        """The whole residual step `h + scale * mixer(norm(h))` over rows (`to_rows`): the
        norm inside the input projection, the gated norm and the residual add inside the
        output projection; a one-token step runs `mamba2_decode_paged` between them."""
        cfg, acc = self.cfg, inputs.layout.layers[layer]
        bsz, t, _ = h.shape
        cols = self.in_proj.ranks(h, norm)  # [B, T, 1, Wr]
        group = cfg.intermediate_size // cfg.n_groups
        if t == 1 and in_place(acc):  # y * silu(z) from the op: the norm is per group only
            y, region = decode_fused(self, cols[:, 0, 0], region, acc, inputs)
            out_norm = Norm(self.norm_weight[...], self.eps, group_size=group)
        else:
            proj = {part.name: self.in_proj.cut(cols, part.name) for part in self.in_proj.parts}
            y, region = self._mix(proj, region, inputs, layer)
            z_at = self.in_proj.part("z").offset
            out_norm = Norm(self.norm_weight[...], self.eps, cols[:, :, 0], z_at, group)
        y = y.reshape(bsz, t, cfg.num_heads, cfg.head_dim)
        return self.out_proj(y, norm=out_norm, residual=h, scale=scale), region

    def _mix(
        self, proj: dict[str, jax.Array], region: jax.Array, inputs: StepInput, layer: int
    ) -> tuple[jax.Array, jax.Array]:
        """Conv, dt and the scan (or one-token step) from the projections -> (y [B, T, Hs, P],
        region)."""
        cfg, ops = self.cfg, self.ops
        acc = inputs.layout.layers[layer]
        tp = inputs.layout.tp
        pages = inputs.tables[acc.group]
        bsz, t = proj["dt"].shape[:2]
        paged = t == 1 and in_place(acc) and (tp == 1 or inputs.layout.mesh is not None)
        seqs = {k: proj[k] for k in ("x", "b", "c")}
        dt = self._dt(proj["dt"])
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))
        page_rows = inputs.layout.page_rows
        fresh = inputs.fresh  # a row at position 0 starts from zero state (the page is reused)
        # packed prefill over several rows: `mamba2_chain` (a one-row program's row is a first)
        chained = inputs.continues is not None and t > 1 and bsz > 1
        if paged:
            x_st, b_st, c_st, conv_rows = read_conv(region, acc, tp, pages, page_rows)
        else:
            x_st, b_st, c_st, ssm_state, region = read_mamba(region, acc, tp, pages, page_rows)
            zero = fresh | (inputs.continues > 0) if chained else fresh
            ssm_state = jnp.where(zero[:, None, None, None], 0, ssm_state)
        states = {
            k: jnp.where(fresh[:, None, None], 0, st)
            for k, st in (("x", x_st), ("b", b_st), ("c", c_st))
        }
        before = dict(states)  # the conv states the step starts from
        outs = {}
        for key, seq in seqs.items():
            weight = self.conv_weight[key][...]
            weight = weight.reshape(-1, weight.shape[-1])
            bias = None if self.conv_bias is None else self.conv_bias[key][...].reshape(-1)
            flat = seq.reshape(bsz, t, -1)
            if chained:
                states[key] = carry_conv(flat, states[key], inputs.continues)
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
            y, region = step_in_place(self, region, acc, pages, fresh, inputs, *step)
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
            start_state = ssm_state
            y, ssm_state = ops.mamba2_scan(
                xs, dt, a, bs, cs, self.D[...], ssm_state, cfg.chunk_size
            )
            if inputs.commit is not None:  # rows with drafts keep the state before them
                ssm_state, states = self._committed(
                    inputs, seqs, before, states, (xs, dt, a, bs, cs, start_state, ssm_state)
                )
            if chained:
                y, ssm_state = join_rows(y, ssm_state, dt, a, cs, inputs.continues)
                pages = jnp.where(inputs.last, pages, 0)  # one row per sequence stores
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
        return y, region

    def _committed(
        self,
        inputs: StepInput,
        seqs: dict[str, jax.Array],
        before: dict[str, jax.Array],
        after: dict[str, jax.Array],
        scan: tuple[jax.Array, ...],
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The states after each row's first `commit` tokens instead of all `lengths` (a
        speculative step: the drafts at the end must not move a state that cannot be rolled
        back). The ssm state comes from a second scan with the drafts' dt and x zeroed (the state
        passes through them), run only when some row has drafts; the conv states are the last
        W - 1 inputs before the drafts."""
        xs, dt, a, bs, cs, start, full = scan
        commit, lengths = inputs.commit, inputs.lengths
        t = xs.shape[1]

        def rescan(_: None) -> jax.Array:
            keep = jnp.arange(t)[None, :] < commit[:, None]
            xk = jnp.where(keep[:, :, None, None], xs, 0)
            dk = jnp.where(keep[:, :, None], dt, 0.0)
            _, st = self.ops.mamba2_scan(xk, dk, a, bs, cs, self.D[...], start, self.cfg.chunk_size)
            return st.astype(full.dtype)

        ssm = jax.lax.cond(jnp.any(commit < lengths), rescan, lambda _: full, None)
        states = {}
        for key, seq in seqs.items():
            flat = seq.reshape(seq.shape[0], t, -1)
            old = jnp.swapaxes(before[key].astype(flat.dtype), 1, 2)  # [B, W - 1, C]
            rows = old.shape[1]
            both = jnp.concatenate([old, flat], axis=1)  # inputs from W - 1 before the chunk
            idx = commit[:, None] + jnp.arange(rows)[None, :]  # the W - 1 before `commit`
            kept = jnp.swapaxes(jnp.take_along_axis(both, idx[..., None], axis=1), 1, 2)
            drafts = (commit < lengths)[:, None, None]
            states[key] = jnp.where(drafts, kept.astype(after[key].dtype), after[key])
        return ssm, states

    def _dt(self, raw: jax.Array) -> jax.Array:
        """dt = softplus(raw + dt_bias) in float32, clipped to the config's range if any."""
        cfg = self.cfg
        dt = jax.nn.softplus(raw.astype(jnp.float32) + self.dt_bias[...])
        if cfg.dt_min > 0.0 or cfg.dt_max < float("inf"):
            dt = jnp.clip(dt, cfg.dt_min, cfg.dt_max)
        return dt

    def _out(self, y: jax.Array, z: jax.Array, u: jax.Array) -> jax.Array:
        """out = W_out (gated_group_rmsnorm(y, z)), y and z [B, T, Hs, P] -> [B, T, D]."""
        cfg = self.cfg
        bsz, t = u.shape[:2]
        width = cfg.num_heads * cfg.head_dim
        y = self.ops.gated_rms_norm(
            y.reshape(bsz, t, width),
            z.reshape(bsz, t, width),
            self.norm_weight[...],
            self.eps,
            cfg.intermediate_size // cfg.n_groups,
        )
        return self.out_proj(y.reshape(bsz, t, cfg.num_heads, cfg.head_dim).astype(u.dtype))
