"""The device side of generation: parameters, per-slot caches and the jitted forward step.

Shapes are bucketed (powers of two) so that a handful of programs are compiled and reused:
prefill rows are padded to a token bucket, decode batches to a row bucket whose extra rows
point at the null slot 0. The cache arrays are donated to every step, so they are updated in
place and keep their device buffers for the life of the runner.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from hybridserve.config import ModelConfig
from hybridserve.layers.step_input import StepInput
from hybridserve.models.hybrid import HybridModel, cache_shapes
from hybridserve.parallel import partition_spec

NULL_SLOT = 0


def bucket(n: int, smallest: int = 1) -> int:
    """The smallest power of two >= max(n, smallest)."""
    size = smallest
    while size < n:
        size *= 2
    return size


# Logical axes of the cache arrays (see hybridserve.parallel): KV heads and ssm heads shard.
CACHE_AXES = {
    "k": (None, None, "kv_heads", None),
    "v": (None, None, "kv_heads", None),
    "conv": (None, None, None),
    "ssm": (None, "ssm_heads", None, None),
}


def _cache_sharding(name: str, mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(CACHE_AXES[name], shape, mesh.shape["tp"]))


class ModelRunner:
    """Runs prefill chunks and decode steps of `model` over `num_slots` cache slots.

    Slot 0 is the null slot (padding rows write there); requests use slots 1..num_slots-1.
    """

    def __init__(
        self,
        model: HybridModel,
        cfg: ModelConfig,
        mesh: Mesh,
        num_slots: int,
        max_model_len: int,
        cache_dtype: jnp.dtype,
    ) -> None:
        self.cfg, self.mesh = cfg, mesh
        self.num_slots, self.max_model_len = num_slots, max_model_len
        self.graphdef, self.params = nnx.split(model)
        shapes = cache_shapes(cfg, num_slots, max_model_len, cache_dtype)
        self.caches = [
            {
                k: jnp.zeros(s.shape, s.dtype, device=_cache_sharding(k, mesh, s.shape))
                for k, s in layer.items()
            }
            for layer in shapes
        ]
        self._step = jax.jit(self._forward, donate_argnums=(1,), static_argnames=("last_only",))

    def _forward(
        self, params: nnx.State, caches: list, tokens: jax.Array, inputs: StepInput, last_only: bool
    ) -> tuple[jax.Array, list]:
        model = nnx.merge(self.graphdef, params)
        hidden, caches = model(tokens, inputs, caches)
        if last_only:
            rows = jnp.arange(hidden.shape[0])
            hidden = hidden[rows, jnp.maximum(inputs.lengths - 1, 0)]
        return model.logits(hidden), caches

    def run(
        self,
        slots: np.ndarray,
        tokens: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        last_only: bool = True,
    ) -> jax.Array:
        """One forward step over rows of tokens [B, T] (right-padded) at `starts` positions.

        Returns float32 logits: [B, V] for each row's last valid token, or [B, T, V].
        """
        b, t = tokens.shape
        positions = starts[:, None] + np.arange(t)[None, :]
        inputs = StepInput(
            slots=jnp.asarray(slots, jnp.int32),
            positions=jnp.asarray(positions, jnp.int32),
            lengths=jnp.asarray(lengths, jnp.int32),
        )
        logits, self.caches = self._step(
            self.params, self.caches, jnp.asarray(tokens, jnp.int32), inputs, last_only=last_only
        )
        return logits

    def prefill(self, slot: int, token_ids: list[int], start: int) -> jax.Array:
        """Run a chunk of one request's prompt from position `start`; logits [V] of its last
        token."""
        n = len(token_ids)
        if start + n > self.max_model_len:
            raise ValueError(
                f"sequence of {start + n} tokens exceeds max_model_len {self.max_model_len}"
            )
        t = bucket(n, 16)
        tokens = np.zeros((1, t), np.int32)
        tokens[0, :n] = token_ids
        return self.run(np.array([slot]), tokens, np.array([start]), np.array([n]))[0]

    def decode(self, slots: list[int], token_ids: list[int], positions: list[int]) -> jax.Array:
        """One token for each of `slots`; logits [len(slots), V]."""
        n = len(slots)
        b = bucket(n)
        pad = b - n
        rows = np.array(list(slots) + [NULL_SLOT] * pad)
        tokens = np.array(list(token_ids) + [0] * pad)[:, None]
        starts = np.array(list(positions) + [0] * pad)
        lengths = np.array([1] * n + [0] * pad)
        return self.run(rows, tokens, starts, lengths)[:n]
