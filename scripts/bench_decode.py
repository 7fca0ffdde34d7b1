#!/usr/bin/env python
"""The decode step against its roofline floor: bytes moved per step, copy bandwidth, time.

One run, one device:
  1. Copy bandwidth: a jitted elementwise pass over --copy-mib MiB (read + write), 20 calls
     back to back (as the forward is timed), best of 5; BW = 2 * bytes / time. Every floor
     below divides by this BW.
  2. For each --backend in turn (default: xla, then pallas; "xla,OP=pallas" takes one op from
     another backend), the model (a --shape from scripts/random_models.py with dummy bf16
     weights drawn on the device, or --model DIR) in an engine sized for --max-num-seqs rows.
  3. For each batch B: B requests of --context random prompt tokens are prefilled, then
       forward: the jitted decode program (model + lm_head for B rows, cache in place), called
                --steps times back to back (host work overlaps the device), per call;
       engine:  `LLMEngine.step()` (schedule, program, sampling, token to host), per call;
                overlapped by default (the next step dispatched before this one's tokens
                arrive), and then also one at a time on the same engine
                (--no-async-scheduling: one at a time only);
       kernels: GPU kernels per forward call and their summed time (a profile of 5 calls);
       matmul:  every dense weight the step reads, multiplied by a [B, in] activation in one jitted
                program: the GEMV/GEMM time XLA alone gets from these weights;
     and the bytes the step must move (`scripts/decode_cost.py`): weights (embedding rows,
     MoE expert coverage), KV at the context, Mamba state read + write, each reported apart.
  Ratios are time / floor; the acceptance bound at batch 1 is forward <= 1.15 x floor.
  4. A prefill-only step of --prefill-rows prompts of --prefill-context (or --context) tokens
     (one engine step, packed as the engine packs it), timed as a program, against
     `matmul_program` for its tokens (the GEMMs alone), with its kernels (a profile of 3
     calls, kept under --trace DIR/<backend>_prefill<R>x<T>): "prefill" in the JSON.

    # the H200 numbers in BENCHMARKS.md (about 4 minutes, most of it the first compile)
    python scripts/bench_decode.py --shape nano-9b-v2 --batch 1 8 64 --context 1024 \\
        --json benchmarks/h200/decode.json
    # a CPU check of the script (seconds)
    python scripts/bench_decode.py --shape tiny --batch 1 4 --context 32 --steps 4 --copy-mib 16
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import json
import math
import pstats
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridserve import LLM, SamplingParams
from hybridserve.config import CacheConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import random_models  # noqa: E402
from bench_state_step import best_time, copy_bandwidth  # noqa: E402
from decode_cost import NOT_IN_DECODE, decode_bytes  # noqa: E402
from trace_summary import kernel_times  # noqa: E402


def matmul_program(params: nnx.State, batch: int):
    """A jitted program that multiplies a [batch, n] activation by every dense weight a decode
    step reads (each leaf of 2+ axes viewed as [first axis, rest]: the same bytes in one GEMV or
    GEMM; routed experts, the embedding table and encoders left out)."""
    leaves = []
    for path, var in nnx.to_flat_state(params):
        value, names = var[...], [str(p) for p in path]
        routed = names[-1] in ("up", "gate", "down") and value.ndim == 3
        if names[0] in NOT_IN_DECODE or names[0] == "embed" or value.ndim < 2 or routed:
            continue
        leaves.append(value)

    @jax.jit
    def run(ws):
        total = jnp.zeros((), jnp.float32)
        for w in ws:
            m = w.reshape(w.shape[0], -1)
            x = jnp.ones((batch, m.shape[0]), w.dtype)
            total += jnp.sum(jnp.dot(x, m, preferred_element_type=jnp.float32))
        return total

    return lambda: run(leaves)


def count_kernels(
    fn, args: argparse.Namespace, name: str, calls: int = 5
) -> tuple[float | None, float | None]:
    """GPU kernels per call of `fn` and their summed milliseconds, from a profile of `calls`
    calls (kept under --trace DIR/name when given). (None, None) where the profile has no GPU
    stream (the CPU)."""
    with tempfile.TemporaryDirectory() as tmp:
        where = args.trace / name if args.trace else Path(tmp)
        with jax.profiler.trace(str(where), create_perfetto_trace=True):
            jax.block_until_ready([fn() for _ in range(calls)])
        files = sorted(where.rglob("perfetto_trace.json.gz"))
        times = kernel_times(files[-1]) if files else {}
    if not times:
        return None, None
    count = sum(n for _, n in times.values())
    return count / calls, sum(t for t, _ in times.values()) / calls / 1e3


def bench_batch(llm: LLM, b: int, args: argparse.Namespace) -> dict:
    engine, runner = llm.engine, llm.engine.runner
    rng = np.random.default_rng(b)
    params = SamplingParams(
        temperature=0.0, max_tokens=engine.max_model_len - args.context, ignore_eos=True
    )
    vocab = engine.model_config.vocab_size
    ids = [
        engine.add_request(rng.integers(3, vocab, args.context).tolist(), params) for _ in range(b)
    ]
    generated = set()
    while len(generated) < b:  # every prompt prefilled: from here on, decode steps only
        generated.update(o.request_id for o in engine.step())
    captured = []
    run = runner.run
    runner.run = lambda batch, *a, **k: (captured.append(batch), run(batch, *a, **k))[1]
    sync_s = None
    if engine.overlapped:  # the same engine one step at a time first (no step in flight yet)
        engine.overlapped = False
        sync_s = best_time(lambda: (engine.step(), jnp.zeros(()))[1], args.steps, repeats=3)
        engine.overlapped = True
    engine_s = best_time(lambda: (engine.step(), jnp.zeros(()))[1], args.steps, repeats=3)
    runner.run = run
    if args.profile_engine:  # where the host time of a step goes
        profile = cProfile.Profile()
        profile.runcall(lambda: [engine.step() for _ in range(args.steps)])
        print(f"engine steps at batch {b}, host profile over {args.steps} steps:")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    batch = captured[-1]
    forward_s = best_time(lambda: runner.run(batch)[0], args.steps, repeats=3)
    kernels, kernel_ms = count_kernels(lambda: runner.run(batch)[0], args, f"{args.tag}_b{b}")
    matmul_s = best_time(matmul_program(runner.params, b), args.steps, repeats=3)
    for r in ids:
        engine.abort_request(r)
    cost = decode_bytes(runner.cfg, runner.plan, runner.params, b, args.context)
    floor = cost.floor_s(args.bandwidth)
    return {
        "batch": b,
        "context": args.context,
        "weights_bytes": cost.weights,
        "kv_bytes": cost.kv,
        "state_bytes": cost.state,
        "floor_ms": 1e3 * floor,
        "state_ms_at_bw": 1e3 * cost.state / args.bandwidth,
        "forward_ms": 1e3 * forward_s,
        "engine_step_ms": 1e3 * engine_s,
        "engine_step_one_at_a_time_ms": None if sync_s is None else 1e3 * sync_s,
        "matmul_only_ms": 1e3 * matmul_s,
        "kernels_per_step": kernels,
        "kernel_ms_per_step": kernel_ms,
        "forward_over_floor": forward_s / floor,
        "engine_over_floor": engine_s / floor,
    }


def bench_prefill(llm: LLM, args: argparse.Namespace) -> dict:
    """One prefill-only step of --prefill-rows prompts of --context tokens (packed prefill, as
    the engine schedules it) against the matmul-only program for as many tokens."""
    engine, runner = llm.engine, llm.engine.runner
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    length = args.prefill_context or args.context
    prompts = [rng.integers(3, vocab, length).tolist() for _ in range(args.prefill_rows)]
    ids = [engine.add_request(p, params) for p in prompts]
    captured = []
    run = runner.run
    runner.run = lambda batch, *a, **k: (captured.append(batch), run(batch, *a, **k))[1]
    engine.step()  # the whole prefill in one step (the token budget holds it)
    runner.run = run
    for r in ids:
        engine.abort_request(r)
    batch = max(captured, key=lambda b: b.tokens.size)
    real = int(batch.lengths.sum())
    step_s = best_time(lambda: runner.run(batch)[0], max(3, args.steps // 5), repeats=3)
    matmul_s = best_time(matmul_program(runner.params, real), 3, repeats=3)
    name = f"{args.tag}_prefill{args.prefill_rows}x{length}"
    kernels, kernel_ms = count_kernels(lambda: runner.run(batch)[0], args, name, calls=3)
    return {
        "prompt_tokens": real,
        "program_rows": batch.tokens.shape[0],
        "program_tokens": batch.tokens.size,
        "prefill_ms": 1e3 * step_s,
        "matmul_only_ms": 1e3 * matmul_s,
        "prefill_over_matmul": step_s / matmul_s,
        "kernels_per_step": kernels,
        "kernel_ms_per_step": kernel_ms,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = random_models.model_parser(__doc__)
    add = parser.add_argument
    add("--batch", type=int, nargs="+", default=[1, 8, 64], help="default 1 8 64")
    add("--context", type=int, default=1024, help="cached tokens per sequence (default 1024)")
    add("--steps", type=int, default=30, help="timed calls per measurement (default 30)")
    add("--copy-mib", type=int, default=4096, help="copy-bandwidth buffer (default 4096 MiB)")
    add("--cache-gib", type=float, default=48, help="cache pool GiB (default 48; capped by need)")
    add("--prefill-tokens", type=int, default=8192, help="tokens per prefill step (8192)")
    add(
        "--prefill-rows",
        type=int,
        default=8,
        help="time one prefill step of this many --context prompts against its matmuls (8; 0: "
        "none)",
    )
    add(
        "--prefill-context",
        type=int,
        default=0,
        help="prompt tokens each of the --prefill-rows prompts (default: --context)",
    )
    add(
        "--backend",
        nargs="+",
        default=["xla", "pallas"],
        help='op backends, one engine each (default xla pallas; "xla,OP=pallas" mixes)',
    )
    add("--max-num-seqs", type=int, default=256, help="rows the engine is sized for (256)")
    add("--commit", default="", help="the code's commit, for the JSON")
    add(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="engine steps one at a time (default: overlapped)",
    )
    add("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    add("--json", type=Path, help="write the results here")
    add("--trace", type=Path, help="keep the profiles of 5 forward calls in DIR/<backend>_b<B>")
    add("--profile-engine", action="store_true", help="cProfile the engine steps")
    args = parser.parse_args(argv)
    if min(args.batch) < 1 or args.context < 1 or args.steps < 1:
        parser.error("--batch, --context and --steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = jax.devices()[0]
    print(f"device: {device.platform} {device.device_kind}", flush=True)
    args.bandwidth = copy_bandwidth(args.copy_mib * 2**20, 20)
    print(f"copy bandwidth (read + write): {args.bandwidth / 1e12:.3f} TB/s", flush=True)
    rows = []
    result = {
        "date": datetime.date.today().isoformat(),
        "commit": args.commit,
        "device": f"{device.platform}: {device.device_kind}",
        "jax_version": jax.__version__,
        "copy_gbps": args.bandwidth / 1e9,
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_models.write_config(args.shape, tmp)
        for backend in args.backend:
            args.tag = backend.replace(",", "+").replace("=", "-")
            llm = LLM(
                str(model),
                dtype=args.dtype,
                backend=backend,
                max_model_len=max(args.context, args.prefill_context) + 4 * args.steps + 64,
                max_num_seqs=max(args.max_num_seqs, args.prefill_rows, *args.batch),
                max_num_batched_tokens=max(
                    args.prefill_tokens,
                    args.max_num_seqs,
                    args.prefill_rows * max(args.context, args.prefill_context),
                    *args.batch,
                ),
                max_prefill_chunk=max(args.context, args.prefill_context),
                cache=CacheConfig(memory_bytes=int(args.cache_gib * 2**30)),
                enable_prefix_caching=False,
                async_scheduling=args.async_scheduling,
                load_format="auto" if args.model else "dummy",
                progress=False,
            )
            for b in args.batch:
                rows.append({"backend": backend, **bench_batch(llm, b, args)})
                print(json.dumps(rows[-1]), flush=True)
                if args.json:  # after every row: a run cut short keeps what it measured
                    args.json.write_text(json.dumps(result, indent=2))
            if args.prefill_rows:
                prefill = {"backend": backend, **bench_prefill(llm, args)}
                result.setdefault("prefill", []).append(prefill)
                print(json.dumps(prefill), flush=True)
                if args.json:
                    args.json.write_text(json.dumps(result, indent=2))
            del llm  # free its weights and pool before the next backend's
            gc.collect()
    print_table(rows)
    return result


def print_table(rows: list[dict]) -> None:
    print(
        f"{'backend':>28} {'B':>4} {'weights GB':>10} {'state GB':>8} {'floor ms':>8} "
        f"{'fwd ms':>7} {'fwd/floor':>9} {'engine ms':>9} {'eng/fwd':>7} {'1-at-a-time':>11} "
        f"{'kernels':>7} "
        f"{'matmul ms':>9}"
    )
    for r in rows:
        print(
            f"{r['backend']:>28} {r['batch']:>4} {r['weights_bytes'] / 1e9:>10.3f} "
            f"{r['state_bytes'] / 1e9:>8.3f} {r['floor_ms']:>8.3f} {r['forward_ms']:>7.3f} "
            f"{r['forward_over_floor']:>9.2f} {r['engine_step_ms']:>9.3f} "
            f"{r['engine_step_ms'] / r['forward_ms']:>7.2f} "
            f"{r['engine_step_one_at_a_time_ms'] or math.nan:>11.3f} "
            f"{r['kernels_per_step'] or math.nan:>7.0f} "
            f"{r['matmul_only_ms']:>9.3f}"
        )


if __name__ == "__main__":
    main()
