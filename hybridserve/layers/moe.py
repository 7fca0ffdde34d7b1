"""Mixture of experts with a grouped (ragged) expert matmul.

Routers (scores over E experts for a token u):
  sigmoid_group (nemotron_h): `s = sigmoid(u W_r)`; selection on `s + bias` (the correction
    bias only selects); with n_group > 1 each group is scored by the sum of its two best biased
    scores and only the best `topk_group` groups compete; `w_j = s_j / sum_k s_k` over the chosen
    top-k (when norm_topk_prob), times `routed_scaling_factor`.
  softmax_topk (granitemoehybrid): top-k of the raw logits `u W_r`, `w = softmax` over those k.
  softmax_sink (the expert sink): `p = softmax(u W_r)` over the E routed and S shared experts
    together; top-k among the routed only, `w_j = p_j` (no renormalisation: the routed weights
    sum to at most `1 - sum_s p_s`, the mass the shared experts absorb).
Output: `fc2(sum_j w_j expert_j(fc1 u)) + shared(u)` (fc1/fc2: the optional latent projection;
the shared expert reads the un-projected u); with the sink, `shared(u) = sum_s p_s shared_s(u)`
(every shared expert always runs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from backends import fp8, nvfp4
from backends.protocol import Ops
from hybridserve.config import MlpConfig, MoeConfig
from hybridserve.layers.linear import Einsum, param
from hybridserve.layers.mlp import Mlp, activation


def route(cfg: MoeConfig, logits: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Router logits [M, E] (float32) -> (weights [M, k] float32, expert ids [M, k] int32)."""
    if cfg.router == "softmax_topk":
        top_logits, ids = jax.lax.top_k(logits, cfg.top_k)
        return jax.nn.softmax(top_logits, axis=-1), ids
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias if bias is not None else scores
    if cfg.n_group > 1:
        m, e = choice.shape
        grouped = choice.reshape(m, cfg.n_group, e // cfg.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [M, n_group]
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        group_mask = (
            jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(m)[:, None], keep].set(True)
        )
        choice = jnp.where(jnp.repeat(group_mask, e // cfg.n_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, cfg.top_k)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def route_sink(cfg: MoeConfig, logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Expert sink. Logits [M, E + S] (routed first, float32) -> (routed weights [M, k], expert
    ids [M, k] < E, shared weights [M, S]), all softmax probabilities over the E + S experts."""
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs[:, : cfg.num_experts], cfg.top_k)
    return weights, ids, probs[:, cfg.num_experts :]


class Nvfp4Experts(nnx.Module):
    """Routed-expert weights [E, K, N] stored as NVFP4 (`backends.nvfp4`: e2m1 codes, an e4m3
    scale per 16 rows, a float32 scale per expert), quantised from `dense` on creation."""

    def __init__(self, dense: jax.Array, axes: tuple[str | None, ...]) -> None:
        q = nvfp4.quantize(dense)
        self.codes = nnx.Param(q.codes, axes=axes)
        self.scales = nnx.Param(q.scales, axes=axes)
        self.tensor_scale = nnx.Param(q.tensor_scale, axes=(None,))

    def matmul(self, ops: Ops, x: jax.Array, sizes: jax.Array) -> jax.Array:
        """`grouped_matmul(x, w, sizes)` on the 4-bit weights (the fused op)."""
        w = (self.codes[...], self.scales[...], self.tensor_scale[...])
        return ops.nvfp4_grouped_matmul(x, *w, sizes)


class Fp8Experts(nnx.Module):
    """Routed-expert weights [E, K, N] in e4m3 with a float32 weight scale and a static input
    scale per expert (`backends.fp8`, as a ModelOpt FP8 checkpoint stores each expert's
    projections), quantised from `dense` on creation (scale amax / 448 per expert, input scale
    1) until a checkpoint's values replace them."""

    def __init__(self, dense: jax.Array, axes: tuple[str | None, ...]) -> None:
        scale = fp8.tensor_scale(dense, axis=(1, 2))
        self.weight = nnx.Param(fp8.quantize(dense, scale[:, None, None]), axes=axes)
        self.weight_scale = nnx.Param(scale, axes=(None,))
        self.input_scale = nnx.Param(jnp.ones_like(scale), axes=(None,))

    def matmul(self, ops: Ops, x: jax.Array, sizes: jax.Array) -> jax.Array:
        """`grouped_matmul(x, w, sizes)` on the e4m3 weights (the FP8 op)."""
        scales = (self.weight_scale[...], self.input_scale[...])
        return ops.fp8_grouped_matmul(x, self.weight[...], *scales, sizes)


EXPERT_STACKS = ("up", "gate", "down")  # the routed-expert weights a checkpoint may hold in FP8


class Moe(nnx.Module):
    """Routed experts plus an always-on shared expert (see the module docstring)."""

    def __init__(
        self, hidden: int, cfg: MoeConfig, ops: Ops, *, dtype: jnp.dtype, rngs: nnx.Rngs | None
    ) -> None:
        e, f = cfg.num_experts, cfg.intermediate_size
        din = cfg.latent_size or hidden
        sink = cfg.router == "softmax_sink"
        scored = e + cfg.num_shared_experts if sink else e  # the sink scores the shared experts
        self.router = param(rngs, (hidden, scored), ("embed", None), jnp.float32, fan_in=hidden)
        self.router_bias = (
            param(None, (e,), (None,), jnp.float32, init="zeros")
            if cfg.router == "sigmoid_group"
            else None
        )
        ax_in, ax_out = (None, None, "expert_mlp"), (None, "expert_mlp", None)
        self.up = param(rngs, (e, din, f), ax_in, dtype, fan_in=din)
        self.gate = param(rngs, (e, din, f), ax_in, dtype, fan_in=din) if cfg.gated else None
        self.down = param(rngs, (e, f, din), ax_out, dtype, fan_in=f)
        if cfg.expert_format == "nvfp4":  # the shared experts stay in the model dtype
            self.up = Nvfp4Experts(self.up[...], ax_in)
            self.down = Nvfp4Experts(self.down[...], ax_out)
            self.gate = None if self.gate is None else Nvfp4Experts(self.gate[...], ax_in)
        kw = dict(dtype=dtype, rngs=rngs, bias=cfg.bias)
        if cfg.latent_size:
            self.fc1_latent = Einsum("md,dl->ml", (hidden, din), ("embed", None), **kw)
            self.fc2_latent = Einsum("ml,ld->md", (din, hidden), (None, "embed"), **kw)
        else:
            self.fc1_latent = self.fc2_latent = None
        self.shared = (
            Mlp(
                hidden,
                MlpConfig(cfg.shared_intermediate_size, cfg.activation, cfg.gated, cfg.bias),
                dtype=dtype,
                rngs=rngs,
            )
            if cfg.shared_intermediate_size and not sink
            else None
        )
        # The sink's shared experts, stacked: [S, D, Fs] / [S, Fs, D].
        fs, ns = cfg.shared_intermediate_size, cfg.num_shared_experts
        stacked_in, stacked_out = (None, "embed", "mlp"), (None, "mlp", "embed")
        self.sink_up = param(rngs, (ns, hidden, fs), stacked_in, dtype, hidden) if sink else None
        self.sink_gate = (
            param(rngs, (ns, hidden, fs), stacked_in, dtype, hidden) if sink and cfg.gated else None
        )
        self.sink_down = param(rngs, (ns, fs, hidden), stacked_out, dtype, fs) if sink else None
        self.cfg = cfg
        self.ops = ops

    def __call__(self, u: jax.Array) -> jax.Array:
        cfg = self.cfg
        shape = u.shape
        x = u.reshape(-1, shape[-1])  # [M, D]
        logits = x.astype(jnp.float32) @ self.router[...]
        bias = None if self.router_bias is None else self.router_bias[...]
        if cfg.router == "softmax_sink":
            weights, ids, sink = route_sink(cfg, logits)
        else:
            weights, ids = route(cfg, logits, bias)
        h = self.fc1_latent(x) if self.fc1_latent is not None else x
        flat = ids.reshape(-1)
        order = jnp.argsort(flat)
        token = order // cfg.top_k
        sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
        hs = h[token]
        act = self._experts(self.up, hs, sizes)
        if self.gate is not None:
            act = activation(cfg.activation, self._experts(self.gate, hs, sizes)) * act
        else:
            act = activation(cfg.activation, act)
        out = self._experts(self.down, act.astype(h.dtype), sizes).astype(jnp.float32)
        out = out * weights.reshape(-1)[order][:, None]
        routed = jnp.zeros(h.shape, jnp.float32).at[token].add(out).astype(u.dtype)
        if self.fc2_latent is not None:
            routed = self.fc2_latent(routed)
        if self.shared is not None:
            routed = routed + self.shared(x)
        if self.sink_up is not None:
            routed = routed + self._sink_experts(x, sink).astype(routed.dtype)
        return routed.reshape(shape)

    def to_fp8(self, name: str) -> None:
        """Store the routed-expert stack `name` (one of `EXPERT_STACKS`) as `Fp8Experts`."""
        w = getattr(self, name)
        if not isinstance(w, nnx.Param):
            raise ValueError(f"expert stack {name!r} is {type(w).__name__}, not a dense weight")
        setattr(self, name, Fp8Experts(w[...], w.get_metadata().get("axes")))

    def _experts(
        self, w: nnx.Param | Nvfp4Experts | Fp8Experts, x: jax.Array, sizes: jax.Array
    ) -> jax.Array:
        if isinstance(w, Nvfp4Experts | Fp8Experts):
            return w.matmul(self.ops, x, sizes)
        return self.ops.grouped_matmul(x, w[...], sizes)

    def _sink_experts(self, x: jax.Array, sink: jax.Array) -> jax.Array:
        """`sum_s p_s shared_s(x)`: every shared expert on every token, weighted by its
        probability. x [M, D], sink [M, S] -> [M, D] float32."""
        h = jnp.einsum("md,sdf->msf", x, self.sink_up[...])
        if self.sink_gate is not None:
            gate = jnp.einsum("md,sdf->msf", x, self.sink_gate[...])
            h = activation(self.cfg.activation, gate) * h
        else:
            h = activation(self.cfg.activation, h)
        out = jnp.einsum("msf,sfd->msd", h, self.sink_down[...]).astype(jnp.float32)
        return jnp.einsum("msd,ms->md", out, sink)
