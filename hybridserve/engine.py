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
  4. `abort_request` removes a request in any state and frees its pages at once (a request
     whose KV is still arriving is aborted when its transfer ends).

Disaggregated prefill/decode (`kv_transfer`): a prefill engine given `kv_transfer_params=
{"do_remote_decode": True}` computes the prompt except its last token, holds the pages and
returns transfer parameters in its output; a decode engine given those parameters pulls the
pages over NIXL (`hybridserve.disagg.connector`) and continues from there.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from hybridserve.config import EngineConfig
from hybridserve.core.request import MultimodalInput, Request
from hybridserve.core.scheduler import PoolTooSmall, Scheduler
from hybridserve.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    local_prefill_output,
)
from hybridserve.prompt_check import prompt_token_ids
from hybridserve.runner.factory import make_runner
from hybridserve.runner.multimodal_prompt import multimodal_prompt
from hybridserve.runner.sampler import sample_requests
from hybridserve.runner.spec_decode import SpecDecoder
from hybridserve.sampling_params import SamplingParams
from hybridserve.tokenizer import Tokenizer


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
    remote_prefill: bool = False  # prefill half of a P/D request: hand the pages over


class LLMEngine:
    """Loads a model and serves many requests at once (see the module docstring)."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self.runner = make_runner(
            config.model,
            dtype=config.dtype,
            tp=config.parallel.tensor_parallel_size,
            backend=config.backend,
            cache=config.cache,
            max_model_len=config.max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs,
            progress=progress,
            shareable_regions=config.kv_transfer is not None,  # GPU: UCX cuda_ipc needs it
            load_format=config.load_format,
            seed=config.seed,
        )
        self.model_config = self.runner.cfg
        self.max_model_len = self.runner.max_model_len  # at most max_position_embeddings
        self.scheduler = Scheduler(
            self.runner.plan,
            self.runner.num_pages,
            dataclasses.replace(config.scheduler, max_model_len=self.max_model_len),
        )
        chunk = config.scheduler.max_prefill_chunk
        need = self.scheduler.coordinator.pages_for(self.max_model_len, chunk)
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
        self.connector = None
        self.remote = None
        if config.kv_transfer is not None:
            from hybridserve.disagg.connector import NixlConnector
            from hybridserve.disagg.remote_requests import RemoteRequests

            self.connector = NixlConnector(config.kv_transfer, self.runner)
            self.remote = RemoteRequests(self.connector, self.scheduler, self._gave_up)
        self._ready: list[RequestOutput] = []  # outputs produced outside a model step
        self.spec = (
            None
            if config.speculative is None
            else SpecDecoder(config.speculative, self.runner, self.model_config)
        )

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Token ids of a prompt, or ValueError saying what is wrong with it."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params)}")
        return prompt_token_ids(
            prompt,
            self.tokenizer,
            self.model_config.vocab_size,
            self.max_model_len,
            self.config.model,
        )

    def prepare_multimodal(
        self, prompt: str | list[int], data: dict
    ) -> tuple[list[int], MultimodalInput]:
        """(token ids with the placeholders expanded, the embeddings) of a multimodal prompt
        (`runner.multimodal_prompt`): pass both to `add_request`."""
        if not isinstance(data, dict):
            raise ValueError('multi_modal_data must be a dict like {"image": [...]}')
        ids = self.validate(prompt, SamplingParams())
        return multimodal_prompt(ids, data, self.model_config, self.runner.embed_multimodal)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        req_id: str | None = None,
        kv_transfer_params: dict | None = None,
        mm: MultimodalInput | None = None,
    ) -> str:
        """Queue a prompt (text, or token ids) and return its req_id. `kv_transfer_params`:
        `{"do_remote_decode": True}` on a prefill engine, or a prefill output's parameters on a
        decode engine. `mm`: the embeddings of a prompt from `prepare_multimodal` (whose
        expanded ids are `prompt`)."""
        ids = self.validate(prompt, params)
        if mm is not None and (not mm.positions or mm.positions[-1] >= len(ids)):
            raise ValueError("multimodal positions do not fit the prompt (use prepare_multimodal)")
        if mm is not None and kv_transfer_params:
            raise ValueError("multimodal prompts do not run disaggregated yet")
        remote = kv_transfer_params or {}
        if not isinstance(remote, dict):
            raise ValueError("kv_transfer_params must be an object")
        if remote and self.connector is None:
            raise ValueError("kv_transfer_params given but the engine has no kv_transfer config")
        if remote.get("do_remote_decode") and not self.connector.config.is_producer:
            raise ValueError("do_remote_decode needs a kv_producer (or kv_both) engine")
        transfer = None
        if "block_tables" in remote:
            if not self.connector.config.is_consumer:
                raise ValueError("remote prefill parameters need a kv_consumer (or kv_both) engine")
            transfer = self.connector.consumer.accept_params(remote, ids)  # ValueError, Forbidden
        if req_id is None:
            req_id = f"req-{self._counter}"
        if req_id in self._tracked:
            raise ValueError(f"request id {req_id!r} is already in use")
        self._counter += 1
        seed = (
            params.seed if params.seed is not None else self.config.seed * 1_000_003 + self._counter
        )
        producer = bool(remote.get("do_remote_decode"))
        if producer and len(ids) < 2:  # nothing to transfer: the decode side computes it all
            self._ready.append(local_prefill_output(req_id, prompt, ids))
            return req_id
        request = Request(
            req_id,
            ids[:-1] if producer else ids,  # the decode side computes the last prompt token
            max_tokens=1 if producer else params.max_tokens,
            min_tokens=0 if producer else params.min_tokens,
            eos_token_ids=frozenset() if params.ignore_eos or producer else frozenset(self.eos_ids),
            stop_token_ids=frozenset() if producer else frozenset(params.stop_token_ids),
            hold_pages=producer,
            mm=mm,
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
        self._tracked[req_id].remote_prefill = producer
        if transfer is not None:
            self.remote.add(request, transfer)
        else:
            self.scheduler.add_request(request)
        return req_id

    def abort_request(self, req_id: str) -> None:
        """Stop a request now and free its pages (unknown or finished ids are ignored)."""
        if self._tracked.pop(req_id, None) is None:
            return
        if self.spec is not None:
            self.spec.forget(req_id)
        if self.remote is None or not self.remote.abort(req_id):
            self.scheduler.abort_request(req_id)

    def _gave_up(self, req_id: str, reason: str) -> None:
        """A request failed for good (a decode-side P/D request with `failure_policy` "fail",
        or one the cache pool cannot hold): report it."""
        tracked = self._tracked.pop(req_id, None)
        if tracked is not None:
            self._ready.append(self._output(tracked, True, time.perf_counter()))

    def release_kv(self, params: dict) -> bool:
        """Prefill side: free now the held pages of the request whose transfer parameters
        (as this engine returned them) are `params` (its decode leg failed). False when they
        are not this engine's, not held (read, released, expired) or wrongly signed."""
        if self.connector is None or not self.connector.config.is_producer:
            return False
        return self.connector.release_held(params) is not None

    @property
    def transfers_idle(self) -> bool:
        """No P/D work in flight (held pages, transfers, handshakes, waiting requests)."""
        return self.remote is None or self.remote.idle

    def poll_transfers(self) -> None:
        """Advance P/D bookkeeping (`disagg.remote_requests`): finished transfers, requests
        waiting for pages, released and expired held pages."""
        if self.remote is not None:
            self.remote.poll()

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_unfinished() or self.remote or self._ready)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; outputs of every request that got a token in it."""
        self.poll_transfers()
        ready, self._ready = self._ready, []
        try:
            out = self.scheduler.schedule()
        except PoolTooSmall as err:  # that request can never run here: fail it, keep serving
            self.scheduler.finish_request(err.req_id, "abort", stop_reason=str(err))
            self._gave_up(err.req_id, str(err))
            return ready + self._ready
        if out.is_empty:
            return ready
        if self.spec is not None:
            return ready + self._spec_step(out)
        result = self.runner.execute(out)
        sampled: dict[str, int] = {}
        if result.req_ids:
            tokens = self._sample(result.req_ids, result.logits)
            sampled = dict(zip(result.req_ids, tokens.tolist(), strict=True))
        return ready + self._finish_step(out, sampled)

    def _spec_step(self, out) -> list[RequestOutput]:
        """One step with speculative decoding (`runner.spec_decode`, steps 2-5)."""
        mtp = self.spec.config.method == "mtp"
        result = self.runner.execute(out, n_logits=self.spec.k + 1, keep_hidden=mtp)
        tracked = {
            c.req_id: self._tracked[c.req_id] for c in out.chunks if c.req_id in self._tracked
        }
        keys = {
            r: jax.random.fold_in(t.key, len(t.request.output_token_ids))
            for r, t in tracked.items()
        }
        params = {r: t.params for r, t in tracked.items()}
        sampled = {}
        if result.req_ids:
            sampled = self.spec.accept(result, out, keys, params, self._sample)
        outputs = self._finish_step(out, sampled)
        requests = {r: t.request for r, t in tracked.items()}
        self.spec.propose(result, out, sampled, requests, params, keys, self.max_model_len)
        for o in outputs:
            if o.finished:
                self.spec.forget(o.request_id)
        return outputs

    def _finish_step(self, out, sampled: dict) -> list[RequestOutput]:
        """Record a step's tokens, apply stop strings and build the outputs."""
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
        """One token for each of `req_ids` from its row of `logits` (`sample_requests`)."""
        return sample_requests([self._tracked[r] for r in req_ids], logits)

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
        kv_params = None
        if tracked.remote_prefill and finished:
            kv_params = self.connector.producer_params(
                req.req_id, self.scheduler.held_tables(req.req_id), list(req.prompt_token_ids)
            )
            ids, new, text = [], [], ""
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
            kv_params,
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
        if self.connector is not None:
            stats.update(self.connector.stats(), held_requests=len(s.held))
        if self.spec is not None:
            stats.update(self.spec.stats())
        return stats

    def close(self) -> None:
        """Release the NIXL connector: its handshake server, prepared transfers, registered
        memory and agent (idempotent). A prefill or decode engine takes no P/D request after
        it; a colocated engine has nothing to release."""
        if self.connector is not None:
            self.connector.close()
            self.connector = None
