"""LLMEngine: tokenizer + a slot-based generation loop + the model runner.

Lifecycle of a request:
  1. `add_request` tokenizes the prompt (or takes token ids) and queues it (WAITING).
  2. `step` admits waiting requests into free cache slots (up to `max_num_seqs`).
  3. A request in prefill runs one chunk of at most `max_prefill_chunk` prompt tokens per step,
     carrying conv, ssm and KV state from chunk to chunk; its last chunk samples the first token.
  4. Decoding requests advance one token per step, batched together.
  5. A request finishes on EOS, a stop token or string, `max_tokens`, or `max_model_len`; its
     slot returns to the free list, and its final `RequestOutput` is returned by `step`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from backends.protocol import load_ops
from hybridserve.config import ModelConfig
from hybridserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from hybridserve.parallel import make_mesh
from hybridserve.runner.model_runner import ModelRunner
from hybridserve.runner.sampler import sample
from hybridserve.sampling_params import SamplingParams
from hybridserve.tokenizer import Tokenizer
from hybridserve.weights.loader import load_model


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine settings. `dtype=None` keeps the checkpoint's dtype."""

    model: str
    dtype: str | None = None
    tensor_parallel_size: int = 1
    backend: str = "xla"
    max_model_len: int = 2048
    max_num_seqs: int = 8
    max_prefill_chunk: int = 256
    seed: int = 0


@dataclasses.dataclass
class _Request:
    req_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    key: jax.Array
    slot: int = -1
    num_computed: int = 0
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)


class LLMEngine:
    """Loads a model and generates for many requests at once (see the module docstring)."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        ops = load_ops(config.backend)
        self.mesh = make_mesh(config.tensor_parallel_size)
        model, self.model_config = load_model(
            config.model, ops, self.mesh, config.dtype, progress=progress
        )
        self.tokenizer = Tokenizer.maybe_load(config.model)
        cfg: ModelConfig = self.model_config
        max_len = min(config.max_model_len, cfg.max_position_embeddings)
        cache_dtype = jnp.dtype(config.dtype or cfg.dtype)
        self.runner = ModelRunner(
            model, cfg, self.mesh, config.max_num_seqs + 1, max_len, cache_dtype
        )
        self.max_model_len = max_len
        self.eos_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.free_slots = list(range(config.max_num_seqs, 0, -1))
        self._counter = 0

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, req_id: str | None = None
    ) -> str:
        """Queue a prompt (text, or token ids) and return its req_id."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{self.config.model} has no tokenizer.json: pass prompts as "
                    '{"prompt_token_ids": [...]}'
                )
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary "
                f"(size {self.model_config.vocab_size})"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        req_id = req_id if req_id is not None else str(self._counter)
        self._counter += 1
        seed = params.seed if params.seed is not None else self.config.seed + self._counter
        self.waiting.append(
            _Request(
                req_id,
                text,
                ids,
                params,
                RequestMetrics(arrival_time=time.perf_counter()),
                jax.random.key(seed),
            )
        )
        return req_id

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        """Advance every admitted request by one chunk or one token; return finished outputs."""
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop()
            self.running.append(req)
        decoding = [r for r in self.running if not r.in_prefill]
        for req in [r for r in self.running if r.in_prefill]:
            chunk = req.prompt_ids[
                req.num_computed : req.num_computed + self.config.max_prefill_chunk
            ]
            logits = self.runner.prefill(req.slot, chunk, req.num_computed)
            req.num_computed += len(chunk)
            if not req.in_prefill:
                self._append(req, int(self._sample([req], logits[None])[0]))
        if decoding:
            logits = self.runner.decode(
                [r.slot for r in decoding],
                [r.output_ids[-1] for r in decoding],
                [r.num_computed for r in decoding],
            )
            for req, tok in zip(decoding, self._sample(decoding, logits), strict=True):
                req.num_computed += 1
                self._append(req, int(tok))
        finished = [r for r in self.running if r.finish_reason is not None]
        for req in finished:
            self.running.remove(req)
            self.free_slots.append(req.slot)
            req.metrics.finished_time = time.perf_counter()
        return [self._output(r) for r in finished]

    def _sample(self, reqs: list[_Request], logits: jax.Array) -> np.ndarray:
        p = [r.params for r in reqs]
        keys = jnp.stack([jax.random.fold_in(r.key, len(r.output_ids)) for r in reqs])
        logits = jnp.asarray(logits)
        if any(r.params.min_tokens > len(r.output_ids) for r in reqs) and self.eos_ids:
            block = np.array([r.params.min_tokens > len(r.output_ids) for r in reqs])
            eos = np.array(sorted(self.eos_ids))
            logits = logits.at[np.nonzero(block)[0][:, None], eos[None, :]].set(-jnp.inf)
        return np.asarray(
            sample(
                logits,
                jnp.array([x.temperature for x in p], jnp.float32),
                jnp.array([x.top_k for x in p], jnp.int32),
                jnp.array([x.top_p for x in p], jnp.float32),
                keys,
            )
        )

    def _append(self, req: _Request, token: int) -> None:
        params = req.params
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.perf_counter()
        req.output_ids.append(token)
        if not params.ignore_eos and token in self.eos_ids:
            req.finish_reason = "stop"
        elif token in params.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
        elif len(req.output_ids) >= params.max_tokens or (
            len(req.prompt_ids) + len(req.output_ids) >= self.max_model_len
        ):
            req.finish_reason = "length"
        if params.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_ids, params.skip_special_tokens)
            for stop in params.stop:
                if stop in text:
                    req.finish_reason, req.stop_reason = "stop", stop
                    req.text = text[: text.index(stop)]
                    return

    def _output(self, req: _Request) -> RequestOutput:
        text = req.text
        if not text and self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_ids, req.params.skip_special_tokens)
        completion = CompletionOutput(
            0, text, list(req.output_ids), req.finish_reason, req.stop_reason
        )
        return RequestOutput(
            req.req_id,
            req.prompt,
            list(req.prompt_ids),
            [completion],
            finished=True,
            metrics=req.metrics,
        )
