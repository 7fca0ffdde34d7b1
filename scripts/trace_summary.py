#!/usr/bin/env python
"""Sum the GPU kernel time of a JAX profile (the perfetto trace of `jax.profiler.trace(...,
create_perfetto_trace=True)`) by kernel name: where a step's device time goes.

    python scripts/trace_summary.py TRACE_DIR [--top 25] [--steps 5]
    # kernels of the same kind together (XLA's instance numbers dropped), most frequent first
    python scripts/trace_summary.py TRACE_DIR --group --top 60
    # the first N kernels in launch order (one step's pattern, layer by layer)
    python scripts/trace_summary.py TRACE_DIR --sequence 400
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path


def gpu_kernels(path: Path) -> list[tuple[float, str, float]]:
    """(start us, name, duration us) of every kernel on the GPU streams of one trace file, in
    start order."""
    with gzip.open(path) as f:
        events = json.loads(f.read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    gpu = {pid for pid, n in names.items() if "GPU" in n or "gpu" in n}
    if not gpu:
        print("no GPU streams; processes:", sorted(set(names.values()))[:20])
    out = [
        (float(e["ts"]), e["name"], float(e["dur"]))
        for e in events
        if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e
    ]
    return sorted(out)


def kernel_times(path: Path) -> dict[str, tuple[float, int]]:
    """{kernel name: (total microseconds, count)} over the GPU streams of one trace file."""
    return summed(gpu_kernels(path))


def summed(kernels: list[tuple[float, str, float]]) -> dict[str, tuple[float, int]]:
    """{kernel name: (total microseconds, count)} of `gpu_kernels`' list."""
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for _, name, dur in kernels:
        out[name][0] += dur
        out[name][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def kind(name: str) -> str:
    """A kernel name without XLA's instance numbers: `loop_add_fusion_12` -> `loop_add_fusion`."""
    return re.sub(r"(_\d+)+$", "", re.sub(r"\.\d+", "", name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--steps", type=int, default=5, help="calls traced (per-step numbers)")
    parser.add_argument("--group", action="store_true", help="by kind, most frequent first")
    parser.add_argument("--sequence", type=int, default=0, help="print the first N kernels")
    args = parser.parse_args()
    files = sorted(args.trace_dir.rglob("*.trace.json.gz")) + sorted(
        args.trace_dir.rglob("perfetto_trace.json.gz")
    )
    if not files:
        raise SystemExit(f"no trace under {args.trace_dir}")
    kernels = gpu_kernels(files[-1])  # the trace is parsed once
    times = summed(kernels)
    total = sum(t for t, _ in times.values())
    count = sum(n for _, n in times.values())
    print(
        f"{files[-1]}: {count / args.steps:.0f} kernels, {total / args.steps / 1e3:.3f} ms per step"
    )
    if args.group:
        grouped: dict[str, list] = defaultdict(lambda: [0.0, 0])
        for name, (t, n) in times.items():
            grouped[kind(name)][0] += t
            grouped[kind(name)][1] += n
        times = {k: (v[0], v[1]) for k, v in grouped.items()}
    order = (lambda kv: -kv[1][1]) if args.group else (lambda kv: -kv[1][0])
    for name, (t, n) in sorted(times.items(), key=order)[: args.top]:
        print(
            f"{t / args.steps:9.1f} us {n / args.steps:6.1f}x  {100 * t / total:5.1f}%  {name[:90]}"
        )
    for start, name, dur in kernels[: args.sequence]:
        print(f"{start:14.1f} {dur:8.1f} us  {name[:100]}")


if __name__ == "__main__":
    main()
