"""Run the source checkpoint in transformers beside ours on the same input; compare logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def our_logits(model_dir: str | Path, token_ids: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """Full-sequence logits [T, V] from our model (one-shot prefill)."""
    import jax.numpy as jnp

    from backends.protocol import load_ops
    from hybridserve.parallel import make_mesh
    from hybridserve.runner.model_runner import ModelRunner
    from hybridserve.weights.loader import load_model

    mesh = make_mesh(1)
    model, cfg = load_model(model_dir, load_ops("xla"), mesh, dtype, progress=False)
    runner = ModelRunner(model, cfg, mesh, 2, len(token_ids), jnp.dtype(dtype))
    n = len(token_ids)
    logits = runner.run(
        np.array([1]), np.asarray(token_ids)[None], np.array([0]), np.array([n]), last_only=False
    )
    return np.asarray(logits)[0]


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
