"""parse_hf_config on the three families' config.json files, and its errors."""

from __future__ import annotations

import json
import math

import pytest

from hybridserve.config import ConfigError, ModelConfig, parse_hf_config


def _saved(hf_checkpoint, family: str) -> dict:
    directory, _ = hf_checkpoint(family)
    return json.loads((directory / "config.json").read_text())


def _write(tmp_path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_nemotron_h_list_and_legacy_pattern_agree(hf_checkpoint, tmp_path):
    raw = _saved(hf_checkpoint, "nemotron_h")
    assert isinstance(raw["layers_block_type"], list)
    assert raw["time_step_limit"][1] == {"__float__": "Infinity"}  # as transformers writes it
    from_list = parse_hf_config(hf_checkpoint("nemotron_h")[0])
    assert from_list.pattern == "M-M*EM*E"
    assert math.isinf(from_list.mamba.dt_max) and from_list.mamba.dt_min == 0.0
    legacy = dict(raw, hybrid_override_pattern="M-M*EM*E", num_hidden_layers=8)
    del legacy["layers_block_type"]
    assert parse_hf_config(_write(tmp_path, legacy)) == from_list


def test_bamba_and_granite_fields(hf_checkpoint):
    bamba = parse_hf_config(hf_checkpoint("bamba")[0])
    assert bamba.pattern == "MM*MM*" and bamba.ffn == "mlp" and bamba.mlp.gated
    assert bamba.attention.rotary_dim == bamba.attention.head_dim // 2
    granite = parse_hf_config(hf_checkpoint("granitemoehybrid")[0])
    assert granite.ffn == "moe" and granite.moe.router == "softmax_topk"
    assert (granite.embedding_multiplier, granite.residual_multiplier) == (2.0, 0.5)
    assert granite.attention.softmax_scale == 0.125 and granite.logits_scaling == 4.0


def test_round_trip_through_our_json(hf_checkpoint):
    for family in ("nemotron_h_latent", "granitemoehybrid_rope"):
        cfg = parse_hf_config(hf_checkpoint(family)[0])
        assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda r: r.update(model_type="llama"), "unsupported model_type 'llama'"),
        (lambda r: r.pop("ssm_state_size"), "missing field 'ssm_state_size'"),
        (lambda r: r.update(num_attention_heads=5), "num_attention_heads \\(5\\)"),
        (lambda r: r.update(layers_block_type=["mamba", "conv"]), "unknown layer kind 'conv'"),
        (lambda r: r.update(n_group=3), "n_group"),
        (lambda r: r.update(time_step_limit=[1.0, 0.5]), "time_step_limit"),
        (
            lambda r: (
                r.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="M*")
                or r.pop("mtp_layers_block_type", None)
            ),
            "'mtp_hybrid_override_pattern' = \\['M', '\\*'\\]: only an attention layer",
        ),
        (lambda r: r.update(num_nextn_predict_layers=-1), "num_nextn_predict_layers' = -1"),
    ],
)
def test_bad_configs_name_the_field(hf_checkpoint, tmp_path, edit, message):
    raw = _saved(hf_checkpoint, "nemotron_h")
    edit(raw)
    with pytest.raises(ConfigError, match=message):
        parse_hf_config(_write(tmp_path, raw))


def test_nemotron_h_mtp_fields(hf_checkpoint, tmp_path):
    # NVIDIA's spellings: the legacy pattern string, or the newer list of layer names
    raw = dict(_saved(hf_checkpoint, "nemotron_h"), num_nextn_predict_layers=1)
    raw.pop("mtp_layers_block_type", None)  # (transformers writes its default list)
    assert parse_hf_config(_write(tmp_path, raw)).mtp.ffn == "moe"  # "*E" by default
    raw["mtp_layers_block_type"] = ["attention", "mlp"]
    cfg = parse_hf_config(_write(tmp_path, raw))
    assert cfg.mtp.num_heads == 1 and cfg.mtp.ffn == "mlp" and cfg.mlp is not None
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    raw["num_nextn_predict_layers"] = 0
    assert parse_hf_config(_write(tmp_path, raw)).mtp is None


def test_legacy_pattern_length_mismatch(hf_checkpoint, tmp_path):
    raw = _saved(hf_checkpoint, "nemotron_h")
    del raw["layers_block_type"]
    raw.update(hybrid_override_pattern="M*", num_hidden_layers=3)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        parse_hf_config(_write(tmp_path, raw))


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        parse_hf_config(tmp_path)
