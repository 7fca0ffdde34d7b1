"""The decode program's temporaries are a sliver of the cache: it reads and writes the regions
where they lie (no gathered state pages, no copied K/V halves, no whole-region copies).

Compiled memory analysis of the decode step of a random-weight model (`scripts/random_models`
"tiny" shape, bfloat16) over a pool of 4096 pages, one row: its temporary bytes must stay under
1% of the region bytes. A whole-region copy, a slice of the K or V half of a region, or the
whole-page state gathers of before all exceed it. On the GPU, with the default backend (the
pallas kernels compiled); on the CPU the pallas kernels run in interpret mode, which copies
the refs it writes, so the test asks for a GPU. The suite's conftest makes jax use the CPU
unless JAX_PLATFORMS says otherwise: on a GPU machine run
    JAX_PLATFORMS=cuda python -m pytest tests/cache/test_decode_memory.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import random_models  # noqa: E402

from hybridserve.config import CacheConfig  # noqa: E402
from hybridserve.core.outputs import ScheduledChunk, SchedulerOutput  # noqa: E402
from hybridserve.runner.factory import make_runner  # noqa: E402


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (see the docstring)")
@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_decode_temporaries_under_one_percent_of_the_regions(tmp_path, backend):
    model = random_models.write_config("tiny", tmp_path / "m")
    runner = make_runner(
        str(model),
        dtype="bfloat16",
        backend=backend,
        cache=CacheConfig(num_pages=4096),
        max_model_len=64,
        load_format="dummy",
    )
    analyses = []
    step = runner._step

    def spy(*args, **kwargs):  # the keyword arguments are the static ones
        program = step.lower(*args, **kwargs).compile()
        analyses.append(program.memory_analysis())
        return program(*args)

    runner._step = spy
    tables = runner.scratch_tables(40)
    runner.compute_logits(
        SchedulerOutput((ScheduledChunk("a", tuple(range(3, 23)), 0, tables, True),))
    )
    runner.compute_logits(SchedulerOutput((ScheduledChunk("a", (7,), 20, tables, True),)))
    region_bytes = sum(r.nbytes for r in runner.regions)
    decode = analyses[-1]
    print(f"{backend}: decode temporaries {decode.temp_size_in_bytes} B, regions {region_bytes} B")
    assert decode.alias_size_in_bytes >= region_bytes  # the regions are updated in place
    assert decode.temp_size_in_bytes < 0.01 * region_bytes
