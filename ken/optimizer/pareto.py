"""The one Pareto filter of the optimizer: points with a quality to maximise and a cost to
minimise (accuracy and compute for cascades, accuracy and p95 for gear plans, quality and work
for generation candidates). Callers map their objects to ``(quality, cost)`` pairs and keep the
returned indices, so every frontier in the planner resolves ties the same way."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pareto_front(points: Sequence[tuple[float, float]] | np.ndarray) -> list[int]:
    """Indices of the ``(quality, cost)`` points no other point dominates, by cost ascending.

    A point dominates another if its quality is at least as high and its cost at most as high,
    one of them strictly. Tie rules: of points with equal cost only the highest quality can
    survive, of points with equal quality only the cheapest; of exact duplicates the lowest
    index is kept. Quality therefore strictly increases along the result. NaN is refused
    (``ValueError``): it would be incomparable to everything.
    """
    if len(points) == 0:
        return []
    arr = np.asarray(points, dtype=np.float64).reshape(len(points), 2)
    if np.isnan(arr).any():
        raise ValueError("pareto_front: points must not contain NaN")
    quality, cost = arr[:, 0], arr[:, 1]
    # cost ascending, then quality descending, then index: the first point of each cost is its
    # best, and duplicates resolve to the lowest index
    order = np.lexsort((np.arange(len(arr)), -quality, cost))
    sorted_quality = quality[order]
    best_before = np.maximum.accumulate(np.concatenate(([-np.inf], sorted_quality[:-1])))
    return [int(i) for i in order[sorted_quality > best_before]]
