"""bench_kernels' JSON (`scripts/kernels_json.py`) and its peers (`scripts/kernel_peers.py`) on
the CPU: the rows take the issue's fields, and a peer that is not installed is reported and
skipped, never ending the benchmark."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import kernel_peers  # noqa: E402
from kernels_json import kernels_json  # noqa: E402


def test_rows_take_the_schema_fields() -> None:
    rows = [
        {"section": "ceiling", "variant": "copy", "ms": 1.0, "GBps": 4200.0},
        {
            "section": "mamba2 scan",
            "variant": "one-pass",
            "ms": 2.0,
            "shape": [1, 64, 8, 16],
            "tok_per_s": 3e7,
            "rel_err": 1e-3,
        },  # fmt: skip
        {"section": "decode attn", "variant": "pallas", "ms": 3.0, "of_bandwidth": 0.8},
    ]
    args = argparse.Namespace(prefill_tokens=256, decode_context=512, commit="abc1234")
    out = kernels_json(rows, args, 4.2e12, 1)
    assert {"date", "commit", "device", "copy_gbps", "rows"} <= set(out)
    assert out["commit"] == "abc1234" and out["copy_gbps"] == 4200.0
    got = [(r["op"], r["impl"], r["rate"], r["unit"]) for r in out["rows"]]
    assert got == [
        ("ceiling", "copy", 4200.0, "GB/s"),
        ("mamba2 scan", "one-pass", 3e7, "tok/s/layer"),
        ("decode attn", "pallas", 0.8, "of the copy ceiling"),
    ]
    assert out["rows"][1]["shape"] == [1, 64, 8, 16]  # its own shape
    assert out["rows"][2]["shape"] == "64 rows x 512 ctx, 32/8 heads d128"  # its section's
    assert out["rows"][1]["rel_err"] == 1e-3  # the other numbers stay


def test_missing_peers_are_reported_not_raised(capsys) -> None:
    reported = []
    report = lambda *a, **k: reported.append(a)  # noqa: E731
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 32, 4, 16)), jnp.bfloat16)
    timed = lambda fn, *a, iters: 1.0  # noqa: E731
    kernel_peers.attention(x, x[:, :, :2], x[:, :, :2], x, timed, report, 1)
    kernel_peers.conv(x[0], x[0, 0, :, :4].T, x[0, 0, 0], x[0], 1e12, report, 1)
    assert kernel_peers.torch_copy(report, 1, 2**20) == 0.0  # no CUDA here
    printed = capsys.readouterr().out
    for peer in ("tokamax", "fla"):
        installed = importlib.util.find_spec(peer) is not None
        assert installed or f"FAILED ModuleNotFoundError: No module named '{peer}'" in printed
    assert reported == [] or all(r[0] in ("prefill attn", "sconv") for r in reported)


def test_smoke_run_writes_the_json(tmp_path) -> None:
    """The script end to end on the CPU (--smoke sizes, the norm and grouped-matmul section,
    --peers): it finishes and its JSON holds our rows with rates, peers absent or not."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "kernels.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)}
    cmd = [sys.executable, str(root / "scripts" / "bench_kernels.py"), "--smoke", "--peers",
           "--only", "misc", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    ours = {(r["op"], r["impl"].split()[0]) for r in rows}
    assert {("grouped matmul", "xla"), ("grouped matmul", "pallas"), ("rms_norm", "xla")} <= ours
    assert all(r["rate"] > 0 and r["ms"] > 0 and r["unit"] for r in rows)


def test_fp8_bench_smoke_run_writes_the_json(tmp_path) -> None:
    """bench_fp8 end to end on the CPU (--smoke sizes, the GEMV and MoE sections): FP8 rows
    checked against the xla reference, the JSON in the issue's fields."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "fp8.json"
    cmd = [sys.executable, str(root / "scripts" / "bench_fp8.py"), "--smoke", "--only", "gemv",
           "moe", "--json", str(out), "--commit", "abc1234"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert {"date", "commit", "device", "copy_gbps", "bf16_tflops", "rows"} <= set(data)
    fp8_rows = [r for r in data["rows"] if r["impl"].startswith("fp8")]
    assert {r["op"] for r in fp8_rows} == {"gemv", "moe"} and len(fp8_rows) == 8
    assert all(r["err"] < 1e-2 and r["unit"] for r in fp8_rows)
