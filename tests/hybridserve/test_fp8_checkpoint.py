"""ModelOpt FP8 checkpoints (tiny nemotron_h, `modelopt_fp8`) against transformers running the
same FP8 numerics, the FP8 KV cache, and the errors of a bad quantisation config.

The reference is transformers (an implementation we did not write) on the dequantised weights
(e4m3 * weight_scale), every FP8 projection's input rounded through e4m3 under its input scale,
and with an FP8 KV cache the projected keys and values rounded under k_scale / v_scale. Both
sides then round the same values to the same e4m3 codes in float32, so the stated bound is the
float32 parity bound: |logit difference| <= 1e-4 of the largest |logit|. (An input within float32
roundoff of an e4m3 rounding midpoint could round to the neighbouring code on one side only, one
e4m3 step, 2^-3 relative, of one element; the measured differences, ~4e-7 of the largest logit,
show none does here.) The rounding itself is large in these O(1)-weight random models: the W8A8
logits move by ~60% of the largest logit from the float32 model's, the FP8 KV cache by ~7%.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from engine_shapes import TINY
from safetensors.torch import load_file, save_file

from backends.protocol import load_ops
from hybridserve import LLM, SamplingParams
from hybridserve.cache.plan import make_plan
from hybridserve.config import CacheConfig, ConfigError
from hybridserve.parallel import make_mesh
from hybridserve.runner.factory import make_runner
from hybridserve.weights.loader import load_model, read_config
from hybridserve.weights.safetensors_io import WeightError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import random_models  # noqa: E402

BOUND = 1e-4  # of the largest |logit| (module docstring)
_RUNNERS: dict[tuple, object] = {}


def _prompt(seed: int = 1234, n: int = 21) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 512, size=n)


def _logits(directory, kv_dtype: str = "auto", ids=None) -> np.ndarray:
    key = (str(directory), kv_dtype)
    if key not in _RUNNERS:
        cache = CacheConfig(num_pages=64, kv_dtype=kv_dtype)
        _RUNNERS[key] = make_runner(
            str(directory), dtype="float32", tp=1, cache=cache, max_model_len=64
        )
    ids = _prompt() if ids is None else ids
    return np.asarray(_RUNNERS[key].sequence_logits(ids.tolist()))


def _reference(model, ids=None) -> np.ndarray:
    ids = _prompt() if ids is None else ids
    with torch.no_grad():
        return model(torch.as_tensor(ids)[None]).logits[0].numpy()


@pytest.mark.parametrize("kv", [False, True])
def test_fp8_checkpoint_logits_match_transformers(hf_checkpoint, fp8_checkpoint, kv):
    directory, ref_model = fp8_checkpoint(kv)
    ref = _reference(ref_model)
    got = _logits(directory)
    scale = np.abs(ref).max()
    assert np.abs(ref - _reference(hf_checkpoint("nemotron_h")[1])).max() > 0.1 * scale, (
        "weak test: the FP8 rounding does not move the logits"
    )
    np.testing.assert_allclose(got, ref, rtol=0, atol=BOUND * scale)
    runner = _RUNNERS[(str(directory), "auto")]
    dtypes = {str(v.dtype) for v in jax.tree.leaves(runner.params)}
    assert "float8_e4m3fn" in dtypes  # the weights stay e4m3 on the device
    kv_dtypes = {g.spec.dtype for g in runner.plan.groups if g.spec.kind == "full_attention"}
    assert kv_dtypes == ({"float8_e4m3fn"} if kv else {"float32"})


def _greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.as_tensor(prompt)[None], max_new_tokens=n, min_new_tokens=n,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_fp8_greedy_tokens_match_transformers_over_32_steps(fp8_checkpoint):
    """32 greedy steps; then a prompt that shares three prefix-cache units of FP8 KV (and the
    Mamba state there) with an earlier one reads them from the cache and gives the tokens of
    a cold engine (no prefix cache; our own numerics on both sides: this longer prompt crosses
    e4m3 rounding midpoints where transformers' float32 roundoff differs from ours, and this
    random model amplifies a one-step difference to the next token)."""
    directory, ref_model = fp8_checkpoint(True)
    # a unit below the 176-token block (e4m3 KV pages hold many tokens), within max_model_len
    llm = LLM(str(directory), **TINY, prefix_unit=16, progress=False)
    prompt = _prompt(7, 13).tolist()
    ref = _greedy_reference(ref_model, prompt, 32)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert len(set(ref)) > 3, "weak test: the reference repeats one token"
    assert out[0].outputs[0].token_ids == ref

    unit = llm.engine.scheduler.prefix_unit
    shared = _prompt(8, 3 * unit + 3).tolist()
    second = shared + _prompt(9, 5).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate({"prompt_token_ids": shared + [5, 6]}, params, use_tqdm=False)
    hit = llm.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    cold = LLM(str(directory), **TINY, enable_prefix_caching=False, progress=False)
    want = cold.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    assert hit.metrics.num_cached_tokens >= 3 * unit
    assert hit.outputs[0].token_ids == want.outputs[0].token_ids


def test_fp8_kv_cache_is_within_twice_the_rounding_floor(fp8_checkpoint):
    """Our FP8-KV logits against our float32-KV logits (the same weights) differ by at most
    twice what rounding K and V through e4m3 costs transformers (the floor)."""
    directory, ref_kv = fp8_checkpoint(True)
    _, ref_plain = fp8_checkpoint(False)  # the same weights and input scales, KV unrounded
    floor = np.abs(_reference(ref_kv) - _reference(ref_plain)).max()
    ours = np.abs(_logits(directory) - _logits(directory, "float32")).max()
    assert floor > 1e-3 * np.abs(_reference(ref_plain)).max(), "weak test: no KV rounding"
    assert 0 < ours <= 2 * floor


def test_nano_30b_fp8_config_plans_4176_token_blocks(tmp_path):
    """The plan from the FP8 checkpoint's config alone (kv_dtype "auto"): its FP8 KV cache
    makes the seed's 4176-token blocks, ratio 261 to the kernel block of 16."""
    cfg = read_config(random_models.write_config("nano-30b-a3b-fp8", tmp_path))
    plan = make_plan(cfg, CacheConfig(), 1, "bfloat16")
    assert cfg.kv_cache_dtype == "float8_e4m3fn"
    assert plan.block_size == 4176 and plan.block_size // 16 == 261
    bf16 = make_plan(cfg, CacheConfig(kv_dtype="bfloat16"), 1, "bfloat16")
    assert bf16.block_size != 4176  # the dtype, not the shape, makes the 4176


def test_dummy_fp8_model_runs(tmp_path):
    """A config-only FP8 directory (load_format="dummy"): FP8 parameters from the exclusions,
    e4m3 draws, finite logits."""
    config = random_models.fp8_variant(random_models.SHAPES["tiny"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = read_config(tmp_path)
    assert "layers.0.mixer.in_x.kernel" in cfg.quant.fp8_params
    assert not any(p.startswith(("layers.3.", "layers.2.")) for p in cfg.quant.fp8_params)
    runner = make_runner(
        str(tmp_path), dtype="float32", tp=1, cache=CacheConfig(num_pages=16),
        max_model_len=64, load_format="dummy",
    )  # fmt: skip
    logits = np.asarray(runner.sequence_logits(_prompt(3, 9).tolist()))
    assert np.isfinite(logits).all() and logits.std() > 0


# --- errors --------------------------------------------------------------------------------


def _copy(fp8_checkpoint, tmp_path, kv=True) -> Path:
    src = fp8_checkpoint(kv)[0]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(directory: Path, edit) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _load(directory: Path):
    return load_model(directory, load_ops("xla"), make_mesh(1), progress=False)


@pytest.mark.parametrize("where", ["hf_quant_config.json", "config.json"])
def test_an_unknown_quant_algo_is_refused_by_name(fp8_checkpoint, tmp_path, where):
    directory = _copy(fp8_checkpoint, tmp_path)
    meta = json.loads((directory / where).read_text())
    section = meta["quantization"] if where == "hf_quant_config.json" else meta
    section = section if where == "hf_quant_config.json" else meta["quantization_config"]
    section["quant_algo"] = "NVFP4_AWQ"
    (directory / where).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="quant_algo 'NVFP4_AWQ' is not supported"):
        read_config(directory)


def test_another_quant_method_is_refused_by_name(fp8_checkpoint, tmp_path):
    directory = _copy(fp8_checkpoint, tmp_path)
    (directory / "hf_quant_config.json").unlink()
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quant_method 'gptq' is not supported"):
        read_config(directory)


def test_the_two_quant_configs_must_agree(fp8_checkpoint, tmp_path):
    directory = _copy(fp8_checkpoint, tmp_path)
    meta = json.loads((directory / "hf_quant_config.json").read_text())
    meta["quantization"]["kv_cache_quant_algo"] = None
    (directory / "hf_quant_config.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="disagrees with hf_quant_config.json"):
        read_config(directory)


@pytest.mark.parametrize(
    "tensor",
    [
        "backbone.layers.0.mixer.in_proj.weight_scale",
        "backbone.layers.4.mixer.experts.5.down_proj.input_scale",
        "backbone.layers.6.mixer.v_proj.v_scale",
    ],
)
def test_a_missing_scale_is_named(fp8_checkpoint, tmp_path, tensor):
    directory = _copy(fp8_checkpoint, tmp_path)
    _edit_tensors(directory, lambda t: t.pop(tensor))
    with pytest.raises(WeightError, match=f"missing tensor '{tensor}'"):
        _load(directory)


def test_bad_scales_are_named(fp8_checkpoint, tmp_path):
    directory = _copy(fp8_checkpoint, tmp_path)
    name = "backbone.layers.1.mixer.up_proj.weight_scale"
    _edit_tensors(directory, lambda t: t.update({name: torch.ones(96)}))
    with pytest.raises(WeightError, match="only per-tensor scales"):
        _load(directory)
    _edit_tensors(directory, lambda t: t.update({name: torch.tensor(-1.0)}))
    with pytest.raises(WeightError, match="weight_scale must be finite and > 0"):
        _load(directory)


def test_an_fp8_tensor_where_the_model_keeps_high_precision_is_named(fp8_checkpoint, tmp_path):
    """A quantised conv1d (which ModelOpt never quantises) would be cast without its scale."""
    directory = _copy(fp8_checkpoint, tmp_path)
    name = "backbone.layers.0.mixer.conv1d.weight"

    def edit(t):
        t[name] = t[name].to(torch.float8_e4m3fn)

    _edit_tensors(directory, edit)
    with pytest.raises(WeightError, match=f"tensor '{name}' is float8_e4m3fn"):
        _load(directory)


def test_a_converted_fp8_checkpoint_keeps_its_e4m3_weights(fp8_checkpoint, tmp_path):
    """`hybridserve convert` of an FP8 checkpoint: the orbax copy holds the e4m3 weights and
    scales (and the quantisation in its config), and computes the same logits."""
    from checkpoints.convert import convert

    directory = fp8_checkpoint(True)[0]
    converted = convert(directory, tmp_path / "converted", progress=False)
    cfg = read_config(converted)
    assert cfg.quant == read_config(directory).quant and cfg.quant.fp8_params
    np.testing.assert_array_equal(_logits(converted), _logits(directory))
