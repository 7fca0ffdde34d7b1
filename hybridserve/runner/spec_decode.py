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
from hybridserve.runner.speculative import verify
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
        self._q: dict[str, jax.Array] = {}  # req_id -> [n, V] draft distributions
        self.num_drafts = self.num_accepted = self.num_steps = 0

    def accept(
        self,
        result: StepLogits,
        out: SchedulerOutput,
        keys: dict[str, jax.Array],
        params: dict[str, SamplingParams],
        sample_plain,
    ) -> dict[str, int | list[int]]:
        """Tokens per sampling request: an int (no drafts: `sample_plain(req_ids, logits)`)
        or the accepted drafts and one more token (a list)."""
        chunks = {c.req_id: c for c in out.chunks}
        plain = [i for i, r in enumerate(result.req_ids) if not chunks[r].num_drafts]
        drafted = [i for i, r in enumerate(result.req_ids) if chunks[r].num_drafts]
        sampled: dict[str, int | list[int]] = {}
        if plain:
            ids = [result.req_ids[i] for i in plain]
            tokens = sample_plain(ids, result.logits[jnp.asarray(plain), 0])
            sampled.update(zip(ids, (int(t) for t in tokens), strict=True))
        if drafted:
            ids = [result.req_ids[i] for i in drafted]
            vocab = result.logits.shape[-1]
            drafts = np.zeros((len(ids), self.k), np.int32)
            probs = []
            for j, r in enumerate(ids):
                c = chunks[r]
                drafts[j, : c.num_drafts] = c.token_ids[-c.num_drafts :]
                q = self._q.pop(r, None)
                q = jnp.zeros((0, vocab)) if q is None else q[: c.num_drafts]
                probs.append(jnp.pad(q, ((0, self.k - q.shape[0]), (0, 0))))
            p = [params[r] for r in ids]
            tokens, emitted = verify(
                jnp.asarray(drafts),
                jnp.stack(probs),
                jnp.asarray([chunks[r].num_drafts for r in ids], jnp.int32),
                result.logits[jnp.asarray(drafted)],
                jnp.asarray([x.temperature for x in p], jnp.float32),
                jnp.asarray([x.top_k for x in p], jnp.int32),
                jnp.asarray([x.top_p for x in p], jnp.float32),
                jnp.asarray([x.min_p for x in p], jnp.float32),
                jnp.stack([keys[r] for r in ids]),
            )
            tokens, emitted = np.asarray(tokens), np.asarray(emitted)
            for j, r in enumerate(ids):
                sampled[r] = tokens[j, : emitted[j]].tolist()
                self.num_drafts += chunks[r].num_drafts
                self.num_accepted += int(emitted[j]) - 1
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
                    self._set(requests[r], drafts[:n], None)
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
        hidden, t = p.hidden, batch.tokens.shape[1]
        live = [i for i, c in enumerate(p.chunks) if want.get(c.req_id)]
        for head in range(self.k):
            tokens = np.zeros_like(batch.tokens)
            for i in range(rows):
                seq = np.concatenate([seqs[i], np.asarray(drafts[i], np.int32)])
                idx = starts[i] + np.arange(t) + head + 1
                tokens[i] = np.where(idx < len(seq), seq[np.minimum(idx, len(seq) - 1)], 0)
            hidden, logits = self.runner.mtp(head, hidden, tokens, valid)
            if not live:
                continue
            ids = [p.chunks[i].req_id for i in live]
            picked, q = _draw(logits[jnp.asarray(live)], [params[r] for r in ids],
                              [jax.random.fold_in(keys[r], 7919 + head) for r in ids])  # fmt: skip
            for j, i in enumerate(live):
                drafts[i].append(int(picked[j]))
                if q is not None:
                    qs[i].append(q[j])
        for i in live:
            r = p.chunks[i].req_id
            n = want[r]
            self._set(requests[r], drafts[i][:n], jnp.stack(qs[i][:n]) if qs[i] else None)

    def _set(self, request: Request, drafts: list[int], q: jax.Array | None) -> None:
        request.draft_token_ids = list(drafts)
        if q is None:  # deterministic drafts: one-hot distributions
            vocab = self.runner.cfg.vocab_size
            q = jax.nn.one_hot(jnp.asarray(drafts, jnp.int32), vocab, dtype=jnp.float32)
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


def _draw(
    logits: jax.Array, params: list[SamplingParams], keys: list[jax.Array]
) -> tuple[np.ndarray, jax.Array | None]:
    """Draft tokens from head logits [n, V] under each row's sampling params, and the
    distributions they were drawn from (None when every row is greedy)."""
    temp = jnp.asarray([p.temperature for p in params], jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    if all(p.temperature <= 0 for p in params):
        return np.asarray(greedy), None
    scaled = filtered_logits(
        logits,
        temp,
        jnp.asarray([p.top_k for p in params], jnp.int32),
        jnp.asarray([p.top_p for p in params], jnp.float32),
        jnp.asarray([p.min_p for p in params], jnp.float32),
    )
    drawn = jax.vmap(jax.random.categorical)(jnp.stack(keys), scaled)
    picked = jnp.where(temp <= 0, greedy, drawn)
    q = jnp.where((temp <= 0)[:, None], jax.nn.one_hot(greedy, logits.shape[-1]),
                  jax.nn.softmax(scaled, axis=-1))  # fmt: skip
    return np.asarray(picked), q
