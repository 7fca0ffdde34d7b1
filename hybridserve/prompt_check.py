"""A prompt (text or token ids) checked and turned into token ids, before it reaches a scheduler."""

from __future__ import annotations

from typing import Any

import numpy as np


def prompt_token_ids(
    prompt: str | list[int], tokenizer: Any, vocab_size: int, max_model_len: int, model: str
) -> list[int]:
    """Token ids of a prompt, or ValueError saying what is wrong with it: text without a
    tokenizer, ids that are not integers or lie outside the vocabulary, an empty prompt, or one
    that leaves no room for an output token within `max_model_len`."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                f'{model} has no tokenizer.json: pass prompts as {{"prompt_token_ids": [...]}}'
            )
        ids = tokenizer.encode(prompt)
    else:
        if any(isinstance(t, bool) or not isinstance(t, int | np.integer) for t in prompt):
            raise ValueError("prompt_token_ids must be a list of integers")
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab_size})")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; max_model_len is "
            f"{max_model_len} (prompt + at least one output token)"
        )
    return ids
