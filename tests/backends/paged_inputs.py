"""NaN-poisoned paged-attention inputs, shared by the backend tests and the GPU check of the
Hopper kernel (scripts/check_hopper_attention.py puts this folder on its path)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def paged_inputs(rng, bsz, t, nq, kv, head_dim, page, dtype, starts, kv_len, dr=8):
    """Random pages (each row's pages scattered over the cache, NaN in every slot that no query
    may see and in the unused pages) and queries at `starts`."""
    nblk = -(-int(max(kv_len.max(), 1)) // page) + 1  # one spare table column per row
    n_pages = bsz * nblk + 3
    kp = rng.standard_normal((n_pages, kv, page, head_dim))
    vp = rng.standard_normal((n_pages, kv, page, head_dim))
    table = rng.permutation(np.arange(1, n_pages))[: bsz * nblk].reshape(bsz, nblk)
    for b in range(bsz):
        for j in range(kv_len[b], nblk * page):
            kp[table[b, j // page], :, j % page] = np.nan
            vp[table[b, j // page], :, j % page] = np.nan
    unused = np.setdiff1d(np.arange(n_pages), table)
    kp[unused], vp[unused] = np.nan, np.nan
    q = rng.standard_normal((bsz, t, nq, head_dim))
    pos = (np.asarray(starts)[:, None] + np.arange(t)).astype(np.int32)
    rel_q = rng.standard_normal((bsz, t, nq, dr)) * 0.5
    rel_table = rng.standard_normal((12, dr))
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    arrays = (cast(q), cast(kp), cast(vp), jnp.asarray(table, jnp.int32), jnp.asarray(pos))
    return arrays, jnp.asarray(kv_len, jnp.int32), cast(rel_q), cast(rel_table)
