"""`load_format="dummy"`: random weights from a config alone, reproducible from the seed; and
the decode-roofline script that uses them, run once at toy size."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from backends.protocol import load_ops
from hybridserve.parallel import make_mesh
from hybridserve.weights.loader import load_model

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_decode  # noqa: E402
import random_models  # noqa: E402


def _flat(model) -> dict[str, np.ndarray]:
    _, state = nnx.split(model)
    return {
        ".".join(map(str, p)): np.asarray(v.get_value(), np.float32)
        for p, v in nnx.to_flat_state(state)
    }


def test_dummy_weights_follow_the_seed_and_the_recipe(tmp_path: Path) -> None:
    path = random_models.write_config("tiny", tmp_path / "tiny")
    mesh = make_mesh(1)
    load = lambda seed: _flat(  # noqa: E731
        load_model(path, load_ops("xla"), mesh, "bfloat16", False, "dummy", seed)[0]
    )
    a, b, c = load(0), load(0), load(1)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    w = "layers.0.mixer.in_x.kernel"
    assert not np.array_equal(a[w], c[w])
    assert abs(a[w].std() - 0.02) < 0.002 and abs(a[w].mean()) < 0.002
    assert np.all(a["layers.0.norm.weight"] == 1) and np.all(a["layers.0.mixer.D"] == 1)
    dt = np.log1p(np.exp(a["layers.0.mixer.dt_bias"]))  # softplus(dt_bias) in [1e-3, 0.1]
    assert np.all((dt > 0.9e-3) & (dt < 0.11))
    minus_a = np.exp(a["layers.0.mixer.A_log"])
    assert np.all((minus_a >= 0.99) & (minus_a <= 16.1))
    with pytest.raises(ValueError, match="load_format"):
        load_model(path, load_ops("xla"), mesh, "bfloat16", False, "random", 0)


def test_bench_decode_reports_consistent_rows(tmp_path: Path) -> None:
    """The script's engine runs on dummy weights; its rows add up."""
    result = bench_decode.main(
        ["--shape", "tiny", "--batch", "1", "2", "--context", "16", "--steps", "2"]
        + ["--copy-mib", "4", "--json", str(tmp_path / "d.json")]
        + ["--backend", "xla", "--max-num-seqs", "2"]
    )
    assert (tmp_path / "d.json").is_file()
    assert {row["backend"] for row in result["rows"]} == {"xla"}
    bw = result["copy_gbps"] * 1e9
    for row in result["rows"]:
        total = row["weights_bytes"] + row["kv_bytes"] + row["state_bytes"]
        assert row["floor_ms"] == pytest.approx(1e3 * total / bw)
        assert row["forward_over_floor"] == pytest.approx(row["forward_ms"] / row["floor_ms"])
        assert row["kv_bytes"] > 0 and row["state_bytes"] > 0
    rows = result["rows"]
    assert rows[1]["state_bytes"] == 2 * rows[0]["state_bytes"]
    assert rows[1]["kv_bytes"] == 2 * rows[0]["kv_bytes"]
    (prefill,) = result["prefill"]  # 8 prompts of 16 tokens in one packed step
    assert prefill["prompt_tokens"] == 8 * 16 and prefill["program_tokens"] == 8 * 16
    assert prefill["prefill_over_matmul"] == pytest.approx(
        prefill["prefill_ms"] / prefill["matmul_only_ms"]
    )
