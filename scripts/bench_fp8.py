#!/usr/bin/env python
"""FP8 projections on the GPU: the prefill GEMM and the decode GEMV, bf16 against e4m3 weights,
each beside a ceiling measured in the same run.

  * ceilings: copy bandwidth (`y = x + c`, 2 GiB of bf16, bytes read + written) and the bf16
    matmul rate (8192^3);
  * prefill GEMM, M = 8192 tokens, the Nano-9B MLP shapes (K x N = 4480 x 15680 and back):
    bf16 `x @ w^T` against the W8A8 pattern of `backends.fp8.fp8_matmul` (static input scale,
    per-tensor weight scale), which XLA should turn into a cuBLASLt FP8 GEMM: the compiled HLO
    is searched for it (`fp8_gemm` in the row) and the ratio fp8 / bf16 printed;
  * decode GEMV, one token, the same weights: the `linear` op (pallas GEMV, bf16 rows) against
    `fp8_linear` (pallas: e4m3 rows; xla: the reference), as the share of the copy ceiling
    their weight bytes take;
  * MoE: the grouped matmul at a decode batch (64 tokens x top-6 of 128 experts, 2688 -> 1856:
    Nano-30B's up projection) and at a prefill one (8192 x 2048 -> 1408, 64 experts), bf16
    experts (`grouped_matmul`) against e4m3 ones (`fp8_grouped_matmul`, pallas and xla);
  * decode attention, 64 rows x 8k context, 32/8 heads d128, pages of 16: bf16 pages against
    e4m3 pages (the FP8 KV cache), as the share of the copy ceiling their KV bytes take.
Each time is the median of 5 timed loops of `--iters` calls. Each FP8 result is checked against
the xla FP8 reference (relative L2 error). `--json` writes {date, commit, device, copy_gbps,
bf16_tflops, rows: [{op, shape, impl, ms, rate, unit, ...}]}.

    python scripts/bench_fp8.py --json $OUT/fp8.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from backends import fp8
from backends.protocol import get_op

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_timing import ROWS, rel_err, row, timed  # noqa: E402
from kernels_json import json_rows, run_meta  # noqa: E402

BF = jnp.bfloat16
SHAPES = [(4480, 15680), (15680, 4480)]  # Nano-9B-v2's MLP up and down (K, N)


def ceilings(smoke: int) -> tuple[float, float]:
    x = jax.random.normal(jax.random.key(0), (2**30 // smoke,), BF)
    t = timed(jax.jit(lambda x: x + 1), x)
    bandwidth = 2 * x.nbytes / t
    row("ceiling", "copy y = x + c (2 GiB)", t, GBps=bandwidth / 1e9)
    n = 8192 // smoke
    a, b = (jax.random.normal(jax.random.key(i), (n, n), BF) for i in (1, 2))
    t = timed(jax.jit(lambda a, b: a @ b), a, b)
    row("ceiling", "bf16 matmul 8192^3", t, TFLOPs=2 * n**3 / t / 1e12)
    return bandwidth, 2 * n**3 / t


def weights(k: int, n: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """bf16 rows w [N, K], their e4m3 form and per-tensor scale, and an input scale."""
    w = (jax.random.normal(jax.random.key(5), (n, k), jnp.float32) / k**0.5).astype(BF)
    scale = fp8.tensor_scale(w)
    return w, fp8.quantize(w, scale), scale, jnp.asarray(8.0 / 448, jnp.float32)


def uses_fp8_gemm(fn, *args) -> bool:
    """Does the compiled program call cuBLASLt's FP8 matmul (XLA's rewrite of the pattern)?"""
    return "cublas$lt$matmul$f8" in jax.jit(fn).lower(*args).compile().as_text()


def gemm(args: argparse.Namespace, m: int) -> None:
    for k, n in SHAPES:
        k, n = k // args.smoke, n // args.smoke
        w, w8, ws, xs = weights(k, n)
        x = jax.random.normal(jax.random.key(6), (m, k), BF)
        flops = 2 * m * k * n
        shape = [m, k, n]
        t_bf = timed(jax.jit(lambda x, w: x @ w.T), x, w, iters=args.iters)
        row("gemm", f"bf16 xla {m}x{k}->{n}", t_bf, shape=shape, TFLOPs=flops / t_bf / 1e12)

        def w8a8(x, w8, ws, xs):
            return fp8.fp8_matmul(x, w8, ws, xs).astype(BF)

        t_f8 = timed(jax.jit(w8a8), x, w8, ws, xs, iters=args.iters)
        ref = jax.jit(get_op("fp8_linear", "xla"))(x, w8, ws, xs)
        row(
            "gemm", f"fp8 w8a8 xla {m}x{k}->{n}", t_f8, shape=shape,
            TFLOPs=flops / t_f8 / 1e12, over_bf16=t_bf / t_f8,
            fp8_gemm=uses_fp8_gemm(w8a8, x, w8, ws, xs),
            err=rel_err(jax.jit(w8a8)(x, w8, ws, xs), ref),
        )  # fmt: skip

        def direct(x, w8, ws, xs):  # both operands e4m3, DEFAULT precision: fast accumulation
            q = fp8.quantize(x, xs)
            y = jax.lax.dot_general(q, w8, (((1,), (1,)), ((), ())), preferred_element_type=BF)
            return (y.astype(jnp.float32) * (xs * ws)).astype(BF)

        t_d = timed(jax.jit(direct), x, w8, ws, xs, iters=args.iters)
        row(
            "gemm", f"fp8 e4m3 dot xla {m}x{k}->{n}", t_d, shape=shape,
            TFLOPs=flops / t_d / 1e12, over_bf16=t_bf / t_d,
            fp8_gemm=uses_fp8_gemm(direct, x, w8, ws, xs),
            err=rel_err(jax.jit(direct)(x, w8, ws, xs), ref),
        )  # fmt: skip


def gemv(args: argparse.Namespace, bandwidth: float) -> None:
    for k, n in SHAPES:
        k, n = k // args.smoke, n // args.smoke
        w, w8, ws, xs = weights(k, n)
        x = jax.random.normal(jax.random.key(7), (1, k), BF)
        ref = jax.jit(get_op("fp8_linear", "xla"))(x, w8, ws, xs)
        for name, impl, wt, fp8_args in [
            ("bf16 pallas", get_op("linear", "pallas"), w, ()),
            ("fp8 pallas", get_op("fp8_linear", "pallas"), w8, (ws, xs)),
            ("fp8 xla", get_op("fp8_linear", "xla"), w8, (ws, xs)),
        ]:
            fn = jax.jit(lambda x, w, *s, impl=impl: impl(x, w, *s))
            sec = timed(fn, x, wt, *fp8_args, iters=args.iters)
            extra = {"err": rel_err(fn(x, wt, *fp8_args), ref)} if fp8_args else {}
            row(
                "gemv", f"{name} 1x{k}->{n}", sec, shape=[1, k, n],
                of_bandwidth=wt.nbytes / sec / bandwidth, GBps=wt.nbytes / sec / 1e9, **extra,
            )  # fmt: skip


def moe(args: argparse.Namespace, bandwidth: float) -> None:
    rng = np.random.default_rng(3)
    for m, k, n, e in ((64 * 6, 2688, 1856, 128), (8192, 2048, 1408, 64)):
        m, k, n = m // args.smoke, k // args.smoke, n // args.smoke
        sizes = jnp.asarray(rng.multinomial(m, np.ones(e) / e), jnp.int32)
        x = jax.random.normal(jax.random.key(8), (m, k), BF)
        w = (jax.random.normal(jax.random.key(9), (e, k, n), jnp.float32) / k**0.5).astype(BF)
        ws = fp8.tensor_scale(w, axis=(1, 2))
        w8 = fp8.quantize(w, ws[:, None, None])
        xs = jnp.full((e,), 8.0 / 448, jnp.float32)
        ref = jax.jit(get_op("fp8_grouped_matmul", "xla"))(x, w8, ws, xs, sizes)
        touched = int(jnp.sum(sizes > 0))
        for name, fn, wt, scales in [
            ("bf16 pallas", get_op("grouped_matmul", "pallas"), w, ()),
            ("bf16 xla", get_op("grouped_matmul", "xla"), w, ()),
            ("fp8 pallas", get_op("fp8_grouped_matmul", "pallas"), w8, (ws, xs)),
            ("fp8 xla", get_op("fp8_grouped_matmul", "xla"), w8, (ws, xs)),
        ]:
            run = jax.jit(lambda x, w, *a, fn=fn: fn(x, w, *a))
            sec = timed(run, x, wt, *scales, sizes, iters=args.iters)
            read = wt.nbytes * touched / e
            extra = {"err": rel_err(run(x, wt, *scales, sizes), ref)} if scales else {}
            row(
                "moe", f"{name} {m}x{k}->{n} E{e}", sec, shape=[m, k, n, e],
                TFLOPs=2 * m * k * n / sec / 1e12, of_bandwidth=read / sec / bandwidth, **extra,
            )  # fmt: skip


def attention(args: argparse.Namespace, bandwidth: float) -> None:
    bsz, ctx, nq, nkv, hd, page = 64, 8192 // args.smoke, 32, 8, 128, 16
    nblk = ctx // page
    table = np.random.default_rng(4).permutation(np.arange(1, bsz * nblk + 1))
    table = jnp.asarray(table.reshape(bsz, nblk), jnp.int32)
    kv = [jax.random.normal(jax.random.key(i), (bsz * nblk + 1, nkv, page, hd), BF) for i in (1, 2)]
    q = jax.random.normal(jax.random.key(3), (bsz, 1, nq, hd), BF)
    pos, lens = jnp.full((bsz, 1), ctx - 1, jnp.int32), jnp.full((bsz,), ctx, jnp.int32)
    kv8 = [fp8.quantize(a, 1.0) for a in kv]
    xla, ours = (get_op("paged_attention", b) for b in ("xla", "pallas"))
    ref = jax.jit(lambda *a: xla(*a, hd**-0.5, None))(q, *kv8, table, pos, lens)
    for name, pages in (("bf16 pages", kv), ("e4m3 pages", kv8)):
        fn = jax.jit(lambda *a: ours(*a, hd**-0.5, None))
        sec = timed(fn, q, *pages, table, pos, lens, iters=args.iters)
        read = 2 * bsz * ctx * nkv * hd * pages[0].dtype.itemsize
        extra = {"err": rel_err(fn(q, *pages, table, pos, lens), ref)} if pages is kv8 else {}
        row(
            "decode attn", f"pallas {name}", sec, shape=f"{bsz} rows x {ctx} ctx 32/8 d128",
            of_bandwidth=read / sec / bandwidth, **extra,
        )  # fmt: skip


def main() -> None:
    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]))
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--iters", type=int, default=20, help="calls per timed loop")
    parser.add_argument("--tokens", type=int, default=8192, help="rows of the prefill GEMM")
    parser.add_argument("--json", help="write the run here")
    parser.add_argument("--commit", default="", help="the code's commit, for the JSON")
    parser.add_argument("--smoke", action="store_true", help="sizes / 64: check the script")
    parser.add_argument(
        "--only", nargs="*", default=["gemm", "gemv", "moe", "attention"],
        choices=["gemm", "gemv", "moe", "attention"], help="the sections to run",
    )  # fmt: skip
    args = parser.parse_args()
    args.smoke = 64 if args.smoke else 1
    if args.smoke > 1:
        args.iters = 1
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    bandwidth, flops = ceilings(args.smoke)
    sections = {
        "gemm": lambda: gemm(args, args.tokens // args.smoke),
        "gemv": lambda: gemv(args, bandwidth),
        "moe": lambda: moe(args, bandwidth),
        "attention": lambda: attention(args, bandwidth),
    }
    for section in (sections[name] for name in args.only):
        try:
            section()
        except Exception as exc:  # noqa: BLE001  (a failed section keeps the others' rows)
            print(f"FAILED {type(exc).__name__}: {exc}"[:600], flush=True)
    if args.json:
        meta = {**run_meta(args.commit or None), "copy_gbps": bandwidth / 1e9}
        out = {**meta, "bf16_tflops": flops / 1e12, "rows": json_rows(ROWS)}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
