"""The per-step batch description shared by every layer."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from hybridserve.cache.view import CacheLayout


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["positions", "lengths", "tables", "continues", "commit"],
    meta_fields=["layout"],
)
@dataclasses.dataclass(frozen=True)
class StepInput:
    """Where each batch row's tokens go. Rows are right-padded to a common T.

    positions: [B, T] int32, absolute position of each token (start + t).
    lengths:   [B] int32, valid tokens in each row (0 for padding rows).
    tables:    one array per cache group: attention groups [B, nblk] kernel block ids, Mamba
               groups [B] state pages (padding rows point at the null page 0).
    layout:    the static cache layout.
    continues: packed prefill (`runner.packed`): [B] int32, row b goes on from row b - 1 (the
               same sequence, whose earlier rows are full); None: every row is its own
               sequence.
    commit:    models with recurrent (Mamba) layers: [B] int32, the tokens of each row whose
               state the step keeps (the row's tokens before its drafts: a recurrent state
               cannot be rolled back, so it never moves past a draft); None: `lengths`.
    """

    positions: jax.Array
    lengths: jax.Array
    tables: tuple[jax.Array, ...]
    layout: CacheLayout
    continues: jax.Array | None = None
    commit: jax.Array | None = None

    @property
    def valid(self) -> jax.Array:
        """[B, T] bool: the token is real, not padding."""
        t = self.positions.shape[1]
        return jnp.arange(t)[None, :] < self.lengths[:, None]

    @property
    def kv_lengths(self) -> jax.Array:
        """[B] int32: tokens in the cache once this step's tokens are written."""
        return self.positions[:, 0] + self.lengths

    @property
    def last(self) -> jax.Array:
        """[B] bool: no later row continues this one (its sequence ends here this step)."""
        if self.continues is None:
            return jnp.ones(self.lengths.shape, bool)
        return jnp.append(self.continues[1:] == 0, True)

    @property
    def fresh(self) -> jax.Array:
        """[B] bool: the row starts at position 0 (its recurrent state starts from zero)."""
        return self.positions[:, 0] == 0
