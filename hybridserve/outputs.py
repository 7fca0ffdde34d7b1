"""What `LLM.generate` returns (vLLM-shaped)."""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the model (before penalties and filters), its rank
    in the distribution (1: the most likely) and its text (None without a tokenizer): vLLM's
    `Logprob`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence. finish_reason: "stop" (EOS, stop token or string) or "length".
    With `SamplingParams.logprobs`: `logprobs` per generated token {token id: Logprob} (the
    chosen token and the most likely ones) and `cumulative_logprob`, the sum of the chosen
    tokens' log-probabilities (None without logprobs, as vLLM)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tokens_per_second(self) -> float | None:
        """Decode rate after the first token (None until two tokens exist)."""
        if self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        end = self.finished_time or self.first_token_time
        span = end - self.first_token_time
        return (self.num_generated_tokens - 1) / span if span > 0 else None


@dataclasses.dataclass
class RequestOutput:
    """The prompt and its completion(s) for one request. With `SamplingParams.prompt_logprobs`:
    `prompt_logprobs` per prompt token {token id: Logprob} (the token and the most likely ones
    at its position; None for the first token, which nothing scores), from the first token on.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    new_token_ids: list[int] = dataclasses.field(default_factory=list)  # since the last update
    kv_transfer_params: dict | None = None  # prefill side of P/D: what the decode side needs
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def local_prefill_output(req_id: str, prompt: str | list[int], ids: list[int]) -> RequestOutput:
    """A prefill engine's answer to a remote-decode prompt of one token: there is nothing to
    transfer (the decode side computes the last prompt token itself), so the parameters tell
    the decode side to prefill locally."""
    now = time.perf_counter()
    metrics = RequestMetrics(arrival_time=now, first_token_time=now, finished_time=now)
    done = CompletionOutput(0, "", [], "length", None, None)
    params = {"do_remote_prefill": False, "local_prefill": True}
    text = prompt if isinstance(prompt, str) else None
    return RequestOutput(req_id, text, list(ids), [done], True, metrics, [], params)
