"""The per-step batch description shared by every layer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    """Where each batch row's tokens go. Rows are right-padded to a common T.

    slots:     [B] int32, the cache slot of each row (slot 0 is the null slot for padding rows).
    positions: [B, T] int32, absolute position of each token (start + t).
    lengths:   [B] int32, valid tokens in each row.
    """

    slots: jax.Array
    positions: jax.Array
    lengths: jax.Array

    @property
    def valid(self) -> jax.Array:
        """[B, T] bool: the token is real, not padding."""
        t = self.positions.shape[1]
        return jnp.arange(t)[None, :] < self.lengths[:, None]

    @property
    def kv_lengths(self) -> jax.Array:
        """[B] int32: tokens in the cache once this step's tokens are written."""
        return self.positions[:, 0] + self.lengths
