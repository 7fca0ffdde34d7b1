"""Mamba2 SSD in torch: the chunked scan (same block decomposition as the `xla` reference, see
backends/xla/ssd.py) and the one-token state update, all in float32."""

from __future__ import annotations

import jax
import torch

from backends.protocol import register
from backends.torch.bridge import call
from backends.xla.ssd_paged import through


def _heads_from_groups(m: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, Ns] -> [..., Hs, Ns]: head h reads group h // (Hs / G)."""
    return torch.repeat_interleave(m, num_heads // m.shape[-2], dim=-2)


def _scan(xt, dtt, at, bt, ct, dt_skip, h0, chunk_size: int):
    bsz, t, nh, p = xt.shape
    length = min(chunk_size, t)
    pad = (-t) % length
    xs, dts = xt.float(), dtt.float()
    bs = _heads_from_groups(bt.float(), nh)
    cs_ = _heads_from_groups(ct.float(), nh)
    if pad:
        # Padding with dt = 0 and x = 0 leaves the state untouched.
        xs, dts, bs, cs_ = (
            torch.nn.functional.pad(v, [0, 0] * (v.ndim - 2) + [0, pad]) for v in (xs, dts, bs, cs_)
        )
    nc = (t + pad) // length
    xs, dts, bs, cs_ = (v.reshape(bsz, nc, length, *v.shape[2:]) for v in (xs, dts, bs, cs_))
    cum = torch.cumsum(dts * at.float(), dim=2)  # [B, nc, L, Hs]
    seg = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [B, nc, i, j, Hs]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=xt.device))[
        None, None, :, :, None
    ]
    decay = torch.where(causal, torch.exp(torch.where(causal, seg, 0.0)), 0.0)
    scores = torch.einsum("bzihn,bzjhn->bzijh", cs_, bs) * decay
    y = torch.einsum("bzijh,bzjh,bzjhp->bzihp", scores, dts, xs)
    to_end = torch.exp(cum[:, :, -1:, :] - cum)
    chunk_states = torch.einsum("bzjh,bzjh,bzjhp,bzjhn->bzhpn", to_end, dts, xs, bs)
    chunk_decay = torch.exp(cum[:, :, -1, :])  # [B, nc, Hs]
    h = h0.float()
    starts = []
    for z in range(nc):
        starts.append(h)
        h = chunk_decay[:, z, :, None, None] * h + chunk_states[:, z]
    starts = torch.stack(starts, dim=1)  # [B, nc, Hs, P, Ns]: state entering each chunk
    y = y + torch.einsum("bzih,bzhpn,bzihn->bzihp", torch.exp(cum), starts, cs_)
    y = y + dt_skip.float()[None, None, None, :, None] * xs
    y = y.reshape(bsz, nc * length, nh, p)[:, :t]
    return y.to(xt.dtype), h


@register("mamba2_scan", "torch")
def mamba2_scan(
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
    initial_state: jax.Array,
    chunk_size: int,
) -> tuple[jax.Array, jax.Array]:
    bsz, _, nh, p = x.shape
    specs = (
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct((bsz, nh, p, b.shape[-1]), "float32"),
    )

    def fn(xt, dtt, at, bt, ct, dt_skip, h0):
        return _scan(xt, dtt, at, bt, ct, dt_skip, h0, chunk_size)

    return call(fn, specs, x, dt, a, b, c, d, initial_state)


@register("mamba2_step", "torch")
def mamba2_step(
    state: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    def fn(st, xt, dtt, at, bt, ct, dt_skip):
        nh = xt.shape[1]
        x32, dt32 = xt.float(), dtt.float()
        bh = _heads_from_groups(bt.float(), nh)  # [B, Hs, Ns]
        ch = _heads_from_groups(ct.float(), nh)
        decay = torch.exp(dt32 * at.float())  # [B, Hs]
        new_state = decay[:, :, None, None] * st.float() + torch.einsum(
            "bh,bhp,bhn->bhpn", dt32, x32, bh
        )
        y = torch.einsum("bhpn,bhn->bhp", new_state, ch) + dt_skip.float()[None, :, None] * x32
        return y.to(xt.dtype), new_state

    specs = (
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(state.shape, "float32"),
    )
    return call(fn, specs, state, x, dt, a, b, c, d)


# The region is a JAX buffer: torch updates the gathered states, JAX scatters them back.
mamba2_step_paged = register("mamba2_step_paged", "torch")(through(mamba2_step))
