"""The NIXL connector of one engine: it moves a prompt's KV pages and Mamba states from a
prefill engine to a decode engine, with no copy on either side, by READs the decode side posts
("pull", the default) or WRITEs the prefill side posts ("push"), chosen by the decode engine's
`KVTransferConfig.transfer_mode`.

Lifecycle of one request:
  1. Prefill engine (`kv_producer`): the engine computes the prompt except its last token (a
     state-space layer cannot apply that token twice) and the scheduler holds the request's
     pages. `producer_params` returns the transfer parameters (`disagg.params`: engine id and
     epoch, side-channel address, block ids per group, token count, prompt hash, expiry; signed
     with the shared secret) and starts a lease (`disagg.producer`).
  2. Decode engine (`kv_consumer`, `disagg.consumer`): `accept_params` parses and checks them
     when the request arrives (signature, expiry, replay, prompt hash, allowed peer: a forged
     set fails the request with Forbidden). The producer is found by an authenticated
     handshake off the engine thread (`disagg.peer_directory`; once per producer epoch; plans
     with prepared descriptor lists, heterogeneous TP included). The scheduler then gives the
     request what a colocated engine would hold at its first decode step and says from which
     token each group must be filled (`RemoteSlots`); `start_transfer` computes the descriptor
     ids (`SourceRead.span_ids`: only the tokens to fill, never a null page), then
       pull: posts one READ per (local rank, source rank);
       push: sends the producer a `push` note with its tables and fill points.
  3. Push only: the producer posts the WRITEs, each carrying its part of the `pushed` answer,
     and frees its pages once they are done.
  4. Pull only: when the READs are done the decode engine sends `read`; the producer answers
     `read_ack`, ok only if it still held the pages (the lease had not expired, so nothing
     overwrote them during the READs), and releases them.
  5. `poll_consumer` reports finished transfers: on success (`read_ack`, or every part of
     `pushed`, with ok, from that producer's agent) the request runs from the transferred
     position; on failure or timeout it recomputes locally (or fails, per `failure_policy`),
     never decoding on pages that were not filled, and the producer is handshaken again before
     its next transfer. `keep_alive` sends `keep` heartbeats (every lease/4) for the requests
     still waiting; `release_remote` tells a producer a request was given up.
  6. `poll_producer` on the prefill side releases held pages on `read`, `release`, after its
     WRITEs, when a lease expires, or when released locally (`release_held`).
Notifications: `disagg.notes` (typed; anything else is dropped and counted).
"""

from __future__ import annotations

import queue
import uuid
from typing import Any

from hybridserve.cache.regions import CacheRegions
from hybridserve.config import KVTransferConfig
from hybridserve.core.connector import KVConnector, KVTransferParams
from hybridserve.disagg.consumer import Consumer
from hybridserve.disagg.descriptors import RankLayout, check_compatible
from hybridserve.disagg.handshake import HandshakeError, HandshakeServer
from hybridserve.disagg.notes import parse_note
from hybridserve.disagg.params import Forbidden
from hybridserve.disagg.peers import plan_peer
from hybridserve.disagg.producer import Producer
from hybridserve.disagg.transport import NixlTransport


class NixlConnector(KVConnector):
    """Producer and/or consumer role of one engine (see the module docstring), behind the
    `core.connector.KVConnector` interface that the engine's `core.kv_transfer` drives."""

    def __init__(self, config: KVTransferConfig, regions: CacheRegions) -> None:
        """`regions`: the engine's cache (`ModelRunner.cache_regions()`): every rank's region
        buffers are registered, and advertised with their layouts (`RankLayout`)."""
        self.config = config
        self.engine_id = config.engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.epoch = uuid.uuid4().hex[:12]  # this process: a restart is a new peer
        self.agent_name = f"{self.engine_id}:{self.epoch}"
        self.secret = config.secret_key
        self.layouts = [
            RankLayout.from_plan(
                regions.plan,
                regions.cfg,
                tp_rank=r,
                region_bases=regions.bases(r),
                num_pages=regions.num_pages,
                device_id=regions.device_id(r),
            )
            for r in range(regions.tp)
        ]
        mem = "VRAM" if regions.platform == "gpu" else "DRAM"
        delay = config.nixl_progress_delay_us
        self.transport = NixlTransport(
            self.agent_name,
            [b for rank in regions.buffers for b in rank],
            mem,
            num_threads=config.nixl_threads,
            progress_delay_us=(0 if mem == "VRAM" else 10_000) if delay is None else delay,
        )
        self.server: HandshakeServer | None = None
        self._joined: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        mine = dict(enumerate(self.layouts))
        self.producer = Producer(
            config,
            self.transport,
            lambda agent, layouts: plan_peer(self.transport, agent, layouts, mine, push=True),
            self.epoch,
        )
        if config.is_producer:
            info = {
                "engine_id": self.engine_id,
                "epoch": self.epoch,
                "agent_name": self.agent_name,
                "agent_metadata": self.transport.metadata(),
                "layouts": [layout.to_dict() for layout in self.layouts],
            }
            self.server = HandshakeServer(
                info,
                self._check_peer,
                config.host,
                config.port,
                timeout=config.handshake_timeout_s,
                secret=self.secret,
            )
        self.consumer = Consumer(config, self.transport, self.layouts, self.agent_name)
        self.refused_notes = 0  # notifications that are not valid notes
        self.join_failures = 0  # decode engines whose metadata NIXL refused
        self._closed = False

    @property
    def bytes_moved(self) -> int:
        """Bytes posted by this engine: READs as consumer, WRITEs as producer."""
        return self.consumer.bytes_moved + self.producer.bytes_moved

    @property
    def failures(self) -> int:
        """Failed transfers: decode requests that did not get their pages, pushes refused."""
        return self.consumer.failures + self.producer.failures

    @property
    def handshake_failures(self) -> int:
        """Handshakes that failed: ours (decode side), refused by our server, or joins NIXL
        refused."""
        refused = 0 if self.server is None else self.server.num_refused
        return self.consumer.directory.failures + refused + self.join_failures

    @property
    def idle(self) -> bool:
        """Nothing in flight: no held pages, transfers, pushes, handshakes or joins."""
        return (
            self.consumer.idle
            and not (self.producer.held or self.producer.pushes)
            and self._joined.empty()
        )

    def stats(self) -> dict[str, int]:
        return {
            "transfer_failures": self.failures,
            "transfer_bytes": self.bytes_moved,
            "transfer_bytes_received": self.consumer.bytes_received,
            "handshake_failures": self.handshake_failures,
            "refused_notes": (
                self.refused_notes + self.consumer.refused_notes + self.producer.refused_notes
            ),
        }

    # -- producer ---------------------------------------------------------------------------

    def _check_peer(self, request: dict[str, Any]) -> None:
        """Handshake thread: refuse an incompatible peer; queue a decode engine's metadata (the
        engine thread adds it, NIXL agents are not shared across threads)."""
        check_compatible(self.layouts[0], RankLayout.from_dict(request["layout"]))
        if "agent_metadata" in request:
            metadata, name = request["agent_metadata"], request.get("agent_name")
            if not isinstance(metadata, bytes) or not isinstance(name, str):
                raise ValueError("agent_metadata (bytes) and agent_name (str) are needed")
            layouts = [RankLayout.from_dict(d) for d in request["layouts"]]
            for layout in layouts:
                check_compatible(self.layouts[0], layout)
            self._joined.put({"metadata": metadata, "name": name, "layouts": layouts})

    def _add_consumers(self) -> None:
        """Engine thread: load the metadata of decode engines that joined. A decode engine
        that handshakes again keeps its agent; a restarted one (same engine id, new epoch)
        replaces its old agent."""
        while True:
            try:
                joined = self._joined.get_nowait()
            except queue.Empty:
                return
            producer = self.producer
            if joined["name"] in self.transport.peers:
                producer.consumer_layouts[joined["name"]] = joined["layouts"]
                continue
            try:
                agent = self.transport.add_peer(joined["metadata"])
            except HandshakeError:
                self.join_failures += 1
                continue
            engine = agent.rpartition(":")[0]
            for old in list(producer.consumer_layouts):
                if old != agent and old.rpartition(":")[0] == engine:
                    producer.forget_consumer(old)
            producer.consumer_layouts[agent] = joined["layouts"]

    def producer_params(
        self, req_id: str, tables: tuple[tuple[int, ...], ...], token_ids: list[int]
    ) -> dict[str, Any]:
        """Transfer parameters for the decode side; starts the request's lease."""
        assert self.server is not None, "not a kv_producer"
        host, port = self.server.host, self.server.port
        return self.producer.params(req_id, tables, token_ids, host, port, self.engine_id)

    def release_held(self, raw: Any) -> str | None:
        """Free the held pages named by transfer parameters this engine returned (the proxy
        saw the decode leg fail). Returns the req_id released, or None (not ours, not held,
        or a wrong signature)."""
        if not isinstance(raw, dict) or raw.get("engine_id") != self.engine_id:
            return None
        req_id, cap = raw.get("req_id"), raw.get("signature", "")
        if not isinstance(req_id, str) or not isinstance(cap, str):
            return None
        if self.producer._holds(req_id, cap) is None or not self.producer.release(req_id):
            return None
        return req_id

    def poll_producer(self) -> list[str]:
        """Requests whose held pages can be released: read by the decode side, written by us,
        given up, or lease over."""
        self._add_consumers()
        self._drain()
        return self.producer.poll()

    # -- both roles -------------------------------------------------------------------------

    def _drain(self) -> None:
        """Dispatch every new notification: `read`, `keep`, `push` and `release` to the
        producer, `read_ack` and `pushed` to the transfers waiting for them (only from the
        agent they were asked of)."""
        for agent, messages in self.transport.notifications().items():
            for message in messages:
                note = parse_note(message)
                if note is None:
                    self.refused_notes += 1
                    continue
                if note.op in ("read_ack", "pushed"):
                    self.consumer.answer(agent, note)
                elif self.config.is_producer:
                    self.producer.on_note(agent, note)

    # -- consumer ---------------------------------------------------------------------------

    def poll_consumer(self) -> list[tuple[str, bool, str | None]]:
        """Finished decode-side transfers (`Consumer.poll`), after dispatching notifications."""
        self._drain()
        return self.consumer.poll()

    # -- the KVConnector interface ------------------------------------------------------------

    def parse_params(self, raw: Any, token_ids: list[int]) -> KVTransferParams:
        """`Consumer.accept_params` (ValueError; Forbidden for forged or replayed ones)."""
        params = self.consumer.accept_params(raw, token_ids)
        return KVTransferParams(num_tokens=params.num_tokens, remote=params)

    def lookup_peer(self, params: KVTransferParams) -> Any | None:
        return self.consumer.peer_for(params.remote)

    def request_finished(
        self, req_id: str, block_tables: Any, token_ids: list[int]
    ) -> dict[str, Any]:
        return self.producer_params(req_id, tuple(map(tuple, block_tables)), token_ids)

    def released(self) -> list[str]:
        return self.poll_producer()

    def release(self, raw: Any) -> str | None:
        return self.release_held(raw)

    def give_up(self, params: KVTransferParams) -> None:
        self.consumer.release_remote(params.remote)

    def keep_alive(self, waiting: list[KVTransferParams]) -> None:
        """Send the notes that waited for a handshake, then heartbeats (`Consumer.keep_alive`)."""
        self.consumer.flush()
        if waiting or self.consumer.pulls:
            self.consumer.keep_alive([p.remote for p in waiting])

    def count_failure(self) -> None:
        self.consumer.count_failure()

    def start_load(self, req_id: str, params: KVTransferParams, slots: Any, peer: Any) -> None:
        self.consumer.start_transfer(req_id, params.remote, slots, peer)

    def finished_loads(self) -> list[tuple[str, bool, str | None]]:
        return self.poll_consumer()

    def loading(self, req_id: str) -> bool:
        return req_id in self.consumer.pulls

    def close(self) -> None:
        """Close the handshake server, the prepared transfers, the registered memory and the
        agent (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.server is not None:
            self.server.close()
        self.consumer.close()
        self.transport.close()


__all__ = ["Forbidden", "HandshakeError", "NixlConnector"]
