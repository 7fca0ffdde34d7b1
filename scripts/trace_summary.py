#!/usr/bin/env python
"""Sum the GPU kernel time of a JAX profile (the perfetto trace of `jax.profiler.trace(...,
create_perfetto_trace=True)`) by kernel name: where a step's device time goes.

    python scripts/trace_summary.py TRACE_DIR [--top 25] [--steps 5]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def kernel_times(path: Path) -> dict[str, tuple[float, int]]:
    """{kernel name: (total microseconds, count)} over the GPU streams of one trace file."""
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
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e:
            out[e["name"]][0] += float(e["dur"])
            out[e["name"]][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--steps", type=int, default=5, help="calls traced (per-step numbers)")
    args = parser.parse_args()
    files = sorted(args.trace_dir.rglob("*.trace.json.gz")) + sorted(
        args.trace_dir.rglob("perfetto_trace.json.gz")
    )
    if not files:
        raise SystemExit(f"no trace under {args.trace_dir}")
    times = kernel_times(files[-1])
    total = sum(t for t, _ in times.values())
    count = sum(n for _, n in times.values())
    print(
        f"{files[-1]}: {count / args.steps:.0f} kernels, {total / args.steps / 1e3:.3f} ms per step"
    )
    for name, (t, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(
            f"{t / args.steps:9.1f} us {n / args.steps:6.1f}x  {100 * t / total:5.1f}%  {name[:90]}"
        )


if __name__ == "__main__":
    main()
