#!/usr/bin/env python
"""Offline engine throughput: output tokens/s at several concurrencies.

For each concurrency C, the engine runs with max_num_seqs = C on C * --rounds requests of random
prompts (--input-len tokens) generating exactly --output-len tokens each (greedy, EOS ignored).
Every shape is compiled first by a warmup pass of the same workload, so the timed pass measures
steady state. Prints a table and, with --json, writes the numbers.

    python scripts/bench_engine.py                      # the default model, concurrency 1 8 32
    python scripts/bench_engine.py --model DIR --concurrency 1 4 --input-len 256
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

from hybridserve import LLM, SamplingParams
from hybridserve.api import DEFAULT_MODEL


def run_level(model: str, concurrency: int, args: argparse.Namespace) -> dict:
    llm = LLM(
        model,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=concurrency,
        max_num_batched_tokens=max(args.input_len, concurrency) + concurrency,
        max_prefill_chunk=args.input_len,
        enable_prefix_caching=False,
        progress=False,
    )
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    n = concurrency * args.rounds
    prompts = [
        {"prompt_token_ids": rng.integers(2, vocab, args.input_len).tolist()} for _ in range(n)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warmup: compiles every bucket used
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.time_to_first_token for o in outs]
    return {
        "concurrency": concurrency,
        "requests": n,
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "mean_ttft_ms": 1000 * float(np.mean(ttft)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory")
    parser.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests = rounds * concurrency")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    rows = [run_level(args.model, c, args) for c in args.concurrency]
    print(f"{'concurrency':>11} {'requests':>8} {'out tok/s':>10} {'mean TTFT ms':>12}")
    for r in rows:
        print(
            f"{r['concurrency']:>11} {r['requests']:>8} {r['output_tokens_per_s']:>10.1f} "
            f"{r['mean_ttft_ms']:>12.1f}"
        )
    if args.json:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        meta = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": platform.processor() or platform.machine(),
            "commit": commit,
            "args": vars(args) | {"json": None},
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
