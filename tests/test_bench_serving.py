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
    argv = ["--shape", "tiny", "--gpus", "2", "--workloads", "16/4", "--commit", "abc"]
    argv += ["--concurrency", "2", "--num-prompts", "4", "--json", str(out), "--plot", str(png)]
    result = bench_serving.main(argv)
    assert result["commit"] == "abc" and result["device"] and result["date"]
    rows = result["rows"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [
        ("colocated", 2),
        ("disaggregated", 2),
    ]
    for r in rows:
        assert r["gpus"] == 2 and r["requests"] == 4
        assert r["output_tokens"] == 4 * 4  # every request generated all its tokens
        rate = r["output_tokens"] / r["seconds"] / r["gpus"]
        assert r["output_tok_s_per_gpu"] == pytest.approx(rate)
        assert (r["input_len"], r["output_len"]) == (16, 4)
        assert r["bound_tok_s"] > 0 and r["of_bound"] == pytest.approx(rate / r["bound_tok_s"])
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
        # 4 prompts of 16 tokens, in any grouping: rows of 16, bucketed to 1, 2, 3 or 4 rows
        assert 1.0 <= r["prefill_padding"] <= 4 / 3
    assert json.loads(out.read_text())["rows"] == rows
    plot = tmp_path / "s-16-4.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_bound_by_hand(tmp_path: Path) -> None:
    """serving_bound against the formula with the 9B shape's numbers: prefill 2 P I / M, a
    decode step's bytes at batch c over BW, C O tokens in C prefills and O steps."""
    import random_models
    from decode_cost import decode_bytes
    from serving_bound import WorkloadBound

    bound = WorkloadBound(str(random_models.write_config("nano-9b-v2", tmp_path)), "bfloat16")
    assert 8.2e9 < bound.params_per_token < 8.4e9  # 8.89 B less the embedding table
    ceil = {"matmul_flop_s": 8e14, "copy_bytes_s": 4e12}
    step = decode_bytes(bound.cfg, bound.plan, bound.params, 64, 1024 + 64).total / 4e12
    prefill = 2 * bound.params_per_token * 1024 / 8e14
    want = 64 * 128 / (64 * prefill + 128 * step)
    assert bound.tokens_per_s(ceil, 1024, 128, 64) == pytest.approx(want)
    assert bound.tokens_per_s(ceil, 1024, 128, 128, gpus=2) == pytest.approx(2 * want)


def test_gpu_counts_must_add_up() -> None:
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--gpus", "2", "--prefill-tp", "2", "--decode-tp", "1"])
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--gpus", "3", "--colocated-tp", "2"])
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--workloads", "1024x128"])
