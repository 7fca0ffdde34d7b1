"""Reading Hugging Face safetensors checkpoints: one file, or shards with an index.

The header of each file is checked against its size before anything is read, so that a
truncated download fails with the name of the first tensor that is cut off. Tensors are
memory-mapped (bfloat16 through ml_dtypes), never copied until used.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024


class WeightError(ValueError):
    """A checkpoint is unreadable, incomplete, or does not fit the model; names the tensor."""


def _read_header(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise WeightError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise WeightError(f"{path}: truncated or corrupt safetensors header ({n} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise WeightError(f"{path}: corrupt safetensors header: {err}") from err
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        end = data_start + info["data_offsets"][1]
        if end > size:
            raise WeightError(
                f"{path}: truncated file: tensor {name!r} needs bytes up to {end} but the file "
                f"has {size}"
            )
        if info["dtype"] not in _DTYPES:
            raise WeightError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    return header, data_start


class SafetensorsReader:
    """Name -> numpy array over the `.safetensors` files of a checkpoint directory."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.directory / SINGLE_NAME).is_file():
            weight_map, files = None, [SINGLE_NAME]
        else:
            found = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not found:
                raise WeightError(f"{self.directory}: no safetensors files (and no {INDEX_NAME})")
            weight_map, files = None, found
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for file in files:
            path = self.directory / file
            if not path.is_file():
                raise WeightError(f"{self.directory}: shard {file!r} named in the index is missing")
            header, start = _read_header(path)
            for name, info in header.items():
                self._where[name] = (path, info, start)
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in self._where:
                    raise WeightError(
                        f"{self.directory}: tensor {name!r} is listed in the index "
                        f"under {file!r} but that shard does not hold it"
                    )
        self._maps: dict[Path, np.memmap] = {}

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[1]["shape"])

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype name ("BF16", "F8_E4M3", ...)."""
        return self._entry(name)[1]["dtype"]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy array (memory-mapped)."""
        path, info, start = self._entry(name)
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        raw = self._maps[path][start + begin : start + end]
        return raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])

    def _entry(self, name: str) -> tuple[Path, dict, int]:
        try:
            return self._where[name]
        except KeyError:
            raise WeightError(f"{self.directory}: missing tensor {name!r}") from None
