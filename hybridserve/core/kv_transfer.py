"""The scheduler side of P/D: an engine's requests between its scheduler and its connector.

`LLMEngine` only calls this object (`admit`, `abort`, `poll`, `finished`, `release`); the
transport is the `core.connector.KVConnector` it drives. Plain Python, no jax.

Prefill side, lifecycle of a request asked with `{"do_remote_decode": True}`:
  1. `prepare` and `admit` queue it to compute its prompt but the last token (a state-space
     layer cannot apply that token twice; the decode side computes it), one step, no stop
     tokens, and the scheduler holds its pages when it finishes.
  2. `finished` hands the held block tables to `connector.request_finished`: the parameters
     the decode side needs go out in the request's output.
  3. Each `poll` frees the held pages of requests the connector released (read, written, given
     up, lease over); `release` frees them at once on a client's word.
Decode side, lifecycle of a request whose prompt another engine computed:
  1. `parse` (at `add_request`, so a bad or forged request fails there) and `admit`: the
     request waits for its producer, pages and a seat, until now + `wait_timeout_s`.
  2. Each `poll` reports finished transfers to the scheduler (a request whose transfer
     succeeded runs from the transferred position; one that failed recomputes locally or
     fails, per `failure_policy`), then, for each waiting request whose producer is reachable
     (never blocking), gives it its pages (`Scheduler.add_remote_request`: the colocated
     engine's pages at the first decode step, less a decode-side prefix hit) and starts its
     transfer while pages last. A request whose producer cannot be reached, or still waiting
     past its deadline, is given up the same way. Heartbeats renew the producers' holds.
  3. `abort`: a waiting request is dropped at once; one whose pages are being written is
     aborted when its transfer ends (its pages must not be reused before).
Whenever the decode side gives a request up, the producer is told (`give_up`) so that it frees
its pages now instead of at the end of its hold.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from hybridserve.core.connector import KVConnector, KVTransferParams
from hybridserve.core.request import Request
from hybridserve.core.scheduler import Scheduler


@dataclasses.dataclass
class _Waiting:
    request: Request  # not yet in the scheduler
    params: KVTransferParams
    deadline: float

    @property
    def req_id(self) -> str:
        return self.request.req_id


class KVTransfers:
    """The P/D requests of one engine (module docstring). `give_up(req_id, reason)` ends a
    decode-side request that failed for good (policy "fail"): the engine reports it."""

    def __init__(
        self, connector: KVConnector, scheduler: Scheduler, give_up: Callable[[str, str], None]
    ) -> None:
        self.connector = connector
        self.scheduler = scheduler
        self.give_up = give_up
        self.config = connector.config
        self.waiting: list[_Waiting] = []
        self.params: dict[str, KVTransferParams] = {}  # decode side: req_id -> its parameters
        self.producing: set[str] = set()  # prefill side: requests whose pages will be held
        self._abort_after: set[str] = set()  # aborted while its pages are being written

    def __bool__(self) -> bool:
        return bool(self.waiting)

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing in flight in the connector (P/D engines poll slowly)."""
        return not self.waiting and self.connector.idle

    # -- admission --------------------------------------------------------------------------

    def parse(self, raw: Any, token_ids: list[int]) -> KVTransferParams | None:
        """A request's `kv_transfer_params` (ValueError, or a `ValueError` subclass such as
        NIXL's Forbidden when forged): `{"do_remote_decode": True}` on a prefill engine,
        another engine's output parameters (they name `block_tables`) on a decode engine;
        None for anything else (the request runs locally)."""
        if not isinstance(raw, dict):
            raise ValueError("kv_transfer_params must be an object")
        if raw.get("do_remote_decode"):
            if not self.config.is_producer:
                raise ValueError("do_remote_decode needs a kv_producer (or kv_both) engine")
            return KVTransferParams(do_remote_decode=True)
        if "block_tables" not in raw:
            return None
        if not self.config.is_consumer:
            raise ValueError("remote prefill parameters need a kv_consumer (or kv_both) engine")
        return self.connector.parse_params(raw, token_ids)

    @staticmethod
    def nothing_to_transfer(params: KVTransferParams, token_ids: list[int]) -> bool:
        """A prefill request of one token: the decode side computes it all, so the caller
        answers it at once (and does not `admit` it)."""
        return params.do_remote_decode and len(token_ids) < 2

    def prepare(self, request: Request, params: KVTransferParams) -> None:
        """Reshape a prefill request before anyone sees it (module docstring, prefill step 1):
        its prompt but the last token, one step, no stop tokens, its pages held at the end."""
        if params.do_remote_decode:
            request.prompt_token_ids = request.prompt_token_ids[:-1]
            request.max_tokens, request.min_tokens = 1, 0
            request.eos_token_ids = request.stop_token_ids = frozenset()
            request.hold_pages = True

    def admit(self, request: Request, params: KVTransferParams) -> None:
        """Queue a P/D request (`prepare`d; module docstring, step 1 of either side); the
        caller tracks it first (a decode-side request may be given up at once)."""
        if params.do_remote_decode:
            self.producing.add(request.req_id)
            self.scheduler.add_request(request)
            return
        deadline = time.monotonic() + self.config.wait_timeout_s
        self.waiting.append(_Waiting(request, params, deadline))
        self.params[request.req_id] = params
        self._start()

    def finished(self, request: Request) -> dict[str, Any] | None:
        """A request ended: the decode side's parameters when it was a prefill request whose
        pages are now held (None otherwise)."""
        if request.req_id not in self.producing:
            return None
        self.producing.discard(request.req_id)
        if request.req_id not in self.scheduler.held:
            return None  # aborted or failed: nothing is held
        tables = self.scheduler.held_tables(request.req_id)
        return self.connector.request_finished(
            request.req_id, tables, list(request.prompt_token_ids)
        )

    def abort(self, req_id: str) -> bool:
        """Abort a request this object still owns (waiting for pages, or for its transfer);
        False when the scheduler owns it."""
        self.producing.discard(req_id)
        if any(w.req_id == req_id for w in self.waiting):
            self.waiting = [w for w in self.waiting if w.req_id != req_id]
            self.connector.give_up(self.params.pop(req_id))
            return True
        if self.connector.loading(req_id):
            self._abort_after.add(req_id)  # its pages are being written: free them later
            return True
        return False

    def release(self, raw: Any) -> bool:
        """Prefill side: free the held pages named by parameters this engine returned."""
        if not self.config.is_producer:
            return False
        req_id = self.connector.release(raw)
        return req_id is not None and self.scheduler.release_held(req_id)

    # -- each step --------------------------------------------------------------------------

    def poll(self) -> None:
        """Advance every P/D request (module docstring, step 3 / step 2)."""
        for req_id in self.connector.released():
            self.scheduler.release_held(req_id)
        if not self.config.is_consumer:
            return
        for req_id, ok, reason in self.connector.finished_loads():
            params = self.params.pop(req_id, None)
            if req_id in self._abort_after:
                self._abort_after.discard(req_id)
                self.scheduler.finish_remote_kv(req_id, ok=False)
                self.scheduler.abort_request(req_id)
                if not ok and params is not None:
                    self.connector.give_up(params)
            elif ok:
                self.scheduler.finish_remote_kv(req_id, ok=True)
            else:
                self._failed(req_id, reason or "transfer failed", params)
        self._start()
        self.connector.keep_alive([w.params for w in self.waiting])

    def _start(self) -> None:
        """Give waiting requests pages and start their transfers, while pages last; give up
        those past their deadline."""
        now, still = time.monotonic(), []
        for w in self.waiting:
            try:
                peer = self.connector.lookup_peer(w.params)
                slots = None
                if peer is not None:
                    slots = self.scheduler.add_remote_request(w.request, w.params.num_tokens)
            except Exception as err:  # the producer is unreachable, or the scheduler refused
                self.connector.count_failure()
                self._failed(
                    w.req_id,
                    f"cannot reach the producer: {err}",
                    self.params.pop(w.req_id),
                    w.request,
                )
                continue
            if slots is None:
                if now <= w.deadline:
                    still.append(w)
                    continue
                self.connector.count_failure()
                self._failed(
                    w.req_id,
                    f"no producer handshake, cache pages or seat for its transferred KV "
                    f"within {self.config.wait_timeout_s:g} s (wait_timeout_s)",
                    self.params.pop(w.req_id),
                    w.request,
                )
                continue
            try:
                self.connector.start_load(w.req_id, w.params, slots, peer)
            except Exception as err:  # the transport, or parameters that fit no layout
                self.connector.count_failure()
                self._failed(
                    w.req_id, f"cannot start the transfer: {err}", self.params.pop(w.req_id)
                )
        self.waiting = still

    def _failed(
        self,
        req_id: str,
        reason: str,
        params: KVTransferParams | None,
        request: Request | None = None,
    ) -> None:
        """The request will not get its KV: tell the producer, then recompute it locally or
        end it with `reason` (policy "fail"). `request`: one the scheduler never saw."""
        if params is not None:
            self.connector.give_up(params)
        if request is None:
            self.scheduler.finish_remote_kv(req_id, ok=False)  # frees; queued first
        elif self.config.failure_policy == "recompute":
            self.scheduler.add_request(request)
        if self.config.failure_policy == "recompute":
            return
        if request is None:
            self.scheduler.finish_request(req_id, "abort", stop_reason=reason)
        else:
            request.finish("abort", reason)
        self.give_up(req_id, reason)
