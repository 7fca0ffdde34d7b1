"""Region allocation on CPU (XLA) and the per-rank buffer list NIXL registers."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridserve.cache.regions import allocate_regions, shard_buffers
from hybridserve.cache.view import WORD, WORD_BYTES


def test_cpu_regions_are_xla_zeros_even_when_shareable_is_asked():
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    sharding = NamedSharding(mesh, PartitionSpec("tp", None, None))
    regions, owners = allocate_regions((2, 8, 16), 3, sharding, shareable=True)
    assert owners == []  # CPU memory from XLA is what UCX wants there
    assert len(regions) == 3
    for region in regions:
        assert region.shape == (2, 8, 16) and region.dtype == WORD
        assert not np.asarray(region).any()
    buffers = shard_buffers(regions)
    assert len(buffers) == 2 and all(len(rank) == 3 for rank in buffers)
    for rank, per_rank in enumerate(buffers):
        for region, (addr, nbytes, device) in zip(regions, per_rank, strict=True):
            (shard,) = [s for s in region.addressable_shards if (s.index[0].start or 0) == rank]
            assert addr == shard.data.unsafe_buffer_pointer()
            assert nbytes == 8 * 16 * WORD_BYTES and device == 0
