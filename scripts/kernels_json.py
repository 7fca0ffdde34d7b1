"""The JSON of a `bench_kernels.py` run (`benchmarks/h200/kernels.json`): {date, commit, device,
copy_gbps, rows: [{op, shape, impl, ms, rate, unit, ...the row's other numbers}]}, our rows and
the peers' (`kernel_peers`) alike."""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import jax

RATES = {
    "TFLOPs": "TFLOP/s",
    "tok_per_s": "tok/s/layer",
    "GBps": "GB/s",
    "of_bandwidth": "of the copy ceiling",
}  # the first of these a row has is its rate


def kernels_json(rows: list[dict], args: argparse.Namespace, bandwidth: float, smoke: int) -> dict:
    """`rows` as printed by bench_kernels (section, variant, ms, numbers) in the JSON's form;
    a row without a shape of its own takes its section's benchmark shape."""
    t, ctx, conv_t = args.prefill_tokens, args.decode_context, 2048 // smoke
    shapes = {
        "prefill attn": f"[1, {t}] 32/8 heads d128",
        "decode attn": f"64 rows x {ctx} ctx, 32/8 heads d128",
        "mamba2 step": "256 rows, 128 heads x 64, state 128",
        "sconv": f"[8, {conv_t}, 8448] w4",
        "sconv step": "[256, 8448] w4",
        "rms_norm": f"[{16384 // smoke}, 4096]",
    }
    return {**run_meta(args.commit), "copy_gbps": bandwidth / 1e9, "rows": json_rows(rows, shapes)}


def json_rows(rows: list[dict], shapes: dict[str, str] | None = None) -> list[dict]:
    """Printed rows (section, variant, ms, numbers) as the JSON's {op, shape, impl, ms, rate,
    unit, ...}; a row without a shape takes its section's from `shapes`."""
    out = []
    for r in rows:
        rate_key = next((k for k in RATES if k in r), None)
        rest = {k: v for k, v in r.items() if k not in ("section", "variant", "ms", "shape")}
        out.append(
            {
                "op": r["section"],
                "shape": r.get("shape", (shapes or {}).get(r["section"], "")),
                "impl": r["variant"],
                "ms": r["ms"],
                "rate": r[rate_key] if rate_key else None,
                "unit": RATES.get(rate_key, ""),
                **rest,
            }
        )
    return out


def run_meta(commit: str | None = None) -> dict:
    """What a benchmark JSON records of its run: date, commit (given, else this checkout's
    HEAD) and device."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit or git_head(),
        "device": jax.devices()[0].device_kind,
    }


def git_head() -> str:
    """The short commit of this checkout, "" where there is no git repository."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out.stdout.strip()
