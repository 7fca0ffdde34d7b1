"""Speculative decoding with the MTP heads (or an oracle): drafting, verification, rollback.

Lifecycle of one engine step (`LLMEngine.step` with a `SpeculativeConfig` of k tokens):
  1. The scheduler gives each decoding request that holds drafts a chunk of its last token
     followed by the drafts (`ScheduledChunk.num_drafts`); prefill chunks are unchanged.
  2. `runner.execute(out, n_logits=k + 1)` scores them in one pass: for each sampling row, the
     logits after the last token and after each draft, and every program's hidden states.
  3. `accept`: rows without drafts sample as without speculation; rows with drafts go through
     `speculative.verify` (greedy matching, or exact rejection sampling against the
     distributions the drafts were drawn from), giving the accepted drafts plus one token.
  4. The scheduler records them (`update_from_output`): only the accepted positions count as
     computed. Rollback needs no copy: the attention KV and the sconv inputs at rejected
     positions are rewritten when those positions are computed again (sconv state is cached
     per token), and no Mamba layer may be present (its state would have moved past them).
  5. `propose`: the MTP heads run over each program's rows, from the base model's hidden
     states at the accepted positions (their outputs fill the heads' own KV caches), head i
     reading the token i + 1 places ahead (the accepted tokens, then this round's proposals);
     each row's last position gives head i's draft. Greedy rows take the argmax, others draw
     from the head's filtered distribution and keep it (q) for step 3 of the next round.
     Head caches at positions whose look-ahead token was itself a draft are approximate
     (they are not recomputed when that draft is rejected): that only lowers acceptance,
     never changes the output, which step 3 makes exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hybridserve.config import ModelConfig, SpeculativeConfig
from hybridserve.core.outputs import SchedulerOutput
from hybridserve.core.request import Request, RequestStatus
from hybridserve.runner.model_runner import ModelRunner, StepLogits
from hybridserve.runner.sampler import filtered_logits
from hybridserve.runner.speculative import verify, verify_greedy
from hybridserve.sampling_params import SamplingParams


class SpecDecoder:
    """Drafts and verifies for an engine (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, cfg: ModelConfig) -> None:
        self.config, self.runner, self.k = config, runner, config.num_speculative_tokens
        if config.method == "mtp" and (cfg.mtp is None or cfg.mtp.num_heads < self.k):
            heads = 0 if cfg.mtp is None else cfg.mtp.num_heads
            raise ValueError(
                f"speculative method 'mtp' with {self.k} tokens needs as many MTP heads; "
                f"the model has {heads}"
            )
        if cfg.mamba is not None and "mamba" in cfg.layer_types:
            raise ValueError("speculative decoding cannot roll back Mamba states yet")
        self._q: dict[str, jax.Array] = {}  # req_id -> [k, V] draft distributions (0-padded)
        self._zeros: jax.Array | None = None
        self.num_drafts = self.num_accepted = self.num_steps = 0

    def accept(
        self,
        result: StepLogits,
        out: SchedulerOutput,
        keys: dict[str, jax.Array],
        params: dict[str, SamplingParams],
        sample_plain,
    ) -> dict[str, int | list[int]]:
        """Tokens per sampling request: an int for rows without drafts (drawn by
        `sample_plain(req_ids, logits)`, exactly as without speculation) or, for rows with
        drafts, the accepted drafts and one more token (a list). Every array is padded to the
        logits' power-of-two row count, so that a few shapes serve every batch."""
        chunks = {c.req_id: c for c in out.chunks}
        ids = result.req_ids
        plain = sample_plain(ids, result.logits[:, 0])
        sampled: dict[str, int | list[int]] = {
            r: int(plain[i]) for i, r in enumerate(ids) if not chunks[r].num_drafts
        }
        drafted = [i for i, r in enumerate(ids) if chunks[r].num_drafts]
        if not drafted:
            return sampled
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
        return sampled

    def _budget(self, request: Request, params: SamplingParams, max_model_len: int) -> int:
        """Drafts this request may take now (0: none)."""
        if request.status is not RequestStatus.RUNNING or params.logprobs is not None:
            return 0
        n_out = len(request.output_token_ids)
        if n_out < params.min_tokens:
            return 0  # stop tokens are masked one token at a time until then
        room = min(request.max_tokens - n_out - 1, max_model_len - request.num_tokens)
        return max(0, min(self.k, room))

    def propose(
        self,
        result: StepLogits,
        out: SchedulerOutput,
        sampled: dict[str, int | list[int]],
        requests: dict[str, Request],
        params: dict[str, SamplingParams],
        keys: dict[str, jax.Array],
        max_model_len: int,
    ) -> None:
        """Set `draft_token_ids` (and keep their distributions) on the requests of this step
        (see the module docstring); `requests` holds every request of the step's chunks."""
        want = {}
        for c in out.chunks:
            req = requests.get(c.req_id)
            if req is not None and c.sample:
                want[c.req_id] = self._budget(req, params[c.req_id], max_model_len)
        if self.config.method == "oracle":
            for r, n in want.items():
                if n:
                    drafts = [int(t) for t in self.config.oracle(requests[r].all_token_ids, n)]
                    self._set(requests[r], drafts[:n], None, params[r].temperature <= 0)
            return
        for p in result.passes:
            self._mtp_pass(p, sampled, requests, params, keys, want)

    def _mtp_pass(self, p, sampled, requests, params, keys, want) -> None:
        batch, rows = p.batch, len(p.chunks)
        lengths = np.zeros_like(batch.lengths)
        seqs, drafts = [], [[] for _ in range(rows)]
        for i, c in enumerate(p.chunks):
            got = sampled.get(c.req_id)
            accepted = len(got) - 1 if isinstance(got, list) else 0
            req = requests.get(c.req_id)
            lengths[i] = 0 if req is None else len(c.token_ids) - c.num_drafts + accepted
            seqs.append(np.asarray(req.all_token_ids if req else [], np.int32))
        starts = batch.positions[:, 0]
        valid = dataclasses.replace(batch, lengths=lengths)
        qs: dict[int, list[jax.Array]] = {i: [] for i in range(rows)}
        hidden = p.hidden
        live = [i for i, c in enumerate(p.chunks) if want.get(c.req_id)]
        rows_params = [SamplingParams(temperature=0.0)] * batch.tokens.shape[0]
        row_keys = [None] * batch.tokens.shape[0]
        for i in live:
            rows_params[i] = params[p.chunks[i].req_id]
            row_keys[i] = keys[p.chunks[i].req_id]
        greedy = all(x.temperature <= 0 for x in rows_params)
        if not greedy:
            row_keys = [k if k is not None else row_keys[live[0]] for k in row_keys]
            arrays = _param_arrays(rows_params)
        for head in range(self.k):
            tokens = self._look_ahead(head, starts, seqs, drafts, batch)
            hidden, logits = self.runner.mtp(head, hidden, tokens, valid)
            if not live:  # the heads still run: their caches cover these positions
                continue
            if greedy:  # greedy rows keep no distribution (their check ignores it)
                picked = np.asarray(_argmax(logits))
            else:
                head_keys = jnp.stack([jax.random.fold_in(k, 7919 + head) for k in row_keys])
                picked, q = _draw(logits, *arrays, head_keys)
                picked = np.asarray(picked)
            for i in live:
                drafts[i].append(int(picked[i]))
                if not greedy:
                    qs[i].append(q[i])
        for i in live:
            r = p.chunks[i].req_id
            greedy_row = params[r].temperature <= 0
            self._set(requests[r], drafts[i][: want[r]], qs[i][: want[r]], greedy_row)

    @staticmethod
    def _look_ahead(head, starts, seqs, drafts, batch) -> np.ndarray:
        """[B, T] the token head + 1 places after each position (0 past the known ones)."""
        tokens = np.zeros_like(batch.tokens)
        t = tokens.shape[1]
        for i, seq in enumerate(seqs):
            seq = np.concatenate([seq, np.asarray(drafts[i], np.int32)])
            if not len(seq):
                continue
            idx = starts[i] + np.arange(t) + head + 1
            tokens[i] = np.where(idx < len(seq), seq[np.minimum(idx, len(seq) - 1)], 0)
        return tokens

    def _set(
        self, request: Request, drafts: list[int], qs: list[jax.Array] | None, greedy: bool
    ) -> None:
        """Give `request` its drafts and keep their distributions, [k, V] zero-padded (None:
        deterministic drafts, one-hot; not kept for greedy requests, whose check ignores q)."""
        request.draft_token_ids = list(drafts)
        vocab = self.runner.cfg.vocab_size
        if greedy:
            return
        if not qs:
            padded = np.zeros(self.k, np.int32)
            padded[: len(drafts)] = drafts
            mask = (np.arange(self.k) < len(drafts))[:, None]
            q = jax.nn.one_hot(jnp.asarray(padded), vocab, dtype=jnp.float32) * mask
        else:
            q = jnp.stack(list(qs) + [jnp.zeros(vocab, jnp.float32)] * (self.k - len(qs)))
        self._q[request.req_id] = q

    def forget(self, req_id: str) -> None:
        """Drop a finished or aborted request's draft distributions."""
        self._q.pop(req_id, None)

    def stats(self) -> dict[str, float]:
        """Drafts proposed and accepted so far, and the mean tokens per verifying step."""
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_accepted": self.num_accepted,
            "spec_acceptance_rate": self.num_accepted / max(self.num_drafts, 1),
            "spec_tokens_per_step": (self.num_accepted + self.num_steps) / max(self.num_steps, 1),
        }


_argmax = jax.jit(lambda logits: jnp.argmax(logits, axis=-1))


def _param_arrays(params: list[SamplingParams]) -> tuple[jax.Array, ...]:
    return (
        jnp.asarray([p.temperature for p in params], jnp.float32),
        jnp.asarray([p.top_k for p in params], jnp.int32),
        jnp.asarray([p.top_p for p in params], jnp.float32),
        jnp.asarray([p.min_p for p in params], jnp.float32),
    )


@jax.jit
def _draw(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    keys: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Draft tokens from head logits [B, V] under each row's sampling params, and the
    distributions they were drawn from (one-hot for greedy rows)."""
    greedy = jnp.argmax(logits, axis=-1)
    scaled = filtered_logits(logits, temperature, top_k, top_p, min_p)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled)
    hot = temperature[:, None] <= 0
    picked = jnp.where(hot[:, 0], greedy, drawn)
    q = jnp.where(hot, jax.nn.one_hot(greedy, logits.shape[-1]), jax.nn.softmax(scaled, -1))
    return picked, q
