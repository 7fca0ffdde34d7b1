"""An engine's P/D requests between its scheduler and its connector.

Decode side, lifecycle of a request whose prompt another engine computed:
  1. `Consumer.accept_params` (at `add_request`, so a bad or forged request fails there)
     and `add`: the request waits for its producer's handshake, pages and a seat, until now +
     `wait_timeout_s`.
  2. Each `poll` (every engine step) first releases the prefill side's held pages that were
     read or whose lease ended, then reports finished transfers to the scheduler (a request
     whose transfer succeeded runs from the transferred position; one that failed recomputes
     locally or fails, per `failure_policy`), then, for each waiting request whose producer is
     handshaken (`connector.consumer.peer_for`, never blocking), gives it its pages
     (`Scheduler.add_remote_request`: the colocated engine's pages at the first decode step,
     less a decode-side prefix hit) and starts its transfer while pages last. A request whose
     handshake failed, or still waiting past its deadline, is given up the same way.
     Heartbeats (`keep`) renew the producer's leases of the requests still waiting.
  3. `abort`: a waiting request is dropped at once; one whose pages are being written is
     aborted when its transfer ends (its pages must not be reused before).
Whenever the decode side gives a request up, the producer is told (`release`) so that it frees
its pages now instead of at the end of the lease.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from hybridserve.core.scheduler import Scheduler
from hybridserve.disagg.params import TransferParams


@dataclasses.dataclass
class _Waiting:
    request: Any  # the core Request, not yet in the scheduler
    params: TransferParams
    deadline: float

    @property
    def req_id(self) -> str:
        return self.request.req_id


class RemoteRequests:
    """The P/D requests of one engine (module docstring). `give_up(req_id, reason)` ends a
    decode-side request that failed for good (policy "fail"): the engine reports it."""

    def __init__(
        self, connector: Any, scheduler: Scheduler, give_up: Callable[[str, str], None]
    ) -> None:
        self.connector = connector
        self.scheduler = scheduler
        self.give_up = give_up
        self.config = connector.config
        self.waiting: list[_Waiting] = []
        self.params: dict[str, TransferParams] = {}  # req_id -> its producer's parameters
        self._abort_after: set[str] = set()  # aborted while its pages are being written

    def __bool__(self) -> bool:
        return bool(self.waiting)

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing in flight in the connector (P/D engines poll slowly)."""
        return not self.waiting and self.connector.idle

    def add(self, request: Any, params: TransferParams) -> None:
        """Queue a decode-side request (params from `Consumer.accept_params`); starts at
        once when its producer is known and pages are free."""
        deadline = time.monotonic() + self.config.wait_timeout_s
        self.waiting.append(_Waiting(request, params, deadline))
        self.params[request.req_id] = params
        self._start()

    def abort(self, req_id: str) -> bool:
        """Abort a request this object still owns (waiting for pages, or for its transfer);
        False when the scheduler owns it."""
        if any(w.req_id == req_id for w in self.waiting):
            self.waiting = [w for w in self.waiting if w.req_id != req_id]
            self.connector.consumer.release_remote(self.params.pop(req_id))
            return True
        if req_id in self.connector.consumer.pulls:
            self._abort_after.add(req_id)  # its pages are being written: free them later
            return True
        return False

    def poll(self) -> None:
        """Advance every P/D request (module docstring, step 2)."""
        for req_id in self.connector.poll_producer():
            self.scheduler.release_held(req_id)
        if not self.config.is_consumer:
            return
        for req_id, ok, reason in self.connector.poll_consumer():
            params = self.params.pop(req_id, None)
            if req_id in self._abort_after:
                self._abort_after.discard(req_id)
                self.scheduler.finish_remote_kv(req_id, ok=False)
                self.scheduler.abort_request(req_id)
                if not ok and params is not None:
                    self.connector.consumer.release_remote(params)
            elif ok:
                self.scheduler.finish_remote_kv(req_id, ok=True)
            else:
                self._failed(req_id, reason or "transfer failed", params)
        self._start()
        self.connector.consumer.flush()
        if self.waiting or self.connector.consumer.pulls:
            self.connector.consumer.keep_alive([w.params for w in self.waiting])

    def _start(self) -> None:
        """Give waiting requests pages and start their transfers, while pages last; give up
        those past their deadline."""
        now, still = time.monotonic(), []
        for w in self.waiting:
            try:
                peer = self.connector.consumer.peer_for(w.params)
                slots = None
                if peer is not None:
                    slots = self.scheduler.add_remote_request(w.request, w.params.num_tokens)
            except Exception as err:  # the handshake failed, or the scheduler refused it
                self.connector.consumer.count_failure()
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
                self.connector.consumer.count_failure()
                self._failed(
                    w.req_id,
                    f"no producer handshake, cache pages or seat for its transferred KV "
                    f"within {self.config.wait_timeout_s:g} s (wait_timeout_s)",
                    self.params.pop(w.req_id),
                    w.request,
                )
                continue
            try:
                self.connector.consumer.start_transfer(w.req_id, w.params, slots, peer)
            except Exception as err:  # NIXL, or parameters that fit no layout
                self.connector.consumer.count_failure()
                self._failed(
                    w.req_id, f"cannot start the transfer: {err}", self.params.pop(w.req_id)
                )
        self.waiting = still

    def _failed(
        self, req_id: str, reason: str, params: TransferParams | None, request: Any = None
    ) -> None:
        """The request will not get its KV: tell the producer, then recompute it locally or
        end it with `reason` (policy "fail"). `request`: one the scheduler never saw."""
        if params is not None:
            self.connector.consumer.release_remote(params)
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
