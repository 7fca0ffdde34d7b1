"""Write an Inkling `HybridModel` in the Inkling checkpoint layout: `config.json` and
safetensors (one `model.safetensors`, or shards with `model.safetensors.index.json`), as
documented in docs/inkling_checkpoint.md. Such a directory loads directly (`load_model`,
`make_runner`) and converts to our orbax form through `hybridserve convert`, like an HF one.

Parameters are gathered to the host one at a time and each shard is written when complete, so
host memory holds at most one shard (single-host models: every array must be addressable).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from hybridserve.config import ModelConfig
from hybridserve.config.inkling import inkling_config_json
from hybridserve.models.hybrid import HybridModel
from hybridserve.weights.inkling_names import inkling_rules, unmapped
from hybridserve.weights.loader import TOKENIZER_FILES
from hybridserve.weights.safetensors_io import INDEX_NAME, SINGLE_NAME

DEFAULT_SHARD_BYTES = 5 * 2**30
_METADATA = {"format": "pt", "layout": "inkling"}


def _shards(sizes: dict[str, int], max_bytes: int | None) -> list[list[str]]:
    """Parameters (in order) grouped into shards of at most `max_bytes` (a larger parameter
    gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if max_bytes is not None and shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _host(variable: nnx.Variable) -> np.ndarray:
    return np.asarray(jax.device_get(variable.get_value()))


def export_inkling(
    model: HybridModel,
    cfg: ModelConfig,
    dst: str | Path,
    *,
    tokenizer_from: str | Path | None = None,
    max_shard_bytes: int | None = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write `model` (architecture "inkling", config `cfg`) to the empty or new directory `dst`
    in the Inkling layout; tensors keep the parameters' dtypes (config.json's `dtype` is the
    embedding's). `tokenizer_from`: a directory whose tokenizer files are copied.
    `max_shard_bytes=None`: one file. Raises WeightError naming parameters without a tensor
    name, ConfigError naming config fields the layout cannot store. Returns `dst`."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty")
    flat = {".".join(str(k) for k in path): v for path, v in nnx.to_flat_state(nnx.state(model))}
    rules = inkling_rules(cfg)
    unmapped(set(flat), rules)
    dtype = np.dtype(flat["embed"].get_value().dtype).name
    raw = inkling_config_json(dataclasses.replace(cfg, dtype=dtype))
    sizes = {name: flat[name].get_value().nbytes for name in rules}  # codecs only permute
    shards = _shards(sizes, max_shard_bytes)
    dst.mkdir(parents=True, exist_ok=True)
    files = (
        [SINGLE_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    for file, names in zip(files, shards, strict=True):
        tensors: dict[str, np.ndarray] = {}
        for name in names:
            tensors.update(rules[name].save(_host(flat[name])))
        save_file(tensors, dst / file, metadata=_METADATA)
        weight_map.update(dict.fromkeys(tensors, file))
    if len(files) > 1:
        index: dict[str, Any] = {
            "metadata": {"total_size": sum(sizes.values())},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (dst / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).is_file():
                shutil.copy(Path(tokenizer_from) / name, dst / name)
    return dst


def export_checkpoint(
    src: str | Path, dst: str | Path, *, max_shard_bytes: int | None = DEFAULT_SHARD_BYTES
) -> Path:
    """Load an Inkling checkpoint (converted or in this layout) on the host and export it to
    `dst`, with its tokenizer files."""
    from backends.protocol import load_ops
    from hybridserve.parallel import make_mesh
    from hybridserve.weights.loader import load_model

    model, cfg = load_model(src, load_ops("xla"), make_mesh(1), progress=False)
    return export_inkling(model, cfg, dst, tokenizer_from=src, max_shard_bytes=max_shard_bytes)
