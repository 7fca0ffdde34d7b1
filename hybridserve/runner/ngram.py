"""Prompt lookup (n-gram) drafting: speculation without a draft model.

For a request's tokens x_0 .. x_{L-1} and n from `n_max` down to `n_min`: find the latest
earlier occurrence of the last n tokens, x_{i .. i+n-1} = x_{L-n .. L-1} with i < L - n, and
propose the (up to k) tokens that followed it, x_{i+n ..}. No occurrence for any n: no drafts.
Drafts are deterministic (their draft distribution is one-hot), so verification stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_drafts(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` drafts for the sequence `tokens` (see the module docstring)."""
    seq = np.asarray(tokens, np.int64)
    size = len(seq)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = seq[size - n :]
        starts = np.flatnonzero((sliding_window_view(seq[: size - 1], n) == tail).all(axis=1))
        if starts.size:  # the latest occurrence (every start < size - n: a token follows it)
            after = int(starts[-1]) + n
            return seq[after : after + k].tolist()
    return []
