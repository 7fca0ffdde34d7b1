"""The device side: parameters, the cache regions, and the jitted forward step.

Lifecycle:
  1. `ModelRunner(...)` allocates every region once: 32-bit words `[tp, num_pages * page_rows,
     row_bytes / 4]`, sharded so that each rank owns its pages. Every layer's cache is a typed
     view of its region.
  2. `add_request` gives a request its sampling state (settings, PRNG key, tokens so far).
  3. `execute(scheduler_output)` applies the page copies (prefix-cache restores, Mamba
     snapshots), then runs the decode rows (one token each) and the prompt chunks (packed into
     rows of one segment length: `runner.packed`) as separate bucketed programs
     (`compute_logits`, `runner.logit_rows`), samples the rows that end at their last
     known token, and returns their tokens (with speculation, verified drafts; `propose` then
     gives the next drafts, which the scheduler keeps).
  4. Every program takes the regions donated and returns them updated, so their device buffers
     (and addresses, which NIXL registers) stay the same for the life of the runner.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridserve.cache.plan import CachePlan
from hybridserve.cache.regions import CacheRegions, allocate_regions, build_layout
from hybridserve.cache.view import WORD_BYTES, apply_page_copies
from hybridserve.config import ModelConfig, SpeculativeConfig
from hybridserve.core.outputs import PENDING_TOKEN, ScheduledChunk, SchedulerOutput
from hybridserve.layers.step_input import StepInput
from hybridserve.models.hybrid import HybridModel
from hybridserve.runner.draft_chain import draft_chain
from hybridserve.runner.inflight import InFlight, fill_pending, pending_slots
from hybridserve.runner.input_batch import BatchArrays, bucket, build_batch, pack_ints, unpack_ints
from hybridserve.runner.logit_rows import gather_rows
from hybridserve.runner.memory import PoolSizing
from hybridserve.runner.packed import MAX_SEGMENT, PackLimits, build_packed, split_chunks
from hybridserve.runner.programs import warmup
from hybridserve.runner.prompt_logprobs import score_chunk, taken_scores, wants_scores
from hybridserve.runner.request_state import (
    RequestStates,
    RunnerOutput,
    StepLogits,
    StepPass,
)
from hybridserve.runner.sampler import draw, fetch, sample_requests
from hybridserve.runner.scratch import ScratchLogits
from hybridserve.runner.spec_decode import SpecDecoder
from hybridserve.sampling_params import SamplingParams


class ModelRunner(ScratchLogits):
    """Runs scheduled steps of `model` over the paged hybrid cache (see the module docstring)."""

    def __init__(
        self,
        model: HybridModel,
        cfg: ModelConfig,
        plan: CachePlan,
        mesh: Mesh,
        num_pages: int,
        max_model_len: int,
        pack_limits: PackLimits | None = None,
        shareable_regions: bool = False,
    ) -> None:
        if plan.tensor_parallel_size != mesh.shape["tp"]:
            raise ValueError("the cache plan and the mesh disagree on the TP size")
        self.cfg, self.plan, self.mesh = cfg, plan, mesh
        self.num_pages, self.max_model_len = num_pages, max_model_len
        # packed prefill programs: `runner.packed` (default: steps of 8192 tokens, segments of 256)
        self.pack_limits = pack_limits or PackLimits.for_steps(8192, MAX_SEGMENT)
        self.prefill_tokens = [0, 0]  # real and computed (padded) prompt tokens so far
        self.pool_sizing: PoolSizing | None = None  # set when the pool is sized by memory
        self.layout = dataclasses.replace(build_layout(cfg, plan), mesh=mesh)
        model.prepare(mesh)  # merged projections; at TP 1 rows for the fused path
        self.graphdef, self.params = nnx.split(model)
        # the programs take the parameters as one flat list: passing the nnx.State tree costs a
        # pytree walk per call (~0.15 ms for 91 leaves on a laptop CPU, several ms for the
        # 9B shape's 557 on the GPU host)
        self._leaves, self._param_def = jax.tree.flatten(self.params)
        sharding = NamedSharding(mesh, PartitionSpec("tp", None, None))
        self._shareable = shareable_regions
        self.regions: list[jax.Array] = []
        self.resize_pool(num_pages)
        # Fixed output shardings: the regions come back exactly as they went in, so a copy
        # followed by a step (or the reverse) never looks like a new input to either program.
        regions_out = [sharding] * plan.num_regions
        replicated = NamedSharding(mesh, PartitionSpec())
        self._step = jax.jit(
            self._forward,
            donate_argnums=(1,),
            static_argnames=("shapes", "n_logits", "keep_hidden", "chained"),
            out_shardings=(replicated, regions_out),
        )
        self._replicated = replicated
        self._fill = jax.jit(fill_pending, out_shardings=replicated)
        self._chain = jax.jit(
            lambda leaves, regions, *args, k: draft_chain(self._model(leaves), regions, *args, k),
            donate_argnums=(1,),
            static_argnames=("k",),
            out_shardings=(replicated, regions_out),
        )
        self._embed_fns: dict[str, object] = {}
        self.requests = RequestStates()
        self.spec: SpecDecoder | None = None
        self._copy = jax.jit(
            apply_page_copies, donate_argnums=(0,), static_argnums=(2,), out_shardings=regions_out
        )

    def resize_pool(self, num_pages: int) -> None:
        """(Re)allocate the regions for `num_pages` pages, zeroed: at construction, or before
        the first step when the pool is sized after a profile (`runner.memory`); a connector
        must not have registered the old ones."""
        tp = self.plan.tensor_parallel_size
        sharding = NamedSharding(self.mesh, PartitionSpec("tp", None, None))
        shape = (tp, num_pages * self.layout.page_rows, self.layout.row_bytes // WORD_BYTES)
        for region in self.regions:
            region.delete()
        self.regions, self._region_owners = [], []
        self.num_pages = num_pages
        # `shareable_regions` (GPU P/D): cudaMalloc'd regions that UCX can map (cache/regions)
        self.regions, self._region_owners = allocate_regions(
            shape, self.plan.num_regions, sharding, self._shareable
        )

    @property
    def cache_bytes(self) -> int:
        """Bytes of all regions over all ranks."""
        return sum(r.nbytes for r in self.regions)

    def _model(self, leaves: list[jax.Array]) -> HybridModel:
        """The model over parameter leaves (inside a program: `_leaves` traced)."""
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._param_def, leaves))

    def _forward(
        self,
        leaves: list[jax.Array],
        regions: list,
        packed: jax.Array,
        embeds: jax.Array | None,
        embed_mask: jax.Array | None,
        shapes: tuple[tuple[int, ...], ...],
        n_logits: int | None,
        keep_hidden: bool,
        chained: bool = False,
    ) -> tuple[tuple[jax.Array, jax.Array | None], list]:
        tokens, positions, lengths, num_drafts, *tables = unpack_ints(packed, shapes)
        continues = tables.pop() if chained else None  # packed prefill: last of the ints
        # speculation (logits after the drafts) on recurrent layers: states stop before drafts
        verifies = n_logits is not None and n_logits > 1 and "mamba" in self.cfg.layer_types
        commit = lengths - num_drafts if verifies else None
        inputs = StepInput(positions, lengths, tuple(tables), self.layout, continues, commit)
        model = self._model(leaves)
        # without the hidden states, norm_f runs inside the lm_head (on the picked rows only)
        hidden, regions = model(tokens, inputs, regions, embeds, embed_mask, keep_hidden)
        picked = hidden
        one_token = n_logits == 1 and hidden.shape[1] == 1  # decode: that token, no gather
        if n_logits is not None and not one_token:  # each row's last token, then its drafts
            first = jnp.maximum(inputs.lengths - 1 - num_drafts, 0)
            idx = first[:, None] + jnp.arange(n_logits)[None, :]
            idx = jnp.clip(idx, 0, hidden.shape[1] - 1)
            picked = jnp.take_along_axis(hidden, idx[..., None], axis=1)  # [B, n, D]
        return (model.logits(picked, keep_hidden), hidden if keep_hidden else None), regions

    def embed_multimodal(self, kind: str, item: np.ndarray) -> np.ndarray:
        """One image ([H, W, C]) or waveform ([S]) -> its embeddings [n, D] (float32, host)."""
        fn = self._embed_fns.get(kind)
        if fn is None:
            method = {"image": "embed_image", "audio": "embed_audio"}[kind]
            fn = jax.jit(lambda leaves, x: getattr(self._model(leaves), method)(x))
            self._embed_fns[kind] = fn
        return np.asarray(fn(self._leaves, jnp.asarray(item, jnp.float32)), np.float32)

    def copy_pages(self, copies: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> None:
        """Apply whole-page copies (src, dst) in every region."""
        if not copies:
            return
        arr = np.zeros((bucket(len(copies)), 2), np.int32)
        arr[: len(copies)] = copies
        self.regions = self._copy(self.regions, jnp.asarray(arr), self.layout.page_rows)

    def _inputs(self, batch: BatchArrays) -> StepInput:
        return StepInput(
            positions=jnp.asarray(batch.positions),
            lengths=jnp.asarray(batch.lengths),
            tables=tuple(jnp.asarray(t) for t in batch.tables),
            layout=self.layout,
        )

    def run(
        self,
        batch: BatchArrays,
        n_logits: int | None = 1,
        keep_hidden: bool = False,
        fill: tuple[jax.Array, np.ndarray, np.ndarray] | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """One forward call. Returns logits [B, n_logits, V] of each (padded) row's last token
        before its drafts and of its drafts (`n_logits=None`: every position, [B, T, V]), and
        with `keep_hidden` the final hidden states [B, T, D]. `fill` = (device tokens, slots,
        rows): pending tokens written into the batch on the device (`inflight`)."""
        mm, ints, shapes = self._pack(batch)
        chained = batch.continues is not None
        if fill is not None:
            tokens, slots, rows = fill
            ints = self._fill(ints, tokens, jnp.asarray(slots), jnp.asarray(rows))
        (logits, hidden), self.regions = self._step(
            self._leaves,
            self.regions,
            ints,
            *mm,
            shapes=shapes,
            n_logits=n_logits,
            keep_hidden=keep_hidden,
            chained=chained,
        )
        return logits, hidden

    def _pack(self, batch: BatchArrays) -> tuple[list, jax.Array, tuple]:
        """The step program's inputs: multimodal rows, the packed integers, their shapes."""
        mm = [None if a is None else jnp.asarray(a) for a in (batch.embeds, batch.embed_mask)]
        drafts = np.zeros(batch.tokens.shape[0], np.int32)
        if batch.num_drafts is not None:
            drafts = batch.num_drafts
        chained = [] if batch.continues is None else [batch.continues]
        packed, shapes = pack_ints(
            [batch.tokens, batch.positions, batch.lengths, drafts, *batch.tables, *chained]
        )
        # committed and replicated either way: the step program sees one kind of input (an
        # uncommitted host array and a program's output would compile it twice)
        return mm, jax.device_put(packed, self._replicated), shapes

    def compile_step(self, batch: BatchArrays) -> jax.stages.Compiled:
        """The step program for `batch`'s shapes, compiled and not run (its memory analysis
        sizes the pool: `runner.memory`)."""
        mm, ints, shapes = self._pack(batch)
        lowered = self._step.lower(
            self._leaves,
            self.regions,
            ints,
            *mm,
            shapes=shapes,
            n_logits=1,
            keep_hidden=False,
            chained=batch.continues is not None,
        )
        return lowered.compile()

    def draft_chain(
        self,
        hidden: jax.Array,
        window: np.ndarray,
        known: np.ndarray,
        batch: BatchArrays,
        sampling: tuple[jax.Array, ...] | None,
        keys: jax.Array | None,
        history: tuple[jax.Array, np.ndarray, np.ndarray, np.ndarray] | None,
        k: int,
    ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """k MTP heads over `batch`'s rows in one program (`runner.draft_chain`): drafts
        [B, k], with `sampling` the distributions they were drawn from [B, k, V], and with
        `history` (states, read slots, shifts, write slots) the new history states."""
        if history is not None:
            history = (history[0], *(jnp.asarray(a) for a in history[1:]))
        (drafts, q, kept), self.regions = self._chain(
            self._leaves,
            self.regions,
            hidden,
            jnp.asarray(window),
            jnp.asarray(known),
            self._inputs(batch),
            sampling,
            keys,
            history,
            k=k,
        )
        return drafts, q, kept

    # -- requests and their tokens ----------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        token_ids: list[int],
        params: SamplingParams,
        seed: int,
        stop_ids: frozenset[int] = frozenset(),
    ) -> None:
        """Start sampling a request (`request_state`); `stop_ids` may not be sampled before
        `params.min_tokens` outputs."""
        self.requests.add(req_id, token_ids, params, seed, stop_ids)

    def remove_request(self, req_id: str) -> None:
        """Forget a finished or aborted request."""
        self.requests.remove(req_id)
        if self.spec is not None:
            self.spec.forget(req_id)

    def enable_speculation(self, config: SpeculativeConfig) -> None:
        """Verify and propose drafts from now on (`spec_decode`; ValueError when the model
        cannot)."""
        self.spec = SpecDecoder(config, self, self.cfg)

    def dispatch(self, out: SchedulerOutput, prev: InFlight | None) -> InFlight:
        """Run one scheduled step (no speculation) and draw its tokens without waiting for
        them; chunks may carry the pending tokens of `prev`, the step before (`inflight`).
        The runner records a pending token for each request that sampled; `resolve` settles
        them."""
        result = self.compute_logits(out, prev=prev)
        states = [self.requests[r] for r in result.req_ids]
        tokens, lp = draw(states, result.logits) if states else (None, None)
        positions = {s.req_id: len(s.token_ids) for s in states}
        self.requests.record({r: [PENDING_TOKEN] for r in result.req_ids})
        return InFlight(out, result.req_ids, states, tokens, lp, positions)

    def resolve(self, flight: InFlight) -> RunnerOutput:
        """The tokens of a dispatched step on the host (waits for them), settled into the
        requests that are still here."""
        if not flight.req_ids:
            return RunnerOutput({})
        host, entries = fetch(flight.states, flight.tokens, flight.logprobs)
        sampled = {r: [int(t)] for r, t in zip(flight.req_ids, host.tolist(), strict=True)}
        self.requests.settle(sampled, flight.positions)
        logprobs = {r: [e] for r, e in zip(flight.req_ids, entries, strict=True) if e}
        return RunnerOutput(sampled, logprobs, taken_scores(self.requests, sampled))

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step and sample: the new tokens of every chunk that samples (with
        speculation: its accepted drafts and one more), drawn with each request's own state."""
        if self.spec is None:
            result = self.compute_logits(out)
            if not result.req_ids:
                return RunnerOutput({})
            states = [self.requests[r] for r in result.req_ids]
            tokens, entries = sample_requests(states, result.logits)
            sampled = {r: [int(t)] for r, t in zip(result.req_ids, tokens.tolist(), strict=True)}
            logprobs = {s.req_id: [e] for s, e in zip(states, entries, strict=True) if e}
        else:
            result = self.compute_logits(out, self.spec.k + 1, self.spec.config.method == "mtp")
            sampled, logprobs = self.spec.accept(result, out, self.requests)
        self.requests.record(sampled)
        return RunnerOutput(sampled, logprobs, taken_scores(self.requests, sampled))

    def propose(self, rooms: dict[str, int]) -> dict[str, list[int]]:
        """Speculation: drafts for the requests of the last step that still run, at most
        `rooms[req_id]` each (what their max_tokens and max_model_len leave)."""
        return {} if self.spec is None else self.spec.propose(self.requests, rooms)

    # -- the forward step -------------------------------------------------------------------

    def compute_logits(
        self,
        out: SchedulerOutput,
        n_logits: int = 1,
        keep_hidden: bool = False,
        prev: InFlight | None = None,
    ) -> StepLogits:
        """Run one scheduled step; return the logits of the chunks that sample: [n, V], or with
        `n_logits` > 1 (speculative decoding) [n, n_logits, V] (the last token before the drafts,
        then the drafts); `keep_hidden`: with each program's hidden states (`StepLogits.passes`,
        for the MTP heads). Chunks that score prompt tokens (`runner.prompt_logprobs`) run
        alone with every position's logits."""
        self.copy_pages(out.page_copies)
        # decode rows: one known token, or drafts to verify (after a recurrent model's
        # accepted drafts, which it computes again: `Scheduler.recurrent`)
        decode = [c for c in out.chunks if c.num_drafts or len(c.token_ids) == 1]
        scored = [c for c in out.chunks if len(c.token_ids) > 1 and self._scores(c)]
        alone = {c.req_id for c in scored}
        prefill = [
            c
            for c in out.chunks
            if not c.num_drafts and len(c.token_ids) > 1 and c.req_id not in alone
        ]
        got: dict[str, tuple[int, int]] = {}
        sources: list[jax.Array] = []
        passes = []
        for chunks, batch in self._batches(decode, prefill, packed=not keep_hidden):
            slots = pending_slots(chunks, batch, prev)
            fill = None if slots is None else (prev.tokens, *slots)
            logits, hidden = self.run(batch, n_logits, keep_hidden=keep_hidden, fill=fill)
            if keep_hidden:
                passes.append(StepPass(chunks, batch, hidden))
            last = batch.last_rows()
            for i, c in enumerate(chunks):
                if c.sample:
                    got[c.req_id] = (len(sources), int(last[i]))
                if chunks is decode and self._scores(c):  # its one position's logits
                    score_chunk(self.requests[c.req_id], c, logits[i])
            sources.append(logits)
        for c in scored:
            logits = self.chunk_logits(c)  # [T', V]
            score_chunk(self.requests[c.req_id], c, logits)
            self.prefill_tokens[0] += len(c.token_ids)
            self.prefill_tokens[1] += logits.shape[0]
            if c.sample:
                got[c.req_id] = (len(sources), len(c.token_ids) - 1)
                sources.append(logits[:, None])
        order = [c.req_id for c in out.chunks if c.sample]
        return StepLogits(order, gather_rows(got, order, sources, n_logits == 1), passes)

    def _scores(self, chunk: ScheduledChunk) -> bool:
        return bool(self.requests.serial) and wants_scores(self.requests.get(chunk.req_id), chunk)

    def _batches(
        self, decode: list[ScheduledChunk], prefill: list[ScheduledChunk], packed: bool
    ) -> list[tuple[list[ScheduledChunk], BatchArrays]]:
        """The programs of one step, each with its chunks: the decode rows (one token each,
        with any drafts), then the prompt chunks packed into segments (`runner.packed`: one
        program, or several when the chunks need more rows or slots than `pack_limits`);
        unpacked, rows x longest chunk, when a caller needs one row per chunk (the MTP heads
        read the hidden states by chunk)."""
        out = []
        if decode:
            out.append((decode, build_batch(decode, self.plan, self.max_model_len)))
        if not prefill:
            return out
        if packed:
            for group in split_chunks(prefill, self.pack_limits):
                batch = build_packed(group, self.plan, self.max_model_len, self.pack_limits)
                out.append((group, batch))
        else:
            out.append((prefill, build_batch(prefill, self.plan, self.max_model_len, 16)))
        self.prefill_tokens[0] += sum(len(c.token_ids) for c in prefill)
        self.prefill_tokens[1] += sum(b.tokens.size for c, b in out if c is not decode)
        return out

    def warmup(self, max_num_seqs: int, max_tokens: int, progress: bool = False) -> int:
        """Compile every program `execute` can need for steps of up to `max_num_seqs` requests
        and `max_tokens` prompt tokens (`runner.programs.warmup`); returns how many."""
        return warmup(self, max_num_seqs, max_tokens, progress)

    def cache_regions(self) -> CacheRegions:
        """The cache as a KV connector registers it (`cache.regions.CacheRegions`)."""
        return CacheRegions.of(self.plan, self.cfg, self.layout, self.num_pages, self.regions)

    def region_addresses(self) -> list[list[int]]:
        """Device addresses of every region's shards (constant for the runner's life)."""
        return [
            [s.data.unsafe_buffer_pointer() for s in r.addressable_shards] for r in self.regions
        ]
