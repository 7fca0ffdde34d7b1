#!/usr/bin/env python
"""The one-token Mamba2 state update where the state lies (`mamba2_step_paged`), against the
copy bandwidth measured in the same run: the xla reference (gather, step, scatter) and the
Pallas kernel at several tiles.

One layer of the Nemotron-Nano-9B-v2 shape (128 heads, P = 80, Ns = 128, 8 groups; float32
state, 5.24 MB a row) in a region of --region-gib GiB cut into pages of that
size (256-byte rows, the attention row of that model), B rows on distinct random pages. Each
time is the best of 5 loops of --iters calls; GB/s counts the state read and written once
(2 x B x 5.24 MB), so the ratio to the copy bandwidth is the kernel's fraction of the floor.

    python scripts/bench_state_step.py --batch 1 8 64 256 --json state_step.json
    python scripts/bench_state_step.py --smoke      # a CPU check (interpret mode, seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from backends.pallas.ssd_paged import mamba2_step_paged_tiled
from backends.protocol import get_op

TILES = [(2048, 4), (4096, 4), (8192, 4), (8192, 8), (16384, 8)]


def best_time(fn, iters: int, repeats: int = 5) -> float:
    """Seconds per call, best of `repeats` loops of `iters` calls (after one warmup)."""
    jax.block_until_ready(fn())
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / iters)
    return best


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """Bytes/s of a device copy (read + write counted) of `nbytes`: `iters` copies back to
    back, best of 5 such loops, as the benchmarks time their ops (a copy synchronised one at
    a time adds the launch and the wait to each: 3.7-4.0 TB/s on an H200 against 4.25)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    step = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / best_time(lambda: step(x), iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--region-gib", type=float, default=8.0)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check)")
    args = parser.parse_args()
    nh, p, ns, g, width = (4, 10, 16, 2, 8) if args.smoke else (128, 80, 128, 8, 64)
    if args.smoke:
        args.batch, args.region_gib, args.iters = [2], 0.001, 2
    words = nh * p * ns
    page_rows = -(-(words + 4096) // width)  # the conv state before it, then the state
    num_pages = max(max(args.batch) + 1, int(args.region_gib * 2**30 // (page_rows * width * 4)))
    bw = copy_bandwidth(2**28 if not args.smoke else 2**20, args.iters)
    print(f"{jax.devices()[0].device_kind}: copy {bw / 1e9:.0f} GB/s; {num_pages} pages")
    key = jax.random.split(jax.random.PRNGKey(0), 8)
    state = jax.random.normal(key[0], (1, num_pages * page_rows, width), jnp.float32)
    region = jax.lax.bitcast_convert_type(state, jnp.int32)  # finite float32 states
    rows = []
    for bsz in args.batch:
        rng = np.random.default_rng(bsz)
        pages = jnp.asarray(rng.choice(np.arange(1, num_pages), bsz, replace=False), jnp.int32)
        fresh = jnp.zeros((bsz,), jnp.int32)
        x = jax.random.normal(key[1], (bsz, nh, p), jnp.bfloat16)
        dt = jax.nn.softplus(jax.random.normal(key[2], (bsz, nh)))
        a = -jnp.exp(jax.random.normal(key[3], (nh,)))
        b, c = (jax.random.normal(k, (bsz, g, ns), jnp.bfloat16) for k in key[4:6])
        d = jnp.ones((nh,))
        inputs = (pages, fresh, x, dt, a, b, c, d)
        variants = {"xla": get_op("mamba2_step_paged", "xla")}
        for tile, warps in TILES:
            variants[f"pallas tile {tile} w{warps}"] = lambda *a, t=tile, w=warps: (
                mamba2_step_paged_tiled(*a, tile=t, num_warps=w)
            )
        ref = None
        work = [region + 0]  # updated in place by the timed calls; `region` stays as it is
        for name, op in variants.items():
            y = np.asarray(jax.jit(op, static_argnums=(9, 10))(region, *inputs, 4096, page_rows)[0])
            y = y.astype(np.float32)  # every variant from the same states
            ref = y if ref is None else ref
            err = float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))
            step = jax.jit(op, static_argnums=(9, 10), donate_argnums=(0,))

            def call(step=step, inputs=inputs, work=work):
                out, work[0] = step(work[0], *inputs, 4096, page_rows)
                return out

            seconds = best_time(call, args.iters)
            gbps = 2 * bsz * words * 4 / seconds / 1e9
            rows.append(
                {"batch": bsz, "variant": name, "us": 1e6 * seconds, "gbps": gbps,
                 "of_copy": gbps * 1e9 / bw, "rel_err_vs_xla": err}
            )  # fmt: skip
            print(f"B {bsz:>4} {name:<24} {1e6 * seconds:9.1f} us {gbps:7.0f} GB/s "
                  f"{gbps * 1e9 / bw:5.2f} of copy  err {err:.1e}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": bw / 1e9, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
