"""LLMEngine: tokenizer + scheduler (host) + model runner (device, sampling included) + output
processor.

Lifecycle of a request:
  1. `add_request` validates and tokenizes the prompt and hands a `core.Request` to the
     scheduler (WAITING). A bad request raises here and never reaches the scheduler.
  2. Each `step`: the scheduler picks chunks under the token budget (prefill chunks and decode
     tokens mixed, prefix-cache hits restored by page copies); the runner computes them over the
     paged hybrid cache and samples the rows that reached their last known token, each with the
     sampling state it keeps per request; it returns tokens.
  3. The scheduler records the tokens, checks token-level stops and frees finished requests'
     pages; the output processor decodes the new text, checks stop strings (finishing those
     requests through the scheduler) and builds a `RequestOutput` for every request that got a
     token. With speculation the runner then proposes drafts, which the scheduler keeps.
  4. `abort_request` removes a request in any state and frees its pages at once (a request
     whose KV is still arriving is aborted when its transfer ends).

Disaggregated prefill/decode (`kv_transfer`): the engine owns a KV connector
(`core.connector`, built by name from the config over the cache regions) and hands its P/D
requests to `core.kv_transfer.KVTransfers`, which drives the scheduler and the connector; the
engine only calls it (admit, abort, poll, finished, release) and never sees the transport.
"""

from __future__ import annotations

import dataclasses
import os

from hybridserve.config import EngineConfig
from hybridserve.core.connector import create_connector
from hybridserve.core.kv_transfer import KVTransfers
from hybridserve.core.outputs import PENDING_TOKEN, SchedulerOutput
from hybridserve.core.request import MultimodalInput, Request
from hybridserve.core.scheduler import PoolTooSmall, Scheduler
from hybridserve.output_processor import OutputProcessor
from hybridserve.outputs import RequestOutput, local_prefill_output
from hybridserve.prompt_check import check_request, prompt_token_ids
from hybridserve.runner.compile_cache import enable_compilation_cache, programs
from hybridserve.runner.factory import make_runner
from hybridserve.runner.inflight import InFlight
from hybridserve.runner.multimodal_prompt import expand_placeholders, multimodal_prompt
from hybridserve.sampling_params import SamplingParams
from hybridserve.tokenizer import Tokenizer

WARMUP_ENV = "HYBRIDSERVE_WARMUP"  # "0": no start-up compile (the tests set it)


def wants_warmup(config: EngineConfig) -> bool:
    """Does an engine of `config` compile its programs at start-up by default?"""
    return not config.enforce_eager and os.environ.get(WARMUP_ENV, "1") != "0"


class LLMEngine:
    """Loads a model and serves many requests at once (see the module docstring)."""

    def __init__(
        self, config: EngineConfig, progress: bool = True, warmup: bool | None = None
    ) -> None:
        """`warmup`: compile every step program now (`warmup`); None: unless
        `config.enforce_eager` or `$HYBRIDSERVE_WARMUP=0`."""
        self.config = config
        self.compilation_cache = enable_compilation_cache()  # its directory, or None: off
        self.runner = make_runner(
            config.model,
            dtype=config.dtype,
            tp=config.parallel.tensor_parallel_size,
            backend=config.backend,
            cache=config.cache,
            max_model_len=config.max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_prefill_chunk=config.scheduler.max_prefill_chunk,
            # a step of prompts alone may fill the whole budget (the prompt cap holds beside
            # decodes only)
            max_step_tokens=config.scheduler.max_num_batched_tokens,
            progress=progress,
            shareable_regions=config.kv_transfer is not None,  # a connector exports them
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
                "cache more memory (kv_cache_memory / --kv-cache-memory bytes, or a higher "
                "gpu_memory_utilization) or lower max_model_len"
            )
        self.full_requests = (self.runner.num_pages - 1) // need  # of max_model_len tokens
        self.tokenizer = Tokenizer.maybe_load(config.model)
        self.eos_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self._counter = 0
        self.connector = None
        self.kv: KVTransfers | None = None
        if config.kv_transfer is not None:
            self.connector = create_connector(config.kv_transfer, self.runner.cache_regions())
            self.kv = KVTransfers(self.connector, self.scheduler, self._gave_up)
        self.outputs = OutputProcessor(
            self.tokenizer,
            lambda req_id, stop: self.scheduler.finish_request(req_id, "stop", stop_reason=stop),
            lambda request: None if self.kv is None else self.kv.finished(request),
        )
        self._ready: list[RequestOutput] = []  # outputs produced outside a model step
        if config.speculative is not None:
            self.runner.enable_speculation(config.speculative)
            self.scheduler.max_drafts = config.speculative.num_speculative_tokens
        # overlapped steps (`_step_overlapped`): not with drafts to verify or P/D transfers
        self._overlap = (
            config.scheduler.async_scheduling and config.speculative is None and self.kv is None
        )
        self._flight: InFlight | None = None  # the step whose tokens are still on the device
        if warmup is None:
            warmup = wants_warmup(config)
        if warmup:
            self.warmup(progress)

    def warmup(self, progress: bool = False) -> int:
        """Compile what serving needs before the first request: every step program the
        scheduler's budget can ask for (`runner.warmup`, with a progress bar), then batches
        of 1, 2, 4, ... up to `max_num_seqs` short requests end to end, greedy, sampled and
        filtered (the small programs between the steps, which depend on the batch). Programs
        in JAX's persistent cache load instead of compiling. Returns how many step programs
        there are."""
        sched = self.config.scheduler
        count = self.runner.warmup(sched.max_num_seqs, sched.max_num_batched_tokens, progress)
        vocab, length = self.model_config.vocab_size, min(8, self.max_model_len - 2)
        kinds = (
            SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=0),
            SamplingParams(temperature=1.0, top_p=0.9, max_tokens=2, ignore_eos=True, seed=0),
        )
        rows = 1
        while rows <= sched.max_num_seqs:
            for params in kinds:
                pending = {
                    self.add_request(
                        [1 + (self._counter + j) % (vocab - 1)] * length,
                        params,
                        req_id=f"warmup-{self._counter}",
                    )
                    for j in range(rows)
                }
                while pending:
                    pending -= {out.request_id for out in self.step() if out.finished}
            rows *= 2
        # the statistics start from the first real request
        self.scheduler.coordinator.stats = type(self.scheduler.coordinator.stats)()
        self.scheduler.num_preemptions = 0
        self.runner.prefill_tokens = [0, 0]
        return count

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

    def expand_multimodal(self, prompt: list[int], data: dict) -> list[int]:
        """The token ids of a multimodal prompt with one placeholder per embedding, the media
        checked against the model's encoders (ValueError) but not encoded: what
        `prepare_multimodal` will give, cheaply (pure: any thread may call it)."""
        return expand_placeholders(prompt, data, self.model_config)[0]

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
        check_request(ids, params, self.runner.spec is not None, mm, kv_transfer_params)
        transfer = None
        if kv_transfer_params:
            if self.kv is None:
                raise ValueError(
                    "kv_transfer_params given but the engine has no kv_transfer config"
                )
            transfer = self.kv.parse(kv_transfer_params, ids)  # ValueError on bad or forged
        if req_id is None:
            req_id = f"req-{self._counter}"
        if req_id in self.outputs:
            raise ValueError(f"request id {req_id!r} is already in use")
        self._counter += 1
        seed = (
            params.seed if params.seed is not None else self.config.seed * 1_000_003 + self._counter
        )
        if transfer is not None and self.kv.nothing_to_transfer(transfer, ids):
            self._ready.append(local_prefill_output(req_id, prompt, ids))
            return req_id
        request = Request(
            req_id,
            ids,
            max_tokens=params.max_tokens,
            min_tokens=params.min_tokens,
            eos_token_ids=frozenset() if params.ignore_eos else frozenset(self.eos_ids),
            stop_token_ids=frozenset(params.stop_token_ids),
            mm=mm,
            skip_prefix_cache=params.prompt_logprobs is not None,
        )
        if transfer is not None:
            self.kv.prepare(request, transfer)  # a prefill request computes less
        self.outputs.add(request, prompt, params)
        stops = request.eos_token_ids | request.stop_token_ids
        self.runner.add_request(req_id, request.prompt_token_ids, params, seed, stops)
        if transfer is None:
            self.scheduler.add_request(request)
        else:
            self.kv.admit(request, transfer)
        return req_id

    def abort_request(self, req_id: str) -> None:
        """Stop a request now and free its pages (unknown or finished ids are ignored)."""
        if not self.outputs.remove(req_id):
            return
        self.runner.remove_request(req_id)
        if self.kv is None or not self.kv.abort(req_id):
            self.scheduler.abort_request(req_id)

    def _gave_up(self, req_id: str, reason: str) -> None:
        """A request failed for good (a decode-side P/D request with `failure_policy` "fail",
        or one the cache pool cannot hold): report it."""
        self.runner.remove_request(req_id)
        output = self.outputs.fail(req_id)
        if output is not None:
            self._ready.append(output)

    def release_kv(self, params: dict) -> bool:
        """Prefill side: free now the held pages of the request whose transfer parameters
        (as this engine returned them) are `params` (its decode leg failed). False when they
        are not this engine's, not held (read, released, expired) or wrongly signed."""
        return self.kv is not None and self.kv.release(params)

    @property
    def transfers_idle(self) -> bool:
        """No P/D work in flight (held pages, transfers, handshakes, waiting requests)."""
        return self.kv is None or self.kv.idle

    def poll_transfers(self) -> None:
        """Advance P/D bookkeeping (`core.kv_transfer`): finished transfers, requests waiting
        for pages, released and expired held pages."""
        if self.kv is not None:
            self.kv.poll()

    @property
    def engine_id(self) -> str | None:
        """This engine's name to its P/D peers (None: colocated)."""
        return None if self.connector is None else self.connector.engine_id

    @property
    def num_held(self) -> int:
        """Finished prefill requests whose pages are held for a decode engine."""
        return len(self.scheduler.held)

    def has_unfinished(self) -> bool:
        """Work left: requests, P/D transfers, outputs to hand out, or a step in flight with a
        token for a request still reported on (one whose requests were all aborted is not)."""
        flight = self._flight
        in_flight = flight is not None and any(self.outputs.tracks(r) for r in flight.req_ids)
        return bool(self.scheduler.has_unfinished() or self.kv or self._ready or in_flight)

    @property
    def overlapped(self) -> bool:
        """Whether `step` overlaps the next step with this one (`async_scheduling`)."""
        return self._overlap

    @overlapped.setter
    def overlapped(self, on: bool) -> None:
        """Switch between overlapped and one-at-a-time steps (e.g. to compare them on one
        engine). Switching off lands the step in flight: its outputs come with the next
        `step`. Speculative and P/D engines step one at a time only."""
        if on and (self.runner.spec is not None or self.kv is not None):
            raise ValueError("speculative and P/D engines step one at a time")
        if not on and self._flight is not None:
            flight, self._flight = self._flight, None
            self._ready += self._land(flight, self._record(flight))
        self._overlap = bool(on)

    @property
    def in_flight(self) -> bool:
        """A step is dispatched and its tokens are still on the device (overlapped steps):
        the next `step` reports them, whatever it schedules."""
        return self._flight is not None

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; outputs of every request that got a token in it. With
        `async_scheduling` the step's tokens are still on the device when it returns: the
        outputs are those of the step before (`_step_overlapped`); while a request with
        penalties (they count every token so far) or prompt logprobs runs, steps run one at a
        time."""
        if self._overlap and not self.runner.requests.serial:
            return self._step_overlapped()
        if self._flight is not None:  # a serial request's step: land the one in flight first
            flight, self._flight = self._flight, None
            self._ready += self._land(flight, self._record(flight))
        self.poll_transfers()
        out = self._schedule()
        ready, self._ready = self._ready, []
        if out is None or out.is_empty:
            return ready
        result = self.runner.execute(out)
        finished = {r.req_id for r in self.scheduler.update_from_output(out, result.sampled)}
        outputs = self.outputs.process(
            result.sampled, result.logprobs, finished, result.prompt_logprobs
        )
        if self.runner.spec is not None:  # the next drafts, for the requests still running
            self.scheduler.set_drafts(self.runner.propose(self.scheduler.draft_rooms(out)))
        return ready + self._forget_finished(outputs)

    def _schedule(self) -> SchedulerOutput | None:
        """The next step's schedule; None when a request can never fit the pool (it is
        failed, and its output waits in `_ready`: the engine keeps serving)."""
        try:
            return self.scheduler.schedule()
        except PoolTooSmall as err:
            self.scheduler.finish_request(err.req_id, "abort", stop_reason=str(err))
            self._gave_up(err.req_id, str(err))
            return None

    def _forget_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The runner drops the requests that finished in `outputs`; returns `outputs`."""
        for o in outputs:
            if o.finished:
                self.runner.remove_request(o.request_id)
        return outputs

    def _step_overlapped(self) -> list[RequestOutput]:
        """One call with step N in flight (its tokens on the device):
        1. the scheduler records N with a pending token per sampling request (length stops
           apply here);
        2. it schedules N+1, which the runner dispatches with N's tokens read on the device;
        3. N's tokens reach the host (the device has N+1 queued behind them) and settle: an
           EOS or stop token finishes its request now, and N+1's extra token for it is dropped
           when N+1 is recorded;
        4. the output processor turns N's tokens into outputs while N+1 runs.
        The first call only dispatches; `has_unfinished` stays true while a step is in flight."""
        flight = self._flight
        updated = [] if flight is None else self._record(flight)
        out = self._schedule()
        self._flight = None if out is None or out.is_empty else self.runner.dispatch(out, flight)
        ready, self._ready = self._ready, []
        return ready if flight is None else ready + self._land(flight, updated)

    def _record(self, flight: InFlight) -> list[Request]:
        """Step 1 of `_step_overlapped`: the scheduler records `flight` with pending tokens."""
        pending = {r: [PENDING_TOKEN] for r in flight.req_ids}
        return self.scheduler.update_from_output(flight.out, pending)

    def _land(self, flight: InFlight, updated: list[Request]) -> list[RequestOutput]:
        """Steps 3 and 4 of `_step_overlapped`: `flight`'s tokens settle and become outputs."""
        result = self.runner.resolve(flight)
        settled = self.scheduler.settle(flight.out, result.sampled, updated)
        finished = {r.req_id for r in settled}
        outputs = self.outputs.process(
            result.sampled, result.logprobs, finished, result.prompt_logprobs
        )
        return self._forget_finished(outputs)

    def stats(self) -> dict[str, float]:
        """Scheduler and cache statistics (queue sizes, cache usage, prefix-cache hit rate;
        prompt tokens computed and the program slots they took, padding included; the XLA
        programs this process compiled and loaded from the compilation cache)."""
        s = self.scheduler
        stats = {"num_running": s.num_running, "num_waiting": s.num_waiting, "cache_usage": s.usage}
        prefix = s.prefix_cache_stats
        stats.update(
            prefix_cache_queried_tokens=prefix.queried_tokens,
            prefix_cache_hit_tokens=prefix.hit_tokens,
            prefix_cache_hit_rate=prefix.hit_rate,
            num_preemptions=s.num_preemptions,
            prefill_tokens=self.runner.prefill_tokens[0],
            prefill_tokens_padded=self.runner.prefill_tokens[1],
        )
        pool = s.coordinator.pool  # page 0 is the null page
        stats.update(num_pages_total=pool.num_pages - 1, num_pages_used=pool.num_used)
        compiled = programs()  # this process's XLA programs: compiled, or loaded from disk
        stats.update(programs_compiled=compiled["compiled"], programs_loaded=compiled["loaded"])
        if self.connector is not None:
            stats.update(self.connector.stats(), held_requests=len(s.held))
        if self.runner.spec is not None:
            stats.update(self.runner.spec.stats())
        return stats

    def close(self) -> None:
        """Release the KV connector and what it holds (side channels, registered memory;
        idempotent). A prefill or decode engine takes no P/D request after it; a colocated
        engine has nothing to release."""
        if self.connector is not None:
            self.connector.close()
            self.connector = None
            self.kv = None
