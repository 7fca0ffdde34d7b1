"""The Inkling checkpoint layout (docs/inkling_checkpoint.md): export a tiny model, convert it
through `hybridserve convert`'s path, and get the logits of the directly saved model; MTP heads
(layout_version 2) load to the exported parameters; NVFP4 experts stored losslessly; clear
errors for missing, misshapen and unmapped tensors."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from backends import nvfp4
from checkpoints.convert import convert
from hybridserve.config import CacheConfig, ConfigError, ModelConfig, MtpConfig, parse_hf_config
from hybridserve.config.inkling import inkling_config_json
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.parallel import make_mesh
from hybridserve.runner.factory import make_runner
from hybridserve.runner.model_runner import ModelRunner
from hybridserve.weights.inkling_export import export_inkling
from hybridserve.weights.safetensors_io import SafetensorsReader, WeightError
from tests.hybridserve.inkling_models import (
    build_inkling,
    jax_normal,
    save_inkling,
    tiny_inkling,
)

IDS = [int(t) for t in np.random.default_rng(5).integers(7, 4096, size=19)]  # no placeholders
RNG = np.random.default_rng(6)
IMAGE, WAVE = RNG.normal(size=(8, 12, 3)).astype(np.float32), RNG.normal(size=300)


def _runner(path: Path | str) -> ModelRunner:
    return make_runner(
        str(path), dtype="float32", cache=CacheConfig(num_pages=64), max_model_len=32
    )


def _outputs(path: Path | str) -> list[np.ndarray]:
    """Prompt logits, image and audio embeddings of the checkpoint at `path`."""
    runner = _runner(path)
    return [
        np.asarray(runner.sequence_logits(IDS)),
        runner.embed_multimodal("image", IMAGE),
        runner.embed_multimodal("audio", WAVE.astype(np.float32)),
    ]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """(cfg, model, the exported directory (one file), its direct save)."""
    cfg = tiny_inkling()
    model = build_inkling(cfg, seed=3)
    root = tmp_path_factory.mktemp("inkling")
    exported = export_inkling(model, cfg, root / "hf", tokenizer_from=DEFAULT_MODEL)
    return cfg, model, exported, save_inkling(model, cfg, root / "direct")


def test_export_convert_equals_direct_save(dense, tmp_path):
    cfg, model, _, direct = dense
    sharded = export_inkling(model, cfg, tmp_path / "sharded", max_shard_bytes=100_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    assert parse_hf_config(sharded) == cfg
    converted = convert(sharded, tmp_path / "converted", progress=False)
    meta = json.loads((converted / "hybridserve_config.json").read_text())
    assert ModelConfig.from_dict(meta["model"]) == cfg
    for got, want in zip(_outputs(converted), _outputs(direct), strict=True):
        np.testing.assert_array_equal(got, want)


def test_layout_names_shapes_and_tokenizer(dense):
    cfg, model, exported, _ = dense
    assert (exported / "model.safetensors").is_file() and (exported / "tokenizer.json").is_file()
    raw = json.loads((exported / "config.json").read_text())
    assert raw["model_type"] == "inkling" and raw["layer_types"][1] == "sliding_attention"
    assert raw["layout_version"] == 1 and raw["num_nextn_predict_layers"] == 0  # no MTP heads
    t = load_file(exported / "model.safetensors")
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (32, 48)  # [out, in]
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (48, 32)
    assert t["model.layers.0.self_attn.r_proj.weight"].shape == (16, 48)
    assert t["model.layers.0.self_attn.rel_table"].shape == (8, 4)
    assert t["model.layers.1.sconv_kv.weight"].shape == (32, 4)
    assert t["model.layers.1.mlp.router.weight"].shape == (10, 48)
    assert t["model.layers.2.mlp.experts.7.down_proj.weight"].shape == (48, 32)
    assert t["model.layers.2.mlp.shared_experts.1.gate_proj.weight"].shape == (32, 48)
    assert t["model.vision.stages.1.weight"].shape == (48, 64)
    assert t["model.audio.table"].shape == (8, 6, 48)
    q = np.asarray(model.layers[0].mixer.q_proj.kernel[...])  # [D, N, H]
    np.testing.assert_array_equal(t["model.layers.0.self_attn.q_proj.weight"], q.reshape(48, -1).T)
    up = np.asarray(model.layers[2].ffn.up[...])  # [E, D, F]
    np.testing.assert_array_equal(t["model.layers.2.mlp.experts.5.up_proj.weight"], up[5].T)
    assert len(t) == 3 + 3 * (2 + 6 + 1 + 3 * (8 + 2) + 6) + 4 + 1


def _params(tree) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def test_mtp_heads_round_trip(tmp_path):
    cfg = dataclasses.replace(tiny_inkling(), mtp=MtpConfig(num_heads=2))
    model = build_inkling(cfg, seed=7)
    rng = nnx.Rngs(8)
    for head in model.mtp:  # distinct norms, so that a swapped tensor shows
        for norm in (head.norm_h, head.norm_e, head.norm_o, head.block.norm, head.block.ffn_norm):
            norm.weight[...] = 1 + 0.5 * jax_normal(rng, norm.weight[...].shape)
    exported = export_inkling(model, cfg, tmp_path / "hf", max_shard_bytes=100_000)
    raw = json.loads((exported / "config.json").read_text())
    assert raw["layout_version"] == 2 and raw["num_nextn_predict_layers"] == 2
    assert parse_hf_config(exported) == cfg
    reader = SafetensorsReader(exported)
    proj = reader.get("model.mtp.1.proj.weight")  # torch [out, in] = [D, 2D]
    np.testing.assert_array_equal(proj, np.asarray(model.mtp[1].proj[...]).T)
    for name, want in [
        ("model.mtp.0.norm_e.weight", model.mtp[0].norm_e.weight),
        ("model.mtp.1.norm_o.weight", model.mtp[1].norm_o.weight),
        ("model.mtp.0.post_attention_layernorm.weight", model.mtp[0].block.ffn_norm.weight),
        ("model.mtp.1.self_attn.rel_table", model.mtp[1].block.mixer.rel_table),
    ]:
        np.testing.assert_array_equal(reader.get(name), np.asarray(want[...]))
    assert reader.shape("model.mtp.0.self_attn.q_proj.weight") == (32, 48)
    assert reader.shape("model.mtp.1.mlp.experts.7.down_proj.weight") == (48, 32)
    assert not any(n.startswith("model.mtp.") and "sconv" in n for n in reader.names())
    converted = convert(exported, tmp_path / "converted", progress=False)
    runner, direct = _runner(converted), _runner(save_inkling(model, cfg, tmp_path / "direct"))
    np.testing.assert_array_equal(
        np.asarray(runner.sequence_logits(IDS)), np.asarray(direct.sequence_logits(IDS))
    )
    got = _params(nnx.to_pure_dict(runner.params))
    model.prepare(make_mesh(1))  # as the runner readies its copy for serving (lm_head as rows)
    want = _params(nnx.to_pure_dict(nnx.state(model)))
    assert got.keys() == want.keys() and any(k.startswith("['mtp'][1]") for k in got)
    for key in got:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_nvfp4_experts_are_stored_losslessly(tmp_path):
    cfg = tiny_inkling(hidden=64, nvfp4=True)
    model = build_inkling(cfg, seed=4)
    exported = export_inkling(model, cfg, tmp_path / "hf")
    assert json.loads((exported / "config.json").read_text())["expert_format"] == "nvfp4"
    reader = SafetensorsReader(exported)  # (safetensors.numpy reads no float8)
    base = "model.layers.1.mlp.experts.3.down_proj"
    t = {n: reader.get(f"{base}.{n}") for n in ("weight", "weight_scale", "weight_scale_2")}
    codes, scale, scale_2 = t["weight"], t["weight_scale"], t["weight_scale_2"]
    assert codes.dtype == np.uint8 and codes.shape == (64, 16)  # [out, in / 2]
    assert scale.dtype == ml_dtypes.float8_e4m3fn and scale.shape == (64, 2)  # [out, in / 16]
    assert scale_2.dtype == np.float32 and scale_2.shape == ()
    # Decoded as the doc says: value = e2m1(code) * weight_scale[row, col // 16] * weight_scale_2,
    # code of column 2j in the low nibble of byte j, 2j + 1 in the high one.
    e2m1 = np.asarray(nvfp4.e2m1_value(jnp.stack([codes & 15, codes >> 4], -1).reshape(64, 32)))
    doc = e2m1 * np.repeat(scale.astype(np.float32), 16, axis=1) * scale_2
    down = model.layers[1].ffn.down
    ours = nvfp4.dequantize(nvfp4.Nvfp4Weight(down.codes[...], down.scales[...],
                                              down.tensor_scale[...]))  # fmt: skip
    np.testing.assert_array_equal(doc, np.asarray(ours)[3].T)
    converted = convert(exported, tmp_path / "converted", progress=False)
    direct = save_inkling(model, cfg, tmp_path / "direct")
    got = np.asarray(_runner(converted).sequence_logits(IDS))
    np.testing.assert_array_equal(got, np.asarray(_runner(direct).sequence_logits(IDS)))


def _edited(src: Path, tmp_path: Path, edit) -> Path:
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(broken / "model.safetensors")
    edit(tensors)
    save_file(tensors, broken / "model.safetensors")
    return broken


@pytest.mark.parametrize(
    "name,edit,message",
    [
        ("model.layers.1.sconv_out.weight", lambda t, n: t.pop(n), "missing tensor '{}'"),
        ("model.layers.2.mlp.experts.6.gate_proj.weight", lambda t, n: t.pop(n),
         "missing tensor '{}'"),
        # the transpose has the right element count: still refused, by shape
        ("model.layers.0.self_attn.q_proj.weight", lambda t, n: t.update({n: t[n].T.copy()}),
         r"shape mismatch: {} has shape \(48, 32\), expected \(32, 48\)"),
        ("model.layers.2.mlp.experts.4.down_proj.weight",
         lambda t, n: t.update({n: t[n][:, :-1].copy()}),
         r"shape mismatch: {} has shape \(48, 31\), expected \(48, 32\)"),
    ],
)  # fmt: skip
def test_bad_tensor_is_named(dense, tmp_path, name, edit, message):
    broken = _edited(dense[2], tmp_path, lambda t: edit(t, name))
    with pytest.raises(WeightError, match=message.format(name.replace(".", r"\."))):
        convert(broken, tmp_path / "out", progress=False)


def test_unmapped_parameter_is_named(tmp_path):
    cfg = tiny_inkling()
    model = build_inkling(cfg)
    model.draft_head = nnx.Param(jnp.zeros((4, 48)))  # as a future parameter would appear
    with pytest.raises(
        WeightError, match=r"no Inkling tensor name for parameters \['draft_head'\]"
    ):
        export_inkling(model, cfg, tmp_path / "out")
    # a model with MTP heads exported under a config without them: the heads are named
    model = build_inkling(dataclasses.replace(cfg, mtp=MtpConfig(num_heads=1)))
    with pytest.raises(WeightError, match=r"no Inkling tensor name for parameters \['mtp\.0\."):
        export_inkling(model, cfg, tmp_path / "out2")


def test_config_errors(dense, tmp_path):
    cfg = dense[0]
    raw = json.loads((dense[2] / "config.json").read_text())

    def parse(**edits):
        (tmp_path / "config.json").write_text(json.dumps({**raw, **edits}))
        return parse_hf_config(tmp_path)

    assert parse() == cfg
    del raw["num_nextn_predict_layers"]  # as layout_version 1 files were written: no MTP heads
    assert parse() == cfg and parse(num_nextn_predict_layers=1).mtp == MtpConfig(num_heads=1)
    with pytest.raises(ConfigError, match="'num_nextn_predict_layers' = -1 must be >= 0"):
        parse(num_nextn_predict_layers=-1)
    with pytest.raises(ConfigError, match="missing field 'n_routed_experts'"):
        parse(n_routed_experts=None)
    with pytest.raises(ConfigError, match="'layer_types' has unknown layer kinds \\['mamba'\\]"):
        parse(layer_types=["full_attention", "mamba", "full_attention"])
    with pytest.raises(ConfigError, match="'num_hidden_layers' \\(4\\)"):
        parse(num_hidden_layers=4)
    with pytest.raises(ConfigError, match="layout_version"):
        parse(layout_version=99)
    with pytest.raises(ConfigError, match="vision_config: missing field 'hidden_sizes'"):
        parse(vision_config={"sub_patch_size": 2})
    d = cfg.to_dict()
    d["moe"] = dict(d["moe"], latent_size=32)
    with pytest.raises(ConfigError, match="cannot store these config fields: \\['moe.latent_size"):
        inkling_config_json(ModelConfig.from_dict(d))
