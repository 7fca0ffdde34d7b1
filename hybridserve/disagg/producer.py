"""The prefill side of a connector: held pages under leases, and the WRITEs of push requests.

Lifecycle of one request's held pages:
  1. `params` (the prefill step is done): the transfer parameters for the decode side, signed
     with the shared secret when there is one (`disagg.params`); the pages are held until
     `now + lease_s`.
  2. Notes from the decode side (`on_note`, typed by `disagg.notes`), acted on only when their
     `cap` matches the held request's signature: `keep` renews the lease; `read` (pull: its
     READs are done) is answered with `read_ack`, ok only while the pages were still held, and
     frees them; `release` (the decode side gave the request up) frees them; `push` posts the
     WRITEs into the decode engine's pages, each WRITE carrying its part of the `pushed` answer
     (NIXL delivers a transfer's notification after its data, so the decode side never sees
     `pushed` before the bytes).
  3. `poll` frees the pages of a push whose WRITEs are done (or that failed: `pushed` with ok
     False, sent on its own), of every lease that ended (the decode side died or forgot), and
     of requests released locally (`release`, e.g. the proxy saw the decode leg fail).
A peer's note can fail its own request (an answer with the reason), never the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from hybridserve.config import KVTransferConfig
from hybridserve.disagg.descriptors import RankLayout
from hybridserve.disagg.notes import Note, encode_note
from hybridserve.disagg.params import TransferParams, prompt_hash, same
from hybridserve.disagg.peers import Peer
from hybridserve.disagg.transport import NixlTransport, TransferError

Tables = tuple[tuple[int, ...], ...]


@dataclasses.dataclass
class _Held:
    """A finished prefill's pages, kept for its decode side until `deadline`."""

    tables: Tables
    num_tokens: int
    cap: str  # the signature of its transfer parameters ("" without a secret)
    deadline: float


@dataclasses.dataclass
class _Push:
    """WRITEs in flight towards decode agent `agent` for its request `dst`."""

    agent: str
    dst: str
    xfers: list[Any]
    deadline: float


class Producer:
    """The prefill role of one engine's connector (module docstring). `plan(agent, layouts)`
    builds the push plans towards a decode engine that joined."""

    def __init__(
        self,
        config: KVTransferConfig,
        transport: NixlTransport,
        plan: Callable[[str, list[RankLayout]], Peer],
        epoch: str,
    ) -> None:
        self.config = config
        self.transport = transport
        self.epoch = epoch
        self.secret = config.secret_key
        self._plan = plan
        self.held: dict[str, _Held] = {}
        self.consumer_layouts: dict[str, list[RankLayout]] = {}  # decode agents that joined
        self.consumers: dict[str, Peer] = {}  # decode agent -> push plans (after a push)
        self.pushes: dict[str, _Push] = {}
        self.bytes_moved = 0
        self.failures = 0
        self.refused_notes = 0  # notes about requests not held here, or with a wrong cap
        self._released: list[str] = []

    def params(
        self,
        req_id: str,
        tables: Tables,
        token_ids: list[int],
        host: str,
        port: int,
        engine_id: str,
    ) -> dict[str, Any]:
        """Transfer parameters for the decode side of a request whose `token_ids` were
        computed into `tables`; starts its lease."""
        lease = self.config.lease_s
        params = TransferParams(
            req_id=req_id,
            engine_id=engine_id,
            epoch=self.epoch,
            host=host,
            port=port,
            block_tables=tuple(tuple(t) for t in tables),
            num_tokens=len(token_ids),
            lease_s=lease,
            prompt_hash=prompt_hash(token_ids),
            expires=time.time() + lease,
        ).signed(self.secret)
        self.held[req_id] = _Held(
            params.block_tables, len(token_ids), params.signature, time.monotonic() + lease
        )
        return params.to_dict()

    def _holds(self, req_id: str, cap: str) -> _Held | None:
        """The held request a note may act on: held here, and with the right capability."""
        held = self.held.get(req_id)
        if held is None or (self.secret is not None and not same(held.cap, cap)):
            self.refused_notes += 1
            return None
        return held

    def on_note(self, agent: str, note: Note) -> None:
        """A decode engine's note: `read`, `keep`, `push` or `release` (others are ignored)."""
        if note.op == "read":
            ok = self._holds(note.req, note.cap) is not None and note.req not in self.pushes
            why = None if ok else "the prefill engine no longer held the pages"
            reply = encode_note("read_ack", note.dst, ok=ok, error=why)
            with contextlib.suppress(Exception):
                self.transport.notify(agent, reply)
            if ok:
                self.release(note.req)
        elif note.op == "keep":
            until = time.monotonic() + self.config.lease_s
            for req_id, cap in note.reqs:
                held = self._holds(req_id, cap)
                if held is not None:
                    held.deadline = max(held.deadline, until)
        elif note.op == "push":
            self._start_push(agent, note)
        elif (
            note.op == "release"
            and note.req not in self.pushes
            and self._holds(note.req, note.cap) is not None
        ):
            self.release(note.req)

    def poll(self) -> list[str]:
        """Requests whose held pages can be freed: read, written, given up, or lease over."""
        now = time.monotonic()
        for req_id, push in list(self.pushes.items()):
            try:
                done = all(self.transport.poll(x) == "DONE" for x in push.xfers)
                error = None if done or push.deadline >= now else "the WRITEs timed out"
            except TransferError as err:
                done, error = False, f"WRITE failed: {err}"
            if done or error:
                for xfer in self.pushes.pop(req_id).xfers:
                    self.transport.release(xfer)
                if error:  # on success the WRITEs carried `pushed` themselves
                    self._refuse(push.agent, push.dst, error)
                self.release(req_id)
        for req_id, held in list(self.held.items()):
            if held.deadline < now and req_id not in self.pushes:
                self.release(req_id)
        released, self._released = self._released, []
        return released

    def release(self, req_id: str) -> bool:
        """Stop holding a request's pages (the next `poll` reports it); False when it is not
        held or its WRITEs are in flight (they free it when done)."""
        if req_id in self.pushes or self.held.pop(req_id, None) is None:
            return False
        self._released.append(req_id)
        return True

    def forget_consumer(self, agent: str) -> None:
        """Drop a decode agent that left (restarted under a new epoch), unless we push to it."""
        if any(p.agent == agent for p in self.pushes.values()):
            return
        self.consumer_layouts.pop(agent, None)
        peer = self.consumers.pop(agent, None)
        if peer is not None:
            self.transport.release_prepared(peer.prepared)
        with contextlib.suppress(Exception):
            self.transport.remove_peer(agent)

    def _refuse(self, agent: str, dst: str, error: str) -> None:
        """Tell a decode engine that the push of its request `dst` failed."""
        self.failures += 1
        with contextlib.suppress(Exception):  # a decode engine that is gone: its timeout decides
            self.transport.notify(agent, encode_note("pushed", dst, ok=False, error=error))

    def _start_push(self, agent: str, note: Note) -> None:
        """Post the WRITEs of a `push` note: into the decode engine's `tables`, from token
        `fill[g]` of each group to `tokens`; WRITE i of n carries `pushed` part i of n."""
        req_id, dst = note.req, note.dst
        if agent not in self.consumers and agent in self.consumer_layouts:  # its first push
            try:
                self.consumers[agent] = self._plan(agent, self.consumer_layouts[agent])
            except Exception as err:  # layouts that fit no plan: refuse this agent's pushes
                self.consumer_layouts.pop(agent, None)
                self._refuse(agent, dst, f"cannot plan writes to this engine: {err}")
                return
        peer = self.consumers.get(agent)
        if req_id in self.pushes:
            self._refuse(agent, dst, "already pushing")
            return
        held = self._holds(req_id, note.cap)
        if peer is None or held is None:
            why = "unknown decode engine" if peer is None else "no held pages (lease over?)"
            self._refuse(agent, dst, why)
            return
        xfers: list[Any] = []
        try:
            if not 0 <= note.tokens <= held.num_tokens:
                raise ValueError(f"tokens {note.tokens}: this engine holds {held.num_tokens}")
            fill = list(note.fill)
            posts, nbytes = peer.request_ids(note.tables, held.tables, fill, note.tokens)
            if not posts:  # nothing to write: the answer has no data to follow
                self.transport.notify(agent, encode_note("pushed", dst, ok=True, part=0, parts=0))
            for i, (decode_h, decode_ids, mine_h, my_ids) in enumerate(posts):
                done = encode_note("pushed", dst, ok=True, part=i, parts=len(posts))
                xfers.append(
                    self.transport.start("WRITE", mine_h, my_ids, decode_h, decode_ids, done)
                )
        except Exception as err:  # tables that fit no layout, or NIXL refused the WRITEs
            for xfer in xfers:
                self.transport.release(xfer)
            self._refuse(agent, dst, f"cannot post the WRITEs: {err}")
            self.release(req_id)
            return
        self.bytes_moved += nbytes
        deadline = time.monotonic() + self.config.transfer_timeout_s
        self.pushes[req_id] = _Push(agent, dst, xfers, deadline)
