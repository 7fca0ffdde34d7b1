"""Tiny NVIDIA ModelOpt FP8 checkpoints, written from a transformers model, and the transformers
reference that runs the same FP8 numerics (for the parity tests of `hybridserve.weights`).

`write_modelopt_fp8(model, src, dst, ...)` quantises the checkpoint saved in `src` as ModelOpt's
unified HF export lays it out:
  - every projection (`nn.Linear` weight: Mamba2 in/out_proj, attention q/k/v/o, MLP and shared
    expert up/down, each routed expert's up/down) not matched by `exclude` becomes
    `M.weight` e4m3 = e4m3(w / s_w) with `M.weight_scale` s_w = amax|w| / 448 and a static
    `M.input_scale` s_x = amax|input| / 448 over calibration tokens (the inputs are recorded with
    hooks on a forward pass of `calib` ids; a layer's routed experts share one input scale per
    projection, measured over all its tokens);
  - with `kv=True`, each attention layer gets `k_proj.k_scale` / `v_proj.v_scale` (amax of the
    projected keys / values over the calibration tokens / 448);
  - the router, conv1d, norms, embeddings and lm_head stay as they are;
  - `config.json` gains `quantization_config` and `hf_quant_config.json` is written beside it.

`fp8_reference(model, dst)` turns the transformers model (in place) into the reference for such
a checkpoint: each quantised weight replaced by its dequantised value (e4m3 * scale), and each
quantised projection's input rounded through e4m3 under its input scale (forward pre-hooks; the
routed experts' through the experts module's input and its activation's output); with
`kv=True`, also the keys and values rounded through e4m3 under their scales (forward hooks on
k_proj / v_proj: the cached values of a NoPE attention). Nothing of hybridserve is used.
"""

from __future__ import annotations

import json
import re
import shutil
from fnmatch import fnmatchcase
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3 = torch.float8_e4m3fn
PROJECTION = re.compile(
    r"\.(in_proj|out_proj|q_proj|k_proj|v_proj|o_proj|up_proj|down_proj|"
    r"fc1_latent_proj|fc2_latent_proj)\.weight$"
)
EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


def fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded through e4m3 under `scale` (clipped to +-448), in x's dtype."""
    q = torch.clamp(x.float() / scale, -448.0, 448.0).to(E4M3)
    return (q.float() * scale).to(x.dtype)


def _memory_name(saved: str) -> str:
    """A saved (hub) module name -> the in-memory one of transformers' nemotron_h."""
    return re.sub(r"^backbone\.", "model.", saved)


def _excluded(module: str, exclude: list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") or fnmatchcase(module, p) for p in exclude)


def _calibrate(model, calib: torch.Tensor) -> dict[str, float]:
    """amax of the input of every Linear, of every experts module's input and activation
    output, and of every k_proj / v_proj output, by in-memory module name."""
    amax: dict[str, float] = {}
    hooks = []

    def keep(key: str, t: torch.Tensor) -> None:
        amax[key] = max(amax.get(key, 0.0), float(t.detach().abs().max()))

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, n=name: keep(n, a[0])))
            if name.endswith(("k_proj", "v_proj")):
                hooks.append(mod.register_forward_hook(lambda m, a, o, n=name: keep(n + ":out", o)))
        elif name.endswith(".experts"):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, n=name: keep(n, a[0])))
            hooks.append(
                mod.act_fn.register_forward_hook(lambda m, a, o, n=name: keep(n + ":act", o))
            )
    with torch.no_grad():
        model(calib)
    for h in hooks:
        h.remove()
    return amax


def write_modelopt_fp8(
    model, src: Path, dst: Path, calib: torch.Tensor, exclude: list[str], kv: bool = True
) -> None:
    """Write the ModelOpt FP8 form of the checkpoint in `src` (saved from `model`) to `dst`."""
    amax = _calibrate(model, calib)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if not PROJECTION.search(name) or name == "lm_head.weight" or _excluded(module, exclude):
            out[name] = w
            continue
        expert = EXPERT.match(name)
        if expert:  # the routed experts of a layer share an input scale per projection
            group = _memory_name(expert.group(1))
            key = group if expert.group(3) == "up_proj" else group + ":act"
        else:
            key = _memory_name(module)
        w_scale = float(w.abs().max()) / 448.0
        out[name] = torch.clamp(w.float() / w_scale, -448, 448).to(E4M3)
        out[f"{module}.weight_scale"] = torch.tensor(w_scale, dtype=torch.float32)
        out[f"{module}.input_scale"] = torch.tensor(amax[key] / 448.0, dtype=torch.float32)
    if kv:
        for name in tensors:
            if name.endswith(".k_proj.weight"):
                attn = name.removesuffix(".k_proj.weight")
                for proj, leaf in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
                    scale = amax[_memory_name(f"{attn}.{proj}") + ":out"] / 448.0
                    out[f"{attn}.{proj}.{leaf}"] = torch.tensor(scale, dtype=torch.float32)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for extra in src.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            shutil.copy(extra, dst / extra.name)
    section = {
        "quant_algo": "FP8",
        "kv_cache_quant_algo": "FP8" if kv else None,
        "exclude_modules": ["lm_head", *exclude],
    }
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", **section}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    meta = {"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": section}
    (dst / "hf_quant_config.json").write_text(json.dumps(meta, indent=2))


def fp8_reference(model, dst: Path, kv: bool) -> list:
    """Make `model` compute as the FP8 checkpoint in `dst` does (module docstring); returns the
    hooks (remove them to undo the rounding of inputs; the weights stay dequantised)."""
    tensors = load_file(str(dst / "model.safetensors"))
    modules = dict(model.named_modules())
    hooks = []

    def round_input(scale: float):
        return lambda m, args: (fake_quant(args[0], scale), *args[1:])

    def round_output(scale: float):
        return lambda m, args, out: fake_quant(out, scale)

    experts_in: dict[str, float] = {}
    with torch.no_grad():
        for name, w in tensors.items():
            if w.dtype != E4M3:
                continue
            module = name.removesuffix(".weight")
            value = w.float() * tensors[f"{module}.weight_scale"]
            x_scale = float(tensors[f"{module}.input_scale"])
            expert = EXPERT.match(name)
            if expert:
                group, j, proj = expert.groups()
                stacked = getattr(modules[_memory_name(group)], proj)
                stacked[int(j)].copy_(value)
                experts_in[_memory_name(group) + ("" if proj == "up_proj" else ":act")] = x_scale
                continue
            linear = modules[_memory_name(module)]
            linear.weight.copy_(value)
            hooks.append(linear.register_forward_pre_hook(round_input(x_scale)))
    for key, scale in experts_in.items():
        group, _, act = key.partition(":")
        if act:
            hooks.append(modules[group].act_fn.register_forward_hook(round_output(scale)))
        else:
            hooks.append(modules[group].register_forward_pre_hook(round_input(scale)))
    if kv:
        for name, t in tensors.items():
            if name.endswith((".k_proj.k_scale", ".v_proj.v_scale")):
                proj = modules[_memory_name(name.rsplit(".", 1)[0])]
                hooks.append(proj.register_forward_hook(round_output(float(t))))
    return hooks
