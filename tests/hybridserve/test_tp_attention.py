"""Tensor-parallel attention reads each rank's own shard of the cache (`shard_map`, no copy of
the region): Inkling (full + sliding attention with the relative term, sconvs, MoE) gives the
single-device logits at TP 2 (one KV head per rank) and TP 4 (each KV head held by two ranks),
on a prefill chunk longer than the sliding window and on the decode step after it (float32,
within 1e-5 of the logit scale). The region-copy check is in tests/cache/test_regions.py."""

from __future__ import annotations

import numpy as np
import pytest

from hybridserve.config import CacheConfig
from hybridserve.core.outputs import ScheduledChunk
from hybridserve.runner.factory import make_runner
from tests.hybridserve.inkling_models import build_inkling, save_inkling, tiny_inkling


@pytest.fixture(scope="module")
def inkling(tmp_path_factory):
    cfg = tiny_inkling()
    assert cfg.attention.sliding_window is not None and cfg.attention.rel_dim is not None
    return save_inkling(build_inkling(cfg, seed=3), cfg, tmp_path_factory.mktemp("ink") / "m")


def _logits(path, tp: int) -> tuple[np.ndarray, np.ndarray]:
    runner = make_runner(
        path, dtype="float32", tp=tp, cache=CacheConfig(num_pages=96), max_model_len=64
    )
    tables = runner.scratch_tables(40)
    prompt = tuple(range(3, 23))  # 20 tokens: past the window of 6
    first = runner.prompt_logits(ScheduledChunk("a", prompt, 0, tables, True))
    after = runner.prompt_logits(ScheduledChunk("a", (7,), len(prompt), tables, True))
    return np.asarray(first), np.asarray(after)


@pytest.mark.parametrize("tp", [2, 4])
def test_inkling_logits_at_tp_match_one_device(inkling, tp):
    base = _logits(inkling, 1)
    scale = np.abs(base[0]).max()
    for got, want in zip(_logits(inkling, tp), base, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
