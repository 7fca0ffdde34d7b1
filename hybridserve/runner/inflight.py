"""A dispatched step whose sampled tokens are still on the device (overlapped steps).

`ModelRunner.dispatch` runs a step and draws its tokens without waiting for them; the next
step may be scheduled and dispatched before they reach the host. Its chunks then carry
`PENDING_TOKEN` where a request's newest token belongs: `pending_slots` finds those slots in
the batch and `fill_pending` writes the tokens there on the device, from the step before's
token array, before the forward reads them. `ModelRunner.resolve` fetches the tokens (the
device has the next step queued behind them, so it does not idle) and settles the runner's
copies of the pending tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from hybridserve.core.outputs import PENDING_TOKEN, ScheduledChunk, SchedulerOutput
from hybridserve.runner.input_batch import BatchArrays, bucket
from hybridserve.runner.request_state import RequestState


@dataclasses.dataclass
class InFlight:
    """One dispatched step: its output, the requests that sample in it (token row order) with
    their states as they sampled, the tokens ([n'] on the device) and logprob arrays (None
    when no request asked), and where each request's pending token sits in its token ids."""

    out: SchedulerOutput
    req_ids: list[str]
    states: list[RequestState]
    tokens: jax.Array | None
    logprobs: tuple[jax.Array, ...] | None
    positions: dict[str, int]
    rows: dict[str, int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.rows = {r: i for i, r in enumerate(self.req_ids)}


def pending_slots(
    chunks: list[ScheduledChunk], batch: BatchArrays, prev: InFlight | None
) -> tuple[np.ndarray, np.ndarray] | None:
    """The flat token slots of `batch` that hold `PENDING_TOKEN` and the rows of `prev.tokens`
    their tokens come from, each padded to a power of two (slots past the end: dropped); None
    when there are none."""
    tokens = batch.tokens
    flat = np.flatnonzero(tokens.reshape(-1) == PENDING_TOKEN)
    if flat.size == 0:
        return None
    if prev is None or prev.tokens is None:
        raise RuntimeError("a chunk carries a pending token but no step is in flight")
    width, owners = tokens.shape[1], batch.chunk_rows()
    src = np.array([prev.rows[chunks[owners[i // width]].req_id] for i in flat], np.int32)
    n = bucket(flat.size)
    slots = np.full(n, np.iinfo(np.int32).max, np.int32)  # out of bounds: dropped
    slots[: flat.size] = flat
    rows = np.zeros(n, np.int32)
    rows[: src.size] = src
    return slots, rows


def fill_pending(
    packed: jax.Array, tokens: jax.Array, slots: jax.Array, rows: jax.Array
) -> jax.Array:
    """`packed` (the step's ints, its tokens first) with `tokens[rows]` at `slots` (the runner
    jits it with the step's input sharding)."""
    return packed.at[slots].set(tokens[rows], mode="drop")
