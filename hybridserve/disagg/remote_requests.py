"""An engine's P/D requests between its scheduler and its connector.

Decode side, lifecycle of a request whose prompt another engine computed:
  1. `check_params` (at `add_request`, so a bad request fails there) and `add`: the request
     waits for pages and a seat, until now + `wait_timeout_s`.
  2. Each `poll` (every engine step) first releases the prefill side's held pages that were
     read or whose lease ended, then reports finished transfers to the scheduler (a request
     whose transfer succeeded runs from the transferred position; one that failed recomputes
     locally or fails, per `failure_policy`), then gives waiting requests their pages
     (`Scheduler.add_remote_request`: the colocated engine's pages at the first decode step,
     less a decode-side prefix hit) and starts their transfers while pages last; a request
     still waiting past its deadline is given up the same way. Heartbeats (`keep`) renew the
     producer's leases of the requests still waiting.
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


@dataclasses.dataclass
class _Waiting:
    request: Any  # the core Request, not yet in the scheduler
    params: dict[str, Any]
    deadline: float

    @property
    def req_id(self) -> str:
        return self.request.req_id


def check_params(params: dict[str, Any], num_prompt_tokens: int) -> None:
    """Refuse (ValueError) decode-side transfer parameters that cannot describe this prompt:
    what a prefill engine's output carries, `num_tokens` in [1, prompt length)."""
    n = params.get("num_tokens")
    if type(n) is not int or not 0 < n < num_prompt_tokens:
        raise ValueError(
            f"kv_transfer_params: num_tokens must be an integer in [1, {num_prompt_tokens}) "
            f"for a prompt of {num_prompt_tokens} tokens, got {n!r}"
        )
    tables = params.get("block_tables")
    if not isinstance(tables, list) or not all(
        isinstance(t, list) and all(type(p) is int for p in t) for t in tables
    ):
        raise ValueError("kv_transfer_params: block_tables must be a list of lists of integers")
    if not isinstance(params.get("host"), str) or type(params.get("port")) is not int:
        raise ValueError("kv_transfer_params: host (a string) and port (an integer) are needed")
    if not isinstance(params.get("req_id", ""), str):
        raise ValueError("kv_transfer_params: req_id must be a string")
    lease = params.get("lease_s", 1.0)
    if isinstance(lease, bool) or not isinstance(lease, int | float) or not lease > 0:
        raise ValueError("kv_transfer_params: lease_s must be a positive number")


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
        self.params: dict[str, dict[str, Any]] = {}  # req_id -> its producer's parameters
        self._abort_after: set[str] = set()  # aborted while its pages are being written

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def add(self, request: Any, params: dict[str, Any]) -> None:
        """Queue a decode-side request (params checked by `check_params`); starts at once
        when pages are free."""
        deadline = time.monotonic() + self.config.wait_timeout_s
        self.waiting.append(_Waiting(request, params, deadline))
        self.params[request.req_id] = params
        self._start()

    def abort(self, req_id: str) -> bool:
        """Abort a request this object still owns (waiting for pages, or for its transfer);
        False when the scheduler owns it."""
        if any(w.req_id == req_id for w in self.waiting):
            self.waiting = [w for w in self.waiting if w.req_id != req_id]
            self.connector.release_remote(self.params.pop(req_id))
            return True
        if req_id in self.connector.pulls:
            self._abort_after.add(req_id)  # its pages are being written: free them later
            return True
        return False

    def poll(self) -> None:
        """Advance every P/D request (module docstring, step 2)."""
        for req_id in self.connector.poll_producer():
            self.scheduler.release_held(req_id)
        for req_id, ok, reason in self.connector.poll_consumer():
            params = self.params.pop(req_id, None)
            if req_id in self._abort_after:
                self._abort_after.discard(req_id)
                self.scheduler.finish_remote_kv(req_id, ok=False)
                self.scheduler.abort_request(req_id)
                if not ok and params is not None:
                    self.connector.release_remote(params)
            elif ok:
                self.scheduler.finish_remote_kv(req_id, ok=True)
            else:
                self._failed(req_id, reason or "transfer failed", params)
        self._start()
        if self.waiting or self.connector.pulls:
            self.connector.keep_alive([w.params for w in self.waiting])

    def _start(self) -> None:
        """Give waiting requests pages and start their transfers, while pages last; give up
        those past their deadline."""
        now, still = time.monotonic(), []
        for w in self.waiting:
            slots = self.scheduler.add_remote_request(w.request, w.params["num_tokens"])
            if slots is None:
                if now <= w.deadline:
                    still.append(w)
                    continue
                self._failed(
                    w.req_id,
                    f"no cache pages or seat for its transferred KV within "
                    f"{self.config.wait_timeout_s:g} s (wait_timeout_s)",
                    self.params.pop(w.req_id),
                    w.request,
                )
                continue
            try:
                self.connector.start_transfer(w.req_id, w.params, slots)
            except Exception as err:  # handshake, NIXL, or parameters that fit no layout
                self._failed(
                    w.req_id, f"cannot start the transfer: {err}", self.params.pop(w.req_id)
                )
        self.waiting = still

    def _failed(
        self, req_id: str, reason: str, params: dict[str, Any] | None, request: Any = None
    ) -> None:
        """The request will not get its KV: tell the producer, then recompute it locally or
        end it with `reason` (policy "fail"). `request`: one the scheduler never saw."""
        if params is not None:
            self.connector.release_remote(params)
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
