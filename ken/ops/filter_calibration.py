"""Calibrating ``sem_filter`` on labelled rows: the similarity stage's sigmoid and the
escalation threshold (:func:`fit_similarity_calibration`), and whether the LLM stage earns
its cost (:func:`calibrate_filter`). A :class:`FilterCalibration` records what was fitted and
how it scored; EXPLAIN shows its ``describe()``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace

import numpy as np
from scipy.optimize import minimize_scalar

from ken.errors import DataError, ModelError
from ken.models.resources import sigmoid
from ken.ops.filter_models import (
    DEFAULT_OFFSET,
    DEFAULT_SCALE,
    DEFAULT_THRESHOLD,
    LLMModel,
    SimilarityModel,
)

DEFAULT_TARGET_ACCURACY = 0.90
CALIBRATION_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class FilterSample:
    """Labelled rows for calibrating one predicate: texts and whether each satisfies it."""

    texts: tuple[str, ...]
    labels: tuple[bool, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "texts", tuple(self.texts))
        object.__setattr__(self, "labels", tuple(bool(v) for v in self.labels))
        if len(self.texts) != len(self.labels):
            raise DataError(f"a filter sample needs one label per text: {len(self.texts)} texts,"
                            f" {len(self.labels)} labels")
        if any(not isinstance(t, str) for t in self.texts):
            raise DataError("a filter sample's texts must be strings (drop NULL rows first)")

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def truth(self) -> np.ndarray:
        return np.asarray(self.labels, dtype=bool)


@dataclass(frozen=True)
class FilterCalibration:
    """Stage-1 sigmoid and escalation threshold of one predicate, and what they scored.

    ``calibrated`` is False for the documented defaults. Accuracies are on the calibration
    sample (NaN when not measured): ``stage1_accuracy`` of stage 1 alone, ``resolved_accuracy``
    on the rows stage 1 keeps at ``threshold``, ``llm_accuracy`` and ``stage1_escalated_accuracy``
    of the LLM and of stage 1 on (up to ``llm_rows``) rows that escalate.
    """

    scale: float = DEFAULT_SCALE
    offset: float = DEFAULT_OFFSET
    threshold: float = DEFAULT_THRESHOLD
    use_llm: bool = True
    calibrated: bool = False
    num_rows: int = 0
    target_accuracy: float = DEFAULT_TARGET_ACCURACY
    stage1_accuracy: float = math.nan
    resolved_accuracy: float = math.nan
    escalation_rate: float = math.nan
    llm_rows: int = 0
    llm_accuracy: float = math.nan
    stage1_escalated_accuracy: float = math.nan
    schema_version: int = CALIBRATION_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and math.isfinite(self.offset)):
            raise ModelError(f"filter calibration needs finite scale and offset, got "
                             f"{self.scale}, {self.offset}")

    def describe(self) -> str:
        """A short note for EXPLAIN."""
        sigmoid_text = f"sigmoid({self.scale:.1f} * (sim - {self.offset:.3f}))"
        if not self.calibrated:
            return f"default {sigmoid_text}; pass a labelled sample to calibrate"
        text = (f"{sigmoid_text} fitted on {self.num_rows} rows: stage 1 "
                f"{self.stage1_accuracy:.0%}, escalates {self.escalation_rate:.0%}")
        if self.llm_rows:
            text += (f", LLM {self.llm_accuracy:.0%} vs stage 1 "
                     f"{self.stage1_escalated_accuracy:.0%} on {self.llm_rows} escalated rows")
        return text + ("" if self.use_llm else ", LLM stage dropped")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> FilterCalibration:
        if data.get("schema_version") != CALIBRATION_SCHEMA_VERSION:
            raise ModelError("filter calibration has an old schema; calibrate again")
        return cls(**data)  # type: ignore[arg-type]

    def to_json(self) -> str:
        """JSON (unmeasured accuracies are written as ``null``)."""
        return json.dumps({k: None if isinstance(v, float) and math.isnan(v) else v
                           for k, v in self.to_dict().items()})

    @classmethod
    def from_json(cls, text: str) -> FilterCalibration:
        data = {k: math.nan if v is None else v for k, v in json.loads(text).items()}
        return cls.from_dict(data)



def fit_similarity_calibration(similarities: np.ndarray, labels: np.ndarray,
                               target_accuracy: float = DEFAULT_TARGET_ACCURACY,
                               min_resolved_fraction: float = 0.1) -> FilterCalibration:
    """Fit the stage-1 sigmoid on similarities and pick the escalation threshold.

    The sigmoid's centre ``offset`` is the cut ``sim > offset`` that is most accurate on the
    sample (a one-dimensional threshold, hard to overfit); its ``scale`` is then the maximum-
    likelihood slope around that centre (with a small L2 penalty, so separable samples keep a
    finite slope). A plain logistic regression was tried first: similarities of true rows have
    a long low tail, and its likelihood-optimal centre was less accurate than the default on
    real tweets (0.63 vs 0.71 held out), while the most accurate cut never is on the sample.

    The threshold is the smallest one at which the rows stage 1 keeps (certainty
    ``max(p, 1 - p) >= threshold``) are at least ``target_accuracy`` accurate, so as few rows
    as possible escalate; it must keep at least ``min_resolved_fraction`` of the rows, since
    accuracy on a handful of rows means little. When no threshold qualifies,
    ``DEFAULT_THRESHOLD`` is used. Thresholds fall midway between neighbouring certainties so
    that float rounding at run time does not move rows across.
    """
    sims = np.asarray(similarities, dtype=np.float64)
    truth = np.asarray(labels, dtype=bool)
    n = len(sims)
    if n != len(truth):
        raise DataError(f"{n} similarities but {len(truth)} labels")
    if n < 4 or truth.all() or not truth.any():
        raise DataError(f"calibrating sem_filter needs at least 4 labelled rows with both true "
                        f"and false among them; got {int(truth.sum())} true of {n}")
    if not 0.5 <= target_accuracy <= 1.0:
        raise DataError(f"target accuracy must be in [0.5, 1], got {target_accuracy}")
    offset = _most_accurate_cut(sims, truth)
    scale = _max_likelihood_scale(sims - offset, truth)
    p = sigmoid(scale * (sims - offset)).astype(np.float32).astype(np.float64)
    certainty = np.maximum(p, 1.0 - p)
    correct = (p > 0.5) == truth
    threshold, resolved_acc = _smallest_threshold(certainty, correct, target_accuracy,
                                                  max(1, math.ceil(min_resolved_fraction * n)))
    escalated = certainty < threshold
    if threshold == DEFAULT_THRESHOLD and math.isnan(resolved_acc):
        kept = ~escalated
        resolved_acc = float(correct[kept].mean()) if kept.any() else math.nan
    return FilterCalibration(
        scale=scale, offset=offset, threshold=threshold, use_llm=bool(escalated.any()),
        calibrated=True, num_rows=n, target_accuracy=target_accuracy,
        stage1_accuracy=float(correct.mean()), resolved_accuracy=resolved_acc,
        escalation_rate=float(escalated.mean()),
    )


def _most_accurate_cut(sims: np.ndarray, truth: np.ndarray) -> float:
    """The ``c`` maximising the accuracy of ``sims > c``; the middle one of equally good cuts."""
    order = np.argsort(sims, kind="stable")
    s, t = sims[order], truth[order]
    n = len(s)
    # cutting before sorted row k predicts false for rows < k and true for the rest
    false_below = np.concatenate([[0], np.cumsum(~t)])
    true_above = int(t.sum()) - np.concatenate([[0], np.cumsum(t)])
    accuracy = (false_below + true_above) / n
    possible = np.ones(n + 1, bool)
    possible[1:n] = s[:-1] < s[1:]  # equal similarities cannot be cut apart
    best = np.flatnonzero(possible & (accuracy >= accuracy[possible].max() - 1e-12))
    k = int(best[len(best) // 2])
    spread = max(float(s[-1] - s[0]), 1e-3)
    if k == 0:
        return float(s[0] - 0.05 * spread)
    if k == n:
        return float(s[-1] + 0.05 * spread)
    return float((s[k - 1] + s[k]) / 2)


def _max_likelihood_scale(centred: np.ndarray, truth: np.ndarray) -> float:
    """Slope ``a >= 1`` maximising the likelihood of ``sigmoid(a * centred)``, L2-penalised."""
    sign = np.where(truth, 1.0, -1.0)
    n = len(centred)
    spread = float(centred.std()) or 1.0

    def loss(a: float) -> float:
        # mean log(1 + exp(-sign * a * x)) plus the penalty fit_logistic uses (l2 = 1 on the
        # standardised feature)
        return float(np.logaddexp(0.0, -sign * a * centred).mean() + 0.5 * (a * spread) ** 2 / n)

    # The lower bound keeps P(true) > 0.5 exactly where sim > offset even after rounding to
    # float32 (a slope of 1 is still nearly flat: |sim - offset| <= 1 means p in [0.27, 0.73]).
    result = minimize_scalar(loss, bounds=(1.0, 1000.0), method="bounded",
                             options={"xatol": 1e-4})
    return float(result.x)


def _smallest_threshold(certainty: np.ndarray, correct: np.ndarray, target: float,
                        min_resolved: int) -> tuple[float, float]:
    """Smallest threshold whose resolved rows reach ``target`` accuracy (or the default)."""
    order = np.argsort(-certainty, kind="stable")  # most certain first
    c = certainty[order]
    hits = np.cumsum(correct[order])
    n = len(c)
    # keeping the k most certain rows is a real threshold only where c[k-1] > c[k]
    for k in range(n, min_resolved - 1, -1):
        if k < n and not c[k - 1] > c[k]:
            continue
        accuracy = hits[k - 1] / k
        if accuracy >= target:
            threshold = 0.0 if k == n else float((c[k - 1] + c[k]) / 2)
            return threshold, float(accuracy)
    return DEFAULT_THRESHOLD, math.nan


def calibrate_filter(similarity_model: SimilarityModel, sample: FilterSample,
                     llm: LLMModel | None = None,
                     target_accuracy: float = DEFAULT_TARGET_ACCURACY, llm_rows: int = 64,
                     batch_size: int = 32) -> FilterCalibration:
    """Calibrate a predicate on a labelled sample; decide whether the LLM stage earns its cost.

    Fits the similarity sigmoid and the threshold (:func:`fit_similarity_calibration`). Then,
    if ``llm`` is given and rows escalate, runs it on up to ``llm_rows`` escalated sample rows
    and keeps the LLM stage only if it is more accurate there than stage 1 (on ties stage 1
    wins: it is 10-20x cheaper).
    """
    sims = similarity_model.similarity(sample.texts, batch_size)
    calibration = fit_similarity_calibration(sims, sample.truth, target_accuracy)
    if llm is None or not calibration.use_llm:
        return replace(calibration, use_llm=False)
    p = sigmoid(calibration.scale * (sims - calibration.offset)).astype(np.float32)
    certainty = np.maximum(p, 1.0 - p)
    up = np.flatnonzero(certainty < calibration.threshold)[:llm_rows]
    truth = sample.truth[up]
    llm_pred = llm.predict([sample.texts[i] for i in up], batch_size=8).labels == 1
    llm_acc = float((llm_pred == truth).mean())
    stage1_acc = float(((p[up] > 0.5) == truth).mean())
    return replace(calibration, use_llm=llm_acc > stage1_acc, llm_rows=len(up),
                   llm_accuracy=llm_acc, stage1_escalated_accuracy=stage1_acc)
