"""NVFP4: 4-bit floats (e2m1) with an fp8 (e4m3) scale per 16 values and a float32 scale per
tensor, for the routed-expert weights of an MoE layer `w [E, K, N]` (x [M, K] @ w[e]).

Value of element (e, k, n):
  w = e2m1(code[e, k, n]) * float(scale[e, k // 16, n]) * tensor_scale[e]
with e2m1 a sign bit, two exponent bits and one mantissa bit: the magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}  (exponent 0: 0.5 m; exponent e > 0: 2^(e-1) (1 + m / 2)).

Storage (`Nvfp4Weight`):
  codes:        uint8 [E, K/2, N], two codes per byte. K is cut into blocks of 32 rows; byte row
                16 j + r holds row 32 j + r in its low nibble and row 32 j + 16 + r in its high
                nibble (r < 16): each nibble plane of a block is one whole scale group, so a
                kernel decodes a [16, N] tile per plane and multiplies it by one scale row.
  scales:       float8_e4m3fn [E, K/16, N], one per 16 consecutive rows of a column.
  tensor_scale: float32 [E], `amax(|w[e]|) / (6 * 448)`: block scales then fit e4m3 (max 448).

Quantisation (`quantize`): block scale `s = amax(block) / 6 / tensor_scale`, rounded to e4m3 and
moved up one e4m3 step when rounding went below s (so `|w| / scale <= 6`: no value is clipped),
then each value to the nearest e2m1 magnitude. Error bound per element: half the gap between
the two e2m1 magnitudes around `|w| / S` times `S = scale * tensor_scale`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

E2M1_MAX = 6.0
E4M3_MAX = 448.0
GROUP = 16  # values per fp8 scale
BLOCK = 32  # K rows per packed block (two scale groups, one per nibble plane)
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 codes 0..7 (bit 3 is the sign)


class Nvfp4Weight(NamedTuple):
    """Routed-expert weights in NVFP4 (layout in the module docstring)."""

    codes: jax.Array  # uint8 [E, K/2, N]
    scales: jax.Array  # float8_e4m3fn [E, K/16, N]
    tensor_scale: jax.Array  # float32 [E]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, K, N) of the dense weight."""
        e, half, n = self.codes.shape
        return e, 2 * half, n


def e2m1_value(code: jax.Array) -> jax.Array:
    """float32 value of 4-bit e2m1 codes (uint8 holding 0..15), by arithmetic (no table, so it
    also runs inside Triton kernels)."""
    code = code.astype(jnp.int32)
    exp, man = (code >> 1) & 3, (code & 1).astype(jnp.float32)
    power = jnp.where(exp == 1, 1.0, jnp.where(exp == 2, 2.0, 4.0))
    mag = jnp.where(exp == 0, 0.5 * man, power * (1.0 + 0.5 * man))
    return jnp.where(code >= 8, -mag, mag)


def _pack(codes: jax.Array) -> jax.Array:
    """[E, K, N] codes (0..15) -> [E, K/2, N] bytes in the block-planar order."""
    e, k, n = codes.shape
    blocks = codes.astype(jnp.uint8).reshape(e, k // BLOCK, 2, BLOCK // 2, n)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(e, k // 2, n)


def unpack(packed: jax.Array) -> jax.Array:
    """[E, K/2, N] bytes -> [E, K, N] codes (0..15) in row order."""
    e, half, n = packed.shape
    blocks = packed.reshape(e, half // (BLOCK // 2), 1, BLOCK // 2, n)
    planes = jnp.concatenate([blocks & 15, blocks >> 4], axis=2)
    return planes.reshape(e, 2 * half, n)


def quantize(w: jax.Array) -> Nvfp4Weight:
    """Dense weights [E, K, N] (K a multiple of 32) -> NVFP4 (see the module docstring)."""
    e, k, n = w.shape
    if k % BLOCK:
        raise ValueError(f"NVFP4 needs K (contraction) to be a multiple of {BLOCK}, got {k}")
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=(1, 2))
    tensor_scale = jnp.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), 1.0)
    groups = w.reshape(e, k // GROUP, GROUP, n)
    want = jnp.max(jnp.abs(groups), axis=2) / E2M1_MAX / tensor_scale[:, None, None]
    want = jnp.minimum(want, E4M3_MAX)  # float rounding may put the largest block a hair above
    scale = want.astype(jnp.float8_e4m3fn)
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint8)
    bumped = jax.lax.bitcast_convert_type(bits + 1, jnp.float8_e4m3fn)  # next e4m3 value up
    scale = jnp.where(scale.astype(jnp.float32) < want, bumped, scale)
    full = scale.astype(jnp.float32)[:, :, None, :] * tensor_scale[:, None, None, None]
    ratio = jnp.where(full > 0, jnp.abs(groups) / jnp.where(full > 0, full, 1.0), 0.0)
    grid = jnp.asarray(MAGNITUDES, jnp.float32)
    mag_code = jnp.argmin(jnp.abs(ratio[..., None] - grid), axis=-1).astype(jnp.uint8)
    codes = jnp.where(groups < 0, mag_code | 8, mag_code).reshape(e, k, n)
    return Nvfp4Weight(_pack(codes), scale, tensor_scale.astype(jnp.float32))


def dequantize(weight: Nvfp4Weight) -> jax.Array:
    """NVFP4 -> dense float32 [E, K, N]."""
    values = e2m1_value(unpack(weight.codes))
    scale = jnp.repeat(weight.scales.astype(jnp.float32), GROUP, axis=1)
    return values * scale * weight.tensor_scale[:, None, None]


class Nvfp4GroupedMatmul(Protocol):
    def __call__(
        self,
        x: jax.Array,
        codes: jax.Array,
        scales: jax.Array,
        tensor_scale: jax.Array,
        group_sizes: jax.Array,
    ) -> jax.Array:
        """`grouped_matmul` with NVFP4 expert weights (`backends.nvfp4`: e2m1 codes, an e4m3
        scale per 16 rows, a float32 scale per expert), equal to dequantising the weights to
        x's dtype and multiplying.

        Args: x [M, K] (K a multiple of 32); codes uint8 [E, K/2, N]; scales float8_e4m3fn
        [E, K/16, N]; tensor_scale float32 [E]; group_sizes [E] int32 summing to M.
        Returns: [M, N] in x's dtype (rows past sum(group_sizes) are zero).
        """
