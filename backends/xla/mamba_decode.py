"""`mamba2_decode_paged` from the unfused ops: the conv state's rows gathered, one conv step,
the rows scattered back (words past the state unchanged), dt and a, then the backend's
`mamba2_step_paged` on the ssm state, and the gate `y * silu(z)`. `through(conv_step,
ssm_paged)` builds the op from any backend's two ops (the torch backend reuses it)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from backends.fused import MambaDecode
from backends.protocol import conv_state_to_ds, register
from backends.xla.conv import causal_conv1d_step
from backends.xla.ssd_paged import mamba2_step_paged, read_words, write_words

WORD_BYTES = 4


def conv_words(geo: MambaDecode) -> int:
    """Words of the conv state (its bytes must fill whole words)."""
    size = geo.channels * (geo.conv_width - 1) * jnp.dtype(geo.conv_dtype).itemsize
    if size % WORD_BYTES:
        raise ValueError(f"the conv state ({size} bytes) must fill whole 32-bit words")
    return size // WORD_BYTES


def check_geometry(geo: MambaDecode, cols: jax.Array, region: jax.Array) -> None:
    """ValueError when `cols` or the region cannot hold what `geo` says."""
    if region.dtype != jnp.int32 or region.ndim != 3 or region.shape[0] != 1:
        raise ValueError(f"region must be int32 words [1, R, Wd], got {region.dtype}{region.shape}")
    if geo.conv_layout not in ("DS", "SD"):
        raise ValueError(f"conv layout must be DS or SD, got {geo.conv_layout!r}")
    if geo.heads % geo.groups:
        raise ValueError(f"{geo.heads} ssm heads do not split into {geo.groups} groups")
    width = cols.shape[-1]
    hp = geo.heads * geo.head_dim
    if max(geo.xbc_offset + geo.channels, geo.dt_offset + geo.heads, geo.z_offset + hp) > width:
        raise ValueError(f"x|B|C, dt or z run past the projection's {width} columns")
    if geo.conv_offset + conv_words(geo) > geo.ssm_offset:
        raise ValueError("the conv state overlaps the ssm state")


def dt_of(raw: jax.Array, dt_bias: jax.Array, geo: MambaDecode) -> jax.Array:
    """dt = softplus(raw + dt_bias) in float32, clipped to the geometry's range if any."""
    dt = jax.nn.softplus(raw.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    if geo.dt_min > 0.0 or geo.dt_max < float("inf"):
        dt = jnp.clip(dt, geo.dt_min, geo.dt_max)
    return dt


def through(conv_step: Callable, ssm_paged: Callable) -> Callable:
    """`mamba2_decode_paged` from a `causal_conv1d_step` and a `mamba2_step_paged`."""

    def decode(
        region: jax.Array,
        pages: jax.Array,
        fresh: jax.Array,
        cols: jax.Array,
        conv_weight: jax.Array,
        conv_bias: jax.Array | None,
        dt_bias: jax.Array,
        a_log: jax.Array,
        d: jax.Array,
        geo: MambaDecode,
    ) -> tuple[jax.Array, jax.Array]:
        check_geometry(geo, cols, region)
        bsz, ch, taps = cols.shape[0], geo.channels, geo.conv_width - 1
        n = conv_words(geo)
        raw, rows, lo = read_words(region, pages, geo.page_rows, geo.conv_offset, n)
        values = jax.lax.bitcast_convert_type(raw[:, lo : lo + n], jnp.dtype(geo.conv_dtype))
        shape = (ch, taps) if geo.conv_layout == "DS" else (taps, ch)
        state = conv_state_to_ds(values.reshape(bsz, *shape), geo.conv_layout)
        state = jnp.where(fresh[:, None, None] != 0, 0, state)
        u = cols[:, geo.xbc_offset : geo.xbc_offset + ch]
        v, new = conv_step(u, state, conv_weight, conv_bias, "silu")
        new = conv_state_to_ds(new.astype(geo.conv_dtype), geo.conv_layout).reshape(bsz, -1)
        new_words = jax.lax.bitcast_convert_type(
            new.reshape(bsz, n, -1) if new.dtype.itemsize < WORD_BYTES else new, jnp.int32
        )
        region = write_words(region, pages, rows, raw, lo, new_words)
        hp = geo.heads * geo.head_dim
        gn = geo.groups * geo.state_size
        x = v[:, :hp].reshape(bsz, geo.heads, geo.head_dim)
        b = v[:, hp : hp + gn].reshape(bsz, geo.groups, geo.state_size)
        c = v[:, hp + gn :].reshape(bsz, geo.groups, geo.state_size)
        dt = dt_of(cols[:, geo.dt_offset : geo.dt_offset + geo.heads], dt_bias, geo)
        a = -jnp.exp(a_log.astype(jnp.float32))
        y, region = ssm_paged(
            region, pages, fresh, x, dt, a, b, c, d, geo.ssm_offset, geo.page_rows
        )
        z = cols[:, geo.z_offset : geo.z_offset + hp].astype(jnp.float32)
        g = y.reshape(bsz, hp).astype(jnp.float32) * jax.nn.silu(z)
        return g.astype(cols.dtype), region

    return decode


mamba2_decode_paged = register("mamba2_decode_paged", "xla")(
    through(causal_conv1d_step, mamba2_step_paged)
)
