"""From sampled tokens to `RequestOutput`s: incremental detokenization, stop strings, logprobs
and metrics, per request (what the engine used to redo over every request's whole text at every
step).

Lifecycle of a request:
  1. `add(request, prompt, params)` when the engine accepts it (the scheduler owns `request`).
  2. Each step `process(sampled, logprobs, finished, prompt_logprobs)`: the new tokens' text
     is decoded from a window of the last few tokens only (`IncrementalDetokenizer`), the stop
     strings are looked for in the new text, a request that met one is ended through
     `finish_request` (its text cut before the stop string), and an output is built for every
     request that got a token (with its prompt logprobs once they are all scored).
  3. A request that ended leaves the processor with its last output; `fail` reports one that
     ended outside a step (its P/D transfer failed for good); `remove` forgets an aborted one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from hybridserve.core.request import Request
from hybridserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from hybridserve.sampling_params import SamplingParams
from hybridserve.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what a token that ends inside a UTF-8 character decodes to


class IncrementalDetokenizer:
    """The text of a growing token list, decoding only a short window per new token.

    With ids[p:r] the tokens whose text was emitted last (p: prefix offset, r: read offset),
    a new token's text is `decode(ids[p:])` minus `decode(ids[p:r])`: both start at the same
    token, so tokenizers that drop a leading space or join byte pieces treat them alike. While
    the window ends inside a multi-byte character (decodes to U+FFFD) nothing is emitted."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0

    def add(self, ids: list[int]) -> str:
        """Append tokens; returns the text they completed (may be empty)."""
        out = []
        for token in ids:
            self.ids.append(int(token))
            decode = self.tokenizer.decode
            before = decode(self.ids[self._prefix : self._read], self.skip)
            after = decode(self.ids[self._prefix :], self.skip)
            if len(after) > len(before) and not after.endswith(REPLACEMENT):
                out.append(after[len(before) :])
                self._prefix, self._read = self._read, len(self.ids)
        delta = "".join(out)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The last tokens' text even when it ends inside a character (as a whole decode
        gives it: the request ended there); the text is then complete."""
        before = self.tokenizer.decode(self.ids[self._prefix : self._read], self.skip)
        after = self.tokenizer.decode(self.ids[self._prefix :], self.skip)
        delta = after[len(before) :] if len(after) > len(before) else ""
        self.text += delta
        self._prefix = self._read = len(self.ids)
        return delta


@dataclasses.dataclass
class _Tracked:
    """Output-side facts of one request."""

    request: Request
    params: SamplingParams
    prompt: str | None
    metrics: RequestMetrics
    logprobs: list[dict[int, Logprob]] | None
    detok: IncrementalDetokenizer | None
    text: str = ""
    reported: int = 0  # output tokens already returned
    cumulative: float = 0.0  # the chosen tokens' logprobs, summed over the first `summed`
    summed: int = 0
    stopped: bool = False  # ended by a stop string: `text` is cut before it
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class OutputProcessor:
    """Builds the outputs of an engine's requests (see the module docstring).

    `finish_request(req_id, stop)` ends a request that met stop string `stop` (the scheduler's
    `finish_request`); `transfer_params(request)` gives a finished request's P/D parameters
    (a prefill request's output is those parameters, not tokens) or None."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        finish_request: Callable[[str, str], None],
        transfer_params: Callable[[Request], dict | None] = lambda request: None,
    ) -> None:
        self.tokenizer = tokenizer
        self.finish_request = finish_request
        self.transfer_params = transfer_params
        self._tracked: dict[str, _Tracked] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._tracked

    def __len__(self) -> int:
        return len(self._tracked)

    def add(self, request: Request, prompt: str | list[int], params: SamplingParams) -> None:
        """Track a request the engine accepted."""
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self._tracked[request.req_id] = _Tracked(
            request,
            params,
            prompt if isinstance(prompt, str) else None,
            RequestMetrics(arrival_time=time.perf_counter()),
            [] if params.logprobs is not None else None,
            detok,
        )

    def tracks(self, req_id: str) -> bool:
        """Is the request still to be reported on?"""
        return req_id in self._tracked

    def remove(self, req_id: str) -> bool:
        """Forget a request (aborted); False when it was not tracked."""
        return self._tracked.pop(req_id, None) is not None

    def fail(self, req_id: str) -> RequestOutput | None:
        """The final output of a request that ended outside a step (None: not tracked)."""
        tracked = self._tracked.pop(req_id, None)
        return None if tracked is None else self._output(tracked, True, time.perf_counter())

    def process(
        self,
        sampled: dict[str, list[int]],
        logprobs: dict[str, list[dict[int, Logprob]]],
        finished: set[str],
        prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] | None = None,
    ) -> list[RequestOutput]:
        """Outputs of the requests that got tokens in a step (`sampled`, as the runner gave
        them; the scheduler has recorded what counts), `finished` the ones the scheduler
        ended in it; `prompt_logprobs` the whole prompt's entries of requests that asked (with
        their first token)."""
        prompt_logprobs = prompt_logprobs or {}
        outputs = []
        now = time.perf_counter()
        for req_id in sampled:
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            req = tracked.request
            if tracked.metrics.first_token_time is None:
                tracked.metrics.first_token_time = now
                tracked.metrics.num_cached_tokens = req.num_cached_tokens
            tracked.metrics.num_generated_tokens = len(req.output_token_ids)
            if tracked.logprobs is not None:
                tracked.logprobs.extend(map(self._decoded, logprobs.get(req_id, ())))
            if req_id in prompt_logprobs:
                entries = prompt_logprobs[req_id]
                tracked.prompt_logprobs = [e and self._decoded(e) for e in entries]
            done = req_id in finished
            stop = self._update_text(tracked, check_stops=not done)
            if stop is not None:
                self.finish_request(req_id, stop)
                tracked.stopped = done = True
            elif done and tracked.detok is not None:
                tracked.text = tracked.text + tracked.detok.flush()
            outputs.append(self._output(tracked, done, now))
            if done:
                del self._tracked[req_id]
        return outputs

    def _decoded(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """A logprob entry with each token's text (when there is a tokenizer)."""
        if self.tokenizer is None:
            return entry
        decode = self.tokenizer.decode
        return {
            t: dataclasses.replace(lp, decoded_token=decode([t], skip_special_tokens=False))
            for t, lp in entry.items()
        }

    def _update_text(self, tracked: _Tracked, check_stops: bool) -> str | None:
        """Decode the request's new tokens; the first stop string now in its text (the text
        cut before it), or None."""
        detok = tracked.detok
        if detok is None:
            return None
        ids = tracked.request.output_token_ids
        before = len(detok.text)
        detok.add(ids[len(detok.ids) :])
        tracked.text = detok.text
        for stop in tracked.params.stop if check_stops else ():
            at = detok.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                tracked.text = detok.text[:at]
                return stop
        return None

    def _output(self, tracked: _Tracked, finished: bool, now: float) -> RequestOutput:
        req = tracked.request
        ids = list(req.output_token_ids)
        if finished:
            tracked.metrics.finished_time = now
        new = ids[tracked.reported :]
        tracked.reported = len(ids)
        text = tracked.text
        kv_params = self.transfer_params(req) if finished else None
        if kv_params is not None:  # a prefill request: its output is the decode side's params
            ids, new, text = [], [], ""
        cumulative = None
        if tracked.logprobs is not None:
            for token, entry in zip(
                ids[tracked.summed :], tracked.logprobs[tracked.summed :], strict=False
            ):
                tracked.cumulative += entry[token].logprob
                tracked.summed += 1
            cumulative = tracked.cumulative
        completion = CompletionOutput(
            0,
            text,
            ids,
            req.finish_reason if finished else None,
            req.stop_reason if finished else None,
            tracked.logprobs,
            cumulative,
        )
        return RequestOutput(
            req.req_id,
            tracked.prompt,
            list(req.prompt_token_ids),
            [completion],
            finished,
            tracked.metrics,
            new,
            kv_params,
            tracked.prompt_logprobs,
        )
