"""The NIXL connector of one engine: it moves a prompt's KV pages and Mamba states from a
prefill engine to a decode engine, with no copy on either side, by READs the decode side posts
("pull", the default) or WRITEs the prefill side posts ("push"), chosen by the decode engine's
`KVTransferConfig.transfer_mode`.

Lifecycle of one request:
  1. Prefill engine (`kv_producer`): the engine computes the prompt except its last token (a
     state-space layer cannot apply that token twice) and the scheduler holds the request's
     pages. `producer_params` returns the transfer parameters (engine id, side-channel address,
     block ids per group, token count) and starts a lease.
  2. Decode engine (`kv_consumer`): the scheduler allocates pages for those tokens and parks the
     request; `start_transfer` fetches the producer's agent metadata and layouts over the side
     channel once per producer (sending its own, so that the producer can write to it), plans
     the transfers of every local rank (heterogeneous TP included) with prepared descriptor
     lists (once per producer), then
       pull: posts one READ per (local rank, source rank) with the request's descriptor ids;
       push: sends the producer a `push` notification with its block ids.
  3. Push only: the producer's `poll_producer` takes the `push` notification, posts the WRITEs
     (the same plans, seen from the other side) and, once they are done, frees the pages and
     notifies the decode engine (`pushed`, ok or not).
  4. Pull only: when the READs are done the decode engine sends `read`; the producer answers
     `read_ack`, ok only if it still held the pages (the lease had not expired, so nothing
     overwrote them during the READs), and releases them.
  5. `poll_consumer` on the decode side reports finished transfers: on success (`read_ack` or
     `pushed` with ok) the request runs from the transferred position; on failure or timeout
     it recomputes locally (or fails, per `failure_policy`), never decoding on pages that were
     not filled. Meanwhile `keep_alive` sends the producers `keep` heartbeats (every lease/4)
     for the requests still waiting (for pages, or for their transfer), which renew leases.
  6. `poll_producer` on the prefill side releases held pages on `read`, after its WRITEs, or
     when a lease expires (the decode side died or forgot the request).
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
from hybridserve.disagg.tp_mapping import ReadPlan, plan_reads
from hybridserve.disagg.transport import NixlTransport, TransferError
from hybridserve.runner.regions import shard_buffers


@dataclasses.dataclass
class _Peer:
    """A remote engine with its plans, seen from the decode side: `plans[r]` are the transfers
    of decode rank r; `handles[r][s]` = (decode-side list, prefill-side list) of read s."""

    agent: str
    layouts: dict[int, RankLayout]
    plans: list[ReadPlan]
    handles: list[list[tuple[Any, Any]]]
    lengths: list[list[list[int]]]  # [r][s][id]: bytes of each descriptor of read s

    def nbytes(self, r: int, s: int, ids: list[int]) -> int:
        lengths = self.lengths[r][s]
        return sum(lengths[i] for i in ids)


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
    result: tuple[bool, str | None] | None = None  # set by `read_ack` or `pushed`


@dataclasses.dataclass
class _Push:
    """A push the producer is writing: WRITEs in flight towards decode agent `agent`."""

    agent: str
    dst: str  # the decode engine's req_id
    xfers: list[Any]
    deadline: float


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
        if config.is_producer:
            info = {
                "engine_id": self.engine_id,
                "agent_name": self.engine_id,
                "agent_metadata": self.transport.metadata(),
                "layouts": [layout.to_dict() for layout in self.layouts],
            }
            self.server = HandshakeServer(info, self._check_peer, config.host, config.port)
        # producer
        self.leases: dict[str, float] = {}  # req_id -> deadline
        self.held: dict[str, tuple[tuple[tuple[int, ...], ...], int]] = {}  # (tables, tokens)
        self.consumer_layouts: dict[str, list[RankLayout]] = {}  # decode agents that joined
        self.consumers: dict[str, _Peer] = {}  # decode agent name -> plans (after a push)
        self.pushes: dict[str, _Push] = {}
        self._released: list[str] = []
        # consumer
        self.peers: dict[tuple[str, int], _Peer] = {}
        self.pulls: dict[str, _Transfer] = {}
        self._next_keep = 0.0
        self.bytes_moved = 0  # posted by this engine (READs as consumer, WRITEs as producer)
        self.bytes_received = 0  # landed in this engine's pages by completed transfers
        self.failures = 0

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
            self.consumer_layouts[agent] = joined["layouts"]

    def producer_params(
        self, req_id: str, tables: tuple[tuple[int, ...], ...], num_tokens: int
    ) -> dict[str, Any]:
        """Transfer parameters for the decode side; starts the request's lease."""
        assert self.server is not None, "not a kv_producer"
        self.leases[req_id] = time.monotonic() + self.config.lease_s
        self.held[req_id] = (tables, num_tokens)
        return {
            "req_id": req_id,
            "engine_id": self.engine_id,
            "host": self.server.host,
            "port": self.server.port,
            "block_tables": [list(t) for t in tables],
            "num_tokens": num_tokens,
            "lease_s": self.config.lease_s,
        }

    def poll_producer(self) -> list[str]:
        """Requests whose held pages can be released: read by the decode side, written by us,
        or lease over."""
        self._add_consumers()
        self._drain()
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
                self._finish_push(req_id, push.agent, push.dst, error)
        for req_id, deadline in list(self.leases.items()):
            if deadline < now and req_id not in self.pushes:
                self._release(req_id)
        released, self._released = self._released, []
        return released

    def _release(self, req_id: str) -> None:
        if self.leases.pop(req_id, None) is not None:
            self.held.pop(req_id, None)
            self._released.append(req_id)

    def _start_push(self, agent: str, req_id: str, dst: str, note: dict[str, Any]) -> None:
        """Post the WRITEs of a `push` request (decode req_id `dst`) into decode agent
        `agent`'s pages: its `tables`, from token `fill[g]` of each group to `tokens`."""
        if agent not in self.consumers and agent in self.consumer_layouts:  # first push
            mine = dict(enumerate(self.layouts))
            layouts = self.consumer_layouts[agent]
            self.consumers[agent] = self._plan_peer(agent, layouts, mine, push=True)
        peer = self.consumers.get(agent)
        held = self.held.get(req_id)
        if peer is None or held is None or req_id in self.pushes:
            why = (
                "unknown decode engine"
                if peer is None
                else "no held pages (lease over?)"
                if held is None
                else "already pushing"
            )
            self.failures += 1
            with contextlib.suppress(Exception):  # a decode engine that is gone: its timeout
                self.transport.notify(agent, encode_note("pushed", dst, ok=False, error=why))
            return
        mine, num_tokens = held
        xfers: list[Any] = []
        try:
            tokens = note.get("tokens")
            if type(tokens) is not int or not 0 <= tokens <= num_tokens:
                raise ValueError(f"tokens {tokens!r}: this engine holds {num_tokens}")
            posts = []
            for r, (plan, handles) in enumerate(zip(peer.plans, peer.handles, strict=True)):
                for s, (read, (decode_h, mine_h)) in enumerate(
                    zip(plan.reads, handles, strict=True)
                ):
                    decode_ids, my_ids = read.span_ids(note["tables"], mine, note["fill"], tokens)
                    if decode_ids:
                        posts.append((mine_h, my_ids, decode_h, decode_ids))
                        self.bytes_moved += peer.nbytes(r, s, decode_ids)
            for mine_h, my_ids, decode_h, decode_ids in posts:
                xfers.append(self.transport.start("WRITE", mine_h, my_ids, decode_h, decode_ids))
        except (TransferError, ValueError, TypeError, KeyError, IndexError) as err:
            for xfer in xfers:
                self.transport.release(xfer)
            self._finish_push(req_id, agent, dst, f"cannot post the WRITEs: {err}")
            return
        deadline = time.monotonic() + self.config.transfer_timeout_s
        self.pushes[req_id] = _Push(agent, dst, xfers, deadline)

    def _finish_push(self, req_id: str, agent: str, dst: str, error: str | None) -> None:
        """Tell the decode engine how the push of `req_id` (its `dst`) went; free the pages."""
        self.failures += error is not None
        note = encode_note("pushed", dst, ok=error is None, error=error)
        with contextlib.suppress(Exception):  # the decode engine is gone: its timeout decides
            self.transport.notify(agent, note)
        self._release(req_id)

    # -- both roles -------------------------------------------------------------------------

    def _drain(self) -> None:
        """Dispatch every new notification: `read` and `push` (producer), `pushed` (consumer)."""
        for agent, messages in self.transport.notifications().items():
            for message in messages:
                note = decode_note(message)
                if note is None:
                    continue
                op, req_id = note.get("op"), note["req"]
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
                elif op in ("pushed", "read_ack") and req_id in self.pulls:
                    ok = bool(note.get("ok"))
                    self.pulls[req_id].result = (ok, None if ok else str(note.get("error")))

    def _plan_peer(
        self,
        agent: str,
        decode: list[RankLayout],
        prefill: dict[int, RankLayout],
        push: bool,
    ) -> _Peer:
        """Plans and prepared lists of every decode rank against the prefill ranks. Lists of
        this engine's memory are prepared locally, the others with the peer's agent name."""
        plans, handles, lengths = [], [], []
        for local in decode:
            plan = plan_reads(local, prefill)
            plans.append(plan)
            pairs = []
            for read in plan.reads:
                descs = read.local_descriptors()
                decode_h = self.transport.prepare(descs, peer=agent if push else None)
                prefill_h = self.transport.prepare(
                    read.remote_descriptors(), peer=None if push else agent
                )
                pairs.append((decode_h, prefill_h))
            handles.append(pairs)
            lengths.append([[d[1] for d in read.local_descriptors()] for read in plan.reads])
        return _Peer(agent, prefill, plans, handles, lengths)

    # -- consumer ---------------------------------------------------------------------------

    def _peer(self, host: str, port: int) -> _Peer:
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
            self.peers[key] = self._plan_peer(agent, self.layouts, remote, push=False)
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
        posts, nbytes = [], 0
        for r, (plan, handles) in enumerate(zip(peer.plans, peer.handles, strict=True)):
            for s, (read, (local_h, remote_h)) in enumerate(zip(plan.reads, handles, strict=True)):
                local_ids, remote_ids = read.span_ids(
                    slots.block_tables, params["block_tables"], fill, tokens
                )
                if local_ids:
                    posts.append((local_h, local_ids, remote_h, remote_ids))
                    nbytes += peer.nbytes(r, s, local_ids)
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
        self.bytes_moved += nbytes
        self.pulls[req_id] = _Transfer(key, remote_req, xfers, deadline, nbytes)

    def release_remote(self, params: dict[str, Any]) -> None:
        """Tell a producer that its held pages of a request will not be read (the decode side
        gave the request up: aborted, waited too long for pages, or its transfer failed), so
        that it frees them now rather than at the end of the lease. Best effort."""
        with contextlib.suppress(Exception):  # an unreachable producer: its lease decides
            key = (params["host"], int(params["port"]))
            self.transport.notify(
                self._peer(*key).agent, encode_note("release", str(params["req_id"]))
            )

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
            if pull.result is not None:
                ok, reason = pull.result
                what = "push" if pull.push else "transfer"
                finished.append((req_id, ok, None if ok else f"{what} failed: {reason}"))
                self.bytes_received += pull.nbytes if ok else 0
                self._drop(req_id)
                continue
            if pull.deadline < now:
                finished.append((req_id, False, f"{'push' if pull.push else 'transfer'} timed out"))
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
        self.failures += sum(1 for _, ok, _ in finished if not ok)
        return finished

    def _drop(self, req_id: str) -> None:
        for xfer in self.pulls.pop(req_id).xfers:
            self.transport.release(xfer)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.transport.close()


__all__ = ["HandshakeError", "NixlConnector"]
