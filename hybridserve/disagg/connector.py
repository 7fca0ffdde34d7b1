"""The NIXL connector of one engine: it moves a prompt's KV pages and Mamba states from a
prefill engine to a decode engine, with no copy on either side, by READs the decode side posts
("pull", the default) or WRITEs the prefill side posts ("push"), chosen by the decode engine's
`KVTransferConfig.transfer_mode`.

Lifecycle of one request:
  1. Prefill engine (`kv_producer`): the engine computes the prompt except its last token (a
     state-space layer cannot apply that token twice) and the scheduler holds the request's
     pages. `producer_params` returns the transfer parameters (engine id, side-channel address,
     block ids per group, token count) and starts a lease (`disagg.producer`).
  2. Decode engine (`kv_consumer`): the scheduler gives the request what a colocated engine
     would hold at its first decode step (window groups: their window only; the whole pages of
     a decode-side prefix hit shared) and says from which token each group must be filled
     (`RemoteSlots`). `start_transfer` fetches the producer's agent metadata and layouts over
     the side channel once per producer (sending its own, so that the producer can write to
     it), plans the transfers of every local rank (heterogeneous TP included) with prepared
     descriptor lists (once per producer, `disagg.peers`), computes the request's descriptor
     ids (`SourceRead.span_ids`: only the tokens to fill, never a null page), then
       pull: posts one READ per (local rank, source rank);
       push: sends the producer a `push` note with its tables and fill points.
  3. Push only: the producer posts the WRITEs (the same plans, seen from the other side), each
     carrying its part of the `pushed` answer, and frees its pages once they are done.
  4. Pull only: when the READs are done the decode engine sends `read`; the producer answers
     `read_ack`, ok only if it still held the pages (the lease had not expired, so nothing
     overwrote them during the READs), and releases them.
  5. `poll_consumer` on the decode side reports finished transfers: on success (`read_ack`, or
     every part of `pushed`, with ok) the request runs from the transferred position; on
     failure or timeout it recomputes locally (or fails, per `failure_policy`), never decoding
     on pages that were not filled. Meanwhile `keep_alive` sends the producers `keep`
     heartbeats (every lease/4) for the requests still waiting (for pages, or for their
     transfer), which renew leases; `release_remote` tells a producer a request was given up.
  6. `poll_producer` on the prefill side releases held pages on `read`, `release`, after its
     WRITEs, or when a lease expires (the decode side died or forgot the request).
Notifications: `disagg.notes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import time
import uuid
from typing import Any

from hybridserve.config import KVTransferConfig
from hybridserve.core.outputs import RemoteSlots
from hybridserve.disagg.descriptors import RankLayout, check_compatible
from hybridserve.disagg.handshake import HandshakeError, HandshakeServer, fetch_peer
from hybridserve.disagg.notes import decode_note, encode_note
from hybridserve.disagg.peers import Peer, plan_peer
from hybridserve.disagg.producer import Producer
from hybridserve.disagg.transport import NixlTransport, TransferError
from hybridserve.runner.regions import shard_buffers


@dataclasses.dataclass
class _Transfer:
    """A decode request waiting for its pages: READs in flight (pull) or `pushed` (push)."""

    peer: Any  # (host, port) of the producer (pull and push)
    remote_req: str  # the producer's req_id
    xfers: list[Any]
    deadline: float
    nbytes: int  # what lands in this engine's pages
    push: bool = False
    read_sent: bool = False  # pull: the READs are done and `read` went out
    parts: set[int] = dataclasses.field(default_factory=set)  # push: `pushed` parts received
    result: tuple[bool, str | None] | None = None  # set by `read_ack` or `pushed`

    def pushed(self, note: dict[str, Any]) -> None:
        """One `pushed` note: a failure ends the transfer; success once every part is in."""
        if not note.get("ok"):
            self.result = (False, str(note.get("error")))
            return
        part, parts = note.get("part"), note.get("parts")
        if type(part) is int and type(parts) is int and 0 <= part < max(parts, 1):
            self.parts.add(part)
            if len(self.parts) >= parts:
                self.result = (True, None)


class NixlConnector:
    """Producer and/or consumer role of one engine (see the module docstring)."""

    def __init__(self, config: KVTransferConfig, runner: Any) -> None:
        self.config = config
        self.engine_id = config.engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        plan, cfg = runner.plan, runner.cfg
        buffers = shard_buffers(runner.regions)
        self.layouts = [
            RankLayout.from_plan(
                plan,
                cfg,
                tp_rank=r,
                region_bases=[b[0] for b in rank],
                num_pages=runner.num_pages,
                device_id=rank[0][2],
            )
            for r, rank in enumerate(buffers)
        ]
        mem = "VRAM" if next(iter(runner.regions[0].devices())).platform == "gpu" else "DRAM"
        delay = config.nixl_progress_delay_us
        self.transport = NixlTransport(
            self.engine_id,
            [b for rank in buffers for b in rank],
            mem,
            num_threads=config.nixl_threads,
            progress_delay_us=(0 if mem == "VRAM" else 200) if delay is None else delay,
        )
        self.server: HandshakeServer | None = None
        self._joined: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        mine = dict(enumerate(self.layouts))
        self.producer = Producer(
            config,
            self.transport,
            lambda agent, layouts: plan_peer(self.transport, agent, layouts, mine, push=True),
        )
        if config.is_producer:
            info = {
                "engine_id": self.engine_id,
                "agent_name": self.engine_id,
                "agent_metadata": self.transport.metadata(),
                "layouts": [layout.to_dict() for layout in self.layouts],
            }
            self.server = HandshakeServer(info, self._check_peer, config.host, config.port)
        self.peers: dict[tuple[str, int], Peer] = {}  # producers, by side-channel address
        self.pulls: dict[str, _Transfer] = {}
        self._next_keep = 0.0
        self._bytes_moved = 0  # READs posted as consumer
        self.bytes_received = 0  # landed in this engine's pages by completed transfers
        self._failures = 0

    @property
    def bytes_moved(self) -> int:
        """Bytes posted by this engine: READs as consumer, WRITEs as producer."""
        return self._bytes_moved + self.producer.bytes_moved

    @property
    def failures(self) -> int:
        """Failed transfers: decode requests that did not get their pages, pushes refused."""
        return self._failures + self.producer.failures

    # -- producer ---------------------------------------------------------------------------

    def _check_peer(self, request: dict[str, Any]) -> None:
        """Handshake thread: refuse an incompatible peer; queue a decode engine's metadata (the
        engine thread adds it, NIXL agents are not shared across threads)."""
        check_compatible(self.layouts[0], RankLayout.from_dict(request["layout"]))
        if "agent_metadata" in request:
            layouts = [RankLayout.from_dict(d) for d in request["layouts"]]
            for layout in layouts:
                check_compatible(self.layouts[0], layout)
            self._joined.put({"metadata": request["agent_metadata"], "layouts": layouts})

    def _add_consumers(self) -> None:
        while True:
            try:
                joined = self._joined.get_nowait()
            except queue.Empty:
                return
            agent = self.transport.add_peer(joined["metadata"])
            self.producer.consumer_layouts[agent] = joined["layouts"]

    def producer_params(
        self, req_id: str, tables: tuple[tuple[int, ...], ...], num_tokens: int
    ) -> dict[str, Any]:
        """Transfer parameters for the decode side; starts the request's lease."""
        assert self.server is not None, "not a kv_producer"
        host, port = self.server.host, self.server.port
        return self.producer.params(req_id, tables, num_tokens, host, port, self.engine_id)

    def poll_producer(self) -> list[str]:
        """Requests whose held pages can be released: read by the decode side, written by us,
        given up, or lease over."""
        self._add_consumers()
        self._drain()
        return self.producer.poll()

    # -- both roles -------------------------------------------------------------------------

    def _drain(self) -> None:
        """Dispatch every new notification: `read`, `keep`, `push` and `release` to the
        producer, `read_ack` and `pushed` to the transfers waiting for them."""
        for agent, messages in self.transport.notifications().items():
            for message in messages:
                note = decode_note(message)
                if note is None:
                    continue
                op, req_id = note.get("op"), note["req"]
                pull = self.pulls.get(req_id)
                if op == "read_ack" and pull is not None:
                    ok = bool(note.get("ok"))
                    pull.result = (ok, None if ok else str(note.get("error")))
                elif op == "pushed" and pull is not None and pull.push:
                    pull.pushed(note)
                else:
                    self.producer.on_note(agent, op, req_id, note)

    # -- consumer ---------------------------------------------------------------------------

    def _peer(self, host: str, port: int) -> Peer:
        key = (host, port)
        if key not in self.peers:
            request = {  # the producer notifies us (read_ack, pushed) and may write to us
                "layout": self.layouts[0].to_dict(),
                "agent_metadata": self.transport.metadata(),
                "layouts": [layout.to_dict() for layout in self.layouts],
            }
            info = fetch_peer(host, port, request, timeout=self.config.handshake_timeout_s)
            remote = {d["tp_rank"]: RankLayout.from_dict(d) for d in info["layouts"]}
            for layout in remote.values():
                check_compatible(self.layouts[0], layout)
            agent = self.transport.add_peer(info["agent_metadata"])
            self.peers[key] = plan_peer(self.transport, agent, self.layouts, remote, push=False)
        return self.peers[key]

    def start_transfer(self, req_id: str, params: dict[str, Any], slots: RemoteSlots) -> None:
        """Fill the pages `slots` names (from token `slots.fill_from[g]` of each group) from
        the producer's pages: post the READs (pull) or ask the producer to WRITE them (push).
        Raises (nothing posted) on a producer that cannot be reached or whose parameters do
        not fit its layout."""
        key = (params["host"], int(params["port"]))
        peer = self._peer(*key)
        deadline = time.monotonic() + self.config.transfer_timeout_s
        remote_req = str(params.get("req_id", req_id))
        fill, tokens = list(slots.fill_from), slots.num_tokens
        posts, nbytes = peer.request_ids(slots.block_tables, params["block_tables"], fill, tokens)
        if self.config.transfer_mode == "push":
            tables = [list(t) for t in slots.block_tables]
            note = encode_note(
                "push", remote_req, dst=req_id, tables=tables, fill=fill, tokens=tokens
            )
            self.transport.notify(peer.agent, note)
            self.pulls[req_id] = _Transfer(key, remote_req, [], deadline, nbytes, push=True)
            return
        xfers = []
        try:
            for local_h, local_ids, remote_h, remote_ids in posts:
                xfers.append(self.transport.start("READ", local_h, local_ids, remote_h, remote_ids))
        except TransferError:
            for xfer in xfers:
                self.transport.release(xfer)
            raise
        self._bytes_moved += nbytes
        self.pulls[req_id] = _Transfer(key, remote_req, xfers, deadline, nbytes)

    def release_remote(self, params: dict[str, Any]) -> None:
        """Tell a producer that its held pages of a request will not be read (the decode side
        gave the request up: aborted, waited too long for pages, or its transfer failed), so
        that it frees them now rather than at the end of the lease. Best effort."""
        with contextlib.suppress(Exception):  # an unreachable producer: its lease decides
            key = (params["host"], int(params["port"]))
            note = encode_note("release", str(params["req_id"]))
            self.transport.notify(self._peer(*key).agent, note)

    def keep_alive(self, waiting: list[dict[str, Any]]) -> None:
        """Every `lease_s / 4` (the producer's lease, from its params), renew the leases of
        the requests still waiting: `waiting` (params of requests without pages yet) and the
        transfers in flight. One `keep` notification per producer."""
        now = time.monotonic()
        if now < self._next_keep:
            return
        reqs: dict[tuple[str, int], list[str]] = {}
        lease = self.config.lease_s
        for params in waiting:
            key = (params["host"], int(params["port"]))
            reqs.setdefault(key, []).append(str(params.get("req_id")))
            lease = min(lease, float(params.get("lease_s", lease)))
        for pull in self.pulls.values():
            reqs.setdefault(pull.peer, []).append(pull.remote_req)
        for key, ids in reqs.items():
            with contextlib.suppress(Exception):  # a dead producer: the transfer decides
                self.transport.notify(self._peer(*key).agent, encode_note("keep", "", reqs=ids))
        self._next_keep = now + lease / 4

    def poll_consumer(self) -> list[tuple[str, bool, str | None]]:
        """Finished transfers: (req_id, ok, reason when not ok). Notifies producers of reads."""
        self._drain()
        finished = []
        now = time.monotonic()
        for req_id, pull in list(self.pulls.items()):
            what = "push" if pull.push else "transfer"
            if pull.result is not None:
                ok, reason = pull.result
                finished.append((req_id, ok, None if ok else f"{what} failed: {reason}"))
                self.bytes_received += pull.nbytes if ok else 0
                self._drop(req_id)
                continue
            if pull.deadline < now:
                finished.append((req_id, False, f"{what} timed out"))
                self._drop(req_id)
                continue
            if pull.push or pull.read_sent:
                continue
            try:
                done = all(self.transport.poll(x) == "DONE" for x in pull.xfers)
            except TransferError as err:
                finished.append((req_id, False, f"transfer failed: {err}"))
                self._drop(req_id)
                continue
            if done:  # the READs are in; ask the producer whether it held the pages throughout
                for xfer in pull.xfers:
                    self.transport.release(xfer)
                pull.xfers, pull.read_sent = [], True
                note = encode_note("read", pull.remote_req, dst=req_id)
                self.transport.notify(self.peers[pull.peer].agent, note)
        self._failures += sum(1 for _, ok, _ in finished if not ok)
        return finished

    def _drop(self, req_id: str) -> None:
        for xfer in self.pulls.pop(req_id).xfers:
            self.transport.release(xfer)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.transport.close()


__all__ = ["HandshakeError", "NixlConnector"]
