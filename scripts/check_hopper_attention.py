"""Check and time the Hopper (Mosaic GPU) prefill attention kernel on one sm90 GPU.

First every case of a small grid (pages of 16 / 32 / 64, head dims 64 / 128, GQA ratios, the
joint K|V layout, relative bias on and off, prefill chunks that start mid-context and end
mid-page, a padding row) against the xla reference, with NaN in every key slot no query may
see; then the 8k Inkling-shaped prefill (32 / 8 heads, d 128, relative bias with R 64 and 32
buckets) timed with and without the bias, beside our Triton kernel and tokamax's Mosaic GPU
attention when it imports.

    PYTHONPATH=$PWD python scripts/check_hopper_attention.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from backends.pallas.attention import paged_attention_tiled
from backends.pallas.attention_hopper import prefill_attention_hopper, supported
from backends.protocol import RelativeBias, get_op

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests" / "backends")]
from kernel_timing import rel_err, timed  # noqa: E402
from kernels_json import run_meta  # noqa: E402
from paged_inputs import paged_inputs  # noqa: E402  (the backend tests' NaN-poisoned inputs)

BF = jnp.bfloat16


def check_cases(results: list) -> bool:
    ok = True
    spec = RelativeBias(num_buckets=12, num_exact=3, max_distance=100)
    ref_op = get_op("paged_attention", "xla")
    cases = [  # bsz, t, nq, nkv, hd, page, starts, kv_len
        (3, 200, 8, 2, 128, 64, [0, 37, 0], [200, 237, 0]),
        (2, 130, 4, 4, 64, 16, [5, 64], [135, 194]),
        (1, 384, 8, 1, 128, 32, [0], [384]),
        (2, 64, 6, 2, 256, 64, [300, 0], [364, 64]),
    ]
    rng = np.random.default_rng(0)
    for n, (bsz, t, nq, nkv, hd, page, starts, kv_len) in enumerate(cases):
        (q, kp, vp, table, pos), kvl, rq, emb = paged_inputs(
            rng, bsz, t, nq, nkv, hd, page, BF, starts, np.asarray(kv_len), dr=16)  # fmt: skip
        for rel, joint, block_k in ((False, False, 64), (True, True, 64), (True, False, 128),
                                    (False, True, 128)):  # fmt: skip
            if supported(q, kp, None, block_k) is not None:  # e.g. 128 keys at d 256
                continue
            extra = (rq, emb, spec) if rel else (None, None, None)
            ref = ref_op(q, kp, vp, table, pos, kvl, hd**-0.5, None, *extra)
            pages = (jnp.stack([kp, vp], axis=1), None) if joint else (kp, vp)
            try:
                got = jax.jit(
                    lambda *a, extra=extra, scale=hd**-0.5, bk=block_k: (
                        prefill_attention_hopper(*a, scale, None, *extra, block_k=bk))
                )(q, *pages, table, pos, kvl)  # fmt: skip
                err = rel_err(got, ref)
                finite = bool(np.isfinite(np.asarray(got, np.float32)).all())
            except Exception as exc:  # noqa: BLE001  (report every case)
                err, finite = float("nan"), False
                print(f"case {n}: {type(exc).__name__}: {exc}"[:2000])
            good = finite and err < 2e-2
            ok &= good
            results.append({"case": n, "rel": rel, "joint": joint, "block_k": block_k,
                            "rel_err": err,
                            "finite": finite, "ok": good})  # fmt: skip
            print(f"case {n} {bsz}x{t} {nq}/{nkv} d{hd} page {page} rel={rel} "
                  f"joint={joint} block_k={block_k}: rel_err {err:.2e} finite={finite} "
                  f"{'OK' if good else 'BAD'}",
                  flush=True)  # fmt: skip
    return ok


def bench(results: list, iters: int, tiles: list[tuple[int, ...]]) -> None:
    t, nq, nkv, hd, r = 8192, 32, 8, 128, 64
    flops = 4 * t * t / 2 * nq * hd
    spec = RelativeBias(num_buckets=32, num_exact=16, max_distance=4096)
    key = jax.random.key
    rq = jax.random.normal(key(4), (1, t, nq, r), BF) * 0.1
    emb = jax.random.normal(key(5), (32, r), BF)
    page = 64
    n_pages = t // page + 1
    table = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, n_pages))[None],
                        jnp.int32)  # fmt: skip
    kp = jax.random.normal(key(1), (n_pages, nkv, page, hd), BF)
    vp = jax.random.normal(key(2), (n_pages, nkv, page, hd), BF)
    q = jax.random.normal(key(3), (1, t, nq, hd), BF)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    kvl = jnp.full((1,), t, jnp.int32)
    scale = hd**-0.5
    n = 1024
    small_args = (q[:, :n], kp, vp, table, pos[:, :n], jnp.full((1,), n, jnp.int32), scale, None)
    refs = {True: get_op("paged_attention", "xla")(*small_args, rq[:, :n], emb, spec),
            False: get_op("paged_attention", "xla")(*small_args)}  # fmt: skip

    def add(impl, sec, err):
        tf = flops / sec / 1e12
        results.append({"op": "prefill attn", "impl": impl, "ms": sec * 1e3, "TFLOPs": tf,
                        "rel_err": err})  # fmt: skip
        print(f"{impl:48s} {sec * 1e3:8.3f} ms  {tf:6.1f} TFLOP/s  rel_err {err:.2e}", flush=True)

    for block_k, stages, *named in tiles:
        named = bool(named and named[0])
        for bias in (True, False):
            extra = (rq, emb, spec) if bias else (None, None, None)

            def f(q, kp, vp, table, pos, kvl, rq, extra=extra, stages=stages, bk=block_k, nm=named):
                e = (rq, *extra[1:]) if extra[0] is not None else extra
                return prefill_attention_hopper(
                    q, kp, vp, table, pos, kvl, scale, None, *e, block_k=bk, stages=stages,
                    named_barriers=nm)  # fmt: skip

            try:
                fn = jax.jit(f)
                small = fn(q[:, :n], kp, vp, table, pos[:, :n], jnp.full((1,), n, jnp.int32),
                           rq[:, :n])  # fmt: skip
                err = rel_err(small, refs[bias])
                sec = timed(fn, q, kp, vp, table, pos, kvl, rq, iters=iters)
                name = (
                    f"hopper mosaic k{block_k} stages {stages}{' named' if named else ''} "
                    f"{'bias' if bias else 'nobias'}"
                )
                add(name, sec, err)
            except Exception as exc:  # noqa: BLE001
                print(
                    f"hopper k{block_k} stages {stages} bias={bias}: {type(exc).__name__}: {exc}"[
                        :3000
                    ]
                )
    for bias in (True, False):
        extra = (emb, spec) if bias else (None, None)
        fn = jax.jit(lambda *a, extra=extra, bias=bias: paged_attention_tiled(
            *a[:6], scale, None, a[6] if bias else None, *extra, block_m=64, block_k=64,
            num_warps=4, num_stages=2))  # fmt: skip
        sec = timed(fn, q, kp, vp, table, pos, kvl, rq, iters=iters)
        add(f"triton page 64 m64 k64 {'bias' if bias else 'nobias'}", sec, float("nan"))
    try:
        import tokamax

        k = kp[table[0]].transpose(0, 2, 1, 3).reshape(1, t, nkv, hd)
        v = vp[table[0]].transpose(0, 2, 1, 3).reshape(1, t, nkv, hd)
        fn = jax.jit(lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, is_causal=True, implementation="mosaic"))  # fmt: skip
        sec = timed(fn, q, k, v, iters=iters)
        add("tokamax mosaic nobias", sec, float("nan"))
    except Exception as exc:  # noqa: BLE001
        print(f"tokamax: {type(exc).__name__}: {exc}"[:400])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--commit", help="the code's commit, for the JSON (default: HEAD)")
    parser.add_argument("--no-bench", action="store_true", help="only the correctness cases")
    parser.add_argument("--tiles", default="64,2;128,2",
                        help="block_k,stages[,named] timed, ';' between them (named 1: "
                             "named-barrier ping-pong)")  # fmt: skip
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    results: list = []
    ok = check_cases(results)
    if not args.no_bench:
        tiles = [tuple(int(v) for v in pair.split(",")) for pair in args.tiles.split(";")]
        bench(results, args.iters, tiles)
    if args.json:
        record = {**run_meta(args.commit), "ok": ok, "rows": results}
        Path(args.json).write_text(json.dumps(record, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
