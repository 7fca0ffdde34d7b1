"""Run the source checkpoint in transformers beside ours on the same input; compare logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def our_logits(model_dir: str | Path, token_ids: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """Full-sequence logits [T, V] from our model (one-shot prefill)."""
    from hybridserve.config import CacheConfig
    from hybridserve.runner.factory import make_runner

    n = len(token_ids)
    runner = make_runner(
        str(model_dir), dtype=dtype, cache=CacheConfig(num_pages=64), max_model_len=max(n, 16)
    )
    return np.asarray(runner.sequence_logits([int(t) for t in token_ids]))


def verify_against_transformers(
    src: str | Path, ours: str | Path, num_tokens: int = 24, seed: int = 0
) -> tuple[float, float]:
    """Max |logit difference| between transformers on `src` and us on `ours`, float32, over a
    random prompt; also returns max |logit| for scale."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        raise RuntimeError(
            "--verify needs torch and transformers (pip install -e '.[cpu,dev]')"
        ) from err
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    ids = np.random.default_rng(seed).integers(3, vocab, size=num_tokens)
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids)[None]).logits[0].float().numpy()
    got = our_logits(ours, ids)
    return float(np.abs(got - ref).max()), float(np.abs(ref).max())
