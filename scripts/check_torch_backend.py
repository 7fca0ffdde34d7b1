#!/usr/bin/env python
"""`backend="torch"` on the shipped default model, in float32: greedy tokens against xla's and
the decode step against the default backend's (`auto`), in one short run.

For each backend (xla, auto, torch) one engine is built; a warmup `generate` compiles its
shapes, then the same batch of `--prompts` short prompts generates `--new-tokens` greedy tokens
each, timed. Short prompts make the run decode-bound, so the time per generated position
(`step_ms` = seconds / new tokens) is the engine's decode step. Rows, one JSON line each:
backend, step_ms, tok_per_s, `greedy_agree` (tokens equal to xla's before each row's first
divergence / all tokens) and `step_over_auto`.

    python scripts/check_torch_backend.py [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np

from hybridserve import LLM, SamplingParams
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.weights.loader import read_config


def run(backend: str, model: str, prompts: list[dict], new_tokens: int) -> dict:
    """One engine: warmup, then the timed greedy generation."""
    llm = LLM(model, dtype="float32", backend=backend, max_model_len=512,
              max_num_seqs=len(prompts), max_num_batched_tokens=256, progress=False)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compile every shape the timed run meets
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    gc.collect()
    return {"backend": backend, "tokens": tokens, "step_ms": 1e3 * seconds / new_tokens,
            "tok_per_s": sum(map(len, tokens)) / seconds}  # fmt: skip


def agree(tokens: list[list[int]], ref: list[list[int]]) -> str:
    same = 0
    for got, want in zip(tokens, ref, strict=True):
        for g, w in zip(got, want, strict=True):
            if g != w:
                break
            same += 1
    return f"{same}/{sum(map(len, ref))}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--prompts", type=int, default=8, help="rows decoded together (8)")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens a row (48)")
    parser.add_argument("--backends", nargs="+", default=["xla", "auto", "torch"])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    vocab = read_config(args.model).vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, int(n)).tolist()}
               for n in rng.integers(8, 32, args.prompts)]  # fmt: skip
    results: dict[str, dict] = {}
    for backend in args.backends:
        try:
            results[backend] = run(backend, args.model, prompts, args.new_tokens)
        except Exception as exc:  # noqa: BLE001  (report, go on with the next backend)
            print(json.dumps({"backend": backend, "error": f"{exc}"[:400]}), flush=True)
    rows = []
    for res in results.values():
        row = {k: v for k, v in res.items() if k != "tokens"}
        if "xla" in results:
            row["greedy_agree"] = agree(res["tokens"], results["xla"]["tokens"])
        if "auto" in results:
            row["step_over_auto"] = res["step_ms"] / results["auto"]["step_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
