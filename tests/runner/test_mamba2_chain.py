"""The Mamba2 row chain of packed prefill (`backends.ssd_rows.chain_states`) against the
recurrence it unrolls, row by row in float64 numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from backends.ssd_rows import chain_states


def reference(final: np.ndarray, log_decay: np.ndarray, continues: np.ndarray):
    """h_i = e_{i-1} if continues[i] else 0; e_i = f_i + exp(log_decay_i) h_i, row by row."""
    inflow, ends = np.zeros_like(final), np.zeros_like(final)
    for i in range(final.shape[0]):
        if continues[i] and i > 0:
            inflow[i] = ends[i - 1]
        ends[i] = final[i] + np.exp(log_decay[i])[:, None, None] * inflow[i]
    return inflow, ends


@pytest.mark.parametrize("rows", [1, 2, 7, 32])
def test_chain_states_matches_the_recurrence(rows: int) -> None:
    """Random states and decays (some rows decaying hard, some barely), random sequence
    boundaries (first rows among continuing ones); float32 against float64, rtol 1e-5."""
    rng = np.random.default_rng(rows)
    final = rng.normal(size=(rows, 4, 3, 5))
    log_decay = -rng.exponential(size=(rows, 4)) * rng.choice([0.01, 1.0, 20.0], size=(rows, 4))
    continues = (rng.random(rows) < 0.7).astype(np.int32)
    continues[0] = 0
    want_inflow, want_ends = reference(final, log_decay, continues)
    inflow, ends = chain_states(
        jnp.asarray(final, jnp.float32),
        jnp.asarray(log_decay, jnp.float32),
        jnp.asarray(continues),
    )
    np.testing.assert_allclose(np.asarray(ends), want_ends, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(inflow), want_inflow, rtol=1e-5, atol=1e-5)
