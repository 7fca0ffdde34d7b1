"""The producers a decode engine knows, found by handshakes that never run on the engine thread.

A producer is reached at its side-channel address (host, port) and is one process lifetime
(`epoch`; its NIXL agent is named `engine_id:epoch`). Transfer parameters name both, so a
restarted producer (same address, new epoch) is noticed before any transfer is posted.

Lifecycle of one producer entry (all calls on the engine thread):
  1. `lookup(params)` finds no usable entry (none, another epoch, or marked stale after a
     failed transfer) and submits `fetch_peer` to a small thread pool; it answers None
     ("pending") until the handshake ends. The handshake has one overall deadline
     (`handshake_timeout_s`, DNS included as far as the pool thread is concerned: past the
     deadline the lookup fails even if the thread is still blocked).
  2. When the handshake is done, the engine thread loads the peer's metadata into NIXL and
     prepares the descriptor lists (`peers.plan_peer`). The same epoch as a stale entry reuses
     it; a new epoch replaces the entry, and the old agent is retired.
  3. A failed handshake raises HandshakeError from `lookup` for every request that waited on
     it (they fail or recompute together, instead of each later one starting a handshake of
     its own and waiting out another deadline) and is counted once in `failures`; a request
     that arrives after the failure tries again.
  4. `collect(in_use)` drops retired agents that no transfer uses any more: their prepared
     lists are released and NIXL forgets them. `close()` stops the pool.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any, NoReturn

from hybridserve.disagg.descriptors import RankLayout, check_compatible
from hybridserve.disagg.handshake import HandshakeError, fetch_peer
from hybridserve.disagg.params import TransferParams
from hybridserve.disagg.peers import Peer, plan_peer
from hybridserve.disagg.transport import NixlTransport

Key = tuple[str, int]


@dataclasses.dataclass
class _Pending:
    future: concurrent.futures.Future
    deadline: float
    # the parameters looked up meanwhile, by id() (the object is kept, so its id stays its own)
    waiters: dict[int, TransferParams] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Failed:
    """A handshake that failed, and the parameters that waited on it and have not heard yet."""

    error: HandshakeError
    waiters: dict[int, TransferParams]

    def take(self, params: TransferParams) -> bool:
        """Whether `params` waited on this handshake (once: it is forgotten here)."""
        return self.waiters.pop(id(params), None) is params


class PeerDirectory:
    """Producers by side-channel address (module docstring). `request()` is this engine's
    handshake request (its layouts and agent metadata, sent only after the proofs)."""

    def __init__(
        self,
        transport: NixlTransport,
        layouts: list[RankLayout],
        request: Callable[[], dict[str, Any]],
        timeout_s: float,
        secret: bytes | None,
    ) -> None:
        self.transport = transport
        self.layouts = layouts
        self.request = request
        self.timeout_s = timeout_s
        self.secret = secret
        self.peers: dict[Key, Peer] = {}
        self.pending: dict[Key, _Pending] = {}
        self.failed: dict[Key, _Failed] = {}  # the last failure per producer, until heard
        self.retired: list[Peer] = []
        self.failures = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="handshake")

    def __bool__(self) -> bool:
        return bool(self.pending)

    def ready(self, params: TransferParams) -> Peer | None:
        """The usable entry for these parameters, or None (never starts a handshake)."""
        peer = self.peers.get(params.peer)
        if peer is None or peer.stale or peer.epoch != params.epoch:
            return None
        return peer

    def lookup(self, params: TransferParams) -> Peer | None:
        """The producer of `params`, ready for transfers; None while its handshake runs.
        Raises HandshakeError when the handshake failed or the producer restarted since
        these parameters were made (its pages are gone)."""
        peer = self.ready(params)
        if peer is not None:
            return peer
        key = params.peer
        failed = self.failed.get(key)
        if failed is not None and failed.take(params):
            if not failed.waiters:
                del self.failed[key]
            raise HandshakeError(str(failed.error))
        pending = self.pending.get(key)
        if pending is None:
            future = self._pool.submit(
                fetch_peer, key[0], key[1], self.request(), self.timeout_s, self.secret
            )
            deadline = time.monotonic() + self.timeout_s
            self.pending[key] = _Pending(future, deadline, {id(params): params})
            return None
        if not pending.future.done():
            if time.monotonic() <= pending.deadline:
                pending.waiters[id(params)] = params
                return None
            pending.future.cancel()
            timed_out = HandshakeError(f"handshake with {key[0]}:{key[1]} timed out")
            self._fail(key, pending, params, timed_out)
        del self.pending[key]
        try:
            peer = self._join(key, pending.future.result())
        except Exception as err:
            if not isinstance(err, HandshakeError):
                cause = err
                err = HandshakeError(f"handshake with {key[0]}:{key[1]} failed: {cause}")
                err.__cause__ = cause
            self._fail(key, pending, params, err)
        self.failed.pop(key, None)
        if peer.epoch != params.epoch:
            raise HandshakeError(
                f"the prefill engine at {key[0]}:{key[1]} restarted since these transfer "
                "parameters were made (its pages are gone)"
            )
        return peer

    def _fail(
        self, key: Key, pending: _Pending, params: TransferParams, error: HandshakeError
    ) -> NoReturn:
        """End a failed handshake: raises `error` for `params`; the other requests that waited
        on it hear the same at their next lookup."""
        self.pending.pop(key, None)
        self.failures += 1
        pending.waiters.pop(id(params), None)
        self.failed[key] = _Failed(error, pending.waiters)
        raise error

    def _join(self, key: Key, info: dict[str, Any]) -> Peer:
        """Load a producer's handshake reply (engine thread)."""
        epoch, metadata, layouts = info.get("epoch"), info.get("agent_metadata"), info["layouts"]
        if not isinstance(epoch, str) or not isinstance(metadata, bytes):
            raise HandshakeError("the handshake reply has no epoch or agent metadata")
        if not isinstance(layouts, list) or not layouts:
            raise HandshakeError("the handshake reply has no layouts")
        remote = {}
        for d in layouts:
            layout = RankLayout.from_dict(d)
            check_compatible(self.layouts[0], layout)
            remote[layout.tp_rank] = layout
        old = self.peers.get(key)
        if old is not None and old.epoch == epoch:
            old.stale = False
            return old
        agent = self.transport.add_peer(metadata)
        try:
            peer = plan_peer(self.transport, agent, self.layouts, remote, push=False)
        except BaseException:
            with contextlib.suppress(Exception):
                self.transport.remove_peer(agent)
            raise
        peer.epoch = epoch
        if old is not None:
            self.retired.append(old)
        self.peers[key] = peer
        return peer

    def mark_stale(self, peer: Peer) -> None:
        """A transfer with `peer` failed: handshake again before the next one."""
        peer.stale = True

    def collect(self, in_use: set[str]) -> None:
        """Drop retired agents that no transfer in flight uses (`in_use`: agent names)."""
        keep = []
        for peer in self.retired:
            if peer.agent in in_use:
                keep.append(peer)
                continue
            self.transport.release_prepared(peer.prepared)
            with contextlib.suppress(Exception):
                self.transport.remove_peer(peer.agent)
        self.retired = keep

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
