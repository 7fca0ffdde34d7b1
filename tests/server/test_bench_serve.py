"""`hybridserve bench serve` against the shared running server: every request completes, the
token counts are what was asked, and the result JSON has `vllm bench serve`'s field names."""

from __future__ import annotations

import json
import subprocess
import sys

VLLM_FIELDS = {
    "duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
    "errors", *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99")
                for m in ("ttft", "tpot", "itl", "e2el")),
}  # fmt: skip


def test_bench_serve_against_a_running_server(server, tmp_path):
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "hybridserve.cli", "bench", "serve", "--base-url", server.url,
        "--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "6",
        "--max-concurrency", "4", "--result-file", str(out), "--metric-percentiles", "50,99",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "TTFT (ms)" in proc.stdout
    result = json.loads(out.read_text())
    assert set(result) >= VLLM_FIELDS
    assert result["completed"] == 8 and not any(result["errors"])
    assert result["total_input_tokens"] == 8 * 16 and result["output_lens"] == [6] * 8
    assert result["total_output_tokens"] == 48
    assert 0 < result["p50_ttft_ms"] <= result["p99_ttft_ms"] <= result["mean_e2el_ms"] * 8
    # a gap per streamed event after the first (a token whose text is not complete yet, such
    # as part of a UTF-8 character, rides with the next one)
    assert all(len(itl) <= 5 for itl in result["itls"]) and sum(map(len, result["itls"])) > 8
    assert result["mean_tpot_ms"] > 0 and result["output_throughput"] > 0


def test_bench_serve_reports_failed_requests(tmp_path):
    """No server at the URL: every request fails, the run ends with the errors, exit 1."""
    cmd = [sys.executable, "-m", "hybridserve.cli", "bench", "serve", "--base-url",
           "http://127.0.0.1:9", "--num-prompts", "2", "--timeout", "5"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "failed requests" in proc.stdout
