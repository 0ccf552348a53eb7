"""Certainty functions: how sure a classifier is of its top prediction, per row.

Each maps class probabilities of shape ``(rows, classes)`` to one float per row; larger means
more certain. Cascades escalate rows whose certainty is below a stage threshold.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ken.errors import KenError

CertaintyFn = Callable[[np.ndarray], np.ndarray]


def max_prob(probabilities: np.ndarray) -> np.ndarray:
    """Probability of the predicted class (in [1/k, 1])."""
    return np.asarray(probabilities, dtype=np.float64).max(axis=1)


def margin(probabilities: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 probability (in [0, 1])."""
    p = np.asarray(probabilities, dtype=np.float64)
    if p.shape[1] < 2:
        return np.ones(p.shape[0])
    top2 = np.partition(p, p.shape[1] - 2, axis=1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def neg_entropy(probabilities: np.ndarray) -> np.ndarray:
    """Negative Shannon entropy in nats (in [-log k, 0])."""
    p = np.asarray(probabilities, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(p), 0.0)
    return terms.sum(axis=1)


CERTAINTY_FUNCTIONS: dict[str, CertaintyFn] = {
    "max_prob": max_prob,
    "margin": margin,
    "neg_entropy": neg_entropy,
}


def certainty_fn(name: str) -> CertaintyFn:
    """Look up a certainty function by name."""
    try:
        return CERTAINTY_FUNCTIONS[name]
    except KeyError:
        known = ", ".join(sorted(CERTAINTY_FUNCTIONS))
        raise KenError(f"unknown certainty function {name!r}; use one of: {known}") from None


def certainty_of(scores: np.ndarray, kind: str = "max_prob") -> np.ndarray:
    """Certainty per row from a model's scores: the named function of class probabilities
    (rows x classes), or the model's own certainty (rows,) as it is (other output types)."""
    scores = np.asarray(scores)
    if scores.ndim == 2:
        return np.asarray(certainty_fn(kind)(scores), dtype=np.float64)
    return scores.astype(np.float64)
