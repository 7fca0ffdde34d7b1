"""Declarative name tables: our parameter path <- Hugging Face tensor name(s) + a reshape hook.

`hf_sources(cfg)` returns, for every parameter of `HybridModel(cfg)`, the candidate sources in
the HF checkpoint of cfg's family. A source is a list of tensor names and a hook that turns those
arrays into our layout (given the target shape); the first candidate whose tensors all exist
wins, which covers the hub layout and transformers' in-memory layout (stacked experts).

Our layouts: projections are [in, out...] (HF Linear weights are [out, in]); the Mamba2 in_proj
rows [z | x | B | C | dt] are split into five kernels; experts are stacked [E, in, out].
Our own Inkling layout (architecture "inkling") has its two-way table in `inkling_names`.
"""

from __future__ import annotations

import numpy as np

from hybridserve.config import ModelConfig
from hybridserve.weights.inkling_names import inkling_sources
from hybridserve.weights.sources import Hook, Source


def same(arrs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    return arrs[0].reshape(shape)


def linear(arrs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """HF [out, in] -> ours [in, *out] (or [*in, out] for output projections)."""
    return arrs[0].T.reshape(shape)


def rows(start: int, stop: int, transpose: bool = True) -> Hook:
    """Rows [start, stop) of a fused HF weight (or a slice of a fused bias)."""

    def hook(arrs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        part = arrs[0][start:stop]
        return (part.T if transpose and part.ndim == 2 else part).reshape(shape)

    return hook


def conv_rows(start: int, stop: int) -> Hook:
    """Channels [start, stop) of a conv1d weight [C, 1, W] -> [channels..., W]."""

    def hook(arrs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        return arrs[0][start:stop, 0, :].reshape(shape)

    return hook


def stack_linear(arrs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """Per-expert HF [out, in] weights -> ours [E, in, out]."""
    return np.stack(arrs).transpose(0, 2, 1).reshape(shape)


def experts_linear(start: int | None = None, stop: int | None = None) -> Hook:
    """Stacked HF experts [E, out, in] (optionally rows [start, stop) of out) -> [E, in, out]."""

    def hook(arrs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        return arrs[0][:, start:stop, :].transpose(0, 2, 1).reshape(shape)

    return hook


def _linear(table: dict, ours: str, hf: str, bias: bool) -> None:
    table[f"{ours}.kernel"] = [Source((f"{hf}.weight",), linear)]
    if bias:
        table[f"{ours}.bias"] = [Source((f"{hf}.bias",), same)]


def _mamba(table: dict, cfg: ModelConfig, ours: str, hf: str) -> None:
    m = cfg.mamba
    i, gn, hs = m.intermediate_size, m.n_groups * m.state_size, m.num_heads
    cuts = {
        "in_z": (0, i),
        "in_x": (i, 2 * i),
        "in_b": (2 * i, 2 * i + gn),
        "in_c": (2 * i + gn, 2 * i + 2 * gn),
        "in_dt": (2 * i + 2 * gn, 2 * i + 2 * gn + hs),
    }
    for name, (a, b) in cuts.items():
        table[f"{ours}.{name}.kernel"] = [Source((f"{hf}.in_proj.weight",), rows(a, b))]
        if m.use_bias:
            table[f"{ours}.{name}.bias"] = [Source((f"{hf}.in_proj.bias",), rows(a, b))]
    for name, (a, b) in {"x": (0, i), "b": (i, i + gn), "c": (i + gn, i + 2 * gn)}.items():
        table[f"{ours}.conv_weight.{name}"] = [Source((f"{hf}.conv1d.weight",), conv_rows(a, b))]
        if m.use_conv_bias:
            table[f"{ours}.conv_bias.{name}"] = [Source((f"{hf}.conv1d.bias",), rows(a, b))]
    for name in ("dt_bias", "A_log", "D"):
        table[f"{ours}.{name}"] = [Source((f"{hf}.{name}",), same)]
    table[f"{ours}.norm_weight"] = [Source((f"{hf}.norm.weight",), same)]
    _linear(table, f"{ours}.out_proj", f"{hf}.out_proj", m.use_bias)


def _attention(table: dict, cfg: ModelConfig, ours: str, hf: str) -> None:
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        _linear(table, f"{ours}.{proj}", f"{hf}.{proj}", cfg.attention.bias)


def _mlp(table: dict, ours: str, hf: str, gated: bool, bias: bool, fused_gate: int = 0) -> None:
    """Dense MLP; `fused_gate=F` reads granite's fused [gate; up] `input_linear`."""
    if fused_gate:
        table[f"{ours}.gate_proj.kernel"] = [
            Source((f"{hf}.input_linear.weight",), rows(0, fused_gate))
        ]
        table[f"{ours}.up_proj.kernel"] = [
            Source((f"{hf}.input_linear.weight",), rows(fused_gate, 2 * fused_gate))
        ]
        table[f"{ours}.down_proj.kernel"] = [Source((f"{hf}.output_linear.weight",), linear)]
        return
    if gated:
        _linear(table, f"{ours}.gate_proj", f"{hf}.gate_proj", bias)
    _linear(table, f"{ours}.up_proj", f"{hf}.up_proj", bias)
    _linear(table, f"{ours}.down_proj", f"{hf}.down_proj", bias)


def _nemotron_moe(table: dict, cfg: ModelConfig, ours: str, hf: str) -> None:
    moe, e = cfg.moe, cfg.moe.num_experts
    table[f"{ours}.router"] = [Source((f"{hf}.gate.weight",), linear)]
    table[f"{ours}.router_bias"] = [Source((f"{hf}.gate.e_score_correction_bias",), same)]
    for ours_name, hf_name in (("up", "up_proj"), ("down", "down_proj")):
        per_expert = tuple(f"{hf}.experts.{j}.{hf_name}.weight" for j in range(e))
        table[f"{ours}.{ours_name}"] = [
            Source(per_expert, stack_linear),
            Source((f"{hf}.experts.{hf_name}",), experts_linear()),
        ]
    if moe.shared_intermediate_size:
        _mlp(table, f"{ours}.shared", f"{hf}.shared_experts", False, moe.bias)
    if moe.latent_size:
        _linear(table, f"{ours}.fc1_latent", f"{hf}.fc1_latent_proj", moe.bias)
        _linear(table, f"{ours}.fc2_latent", f"{hf}.fc2_latent_proj", moe.bias)


def _granite_moe(table: dict, cfg: ModelConfig, ours: str, hf: str) -> None:
    moe, f = cfg.moe, cfg.moe.intermediate_size
    table[f"{ours}.router"] = [
        Source((f"{hf}.block_sparse_moe.router.layer.weight",), linear),
        Source((f"{hf}.block_sparse_moe.router.weight",), linear),
    ]
    for name, cut in (("gate", (0, f)), ("up", (f, 2 * f))):
        table[f"{ours}.{name}"] = [
            Source((f"{hf}.block_sparse_moe.input_linear.weight",), experts_linear(*cut)),
            Source((f"{hf}.block_sparse_moe.experts.gate_up_proj",), experts_linear(*cut)),
        ]
    table[f"{ours}.down"] = [
        Source((f"{hf}.block_sparse_moe.output_linear.weight",), experts_linear()),
        Source((f"{hf}.block_sparse_moe.experts.down_proj",), experts_linear()),
    ]
    _mlp(
        table,
        f"{ours}.shared",
        f"{hf}.shared_mlp",
        True,
        False,
        fused_gate=moe.shared_intermediate_size,
    )


def hf_sources(cfg: ModelConfig) -> dict[str, list[Source]]:
    """Our dotted parameter path -> candidate HF sources, for every parameter of the model."""
    if cfg.architecture == "inkling":
        return inkling_sources(cfg)
    table: dict[str, list[Source]] = {}
    fam = cfg.architecture
    root = "backbone" if fam == "nemotron_h" else "model"
    embed = "embeddings" if fam == "nemotron_h" else "embed_tokens"
    final = {"nemotron_h": "norm_f", "bamba": "final_layernorm"}.get(fam, "norm")
    table["embed"] = [Source((f"{root}.{embed}.weight",), same)]
    table["norm_f.weight"] = [Source((f"{root}.{final}.weight",), same)]
    if not cfg.tie_word_embeddings:
        table["lm_head"] = [Source(("lm_head.weight",), linear)]
    for i, kind in enumerate(cfg.layer_types):
        ours, hf = f"layers.{i}", f"{root}.layers.{i}"
        if fam == "nemotron_h":
            table[f"{ours}.norm.weight"] = [Source((f"{hf}.norm.weight",), same)]
            mixer = f"{hf}.mixer"
        else:
            table[f"{ours}.norm.weight"] = [Source((f"{hf}.input_layernorm.weight",), same)]
            ffn_norm = "pre_ff_layernorm" if fam == "bamba" else "post_attention_layernorm"
            table[f"{ours}.ffn_norm.weight"] = [Source((f"{hf}.{ffn_norm}.weight",), same)]
            mixer = f"{hf}.mamba" if kind == "mamba" else f"{hf}.self_attn"
        if kind == "mamba":
            _mamba(table, cfg, f"{ours}.mixer", mixer)
        elif kind in ("attention", "sliding_attention"):
            _attention(table, cfg, f"{ours}.mixer", mixer)
        elif kind == "mlp":
            _mlp(table, f"{ours}.mixer", mixer, cfg.mlp.gated, cfg.mlp.bias)
        else:
            _nemotron_moe(table, cfg, f"{ours}.mixer", mixer)
        if fam == "bamba":
            _mlp(table, f"{ours}.ffn", f"{hf}.feed_forward", True, cfg.mlp.bias)
        elif fam == "granitemoehybrid" and cfg.ffn == "moe":
            _granite_moe(table, cfg, f"{ours}.ffn", hf)
        elif fam == "granitemoehybrid":
            _mlp(
                table,
                f"{ours}.ffn",
                f"{hf}.shared_mlp",
                True,
                False,
                fused_gate=cfg.mlp.intermediate_size,
            )
    if fam == "nemotron_h" and cfg.mtp is not None:
        _nemotron_mtp(table, cfg)
    return table


def eh_proj(arrs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """Nemotron-H's `eh_proj` [D, 2D] (inputs: the normed embedding, then the normed hidden
    state) as our `MtpHead.proj` [2D, D] (rows: the hidden state's, then the embedding's)."""
    w = np.asarray(arrs[0]).T
    d = w.shape[0] // 2
    out = np.concatenate([w[d:], w[:d]], axis=0)
    if out.shape != shape:
        raise ValueError(f"eh_proj: expected {shape[::-1]} transposed, got {arrs[0].shape}")
    return out


def _nemotron_mtp(table: dict, cfg: ModelConfig) -> None:
    """Nemotron-H's MTP steps (`mtp.layers.{2i}`: enorm, hnorm, eh_proj, norm and an attention
    mixer; `mtp.layers.{2i+1}`: norm, an mlp or moe mixer and final_layernorm) as `MtpHead` i:
    norm_e, norm_h, proj, block.norm + block.mixer, block.ffn_norm + block.ffn, norm_o."""
    for i in range(cfg.mtp.num_heads):
        ours = f"mtp.{i}"
        first, second = (f"mtp.layers.{2 * i + j}" for j in (0, 1))
        for norm, (hf, name) in {
            "norm_e": (first, "enorm"),
            "norm_h": (first, "hnorm"),
            "block.norm": (first, "norm"),
            "block.ffn_norm": (second, "norm"),
            "norm_o": (second, "final_layernorm"),
        }.items():
            table[f"{ours}.{norm}.weight"] = [Source((f"{hf}.{name}.weight",), same)]
        table[f"{ours}.proj"] = [Source((f"{first}.eh_proj.weight",), eh_proj)]
        _attention(table, cfg, f"{ours}.block.mixer", f"{first}.mixer")
        if cfg.mtp.ffn == "moe":
            _nemotron_moe(table, cfg, f"{ours}.block.ffn", f"{second}.mixer")
        else:
            _mlp(table, f"{ours}.block.ffn", f"{second}.mixer", cfg.mlp.gated, cfg.mlp.bias)


# Tensors a checkpoint may hold that the model deliberately does not use (MTP layers when the
# config asks for none; `rotary_emb.inv_freq` buffers).
IGNORED_PREFIXES = ("mtp.", "model.mtp.", "backbone.mtp.")
