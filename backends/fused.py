"""Signatures of the fused decode ops: a projection with its norm and residual, and the whole
one-token Mamba2 mixer between its projections, on states that stay in the cache region.

A decode step at small batch is bandwidth-bound and launch-bound: every op outside a GEMM is a
kernel of its own (a norm, an activation, a residual add, a slice, a gather and a scatter of the
conv state). These two ops take the work that surrounds the GEMMs into them, so that a layer is a
few kernels (`backends.protocol` holds the other ops; the xla references compose the same maths
from plain jax and the other references).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Norm:
    """The norm `linear` applies to its input first.

    RMSNorm (`gate` None): `n = x / sqrt(mean(x^2) + eps)` over x's last axis, or over each
    group of `group_size` channels when set (float32), `x' = weight * n.astype(x.dtype)`
    (`rms_norm`). Gated group RMSNorm (`gate` given): the same of `g = x * silu(z)` with
    `z = gate[..., gate_offset : gate_offset + K]` (`gated_rms_norm`)."""

    weight: Array
    eps: float
    gate: Array | None = None
    gate_offset: int = 0
    group_size: int = 0


class Linear(Protocol):
    def __call__(
        self,
        x: Array,
        w: Array,
        bias: Array | None = None,
        norm: Norm | None = None,
        activation: str | None = None,
        residual: Array | None = None,
        scale: float = 1.0,
    ) -> Array:
        """`out = residual + scale * act(norm(x) w^T + bias)` (each part optional), every step
        rounded to x's dtype as the unfused ops round it.

        Args:
          x: [..., K]. w: [N, K] (one row per output feature: the transposed kernel, read
          row by row). bias: [N]. norm: see `Norm` (its weight [K]). activation: None, "relu2"
          (squared ReLU) or "silu". residual: [..., N] (x's leading axes).
        Returns: [..., N] in x's dtype.
        """


@dataclasses.dataclass(frozen=True)
class MambaDecode:
    """Where `mamba2_decode_paged` finds its inputs and states (all static).

    The projection's columns `cols [B, Wc]` hold x|B|C (`xbc_offset`: Hs*P channels of x, then
    G*Ns of B and of C), dt (`dt_offset`: Hs) and the gate z (`z_offset`: Hs*P). A state page
    holds the conv state from word `conv_offset` ([C, W-1] channel-major when `conv_layout` is
    "DS", [W-1, C] when "SD", C = Hs*P + 2*G*Ns, in `conv_dtype`, two 16-bit values to a word
    or one 32-bit) and the float32 ssm state [Hs, P, Ns] from word `ssm_offset`; page p is
    region rows [p * page_rows, (p + 1) * page_rows)."""

    heads: int
    head_dim: int
    groups: int
    state_size: int
    conv_width: int
    xbc_offset: int
    dt_offset: int
    z_offset: int
    conv_layout: str
    conv_dtype: str
    conv_offset: int
    ssm_offset: int
    page_rows: int
    dt_min: float = 0.0
    dt_max: float = float("inf")

    @property
    def channels(self) -> int:
        """Conv channels: x, then B, then C."""
        return self.heads * self.head_dim + 2 * self.groups * self.state_size


class Mamba2DecodePaged(Protocol):
    def __call__(
        self,
        region: Array,
        pages: Array,
        fresh: Array,
        cols: Array,
        conv_weight: Array,
        conv_bias: Array | None,
        dt_bias: Array,
        a_log: Array,
        d: Array,
        geo: MambaDecode,
    ) -> tuple[Array, Array]:
        """One token of the Mamba2 mixer between its projections, states in place:
          u = cols[:, xbc]: x|B|C before the conv;  window = [conv state | u] per channel
          v = silu(sum_k w[c, k] window[c, k] + bias[c]);  conv state <- window[:, 1:]
          dt = softplus(cols[:, dt] + dt_bias) (clipped to [dt_min, dt_max] when set)
          s' = exp(-dt exp(a_log)) s + dt (x outer b);  y = s' . c + d x   (`mamba2_step`)
          g = y * silu(z),  z = cols[:, z]: the gated norm's product, which the output
          projection normalises per group (`Norm` with `group_size`, no gate)
        with x, b, c the parts of v (y and g in float32, g rounded to cols' dtype). Row i's
        states live in page `pages[i]`; `fresh[i]` rows start from zero states (a reused
        page); rows on page 0 (padding) store nothing.

        Args: region int32 words [1, R, Wd]; pages, fresh [B] int32; cols [B, Wc];
          conv_weight [C, W]; conv_bias [C] or None; dt_bias, a_log, d [Hs] float32.
        Returns: g [B, Hs * P] in cols' dtype, and the region (donated: written in place).
        """
