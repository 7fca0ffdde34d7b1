"""Speculative decoding with the MTP heads (or an oracle): drafting, verification, rollback.

Lifecycle of one engine step (`LLMEngine.step` with a `SpeculativeConfig` of k tokens):
  1. The scheduler gives each decoding request that holds drafts a chunk of its last token
     followed by the drafts (`ScheduledChunk.num_drafts`); prefill chunks are unchanged.
  2. `ModelRunner.execute` scores them in one pass (`compute_logits(out, n_logits=k + 1)`):
     for each sampling row, the logits after the last token and after each draft, and every
     program's hidden states.
  3. `accept`: rows without drafts sample as without speculation; rows with drafts go through
     `speculative.verify` (greedy matching, or exact rejection sampling against the
     distributions the drafts were drawn from), giving the accepted drafts plus one token.
  4. The scheduler records them (`update_from_output`): only the accepted positions count as
     computed. Rollback needs no copy: the attention KV and the sconv inputs at rejected
     positions are rewritten when those positions are computed again (sconv state is cached
     per token). A Mamba layer's state cannot be rewound, so there the step keeps the state
     from before the drafts (`StepInput.commit`), no draft counts as computed, and the next
     step's chunk computes the accepted drafts again ahead of its own drafts.
  5. `propose` (`ModelRunner.propose(rooms)`, for the requests still running, each with the
     room its max_tokens and max_model_len leave): per program of the step, one device
     program runs the whole chain of k heads over its rows (`runner.draft_chain`: each head's
     block, lm_head and draw, the drafts fed forward on the device), from the base model's
     hidden states at the accepted positions; their outputs fill the heads' own KV caches.
     Head i reads the token i + 1 places ahead (the accepted tokens, then this round's
     proposals); each row's last position gives head i's draft. Greedy rows take the argmax,
     others draw from the head's filtered distribution and keep it (q) for step 3 of the next
     round. The drafts go back to the engine, and the scheduler keeps them for the next step.
     Head caches at positions whose look-ahead token was a draft are guesses: each row
     starts k - 1 positions early, from the base states the chain keeps per request (its
     history slot), and recomputes them with the tokens now known. A wrong guess would only
     lower acceptance, never change the output, which step 3 makes exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hybridserve.config import ModelConfig, SpeculativeConfig
from hybridserve.core.outputs import SchedulerOutput
from hybridserve.outputs import Logprob
from hybridserve.runner.ngram import ngram_drafts
from hybridserve.runner.request_state import RequestState, RequestStates, StepLogits
from hybridserve.runner.sampler import sample_requests
from hybridserve.runner.speculative import verify, verify_greedy
from hybridserve.sampling_params import SamplingParams


class SpecDecoder:
    """Drafts and verifies for an engine (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, runner: Any, cfg: ModelConfig) -> None:
        """`runner`: the `ModelRunner` whose `mtp(head, ...)` runs the heads."""
        self.config, self.runner, self.k = config, runner, config.num_speculative_tokens
        if config.method == "mtp" and (cfg.mtp is None or cfg.mtp.num_heads < self.k):
            heads = 0 if cfg.mtp is None else cfg.mtp.num_heads
            raise ValueError(
                f"speculative method 'mtp' with {self.k} tokens needs as many MTP heads; "
                f"the model has {heads}"
            )
        self._q: dict[str, jax.Array] = {}  # req_id -> [k, V] draft distributions (`_set`)
        self._zeros: jax.Array | None = None
        self.num_drafts = self.num_accepted = self.num_steps = 0
        self._last: tuple | None = None  # (result, out, sampled, keys) of the last step
        # the base model's last k - 1 hidden states per request (`draft_chain`)
        self._hist: jax.Array | None = None  # [S, k - 1, D]
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._history: dict[str, tuple[int, int]] = {}  # req_id -> positions [begin, end) held

    def accept(
        self, result: StepLogits, out: SchedulerOutput, states: RequestStates
    ) -> tuple[dict[str, list[int]], dict[str, list[dict[int, Logprob]]]]:
        """Tokens per sampling request: for rows without drafts one token (drawn exactly as
        without speculation, `sample_requests`, with its logprob entry when asked), for rows
        with drafts the accepted drafts and one more token. Every array is padded to the
        logits' power-of-two row count, so that a few shapes serve every batch."""
        chunks = {c.req_id: c for c in out.chunks}
        ids = result.req_ids
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[dict[int, Logprob]]] = {}
        if not ids:
            self._last = (result, out, sampled, {})
            return sampled, logprobs
        rows_states = [states[r] for r in ids]
        keys = {s.req_id: jax.random.fold_in(s.key, s.num_outputs) for s in rows_states}
        params = {s.req_id: s.params for s in rows_states}
        self._last = (result, out, sampled, keys)
        plain, entries = sample_requests(rows_states, result.logits[:, 0])
        for i, r in enumerate(ids):
            if not chunks[r].num_drafts:
                sampled[r] = [int(plain[i])]
                if entries[i]:
                    logprobs[r] = [entries[i]]
        drafted = [i for i, r in enumerate(ids) if chunks[r].num_drafts]
        if not drafted:
            return sampled, logprobs
        rows, vocab = result.logits.shape[0], result.logits.shape[-1]
        if self._zeros is None:
            self._zeros = jnp.zeros((self.k, vocab), jnp.float32)
        drafts = np.zeros((rows, self.k), np.int32)
        num = np.zeros(rows, np.int32)
        probs = [self._zeros] * rows
        for i in drafted:
            c = chunks[ids[i]]
            num[i] = c.num_drafts
            drafts[i, : c.num_drafts] = c.token_ids[-c.num_drafts :]
            q = self._q.pop(ids[i], None)
            probs[i] = self._zeros if q is None else q
        p = [params[r] for r in ids] + [params[ids[0]]] * (rows - len(ids))
        row_keys = [keys[r] for r in ids]
        if all(x.temperature <= 0 for x in p):
            tokens, emitted = verify_greedy(jnp.asarray(drafts), jnp.asarray(num), result.logits)
        else:
            tokens, emitted = verify(
                jnp.asarray(drafts),
                jnp.stack(probs),
                jnp.asarray(num),
                result.logits,
                *_param_arrays(p),
                jnp.stack(row_keys + row_keys[:1] * (rows - len(ids))),
            )
        tokens, emitted = np.asarray(tokens), np.asarray(emitted)
        for i in drafted:
            sampled[ids[i]] = tokens[i, : emitted[i]].tolist()
            self.num_drafts += int(num[i])
            self.num_accepted += int(emitted[i]) - 1
            self.num_steps += 1
        return sampled, logprobs

    def _budget(self, state: RequestState, room: int) -> int:
        """Drafts this request may take now (0: none); `room`: what max_tokens and
        max_model_len leave it after the next token."""
        params = state.params
        if params.logprobs is not None or state.num_outputs < params.min_tokens:
            return 0  # stop tokens are masked one token at a time until min_tokens
        return max(0, min(self.k, room))

    def propose(self, states: RequestStates, rooms: dict[str, int]) -> dict[str, list[int]]:
        """Drafts (and their kept distributions) for the requests of the last step that still
        run (`rooms`: req_id -> room; see the module docstring, step 5). Rows of requests
        that ended still run the heads (their caches cover those positions)."""
        if self._last is None:
            return {}
        result, out, sampled, keys = self._last
        self._last = None
        live = {c.req_id: states.get(c.req_id) for c in out.chunks}
        requests = {r: s for r, s in live.items() if s is not None}
        params = {r: s.params for r, s in requests.items()}
        want = {}
        for c in out.chunks:
            state = requests.get(c.req_id)
            if state is not None and c.sample:
                room = rooms.get(c.req_id)
                want[c.req_id] = 0 if room is None else self._budget(state, room)
        self._drafts: dict[str, list[int]] = {}
        if self.config.method in ("oracle", "ngram"):
            for r, n in want.items():
                if n:
                    drafts = [int(t) for t in self._lookup(requests[r].token_ids, n)]
                    if drafts:
                        self._set(r, drafts[:n], None, params[r].temperature <= 0)
            return self._drafts
        for p in result.passes:
            self._mtp_pass(p, sampled, requests, params, keys, want)
        return self._drafts

    def _lookup(self, token_ids: list[int], n: int) -> list[int]:
        """Drafts of the host-side methods: the oracle's, or prompt lookup's (`runner.ngram`)."""
        c = self.config
        if c.method == "oracle":
            return c.oracle(token_ids, n)
        return ngram_drafts(token_ids, n, c.prompt_lookup_min, c.prompt_lookup_max)

    def _mtp_pass(self, p, sampled, requests, params, keys, want) -> None:
        """The draft chain over one program's rows (`runner.draft_chain`). Each row starts
        s <= k - 1 positions early where the history holds its states there (see
        `draft_chain`); its window holds its tokens from that position on (the accepted drafts
        and the token sampled after them included), then room for the k drafts."""
        batch, k = p.batch, self.k
        m = k - 1
        n_rows, span = batch.tokens.shape[0], batch.tokens.shape[1] + m
        lengths = np.zeros(n_rows, np.int32)
        positions = np.zeros((n_rows, span), np.int32)
        window = np.zeros((n_rows, span + k + 1), np.int32)
        known = np.zeros(n_rows, np.int32)
        starts = batch.positions[:, 0]
        last_row = {c.req_id: i for i, c in enumerate(p.chunks)}
        first_row = {c.req_id: i for i, c in reversed(list(enumerate(p.chunks)))}
        if m:
            self._states(p.hidden)
        read = np.full(n_rows, -1, np.int32)
        write = read.copy()
        shift = np.zeros(n_rows, np.int32)
        for i, c in enumerate(p.chunks):
            req = requests.get(c.req_id)
            if req is None:
                continue
            got = sampled.get(c.req_id)
            accepted = len(got) - 1 if got and c.num_drafts else 0
            start = int(starts[i])
            slot = self._slots.get(c.req_id)
            if m and slot is not None and first_row[c.req_id] == i:
                begin, end = self._history.get(c.req_id, (start, -1))
                if end == start:
                    shift[i] = min(m, start - begin)
                    read[i] = slot
            begin = start - int(shift[i])
            lengths[i] = shift[i] + len(c.token_ids) - c.num_drafts + accepted
            positions[i] = begin + np.arange(span)
            seq = np.asarray(req.token_ids[begin : begin + span + k + 1], np.int32)
            window[i, : len(seq)] = seq
            known[i] = len(seq)
            if m and last_row[c.req_id] == i and lengths[i] > 0:
                write[i] = self._slot(c.req_id)
                self._history[c.req_id] = (begin, begin + int(lengths[i]))
        ext = dataclasses.replace(
            batch, tokens=np.zeros_like(positions), positions=positions, lengths=lengths
        )
        live = [i for i, c in enumerate(p.chunks) if want.get(c.req_id)]
        rows_params = [SamplingParams(temperature=0.0)] * n_rows
        for i in live:
            rows_params[i] = params[p.chunks[i].req_id]
        sampling = row_keys = None
        if any(x.temperature > 0 for x in rows_params):
            sampling = _param_arrays(rows_params)
            first = keys[p.chunks[live[0]].req_id]
            by_row = {i: keys[p.chunks[i].req_id] for i in live}
            row_keys = jnp.stack([by_row.get(i, first) for i in range(n_rows)])
        none = self._capacity()  # out of range: no slot read or written
        read, write = np.where(read < 0, none, read), np.where(write < 0, none, write)
        history = (self._hist, read, shift, write) if m else None
        drafts, q, kept = self.runner.draft_chain(
            p.hidden, window, known, ext, sampling, row_keys, history, k
        )
        if kept is not None:
            self._hist = kept
        if not live:  # the heads still ran: their caches cover these positions
            return
        drafts = np.asarray(drafts)
        for i in live:
            r = p.chunks[i].req_id
            n = want[r]
            q_r = None if q is None or params[r].temperature <= 0 else q[i]  # one slice
            self._set(r, drafts[i, :n].tolist(), q_r, params[r].temperature <= 0)

    # -- the hidden-state history (`draft_chain`) -------------------------------------------

    def _capacity(self) -> int:
        return 0 if self._hist is None else self._hist.shape[0]

    def _states(self, hidden: jax.Array) -> jax.Array:
        if self._hist is None:
            self._hist = jnp.zeros((8, self.k - 1, hidden.shape[-1]), hidden.dtype)
            self._free = list(range(7, -1, -1))
        return self._hist

    def _slot(self, req_id: str) -> int:
        """The history slot of `req_id` (taken on first use; the history doubles when full)."""
        slot = self._slots.get(req_id)
        if slot is None:
            if not self._free:
                old = self._capacity()
                grown = max(8, 2 * old)
                pad = jnp.zeros((grown - old, *self._hist.shape[1:]), self._hist.dtype)
                self._hist = jnp.concatenate([self._hist, pad])
                self._free = list(range(grown - 1, old - 1, -1))
            slot = self._slots[req_id] = self._free.pop()
        return slot

    def _set(self, req_id: str, drafts: list[int], q: jax.Array | None, greedy: bool) -> None:
        """Propose `drafts` for `req_id` and keep their distributions `q` [k, V] (the rows
        past the drafts are ignored by `verify`; None: deterministic drafts, one-hot, the rest
        zeros). Not kept for greedy requests, whose check ignores q."""
        self._drafts[req_id] = list(drafts)
        if greedy:
            return
        if q is None:
            padded = np.zeros(self.k, np.int32)
            padded[: len(drafts)] = drafts
            mask = (np.arange(self.k) < len(drafts))[:, None]
            vocab = self.runner.cfg.vocab_size
            q = jax.nn.one_hot(jnp.asarray(padded), vocab, dtype=jnp.float32) * mask
        self._q[req_id] = q

    def forget(self, req_id: str) -> None:
        """Drop a finished or aborted request's draft distributions and history slot."""
        self._q.pop(req_id, None)
        self._history.pop(req_id, None)
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def stats(self) -> dict[str, float]:
        """Drafts proposed and accepted so far, and the mean tokens per verifying step."""
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_accepted": self.num_accepted,
            "spec_acceptance_rate": self.num_accepted / max(self.num_drafts, 1),
            "spec_tokens_per_step": (self.num_accepted + self.num_steps) / max(self.num_steps, 1),
        }


def _param_arrays(params: list[SamplingParams]) -> tuple[jax.Array, ...]:
    return (
        jnp.asarray([p.temperature for p in params], jnp.float32),
        jnp.asarray([p.top_k for p in params], jnp.int32),
        jnp.asarray([p.top_p for p in params], jnp.float32),
        jnp.asarray([p.min_p for p in params], jnp.float32),
    )
