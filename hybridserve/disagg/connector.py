"""The NIXL connector of one engine: it moves a prompt's KV pages and Mamba states from a
prefill engine to a decode engine, with no copy on either side.

Lifecycle of one request:
  1. Prefill engine (`kv_producer`): the engine computes the prompt except its last token (a
     state-space layer cannot apply that token twice) and the scheduler holds the request's
     pages. `producer_params` returns the transfer parameters (engine id, side-channel address,
     block ids per group, token count) and starts a lease.
  2. Decode engine (`kv_consumer`): the scheduler allocates pages for those tokens and parks the
     request; `start_pull` fetches the producer's agent metadata and layouts over the side
     channel (once per producer), plans the reads of every local rank (heterogeneous TP
     included) with prepared descriptor lists (once per producer), and posts one READ per
     (local rank, source rank) with the request's descriptor ids.
  3. `poll` on the decode side reports finished transfers: on success the decode engine notifies
     the producer (one notification per request) and the request runs from the transferred
     position; on failure it recomputes locally (or fails, per `failure_policy`).
  4. `poll` on the prefill side drains notifications and releases held pages; a lease that
     expires (the decode side died or never read) releases them too.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import jax

from hybridserve.config import KVTransferConfig
from hybridserve.disagg.descriptors import RankLayout, check_compatible
from hybridserve.disagg.handshake import HandshakeError, HandshakeServer, fetch_peer
from hybridserve.disagg.tp_mapping import ReadPlan, plan_reads
from hybridserve.disagg.transport import NixlTransport, TransferError


def shard_buffers(regions: list[jax.Array]) -> list[list[tuple[int, int, int]]]:
    """Per TP rank, the (address, bytes, device id) of every region's shard of that rank."""
    tp = regions[0].shape[0]
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(tp)]
    for region in regions:
        for shard in region.addressable_shards:
            rank = shard.index[0].start or 0
            out[rank].append(
                (
                    shard.data.unsafe_buffer_pointer(),
                    shard.data.nbytes,
                    shard.device.id if shard.device.platform != "cpu" else 0,
                )
            )
    return out


@dataclasses.dataclass
class _Peer:
    agent: str
    layouts: dict[int, RankLayout]
    plans: list[ReadPlan]  # per local rank
    handles: list[list[tuple[Any, Any]]]  # per local rank, per source: (local, remote) lists


@dataclasses.dataclass
class _Pull:
    peer: tuple[str, int]
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
        self.transport = NixlTransport(self.engine_id, [b for rank in buffers for b in rank], mem)
        self.server: HandshakeServer | None = None
        if config.is_producer:
            info = {
                "engine_id": self.engine_id,
                "agent_name": self.engine_id,
                "agent_metadata": self.transport.metadata(),
                "layouts": [layout.to_dict() for layout in self.layouts],
            }
            self.server = HandshakeServer(info, self._check_peer, config.host, config.port)
        self.leases: dict[str, float] = {}  # producer: req_id -> deadline
        self.peers: dict[tuple[str, int], _Peer] = {}
        self.pulls: dict[str, _Pull] = {}
        self.bytes_moved = 0
        self.failures = 0

    # -- producer ---------------------------------------------------------------------------

    def _check_peer(self, request: dict[str, Any]) -> None:
        check_compatible(self.layouts[0], RankLayout.from_dict(request["layout"]))

    def producer_params(
        self, req_id: str, tables: tuple[tuple[int, ...], ...], num_tokens: int
    ) -> dict[str, Any]:
        """Transfer parameters for the decode side; starts the request's lease."""
        assert self.server is not None, "not a kv_producer"
        self.leases[req_id] = time.monotonic() + self.config.lease_s
        return {
            "engine_id": self.engine_id,
            "host": self.server.host,
            "port": self.server.port,
            "block_tables": [list(t) for t in tables],
            "num_tokens": num_tokens,
        }

    def poll_producer(self) -> list[str]:
        """Requests whose held pages can be released: read by the decode side, or lease over."""
        done = []
        for _peer, messages in self.transport.notifications().items():
            for message in messages:
                req_id = message.decode()
                if self.leases.pop(req_id, None) is not None:
                    done.append(req_id)
        now = time.monotonic()
        for req_id, deadline in list(self.leases.items()):
            if deadline < now:
                del self.leases[req_id]
                done.append(req_id)
        return done

    # -- consumer ---------------------------------------------------------------------------

    def _peer(self, host: str, port: int) -> _Peer:
        key = (host, port)
        if key not in self.peers:
            info = fetch_peer(
                host,
                port,
                {"layout": self.layouts[0].to_dict()},
                timeout=self.config.handshake_timeout_s,
            )
            remote = {d["tp_rank"]: RankLayout.from_dict(d) for d in info["layouts"]}
            for layout in remote.values():
                check_compatible(self.layouts[0], layout)
            agent = self.transport.add_peer(info["agent_metadata"])
            plans, handles = [], []
            for local in self.layouts:
                plan = plan_reads(local, remote)
                plans.append(plan)
                handles.append(
                    [
                        (
                            self.transport.prepare(read.local_descriptors()),
                            self.transport.prepare(read.remote_descriptors(), peer=agent),
                        )
                        for read in plan.reads
                    ]
                )
            self.peers[key] = _Peer(agent, remote, plans, handles)
        return self.peers[key]

    def start_pull(
        self, req_id: str, params: dict[str, Any], local_tables: tuple[tuple[int, ...], ...]
    ) -> None:
        """Post the READs that fill `local_tables` from the producer's pages."""
        key = (params["host"], int(params["port"]))
        peer = self._peer(*key)
        remote_tables = [list(t) for t in params["block_tables"]]
        xfers = []
        for plan, handles in zip(peer.plans, peer.handles, strict=True):
            for read, (local_h, remote_h) in zip(plan.reads, handles, strict=True):
                local_ids, remote_ids = read.descriptor_ids(local_tables, remote_tables)
                if local_ids:
                    xfers.append(
                        self.transport.start("READ", local_h, local_ids, remote_h, remote_ids)
                    )
        self.pulls[req_id] = _Pull(key, xfers, time.monotonic() + self.config.transfer_timeout_s)

    def poll_consumer(self) -> list[tuple[str, bool, str | None]]:
        """Finished pulls: (req_id, ok, reason when not ok). Notifies producers of successes."""
        finished = []
        now = time.monotonic()
        for req_id, pull in list(self.pulls.items()):
            try:
                states = [self.transport.poll(x) for x in pull.xfers]
            except TransferError as err:
                finished.append((req_id, False, f"transfer failed: {err}"))
                self._drop(req_id)
                continue
            if all(s == "DONE" for s in states):
                self._drop(req_id)
                self.transport.notify(self.peers[pull.peer].agent, req_id.encode())
                finished.append((req_id, True, None))
            elif pull.deadline < now:
                finished.append((req_id, False, "transfer timed out"))
                self._drop(req_id)
        self.failures += sum(1 for _, ok, _ in finished if not ok)
        return finished

    def _drop(self, req_id: str) -> None:
        for xfer in self.pulls.pop(req_id).xfers:
            self.transport.release(xfer)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.transport.close()


__all__ = ["HandshakeError", "NixlConnector", "shard_buffers"]
