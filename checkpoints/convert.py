"""`hybridserve convert SRC DST`: HF safetensors -> orbax checkpoint + our config + tokenizer."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import jax.numpy as jnp

from backends.protocol import load_ops
from hybridserve.parallel import make_mesh
from hybridserve.weights.loader import is_converted, load_model, save_converted


def convert(
    src: str | Path,
    dst: str | Path,
    dtype: str | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Convert the HF checkpoint in `src` (one safetensors file or sharded with an index) into
    `dst`. `dtype=None` keeps the checkpoint's dtype. A non-empty `dst` is refused unless
    `overwrite` (then it is replaced once the new one is written). Returns `dst`."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"source directory {src} does not exist")
    if is_converted(src):
        raise ValueError(f"{src} is already a converted checkpoint")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(f"{dst} exists and is not empty (--overwrite replaces it)")
    model, cfg = load_model(src, load_ops("xla"), make_mesh(1), dtype, progress=progress)
    staging = dst.with_name(dst.name + ".converting")
    shutil.rmtree(staging, ignore_errors=True)
    save_converted(model, cfg, staging, source=src, dtype=jnp.dtype(dtype or cfg.dtype))
    if dst.exists():
        shutil.rmtree(dst)
    staging.rename(dst)
    return dst


def main(
    src: str, dst: str, dtype: str | None, verify: bool, overwrite: bool = False,
    verify_only: bool = False,
) -> int:  # fmt: skip
    """CLI body: convert (unless `verify_only`, on an existing output), report, and with
    `verify` compare against transformers and print PASS/FAIL (exit 1 on FAIL)."""
    if verify or verify_only:
        from checkpoints.verify import require_dependencies

        require_dependencies()  # before any work: a missing package fails fast
    if verify_only:
        if not is_converted(dst):
            raise FileNotFoundError(f"{dst} is not a converted checkpoint (--verify-only)")
    else:
        start = time.perf_counter()
        convert(src, dst, dtype, overwrite=overwrite)
        size = sum(p.stat().st_size for p in Path(dst).rglob("*") if p.is_file())
        seconds = time.perf_counter() - start
        print(f"converted {src} -> {dst} ({size / 2**20:.1f} MiB) in {seconds:.1f}s")
    if verify or verify_only:
        from checkpoints.verify import verify_against_transformers

        verdict = verify_against_transformers(src, dst)
        print(verdict)
        return 0 if verdict.passed else 1
    return 0
