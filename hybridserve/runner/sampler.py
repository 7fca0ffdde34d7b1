"""Token sampling (greedy, temperature, top-k, top-p, min-p; one PRNG key per row), the
repetition, frequency and presence penalties, and log-probabilities."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hybridserve.core.outputs import PENDING_TOKEN
from hybridserve.outputs import Logprob
from hybridserve.runner.request_state import RequestState

SAMPLING_DTYPES = (jnp.float32, jnp.int32, jnp.float32, jnp.float32)  # temperature, k, p, min_p


@functools.partial(jax.jit, static_argnames=("mode",))
def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    keys: jax.Array,
    mode: str = "filtered",
) -> jax.Array:
    """Pick one token per row.

    The filters apply to the temperature-scaled distribution, in the order top-k, top-p
    (smallest set of most likely tokens with mass >= top_p), min-p (tokens with probability
    >= min_p times the most likely one's).

    Args:
      logits: [B, V] float32. temperature: [B] (0 = greedy). top_k: [B] int (0 = off).
      top_p: [B] in (0, 1] (1 = off). min_p: [B] in [0, 1] (0 = off). keys: [B] PRNG keys.
      mode: "filtered" (any settings), "plain" (no row filters: no sort of the vocabulary) or
        "greedy" (every row at temperature 0: argmax alone); `sample_mode` picks it.
    Returns: [B] int32 token ids.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        return greedy
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    if mode == "filtered":
        scaled = filtered_logits(logits, temperature, top_k, top_p, min_p)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature <= 0, greedy, drawn)


def sample_mode(
    temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float]
) -> str:
    """The cheapest `sample` mode that gives the same tokens for these rows' settings."""
    if all(t <= 0 for t in temperature):
        return "greedy"
    if all(k <= 0 for k in top_k) and all(p >= 1 for p in top_p) and all(m <= 0 for m in min_p):
        return "plain"
    return "filtered"


def filtered_logits(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
) -> jax.Array:
    """The temperature-scaled logits [B, V] with the tokens that top-k, top-p and min-p filter
    out at -inf: `softmax` of this is the distribution `sample` draws from (temperature > 0)."""
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    vocab = logits.shape[-1]
    desc = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    desc = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
    keep = jnp.sum(before < top_p[:, None], axis=-1)  # >= 1
    cutoff = jnp.take_along_axis(desc, (keep - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    floor = desc[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]  # log(min_p * p_max)
    return jnp.where((min_p[:, None] > 0) & (scaled < floor), -jnp.inf, scaled)


@functools.partial(jax.jit, static_argnames=("num",))
def logprobs(
    logits: jax.Array, tokens: jax.Array, num: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of the model's distribution (before any sampling transform).

    Returns: chosen [B] (logprob of `tokens`), top ids [B, num], top logprobs [B, num], and
    the chosen tokens' ranks [B] (1 + the number of more likely tokens).
    """
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, num)
    rank = 1 + jnp.sum(lp > chosen[:, None], axis=-1)
    return chosen, top_ids.astype(jnp.int32), top_lp, rank.astype(jnp.int32)


@jax.jit
def penalize(
    logits: jax.Array,
    prompt_ids: jax.Array,
    output_ids: jax.Array,
    repetition: jax.Array,
    frequency: jax.Array,
    presence: jax.Array,
) -> jax.Array:
    """The logits [B, V] with `SamplingParams`' penalties: a token seen in the prompt or the
    output gets `l / r` (l > 0) or `l * r`; then `l - f * c - p * [c > 0]`, c its count in the
    output. `prompt_ids` [B, Lp] and `output_ids` [B, Lo] hold token ids padded with V (not a
    token: dropped); `repetition`, `frequency`, `presence` [B] (1, 0, 0: off)."""
    rows, vocab = logits.shape
    at = jnp.arange(rows)[:, None]

    def counts(ids: jax.Array) -> jax.Array:
        return jnp.zeros((rows, vocab), jnp.int32).at[at, ids].add(1, mode="drop")

    out = counts(output_ids)
    seen = (out + counts(prompt_ids)) > 0
    r = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * out - presence[:, None] * (out > 0)


def _padded(lists: list[list[int]], fill: int) -> jax.Array:
    """Token id lists as one [B, L] array, L a power of two (>= 8), padded with `fill`."""
    width = max(8, 1 << max(len(ids) for ids in lists).bit_length())
    out = np.full((len(lists), width), fill, np.int32)
    for i, ids in enumerate(lists):
        out[i, : len(ids)] = ids
    return jnp.asarray(out)


def penalty_inputs(states: list[RequestState], rows: int, vocab: int) -> tuple | None:
    """`penalize`'s arguments after the logits for `states` padded to `rows` (None when no
    request is penalised: nothing then goes to the device). Every token id must be settled
    (the engine steps one at a time while a penalised request runs)."""
    if not any(t.params.penalized for t in states):
        return None
    prompts, outputs, values = [], [], []
    for t in states:
        if t.params.penalized and PENDING_TOKEN in t.token_ids:
            raise RuntimeError(f"{t.req_id}: penalties need every token settled (none in flight)")
        if t.params.penalized:
            prompts.append(t.token_ids[: t.num_prompt_tokens])
            outputs.append(t.token_ids[t.num_prompt_tokens :])
            p = t.params
            values.append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
        else:
            prompts.append([]), outputs.append([]), values.append((1.0, 0.0, 0.0))
    pad = rows - len(states)
    prompts, outputs = prompts + [[]] * pad, outputs + [[]] * pad
    values = np.asarray(values + [(1.0, 0.0, 0.0)] * pad, np.float32).T
    return _padded(prompts, vocab), _padded(outputs, vocab), *map(jnp.asarray, values)


_fold_keys = jax.jit(jax.vmap(jax.random.fold_in))


def sample_requests(
    states: list[RequestState], logits: jax.Array
) -> tuple[np.ndarray, list[dict[int, Logprob] | None]]:
    """One token for each request in `states` from its row of `logits` (rows beyond them are
    padding: they get the first request's parameters), and each one's logprob entry
    ({token id: logprob}: the chosen token and the top `params.logprobs`; None when not asked).
    Row i draws with fold_in(key, outputs so far); a request short of `min_tokens` cannot pick
    EOS or a stop token (`RequestState.blocked_ids`)."""
    return fetch(states, *draw(states, logits))


def draw(
    states: list[RequestState], logits: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, ...] | None]:
    """`sample_requests` left on the device: the tokens [n'] (n' >= len(states): padded) and,
    when a request asks for logprobs, the arrays `fetch` makes its entries from. Nothing here
    waits for the device."""
    pad = logits.shape[0] - len(states)
    params = [t.params for t in states] + [states[0].params] * pad
    n_out = [t.num_outputs for t in states]
    for i, state in enumerate(states):  # no EOS or stop token before min_tokens
        blocked = sorted(state.blocked_ids)
        if blocked:
            logits = logits.at[i, jnp.asarray(blocked)].set(-jnp.inf)
    raw = logits  # the logprobs are the model's (before penalties), as vLLM returns them
    penalties = penalty_inputs(states, logits.shape[0], logits.shape[1])
    if penalties is not None:
        logits = penalize(logits, *penalties)
    columns = (
        [p.temperature for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
    )
    mode, keys, settings = sample_mode(*columns), None, [None] * 4
    if mode != "greedy":  # (greedy: the argmax alone, nothing else goes to the device)
        keys = _fold_keys(
            jnp.stack([t.key for t in states] + [states[0].key] * pad),
            jnp.asarray(n_out + n_out[:1] * pad, jnp.int32),
        )
        settings = [jnp.array(c, d) for c, d in zip(columns, SAMPLING_DTYPES, strict=True)]
    tokens = sample(logits, *settings, keys, mode=mode)
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    if not wanted:
        return tokens, None
    return tokens, logprobs(raw, tokens, max(max(wanted), 1))


def fetch(
    states: list[RequestState], tokens: jax.Array, lp: tuple[jax.Array, ...] | None
) -> tuple[np.ndarray, list[dict[int, Logprob] | None]]:
    """`draw`'s results on the host: the tokens of `states` and their logprob entries (the
    top `logprobs` tokens in rank order, then the chosen one)."""
    host = np.asarray(tokens)[: len(states)]
    entries: list[dict[int, Logprob] | None] = [None] * len(states)
    if lp is not None:
        chosen, top_ids, top_lp, rank = (np.asarray(a) for a in lp)
        for i, t in enumerate(states):
            if t.params.logprobs is not None:
                entry = {
                    int(top_ids[i, j]): Logprob(float(top_lp[i, j]), j + 1)
                    for j in range(t.params.logprobs)
                }
                entry[int(host[i])] = Logprob(float(chosen[i]), int(rank[i]))
                entries[i] = entry
    return host, entries
