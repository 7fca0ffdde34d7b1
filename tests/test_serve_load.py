"""scripts/serve_load.py on CPU: `hybridserve serve` started as a user starts it (dummy weights
of the tiny shape), N completions sent at once, every one answered, and the report says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import serve_load  # noqa: E402


def test_serve_load_reports_every_request(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = ["--shape", "tiny", "--max-model-len", "128", "--requests", "6"]
    argv += ["--input-len", "20", "--output-len", "3", "--json", str(out)]
    argv += ["--log", str(tmp_path / "server.log"), "--start-timeout", "300"]
    assert serve_load.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == report["succeeded"] == 6 and report["refused"] == {}
    assert report["output_tokens"] == 6 * 3  # EOS ignored: every request runs to its length
    assert "--max-model-len 128" in report["command"] and "--load-format dummy" in report["command"]
    # the server's pool line: pages, and how many requests of max_model_len fit
    assert len(report["pool"]) == 1 and "requests of max_model_len 128" in report["pool"][0]


def test_serve_load_exits_1_when_a_request_fails(tmp_path: Path) -> None:
    """Prompts longer than the server's max_model_len are refused (HTTP 400): the script
    reports each refusal by status and message and exits 1."""
    out = tmp_path / "report.json"
    argv = ["--shape", "tiny", "--max-model-len", "16", "--requests", "2"]
    argv += ["--input-len", "20", "--output-len", "2", "--json", str(out)]
    assert serve_load.main(argv) == 1
    report = json.loads(out.read_text())
    assert report["succeeded"] == 0 and sum(report["refused"].values()) == 2
    assert all(key.startswith("400") for key in report["refused"])
