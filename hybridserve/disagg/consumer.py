"""The decode side of a connector: transfer parameters checked at the boundary, producers
found by handshakes off the engine thread (`disagg.peer_directory`), and the transfers that
fill a request's pages (READs it posts, or WRITEs it asked a producer for).

Lifecycle of one decode request's transfer (the connector's steps 2, 4 and 5):
  1. `accept_params` when the request arrives: parse, check the producer may be contacted,
     verify signature, expiry and prompt hash, refuse a replay. Nothing is sent.
  2. `peer_for` until the producer's handshake is done (None meanwhile, never blocking).
  3. `start_transfer`: post the READs (pull) or send the `push` note.
  4. `answer` (from the connector's notification dispatch, only for the producer's agent)
     records `read_ack` or `pushed` parts; `poll` reports finished transfers, sends `read` once
     the READs are done, and fails transfers past their deadline or that NIXL failed (the
     producer is handshaken again before its next transfer).
  5. `keep_alive` renews the producers' leases of waiting requests; `release_remote` tells a
     producer a request was given up (after its handshake if one is still running: `flush`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

from hybridserve.config import KVTransferConfig
from hybridserve.core.outputs import RemoteSlots
from hybridserve.disagg.descriptors import RankLayout
from hybridserve.disagg.handshake import HandshakeError
from hybridserve.disagg.notes import Note, encode_note
from hybridserve.disagg.params import Forbidden, ReplayGuard, TransferParams, peer_allowed
from hybridserve.disagg.peer_directory import PeerDirectory
from hybridserve.disagg.peers import Peer
from hybridserve.disagg.transport import NixlTransport, TransferError


@dataclasses.dataclass
class _Transfer:
    """A decode request waiting for its pages: READs in flight (pull) or `pushed` (push)."""

    peer: Peer
    params: TransferParams
    xfers: list[Any]
    deadline: float
    nbytes: int  # what lands in this engine's pages
    push: bool = False
    read_sent: bool = False  # pull: the READs are done and `read` went out
    parts: set[int] = dataclasses.field(default_factory=set)  # push: `pushed` parts received
    result: tuple[bool, str | None] | None = None  # set by `read_ack` or `pushed`

    def answer(self, note: Note) -> None:
        """`read_ack`, or one `pushed` part: a failure ends the transfer, success once every
        part is in."""
        if not note.ok:
            self.result = (False, str(note.error))
        elif note.op == "read_ack":
            self.result = (True, None)
        elif note.part < max(note.parts, 1):
            self.parts.add(note.part)
            if len(self.parts) >= note.parts:
                self.result = (True, None)


class Consumer:
    """The decode role of one engine's connector (module docstring)."""

    def __init__(
        self,
        config: KVTransferConfig,
        transport: NixlTransport,
        layouts: list[RankLayout],
        agent_name: str,
    ) -> None:
        self.config = config
        self.transport = transport
        self.layouts = layouts
        self.agent_name = agent_name
        self.secret = config.secret_key
        self.directory = PeerDirectory(
            transport, layouts, self._handshake_request, config.handshake_timeout_s, self.secret
        )
        self.pulls: dict[str, _Transfer] = {}
        self._later: list[tuple[TransferParams, bytes]] = []  # notes waiting for a handshake
        self._replays = ReplayGuard()
        self._next_keep = 0.0
        self.bytes_moved = 0  # READs posted
        self.bytes_received = 0  # landed in this engine's pages by completed transfers
        self.failures = 0  # requests that did not get their pages
        self.refused_notes = 0  # answers from an agent that is not the transfer's producer

    @property
    def idle(self) -> bool:
        return not (self.pulls or self._later or self.directory)

    def count_failure(self) -> None:
        """A decode request gave up its transfer before posting it (handshake, no pages)."""
        self.failures += 1

    def answer(self, agent: str, note: Note) -> None:
        """A `read_ack` or `pushed` note: it counts only from the transfer's producer."""
        pull = self.pulls.get(note.req)
        if pull is None or pull.peer.agent != agent:
            self.refused_notes += 1
        elif note.op == "read_ack" or pull.push:
            pull.answer(note)

    def _handshake_request(self) -> dict[str, Any]:
        """What we tell a producer (after the proofs): it notifies us and may write to us."""
        return {
            "layout": self.layouts[0].to_dict(),
            "agent_name": self.agent_name,
            "agent_metadata": self.transport.metadata(),
            "layouts": [layout.to_dict() for layout in self.layouts],
        }

    def accept_params(self, raw: Any, token_ids: list[int]) -> TransferParams:
        """Decode side, when a request arrives: parse its transfer parameters (ValueError) and
        refuse (Forbidden) forged, expired, replayed or foreign ones, and producers this engine
        may not contact. No connection is made here."""
        params = TransferParams.parse(raw, len(token_ids))
        if not peer_allowed(
            params.host, params.port, self.config.allowed_peers, self.secret is not None
        ):
            raise Forbidden(
                f"kv_transfer_params: producer {params.host}:{params.port} is not allowed "
                "(allowed_peers; without a shared secret only loopback producers)"
            )
        params.verify(self.secret, token_ids)
        self._replays.claim(params)
        return params

    def peer_for(self, params: TransferParams) -> Peer | None:
        """The producer of `params` once its handshake is done (None while it runs); raises
        HandshakeError when it failed."""
        return self.directory.lookup(params)

    def start_transfer(
        self, req_id: str, params: TransferParams, slots: RemoteSlots, peer: Peer
    ) -> None:
        """Fill the pages `slots` names (from token `slots.fill_from[g]` of each group) from
        the producer's pages: post the READs (pull) or ask the producer to WRITE them (push).
        Raises (nothing posted) on parameters that do not fit the producer's layout or a post
        NIXL refuses."""
        deadline = time.monotonic() + self.config.transfer_timeout_s
        fill, tokens = list(slots.fill_from), slots.num_tokens
        posts, nbytes = peer.request_ids(slots.block_tables, params.block_tables, fill, tokens)
        if self.config.transfer_mode == "push":
            note = encode_note(
                "push",
                params.req_id,
                dst=req_id,
                cap=params.signature,
                tables=[list(t) for t in slots.block_tables],
                fill=fill,
                tokens=tokens,
            )
            self.transport.notify(peer.agent, note)
            self.pulls[req_id] = _Transfer(peer, params, [], deadline, nbytes, push=True)
            return
        xfers = []
        try:
            for local_h, local_ids, remote_h, remote_ids in posts:
                xfers.append(self.transport.start("READ", local_h, local_ids, remote_h, remote_ids))
        except TransferError:
            for xfer in xfers:
                self.transport.release(xfer)
            self.directory.mark_stale(peer)
            raise
        self.bytes_moved += nbytes
        self.pulls[req_id] = _Transfer(peer, params, xfers, deadline, nbytes)

    def release_remote(self, params: TransferParams) -> None:
        """Tell a producer that its held pages of a request will not be read (the decode side
        gave the request up), so that it frees them now rather than at the end of the lease.
        Best effort, and only to a producer already handshaken (never connects)."""
        note = encode_note("release", params.req_id, cap=params.signature)
        peer = self.directory.ready(params)
        if peer is None and params.peer in self.directory.pending:
            self._later.append((params, note))  # sent once the handshake is done
        elif peer is not None:
            with contextlib.suppress(TransferError):  # a dead producer: its lease decides
                self.transport.notify(peer.agent, note)

    def flush(self) -> None:
        """Send the notes that waited for their producer's handshake (dropped if it failed:
        the producer's lease frees the pages)."""
        later, self._later = self._later, []
        for params, note in later:
            if params.peer in self.directory.pending:
                try:
                    self.directory.lookup(params)  # joins the handshake once it is done
                except HandshakeError:
                    continue
            peer = self.directory.ready(params)
            if peer is not None:
                with contextlib.suppress(TransferError):
                    self.transport.notify(peer.agent, note)
            elif params.peer in self.directory.pending:
                self._later.append((params, note))

    def keep_alive(self, waiting: list[TransferParams]) -> None:
        """Every `lease_s / 4` (the shortest lease among them), renew the leases of the
        requests still waiting: `waiting` (without pages yet) and the transfers in flight.
        One `keep` notification per producer already handshaken."""
        now = time.monotonic()
        if now < self._next_keep:
            return
        reqs: dict[str, list[list[str]]] = {}
        lease = self.config.lease_s
        for params in [*waiting, *(p.params for p in self.pulls.values())]:
            peer = self.directory.ready(params)
            if peer is not None:
                reqs.setdefault(peer.agent, []).append([params.req_id, params.signature])
            lease = min(lease, params.lease_s)
        for agent, ids in reqs.items():
            with contextlib.suppress(TransferError):  # a dead producer: the transfer decides
                self.transport.notify(agent, encode_note("keep", "", reqs=ids))
        self._next_keep = now + lease / 4

    def poll(self) -> list[tuple[str, bool, str | None]]:
        """Finished transfers: (req_id, ok, reason when not ok). Notifies producers of reads."""
        finished = []
        now = time.monotonic()
        for req_id, pull in list(self.pulls.items()):
            what = "push" if pull.push else "transfer"
            error = None
            if pull.result is not None:
                ok, reason = pull.result
                if ok:
                    finished.append((req_id, True, None))
                    self.bytes_received += pull.nbytes
                    self._drop(req_id)
                    continue
                error = f"{what} failed: {reason}"
            elif pull.deadline < now:
                error = f"{what} timed out"
            elif not (pull.push or pull.read_sent):
                try:
                    done = all(self.transport.poll(x) == "DONE" for x in pull.xfers)
                except TransferError as err:
                    done, error = False, f"transfer failed: {err}"
                if done:  # the READs are in: ask the producer whether it held the pages
                    for xfer in pull.xfers:
                        self.transport.release(xfer)
                    pull.xfers, pull.read_sent = [], True
                    note = encode_note(
                        "read", pull.params.req_id, dst=req_id, cap=pull.params.signature
                    )
                    try:
                        self.transport.notify(pull.peer.agent, note)
                    except TransferError as err:
                        error = f"transfer failed: {err}"
            if error is not None:
                finished.append((req_id, False, error))
                self.directory.mark_stale(pull.peer)
                self._drop(req_id)
        self.failures += sum(1 for _, ok, _ in finished if not ok)
        self.directory.collect({p.peer.agent for p in self.pulls.values()})
        return finished

    def _drop(self, req_id: str) -> None:
        for xfer in self.pulls.pop(req_id).xfers:
            self.transport.release(xfer)

    def _drop(self, req_id: str) -> None:
        for xfer in self.pulls.pop(req_id).xfers:
            self.transport.release(xfer)

    def close(self) -> None:
        self.directory.close()
