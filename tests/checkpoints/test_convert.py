"""HF -> orbax conversion: round trip, sharded sources, and clear errors on bad checkpoints."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from checkpoints.convert import convert
from checkpoints.verify import our_logits
from hybridserve.cli import main as cli_main
from hybridserve.weights.safetensors_io import WeightError

IDS = np.random.default_rng(5).integers(3, 512, size=19)


def test_round_trip_gives_identical_logits(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("nemotron_h")
    dst = convert(src, tmp_path / "converted", progress=False)
    assert (dst / "hybridserve_config.json").is_file()
    np.testing.assert_array_equal(our_logits(dst, IDS), our_logits(src, IDS))


def test_sharded_checkpoint_converts(hf_checkpoint, tmp_path):
    src, hf = hf_checkpoint("granitemoehybrid")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    dst = convert(sharded, tmp_path / "converted", progress=False)
    np.testing.assert_array_equal(our_logits(dst, IDS), our_logits(src, IDS))


def _copy(src, tmp_path):
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    return dst


def test_truncated_file_names_a_tensor(hf_checkpoint, tmp_path):
    broken = _copy(hf_checkpoint("nemotron_h")[0], tmp_path)
    path = broken / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(WeightError, match=r"truncated file: tensor '[\w.]+'"):
        convert(broken, tmp_path / "out", progress=False)


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
    broken = _copy(hf_checkpoint("nemotron_h")[0], tmp_path)
    tensors = load_file(broken / "model.safetensors")
    del tensors["backbone.layers.3.mixer.k_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(WeightError, match="missing tensor 'backbone.layers.3.mixer.k_proj.weight'"):
        convert(broken, tmp_path / "out", progress=False)


def test_shape_mismatch_is_named(hf_checkpoint, tmp_path):
    broken = _copy(hf_checkpoint("nemotron_h")[0], tmp_path)
    tensors = load_file(broken / "model.safetensors")
    name = "backbone.layers.0.mixer.out_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(WeightError, match=f"shape mismatch: {name}"):
        convert(broken, tmp_path / "out", progress=False)


def test_cli_convert_with_verify(hf_checkpoint, tmp_path, capsys):
    """--verify prints a PASS verdict with its tolerance; a non-empty output is refused unless
    --overwrite; --verify-only checks an existing output without converting."""
    src, _ = hf_checkpoint("bamba")
    assert cli_main(["convert", str(src), str(tmp_path / "c"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verify: PASS" in out and "over 3 prompts" in out
    diff = float(out.split("vs transformers ")[1].split()[0])
    assert diff < 1e-4
    assert cli_main(["convert", str(src), str(tmp_path / "c")]) == 2  # not empty: refused
    assert "--overwrite replaces it" in capsys.readouterr().err
    assert cli_main(["convert", str(src), str(tmp_path / "c"), "--verify-only"]) == 0
    out = capsys.readouterr().out
    assert "verify: PASS" in out and "converted" not in out
    stamp = (tmp_path / "c" / "hybridserve_config.json").stat().st_mtime_ns
    assert cli_main(["convert", str(src), str(tmp_path / "c"), "--overwrite"]) == 0
    assert (tmp_path / "c" / "hybridserve_config.json").stat().st_mtime_ns != stamp
    assert not (tmp_path / "c.converting").exists()


def test_verify_fails_on_other_weights(hf_checkpoint, tmp_path, capsys):
    """--verify-only of one model's conversion against another source: FAIL, exit 1."""
    src, _ = hf_checkpoint("nemotron_h")
    other = _copy(src, tmp_path)
    tensors = load_file(other / "model.safetensors")
    name = "backbone.layers.0.mixer.out_proj.weight"
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, other / "model.safetensors")
    assert cli_main(["convert", str(other), str(tmp_path / "c")]) == 0
    assert cli_main(["convert", str(src), str(tmp_path / "c"), "--verify-only"]) == 1
    assert "verify: FAIL" in capsys.readouterr().out
