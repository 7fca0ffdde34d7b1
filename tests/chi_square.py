"""Chi-square goodness-of-fit checks of samplers, and their sample sizes from a power calculation.

A check counts N draws over cells whose exact probabilities are p0, pools the cells expected
fewer than 5 times into one, and fails when the p-value is below alpha. Against an alternative
distribution p1 (a specific fault of the sampler), the statistic is approximately noncentral
chi-square with df = cells - 1 and noncentrality lambda = N * w^2, where
w^2 = sum_i (p1_i - p0_i)^2 / p0_i (Cohen's effect size, over the pooled cells); the power, the
probability that the check catches the fault, is P(X > c) with c the 1 - alpha quantile of the
central chi-square. `sample_size` is the smallest N that reaches a given power, so a check is as
large as the fault it must catch requires, and no larger.
"""

from __future__ import annotations

import numpy as np
from scipy import stats


def pooled(counts: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(counts, expected) with the cells expected fewer than 5 times merged into one."""
    rare = expected < 5
    if not rare.any():
        return counts, expected
    return (
        np.append(counts[~rare], counts[rare].sum()),
        np.append(expected[~rare], expected[rare].sum()),
    )


def p_value(counts: np.ndarray, p0: np.ndarray) -> float:
    """The chi-square p-value of `counts` under the cell probabilities `p0` (rare cells pooled;
    `p0` is renormalised, so float32 probabilities that sum to 1 - 1e-7 are fine)."""
    expected = p0 / p0.sum() * counts.sum()
    obs, exp = pooled(np.asarray(counts, np.float64), expected)
    return float(stats.chisquare(obs, exp).pvalue)


def power(n: int, p0: np.ndarray, p1: np.ndarray, alpha: float) -> float:
    """The probability that a check of `n` draws rejects p0 at level `alpha` when they come
    from p1 (both over the same cells), with the cells pooled as the check pools them."""
    p0, p1 = p0 / p0.sum(), p1 / p1.sum()
    rare = n * p0 < 5
    if rare.any():
        p0 = np.append(p0[~rare], p0[rare].sum())
        p1 = np.append(p1[~rare], p1[rare].sum())
    df = len(p0) - 1
    if df < 1:  # every cell pooled into one: nothing to tell apart
        return 0.0
    w2 = float(np.sum((p1 - p0) ** 2 / p0))
    critical = stats.chi2.ppf(1 - alpha, df)
    return float(stats.ncx2.sf(critical, df, n * w2))


def sample_size(
    p0: np.ndarray, p1: np.ndarray, alpha: float, target: float = 0.99, step: int = 50
) -> int:
    """The smallest multiple of `step` whose check catches p1 with probability >= `target`."""
    n = step
    while power(n, p0, p1, alpha) < target:
        n += step
        if n > 10_000_000:
            raise ValueError("the alternative is too close to p0 to be detected")
    return n
