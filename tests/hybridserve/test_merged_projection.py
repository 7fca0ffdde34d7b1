"""`layers.merged.MergedProjection`: one einsum over a kernel merged per TP rank gives each
part's separate einsum (with its bias), at TP 1, 2 and 4, for parts split over the ranks and
parts with fewer entries than ranks (duplicated); each rank's columns are exactly its own
entries, and the kernel is sharded on the rank axis. Random float32 weights; the merge only
moves elements, so the products agree to float32 rounding (1e-5)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from hybridserve.layers.linear import Einsum
from hybridserve.layers.merged import MergedProjection
from hybridserve.parallel import make_mesh

D = 24
_SHAPES = {  # name: (equation, kernel shape, axes)
    "z": ("btd,dhp->bthp", (D, 4, 3), ("embed", "ssm_heads", None)),
    "b": ("btd,dgn->btgn", (D, 2, 5), ("embed", "ssm_groups", None)),
    "dt": ("btd,dh->bth", (D, 4), ("embed", "ssm_heads")),
}


def _parts(bias: bool) -> dict[str, Einsum]:
    rngs = nnx.Rngs(3)
    parts = {}
    for name, (eq, shape, axes) in _SHAPES.items():
        proj = Einsum(eq, shape, axes, dtype=np.float32, rngs=rngs, bias=bias)
        if bias:  # zeros at init: random, so a misplaced bias shows
            proj.bias[...] = jax.random.normal(rngs.params(), proj.bias.shape)
        parts[name] = proj
    return parts


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_merged_equals_the_separate_projections(tp, bias):
    parts = _parts(bias)
    x = np.random.default_rng(tp).standard_normal((2, 3, D)).astype(np.float32)
    want = {name: np.asarray(proj(x)) for name, proj in parts.items()}
    merged = MergedProjection(parts, make_mesh(tp))
    got = merged(x)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=1e-5, atol=1e-5)
    kernel = merged.kernel[...]
    assert kernel.shape == (D, tp, 4 * 3 // tp + max(2 // tp, 1) * 5 + 4 // tp)
    if tp > 1:
        assert kernel.sharding.spec[1] == "tp"


def test_each_rank_holds_its_own_entries():
    """At TP 4 rank r's columns are z heads {r}, B group {r // 2} (2 groups, duplicated) and dt
    head {r}, in that order."""
    parts = _parts(False)
    merged = MergedProjection(parts, make_mesh(4))
    kernel = np.asarray(merged.kernel[...])
    z, b, dt = (np.asarray(parts[k].kernel[...]) for k in ("z", "b", "dt"))
    for r in range(4):
        want = np.concatenate([z[:, r], b[:, r // 2], dt[:, r : r + 1]], axis=-1)
        np.testing.assert_array_equal(kernel[:, r], want)
