"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): for every prompt token after the
first, its log-probability given the tokens before it, its rank, and the `k` most likely tokens.

The logits at position i score token i + 1: a chunk of positions [s, s + L) scores the prompt
tokens s + 1 .. min(s + L, P - 1) (P: the prompt's length), as log_softmax of the model's raw
logits (before penalties, temperature and filters, as vLLM returns them). The runner computes
such chunks with every position's logits (one unpacked program each: `ModelRunner.run` with
`n_logits=None`; a one-token chunk's decode row is already that). The entries accumulate in
the request's state; a position scored once (a preempted request computes its prompt again) is
not scored twice. The whole list, `[None, entry 1, ..., entry P-1]`, goes out with the
request's first sampled token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hybridserve.core.outputs import ScheduledChunk
from hybridserve.outputs import Logprob
from hybridserve.runner.request_state import RequestState, RequestStates
from hybridserve.runner.sampler import logprobs


def _span(state: RequestState, chunk: ScheduledChunk) -> tuple[int, int]:
    """The prompt positions [first, last] whose tokens `chunk` scores and `state` has not yet
    (empty when first > last)."""
    first = max(chunk.start + 1, len(state.prompt_logprobs) + 1)
    last = min(chunk.start + len(chunk.token_ids), state.num_prompt_tokens - 1)
    return first, last


def wants_scores(state: RequestState | None, chunk: ScheduledChunk) -> bool:
    """Does `chunk` hold prompt positions whose next token `state` has yet to score?"""
    if state is None or state.prompt_logprobs is None:
        return False
    first, last = _span(state, chunk)
    return first <= last


def score_chunk(state: RequestState, chunk: ScheduledChunk, logits: jax.Array) -> None:
    """Append the entries of the prompt tokens `chunk` scores to `state.prompt_logprobs`;
    `logits` [T', V] (T' >= len(chunk.token_ids), padded rows after) are the chunk's positions'
    logits."""
    have, start = state.prompt_logprobs, chunk.start
    first, last = _span(state, chunk)
    if first > last:
        return
    targets = np.zeros(logits.shape[0], np.int32)  # row i scores the token at start + i + 1
    span = np.arange(first, last + 1)
    targets[span - start - 1] = [state.token_ids[p] for p in span]
    k = state.params.prompt_logprobs
    chosen, top_ids, top_lp, rank = (
        np.asarray(a) for a in logprobs(logits, jnp.asarray(targets), max(k, 1))
    )
    for p in span:
        i = p - start - 1
        entry = {int(top_ids[i, j]): Logprob(float(top_lp[i, j]), j + 1) for j in range(k)}
        entry[int(targets[i])] = Logprob(float(chosen[i]), int(rank[i]))
        have.append(entry)


def take_scores(state: RequestState) -> list[dict[int, Logprob] | None] | None:
    """The request's prompt logprobs once, when every prompt token is scored (None before,
    after, and for a request that did not ask). Taking them ends the scoring: a preempted
    request that computes its prompt again scores nothing."""
    have = state.prompt_logprobs
    if have is None or len(have) < state.num_prompt_tokens - 1:
        return None
    state.prompt_logprobs = None
    return [None, *have]


def taken_scores(
    states: RequestStates, req_ids: dict[str, list[int]]
) -> dict[str, list[dict[int, Logprob] | None]]:
    """`take_scores` of the requests in `req_ids` that have theirs ready."""
    if not states.serial:
        return {}
    taken = {r: take_scores(s) for r in req_ids if (s := states.get(r)) is not None}
    return {r: entries for r, entries in taken.items() if entries is not None}
