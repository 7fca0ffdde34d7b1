#!/usr/bin/env python
"""Serving load generator: colocated vs disaggregated (prefill + decode) engines, a concurrency
sweep, output tokens/s per GPU against tokens/s per user (the Pareto plot).

Deployments (each engine a worker process, `hybridserve/entrypoints/worker.py`):
  colocated      --gpus / --colocated-tp instances of TP --colocated-tp; a request goes to the
                 instance with the fewest requests in flight.
  disaggregated  one prefill engine (TP --prefill-tp) and one decode engine (TP --decode-tp) on
                 their own GPUs; the prefill engine computes the prompt and hands its KV pages and
                 Mamba states to the decode engine over NIXL (--transfer-mode pull | push).
On a GPU machine each worker sees its own GPUs (CUDA_VISIBLE_DEVICES); without GPUs the workers
run on CPU devices (a check of the machinery, not a measurement).

Workloads (--workloads IN/OUT ..., default 1024/128, prefill-heavy, and 1024/1024,
decode-heavy): random prompts of IN tokens, OUT tokens each (greedy, EOS ignored), closed
loop: C requests in flight, a new one sent when one finishes, --num-prompts requests in all
(default --waves * C, at least 8), after a warmup pass of --warmup-waves * C of them (default 2)
at the same C (it compiles the programs the timed pass needs). Per (workload, deployment, C):
  output tok/s/GPU = output tokens / (last finish - first send) / GPUs used
  bound tok/s      = the workload's roofline bound per GPU (`serving_bound`: prefill FLOPs
                     at the matmul ceiling + decode bytes at the copy bandwidth, both measured
                     on the device at the start of the run), and the ratio achieved
  tok/s/user       = median over requests of (tokens - 1) / (last token - first token)
  TTFT             = first token - send (percentiles), ITL = gaps between a request's tokens
                     (percentiles over all gaps); token times come from the engine processes.
  prefill padding  = the slots of the prefill programs / the prompt tokens they computed
                     (packed prefill: `runner.packed`), over the timed pass.

    # one H200, colocated, both workloads (benchmarks/h200/serving.json)
    python scripts/bench_serving.py --shape nano-9b-v2 --gpus 1 --modes colocated \\
        --json benchmarks/h200/serving.json --plot serving.png
    # the two-GPU comparison (one H200 each for P and D; 2 colocated instances)
    python scripts/bench_serving.py --shape nano-9b-v2 --gpus 2 --workloads 1024/256 \\
        --concurrency 8 16 32 64 128 256
    # eight GPUs: colocated TP 8 against 1 prefill TP 4 + 1 decode TP 4
    python scripts/bench_serving.py --shape nano-30b-a3b --gpus 8 --colocated-tp 8 \\
        --prefill-tp 4 --decode-tp 4 --concurrency 8 16 32 64 128 256
    # a CPU check of the machinery (about two minutes)
    python scripts/bench_serving.py --shape tiny --gpus 2 --workloads 32/8 \\
        --concurrency 2 4 --num-prompts 8
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hybridserve.entrypoints.worker import WorkerSpec, spawn_workers
from hybridserve.server.flags import GPU_SERVE_DEFAULTS

sys.path.insert(0, str(Path(__file__).resolve().parent))
import random_models  # noqa: E402
from serving_bound import WorkloadBound, ceilings  # noqa: E402

MODES = ("colocated", "disaggregated")


def _gpu_env(first: int, count: int, on_gpu: bool) -> dict[str, str] | None:
    if not on_gpu:
        return None
    return {
        "JAX_PLATFORMS": "cuda",
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(first, first + count)),
    }


def engine_kwargs(model: str, args: argparse.Namespace, tp: int) -> dict:
    return {
        "model": model,
        "dtype": args.dtype,
        "tensor_parallel_size": tp,
        "max_model_len": max(i + o for i, o in args.workloads) + 16,
        "max_num_seqs": max(args.concurrency),
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_prefill_tokens": args.max_num_prefill_tokens,
        "max_prefill_chunk": min(max(i for i, _ in args.workloads), args.max_num_batched_tokens),
        "enable_prefix_caching": False,
        "load_format": "auto" if args.model else "dummy",
        "cache": {"memory_bytes": int(args.cache_gib * 2**30)},
    }


class Deployment:
    """The worker processes of one mode and how a request flows through them."""

    def __init__(self, mode: str, model: str, args: argparse.Namespace, on_gpu: bool) -> None:
        self.mode = mode
        self.runs = 0  # request ids are unique over runs (a prefill engine may still hold pages)
        if mode == "colocated":
            tp = args.colocated_tp
            specs = [
                WorkerSpec(engine_kwargs(model, args, tp), None, tp, _gpu_env(i * tp, tp, on_gpu))
                for i in range(args.gpus // tp)
            ]
        else:
            p, d = args.prefill_tp, args.decode_tp
            consumer = {"kv_role": "kv_consumer", "transfer_mode": args.transfer_mode}
            specs = [
                WorkerSpec(engine_kwargs(model, args, p), {"kv_role": "kv_producer"}, p,
                           _gpu_env(0, p, on_gpu)),
                WorkerSpec(engine_kwargs(model, args, d), consumer, d, _gpu_env(p, d, on_gpu)),
            ]  # fmt: skip
        self.workers = spawn_workers(specs)  # all at once; stopped together on an error
        self.gpus = sum(spec.devices for spec in specs)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()

    def prefill_tokens(self) -> tuple[int, int]:
        """Prompt tokens the workers' prefill programs computed so far, and the slots those
        programs had (padding included): `LLMEngine.stats`."""
        real = padded = 0
        for w, worker in enumerate(self.workers):
            worker.send({"op": "stats"})
            while (message := worker.recv(60.0)) is not None and "stats" not in message:
                pass
            if message is None:
                raise RuntimeError(f"{self.mode} worker {w} sent no statistics")
            real += message["stats"]["prefill_tokens"]
            padded += message["stats"]["prefill_tokens_padded"]
        return real, padded

    def run(self, prompts: list[list[int]], concurrency: int, output_len: int) -> list[dict]:
        """Closed loop over `prompts` with `concurrency` in flight; one record per request:
        {"sent", "token_times", "tokens"}."""
        params = {"temperature": 0.0, "max_tokens": output_len, "ignore_eos": True}
        pending = list(enumerate(prompts))[::-1]
        self.runs += 1
        prefix = f"run{self.runs}-"
        inflight: dict[str, tuple[int, float]] = {}
        load = [0] * len(self.workers)
        done: list[dict] = []

        def send() -> None:
            i, ids = pending.pop()
            req_id = f"{prefix}{i}"
            if self.mode == "colocated":
                w = int(np.argmin(load))
                load[w] += 1
                message = {"op": "add", "req_id": req_id, "timing": True}
            else:
                w, message = 0, {"op": "add", "req_id": req_id, "kv": {"do_remote_decode": True}}
            inflight[req_id] = (w, time.time())
            self.workers[w].send(message | {"prompt_token_ids": ids, "params": params})

        while pending and len(inflight) < concurrency:
            send()
        while inflight:
            for w, worker in enumerate(self.workers):
                if not worker.process.is_alive() and not worker.conn.poll():
                    raise RuntimeError(f"{self.mode} worker {w} died")
                message = worker.recv(0.0005)
                if message is None or "output" not in message:
                    continue
                out = message["output"]
                if "error" in out:
                    raise RuntimeError(f"request {out['req_id']} failed: {out['error']}")
                if self.mode == "disaggregated" and w == 0:  # prefilled: on to the decoder
                    ids = prompts[int(out["req_id"].rsplit("-", 1)[1])]
                    self.workers[1].send(
                        {"op": "add", "req_id": out["req_id"], "prompt_token_ids": ids}
                        | {"params": params, "kv": out["kv"], "timing": True}
                    )
                    continue
                _, sent = inflight.pop(out["req_id"])
                if self.mode == "colocated":
                    load[w] -= 1
                done.append({"sent": sent, "token_times": out["token_times"]})
                if pending:
                    send()
        return done


def summarise(records: list[dict], gpus: int) -> dict:
    """The per-level numbers of the module docstring."""
    start = min(r["sent"] for r in records)
    end = max(r["token_times"][-1] for r in records)
    tokens = sum(len(r["token_times"]) for r in records)
    ttft = [r["token_times"][0] - r["sent"] for r in records]
    gaps = np.concatenate([np.diff(r["token_times"]) for r in records])
    per_user = [
        (len(t) - 1) / (t[-1] - t[0])
        for t in (r["token_times"] for r in records)
        if len(t) > 1 and t[-1] > t[0]
    ]

    def pct(xs, q: float) -> float:
        return 1e3 * float(np.percentile(xs, q)) if len(xs) else float("nan")

    return {
        "requests": len(records),
        "output_tokens": tokens,
        "seconds": end - start,
        "output_tok_s_per_gpu": tokens / (end - start) / gpus,
        "tokens_per_s_per_user": float(np.median(per_user)) if per_user else float("nan"),
        **{f"ttft_p{q}_ms": pct(ttft, q) for q in (50, 90, 99)},
        **{f"itl_p{q}_ms": pct(gaps, q) for q in (50, 90, 99)},
    }


def plot(rows: list[dict], path: Path, title: str) -> None:
    """tokens/s/GPU against tokens/s/user, one line per mode, points labelled with C."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for mode in MODES:
        pts = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["concurrency"])
        if not pts:
            continue
        xs = [r["tokens_per_s_per_user"] for r in pts]
        ys = [r["output_tok_s_per_gpu"] for r in pts]
        ax.plot(xs, ys, "o-", label=mode)
        for r, x, y in zip(pts, xs, ys, strict=True):
            ax.annotate(f"C={r['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("output tokens/s per user")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = random_models.model_parser(__doc__)
    add = parser.add_argument
    add("--modes", nargs="+", choices=MODES, default=list(MODES))
    add("--gpus", type=int, default=2, help="GPUs per deployment (default 2)")
    add("--colocated-tp", type=int, default=1, help="TP of each colocated instance (default 1)")
    add("--prefill-tp", type=int, default=1, help="TP of the prefill engine (default 1)")
    add("--decode-tp", type=int, default=1, help="TP of the decode engine (default 1)")
    add("--transfer-mode", choices=["pull", "push"], default="push")
    add(
        "--workloads",
        nargs="+",
        type=_workload,
        default=[(1024, 128), (1024, 1024)],
        help="IN/OUT prompt and output tokens (default 1024/128 1024/1024)",
    )
    add("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    add("--num-prompts", type=int, help="requests per level (default --waves x C, at least 8)")
    add("--waves", type=int, default=4, help="requests per level in units of C (default 4)")
    add(
        "--warmup-waves",
        type=int,
        default=2,
        help="warmup requests per level in units of C (default 2): the programs the timed "
        "pass meets compile here (each a few seconds for the 9B shape on the H200)",
    )
    add("--max-num-batched-tokens", type=int, default=8192)
    add(
        "--max-num-prefill-tokens",
        type=int,
        default=GPU_SERVE_DEFAULTS["max_num_prefill_tokens"],
        help="prompt tokens per step beside decodes, all requests together (default "
        f"{GPU_SERVE_DEFAULTS['max_num_prefill_tokens']}, what `hybridserve serve` takes on a GPU)",
    )
    add("--cache-gib", type=float, default=40, help="cache pool GiB per rank (default 40)")
    add("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    add("--json", type=Path, help="write every level's numbers here")
    add("--plot", type=Path, help="write the Pareto plot (PNG) here (one per workload: -IN-OUT)")
    add("--commit", default="", help="the code's commit, for the JSON")
    args = parser.parse_args(argv)
    if args.gpus % args.colocated_tp:
        parser.error("--gpus must be a multiple of --colocated-tp")
    if "disaggregated" in args.modes and args.prefill_tp + args.decode_tp != args.gpus:
        parser.error("--prefill-tp + --decode-tp must equal --gpus (the same GPUs per mode)")
    if args.waves < 1 or args.warmup_waves < 1:
        parser.error("--waves and --warmup-waves must be >= 1")
    if min(o for _, o in args.workloads) < 2 or min(args.concurrency) < 1:
        parser.error("every workload's OUT must be >= 2 and every concurrency >= 1")
    return args


def _workload(text: str) -> tuple[int, int]:
    try:
        i, o = (int(v) for v in text.split("/"))
    except ValueError:
        msg = f"a workload is IN/OUT tokens, e.g. 1024/128: {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if i < 1 or o < 1:
        raise argparse.ArgumentTypeError(f"IN and OUT must be >= 1: {text!r}")
    return i, o


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    on_gpu = _has_gpus()
    ceil = ceilings(_gpu_env(0, 1, on_gpu))
    print(
        f"{ceil['device']}: matmul {ceil['matmul_flop_s'] / 1e12:.1f} TFLOP/s, "
        f"copy {ceil['copy_bytes_s'] / 1e9:.0f} GB/s",
        flush=True,
    )
    rows: list[dict] = []
    result = {
        "date": datetime.date.today().isoformat(),
        "commit": args.commit,
        "device": ceil["device"],
        "ceilings": ceil,
        "args": {k: str(v) for k, v in vars(args).items()},
        "on_gpu": on_gpu,
        "rows": rows,
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = str(args.model or random_models.write_config(args.shape, tmp))
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        bound = WorkloadBound(model, args.dtype)
        rng = np.random.default_rng(0)
        for mode in args.modes:
            print(f"[{mode}] starting workers ...", flush=True)
            deployment = Deployment(mode, model, args, on_gpu)
            try:
                for (i, o), c in itertools.product(args.workloads, args.concurrency):
                    n = args.num_prompts or max(8, args.waves * c)
                    total = max(n, args.warmup_waves * c)
                    prompts = [rng.integers(3, vocab, i).tolist() for _ in range(total)]
                    deployment.run(prompts[: args.warmup_waves * c], c, o)  # warmup: compiles
                    before = deployment.prefill_tokens()
                    records = deployment.run(prompts[:n], c, o)
                    after = deployment.prefill_tokens()
                    row = {"mode": mode, "concurrency": c, "input_len": i, "output_len": o}
                    row |= {"gpus": deployment.gpus} | summarise(records, deployment.gpus)
                    real, padded = after[0] - before[0], after[1] - before[1]
                    row["prefill_padding"] = padded / max(real, 1)
                    gpus = deployment.gpus  # the bound per GPU, as the throughput
                    row["bound_tok_s"] = bound.tokens_per_s(ceil, i, o, c, gpus) / gpus
                    row["of_bound"] = row["output_tok_s_per_gpu"] / row["bound_tok_s"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.json:
                        args.json.write_text(json.dumps(result, indent=2))
            finally:
                deployment.close()
    _print_table(rows)
    if args.plot:
        name = args.model.name if args.model else args.shape
        for i, o in args.workloads:
            pts = [r for r in rows if (r["input_len"], r["output_len"]) == (i, o)]
            path = args.plot.with_name(f"{args.plot.stem}-{i}-{o}{args.plot.suffix}")
            plot(pts, path, f"{name}, {i}/{o} tokens, {args.gpus} GPUs")
    return result


def _has_gpus() -> bool:
    """NVIDIA GPUs present (asked of nvidia-smi: JAX in this process would take GPU memory)."""
    if shutil.which("nvidia-smi") is None:
        return False
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return out.returncode == 0 and "GPU" in out.stdout


def _print_table(rows: list[dict]) -> None:
    print(
        f"{'mode':>13} {'in/out':>10} {'C':>4} {'reqs':>5} {'tok/s/GPU':>10} {'bound':>8} "
        f"{'of bound':>8} {'tok/s/user':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
        f"{'ITL p99':>8} {'padding':>7}"
    )
    for r in rows:
        print(
            f"{r['mode']:>13} {r['input_len']:>5}/{r['output_len']:<4} {r['concurrency']:>4} "
            f"{r['requests']:>5} {r['output_tok_s_per_gpu']:>10.1f} {r['bound_tok_s']:>8.1f} "
            f"{r['of_bound']:>8.2f} {r['tokens_per_s_per_user']:>10.1f} "
            f"{r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>9.1f} "
            f"{r['itl_p50_ms']:>8.2f} {r['itl_p99_ms']:>8.2f} {r['prefill_padding']:>7.2f}"
        )


if __name__ == "__main__":
    main()
