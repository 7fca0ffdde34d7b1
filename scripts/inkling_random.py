"""Random-weight Inkling checkpoints for benchmarks (`bench_engine.py --random-config`).

`random_config("mid" | "tiny", mtp_heads)`: `inkling_mid()` (3.3 B parameters, bf16) or a
tiny float32 Inkling (2 layers, sliding then full attention, hidden 64, the default tokenizer's
4096-token vocab) for CPU checks, each with `mtp_heads` MTP heads (in mid 0.23 B each: a block
with the full MoE). `build_and_save` initialises the weights on the default device (the GPU
there) and writes a converted checkpoint that `LLM(dir)` loads. Init is eager by default: one
small compiled op per distinct shape (blocks share shapes), each float32 draw cast to the model
dtype at once; `build(jit=True)` makes it one program instead, which on CPU for the tiny config
compiled in 14 s against 8 s eager (0.1 s eager once the ops are cached).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from backends.protocol import load_ops
from hybridserve.config import AttentionConfig, ModelConfig, MtpConfig
from hybridserve.config.inkling_presets import inkling_mid, layer_pattern
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.models.hybrid import HybridModel
from hybridserve.weights.loader import read_config, save_converted

CONFIGS = ("tiny", "mid")
LAYER_LETTERS = {"attention": "A", "sliding_attention": "S", "mamba": "M", "mlp": "F", "moe": "E"}


def random_config(name: str, mtp_heads: int, dtype: str | None = None) -> ModelConfig:
    """The named config with `mtp_heads` MTP heads (0: none); dtype bf16 (mid) or f32 (tiny)."""
    if name == "mid":
        cfg = inkling_mid()
    elif name == "tiny":
        cfg = dataclasses.replace(
            inkling_mid(),
            vocab_size=4096,
            hidden_size=64,
            layer_types=layer_pattern(2, every=2),
            attention=AttentionConfig(
                num_heads=4,
                num_kv_heads=2,
                head_dim=16,
                rope_theta=None,
                sliding_window=8,
                rel_dim=8,
                rel_buckets=8,
                rel_exact=4,
                rel_max_distance=64,
            ),
            moe=dataclasses.replace(
                inkling_mid().moe,
                num_experts=8,
                top_k=2,
                intermediate_size=32,
                shared_intermediate_size=32,
            ),
            max_position_embeddings=4096,
            dtype="float32",
        )
    else:
        raise ValueError(f"unknown random config {name!r} (one of {CONFIGS})")
    mtp = MtpConfig(num_heads=mtp_heads) if mtp_heads else None
    return dataclasses.replace(cfg, mtp=mtp, dtype=dtype or cfg.dtype)


def build(cfg: ModelConfig, seed: int = 0, jit: bool = False) -> HybridModel:
    """A HybridModel with random weights in `cfg.dtype`, initialised on the default device."""
    dtype = jnp.dtype(cfg.dtype)
    ops = load_ops("xla")

    def create() -> HybridModel:
        return HybridModel(cfg, ops, dtype=dtype, rngs=nnx.Rngs(seed))

    return nnx.jit(create)() if jit else create()


def param_counts(model: HybridModel) -> dict[str, int]:
    """Parameters in total and in the MTP heads (works on `nnx.eval_shape` models too)."""

    def count(module) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))

    return {"params": count(model), "mtp_params": count(model.mtp) if model.mtp else 0}


def build_and_save(cfg: ModelConfig, dst: Path, seed: int = 0, log=print) -> dict:
    """Build a random model for `cfg`, save it to `dst` (empty or absent); timings and counts."""
    log(f"building a random {cfg.dtype} Inkling on {jax.devices()[0].device_kind} ...")
    t0 = time.perf_counter()
    model = build(cfg, seed)
    jax.block_until_ready(nnx.state(model))
    t1 = time.perf_counter()
    counts = param_counts(model)
    log(
        f"  {counts['params']:,} parameters ({counts['mtp_params']:,} in "
        f"{0 if cfg.mtp is None else cfg.mtp.num_heads} MTP heads), built in {t1 - t0:.1f} s; "
        f"saving to {dst} ..."
    )
    save_converted(model, cfg, dst, DEFAULT_MODEL, jnp.dtype(cfg.dtype))
    t2 = time.perf_counter()
    log(f"  saved in {t2 - t1:.1f} s")
    del model
    return counts | {"build_s": t1 - t0, "save_s": t2 - t1}


def describe(model_dir: str | Path) -> dict:
    """A model directory's config in brief; `pattern`: a letter per layer (LAYER_LETTERS)."""
    cfg = read_config(model_dir)
    return {
        "pattern": "".join(LAYER_LETTERS.get(t, "?") for t in cfg.layer_types),
        "pattern_legend": LAYER_LETTERS,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "dtype": cfg.dtype,
        "mtp_heads": 0 if cfg.mtp is None else cfg.mtp.num_heads,
    }
