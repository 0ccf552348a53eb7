"""Evaluation samples and per-row quality metrics (the output contract's other half).

An :class:`EvalSample` holds inputs, one reference per row and the name of a quality metric.
``sample.quality(values)`` scores a model's values row by row, so profiles can store a quality
per row for *any* output type and the cascade search, simulator and planner only ever average
those numbers: the mean per-row quality of a cascade is its accuracy (or balanced accuracy,
exact match, token F1, closeness of a score) on the sample, whatever the values mean.

>>> s = EvalSample("demo", ("a", "b"), ("pos", "neg"), "accuracy")
>>> s.quality(["pos", "pos"]).tolist()
[1.0, 0.0]
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ken.errors import DataError
from ken.models.model import BOOLEAN_LABELS

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalise_answer(text: Any) -> str:
    """Lower case, no punctuation, articles or extra spaces (the SQuAD / MultiModalQA rule)."""
    text = str(text).lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())


def _as_boolean(value: Any) -> Any:
    """Boolean classifiers predict the labels "false" / "true" (``BOOLEAN_LABELS``)."""
    return (value == "true") if isinstance(value, str) and value in BOOLEAN_LABELS else value


def _same(value: Any, reference: Any) -> bool:
    if value is None or reference is None:
        return value is None and reference is None
    if isinstance(reference, bool | np.bool_):
        value = _as_boolean(value)
    booleans = (isinstance(value, bool | np.bool_), isinstance(reference, bool | np.bool_))
    if any(booleans):
        return all(booleans) and bool(value) == bool(reference)
    return bool(value == reference)


def accuracy(values: Sequence[Any], references: Sequence[Any]) -> np.ndarray:
    """1 where the value equals the reference, else 0."""
    return np.array([1.0 if _same(v, r) else 0.0 for v, r in zip(values, references,
                                                                  strict=True)])


def balanced_accuracy(values: Sequence[Any], references: Sequence[Any]) -> np.ndarray:
    """Correctness weighted so that every reference class counts equally: the mean over rows
    is the balanced accuracy (mean recall per class). For skewed samples, e.g. entity pairs
    where one in ten matches, plain accuracy rewards answering "no match" everywhere."""
    correct = accuracy(values, references)
    keys = [json.dumps(r, sort_keys=True, default=str) for r in references]
    counts = Counter(keys)
    n, k = len(keys), len(counts)
    weights = np.array([n / (k * counts[key]) for key in keys]) if n else np.zeros(0)
    return correct * weights


def exact_match(values: Sequence[Any], references: Sequence[Any]) -> np.ndarray:
    """1 where the normalised answer equals a normalised reference (a reference may be a list
    of acceptable answers), else 0; ``None`` (no answer) scores 0."""
    out = []
    for v, r in zip(values, references, strict=True):
        options = r if isinstance(r, list | tuple) else [r]
        out.append(1.0 if v is not None and any(normalise_answer(v) == normalise_answer(o)
                                                for o in options) else 0.0)
    return np.array(out)


def token_f1(values: Sequence[Any], references: Sequence[Any]) -> np.ndarray:
    """Token F1 between the normalised answer and the best-matching reference, per row."""
    out = []
    for v, r in zip(values, references, strict=True):
        options = r if isinstance(r, list | tuple) else [r]
        best = 0.0
        if v is not None:
            pred = normalise_answer(v).split()
            for o in options:
                gold = normalise_answer(o).split()
                common = sum((Counter(pred) & Counter(gold)).values())
                if not pred or not gold:
                    best = max(best, float(pred == gold))
                elif common:
                    p, rec = common / len(pred), common / len(gold)
                    best = max(best, 2 * p * rec / (p + rec))
        out.append(best)
    return np.array(out)


#: the span of the scale ``scale_closeness`` is measured on: 1 to 5
CLOSENESS_SPAN = 4.0


def scale_closeness(values: Sequence[Any], references: Sequence[Any]) -> np.ndarray:
    """How close a score is to the reference score on a 1-5 scale (``sem_score``'s evaluation
    sample): ``1 - |value - reference| / 4`` clipped to [0, 1], so 1 is exact and 0 is the
    other end of the scale; ``None`` (no score) is 0."""
    out = []
    for v, r in zip(values, references, strict=True):
        if v is None or r is None:
            out.append(0.0)
            continue
        try:
            gap = abs(float(v) - float(r))
        except (TypeError, ValueError):
            out.append(0.0)
            continue
        out.append(0.0 if np.isnan(gap) else float(np.clip(1.0 - gap / CLOSENESS_SPAN,
                                                           0.0, 1.0)))
    return np.array(out)


def label_named(values: Sequence[Any], references: Sequence[Any]) -> np.ndarray:
    """1 where a free-text answer names its reference label and no other label of the sample
    (the distinct references), word for word after :func:`normalise_answer`; else 0
    ("The overall sentiment is positive." names "positive"). For answers that are sentences
    about a label, where exact match would score every one 0."""
    labels = {normalise_answer(r) for r in references if r is not None}
    out = []
    for v, r in zip(values, references, strict=True):
        if v is None or r is None:
            out.append(0.0)
            continue
        words = f" {normalise_answer(v)} "
        named = {label for label in labels if f" {label} " in words}
        out.append(1.0 if named == {normalise_answer(r)} else 0.0)
    return np.array(out)


def roc_auc(scores: Sequence[float], truth: Sequence[bool]) -> float:
    """ROC AUC of ``scores`` for the rows where ``truth`` holds, by the rank sum (tied scores
    get their mean rank): the chance that a true row scores above a false one, ties counting
    half. DataError unless both kinds of row are present."""
    scores = np.asarray(scores, dtype=np.float64)
    truth = np.asarray(truth, dtype=bool)
    pos = int(truth.sum())
    neg = len(truth) - pos
    if pos == 0 or neg == 0:
        raise DataError("ROC AUC needs both true and false rows")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    for value in np.unique(scores):
        tied = scores == value
        ranks[tied] = ranks[tied].mean()
    return float((ranks[truth].sum() - pos * (pos + 1) / 2) / (pos * neg))


METRICS: dict[str, Callable[[Sequence[Any], Sequence[Any]], np.ndarray]] = {
    "accuracy": accuracy,
    "balanced_accuracy": balanced_accuracy,
    "exact_match": exact_match,
    "token_f1": token_f1,
    "scale_closeness": scale_closeness,
    "label_named": label_named,
}


@dataclass(frozen=True, eq=False)
class EvalSample:
    """Inputs with one reference each and a per-row quality metric.

    ``inputs`` are strings, or tuples of strings for operators over several columns.
    ``references`` are the values a perfect model returns (a label, a boolean, a number, an
    answer string or a list of acceptable answers). ``metric`` names one of :data:`METRICS`.
    """

    name: str
    inputs: tuple = field(repr=False)
    references: tuple = field(repr=False)
    metric: str = "accuracy"

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "references", tuple(self.references))
        if len(self.inputs) != len(self.references):
            raise DataError(f"evaluation sample {self.name}: {len(self.inputs)} inputs but "
                            f"{len(self.references)} references")
        if not self.inputs:
            raise DataError(f"evaluation sample {self.name} is empty")
        if self.metric not in METRICS:
            raise DataError(f"unknown quality metric {self.metric!r}; use one of: "
                            f"{', '.join(METRICS)}")
        if any(x is None for x in self.inputs):
            raise DataError(f"evaluation sample {self.name} has NULL inputs; drop them first")

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def texts(self) -> tuple:
        """The inputs (what a model's ``predict`` takes)."""
        return self.inputs

    def quality(self, values: Sequence[Any]) -> np.ndarray:
        """Per-row quality of ``values`` (float64); its mean is the metric on the sample."""
        if len(values) != len(self.references):
            raise DataError(f"{len(values)} values for {len(self.references)} references of "
                            f"{self.name}")
        return np.asarray(METRICS[self.metric](values, self.references), dtype=np.float64)

    @property
    def content_hash(self) -> str:
        h = hashlib.sha256()
        h.update(self.metric.encode())
        for x, r in zip(self.inputs, self.references, strict=True):
            h.update(json.dumps(x, ensure_ascii=False).encode("utf-8", "replace"))
            h.update(b"\x1e")
            h.update(json.dumps(r, ensure_ascii=False, sort_keys=True, default=str)
                     .encode("utf-8", "replace"))
            h.update(b"\x1d")
        return h.hexdigest()[:16]

    def subset(self, indices: Sequence[int], name: str | None = None) -> EvalSample:
        idx = [int(i) for i in indices]
        return EvalSample(name or self.name, tuple(self.inputs[i] for i in idx),
                          tuple(self.references[i] for i in idx), self.metric)
