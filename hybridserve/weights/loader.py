"""Build a model with its weights: from a Hugging Face directory (converted on the fly) or from
one of our converted directories (orbax), into an abstract (`nnx.eval_shape`) model whose
parameters are placed with the mesh sharding as they are read.

A converted directory holds `hybridserve_config.json` (our ModelConfig plus provenance),
`params/` (an orbax checkpoint of the parameter tree, stored in the model dtype) and the
tokenizer files of the source.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from backends import fp8
from backends.protocol import Ops
from hybridserve.config import ModelConfig, parse_hf_config
from hybridserve.models.hybrid import HybridModel
from hybridserve.parallel import state_shardings
from hybridserve.weights.dummy import dummy_array
from hybridserve.weights.fp8_names import resolve_fp8_params, with_fp8
from hybridserve.weights.hf_names import IGNORED_PREFIXES, hf_sources
from hybridserve.weights.safetensors_io import SafetensorsReader, WeightError

log = logging.getLogger(__name__)
CONVERTED_CONFIG = "hybridserve_config.json"
FORMAT_VERSION = 1
LOAD_FORMATS = ("auto", "dummy")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def is_converted(path: str | Path) -> bool:
    return (Path(path) / CONVERTED_CONFIG).is_file()


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a converted or an HF directory."""
    path = Path(path)
    if is_converted(path):
        meta = json.loads((path / CONVERTED_CONFIG).read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise WeightError(
                f"{path}: converted with format_version "
                f"{meta.get('format_version')}, this build reads {FORMAT_VERSION}"
            )
        return ModelConfig.from_dict(meta["model"])
    cfg = parse_hf_config(path)
    if cfg.quant is None:
        return cfg
    try:
        reader = SafetensorsReader(path)
    except WeightError:  # a config-only directory (load_format="dummy")
        reader = None
    return resolve_fp8_params(cfg, hf_sources(cfg), reader)


def abstract_model(cfg: ModelConfig, ops: Ops, dtype: jnp.dtype) -> HybridModel:
    """The model with shapes and dtypes only (no memory)."""
    return nnx.eval_shape(lambda: HybridModel(cfg, ops, dtype=dtype, rngs=nnx.Rngs(0)))


def _flat_paths(state: nnx.State) -> dict[str, tuple]:
    return {".".join(str(k) for k in path): path for path, _ in nnx.to_flat_state(state)}


def _get(tree: dict, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def hf_arrays(
    directory: str | Path,
    cfg: ModelConfig,
    abstract: dict,
    paths: dict[str, tuple],
    progress: bool = True,
):
    """Yield (our path, numpy array in our layout) for every parameter, from an HF checkpoint.

    Raises WeightError naming the tensor when one is missing or has the wrong shape.
    """
    reader = SafetensorsReader(directory)
    table = with_fp8(hf_sources(cfg), cfg)
    missing_ours = sorted(set(paths) - set(table))
    if missing_ours:
        raise WeightError(
            f"no HF source known for parameters {missing_ours}; add them to the name table "
            "(hybridserve/weights/hf_names.py, or inkling_names.py for Inkling)"
        )
    used: set[str] = set()
    for name in tqdm(sorted(paths), desc="loading weights", unit="tensor", disable=not progress):
        target = _get(abstract, paths[name])
        candidates = table[name]
        source = next((s for s in candidates if all(n in reader for n in s.names)), None)
        if source is None:
            absent = next(n for n in candidates[0].names if n not in reader)
            raise WeightError(f"{directory}: missing tensor {absent!r} (for parameter {name})")
        arrays = [reader.get(n) for n in source.names]
        _check_fp8(directory, name, source.names, arrays, target.dtype)
        try:
            value = source.hook(arrays, tuple(target.shape))
        except WeightError as err:  # a hook that checks its tensors names them itself
            raise WeightError(f"{directory}: {err} (for parameter {name})") from None
        except ValueError:
            shapes = ", ".join(f"{n} {reader.shape(n)}" for n in source.names)
            raise WeightError(
                f"{directory}: tensor shape mismatch: {shapes} cannot give "
                f"parameter {name} of shape {tuple(target.shape)}"
            ) from None
        used.update(source.names)
        yield paths[name], np.asarray(value).astype(target.dtype)
    unused = [k for k in reader.names() if k not in used and not k.startswith(IGNORED_PREFIXES)]
    if unused:
        log.warning(
            "%s: %d tensors not used by the model, e.g. %s", directory, len(unused), unused[:5]
        )


def _check_fp8(directory, name: str, names: tuple, arrays: list, dtype: jnp.dtype) -> None:
    """WeightError unless the tensors are e4m3 exactly when parameter `name` is (an 8-bit value
    cast to another dtype without its scale would be a wrong weight)."""
    want = jnp.dtype(dtype) == jnp.float8_e4m3fn
    for tensor, array in zip(names, arrays, strict=True):
        if want and array.dtype != jnp.float8_e4m3fn:
            raise WeightError(
                f"{directory}: parameter {name} is FP8 (e4m3) but tensor {tensor!r} is "
                f"{array.dtype}"
            )
        if not want and fp8.is_float8(array.dtype):
            raise WeightError(
                f"{directory}: tensor {tensor!r} is {array.dtype} (quantised), but parameter "
                f"{name} is not stored in FP8 (only projections and routed experts are, with "
                "quant_algo FP8 in the checkpoint's quantization config)"
            )


def load_model(
    path: str | Path,
    ops: Ops,
    mesh: Mesh,
    dtype: jnp.dtype | None = None,
    progress: bool = True,
    load_format: str = "auto",
    seed: int = 0,
) -> tuple[HybridModel, ModelConfig]:
    """Load an HF or converted directory into a sharded model.

    `dtype=None` keeps the checkpoint's dtype (float32 when it does not say).
    `load_format="dummy"` reads the config alone and draws random weights from `seed`
    (`weights/dummy.py`), for benchmarks of sizes that have no checkpoint here.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r}: expected one of {LOAD_FORMATS}")
    path = Path(path)
    cfg = read_config(path)
    dtype = jnp.dtype(dtype or cfg.dtype)
    model = abstract_model(cfg, ops, dtype)
    graphdef, state = nnx.split(model)
    abstract = nnx.to_pure_dict(state)
    shardings = state_shardings(state, mesh)
    if load_format == "dummy":
        flat = _flat_paths(state)
        values = jax.tree.map(lambda x: x, abstract)
        for name in tqdm(sorted(flat), desc="drawing weights", unit="tensor", disable=not progress):
            a = _get(abstract, flat[name])
            array = dummy_array(name, a.shape, a.dtype, _get(shardings, flat[name]), seed)
            _set(values, flat[name], array)
    elif is_converted(path):
        values = _restore_orbax(path / "params", abstract, shardings)
    else:
        values = jax.tree.map(lambda x: x, abstract)
        for key, array in hf_arrays(path, cfg, abstract, _flat_paths(state), progress):
            _set(values, key, jax.device_put(array, _get(shardings, key)))
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state), cfg


def _restore_orbax(directory: Path, abstract: dict, shardings: dict) -> dict:
    import orbax.checkpoint as ocp

    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(directory.absolute(), _str_keys(target))
    return _int_keys(restored, abstract)


def _str_keys(tree: Any) -> Any:
    """Orbax stores dict keys as strings; our layer lists use ints."""
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def _int_keys(tree: Any, like: Any) -> Any:
    if isinstance(like, dict):
        return {k: _int_keys(tree[str(k)], v) for k, v in like.items()}
    return tree


def save_converted(
    model: HybridModel, cfg: ModelConfig, dst: str | Path, source: str | Path, dtype: jnp.dtype
) -> None:
    """Write `model`'s parameters (orbax), our config and the source's tokenizer files."""
    import orbax.checkpoint as ocp

    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    params = _str_keys(nnx.to_pure_dict(nnx.state(model)))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((dst / "params").absolute(), params)
    meta = {
        "format_version": FORMAT_VERSION,
        "source": str(source),
        "dtype": str(dtype),
        "model": dataclasses.replace(cfg, dtype=jnp.dtype(dtype).name).to_dict(),
    }
    (dst / CONVERTED_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, dst / name)
