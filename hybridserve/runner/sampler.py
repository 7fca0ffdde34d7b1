"""Token sampling: greedy, temperature, top-k and top-p, one PRNG key per row."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def sample(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, keys: jax.Array
) -> jax.Array:
    """Pick one token per row.

    Args:
      logits: [B, V] float32. temperature: [B] (0 = greedy). top_k: [B] int (0 = off).
      top_p: [B] in (0, 1] (1 = off). keys: [B] PRNG keys.
    Returns: [B] int32 token ids.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.sort(scaled, axis=-1)[:, ::-1]  # descending
    vocab = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(order, (k - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    probs = jax.nn.softmax(jnp.sort(scaled, axis=-1)[:, ::-1], axis=-1)
    # Keep the smallest prefix of the sorted tokens whose mass reaches top_p.
    before = jnp.cumsum(probs, axis=-1) - probs
    cutoff_idx = jnp.sum(before < top_p[:, None], axis=-1) - 1
    sorted_desc = jnp.sort(scaled, axis=-1)[:, ::-1]
    cutoff = jnp.take_along_axis(sorted_desc, cutoff_idx[:, None], axis=-1)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature <= 0, greedy, drawn)
