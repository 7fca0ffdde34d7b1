"""The engine settings the tests share, so that they share compiled programs.

An engine's forward programs are keyed by the model, its dtype, the TP size and backend, the
cache pool's shape (its pages follow from max_num_seqs and max_model_len) and the block tables'
width (max_model_len), then by each step's rows and tokens per row (powers of two). JAX's
persistent compilation cache (conftest.py) hands a program compiled once to every later engine,
test and process that needs the same one, so a test on these settings compiles only the buckets
that no earlier test used. A test that needs other settings says why.
"""

from __future__ import annotations

from pathlib import Path

from hybridserve.cache.plan import make_plan, num_pages_for
from hybridserve.config import CacheConfig
from hybridserve.runner.memory import HOST_POOL_BYTES
from hybridserve.weights.loader import read_config

# The tiny HF checkpoints (hf_models): 32 seats of 128 tokens (the P/D tests hold 32 prompts).
TINY = dict(dtype="float32", max_model_len=128, max_num_seqs=32, max_num_batched_tokens=2048)
# The tiny Inkling checkpoints (inkling_models): 8 seats. Its pages are small and many (2,305
# here), and an Inkling step's cost grows with the pool: 32 seats would make every step slower.
INKLING = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=2048)
# The shipped default model as the server tests serve it (server_harness.SMALL, OFFLINE).
SERVED = dict(dtype="float32", max_model_len=256, max_num_seqs=8)


def pool_of(model: str | Path, settings: dict = TINY, tp: int = 1) -> CacheConfig:
    """The cache of an engine on `settings` for the model at `model`: a test that needs fewer
    seats than `settings` keeps their pool with it, and so their programs."""
    cfg = read_config(model)
    plan = make_plan(cfg, CacheConfig(), tp, settings["dtype"])
    seats, length = settings["max_num_seqs"], settings["max_model_len"]
    chunk = settings.get("max_prefill_chunk", 256)  # the engine's default chunk
    pages = num_pages_for(plan, CacheConfig(), seats, length, chunk, HOST_POOL_BYTES)
    return CacheConfig(num_pages=pages)
