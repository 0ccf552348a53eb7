"""Training ``sem_join`` on labelled pairs (issue 35): where each yes/no question says yes.

``sem_join``'s pair question and its per-side questions are scored by option likelihood and
calibrated against content-free inputs (``ken.ops.filter_models.ChoiceFilterModel``). That
ranks pairs well, but its boundary can sit far from the labels: Qwen2.5-Coder-0.5B said yes
to 98% of SST-2 pairs for "both reviews are positive" (docs/results.md). Labelled pairs move
the boundary: each question's log-odds ``x = logit P(yes)`` is shifted by the threshold ``t``
that maximises balanced accuracy on the training pairs (``P' = sigmoid(x - t)``, so the
answer is yes iff ``x >= t``), the per-side questions' threshold fitted on the pairs' labels
through the rewrite's combination (both / neither / same / different of the two sides).

A per-side threshold can only move the LM's boundary. The rewrite can also learn *what* it
asks of each side: a logistic head over the LM's per-side log-odds and a sentence embedding
of the side (``x = a * logit P + w . e + b``), fitted by maximum likelihood on the pairs'
labels through the same combination (a pair's label is all the training sees of its sides:
``P(both) = s(x_l) s(x_r)``, ``P(same) = s(x_l) s(x_r) + (1 - s(x_l)) (1 - s(x_r))``), with
an L2 penalty on ``w``. Which encoder, which penalty, or no head at all is chosen by
cross-validation on the fit pairs (:func:`choose_side_head`); the threshold is then fitted
on the head's log-odds as it is on the LM's.

Everything here is numpy/scipy on scores and features already computed; ``SemJoin.train``
asks the models.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import minimize

from ken.errors import DataError
from ken.models.resources import sigmoid

JOIN_FIT_SCHEMA_VERSION = 2  # 2: the per-side head
#: held-out pairs of each label a rewrite must be scored on before it is trusted unchecked
MIN_TRUST_PER_LABEL = 5
#: probabilities are clipped to this distance from 0 and 1 before their log-odds are taken
EPS = 1e-6
#: L2 penalties on the embedding weights tried for a per-side head
HEAD_PENALTIES = (1e-4, 1e-3, 1e-2, 1e-1)
#: folds of the cross-validation that chooses the head (or none)
HEAD_FOLDS = 4


def log_odds(p: np.ndarray) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), EPS, 1.0 - EPS)
    return np.log(p) - np.log1p(-p)


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


def head_log_odds(params: np.ndarray, q: np.ndarray, e: np.ndarray) -> np.ndarray:
    """A side's log-odds under a head ``params = (a, b, w...)``: ``a * q + b + e @ w`` from
    the LM's log-odds ``q`` (n,) and the side's embedding ``e`` (n, d)."""
    params = np.asarray(params, dtype=np.float64)
    return params[0] * q + params[1] + e @ params[2:]


def pair_probability(kind: str, pl: np.ndarray, pr: np.ndarray) -> np.ndarray:
    """P(the pair is true) from its sides' P(yes), by ``kind``'s combination."""
    if kind == "both":
        return pl * pr
    if kind == "neither":
        return (1 - pl) * (1 - pr)
    same = pl * pr + (1 - pl) * (1 - pr)
    if kind == "same":
        return same
    if kind in ("different", "opposite"):
        return 1 - same
    raise DataError(f"no per-side combination {kind!r}")


def head_loss(params: np.ndarray, kind: str, q: tuple[np.ndarray, np.ndarray],
              e: tuple[np.ndarray, np.ndarray], truth: np.ndarray, penalty: float
              ) -> tuple[float, np.ndarray]:
    """Mean negative log-likelihood of the pairs' labels under a head, plus ``penalty x
    |w|^2``, and its gradient in ``params``."""
    y = np.asarray(truth, dtype=np.float64)
    xl, xr = head_log_odds(params, q[0], e[0]), head_log_odds(params, q[1], e[1])
    pl, pr = sigmoid(xl), sigmoid(xr)
    p = np.clip(pair_probability(kind, pl, pr), 1e-12, 1 - 1e-12)
    w = params[2:]
    loss = float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)) + penalty * (w @ w))
    dp = -(y / p - (1 - y) / (1 - p)) / len(y)  # d loss / d p per pair
    if kind == "both":
        dl, dr = dp * pr, dp * pl
    elif kind == "neither":
        dl, dr = -dp * (1 - pr), -dp * (1 - pl)
    else:
        sign = 1.0 if kind == "same" else -1.0
        dl, dr = sign * dp * (2 * pr - 1), sign * dp * (2 * pl - 1)
    gl, gr = dl * pl * (1 - pl), dr * pr * (1 - pr)  # d loss / d x per side
    grad = np.concatenate(([gl @ q[0] + gr @ q[1], gl.sum() + gr.sum()],
                           e[0].T @ gl + e[1].T @ gr + 2 * penalty * w))
    return loss, grad


def fit_head(kind: str, q: tuple[np.ndarray, np.ndarray], e: tuple[np.ndarray, np.ndarray],
             truth: np.ndarray, penalty: float) -> np.ndarray:
    """The head ``(a, b, w...)`` that minimises :func:`head_loss`, from the LM's log-odds as
    they are (``a = 1``, nothing else)."""
    x0 = np.zeros(e[0].shape[1] + 2)
    x0[0] = 1.0
    result = minimize(head_loss, x0, args=(kind, q, e, np.asarray(truth, bool), penalty),
                      jac=True, method="L-BFGS-B", options={"maxiter": 500})
    return np.asarray(result.x, dtype=np.float64)


@dataclass(frozen=True)
class HeadChoice:
    """What :func:`choose_side_head` chose: ``encoder`` None for no head (the LM's log-odds
    and a threshold), else the encoder and penalty; each candidate's cross-validated
    balanced accuracy by name."""

    encoder: str | None
    penalty: float
    scores: dict[str, float]


def _fold_score(kind: str, q: tuple[np.ndarray, np.ndarray],
                e: tuple[np.ndarray, np.ndarray] | None, truth: np.ndarray,
                train: np.ndarray, test: np.ndarray, penalty: float) -> float:
    ql, qr = q
    if e is not None:
        params = fit_head(kind, (ql[train], qr[train]), (e[0][train], e[1][train]),
                          truth[train], penalty)
        ql, qr = head_log_odds(params, ql, e[0]), head_log_odds(params, qr, e[1])
    t, _ = fit_side_threshold(kind, ql[train], qr[train], truth[train])
    return float(balanced(combine(kind, ql[test] >= t, qr[test] >= t), truth[test])[0])


def choose_side_head(kind: str, q: tuple[np.ndarray, np.ndarray],
                     features: dict[str, tuple[np.ndarray, np.ndarray]],
                     truth: np.ndarray, folds: int = HEAD_FOLDS,
                     penalties: tuple[float, ...] = HEAD_PENALTIES, seed: int = 0
                     ) -> HeadChoice:
    """No head, or the encoder of ``features`` (per pair: left and right embeddings) and the
    penalty whose head scores best by ``folds``-fold cross-validation on these pairs
    (balanced accuracy of the combined answers, each fold's threshold fitted on the other
    folds); ties keep no head, then the larger penalty."""
    truth = np.asarray(truth, dtype=bool)
    order = np.random.default_rng(seed).permutation(len(truth))
    parts = [p for p in np.array_split(order, min(folds, len(truth))) if len(p)]

    def cv(e: tuple[np.ndarray, np.ndarray] | None, penalty: float) -> float:
        scores = []
        for k, test in enumerate(parts):
            train = np.concatenate([p for j, p in enumerate(parts) if j != k])
            if truth[train].all() or not truth[train].any():
                continue
            scores.append(_fold_score(kind, q, e, truth, train, test, penalty))
        return float(np.mean(scores)) if scores else math.nan

    scores = {"none": cv(None, 0.0)}
    best: tuple[float, str | None, float] = (scores["none"], None, 0.0)
    for encoder, e in features.items():
        for penalty in sorted(penalties, reverse=True):
            score = cv(e, penalty)
            scores[f"{encoder}@{penalty:g}"] = score
            if score > best[0] + 1e-12:
                best = (score, encoder, penalty)
    return HeadChoice(best[1], best[2], scores)


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
    #: the rewrite on the LM's log-odds and a threshold alone, held out (when a head won)
    rewrite_threshold_only: float = math.nan
    #: the per-side head (``a, b, w...``, :func:`head_log_odds`) over the LM's log-odds and
    #: ``side_encoder``'s embedding; None: the LM's log-odds alone
    side_head: tuple[float, ...] | None = None
    side_encoder: str | None = None
    side_penalty: float = 0.0
    schema_version: int = JOIN_FIT_SCHEMA_VERSION

    def __post_init__(self) -> None:
        offsets = [self.pair_offset] + ([] if self.side_offset is None else [self.side_offset])
        if not all(math.isfinite(v) for v in offsets):
            raise DataError(f"a sem_join fit needs finite thresholds, not {offsets}")
        if self.side_head is not None:
            head = tuple(float(v) for v in self.side_head)
            if len(head) < 3 or not all(math.isfinite(v) for v in head) or \
                    not self.side_encoder or self.side_offset is None:
                raise DataError("a sem_join fit's per-side head needs finite weights, an "
                                "encoder and a side threshold")
            object.__setattr__(self, "side_head", head)

    def describe(self) -> str:
        text = (f"balanced accuracy on {self.held_rows} held-out pairs: pair question "
                f"{self.pair_trained:.1%} trained ({self.pair_untrained:.1%} untrained)")
        if self.side_offset is not None:
            head = ("" if self.side_head is None else
                    f" with a head over {self.side_encoder} embeddings (threshold alone "
                    f"{self.rewrite_threshold_only:.1%})")
            text += (f", per-side rewrite {self.rewrite_trained:.1%} trained{head} "
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
        floats = ("pair_untrained", "pair_trained", "rewrite_untrained", "rewrite_trained",
                  "rewrite_threshold_only")
        values = {k: (math.nan if k in floats and v is None else v) for k, v in data.items()}
        try:
            if values.get("side_head") is not None:
                values["side_head"] = tuple(values["side_head"])
            return cls(**values)
        except TypeError as exc:
            raise DataError(f"a sem_join fit that does not read back: {exc}") from None


def fit_join(lm: str, pair_p: np.ndarray, truth: np.ndarray, fit: np.ndarray,
             held: np.ndarray, side: tuple[str, np.ndarray, np.ndarray] | None = None,
             rewrite: str = "",
             features: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> JoinFit:
    """Fit on the rows ``fit``, score on ``held`` (index arrays into the pairs).
    ``pair_p``: the pair question's calibrated P(yes) per pair; ``side``: the rewrite's
    combination kind and each pair's left and right side P(yes / first option);
    ``features``: per encoder, each pair's left and right side embeddings, for a per-side
    head (:func:`choose_side_head` decides whether one is used)."""
    truth = np.asarray(truth, dtype=bool)
    x = log_odds(pair_p)
    pair_offset, _ = fit_threshold(x[fit], truth[fit])
    out = {"lm": lm, "pair_offset": pair_offset, "fit_rows": len(fit),
           "held_rows": len(held),
           "pair_untrained": float(balanced(x[held] >= 0.0, truth[held])[0]),
           "pair_trained": float(balanced(x[held] >= pair_offset, truth[held])[0])}
    if side is not None:
        kind, left_p, right_p = side
        ql, qr = log_odds(left_p), log_odds(right_p)
        untrained = float(balanced(combine(kind, ql[held] >= 0.0, qr[held] >= 0.0),
                                   truth[held])[0])
        xl, xr = ql, qr
        if features:
            choice = choose_side_head(kind, (ql[fit], qr[fit]),
                                      {k: (v[0][fit], v[1][fit]) for k, v in features.items()},
                                      truth[fit])
            if choice.encoder is not None:
                el, er = features[choice.encoder]
                params = fit_head(kind, (ql[fit], qr[fit]), (el[fit], er[fit]), truth[fit],
                                  choice.penalty)
                xl, xr = head_log_odds(params, ql, el), head_log_odds(params, qr, er)
                alone, _ = fit_side_threshold(kind, ql[fit], qr[fit], truth[fit])
                out.update(side_head=tuple(float(v) for v in params),
                           side_encoder=choice.encoder, side_penalty=choice.penalty,
                           rewrite_threshold_only=float(balanced(
                               combine(kind, ql[held] >= alone, qr[held] >= alone),
                               truth[held])[0]))
        side_offset, _ = fit_side_threshold(kind, xl[fit], xr[fit], truth[fit])
        trained = float(balanced(combine(kind, xl[held] >= side_offset,
                                         xr[held] >= side_offset), truth[held])[0])
        out.update(side_offset=side_offset, rewrite=rewrite, rewrite_trained=trained,
                   rewrite_untrained=untrained,
                   trust_rewrite=bool(trained >= out["pair_trained"] and
                                      min(truth[held].sum(), (~truth[held]).sum())
                                      >= MIN_TRUST_PER_LABEL))
    return JoinFit(**out)
