"""`hybridserve convert SRC DST`: HF safetensors -> orbax checkpoint + our config + tokenizer."""

from __future__ import annotations

import time
from pathlib import Path

import jax.numpy as jnp

from backends.protocol import load_ops
from hybridserve.parallel import make_mesh
from hybridserve.weights.loader import is_converted, load_model, save_converted


def convert(
    src: str | Path, dst: str | Path, dtype: str | None = None, progress: bool = True
) -> Path:
    """Convert the HF checkpoint in `src` (one safetensors file or sharded with an index) into
    `dst`. `dtype=None` keeps the checkpoint's dtype. Returns `dst`."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"source directory {src} does not exist")
    if is_converted(src):
        raise ValueError(f"{src} is already a converted checkpoint")
    model, cfg = load_model(src, load_ops("xla"), make_mesh(1), dtype, progress=progress)
    save_converted(model, cfg, dst, source=src, dtype=jnp.dtype(dtype or cfg.dtype))
    return dst


def main(src: str, dst: str, dtype: str | None, verify: bool) -> int:
    """CLI body: convert, report, and optionally verify against transformers."""
    start = time.perf_counter()
    convert(src, dst, dtype)
    size = sum(p.stat().st_size for p in Path(dst).rglob("*") if p.is_file())
    print(
        f"converted {src} -> {dst} ({size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f}s"
    )
    if verify:
        from checkpoints.verify import verify_against_transformers

        diff, scale = verify_against_transformers(src, dst)
        print(
            f"verify: max |logit difference| vs transformers = {diff:.3e} (max |logit| {scale:.3f})"
        )
    return 0
