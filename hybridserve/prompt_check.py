"""A prompt (text or token ids) checked and turned into token ids, and its settings checked
against what the engine can do, before it reaches a scheduler."""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridserve.core.request import MultimodalInput
from hybridserve.sampling_params import SamplingParams


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


def check_request(
    ids: list[int],
    params: SamplingParams,
    speculative: bool,
    mm: MultimodalInput | None,
    kv_transfer_params: Any,
) -> None:
    """ValueError when an engine (`speculative`: it verifies drafts) cannot run a request
    with these settings, multimodal embeddings and P/D parameters."""
    if params.n != 1:
        raise ValueError(
            f"n={params.n}: the engine takes one completion per request (LLM.generate "
            "fans n out into n requests)"
        )
    if params.penalized and speculative:
        raise ValueError("penalties are not supported with speculative decoding yet")
    if params.prompt_logprobs is not None and speculative:
        raise ValueError("prompt_logprobs is not supported with speculative decoding yet")
    if params.prompt_logprobs is not None and kv_transfer_params:
        raise ValueError(
            "prompt_logprobs is not supported with disaggregated prefill/decode yet: send the "
            "request to a colocated engine"
        )
    if mm is not None and (not mm.positions or mm.positions[-1] >= len(ids)):
        raise ValueError("multimodal positions do not fit the prompt (use prepare_multimodal)")
    if kv_transfer_params and not isinstance(kv_transfer_params, dict):
        raise ValueError("kv_transfer_params must be an object")
