"""scripts/bench_engine.py end to end on the tiny random Inkling: none, mtp and oracle modes give
the same greedy outputs, and the oracle's perfect drafts are all accepted. One MTP head and one
draft per step: the MTP programs compile in half the time of three (about 45 s in all on 2
CPU cores)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_engine  # noqa: E402


def test_bench_engine_random_tiny_speculative(tmp_path):
    out = tmp_path / "bench.json"
    argv = shlex.split(
        "--random-config tiny --mtp-heads 1 --concurrency 1 --input-len 8 --output-len 5 "
        "--rounds 1 --speculative oracle mtp none --num-speculative-tokens 1"
    ) + ["--save-dir", str(tmp_path / "model"), "--json", str(out)]
    bench_engine.main(argv)
    result = json.loads(out.read_text())
    assert result["checks"] == {"ok": True, "failures": []}
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == ["none", "mtp", "oracle"]  # none first, whatever the order asked
    assert all(r["output_tokens"] == 5 and r["concurrency"] == 1 for r in rows.values())
    assert len({r["outputs_sha1"] for r in rows.values()}) == 1
    assert rows["mtp"]["outputs_match_none"] and rows["oracle"]["outputs_match_none"]
    assert rows["oracle"]["spec_acceptance_rate"] == 1.0
    # after the prefill token, 4 tokens: two steps each verifying 1 draft, all accepted
    assert rows["oracle"]["spec_num_drafts"] == rows["oracle"]["spec_num_accepted"] == 2
    assert rows["oracle"]["spec_tokens_per_step"] == 2
    assert rows["mtp"]["spec_num_drafts"] > 0
    model = result["meta"]["model"]
    assert model["pattern"] == "SA" and model["mtp_heads"] == 1 and model["params"] > 0
    assert rows["none"]["tokens_per_s_per_user"] == rows["none"]["output_tokens_per_s"]
