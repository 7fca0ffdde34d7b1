#!/usr/bin/env python
"""The fused decode ops against the copy bandwidth and against XLA, in one run.

1. `linear` (norm + GEMV + activation + residual) at the Nemotron-Nano-9B-v2 decode shapes
   (hidden 4480: the merged Mamba2 input projection, its gated-norm output projection, the MLP's
   up and down projections, the merged q|k|v, o_proj, the lm_head), M = --rows tokens:
     xla      the reference (XLA's norm, GEMM and epilogue fusions; w [N, K])
     xla kn   a plain XLA dot with the checkpoint's [K, N] weight (the GEMM alone)
     pallas   our kernel at each (bn, bk, warps, stages, splits of K) of the sweep
   GB/s counts the weight bytes once (the floor of a GEMV); each time is the best of 5 loops
   of one program that runs the op on --reps different inputs back to back (launch costs
   amortised). Each pallas result is checked against the reference.
2. `mamba2_decode_paged` (conv and ssm states in place) for one Nano-9B-v2 Mamba layer at
   each --batch, pallas against the xla reference (gather, step, scatter); GB/s counts the
   states read and written once.

    python scripts/bench_fused.py --json benchmarks/h200/fused.json          # on the GPU
    python scripts/bench_fused.py --smoke                                      # CPU check
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from backends.fused import MambaDecode, Norm
from backends.pallas.linear import linear_tiled, tiles
from backends.protocol import get_op

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_state_step import best_time, copy_bandwidth  # noqa: E402

# (name, N, K, prologue, activation, residual): the Nano-9B-v2 decode projections
SHAPES = [
    ("mamba_in", 22656, 4480, "rms", None, False),
    ("mamba_out", 4480, 10240, "group", None, True),
    ("mlp_up", 15680, 4480, "rms", "relu2", False),
    ("mlp_down", 4480, 15680, None, None, True),
    ("qkv", 7168, 4480, "rms", None, False),
    ("o_proj", 4480, 5120, None, None, True),
    ("lm_head", 131072, 4480, "rms", None, False),
]
SMOKE_SHAPES = [("in", 96, 64, "rms", None, False), ("out", 32, 128, "group", None, True)]


def linear_case(shape, m: int, reps: int, key) -> dict:
    """Inputs of one projection: `reps` different x, weights and residuals (distinct weights:
    XLA merges dots that share one, which would time one GEMM for all)."""
    name, n, k, pro, act, res = shape
    keys = jax.random.split(key, 6)
    bf = jnp.bfloat16
    xs = [jax.random.normal(jax.random.fold_in(keys[0], r), (m, k), bf) for r in range(reps)]
    ws = [
        (jax.random.normal(jax.random.fold_in(keys[1], r), (n, k), bf) / math.sqrt(k)).astype(bf)
        for r in range(reps)
    ]
    norm = None
    if pro == "rms":
        norm = Norm((1 + 0.1 * jax.random.normal(keys[2], (k,))).astype(bf), 1e-5)
    elif pro == "group":  # Mamba2's output: y * silu(z) normalised per group
        weight = (1 + 0.1 * jax.random.normal(keys[2], (k,))).astype(bf)
        norm = Norm(weight, 1e-5, None, 0, k // 8)
    residuals = [jax.random.normal(jax.random.fold_in(keys[4], r), (m, n), bf) for r in range(reps)]
    return dict(xs=xs, w=ws, norm=norm, act=act, res=residuals if res else None)


def timed(op, case: dict, reps: int) -> tuple[float, jax.Array]:
    """Seconds per call of `op(x, w, norm, act, residual)` and its first output."""

    @jax.jit
    def run(xs, ws, residuals):
        return [
            op(x, w, case["norm"], case["act"], None if residuals is None else residuals[i])
            for i, (x, w) in enumerate(zip(xs, ws, strict=True))
        ]

    args = (case["xs"], case["w"], case["res"])
    return best_time(lambda: run(*args), 5) / reps, run(*args)[0]


def bench_linear(args, bw: float) -> list[dict]:
    ref = get_op("linear", "xla")
    rows = []
    for shape, m in itertools.product(SMOKE_SHAPES if args.smoke else SHAPES, args.rows):
        name, n, k = shape[:3]
        case = linear_case(shape, m, args.reps, jax.random.key(n + m))

        def record(variant, seconds, out=None, expect=None, name=name, m=m, n=n, k=k, case=case):
            err = None
            if out is not None:
                diff = jnp.abs(out.astype(jnp.float32) - expect.astype(jnp.float32))
                err = float(jnp.max(diff) / (jnp.max(jnp.abs(expect.astype(jnp.float32))) + 1e-9))
            row = dict(
                op=name,
                m=m,
                n=n,
                k=k,
                variant=variant,
                us=seconds * 1e6,
                gbps=case["w"][0].nbytes / seconds / 1e9,
                of_copy=case["w"][0].nbytes / seconds / bw,
                rel_err=err,
            )
            rows.append(row)
            print(json.dumps(row), flush=True)

        t_ref, expect = timed(lambda x, w, nm, a, r: ref(x, w, None, nm, a, r), case, args.reps)
        record("xla", t_ref)
        plain = dict(case, w=[w.T for w in case["w"]], norm=None, act=None, res=None)
        t_kn, _ = timed(lambda x, w, nm, a, r: jnp.dot(x, w), plain, args.reps)
        record("xla kn", t_kn)
        default = tiles(m, n, k, k // 8 if shape[3] == "group" else 0)
        grid = args.grid or [f"{bn},{bk},{w},{s},1" for bn, bk, w, s in sweep(m)]
        if not args.smoke and name not in args.sweep:
            grid = []
        bn, bk, warps, stages, splits = default
        for spec in dict.fromkeys([f"{bn},{bk},{warps},{stages or 0},{splits}", *grid]):
            bn, bk, warps, stages, splits = (int(v) for v in (spec + ",1").split(",")[:5])
            fn = lambda x, w, nm, a, r, bn=bn, bk=bk, wp=warps, st=stages, sp=splits: linear_tiled(  # noqa: E731
                x, w, None, nm, a, r, 1.0, bn=bn, bk=bk, warps=wp, stages=st or None, splits=sp
            )
            try:
                t, out = timed(fn, case, args.reps)
            except Exception as err:  # a tile that does not compile: say so, go on
                print(f"{name} m={m} {spec}: {type(err).__name__}: {str(err)[:200]}")
                continue
            record(f"pallas {spec}", t, out, expect)
    return rows


def sweep(m: int) -> list[tuple[int, int, int, int]]:
    if m == 1:
        return list(itertools.product((2, 4, 8), (1024, 2048), (4, 8), (0,)))
    return list(itertools.product((2, 4, 8), (512, 1024), (4,), (0,)))


def bench_mamba(args, bw: float) -> list[dict]:
    hs, p, g, ns, width = (4, 10, 2, 16, 8) if args.smoke else (128, 80, 8, 128, 64)
    ch = hs * p + 2 * g * ns
    conv_words = ch * 3 // 2
    ssm_offset = -(-conv_words // width) * width
    page_rows = -(-(ssm_offset + hs * p * ns) // width)
    num_pages = max(max(args.batch) + 1, int(args.region_gib * 2**30 // (page_rows * width * 4)))
    # the merged projection's columns as the model lays them out: z | x | B | C | dt
    xbc, dt = hs * p, 2 * hs * p + 2 * g * ns
    geo = MambaDecode(hs, p, g, ns, 4, xbc, dt, 0, "DS", "bfloat16", 0, ssm_offset, page_rows)
    key = jax.random.split(jax.random.key(3), 8)
    region = jax.lax.bitcast_convert_type(
        jax.random.normal(key[0], (1, num_pages * page_rows, width), jnp.float32) * 0.1, jnp.int32
    )
    ops = {b: get_op("mamba2_decode_paged", b) for b in ("xla", "pallas")}
    rows = []
    for bsz in args.batch:
        rng = np.random.default_rng(bsz)
        pages = jnp.asarray(rng.choice(np.arange(1, num_pages), bsz, replace=False), jnp.int32)
        fresh = jnp.zeros((bsz,), jnp.int32)
        cols = jax.random.normal(key[1], (bsz, geo.dt_offset + hs), jnp.bfloat16)
        weights = (
            jax.random.normal(key[2], (ch, 4), jnp.bfloat16),
            None,
            jax.random.normal(key[3], (hs,)),
            jax.random.normal(key[4], (hs,)),
            jnp.ones((hs,)),
        )
        moved = 2 * bsz * (hs * p * ns * 4 + conv_words * 4)
        outs = {}
        for name, op in ops.items():
            inputs = (pages, fresh, cols, *weights, geo)
            step = jax.jit(lambda r, op=op, inputs=inputs: op(r, *inputs), donate_argnums=0)
            out, region = step(region)
            outs[name] = out
            jax.block_until_ready(region)
            best = math.inf
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(args.reps):
                    out, region = step(region)
                jax.block_until_ready(region)
                best = min(best, (time.perf_counter() - t) / args.reps)
            row = dict(
                op="mamba2_decode_paged",
                batch=bsz,
                variant=name,
                us=best * 1e6,
                gbps=moved / best / 1e9,
                of_copy=moved / best / bw,
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="tokens M")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="Mamba rows")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--region-gib", type=float, default=4.0)
    parser.add_argument("--grid", nargs="*", help="pallas tiles as bn,bk,warps,stages[,splits]")
    parser.add_argument(
        "--sweep",
        nargs="*",
        default=["mamba_in", "mamba_out", "mlp_down"],
        help="ops whose tiles are swept (the others run the default tiles only)",
    )
    parser.add_argument("--only", choices=["linear", "mamba"])
    parser.add_argument("--commit", default="")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check)")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.batch, args.reps, args.region_gib = [1, 3], [2], 2, 0.001
        args.grid = args.grid or ["16,32,4,0"]
    bw = copy_bandwidth(2**20 if args.smoke else 2**32, 20)
    device = jax.devices()[0]
    print(f"{device.device_kind}: copy {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    if args.only != "mamba":
        rows += bench_linear(args, bw)
    if args.only != "linear":
        rows += bench_mamba(args, bw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    date=datetime.date.today().isoformat(),
                    commit=args.commit,
                    device=f"{device.platform}: {device.device_kind}",
                    copy_gbps=bw / 1e9,
                    rows=rows,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
