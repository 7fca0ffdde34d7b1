#!/usr/bin/env python
"""`backend="torch"` on the shipped default model, in float32: greedy tokens against xla's and
the decode step against the default backend's (`auto`), in one short run.

For each backend (xla, auto, torch) one engine is built; a warmup `generate` compiles its
shapes, then the same batch of `--prompts` short prompts generates `--new-tokens` greedy tokens
each, timed. Short prompts make the run decode-bound, so the time per generated position
(`step_ms` = seconds / new tokens) is the engine's decode step. Rows, one JSON line each:
backend, step_ms, tok_per_s, `greedy_agree` (tokens equal to xla's before each row's first
divergence / all tokens) and `step_over_auto`.

`--breakdown` then generates once more with the torch engine, counting its buffer callbacks:
per torch function, callbacks per generated position, host microseconds per callback (the
callback's wall time, including any wait for the GIL: on a GPU, torch's launches, not its
kernels) and aten ops per callback (about the kernels it launches; counting adds a little host
time). `--no-async-scheduling` runs every engine one step at a time (no overlap of the host's
scheduling with the device step, so no thread holds the GIL while a callback wants it).

    python scripts/check_torch_backend.py [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import time

import numpy as np
from check_gpu_backends import agree  # scripts/, beside this file
from kernels_json import run_meta
from torch.utils._python_dispatch import TorchDispatchMode

from backends.torch import bridge
from hybridserve import LLM, SamplingParams
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.weights.loader import read_config


class _AtenCount(TorchDispatchMode):
    """Counts the aten ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def breakdown(llm: LLM, prompts: list[dict], params: SamplingParams) -> list[dict]:
    """One more generation with every torch buffer callback counted and timed (by name)."""
    stats: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
    original = bridge._Callback.__call__

    def counted(self, ctx, outs, *inputs) -> None:
        start = time.perf_counter()
        with _AtenCount() as count:
            original(self, ctx, outs, *inputs)
        entry = stats[self.name or "?"]
        entry[0] += 1
        entry[1] += time.perf_counter() - start
        entry[2] += count.ops

    bridge._Callback.__call__ = counted
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        bridge._Callback.__call__ = original
    return [{"op": name.split(".")[0], "calls_per_position": n / params.max_tokens,
             "host_us_per_call": 1e6 * sec / n, "aten_ops_per_call": ops / n}
            for name, (n, sec, ops) in sorted(stats.items(), key=lambda kv: -kv[1][1])]  # fmt: skip


def run(
    backend: str,
    model: str,
    prompts: list[dict],
    new_tokens: int,
    detail: bool = False,
    overlap: bool = True,
) -> dict:
    """One engine: warmup, then the timed greedy generation (then `breakdown` if `detail`).
    A backend named `torch+graphs` is torch with `HYBRIDSERVE_TORCH_GRAPHS=1` (the bridge's
    callbacks traced into XLA's command buffers)."""
    graphs = backend.endswith("+graphs")
    os.environ["HYBRIDSERVE_TORCH_GRAPHS"] = "1" if graphs else "0"
    llm = LLM(model, dtype="float32", backend=backend.removesuffix("+graphs"), max_model_len=512,
              max_num_seqs=len(prompts), max_num_batched_tokens=256, progress=False,
              async_scheduling=overlap)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compile every shape the timed run meets
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    callbacks = breakdown(llm, prompts, params) if detail else None
    del llm
    gc.collect()
    out = {"backend": backend, "tokens": tokens, "step_ms": 1e3 * seconds / new_tokens,
           "tok_per_s": sum(map(len, tokens)) / seconds}  # fmt: skip
    return out if callbacks is None else out | {"callbacks": callbacks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--prompts", type=int, default=8, help="rows decoded together (8)")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens a row (48)")
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["xla", "auto", "torch"],
        help="engines to run (default xla auto torch; torch+graphs: experimental, see run())",
    )
    parser.add_argument("--json", help="write the rows here, with the run's date and device")
    parser.add_argument("--commit", help="the code's commit, for the JSON (default: HEAD)")
    parser.add_argument(
        "--breakdown", action="store_true", help="count the torch engine's callbacks (see above)"
    )
    parser.add_argument(
        "--no-async-scheduling",
        dest="overlap",
        action="store_false",
        help="engines step one at a time (default: overlapped)",
    )
    args = parser.parse_args()
    vocab = read_config(args.model).vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, int(n)).tolist()}
               for n in rng.integers(8, 32, args.prompts)]  # fmt: skip
    results: dict[str, dict] = {}
    for backend in args.backends:
        try:
            detail = args.breakdown and backend.split(",")[0].startswith("torch")
            results[backend] = run(
                backend, args.model, prompts, args.new_tokens, detail, args.overlap
            )
        except Exception as exc:  # noqa: BLE001  (report, go on with the next backend)
            print(json.dumps({"backend": backend, "error": f"{exc}"[:400]}), flush=True)
    rows = []
    for res in results.values():
        row = {k: v for k, v in res.items() if k not in ("tokens", "callbacks")}
        if "xla" in results:
            same, total = agree(res["tokens"], results["xla"]["tokens"])
            row["greedy_agree"] = f"{same}/{total}"
        if "auto" in results:
            row["step_over_auto"] = res["step_ms"] / results["auto"]["step_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        for entry in res.get("callbacks", []):
            op, per, us = entry["op"], entry["calls_per_position"], entry["host_us_per_call"]
            print(f"  {op:24s} {per:5.1f} a position {us:8.1f} us/call "
                  f"{entry['aten_ops_per_call']:6.1f} aten ops/call")  # fmt: skip
        if "callbacks" in res:
            row["callbacks"] = res["callbacks"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_meta(args.commit), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
