"""LLMEngine: tokenizer + scheduler (host) + model runner (device) + sampler.

Lifecycle of a request:
  1. `add_request` validates and tokenizes the prompt and hands a `core.Request` to the
     scheduler (WAITING). A bad request raises here and never reaches the scheduler.
  2. Each `step`: the scheduler picks chunks under the token budget (prefill chunks and decode
     tokens mixed, prefix-cache hits restored by page copies); the runner computes them over the
     paged hybrid cache; rows that reached their last known token are sampled.
  3. The scheduler records the tokens, checks token-level stops and frees finished requests'
     pages; the engine checks stop strings (finishing those requests through the scheduler) and
     returns a `RequestOutput` for every request that got a token.
  4. `abort_request` removes a request in any state and frees its pages at once.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from hybridserve.config import CacheConfig, SchedulerConfig
from hybridserve.core.request import Request
from hybridserve.core.scheduler import Scheduler
from hybridserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from hybridserve.runner.factory import make_runner
from hybridserve.runner.sampler import logprobs, sample
from hybridserve.sampling_params import SamplingParams
from hybridserve.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine settings. `dtype=None` keeps the checkpoint's dtype."""

    model: str
    dtype: str | None = None
    tensor_parallel_size: int = 1
    backend: str = "xla"
    max_model_len: int = 2048
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_prefill_chunk: int = 256
    enable_prefix_caching: bool = True
    cache: CacheConfig = CacheConfig()
    seed: int = 0


@dataclasses.dataclass
class _Tracked:
    """Engine-side facts of one request (the scheduler owns the core Request)."""

    request: Request
    params: SamplingParams
    prompt: str | None
    key: jax.Array
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None
    text: str = ""
    reported: int = 0  # output tokens already returned


class LLMEngine:
    """Loads a model and serves many requests at once (see the module docstring)."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self.runner = make_runner(
            config.model,
            dtype=config.dtype,
            tp=config.tensor_parallel_size,
            backend=config.backend,
            cache=config.cache,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            progress=progress,
        )
        self.model_config = self.runner.cfg
        self.max_model_len = self.runner.max_model_len
        self.scheduler = Scheduler(
            self.runner.plan,
            self.runner.num_pages,
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_prefill_chunk=config.max_prefill_chunk,
                max_model_len=self.max_model_len,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
        )
        need = self.scheduler.coordinator.pages_for(self.max_model_len)
        if self.runner.num_pages < need:
            raise ValueError(
                f"the cache pool has {self.runner.num_pages} pages but one request of "
                f"max_model_len={self.max_model_len} tokens needs {need}: give the "
                "cache more memory or lower max_model_len"
            )
        self.tokenizer = Tokenizer.maybe_load(config.model)
        self.eos_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self._tracked: dict[str, _Tracked] = {}
        self._counter = 0

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Token ids of a prompt, or ValueError saying what is wrong with it."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{self.config.model} has no tokenizer.json: pass prompts as "
                    '{"prompt_token_ids": [...]}'
                )
            ids = self.tokenizer.encode(prompt)
        else:
            if any(isinstance(t, bool) or not isinstance(t, int | np.integer) for t in prompt):
                raise ValueError("prompt_token_ids must be a list of integers")
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; max_model_len is "
                f"{self.max_model_len} (prompt + at least one output token)"
            )
        return ids

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, req_id: str | None = None
    ) -> str:
        """Queue a prompt (text, or token ids) and return its req_id."""
        ids = self.validate(prompt, params)
        if req_id is None:
            req_id = f"req-{self._counter}"
        if req_id in self._tracked:
            raise ValueError(f"request id {req_id!r} is already in use")
        self._counter += 1
        seed = (
            params.seed if params.seed is not None else self.config.seed * 1_000_003 + self._counter
        )
        request = Request(
            req_id,
            ids,
            max_tokens=params.max_tokens,
            min_tokens=params.min_tokens,
            eos_token_ids=frozenset() if params.ignore_eos else frozenset(self.eos_ids),
            stop_token_ids=frozenset(params.stop_token_ids),
        )
        metrics = RequestMetrics(arrival_time=time.perf_counter())
        self._tracked[req_id] = _Tracked(
            request,
            params,
            prompt if isinstance(prompt, str) else None,
            jax.random.key(seed),
            metrics,
            [] if params.logprobs is not None else None,
        )
        self.scheduler.add_request(request)
        return req_id

    def abort_request(self, req_id: str) -> None:
        """Stop a request now and free its pages (unknown or finished ids are ignored)."""
        if self._tracked.pop(req_id, None) is not None:
            self.scheduler.abort_request(req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; outputs of every request that got a token in it."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        result = self.runner.execute(out)
        sampled: dict[str, int] = {}
        if result.req_ids:
            tokens = self._sample(result.req_ids, result.logits)
            sampled = dict(zip(result.req_ids, tokens.tolist(), strict=True))
        finished = {r.req_id for r in self.scheduler.update_from_output(out, sampled)}
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
            stop = None if req_id in finished else self._stop_string(tracked)
            if stop is not None:
                self.scheduler.finish_request(req_id, "stop", stop_reason=stop)
                finished.add(req_id)
            outputs.append(self._output(tracked, req_id in finished, now))
            if req_id in finished:
                del self._tracked[req_id]
        return outputs

    def _sample(self, req_ids: list[str], logits: jax.Array) -> np.ndarray:
        tracked = [self._tracked[r] for r in req_ids]
        params = [t.params for t in tracked]
        n_out = [len(t.request.output_token_ids) for t in tracked]
        blocked = [i for i, t in enumerate(tracked) if n_out[i] < t.params.min_tokens]
        if blocked:  # no EOS or stop token before min_tokens
            for i in blocked:
                stops = sorted(tracked[i].request.eos_token_ids | tracked[i].request.stop_token_ids)
                if stops:
                    logits = logits.at[i, jnp.asarray(stops)].set(-jnp.inf)
        keys = jnp.stack(
            [jax.random.fold_in(t.key, n) for t, n in zip(tracked, n_out, strict=True)]
        )
        tokens = sample(
            logits,
            jnp.array([p.temperature for p in params], jnp.float32),
            jnp.array([p.top_k for p in params], jnp.int32),
            jnp.array([p.top_p for p in params], jnp.float32),
            jnp.array([p.min_p for p in params], jnp.float32),
            keys,
        )
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            num = max(max(wanted), 1)
            chosen, top_ids, top_lp = (np.asarray(a) for a in logprobs(logits, tokens, num))
            for i, t in enumerate(tracked):
                if t.logprobs is not None:
                    entry = {
                        int(top_ids[i, j]): float(top_lp[i, j]) for j in range(t.params.logprobs)
                    }
                    entry[int(tokens[i])] = float(chosen[i])
                    t.logprobs.append(entry)
        return np.asarray(tokens)

    def _stop_string(self, tracked: _Tracked) -> str | None:
        """The first stop string in the text so far (the text is cut before it), or None."""
        params = tracked.params
        if not params.stop or self.tokenizer is None:
            return None
        text = self.tokenizer.decode(tracked.request.output_token_ids, params.skip_special_tokens)
        for stop in params.stop:
            if stop in text:
                tracked.text = text[: text.index(stop)]
                return stop
        return None

    def _output(self, tracked: _Tracked, finished: bool, now: float) -> RequestOutput:
        req = tracked.request
        ids = list(req.output_token_ids)
        text = tracked.text
        if not (finished and req.stop_reason in tracked.params.stop) and self.tokenizer:
            text = self.tokenizer.decode(ids, tracked.params.skip_special_tokens)
        if finished:
            tracked.metrics.finished_time = now
        new = ids[tracked.reported :]
        tracked.reported = len(ids)
        reason = req.finish_reason if finished else None
        completion = CompletionOutput(
            0, text, ids, reason, req.stop_reason if finished else None, tracked.logprobs
        )
        return RequestOutput(
            req.req_id,
            tracked.prompt,
            list(req.prompt_token_ids),
            [completion],
            finished,
            tracked.metrics,
            new,
        )

    def stats(self) -> dict[str, float]:
        """Scheduler and cache statistics (queue sizes, cache usage, prefix-cache hit rate)."""
        s = self.scheduler
        stats = {"num_running": s.num_running, "num_waiting": s.num_waiting, "cache_usage": s.usage}
        prefix = s.prefix_cache_stats
        stats.update(
            prefix_cache_queried_tokens=prefix.queried_tokens,
            prefix_cache_hit_tokens=prefix.hit_tokens,
            prefix_cache_hit_rate=prefix.hit_rate,
            num_preemptions=s.num_preemptions,
        )
        return stats
