"""Prefill/decode disaggregation: KV and Mamba-state transfers between engines over NIXL.

`descriptors` describes one rank's cache memory (`RankLayout`, sent in the handshake) and its
dual descriptor view; `tp_mapping` maps block ids to descriptor ids and plans the reads of a
decode rank from prefill ranks of any compatible TP size. Both are standard library only; the
NIXL agent (`transport`) and the side channel (`handshake`) use them.
"""

from __future__ import annotations

from hybridserve.disagg.descriptors import (
    DescRun,
    RankLayout,
    check_compatible,
    expand_runs,
    held_range,
    local_descriptors,
    local_runs,
    view_size,
)
from hybridserve.disagg.tp_mapping import (
    ReadPlan,
    SourceRead,
    descriptor_ids,
    expand_kernel_ids,
    layout_descriptor_ids,
    notifications_per_request,
    plan_reads,
    source_ranks,
)

__all__ = [
    "DescRun",
    "RankLayout",
    "ReadPlan",
    "SourceRead",
    "check_compatible",
    "descriptor_ids",
    "expand_kernel_ids",
    "expand_runs",
    "held_range",
    "layout_descriptor_ids",
    "local_descriptors",
    "local_runs",
    "notifications_per_request",
    "plan_reads",
    "source_ranks",
    "view_size",
]
