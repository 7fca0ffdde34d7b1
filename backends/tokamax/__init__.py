"""Ops taken from tokamax (DeepMind's accelerator kernels for JAX), for per-op overrides:
`backend="auto,grouped_matmul=tokamax"`.

  grouped_matmul   `tokamax.ragged_dot` (the same contract as `jax.lax.ragged_dot`: rows of
                   x in consecutive groups of `group_sizes`, group g times w[g]); tokamax picks
                   its fastest implementation for the device (Pallas Mosaic GPU on Hopper).

Only this op: the backend is for overrides (`load_ops` raises for the others unless a fallback
is given). tokamax 0.0.17 needs Python >= 3.12 and jax >= 0.11.1; without it the import raises
ImportError, which `backends.protocol.get_op` reports as "backend 'tokamax' is not available
here". `scripts/kernel_peers.py` says how to install it on a machine without network, and
`bench_kernels.py --peers` measures it beside ours.
"""

import jax
import tokamax

from backends.protocol import register


@register("grouped_matmul", "tokamax")
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] by w [G, K, N] in groups of `group_sizes` [G] rows -> [M, N] in x's dtype."""
    return tokamax.ragged_dot(x, w, group_sizes.astype("int32"))
