#!/usr/bin/env python
"""Offline engine throughput: output tokens/s at several concurrencies, with and without
speculative decoding.

For each concurrency C and --speculative mode, the engine runs with max_num_seqs = C on
C * --rounds random prompts of --input-len tokens, generating --output-len tokens each (greedy,
EOS ignored); a warmup pass of the same workload compiles every shape first. Modes: `none`;
`mtp` (the model's MTP heads draft --num-speculative-tokens tokens a step); `ngram` (prompt
lookup: no draft model, any architecture); `oracle` (perfect
drafts replaying the greedy output of `none` on the same prompts, run first if not asked for).
Checks: speculative outputs equal `none`'s, oracle acceptance is 1.0; a failed check or a cell
that raised is printed and exits 1 (the JSON, written after each cell, keeps the rest).

Columns: out tok/s over all requests; tok/s/user = output tokens / wall time per request (its
share elapsed * C / requests of the timed pass: at C = 1 it equals out tok/s); ITL = (finish -
first token) / (tokens - 1), mean over requests; TTFT (with queueing behind earlier rounds);
accept = accepted / proposed drafts; tok/step = tokens per verifying step; =none: see Checks.

--random-config tiny|mid benchmarks a random-weight Inkling (scripts/inkling_random.py: `mid`
is inkling_mid(), 3.3 B parameters + 0.23 B per MTP head, bf16; `tiny` float32, for CPU checks)
with --mtp-heads heads, saved to a temporary directory (or --save-dir).

    python scripts/bench_engine.py                      # the default model, concurrency 1 8 32
    python scripts/bench_engine.py --model DIR --concurrency 1 4 --input-len 256
    # the GPU (H200) numbers: a mid-size random Inkling at batch 1, with and without drafts
    python scripts/bench_engine.py --random-config mid --concurrency 1 --input-len 512 \\
        --output-len 128 --speculative none mtp oracle --json out.json
    # a quick CPU check (about a minute)
    python scripts/bench_engine.py --random-config tiny --concurrency 1 --input-len 16 \\
        --output-len 8 --rounds 1 --speculative none mtp oracle
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import numpy as np

from hybridserve import LLM, SamplingParams
from hybridserve.config import CacheConfig
from hybridserve.engine import WARMUP_ENV
from hybridserve.entrypoints import DEFAULT_MODEL

sys.path.insert(0, str(Path(__file__).resolve().parent))
import inkling_random  # noqa: E402

MODES = ("none", "mtp", "ngram", "oracle")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


def make_llm(model: str, c: int, mode: str, args: argparse.Namespace, reference=None) -> LLM:
    k = args.num_speculative_tokens
    spec = None
    if mode in ("mtp", "ngram"):  # the model's heads, or prompt lookup
        spec = {"method": mode, "num_speculative_tokens": k}
    elif mode == "oracle":
        n = args.input_len

        def oracle(ids: list[int], k: int) -> list[int]:  # every prompt has n tokens
            return reference[tuple(ids[:n])][len(ids) - n :][:k]

        spec = {"method": "oracle", "num_speculative_tokens": k, "oracle": oracle}
    cache = CacheConfig(memory_bytes=args.cache_mb * 2**20) if args.cache_mb else None
    budget = c * (k + 1)  # the same in every mode: room for C decodes with k drafts each
    return LLM(
        model,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=c,
        max_num_batched_tokens=max(args.input_len, budget) + budget,
        max_prefill_chunk=args.input_len,
        enable_prefix_caching=False,
        cache=cache,
        progress=False,
        speculative_config=spec,
        backend=args.backend,
    )


def generate(llm: LLM, prompts: list[list[int]], args: argparse.Namespace):
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def run_level(model: str, c: int, mode: str, args, reference=None, timed=True):
    """One cell: warmup, timed pass -> (row, [(prompt, output)]); `reference`: prompt tuple ->
    `none` output (the oracle's replay); `timed=False`: the warmup's outputs alone."""
    log(f"[{mode} C={c}] loading, {'warmup' if timed else 'reference outputs'} ...")
    llm = make_llm(model, c, mode, args, reference)
    rng, vocab = np.random.default_rng(0), llm.engine.model_config.vocab_size
    prompts = [rng.integers(2, vocab, args.input_len).tolist() for _ in range(c * args.rounds)]
    outs = generate(llm, prompts, args)  # warmup: compiles every bucket used
    spec, elapsed = llm.engine.runner.spec, None
    if spec is not None:  # count the timed pass alone
        spec.num_drafts = spec.num_accepted = spec.num_steps = 0
    if timed:
        log(f"[{mode} C={c}] timed pass ...")
        start = time.perf_counter()
        outs = generate(llm, prompts, args)
        elapsed = time.perf_counter() - start
    stats = llm.engine.stats()
    del llm
    gc.collect()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    pairs = list(zip(map(tuple, prompts), tokens, strict=True))
    if not timed:
        return None, pairs
    n_out = sum(len(t) for t in tokens)
    m = [o.metrics for o in outs]
    itl = [(x.finished_time - x.first_token_time) / (x.num_generated_tokens - 1) for x in m]
    row = {
        "mode": mode,
        "concurrency": c,
        "requests": len(prompts),
        "output_tokens": n_out,
        "seconds": elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "tokens_per_s_per_user": n_out / (elapsed * c),
        "mean_itl_ms": 1000 * float(np.mean(itl)),
        "mean_ttft_ms": 1000 * float(np.mean([x.time_to_first_token for x in m])),
        "num_preemptions": stats["num_preemptions"],
        "outputs_sha1": hashlib.sha1(json.dumps(tokens).encode()).hexdigest(),
    }
    row.update({k: v for k, v in stats.items() if k.startswith("spec_")})
    row["mean_step_ms"] = row["mean_itl_ms"] * (row.get("spec_tokens_per_step") or 1.0)
    return row, pairs


def draft_cost(rows: list[dict]) -> list[dict]:
    """Per concurrency: the drafting cost per step, as mtp's step time minus oracle's (both
    verify the same k + 1 tokens; the oracle drafts on the host for free), against `none`'s step."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        by = {r["mode"]: r for r in rows if r["concurrency"] == c}
        if {"none", "mtp", "oracle"} <= by.keys():
            ms = by["mtp"]["mean_step_ms"] - by["oracle"]["mean_step_ms"]
            plain = by["none"]["mean_step_ms"]
            out.append(
                {
                    "concurrency": c,
                    "draft_ms": ms,
                    "plain_step_ms": plain,
                    "draft_over_plain_step": ms / plain,
                }
            )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(
        description=doc[0], epilog=doc[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", help=f"model directory (default {DEFAULT_MODEL})")
    src.add_argument(
        "--random-config", choices=inkling_random.CONFIGS, help="a random-weight Inkling (below)"
    )
    add("--mtp-heads", type=int, default=3, help="MTP heads of --random-config (default 3)")
    add("--save-dir", type=Path, help="save the random model here (default: a temporary dir)")
    add("--backend", default="xla", help="op backend: xla | pallas | torch (default xla)")
    add("--dtype", choices=["float32", "bfloat16"], help="default: the model's (tiny f32)")
    add("--speculative", nargs="+", choices=MODES, default=["none"], help="modes to compare")
    add("--num-speculative-tokens", type=int, default=3, help="drafts per step (default 3)")
    add("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="default 1 8 32")
    add("--input-len", type=int, default=64, help="prompt tokens (default 64)")
    add("--output-len", type=int, default=64, help="output tokens (default 64)")
    add("--rounds", type=int, default=2, help="requests = rounds * concurrency (default 2)")
    add("--cache-mb", type=int, help="cache pool MiB (default: the engine's 256; mid 4096)")
    add("--json", type=Path, help="write the results (and device, versions, config) here")
    args = parser.parse_args(argv)
    k = args.num_speculative_tokens
    if args.output_len < 2:
        parser.error("--output-len must be >= 2 (inter-token latency)")
    if args.random_config and "mtp" in args.speculative and args.mtp_heads < k:
        parser.error(f"--speculative mtp with {k} tokens needs --mtp-heads >= {k}")
    if args.cache_mb is None and args.random_config == "mid":
        args.cache_mb = 4096
    args.speculative = [m for m in MODES if m in args.speculative]  # none first
    return args


def bench(model: str, args: argparse.Namespace, save) -> tuple[list[dict], list[str]]:
    """Every (concurrency, mode) cell; one that raises is reported and skipped, and the results
    so far are saved after each cell (`save(rows, failures)`), for unattended runs."""
    rows, failures = [], []
    for c in args.concurrency:
        reference = None
        for mode in (["reference"] if args.speculative[0] != "none" else []) + args.speculative:
            try:
                if mode == "reference":
                    reference = dict(run_level(model, c, "none", args, timed=False)[1])
                    continue
                row, outs = run_level(model, c, mode, args, reference)
            except Exception as e:  # keep the other cells' numbers
                traceback.print_exc()
                failures.append(f"{mode} C={c}: {type(e).__name__}: {e}")
                continue
            if mode == "none":
                reference = dict(outs)
            elif reference is not None:
                row["outputs_match_none"] = all(reference[p] == t for p, t in outs)
                if not row["outputs_match_none"]:
                    failures.append(f"{mode} C={c}: greedy output differs from `none`")
            if mode == "oracle" and row["spec_acceptance_rate"] != 1.0:
                failures.append(f"oracle C={c}: acceptance {row['spec_acceptance_rate']}")
            rows.append(row)
            save(rows, failures)
    return rows, failures


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def git_commit() -> str:
    git = ["git", "rev-parse", "--short", "HEAD"]
    try:
        out = subprocess.run(git, capture_output=True, text=True, cwd=Path(__file__).parent)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # each cell's warmup pass compiles the programs its workload uses; the engine's start-up
    # warmup would compile every bucket of every engine (minutes per engine for `mid` on a GPU)
    os.environ.setdefault(WARMUP_ENV, "0")
    built, tmp = None, None
    model = args.model or str(DEFAULT_MODEL)
    if args.random_config:
        cfg = inkling_random.random_config(args.random_config, args.mtp_heads, args.dtype)
        if args.save_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="inkling_random_")
        dst = args.save_dir or Path(tmp.name) / args.random_config
        built = inkling_random.build_and_save(cfg, dst, log=log)
        model = str(dst)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "device": f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}",
        "jax_version": jax.__version__,
        "commit": git_commit(),
        "model": inkling_random.describe(model) | (built or {}),
        "args": vars(args) | {"json": None},
    }
    result = {}

    def save(rows: list[dict], failures: list[str]) -> None:
        result.update(meta=meta, rows=rows, checks={"ok": not failures, "failures": failures})
        if args.json:
            args.json.write_text(json.dumps(result, indent=2, default=str))

    try:
        rows, failures = bench(model, args, save)
    finally:
        if tmp is not None:
            tmp.cleanup()
    save(rows, failures)
    result["draft_cost"] = draft_cost(rows)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    print(
        f"{'mode':>6} {'conc':>4} {'reqs':>4} {'out tok/s':>9} {'tok/s/user':>10} "
        f"{'ITL ms':>7} {'TTFT ms':>8} {'accept':>6} {'tok/step':>8} {'=none':>5}"
    )
    for r in rows:
        print(
            f"{r['mode']:>6} {r['concurrency']:>4} {r['requests']:>4} "
            f"{r['output_tokens_per_s']:>9.1f} {r['tokens_per_s_per_user']:>10.1f} "
            f"{r['mean_itl_ms']:>7.2f} {r['mean_ttft_ms']:>8.1f} "
            f"{fmt(r.get('spec_acceptance_rate'), '6.3f'):>6} "
            f"{fmt(r.get('spec_tokens_per_step'), '8.2f'):>8} "
            f"{str(r.get('outputs_match_none', '-')):>5}"
        )
    for d in result["draft_cost"]:
        print(
            f"C={d['concurrency']}: drafting costs {d['draft_ms']:.2f} ms a step (mtp - oracle) "
            f"= {d['draft_over_plain_step']:.3f} of a plain step ({d['plain_step_ms']:.2f} ms)"
        )
    for f in failures:
        print(f"CHECK FAILED: {f}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["checks"]["ok"] else 1)
