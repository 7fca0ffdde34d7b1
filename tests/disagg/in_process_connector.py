"""A KV connector test double: engines in one process hand pages over by copying bytes.

It implements `core.connector.KVConnector` without NIXL, handshakes or notifications: the
producer keeps a registry entry per held request, and the consumer copies the held pages
straight from the producer's region memory into its own (whole pages: the coarse view of
`disagg.request_spans`, so equal TP and page size only). Swapping it in for NIXL shows the
engine knows nothing of the transport: the P/D engine tests pass over either.

    register_connector("InProcessConnector", "in_process_connector:InProcessConnector")
    KVTransferConfig(kv_role="kv_producer", kv_connector="InProcessConnector")
"""

from __future__ import annotations

import ctypes
import hashlib
import uuid
from typing import Any

from hybridserve.cache.regions import CacheRegions
from hybridserve.config import KVTransferConfig
from hybridserve.core.connector import KVConnector, KVTransferParams, register_connector

NAME = "InProcessConnector"
_ENGINES: dict[str, InProcessConnector] = {}  # engine_id -> its live connector


def register() -> None:
    """Make `KVTransferConfig(kv_connector=NAME)` build this double."""
    register_connector(NAME, f"{__name__}:InProcessConnector")


def _digest(token_ids: list[int]) -> str:
    return hashlib.sha256(repr([int(t) for t in token_ids]).encode()).hexdigest()


class InProcessConnector(KVConnector):
    """Producer and consumer roles of one engine in this process (see the module docstring)."""

    def __init__(self, config: KVTransferConfig, regions: CacheRegions) -> None:
        self.config = config
        self.engine_id = config.engine_id or f"inproc-{uuid.uuid4().hex[:8]}"
        self.regions = regions
        self.plan = regions.plan
        self.held: dict[str, tuple[tuple[tuple[int, ...], ...], str]] = {}
        self._released: list[str] = []
        self._finished: list[tuple[str, bool, str | None]] = []
        self.failures = 0
        self.bytes_moved = 0
        _ENGINES[self.engine_id] = self

    # -- producer ---------------------------------------------------------------------------

    def request_finished(self, req_id, block_tables, token_ids) -> dict[str, Any]:
        tables = tuple(tuple(int(p) for p in t) for t in block_tables)
        self.held[req_id] = (tables, _digest(token_ids))
        return {
            "engine_id": self.engine_id,
            "req_id": req_id,
            "block_tables": [list(t) for t in tables],
            "num_tokens": len(token_ids),
        }

    def released(self) -> list[str]:
        out, self._released = self._released, []
        return out

    def release(self, raw: Any) -> str | None:
        if not isinstance(raw, dict) or raw.get("engine_id") != self.engine_id:
            return None
        req_id = raw.get("req_id")
        if not isinstance(req_id, str) or self.held.pop(req_id, None) is None:
            return None
        return req_id

    def _hand_over(self, req_id: str) -> None:
        """The decode side copied (or gave up) a held request: free its pages next poll."""
        if self.held.pop(req_id, None) is not None:
            self._released.append(req_id)

    # -- consumer ---------------------------------------------------------------------------

    def parse_params(self, raw: Any, token_ids: list[int]) -> KVTransferParams:
        engine, req_id, n = raw.get("engine_id"), raw.get("req_id"), raw.get("num_tokens")
        tables = raw.get("block_tables")
        if not isinstance(engine, str) or not isinstance(req_id, str):
            raise ValueError("kv_transfer_params: engine_id and req_id must be strings")
        if type(n) is not int or not 0 < n < len(token_ids):
            raise ValueError(f"kv_transfer_params: num_tokens must be in [1, {len(token_ids)})")
        if not isinstance(tables, list) or not all(
            isinstance(t, list) and all(type(p) is int for p in t) for t in tables
        ):
            raise ValueError("kv_transfer_params: block_tables must be lists of page ids")
        producer = _ENGINES.get(engine)
        if producer is not None and producer.held.get(req_id, (None, None))[1] != _digest(
            token_ids[:n]
        ):
            raise ValueError("kv_transfer_params: the prompt is not the one the producer ran")
        return KVTransferParams(num_tokens=n, remote=raw)

    def lookup_peer(self, params: KVTransferParams) -> InProcessConnector:
        producer = _ENGINES.get(params.remote["engine_id"])
        if producer is None:
            raise ValueError(f"no engine {params.remote['engine_id']!r} in this process")
        return producer

    def start_load(self, req_id, params, slots, peer) -> None:
        remote = peer.held.get(params.remote["req_id"])
        if remote is None:
            raise ValueError("the producer holds no pages for this request")
        pairs = self._page_pairs(slots, remote[0])
        # Both engines' steps are done (an engine reads its tokens before it polls), so no
        # program is writing these pages; the region addresses never change.
        mine, theirs = self.regions.buffers, peer.regions.buffers
        if len(mine) != len(theirs) or len(mine[0]) != len(theirs[0]):
            raise ValueError("the in-process double moves pages between equal TP layouts only")
        page = mine[0][0][1] // self.regions.num_pages
        if page != theirs[0][0][1] // peer.regions.num_pages:
            raise ValueError("the in-process double needs equal page sizes")
        for rank_mine, rank_theirs in zip(mine, theirs, strict=True):
            for (dst_base, _, _), (src_base, _, _) in zip(rank_mine, rank_theirs, strict=True):
                for src, dst in pairs:
                    ctypes.memmove(dst_base + dst * page, src_base + src * page, page)
                    self.bytes_moved += page
        peer._hand_over(params.remote["req_id"])
        self._finished.append((req_id, True, None))

    def _page_pairs(self, slots, remote_tables) -> list[tuple[int, int]]:
        """(producer page, decode page) of every page the transfer fills."""
        block, pairs = self.plan.block_size, []
        for g, group in enumerate(self.plan.groups):
            local, remote = slots.block_tables[g], remote_tables[g]
            if group.kind == "mamba":
                span = range(1)
            else:
                span = range(slots.fill_from[g] // block, -(-slots.num_tokens // block))
            for j in span:
                if not (local[j] > 0 and remote[j] > 0):
                    raise ValueError(f"group {g}: entry {j} is the null page on one side")
                pairs.append((remote[j], local[j]))
        return pairs

    def finished_loads(self) -> list[tuple[str, bool, str | None]]:
        out, self._finished = self._finished, []
        return out

    def loading(self, req_id: str) -> bool:
        return False  # every copy is done inside start_load

    def give_up(self, params: KVTransferParams) -> None:
        producer = _ENGINES.get(params.remote["engine_id"])
        if producer is not None:
            producer._hand_over(params.remote["req_id"])

    def count_failure(self) -> None:
        self.failures += 1

    @property
    def idle(self) -> bool:
        return not (self.held or self._released or self._finished)

    def stats(self) -> dict[str, int]:
        moved = self.bytes_moved  # this double moves bytes only as the receiving side
        return {
            "transfer_failures": self.failures,
            "transfer_bytes": moved,
            "transfer_bytes_received": moved,
        }

    def close(self) -> None:
        _ENGINES.pop(self.engine_id, None)
