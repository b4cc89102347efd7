"""The percentile bootstrap over prompts, every interval the evaluation reports uses: each
resample draws the prompts with replacement, keeping a prompt's rows together."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike


def bootstrap_interval(
    statistic_fn: Callable[..., float],
    *arrays: ArrayLike,
    n_resamples: int,
    confidence: float,
    seed: int,
) -> tuple[float, float]:
    """Percentile-bootstrap (low, high) of ``statistic_fn(*arrays)``, resampling indices jointly."""
    columns = [np.asarray(array) for array in arrays]
    if not columns or len(columns[0]) == 0:
        raise ValueError("bootstrap_interval needs at least one non-empty array")
    n = len(columns[0])
    if any(len(column) != n for column in columns):
        raise ValueError(
            f"paired arrays differ in length: {[len(c) for c in columns]}; pass one row per prompt"
        )
    if n_resamples < 1:
        raise ValueError(f"n_resamples: {n_resamples} must be at least 1")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: {confidence} must be in (0, 1), e.g. 0.95")
    rng = np.random.default_rng(seed)
    stats = np.empty(n_resamples, np.float64)
    for i in range(n_resamples):  # one index draw at a time keeps memory O(n)
        rows = rng.integers(0, n, size=n)
        stats[i] = statistic_fn(*(column[rows] for column in columns))
    if np.isnan(stats).any():
        return math.nan, math.nan
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return float(low), float(high)
