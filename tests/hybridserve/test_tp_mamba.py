"""Decode steps update each Mamba layer's state where it lies (`mamba2_step_paged`, per rank
over its own shard at TP > 1): Nemotron-H (2 B/C groups) gives the single-device xla logits at
TP 2 (one group per rank) and TP 4 (each group held by two ranks), with the xla reference and
the pallas kernel (interpret mode), over a prefill chunk and three decode steps after it, so
that each step reads the state the one before wrote (float32, within 1e-5 of the logit
scale)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridserve.config import CacheConfig
from hybridserve.core.outputs import ScheduledChunk, SchedulerOutput
from hybridserve.runner.factory import make_runner

_BASE: list[list[np.ndarray]] = []  # the one-device xla logits, computed once per module


def _logits(path, tp: int, backend: str) -> list[np.ndarray]:
    runner = make_runner(
        str(path),
        dtype="float32",
        tp=tp,
        backend=backend,
        cache=CacheConfig(num_pages=96),
        max_model_len=64,
    )
    tables = runner.scratch_tables(40)
    prompt = tuple(range(3, 23))
    out = [np.asarray(runner.prompt_logits(ScheduledChunk("a", prompt, 0, tables, True)))]
    for i, token in enumerate((7, 11, 5)):  # one-token decode steps: the in-place path
        chunk = ScheduledChunk("a", (token,), len(prompt) + i, tables, True)
        out.append(np.asarray(runner.compute_logits(SchedulerOutput((chunk,))).logits)[:1])
    return out


@pytest.mark.parametrize("backend,tp", [("xla", 2), ("xla", 4), ("pallas", 1), ("pallas", 4)])
def test_nemotron_decode_logits_at_tp_match_one_device(hf_checkpoint, backend, tp):
    path = hf_checkpoint("nemotron_h")[0]
    if not _BASE:
        _BASE.append(_logits(path, 1, "xla"))
    base = _BASE[0]
    scale = max(np.abs(b).max() for b in base)
    for got, want in zip(_logits(path, tp, backend), base, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
