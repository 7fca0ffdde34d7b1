#!/usr/bin/env python
"""Kernel benchmark for the GPU machine: ceilings first, then every op at realistic shapes.

Ceilings (measured in the same run): device copy bandwidth (`y = x + c` over 2 GiB of bf16,
bytes read + written) and bf16 matmul rate (8192^3). Then, bf16 unless stated:
  * prefill attention, 8k tokens, 32 query / 8 KV heads, head dim 128, causal, pages of 16 and
    64 tokens scattered through a block table: pallas with and without the relative bias, in
    TFLOP/s (4 T^2/2 N H), against torch flash SDPA without bias on the same shape;
  * paged decode attention, batch 64, context 8k, pages of 16: % of copy bandwidth over the
    KV bytes; pallas tile variants and the xla reference; batch 1 at 128k context
    (--long-context), split-KV (the registered op) and one split;
  * Mamba2 chunked scan, 128 heads x 64, state 128, one group: tokens/s per layer (tile
    variants, and each sequence split into 2-16 pieces scanned side by side, `ssd_split`);
  * sconv (causal depthwise conv, width 4, silu) over [8, 2048, 8448]: % of bandwidth;
  * one-token Mamba2 state update and conv update at batch 256, RMSNorm, grouped matmul.
Each time is the median of 5 timed loops of `--iters` calls (after a warmup call), the host
waiting on the last result. Every pallas result is checked against the xla reference on the
same random inputs first (relative L2 error printed). Prints a table; `--json` writes the run
(`kernels_json`: {date, commit, device, copy_gbps, rows: [{op, shape, impl, ms, rate, unit}]}).
`--peers` measures tokamax, fla-core and a torch copy beside ours on the same inputs, each
checked against our output (`kernel_peers`, which says how to install them); the copy ceiling
is then the better of JAX's and torch's.

    python scripts/bench_kernels.py --peers --json $OUT/kernels.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from backends.pallas.attention import paged_attention_tiled
from backends.pallas.conv import causal_conv1d_tiled
from backends.pallas.ssd import mamba2_scan_tiled
from backends.pallas.ssd_split import mamba2_scan_split
from backends.protocol import RelativeBias, get_op

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_peers  # noqa: E402
from kernel_timing import ROWS, rel_err, row, timed  # noqa: E402
from kernels_json import kernels_json  # noqa: E402

BF = jnp.bfloat16
# Variant sweeps: one-pass scan (chunk, P slice, warps); sconv tiles (time rows, channels, warps)
SCAN_ONE_PASS = [(64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2)]
CONV_TILES = [(32, 128, 2), (32, 256, 4), (128, 128, 4), (16, 256, 4)]
CONV_TILES += [(32, 128, 2, 1), (64, 128, 4, 1), (32, 256, 4, 1)]  # 1: tile 0 launched apart
# one-pass scan with c b^T computed once per group and chunk (shared_scores): same tile tuples
SCAN_SHARED = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2), (64, 32, 4, 3), (64, 16, 4, 2)]
SCAN_PIECES = [2, 4, 8, 16]  # split scan: each sequence cut into this many rows (ssd_split)
SMOKE = 1  # --smoke: every size divided by 64, to check the script on a CPU (interpret mode)


def bind(op: str, backend: str, *tail) -> Callable:
    """`backend`'s `op` with trailing static arguments bound, jitted."""
    fn = get_op(op, backend)
    return jax.jit(lambda *arrays: fn(*arrays, *tail))


def ceilings() -> tuple[float, float]:
    x = jax.random.normal(jax.random.key(0), (2**30 // SMOKE,), BF)
    c = jnp.asarray(1.0, BF)
    t = timed(jax.jit(lambda x, c: x + c), x, c)
    bandwidth = 2 * x.nbytes / t
    row("ceiling", "copy y = x + c (2 GiB)", t, GBps=bandwidth / 1e9)
    n = 8192 // SMOKE
    a = jax.random.normal(jax.random.key(1), (n, n), BF)
    b = jax.random.normal(jax.random.key(2), (n, n), BF)
    t = timed(jax.jit(lambda a, b: a @ b), a, b)
    flops = 2 * n**3 / t
    row("ceiling", "bf16 matmul 8192^3", t, TFLOPs=flops / 1e12)
    return bandwidth, flops


def paged_inputs(rng, bsz, t, ctx, nq, nkv, hd, page, starts, dtype=BF):
    """q for positions `starts + [0, t)`, a scattered cache holding `ctx` tokens per row."""
    nblk = -(-ctx // page)
    n_pages = bsz * nblk + 1
    table = rng.permutation(np.arange(1, n_pages)).reshape(bsz, nblk).astype(np.int32)
    k = jax.random.normal(jax.random.key(1), (n_pages, nkv, page, hd), dtype)
    v = jax.random.normal(jax.random.key(2), (n_pages, nkv, page, hd), dtype)
    q = jax.random.normal(jax.random.key(3), (bsz, t, nq, hd), dtype)
    pos = jnp.asarray(np.asarray(starts)[:, None] + np.arange(t), jnp.int32)
    kv_len = jnp.full((bsz,), ctx, jnp.int32)
    return q, k, v, jnp.asarray(table), pos, kv_len


def prefill(peak_flops: float, args: argparse.Namespace) -> None:
    t, nq, nkv, hd, r = args.prefill_tokens, 32, 8, 128, 64
    flops = 4 * t * t / 2 * nq * hd
    spec = RelativeBias(num_buckets=32, num_exact=16, max_distance=4096)
    rq = jax.random.normal(jax.random.key(4), (1, t, nq, r), BF) * 0.1
    emb = jax.random.normal(jax.random.key(5), (32, r), BF)
    scale = hd**-0.5
    torch_tflops = kernel_peers.torch_flash(t, nq, nkv, hd, row, args.iters)
    rng = np.random.default_rng(0)
    for page in sorted({tile[0] for tile in args.prefill_tiles}):
        q, k, v, table, pos, kv_len = paged_inputs(rng, 1, t, t, nq, nkv, hd, page, [0])
        # correctness on a 1k prefix (the reference materialises [T, S] logits)
        n = min(1024, t)
        small = (q[:, :n], k, v, table, pos[:, :n], jnp.full((1,), n, jnp.int32))
        ref = bind("paged_attention", "xla", scale, None, rq[:, :n], emb, spec)(*small)
        for _, bm, bk, warps, stages in [tile for tile in args.prefill_tiles if tile[0] == page]:

            def run(*a, bm=bm, bk=bk, w=warps, s=stages, bias=True):
                *a, rel_q = a
                extra = (rel_q, emb, spec) if bias else (None, None, None)
                return paged_attention_tiled(
                    *a, scale, None, *extra, block_m=bm, block_k=bk, num_warps=w, num_stages=s
                )

            name = f"page {page} m{bm} k{bk} w{warps} s{stages}"
            try:
                err = rel_err(jax.jit(run)(*small, rq[:, :n]), ref)
                for bias in (True, False):
                    f = jax.jit(lambda *a, f=run, b=bias: f(*a, bias=b))
                    sec = timed(f, q, k, v, table, pos, kv_len, rq, iters=args.iters)
                    tf = flops / sec / 1e12
                    row("prefill attn", f"{name} {'bias' if bias else 'nobias'}", sec,
                        TFLOPs=tf, of_peak=tf * 1e12 / peak_flops,
                        vs_torch_flash=tf / torch_tflops if torch_tflops else float("nan"),
                        rel_err=err)  # fmt: skip
            except Exception as exc:  # noqa: BLE001  (report and go on)
                print(f"prefill attn {name}: FAILED {type(exc).__name__}: {exc}"[:400])
    if args.peers:  # the same tokens, K/V gathered from the pages into contiguous arrays
        flat = lambda pages: pages[table[0]].swapaxes(1, 2).reshape(1, t, nkv, hd)  # noqa: E731
        ours = bind("paged_attention", "pallas", scale, None, None, None, None)
        out = ours(q, k, v, table, pos, kv_len)
        kernel_peers.attention(q, flat(k), flat(v), out, timed, row, args.iters)


def decode(bandwidth: float, args: argparse.Namespace) -> None:
    bsz, ctx, nq, nkv, hd = 64, args.decode_context, 32, 8, 128
    kv_bytes = 2 * bsz * ctx * nkv * hd * 2
    scale = hd**-0.5
    for page in sorted({tile[0] for tile in args.decode_tiles}):
        decode_page(page, bandwidth, args, bsz, ctx, nq, nkv, hd, kv_bytes, scale)
    decode_long(bandwidth, args, nq, nkv, hd, scale)


def decode_long(bandwidth, args, nq, nkv, hd, scale, page=64) -> None:
    """Batch 1 at --long-context tokens: the registered op (split-KV: its key blocks shared
    among programs, merged by log-sum-exp) and one program a (row, kv head) for comparison."""
    ctx = args.long_context
    kv_bytes = 2 * ctx * nkv * hd * 2
    inputs = paged_inputs(np.random.default_rng(2), 1, 1, ctx, nq, nkv, hd, page, [ctx - 1])
    ref = bind("paged_attention", "xla", scale, None)(*inputs)
    one = functools.partial(paged_attention_tiled, scale=scale, sliding_window=None, block_m=16)
    for name, fn in (("split-KV (registered)", bind("paged_attention", "pallas", scale, None)),
                     ("one split", jax.jit(one))):  # fmt: skip
        try:
            err = rel_err(fn(*inputs), ref)
            sec = timed(fn, *inputs, iters=args.iters)
            row("decode attn", f"pallas B1 {ctx} ctx page {page} {name}", sec,
                shape=f"1 row x {ctx} ctx, {nq}/{nkv} heads d{hd}", GBps=kv_bytes / sec / 1e9,
                of_bandwidth=kv_bytes / sec / bandwidth, rel_err=err)  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            print(f"decode attn B1 {name}: FAILED {type(exc).__name__}: {exc}"[:400])


def decode_page(page, bandwidth, args, bsz, ctx, nq, nkv, hd, kv_bytes, scale) -> None:
    rng = np.random.default_rng(1)
    q, k, v, table, pos, kv_len = paged_inputs(rng, bsz, 1, ctx, nq, nkv, hd, page, [ctx - 1] * bsz)
    ref_fn = bind("paged_attention", "xla", scale, None)
    ref = ref_fn(q, k, v, table, pos, kv_len)
    sec = timed(ref_fn, q, k, v, table, pos, kv_len, iters=args.iters)
    row("decode attn", f"xla reference page {page}", sec, of_bandwidth=kv_bytes / sec / bandwidth)
    for _, bk, warps, stages in [tile for tile in args.decode_tiles if tile[0] == page]:
        fn = jax.jit(lambda *a, bk=bk, w=warps, s=stages: paged_attention_tiled(
            *a, scale, None, block_m=16, block_k=bk, num_warps=w, num_stages=s))  # fmt: skip
        try:
            err = rel_err(fn(q, k, v, table, pos, kv_len), ref)
            sec = timed(fn, q, k, v, table, pos, kv_len, iters=args.iters)
            row("decode attn", f"pallas page {page} k{bk} w{warps} s{stages}", sec,
                GBps=kv_bytes / sec / 1e9, of_bandwidth=kv_bytes / sec / bandwidth,
                rel_err=err)  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            print(f"decode attn k{bk}: FAILED {type(exc).__name__}: {exc}"[:400])


def ssm(bandwidth: float, args: argparse.Namespace) -> None:
    nh, p, ns = 128, 64, 128
    a = -jnp.exp(jax.random.normal(jax.random.key(6), (nh,), jnp.float32))
    d = jax.random.normal(jax.random.key(7), (nh,), jnp.float32)
    for bsz, t in ((1, 16384 // SMOKE), (8, 4096 // SMOKE)):
        keys = jax.random.split(jax.random.key(8), 5)
        x = jax.random.normal(keys[0], (bsz, t, nh, p), BF)
        dt = jax.nn.softplus(jax.random.normal(keys[1], (bsz, t, nh), jnp.float32) - 2).astype(BF)
        b = jax.random.normal(keys[2], (bsz, t, 1, ns), BF)
        c = jax.random.normal(keys[3], (bsz, t, 1, ns), BF)
        h0 = jax.random.normal(keys[4], (bsz, nh, p, ns), jnp.float32)
        ops = (x, dt, a, b, c, d, h0)
        ref = None
        # (kernel, chunk, P slice, warps[, stages]): the two-phase kernels, then the one-pass one
        variants = [("xla", 128, 0, 0), ("two-phase", 128, 32, 0), ("two-phase", 64, 32, 0)]
        variants += [("registered", 0, 0, 0)] + [("one-pass", *v) for v in SCAN_ONE_PASS]
        variants += [("shared", *v) for v in SCAN_SHARED]
        variants += [("split", 64, n, 0) for n in SCAN_PIECES]  # (P slice: the pieces)
        for kind, chunk, bp, warps, *stages in variants:
            if kind == "split":
                fn = jax.jit(lambda *z, n=bp: mamba2_scan_split(*z, 64, n))
            elif kind in ("xla", "registered"):
                backend = "xla" if kind == "xla" else "pallas"
                fn = bind("mamba2_scan", backend, chunk or 128)
            else:
                tiles = dict(block_p=bp, num_warps=warps or None, one_pass=kind != "two-phase",
                             num_stages=stages[0] if stages else None,
                             shared_scores=kind == "shared")  # fmt: skip
                fn = jax.jit(lambda *z, ch=chunk, kw=tiles: mamba2_scan_tiled(*z, ch, **kw))
            name = f"{kind} B{bsz} T{t} chunk {chunk} p{bp} w{warps}"
            name += f" s{stages[0]}" if stages else ""
            if kind == "split":
                name = f"split B{bsz} T{t} into {bp} pieces (registered tiles)"
            try:
                out = fn(*ops)
                ref = out if kind == "xla" else ref
                sec = timed(fn, *ops, iters=args.iters)
                row("mamba2 scan", name, sec, shape=[bsz, t, nh, p], tok_per_s=bsz * t / sec,
                    rel_err=rel_err(out[0], ref[0]), state_err=rel_err(out[1], ref[1]))  # fmt: skip
            except Exception as exc:  # noqa: BLE001
                print(f"mamba2 scan {name}: FAILED {type(exc).__name__}: {exc}"[:400])
        if args.peers and ref is not None:
            kernel_peers.scan(*ops, ref[0], row, args.iters)
    scan_p80(args)
    bsz = 256  # one decode step
    keys = jax.random.split(jax.random.key(9), 5)
    state = jax.random.normal(keys[0], (bsz, nh, p, ns), jnp.float32)
    xs = jax.random.normal(keys[1], (bsz, nh, p), BF)
    dts = jax.nn.softplus(jax.random.normal(keys[2], (bsz, nh), BF))
    bs, cs = (jax.random.normal(k, (bsz, 1, ns), BF) for k in keys[3:5])
    step = (state, xs, dts, a, bs, cs, d)
    moved = 2 * state.nbytes
    for backend in ("xla", "pallas"):
        fn = jax.jit(get_op("mamba2_step", backend))
        sec = timed(fn, *step, iters=args.iters)
        row("mamba2 step", f"{backend} B{bsz}", sec, of_bandwidth=moved / sec / bandwidth)


def scan_p80(args: argparse.Namespace) -> None:
    """The 9B shape's prefill row (one row of 512 tokens, 128 heads x 80, 8 groups of state
    128): the one-pass scan with P in slices of 16 (80 unpadded), 32 (96) and 64 (128), and
    with c b^T shared by the heads of a group."""
    keys = jax.random.split(jax.random.key(15), 6)
    t, nh, p, g, ns = 512 // SMOKE, 128, 80, 8, 128
    x = jax.random.normal(keys[0], (1, t, nh, p), BF)
    dt = jax.nn.softplus(jax.random.normal(keys[1], (1, t, nh), jnp.float32) - 2).astype(BF)
    b, c = (jax.random.normal(k, (1, t, g, ns), BF) for k in keys[2:4])
    a = -jnp.exp(jax.random.normal(keys[4], (nh,), jnp.float32))
    h0 = jax.random.normal(keys[5], (1, nh, p, ns), jnp.float32)
    ops = (x, dt, a, b, c, jnp.ones((nh,), jnp.float32), h0)
    ref = bind("mamba2_scan", "xla", 128)(*ops)
    # (P slice, c b^T shared); slice 0: the registered op
    for bp, shared in ((0, False), (16, False), (32, False), (64, False), (16, True), (32, True)):
        if bp == 0:
            fn = bind("mamba2_scan", "pallas", 64)
        else:
            fn = jax.jit(lambda *z, bp=bp, sh=shared: mamba2_scan_tiled(
                *z, 64, block_p=bp, num_warps=4, one_pass=True, shared_scores=sh))  # fmt: skip
        name = "registered P80" if bp == 0 else f"one-pass P80 in slices of {bp}"
        name += ", c b^T shared" if shared else ""
        try:
            err = rel_err(fn(*ops)[0], ref[0])
            sec = timed(fn, *ops, iters=args.iters)
            row("mamba2 scan", name, sec, shape=list(x.shape), tok_per_s=t / sec, rel_err=err)
        except Exception as exc:  # noqa: BLE001
            print(f"mamba2 scan {name}: FAILED {type(exc).__name__}: {exc}"[:400])


def conv(bandwidth: float, args: argparse.Namespace) -> None:
    bsz, t, ch, width = 8, 2048 // SMOKE, 8448, 4
    keys = jax.random.split(jax.random.key(10), 4)
    x = jax.random.normal(keys[0], (bsz, t, ch), BF)
    state = jax.random.normal(keys[1], (bsz, ch, width - 1), BF)
    w = jax.random.normal(keys[2], (ch, width), BF)
    bias = jax.random.normal(keys[3], (ch,), BF)
    lengths = jnp.full((bsz,), t, jnp.int32)
    moved = 2 * x.nbytes
    outs = {}
    for backend in ("xla", "pallas"):
        fn = bind("causal_conv1d", backend, "silu")
        outs[backend] = fn(x, state, w, bias, lengths)
        sec = timed(fn, x, state, w, bias, lengths, iters=args.iters)
        err = rel_err(outs[backend][0], outs["xla"][0])
        row("sconv", f"{backend} [{bsz},{t},{ch}] w{width}", sec,
            GBps=moved / sec / 1e9, of_bandwidth=moved / sec / bandwidth, rel_err=err)  # fmt: skip
    variants = [(64, 128, 4, False, 0)]  # (block_t, block_c, warps, approx silu, split)
    variants += [(*v[:3], None, v[3] if len(v) > 3 else 0) for v in CONV_TILES]
    for bt, bc, warps, approx, split in variants:
        fn = jax.jit(lambda *z, bt=bt, bc=bc, w=warps, a=approx, sp=split: causal_conv1d_tiled(
            *z, "silu", block_t=bt, block_c=bc, num_warps=w, approx=a,
            split_first=bool(sp)))  # fmt: skip
        try:
            err = rel_err(fn(x, state, w, bias, lengths)[0], outs["xla"][0])
            sec = timed(fn, x, state, w, bias, lengths, iters=args.iters)
            gbps = moved / sec
            silu = "exact" if approx is False else "auto (tanh.approx for bf16 on GPU)"
            silu += ", tile 0 launched apart" if split else ""
            row("sconv", f"pallas tiles {bt} x {bc} w{warps} silu {silu}", sec,
                GBps=gbps / 1e9, of_bandwidth=gbps / bandwidth, rel_err=err)  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            print(f"sconv {bt}x{bc}: FAILED {type(exc).__name__}: {exc}"[:400])
    if args.peers:
        zero = bind("causal_conv1d", "pallas", "silu")(x, jnp.zeros_like(state), w, bias, lengths)
        kernel_peers.conv(x, w, bias, zero[0], bandwidth, row, args.iters)
    bsz = 256
    xs, st = x[:, 0].repeat(32, 0)[:bsz], state.repeat(32, 0)[:bsz]
    for backend in ("xla", "pallas"):
        fn = bind("causal_conv1d_step", backend, "silu")
        sec = timed(fn, xs, st, w, bias, iters=args.iters)
        row("sconv step", f"{backend} B{bsz}", sec, of_bandwidth=2 * st.nbytes / sec / bandwidth)


def misc(bandwidth: float, args: argparse.Namespace) -> None:
    x = jax.random.normal(jax.random.key(11), (16384 // SMOKE, 4096), BF)
    wt = jax.random.normal(jax.random.key(12), (4096,), BF)
    for backend in ("xla", "pallas"):
        fn = bind("rms_norm", backend, 1e-5)
        sec = timed(fn, x, wt, iters=args.iters)
        row(
            "rms_norm", f"{backend} [16384, 4096]", sec, of_bandwidth=2 * x.nbytes / sec / bandwidth
        )
    m, k, n = 8192 // SMOKE, 2048 // SMOKE, 1408 // SMOKE
    sizes = jnp.asarray(np.random.default_rng(3).multinomial(m, np.ones(64) / 64), jnp.int32)
    xm = jax.random.normal(jax.random.key(13), (m, k), BF)
    wm = jax.random.normal(jax.random.key(14), (64, k, n), BF)
    for backend in ("xla", "pallas"):
        fn = jax.jit(get_op("grouped_matmul", backend))
        sec = timed(fn, xm, wm, sizes, iters=args.iters)
        row("grouped matmul", f"{backend} {m}x{k}->{n} E64", sec, shape=[m, k, n, 64],
            TFLOPs=2 * m * k * n / sec / 1e12)  # fmt: skip
    if args.peers:
        ours = jax.jit(get_op("grouped_matmul", "pallas"))(xm, wm, sizes)
        kernel_peers.ragged_dot(xm, wm, sizes, ours, timed, row, args.iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="calls per timed loop")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--decode-context", type=int, default=8192)
    parser.add_argument("--long-context", type=int, default=131072, help="batch-1 decode row")
    parser.add_argument("--only", nargs="*", default=["prefill", "decode", "ssm", "conv", "misc"])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check the script")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="measure the peers beside ours "
        "(scripts/kernel_peers.py: tokamax, fla-core, torch copy)",
    )
    parser.add_argument("--commit", default="", help="the code's commit, for the JSON")
    tiles = "comma-separated ints, ';' between variants (replaces the built-in sweep)"
    parser.add_argument("--prefill-tiles", help=f"page,block_m,block_k,warps,stages: {tiles}")
    parser.add_argument("--decode-tiles", help=f"page,block_k,warps,stages: {tiles}")
    parser.add_argument("--scan-tiles", help=f"chunk,block_p,warps,stages (one-pass): {tiles}")
    parser.add_argument("--conv-tiles", help=f"block_t,block_c,warps[,split]: {tiles}")
    args = parser.parse_args()
    if args.smoke:
        global SMOKE
        SMOKE, args.iters = 64, 1
        args.prefill_tokens, args.decode_context, args.long_context = 256, 256, 1024
    # (page, block_m, block_k, warps, stages)
    prefill_tiles = [(16, 64, 64, 4, 2), (16, 128, 64, 8, 2), (64, 64, 64, 4, 2)]
    prefill_tiles += [(64, 128, 64, 8, 2), (64, 64, 32, 4, 2), (64, 128, 32, 4, 3)]
    decode_tiles = [(16, 64, 4, 2), (16, 64, 4, 3), (16, 32, 4, 2), (16, 64, 8, 2)]
    decode_tiles += [(64, 64, 4, 2), (64, 64, 4, 3)]
    global SCAN_ONE_PASS, CONV_TILES
    parse = lambda text: [tuple(int(v) for v in t.split(",")) for t in text.split(";")]  # noqa: E731
    args.prefill_tiles = parse(args.prefill_tiles) if args.prefill_tiles else prefill_tiles
    args.decode_tiles = parse(args.decode_tiles) if args.decode_tiles else decode_tiles
    SCAN_ONE_PASS = parse(args.scan_tiles) if args.scan_tiles else SCAN_ONE_PASS
    CONV_TILES = parse(args.conv_tiles) if args.conv_tiles else CONV_TILES
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    bandwidth, flops = ceilings()
    if args.peers:  # the ceiling of a bandwidth-bound op: the best copy, JAX's or torch's
        bandwidth = max(bandwidth, kernel_peers.torch_copy(row, args.iters, 2**31 // SMOKE))
    sections = {"prefill": lambda: prefill(flops, args), "decode": lambda: decode(bandwidth, args),
                "ssm": lambda: ssm(bandwidth, args), "conv": lambda: conv(bandwidth, args),
                "misc": lambda: misc(bandwidth, args)}  # fmt: skip
    for name in args.only:
        try:
            sections[name]()
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: FAILED {type(exc).__name__}: {exc}"[:600], flush=True)
        if args.json:  # after every section: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(kernels_json(ROWS, args, bandwidth, SMOKE), f, indent=1)


if __name__ == "__main__":
    main()
