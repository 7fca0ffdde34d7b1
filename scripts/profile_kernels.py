#!/usr/bin/env python
"""Run each pallas kernel once at the benchmark's shapes, for a profiler (Nsight Compute).

Every case is jitted and run once (compiling launches no pallas kernel, so the profiler,
filtered by kernel name, sees each kernel exactly once). Cases (bf16, the benchmark's shapes):
  * prefill: paged attention, 8k tokens, 32 / 8 heads, hd 128, pages of 64, with the relative
    bias and without;
  * scan: the Mamba2 scan (128 heads x 64, state 128, one group, B 1 x T 16384), one-pass and
    two-phase kernels;
  * conv: sconv over [8, 2048, 8448], width 4.

    ncu --clock-control none --kernel-name regex:'paged|mamba2|conv1d' \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python scripts/profile_kernels.py --only prefill scan conv
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import BF, paged_inputs  # noqa: E402

from backends.pallas.attention import paged_attention_tiled  # noqa: E402
from backends.pallas.conv import causal_conv1d_tiled  # noqa: E402
from backends.pallas.ssd import mamba2_scan_tiled  # noqa: E402
from backends.protocol import RelativeBias, get_op  # noqa: E402


def prefill(tokens: int) -> list[tuple[str, Callable, tuple]]:
    nq, nkv, hd, r, page = 32, 8, 128, 64, 64
    spec = RelativeBias(num_buckets=32, num_exact=16, max_distance=4096)
    rq = jax.random.normal(jax.random.key(4), (1, tokens, nq, r), BF) * 0.1
    emb = jax.random.normal(jax.random.key(5), (32, r), BF)
    arrays = paged_inputs(np.random.default_rng(0), 1, tokens, tokens, nq, nkv, hd, page, [0])

    def run(*a, bias: bool):
        *a, rel_q = a
        extra = (rel_q, emb, spec) if bias else (None, None, None)
        return paged_attention_tiled(
            *a, hd**-0.5, None, *extra, block_m=64, block_k=64, num_warps=4, num_stages=2
        )

    return [
        (f"prefill {bias=}", jax.jit(lambda *a, b=bias: run(*a, bias=b)), (*arrays, rq))
        for bias in (True, False)
    ]


def scan(tokens: int) -> list[tuple[str, Callable, tuple]]:
    nh, p, ns = 128, 64, 128
    keys = jax.random.split(jax.random.key(8), 7)
    x = jax.random.normal(keys[0], (1, tokens, nh, p), BF)
    dt = jax.nn.softplus(jax.random.normal(keys[1], (1, tokens, nh), jnp.float32) - 2).astype(BF)
    a = -jnp.exp(jax.random.normal(keys[5], (nh,), jnp.float32))
    b = jax.random.normal(keys[2], (1, tokens, 1, ns), BF)
    c = jax.random.normal(keys[3], (1, tokens, 1, ns), BF)
    d = jax.random.normal(keys[6], (nh,), jnp.float32)
    h0 = jax.random.normal(keys[4], (1, nh, p, ns), jnp.float32)
    ops = (x, dt, a, b, c, d, h0)
    one = jax.jit(lambda *z: get_op("mamba2_scan", "pallas")(*z, 128))  # the one-pass kernel
    two = jax.jit(lambda *z: mamba2_scan_tiled(*z, 128, block_p=32))
    return [("scan one-pass", one, ops), ("scan two-phase", two, ops)]


def conv(tokens: int) -> list[tuple[str, Callable, tuple]]:
    bsz, ch, width = 8, 8448, 4
    keys = jax.random.split(jax.random.key(10), 4)
    x = jax.random.normal(keys[0], (bsz, tokens, ch), BF)
    state = jax.random.normal(keys[1], (bsz, ch, width - 1), BF)
    w = jax.random.normal(keys[2], (ch, width), BF)
    bias = jax.random.normal(keys[3], (ch,), BF)
    lengths = jnp.full((bsz,), tokens, jnp.int32)
    fn = jax.jit(lambda *z: causal_conv1d_tiled(*z, "silu"))
    return [("sconv", fn, (x, state, w, bias, lengths))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=["prefill", "scan", "conv"])
    parser.add_argument("--scale", type=int, default=1, help="divide the token counts (CPU)")
    args = parser.parse_args()
    build = {
        "prefill": lambda: prefill(8192 // args.scale),
        "scan": lambda: scan(16384 // args.scale),
        "conv": lambda: conv(2048 // args.scale),
    }
    for name in args.only:
        for label, fn, inputs in build[name]():
            jax.block_until_ready(fn(*inputs))
            print(f"ran {label}", flush=True)


if __name__ == "__main__":
    main()
