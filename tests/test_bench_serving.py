"""scripts/bench_serving.py on CPU: both deployments (two colocated engines; a prefill and a
decode engine moving state over real NIXL) serve a closed-loop load, and the numbers add up."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_serving  # noqa: E402


def test_both_deployments_serve_the_sweep(tmp_path: Path) -> None:
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    argv = ["--shape", "tiny", "--gpus", "2", "--input-len", "16", "--output-len", "4"]
    argv += ["--concurrency", "2", "--num-prompts", "4", "--json", str(out), "--plot", str(png)]
    result = bench_serving.main(argv)
    rows = result["rows"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [
        ("colocated", 2),
        ("disaggregated", 2),
    ]
    for r in rows:
        assert r["gpus"] == 2 and r["requests"] == 4
        assert r["output_tokens"] == 4 * 4  # every request generated all its tokens
        rate = r["output_tokens"] / r["seconds"] / r["gpus"]
        assert r["output_tokens_per_s_per_gpu"] == pytest.approx(rate)
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
    assert json.loads(out.read_text())["rows"] == rows
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_counts_must_add_up() -> None:
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--gpus", "2", "--prefill-tp", "2", "--decode-tp", "1"])
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--gpus", "3", "--colocated-tp", "2"])
