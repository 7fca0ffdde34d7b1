"""Reading an HF-style `config.json`: `load_hf_json`, `Fields` (field access whose errors name
the field, the model type and the file) and `common_fields` (the fields every family shares).
Shared by the parsers of `hybridserve.config.hf` and `hybridserve.config.inkling`. Standard
library only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridserve.config.errors import ConfigError

KIND_NAMES = {  # HF layer kind names -> ours
    "M": "mamba",
    "mamba": "mamba",
    "linear_attention": "mamba",
    "*": "attention",
    "attention": "attention",
    "full_attention": "attention",
    "-": "mlp",
    "mlp": "mlp",
    "E": "moe",
    "moe": "moe",
}
HF_ACTIVATIONS = {"relu2": "relu2", "silu": "silu", "swish": "silu", "gelu": "gelu", "relu": "relu"}


def _decode_floats(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__float__"}:
            return float(obj["__float__"])  # "Infinity", "-Infinity", "NaN"
        return {k: _decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_floats(v) for v in obj]
    return obj


def load_hf_json(path: str | Path) -> dict[str, Any]:
    """Read `config.json` (given the file or its directory), decoding `{"__float__": ...}`."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        return _decode_floats(json.loads(path.read_text()))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from err


class Fields:
    """Field access that names the missing field, the model type and the file."""

    def __init__(self, raw: dict[str, Any], where: str) -> None:
        self.raw, self.where = raw, where

    def get(self, *names: str, default: Any = ...) -> Any:
        """The first of `names` present and not None; else `default`, or ConfigError."""
        for name in names:
            if name in self.raw and self.raw[name] is not None:
                return self.raw[name]
        if default is ...:
            raise ConfigError(f"{self.where}: missing field {names[0]!r}")
        return default

    def kinds(self, name: str, values: list[str]) -> tuple[str, ...]:
        """Field `name`'s layer kinds (`values`) in our names."""
        try:
            return tuple(KIND_NAMES[v] for v in values)
        except KeyError as err:
            raise ConfigError(
                f"{self.where}: field {name!r} has unknown layer kind {err}"
            ) from None

    def activation(self, *names: str, default: str) -> str:
        """The activation field of `names`, in our names."""
        act = self.get(*names, default=default)
        if act not in HF_ACTIVATIONS:
            raise ConfigError(f"{self.where}: field {names[0]!r} = {act!r} is not supported")
        return HF_ACTIVATIONS[act]


def common_fields(f: Fields, model_type: str, eps_field: str) -> dict[str, Any]:
    """The `ModelConfig` fields every family stores alike (`eps_field`: its norm epsilon)."""
    eos = f.get("eos_token_id", default=None)
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return dict(
        architecture=model_type,
        vocab_size=int(f.get("vocab_size")),
        hidden_size=int(f.get("hidden_size")),
        norm_eps=float(f.get(eps_field)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        max_position_embeddings=int(f.get("max_position_embeddings", default=4096)),
        bos_token_id=f.get("bos_token_id", default=None),
        eos_token_ids=eos_ids,
        pad_token_id=f.get("pad_token_id", default=None),
        dtype=str(f.get("dtype", "torch_dtype", default="float32")),
    )
