"""Training ``sem_join`` on labelled pairs (issue 35): where each yes/no question says yes.

``sem_join``'s pair question and its per-side questions are scored by option likelihood and
calibrated against content-free inputs (``ken.ops.filter_models.ChoiceFilterModel``). That
ranks pairs well, but its boundary can sit far from the labels: Qwen2.5-Coder-0.5B said yes
to 98% of SST-2 pairs for "both reviews are positive" (docs/results.md). Labelled pairs move
the boundary: each question's log-odds ``x = logit P(yes)`` is shifted by the threshold ``t``
that maximises balanced accuracy on the training pairs (``P' = sigmoid(x - t)``, so the
answer is yes iff ``x >= t``), the per-side questions' threshold fitted on the pairs' labels
through the rewrite's combination (both / neither / same / different of the two sides).

Everything here is numpy on scores already computed; ``SemJoin.train`` asks the models.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ken.errors import DataError

JOIN_FIT_SCHEMA_VERSION = 1
#: held-out pairs of each label a rewrite must be scored on before it is trusted unchecked
MIN_TRUST_PER_LABEL = 5
#: probabilities are clipped to this distance from 0 and 1 before their log-odds are taken
EPS = 1e-6


def log_odds(p: np.ndarray) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), EPS, 1.0 - EPS)
    return np.log(p) - np.log1p(-p)


def shifted(p: np.ndarray, offset: float) -> np.ndarray:
    """``sigmoid(logit(p) - offset)``: ``p`` with its yes/no boundary moved to ``offset``."""
    return 1.0 / (1.0 + np.exp(-(log_odds(p) - offset)))


def balanced(predicted: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Balanced accuracy of each row of ``predicted`` (booleans, shape (k, n) or (n,))
    against ``truth`` (n booleans): the mean of the recall of each class present."""
    predicted = np.atleast_2d(predicted)
    truth = np.asarray(truth, dtype=bool)
    parts = [(predicted[:, truth] if cls else ~predicted[:, ~truth]).mean(axis=1)
             for cls in (True, False) if (truth == cls).any()]
    return np.mean(parts, axis=0)


def combine(kind: str, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """A pair's answer from its sides' answers (booleans: the side says yes / the side's
    value is the first option), as ``SideRewrite.combine`` does for values."""
    if kind == "both":
        return left & right
    if kind == "neither":
        return ~left & ~right
    if kind == "same":
        return left == right
    if kind in ("different", "opposite"):
        return left != right
    raise DataError(f"no per-side combination {kind!r}")


def candidates(x: np.ndarray) -> np.ndarray:
    """The thresholds worth trying on scores ``x``: below all, between each two distinct
    neighbours, above all."""
    u = np.unique(x)
    if len(u) == 0:
        return np.array([0.0])
    return np.concatenate(([u[0] - 1.0], (u[:-1] + u[1:]) / 2, [u[-1] + 1.0]))


def _best(thresholds: np.ndarray, scores: np.ndarray) -> tuple[float, float]:
    """The threshold of the best score; among equal bests, the middle one of the longest run
    of consecutive candidates (the widest margin), not the first."""
    best = scores.max()
    top = np.flatnonzero(np.isclose(scores, best, rtol=0.0, atol=1e-12))
    runs = np.split(top, np.flatnonzero(np.diff(top) > 1) + 1)
    run = max(runs, key=len)
    return float(thresholds[run[len(run) // 2]]), float(best)


def fit_threshold(x: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """The threshold ``t`` on scores ``x`` (yes iff ``x >= t``) with the best balanced
    accuracy on ``truth``, and that accuracy."""
    x = np.asarray(x, dtype=np.float64)
    t = candidates(x)
    return _best(t, balanced(x[None, :] >= t[:, None], truth))


def fit_side_threshold(kind: str, x_left: np.ndarray, x_right: np.ndarray,
                       truth: np.ndarray) -> tuple[float, float]:
    """One threshold for both sides' scores (a side says yes iff its ``x >= t``) whose
    combination by ``kind`` has the best balanced accuracy on the pairs' ``truth``."""
    x_left = np.asarray(x_left, dtype=np.float64)
    x_right = np.asarray(x_right, dtype=np.float64)
    t = candidates(np.concatenate([x_left, x_right]))
    pairs = combine(kind, x_left[None, :] >= t[:, None], x_right[None, :] >= t[:, None])
    return _best(t, balanced(pairs, truth))


@dataclass(frozen=True)
class JoinFit:
    """What training ``sem_join`` on labelled pairs fitted for one predicate and LM, and how
    it scored on the held-out pairs (balanced accuracy; NaN where not measured).

    ``pair_offset``: the pair question's threshold on its log-odds. ``side_offset``: the
    per-side questions' (None: the predicate has no rewrite, or one with more than two
    values). ``trust_rewrite``: on the held-out pairs the trained rewrite was at least as
    accurate as the trained pair question (on at least ``MIN_TRUST_PER_LABEL`` held-out
    pairs of each label), so a query may run it without checking it against the pair
    question on sampled pairs."""

    lm: str
    pair_offset: float
    side_offset: float | None = None
    rewrite: str = ""  # SideRewrite.describe() of the fitted rewrite
    trust_rewrite: bool = False
    fit_rows: int = 0
    held_rows: int = 0
    pair_untrained: float = math.nan
    pair_trained: float = math.nan
    rewrite_untrained: float = math.nan
    rewrite_trained: float = math.nan
    schema_version: int = JOIN_FIT_SCHEMA_VERSION

    def __post_init__(self) -> None:
        offsets = [self.pair_offset] + ([] if self.side_offset is None else [self.side_offset])
        if not all(math.isfinite(v) for v in offsets):
            raise DataError(f"a sem_join fit needs finite thresholds, not {offsets}")

    def describe(self) -> str:
        text = (f"balanced accuracy on {self.held_rows} held-out pairs: pair question "
                f"{self.pair_trained:.1%} trained ({self.pair_untrained:.1%} untrained)")
        if self.side_offset is not None:
            text += (f", per-side rewrite {self.rewrite_trained:.1%} trained "
                     f"({self.rewrite_untrained:.1%} untrained); the rewrite is "
                     + ("trusted without a check" if self.trust_rewrite else
                        "checked against the pair question as before"))
        return text

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> JoinFit:
        if data.get("schema_version") != JOIN_FIT_SCHEMA_VERSION:
            raise DataError(f"a sem_join fit of schema {data.get('schema_version')!r}, not "
                            f"{JOIN_FIT_SCHEMA_VERSION}")
        floats = ("pair_untrained", "pair_trained", "rewrite_untrained", "rewrite_trained")
        return cls(**{k: (math.nan if k in floats and v is None else v)
                      for k, v in data.items()})


def fit_join(lm: str, pair_p: np.ndarray, truth: np.ndarray, fit: np.ndarray,
             held: np.ndarray, side: tuple[str, np.ndarray, np.ndarray] | None = None,
             rewrite: str = "") -> JoinFit:
    """Fit on the rows ``fit``, score on ``held`` (index arrays into the pairs).
    ``pair_p``: the pair question's calibrated P(yes) per pair; ``side``: the rewrite's
    combination kind and each pair's left and right side P(yes / first option)."""
    truth = np.asarray(truth, dtype=bool)
    x = log_odds(pair_p)
    pair_offset, _ = fit_threshold(x[fit], truth[fit])
    out = {"lm": lm, "pair_offset": pair_offset, "fit_rows": len(fit),
           "held_rows": len(held),
           "pair_untrained": float(balanced(x[held] >= 0.0, truth[held])[0]),
           "pair_trained": float(balanced(x[held] >= pair_offset, truth[held])[0])}
    if side is not None:
        kind, left_p, right_p = side
        xl, xr = log_odds(left_p), log_odds(right_p)
        side_offset, _ = fit_side_threshold(kind, xl[fit], xr[fit], truth[fit])
        trained = float(balanced(combine(kind, xl[held] >= side_offset,
                                         xr[held] >= side_offset), truth[held])[0])
        out.update(side_offset=side_offset, rewrite=rewrite, rewrite_trained=trained,
                   rewrite_untrained=float(balanced(combine(kind, xl[held] >= 0.0,
                                                            xr[held] >= 0.0),
                                                    truth[held])[0]),
                   trust_rewrite=bool(trained >= out["pair_trained"] and
                                      min(truth[held].sum(), (~truth[held]).sum())
                                      >= MIN_TRUST_PER_LABEL))
    return JoinFit(**out)
