"""The prefill side of a connector: held pages under leases, and the WRITEs of push requests.

Lifecycle of one request's held pages:
  1. `params` (the prefill step is done): the transfer parameters for the decode side; the
     pages are held until `now + lease_s`.
  2. Notes from the decode side (`on_note`): `keep` renews the lease; `read` (pull: its READs
     are done) is answered with `read_ack`, ok only while the pages were still held, and frees
     them; `release` (the decode side gave the request up) frees them; `push` posts the WRITEs
     into the decode engine's pages, each WRITE carrying its part of the `pushed` answer (NIXL
     delivers a transfer's notification after its data, so the decode side never sees `pushed`
     before the bytes).
  3. `poll` frees the pages of a push whose WRITEs are done (or that failed: `pushed` with ok
     False, sent on its own), and of every lease that ended (the decode side died or forgot).
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
from hybridserve.disagg.notes import encode_note
from hybridserve.disagg.peers import Peer
from hybridserve.disagg.transport import NixlTransport, TransferError

Tables = tuple[tuple[int, ...], ...]


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
    ) -> None:
        self.config = config
        self.transport = transport
        self._plan = plan
        self.leases: dict[str, float] = {}  # req_id -> deadline
        self.held: dict[str, tuple[Tables, int]] = {}  # req_id -> (block tables, tokens)
        self.consumer_layouts: dict[str, list[RankLayout]] = {}  # decode agents that joined
        self.consumers: dict[str, Peer] = {}  # decode agent -> push plans (after a push)
        self.pushes: dict[str, _Push] = {}
        self.bytes_moved = 0
        self.failures = 0
        self._released: list[str] = []

    def params(
        self, req_id: str, tables: Tables, num_tokens: int, host: str, port: int, engine_id: str
    ) -> dict[str, Any]:
        """Transfer parameters for the decode side; starts the request's lease."""
        self.leases[req_id] = time.monotonic() + self.config.lease_s
        self.held[req_id] = (tables, num_tokens)
        return {
            "req_id": req_id,
            "engine_id": engine_id,
            "host": host,
            "port": port,
            "block_tables": [list(t) for t in tables],
            "num_tokens": num_tokens,
            "lease_s": self.config.lease_s,
        }

    def on_note(self, agent: str, op: Any, req_id: str, note: dict[str, Any]) -> None:
        """A decode engine's note: `read`, `keep`, `push` or `release` (others are ignored)."""
        if op == "read":
            ok = req_id in self.leases and req_id not in self.pushes
            why = None if ok else "the prefill engine no longer held the pages"
            reply = encode_note("read_ack", str(note.get("dst")), ok=ok, error=why)
            with contextlib.suppress(Exception):
                self.transport.notify(agent, reply)
            if ok:
                self._release(req_id)
        elif op == "keep" and isinstance(note.get("reqs"), list):
            until = time.monotonic() + self.config.lease_s
            for held in note["reqs"]:
                if isinstance(held, str) and held in self.leases:
                    self.leases[held] = max(self.leases[held], until)
        elif op == "push":
            self._start_push(agent, req_id, str(note.get("dst")), note)
        elif op == "release" and req_id not in self.pushes:
            self._release(req_id)

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
                self._release(req_id)
        for req_id, deadline in list(self.leases.items()):
            if deadline < now and req_id not in self.pushes:
                self._release(req_id)
        released, self._released = self._released, []
        return released

    def _release(self, req_id: str) -> None:
        if self.leases.pop(req_id, None) is not None:
            self.held.pop(req_id, None)
            self._released.append(req_id)

    def _refuse(self, agent: str, dst: str, error: str) -> None:
        """Tell a decode engine that the push of its request `dst` failed."""
        self.failures += 1
        with contextlib.suppress(Exception):  # a decode engine that is gone: its timeout decides
            self.transport.notify(agent, encode_note("pushed", dst, ok=False, error=error))

    def _start_push(self, agent: str, req_id: str, dst: str, note: dict[str, Any]) -> None:
        """Post the WRITEs of a `push` note: into the decode engine's `tables`, from token
        `fill[g]` of each group to `tokens`; WRITE i of n carries `pushed` part i of n."""
        if agent not in self.consumers and agent in self.consumer_layouts:  # its first push
            self.consumers[agent] = self._plan(agent, self.consumer_layouts[agent])
        peer, held = self.consumers.get(agent), self.held.get(req_id)
        if peer is None or held is None or req_id in self.pushes:
            why = "unknown decode engine" if peer is None else "no held pages (lease over?)"
            self._refuse(agent, dst, why if req_id not in self.pushes else "already pushing")
            return
        mine, num_tokens = held
        xfers: list[Any] = []
        try:
            tokens = note.get("tokens")
            if type(tokens) is not int or not 0 <= tokens <= num_tokens:
                raise ValueError(f"tokens {tokens!r}: this engine holds {num_tokens}")
            posts, nbytes = peer.request_ids(note["tables"], mine, note["fill"], tokens)
            if not posts:  # nothing to write: the answer has no data to follow
                self.transport.notify(agent, encode_note("pushed", dst, ok=True, part=0, parts=0))
            for i, (decode_h, decode_ids, mine_h, my_ids) in enumerate(posts):
                done = encode_note("pushed", dst, ok=True, part=i, parts=len(posts))
                xfers.append(
                    self.transport.start("WRITE", mine_h, my_ids, decode_h, decode_ids, done)
                )
        except (TransferError, ValueError, TypeError, KeyError, IndexError) as err:
            for xfer in xfers:
                self.transport.release(xfer)
            self._refuse(agent, dst, f"cannot post the WRITEs: {err}")
            self._release(req_id)
            return
        self.bytes_moved += nbytes
        deadline = time.monotonic() + self.config.transfer_timeout_s
        self.pushes[req_id] = _Push(agent, dst, xfers, deadline)
