"""What the runner keeps of each request to sample it, and what a step returns.

The scheduler owns a request's lifecycle (`core.Request`); the runner owns what sampling needs:
the settings, the PRNG key, the token ids so far (prompt, then the tokens it sampled: the
speculative heads read ahead in them) and the tokens that may not end it before `min_tokens`.
Row i of a step draws with `fold_in(key, outputs so far)`, so a request's tokens do not depend
on the batch it shares.
"""

from __future__ import annotations

import dataclasses

import jax

from hybridserve.core.outputs import ScheduledChunk
from hybridserve.outputs import Logprob
from hybridserve.runner.input_batch import BatchArrays
from hybridserve.sampling_params import SamplingParams


@dataclasses.dataclass
class RequestState:
    """One request as the runner sees it."""

    req_id: str
    params: SamplingParams
    key: jax.Array
    token_ids: list[int]  # prompt, then every token sampled for it
    num_prompt_tokens: int
    stop_ids: frozenset[int]  # EOS and stop tokens: masked while short of min_tokens
    # `runner.prompt_logprobs`: entries of prompt positions 1.. scored so far (None: not asked,
    # or already handed out)
    prompt_logprobs: list[dict[int, Logprob]] | None = None

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def blocked_ids(self) -> frozenset[int]:
        """The tokens this request may not sample now (its stops, until `min_tokens`)."""
        return self.stop_ids if self.num_outputs < self.params.min_tokens else frozenset()


@dataclasses.dataclass
class StepPass:
    """One forward program of a step: its chunks, its batch and its final hidden states."""

    chunks: list[ScheduledChunk]
    batch: BatchArrays
    hidden: jax.Array


@dataclasses.dataclass
class StepLogits:
    """Logits [n', V] (or [n', n_logits, V]; float32, on device) of the chunks that sample, in
    `req_ids` order (n' >= len(req_ids): padded to a power of two); `passes` (speculative
    decoding) the programs the MTP heads continue."""

    req_ids: list[str]
    logits: jax.Array | None
    passes: list[StepPass] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class RunnerOutput:
    """What one step gives back per request that sampled: its new tokens (one, or with
    speculative decoding the accepted drafts and one more) and, when asked, one logprob entry
    per new token ({token id: logprob}: the chosen token and the top `logprobs`);
    `prompt_logprobs` the whole prompt's entries of the requests that asked, with their first
    token (`runner.prompt_logprobs`)."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, Logprob]]] = dataclasses.field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = dataclasses.field(
        default_factory=dict
    )


class RequestStates:
    """The runner's requests, by req_id."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}
        # requests whose steps run one at a time: penalties count every token so far, prompt
        # logprobs are read on the host as their chunks compute
        self.serial = 0

    def add(
        self,
        req_id: str,
        token_ids: list[int],
        params: SamplingParams,
        seed: int,
        stop_ids: frozenset[int],
    ) -> None:
        """Start sampling state for a request (its prompt as the scheduler computes it)."""
        if req_id in self._states:
            raise ValueError(f"request id {req_id!r} is already in use")
        self._states[req_id] = RequestState(
            req_id, params, jax.random.key(seed), list(token_ids), len(token_ids), stop_ids
        )
        if params.prompt_logprobs is not None:
            self._states[req_id].prompt_logprobs = []
        self.serial += _serial(params)

    def remove(self, req_id: str) -> None:
        """Forget a finished or aborted request (unknown ids are ignored)."""
        state = self._states.pop(req_id, None)
        if state is not None:
            self.serial -= _serial(state.params)

    def __getitem__(self, req_id: str) -> RequestState:
        return self._states[req_id]

    def get(self, req_id: str) -> RequestState | None:
        return self._states.get(req_id)

    def __len__(self) -> int:
        return len(self._states)

    def record(self, sampled: dict[str, list[int]]) -> None:
        """Append a step's tokens to their requests."""
        for req_id, tokens in sampled.items():
            state = self._states.get(req_id)
            if state is not None:
                state.token_ids.extend(tokens)

    def settle(self, sampled: dict[str, list[int]], positions: dict[str, int]) -> None:
        """Overlapped steps: put each request's token in place of the pending one recorded at
        `positions[req_id]` (requests gone meanwhile are skipped)."""
        for req_id, tokens in sampled.items():
            state = self._states.get(req_id)
            if state is not None:
                at = positions[req_id]
                state.token_ids[at : at + len(tokens)] = tokens


def _serial(params: SamplingParams) -> bool:
    """Must the request's steps run one at a time (`RequestStates.serial`)?"""
    return params.penalized or params.prompt_logprobs is not None
