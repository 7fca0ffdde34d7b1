#!/usr/bin/env python
"""End to end on the GPU: the engine with `backend="pallas"` (and `torch`) against `xla`.

Two models: the shipped default and a ~1B-parameter random-weight hybrid (Nemotron-H pattern:
Mamba2, attention, MLP; written once as a converted checkpoint). For each, in bfloat16:
  1. prompt logits (one 512-token prompt, computed from scratch) per backend, with the xla
     float32 logits as the anchor: `err(b) = |logits_b - logits_xla| / |logits_xla|` (L2), and
     the bf16 noise floor `|logits_xla_bf16 - logits_xla_f32| / |logits_xla_f32|`. A backend
     passes when its error is no more than twice the floor (it differs from xla by about as
     much as bfloat16 itself does);
  2. greedy generation (8 prompts of 20-400 tokens, 32 new tokens each, 2 x 8 for the ~1B
     model; continuous batching and chunked prefill): tokens per second, and how many tokens
     agree with xla before the first divergence (bf16 near-ties may flip late tokens; the
     logits check is the criterion); then the same in float32 against xla's float32 tokens
     (`greedy_agree_f32`: there they should agree in full).

With `--logits-only`, step 1 alone (no generation, no float32 run of the backends): a few
compiles, e.g. to try the Hopper prefill attention inside the engine on the ~1B model (d 128)
with `--skip-default` (set HYBRIDSERVE_HOPPER_ATTENTION=0 for the Triton kernel instead).

    python scripts/check_gpu_backends.py [--backends pallas torch] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from backends.protocol import load_ops
from hybridserve import LLM, SamplingParams
from hybridserve.config import ModelConfig
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.models.hybrid import HybridModel
from hybridserve.weights.loader import read_config, save_converted

PATTERN = "M*M-" * 8  # 32 layers: 16 Mamba2, 8 attention, 8 MLP


def random_billion(dst: Path) -> int:
    """Write a ~1B random-weight hybrid (converted format, the default model's tokenizer);
    returns its parameter count."""
    base = read_config(DEFAULT_MODEL)
    kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
    d = base.to_dict()
    d.update(hidden_size=2048, layer_types=[kinds[c] for c in PATTERN], dtype="bfloat16",
             max_position_embeddings=4096)  # fmt: skip
    d["attention"].update(num_heads=16, num_kv_heads=4, head_dim=128)
    d["mamba"].update(num_heads=64, head_dim=64, n_groups=8, state_size=128, chunk_size=128)
    d["mlp"].update(intermediate_size=12288)
    d["moe"] = None
    cfg = ModelConfig.from_dict(d)
    model = HybridModel(cfg, load_ops("xla"), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    save_converted(model, cfg, dst, DEFAULT_MODEL, jnp.bfloat16)
    return int(count)


def run_backend(
    model: str, backend: str, dtype: str, prompt: list[int], prompts: list, new_tokens: int
) -> dict:
    """The prompt's logits, then (unless `new_tokens` is 0) greedy tokens of `prompts`."""
    llm = LLM(model, dtype=dtype, backend=backend, max_model_len=1024, max_num_seqs=16,
              max_num_batched_tokens=512, max_prefill_chunk=256, progress=False)  # fmt: skip
    logits = np.asarray(jnp.asarray(llm.engine.runner.sequence_logits(prompt), jnp.float32))
    if new_tokens == 0:
        del llm
        gc.collect()
        return {"logits": logits, "tokens": [[] for _ in prompts], "tok_per_s": None}
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # compile the common shapes
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    gc.collect()
    return {"logits": logits, "tokens": tokens, "tok_per_s": sum(map(len, tokens)) / seconds}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def agree(tokens: list[list[int]], ref: list[list[int]]) -> tuple[int, int]:
    """(tokens equal to the reference before each row's first divergence, all tokens)."""
    same = 0
    for got, want in zip(tokens, ref, strict=True):
        for g, w in zip(got, want, strict=True):
            if g != w:
                break
            same += 1
    return same, sum(map(len, ref))


def check(
    name: str, model: str, backends: list[str], n_prompts: int, new_tokens: int
) -> list[dict]:
    vocab = read_config(model).vocab_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, vocab, 512).tolist()
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, int(n)).tolist()}
               for n in rng.integers(20, 400, n_prompts)]  # fmt: skip
    anchor = run_backend(model, "xla", "float32", prompt, prompts, new_tokens)
    ref = run_backend(model, "xla", "bfloat16", prompt, prompts, new_tokens)
    floor = rel(ref["logits"], anchor["logits"])
    rows = [{"model": name, "backend": "xla", "err_vs_xla_f32": floor, "floor": floor,
             "tok_per_s": ref["tok_per_s"], "ok": True}]  # fmt: skip
    print(json.dumps(rows[-1]), flush=True)
    for backend in backends:
        try:
            got = run_backend(model, backend, "bfloat16", prompt, prompts, new_tokens)
            exact = got if new_tokens == 0 else run_backend(
                model, backend, "float32", prompt, prompts, new_tokens)  # fmt: skip
        except Exception as exc:  # noqa: BLE001  (report, go on with the next backend)
            rows.append({"model": name, "backend": backend, "error": f"{exc}"[:300], "ok": False})
            print(json.dumps(rows[-1]), flush=True)
            continue
        same, total = agree(got["tokens"], ref["tokens"])
        err = rel(got["logits"], anchor["logits"])
        same32, _ = agree(exact["tokens"], anchor["tokens"])
        rows.append({
            "model": name, "backend": backend, "err_vs_xla_f32": err, "floor": floor,
            "err_vs_xla_bf16": rel(got["logits"], ref["logits"]),
            "greedy_agree": f"{same}/{total}", "greedy_agree_f32": f"{same32}/{total}",
            "tok_per_s": got["tok_per_s"], "ok": bool(err <= 2 * floor),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="*", default=["pallas"])
    parser.add_argument("--skip-billion", action="store_true", help="the default model only")
    parser.add_argument("--skip-default", action="store_true", help="the ~1B model only")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--logits-only", action="store_true",
                        help="only the prompt-logits check (no generation, no float32 run of "
                             "the backends): a few compiles")  # fmt: skip
    args = parser.parse_args()
    new_tokens = (0, 0) if args.logits_only else (32, 8)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rows = (
        []
        if args.skip_default
        else check("default", str(DEFAULT_MODEL), args.backends, 8, new_tokens[0])
    )
    if not args.skip_billion:
        with tempfile.TemporaryDirectory() as tmp:
            count = random_billion(Path(tmp) / "random-1b")
            print(f"random hybrid: {count / 1e9:.2f}B parameters, pattern {PATTERN}", flush=True)
            name, path = f"random {count / 1e9:.2f}B", str(Path(tmp) / "random-1b")
            # few shapes: each compile is long
            rows += check(name, path, args.backends, 2, new_tokens[1])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if not all(r["ok"] for r in rows):
        raise SystemExit("a backend differs from xla by more than bfloat16 does")


if __name__ == "__main__":
    main()
