"""The power calculation that sizes the sampler checks (`chi_square`), against simulation: at
the sample size it gives, simulated checks catch the alternative at least as often as promised,
and under the null they fail about alpha of the time."""

from __future__ import annotations

import numpy as np
from chi_square import p_value, pooled, power, sample_size

ALPHA = 1e-3


def _checks(p_true: np.ndarray, p0: np.ndarray, n: int, trials: int, seed: int) -> np.ndarray:
    """p-values of `trials` checks of `n` draws from `p_true` against `p0`."""
    counts = np.random.default_rng(seed).multinomial(n, p_true, size=trials)
    return np.array([p_value(c.astype(float), p0) for c in counts])


def test_sample_size_reaches_the_power_it_promises():
    rng = np.random.default_rng(0)
    p0 = rng.dirichlet(np.full(64, 3.0))  # some cells rare enough to be pooled
    p1 = 0.8 * p0 + 0.2 * rng.dirichlet(np.ones(64))
    n = sample_size(p0, p1, ALPHA, 0.9, step=10)
    assert power(n, p0, p1, ALPHA) >= 0.9 > power(n - 10, p0, p1, ALPHA)
    caught = (_checks(p1, p0, n, 2000, seed=1) < ALPHA).mean()
    assert caught >= 0.87, caught  # 0.9 promised; 3 standard errors of 2,000 trials below
    assert (_checks(p0, p0, n, 2000, seed=2) < ALPHA).mean() <= 0.006  # ~alpha when p0 holds


def test_a_larger_fault_needs_fewer_draws():
    rng = np.random.default_rng(3)
    p0 = rng.dirichlet(np.full(20, 5.0))
    p1 = rng.dirichlet(np.full(20, 5.0))
    sizes = [sample_size(p0, (1 - f) * p0 + f * p1, ALPHA) for f in (0.1, 0.2, 0.4)]
    assert sizes[0] > sizes[1] > sizes[2]
    # the effect size w grows with f, so n ~ 1 / f^2 once few cells are pooled
    assert 2.5 < sizes[0] / sizes[1] < 5.5


def test_rare_cells_are_pooled_into_one():
    counts, expected = np.array([10.0, 1, 2, 30]), np.array([9.0, 2, 2.5, 30.5])
    obs, exp = pooled(counts, expected)
    assert obs.tolist() == [10, 30, 3] and exp.tolist() == [9, 30.5, 4.5]
    assert power(10, np.full(4, 0.25), np.array([0.7, 0.1, 0.1, 0.1]), ALPHA) == 0.0  # one cell
