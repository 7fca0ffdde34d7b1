"""A tiny Nemotron-H checkpoint with MTP layers, as NVIDIA lays them out
(`num_nextn_predict_layers`, `mtp_hybrid_override_pattern` "*E", tensors `mtp.layers.{0,1}.*`;
see `weights.hf_names`):
the shipped nemotron_h model plus one MTP step (an attention layer, then a MoE layer) whose
weights are drawn at the scale of the base model's own attention and MoE layers.

`mimic` > 0 makes the step lean on the base model's last hidden state (eh_proj's hidden half
an identity, the mixers' outputs scaled down), so its drafts often agree with the target
distribution: the verifier then accepts some drafts and rejects others."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hybridserve.entrypoints import DEFAULT_MODEL

ATTENTION_LAYER, MOE_LAYER = 1, 5  # the shipped model's layers whose shapes the step copies


def write_nemotron_mtp(dst: Path, seed: int = 0, mimic: float = 0.0) -> str:
    """The shipped model with one MTP step in `dst` (float32 tensors for the step)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(DEFAULT_MODEL).iterdir():
        if f.is_file():
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)

    def like(name: str) -> torch.Tensor:
        x = tensors[name].float()
        return torch.randn(x.shape, generator=gen) * max(float(x.std()), 0.02)

    hidden = cfg["hidden_size"]
    mtp: dict[str, torch.Tensor] = {}
    first, second = "mtp.layers.0", "mtp.layers.1"
    for norm in (f"{first}.enorm", f"{first}.hnorm", f"{first}.norm", f"{second}.norm",
                 f"{second}.final_layernorm"):  # fmt: skip
        mtp[f"{norm}.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    eh = torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5
    if mimic:
        eh[:, :hidden] *= 1.0 - mimic
        eh[:, hidden:] = mimic * torch.eye(hidden) + (1.0 - mimic) * eh[:, hidden:]
    mtp[f"{first}.eh_proj.weight"] = eh
    base = f"backbone.layers.{ATTENTION_LAYER}.mixer"
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        mtp[f"{first}.mixer.{proj}.weight"] = like(f"{base}.{proj}.weight")
    base = f"backbone.layers.{MOE_LAYER}.mixer"
    for name in tensors:
        if name.startswith(base + "."):
            mtp[second + ".mixer" + name[len(base) :]] = like(name)
    mtp[f"{second}.mixer.gate.e_score_correction_bias"] = torch.zeros(
        tensors[f"{base}.gate.e_score_correction_bias"].shape
    )
    if mimic:  # the mixers add less to the residual stream
        for name in mtp:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                mtp[name] *= 1.0 - mimic
    save_file({**tensors, **mtp}, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)
