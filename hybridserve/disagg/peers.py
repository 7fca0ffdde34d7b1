"""A remote engine as one connector sees it: its agent, its ranks' layouts, and the read plans
of every decode rank against the prefill ranks with their prepared NIXL descriptor lists
(built once per pair of engines, `plan_peer`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridserve.disagg.descriptors import RankLayout
from hybridserve.disagg.tp_mapping import ReadPlan, plan_reads


@dataclasses.dataclass
class Peer:
    """`plans[r]` are the reads of decode rank r; `handles[r][s]` = (decode-side list,
    prefill-side list) of its read s; `lengths[r][s][i]`: bytes of descriptor i of read s."""

    agent: str
    layouts: dict[int, RankLayout]
    plans: list[ReadPlan]
    handles: list[list[tuple[Any, Any]]]
    lengths: list[list[list[int]]]
    epoch: str = ""  # the producer's process identity (its agent is `engine_id:epoch`)
    stale: bool = False  # a transfer failed: handshake again before the next one

    @property
    def prepared(self) -> list[Any]:
        """Every prepared descriptor list of this peer (to release when it is dropped)."""
        return [h for pairs in self.handles for pair in pairs for h in pair]

    def nbytes(self, r: int, s: int, ids: list[int]) -> int:
        lengths = self.lengths[r][s]
        return sum(lengths[i] for i in ids)

    def request_ids(
        self,
        decode_tables: Any,
        prefill_tables: Any,
        fill_from: list[int],
        num_tokens: int,
    ) -> tuple[list[tuple[Any, list[int], Any, list[int]]], int]:
        """The descriptor ids of one request over every read (`SourceRead.span_ids`): a list of
        (decode handle, decode ids, prefill handle, prefill ids), reads without ids left out,
        and the bytes that land on the decode side. Raises ValueError (TypeError, IndexError
        for malformed tables) before anything is posted."""
        posts, nbytes = [], 0
        for r, (plan, handles) in enumerate(zip(self.plans, self.handles, strict=True)):
            for s, (read, (decode_h, prefill_h)) in enumerate(
                zip(plan.reads, handles, strict=True)
            ):
                decode_ids, prefill_ids = read.span_ids(
                    decode_tables, prefill_tables, fill_from, num_tokens
                )
                if decode_ids:
                    posts.append((decode_h, decode_ids, prefill_h, prefill_ids))
                    nbytes += self.nbytes(r, s, decode_ids)
        return posts, nbytes


def plan_peer(
    transport: Any,
    agent: str,
    decode: list[RankLayout],
    prefill: dict[int, RankLayout],
    push: bool,
) -> Peer:
    """Plans and prepared lists of every decode rank against the prefill ranks. Lists of the
    calling engine's memory (the decode side's when pulling, the prefill side's when pushing)
    are prepared locally, the others with the peer's agent name."""
    plans, handles, lengths = [], [], []
    try:
        for local in decode:
            plan = plan_reads(local, prefill)
            plans.append(plan)
            pairs: list[tuple[Any, Any]] = []
            handles.append(pairs)
            for read in plan.reads:
                decode_h = transport.prepare(read.local_descriptors(), peer=agent if push else None)
                try:
                    prefill_h = transport.prepare(
                        read.remote_descriptors(), peer=None if push else agent
                    )
                except BaseException:
                    transport.release_prepared([decode_h])
                    raise
                pairs.append((decode_h, prefill_h))
            lengths.append([[d[1] for d in read.local_descriptors()] for read in plan.reads])
    except BaseException:  # nothing prepared for a peer we cannot plan is kept
        transport.release_prepared([h for pairs in handles for pair in pairs for h in pair])
        raise
    return Peer(agent, prefill, plans, handles, lengths)
