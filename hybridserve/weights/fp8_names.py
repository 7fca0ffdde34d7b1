"""FP8 checkpoints (NVIDIA ModelOpt, `quant_algo` "FP8"): which of our parameters are e4m3, and
the name table entries of their scales.

ModelOpt keeps each quantised projection `M` of the Hugging Face model as
  `M.weight` (F8_E4M3, the layout of the high-precision weight), `M.weight_scale` and
  `M.input_scale` (float32 scalars: `w = float(M.weight) * weight_scale`; the GEMM's input is
  quantised as `e4m3(x / input_scale)`),
routed experts as those of each `...experts.{j}.up_proj` / `down_proj`, and, with an FP8 KV
cache, each attention layer's `k_proj.k_scale` and `v_proj.v_scale`. Modules it left in high
precision (`exclude_modules`: lm_head, routers, conv1d, norms, the layers a recipe protects)
keep their usual tensors.

Which parameters are FP8 is read from the checkpoint's tensor dtypes (the headers only) where
there are tensors, and from `exclude_modules` for a config-only directory
(`load_format="dummy"`): every projection and expert stack whose modules it does not exclude.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from hybridserve.config import ModelConfig
from hybridserve.layers.moe import EXPERT_STACKS
from hybridserve.weights.safetensors_io import SafetensorsReader, WeightError
from hybridserve.weights.sources import Source

FP8_DTYPE = "F8_E4M3"
PER_EXPERT = re.compile(r"\.experts\.\d+\.")  # one tensor per routed expert


def is_candidate(path: str) -> bool:
    """May parameter `path` be stored in FP8 (a projection kernel or a routed-expert stack)?"""
    return path.endswith(".kernel") or path.rsplit(".", 1)[-1] in EXPERT_STACKS


def modules(source: Source) -> tuple[str, ...]:
    """The HF modules of a weight source (its `*.weight` tensor names without the suffix)."""
    return tuple(n.removesuffix(".weight") for n in source.names)


def _present(reader: SafetensorsReader, candidates: list[Source]) -> Source | None:
    return next((s for s in candidates if all(n in reader for n in s.names)), None)


def resolve_fp8_params(
    cfg: ModelConfig, table: dict[str, list[Source]], reader: SafetensorsReader | None
) -> ModelConfig:
    """`cfg` with `quant.fp8_params` filled: from the tensor dtypes of `reader`'s checkpoint, or
    from `exclude_modules` when there is none. WeightError names a projection whose tensors are
    partly FP8."""
    found = []
    for path in sorted(p for p in table if is_candidate(p)):
        if reader is None:
            excluded = any(cfg.quant.excluded(m) for m in modules(table[path][0]))
            if not excluded:
                found.append(path)
            continue
        source = _present(reader, table[path])
        if source is None:
            continue  # reported as missing when the weights are read
        kinds = {reader.dtype(n) == FP8_DTYPE for n in source.names}
        if len(kinds) == 2:
            fp8 = [n for n in source.names if reader.dtype(n) == FP8_DTYPE]
            raise WeightError(
                f"{reader.directory}: tensors of parameter {path} are partly FP8 "
                f"(e.g. {fp8[0]!r}); all or none of them must be"
            )
        if kinds == {True}:
            found.append(path)
    quant = dataclasses.replace(cfg.quant, fp8_params=tuple(found))
    return dataclasses.replace(cfg, quant=quant)


def _scalar(what: str):
    """A hook reading one float32 scale per tensor (stacked when there are several)."""

    def hook(arrs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        values = []
        for a in arrs:
            if a.size != 1:
                raise WeightError(
                    f"{what} of shape {a.shape}: only per-tensor scales (one value) are "
                    "supported (quant_algo FP8)"
                )
            values.append(float(np.asarray(a, np.float32).reshape(())))
        out = np.asarray(values, np.float32)
        if not np.all(np.isfinite(out) & (out > 0)):
            raise WeightError(f"{what} must be finite and > 0, got {out.min()}")
        return out.reshape(shape)

    return hook


def with_fp8(table: dict[str, list[Source]], cfg: ModelConfig) -> dict[str, list[Source]]:
    """`table` (from `hf_sources`) extended with the entries an FP8 model has: for each FP8
    projection `X.kernel` its `X.weight_scale` and `X.input_scale`; for each FP8 expert stack
    `X` its `X.weight` (the stack's own sources), `X.weight_scale` and `X.input_scale` (one per
    expert); for each attention layer of an FP8-KV checkpoint its `k_scale` and `v_scale`."""
    quant = cfg.quant
    if quant is None:
        return table
    table = dict(table)
    for path in quant.fp8_params:
        base = path.removesuffix(".kernel")
        if path.endswith(".kernel"):
            source = table[path][0]
        else:  # an expert stack: ModelOpt writes one tensor (and scale) per expert
            source = next((s for s in table[path] if all(map(PER_EXPERT.search, s.names))), None)
            if source is None:
                raise WeightError(
                    f"FP8 experts {path} are stored stacked in one tensor "
                    f"({table[path][0].names[0]}); hybridserve reads FP8 experts one tensor "
                    "per expert, as ModelOpt writes them"
                )
            table[f"{base}.weight"] = [source]
        mods = modules(source)
        for leaf in ("weight_scale", "input_scale"):
            names = tuple(f"{m}.{leaf}" for m in mods)
            table[f"{base}.{leaf}"] = [Source(names, _scalar(leaf))]
    if quant.kv_cache_algo is not None:
        for path in [p for p in table if p.endswith(".mixer.k_proj.kernel")]:
            hf = modules(table[path][0])[0].removesuffix(".k_proj")
            base = path.removesuffix(".k_proj.kernel")
            for leaf, proj in (("k_scale", "k_proj"), ("v_scale", "v_proj")):
                table[f"{base}.{leaf}"] = [
                    Source((f"{hf}.{proj}.{leaf}",), _scalar(leaf)),
                    Source((f"{hf}.{leaf}",), _scalar(leaf)),
                ]
    return table
