"""Run the source checkpoint in transformers beside ours on the same inputs; compare logits.

The verdict (`verify_against_transformers`): PASS when, over `num_prompts` random prompts (float32
on both sides), the largest |logit difference| is at most `TOLERANCE` times the largest |logit|
(float32 summation order: the same bound as the parity tests); FAIL otherwise."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

TOLERANCE = 1e-4  # of the largest |logit|


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The comparison over several prompts: the largest |logit difference|, the largest |logit|,
    and whether the first is within `TOLERANCE` of the second."""

    max_diff: float
    max_logit: float
    prompts: int

    @property
    def passed(self) -> bool:
        return self.max_diff <= TOLERANCE * self.max_logit

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"verify: {verdict}: max |logit difference| vs transformers {self.max_diff:.3e} over "
            f"{self.prompts} prompts, tolerance {TOLERANCE:g} x max |logit| {self.max_logit:.3f} "
            f"= {TOLERANCE * self.max_logit:.3e}"
        )


def require_dependencies() -> None:
    """RuntimeError unless torch and transformers import (what --verify runs)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            f"--verify needs torch and transformers ({err}; pip install -e '.[cpu,dev]')"
        ) from err


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
    src: str | Path, ours: str | Path, num_prompts: int = 3, num_tokens: int = 24, seed: int = 0
) -> Verdict:
    """Transformers on `src` against us on `ours` over `num_prompts` random prompts of
    `num_tokens` tokens, float32 (module docstring)."""
    require_dependencies()
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    rng = np.random.default_rng(seed)
    diff = scale = 0.0
    for _ in range(num_prompts):
        ids = rng.integers(3, vocab, size=num_tokens)
        with torch.no_grad():
            ref = hf(torch.as_tensor(ids)[None]).logits[0].float().numpy()
        got = our_logits(ours, ids)
        diff = max(diff, float(np.abs(got - ref).max()))
        scale = max(scale, float(np.abs(ref).max()))
    return Verdict(diff, scale, num_prompts)
