"""Tie-averaged ranks: one implementation for the diagnostics (numpy, no torch) and for the policies that
rank their terms (AvoKV-E's percentile ranks), so the two cannot drift apart.  Imports nothing of kvviz."""

from __future__ import annotations

import numpy as np


def ranks(values: np.ndarray) -> np.ndarray:
    """Ascending ranks from 1, ties sharing their average rank.

    Parameters
    ----------
    values : array_like
        ``(n,)`` values to rank.

    Returns
    -------
    np.ndarray
        ``(n,)`` float64 ranks in ``[1, n]``.
    """
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, kind="stable")
    ranked = np.empty(values.size)
    ranked[order] = np.arange(1, values.size + 1)
    _, groups = np.unique(values, return_inverse=True)
    sums = np.bincount(groups, weights=ranked)
    return (sums / np.bincount(groups))[groups]
