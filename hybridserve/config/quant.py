"""`QuantConfig`: how a checkpoint is quantised, read from NVIDIA ModelOpt's two places for it.
Standard library only.

ModelOpt ("unified HF" export) writes `hf_quant_config.json`

    {"producer": {"name": "modelopt", "version": ...},
     "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" | null,
                      "exclude_modules": ["lm_head", "backbone.layers.4.mixer*", ...]}}

and/or `config.json`'s `quantization_config` with `"quant_method": "modelopt"` and the same
keys at the top level (newer exports spell the exclusions `ignore` and the KV cache as
`kv_cache_scheme: {"num_bits": 8, "type": "float"}`). Where both exist they must agree.
Supported: `quant_algo` "FP8" (e4m3 projection weights, a float32 `weight_scale` per tensor, a
static `input_scale` per projection) and `kv_cache_quant_algo` "FP8" or none (per-layer
`k_scale` / `v_scale`); anything else is refused by name.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from pathlib import Path
from typing import Any

from hybridserve.config.errors import ConfigError

QUANT_FILE = "hf_quant_config.json"
QUANT_ALGOS = ("FP8",)
KV_CACHE_ALGOS = ("FP8",)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """A ModelOpt-quantised checkpoint (module docstring).

    `algo`: the weights' algorithm ("FP8"). `kv_cache_algo`: "FP8" when the checkpoint carries
    KV cache scales (its KV cache is then e4m3 unless the engine is told otherwise), else None.
    `exclude_modules`: the HF modules (names or fnmatch patterns) the checkpoint left in high
    precision, as written. `fp8_params`: our parameter paths stored in e4m3 (projection
    kernels `....kernel`, stacked experts such as `layers.3.mixer.up`), decided from the
    checkpoint's tensors when it has them (`weights.fp8_names`), else from `exclude_modules`."""

    algo: str = "FP8"
    kv_cache_algo: str | None = None
    exclude_modules: tuple[str, ...] = ()
    fp8_params: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.algo not in QUANT_ALGOS:
            raise ConfigError(
                f"quant_algo {self.algo!r} is not supported; hybridserve reads ModelOpt "
                f"checkpoints with quant_algo one of {list(QUANT_ALGOS)}"
            )
        if self.kv_cache_algo not in (None, *KV_CACHE_ALGOS):
            raise ConfigError(
                f"kv_cache_quant_algo {self.kv_cache_algo!r} is not supported; expected one of "
                f"{list(KV_CACHE_ALGOS)} or null"
            )

    @property
    def kv_cache_dtype(self) -> str | None:
        """The KV cache dtype the checkpoint's scales are for (None: the model dtype)."""
        return "float8_e4m3fn" if self.kv_cache_algo == "FP8" else None

    def excluded(self, module: str) -> bool:
        """Is the HF module `module` in `exclude_modules` (a name, a prefix of it, or a
        pattern)?"""
        return any(
            module == p or module.startswith(p + ".") or fnmatch.fnmatchcase(module, p)
            for p in self.exclude_modules
        )


def _kv_algo(section: dict[str, Any], where: str) -> str | None:
    if section.get("kv_cache_quant_algo") is not None:
        return str(section["kv_cache_quant_algo"]).upper()
    scheme = section.get("kv_cache_scheme")
    if scheme is None:
        return None
    if not isinstance(scheme, dict):
        raise ConfigError(f"{where}: field 'kv_cache_scheme' must be an object, got {scheme!r}")
    if scheme.get("num_bits") == 8 and scheme.get("type") == "float":
        return "FP8"
    raise ConfigError(f"{where}: kv_cache_scheme {scheme} is not supported (only 8-bit float)")


def _section(section: Any, where: str) -> QuantConfig:
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: the quantization section must be an object")
    algo = section.get("quant_algo")
    if algo is None:
        raise ConfigError(f"{where}: missing field 'quant_algo'")
    exclude = section.get("exclude_modules", section.get("ignore")) or []
    if not isinstance(exclude, list) or not all(isinstance(m, str) for m in exclude):
        raise ConfigError(f"{where}: field 'exclude_modules' must be a list of module names")
    try:
        return QuantConfig(str(algo).upper(), _kv_algo(section, where), tuple(exclude))
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def parse_quant(raw: dict[str, Any], directory: Path) -> QuantConfig | None:
    """The checkpoint's quantisation from its `config.json` (`raw`) and `hf_quant_config.json`
    beside it; None when neither declares one. ConfigError names the file and the field."""
    found = []
    qc = raw.get("quantization_config")
    if qc is not None:
        where = f"{directory / 'config.json'} (quantization_config)"
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        if method != "modelopt":
            raise ConfigError(
                f"{where}: quant_method {method!r} is not supported; hybridserve reads NVIDIA "
                f"ModelOpt checkpoints (quant_method 'modelopt', quant_algo one of "
                f"{list(QUANT_ALGOS)})"
            )
        found.append(_section(qc, where))
    path = directory / QUANT_FILE
    if path.is_file():
        try:
            meta = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON: {err}") from err
        if not isinstance(meta, dict) or "quantization" not in meta:
            raise ConfigError(f"{path}: missing field 'quantization'")
        found.append(_section(meta["quantization"], str(path)))
    if len(found) == 2 and (found[0].algo, found[0].kv_cache_algo) != (
        found[1].algo,
        found[1].kv_cache_algo,
    ):
        raise ConfigError(
            f"{directory}: config.json's quantization_config ({found[0].algo}, kv "
            f"{found[0].kv_cache_algo}) disagrees with {QUANT_FILE} ({found[1].algo}, kv "
            f"{found[1].kv_cache_algo})"
        )
    if not found:
        return None
    excluded = tuple(dict.fromkeys(m for q in found for m in q.exclude_modules))
    return dataclasses.replace(found[-1], exclude_modules=excluded)
