"""The torch grouped matmul's sync-free path (`_dense`, which GPUs take for small batches so
that CUDA graphs can capture it) against its per-expert loop, on the CPU: empty groups, a group
holding every row, and rows past the last group (zero)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.torch import moe


@pytest.mark.parametrize("sizes", [[3, 0, 5, 2], [0, 0, 9, 0], [1, 2, 0, 1]])
def test_dense_equals_loop(sizes):
    gen = torch.Generator().manual_seed(sum(sizes) + len(sizes))
    rows, k, n = 10, 6, 5
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(len(sizes), k, n, generator=gen)
    ends = torch.cumsum(torch.tensor(sizes), 0).clamp(max=rows)
    dense, loop = moe._dense(x, w, ends), moe._loop(x, w, ends)
    np.testing.assert_allclose(dense.numpy(), loop.numpy(), rtol=1e-6, atol=1e-6)
    past = int(ends[-1])
    assert (dense[past:] == 0).all()
    for e, (lo, hi) in enumerate(zip([0, *ends[:-1].tolist()], ends.tolist(), strict=True)):
        expect = x[lo:hi] @ w[e]
        np.testing.assert_allclose(dense[lo:hi].numpy(), expect.numpy(), rtol=1e-5, atol=1e-5)
