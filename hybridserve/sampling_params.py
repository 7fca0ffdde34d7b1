"""SamplingParams: how to pick tokens and when to stop (vLLM-shaped)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping rules for one request.

    temperature 0 is greedy. top_k 0 (or -1), top_p 1 and min_p 0 turn those filters off.
    Generation stops at `max_tokens`, at an EOS token (unless `ignore_eos`, or before
    `min_tokens`), at any of `stop_token_ids`, or when the text contains one of the `stop`
    strings (which is cut off). `logprobs=n` returns, per generated token, its log-probability
    and the n most likely tokens' (of the model's distribution, before penalties and filters);
    `prompt_logprobs=n` the same for every prompt token after the first (the request then
    computes its whole prompt: it reads nothing from the prefix cache).
    `seed` makes sampling reproducible per request. `n` > 1 (`LLM.generate`) samples n
    completions of the prompt, the i-th with seed `seed + i` when a seed is given.

    Penalties (vLLM's and OpenAI's meanings), applied to the logits l of each step before the
    temperature, with c(t) the times token t was generated so far:
      repetition_penalty r (> 0, 1 = off): every token in the prompt or the output so far gets
        `l / r` where l > 0 and `l * r` elsewhere;
      frequency_penalty f ([-2, 2]): `l - f * c(t)`;
      presence_penalty p ([-2, 2]): `l - p * [c(t) > 0]`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def choice(self, index: int) -> SamplingParams:
        """The settings of completion `index` of `n`: one completion, seed `seed + index` when
        a seed is given (so completion 0 is what the same request with n = 1 gives); only
        completion 0 computes the prompt's logprobs (the others may share its cached pages)."""
        if self.n == 1 and index == 0:
            return self
        seed = None if self.seed is None else self.seed + index
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)

    @property
    def penalized(self) -> bool:
        """Does any penalty change the logits?"""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (or -1 for off), got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                f"logprobs must be in [0, 20], got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
            ),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an int: {self.seed}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}",
            ),
            (1 <= self.n <= 128, f"n must be in [1, 128], got {self.n}"),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
