"""A text classifier over word n-grams: TF-IDF features and a logistic regression.

Fitted in seconds on a few thousand short texts with scikit-learn, with the regularisation
chosen by stratified cross-validation, and served in-process (nothing is saved: fitting again
is cheaper than a store entry). ken routes MultiModalQA questions with it
(``ken.multihop.question_type_model``): on the 1,439 text and table questions of the dev set
outside the n100 slice, 5-fold cross-validated route accuracy was 0.78 against 0.70 for
MiniLM-L6 features with a logistic head (the classifier it replaced), and on the slice's 62
questions 0.71-0.76 against 0.66 (``docs/results.md``, issue 34). Question types are told
apart by phrasing ("the team that ...", "in which film ..."), which word n-grams see directly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ken.errors import ModelError
from ken.models.model import DeviceConfig, Model, ModelSpec, Prediction

#: inverse regularisation strengths tried by cross-validation
C_GRID = (1.0, 3.0, 10.0, 30.0)
FOLDS = 5
NGRAMS = (1, 3)


class NgramClassifier(Model):
    """A fitted TF-IDF + logistic-regression classifier over ``spec.labels``."""

    def __init__(self, spec: ModelSpec, vectorizer: Any, classifier: Any, cv_accuracy: float,
                 strength: float) -> None:
        self.spec = spec
        self.device = DeviceConfig(threads=1)
        self.vectorizer = vectorizer  # a fitted sklearn TfidfVectorizer
        self.classifier = classifier  # a fitted sklearn LogisticRegression
        #: cross-validated accuracy of the chosen strength on the training texts
        self.cv_accuracy = cv_accuracy
        self.strength = strength  # the inverse regularisation strength chosen

    def predict(self, texts: Sequence, batch_size: int = 32) -> Prediction:
        names = self.spec.labels
        probs = np.zeros((len(texts), len(names)), dtype=np.float32)
        if len(texts):
            got = self.classifier.predict_proba(
                self.vectorizer.transform([str(t) for t in texts]))
            # the classifier's columns are the labels it saw, in index order
            probs[:, self.classifier.classes_] = got
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, names)


def fit_ngram_classifier(name: str, texts: Sequence[str], labels: Sequence[int] | np.ndarray,
                         label_names: Sequence[str], family: str = "ngram",
                         grid: Sequence[float] = C_GRID, folds: int = FOLDS, seed: int = 0
                         ) -> NgramClassifier:
    """Fit on ``texts`` with label indices into ``label_names``: the strength of ``grid`` with
    the best ``folds``-fold stratified cross-validated accuracy (classes weighted by their
    inverse frequency, so a rare type is not given up), then refit on all texts."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score

    y = np.asarray(labels, dtype=np.int64)
    if len(texts) != len(y):
        raise ModelError(f"{len(texts)} texts but {len(y)} labels")
    if y.size and (y.min() < 0 or y.max() >= len(label_names)):
        raise ModelError(f"labels must index the {len(label_names)} label names")
    seen, counts = np.unique(y, return_counts=True)
    if seen.size < 2:
        raise ModelError(f"fitting a classifier needs texts of at least two labels, got "
                         f"{seen.size}")
    if not grid:
        raise ModelError("give at least one regularisation strength")
    splits = min(folds, int(counts.min()))
    vectorizer = TfidfVectorizer(ngram_range=NGRAMS, min_df=2 if len(y) >= 50 else 1,
                                 sublinear_tf=True)
    features = vectorizer.fit_transform([str(t) for t in texts])

    def model(c: float) -> Any:
        return LogisticRegression(C=c, max_iter=3000, class_weight="balanced")

    scores = {float(c): float("nan") for c in grid}
    if splits >= 2:
        cv = StratifiedKFold(splits, shuffle=True, random_state=seed)
        scores = {float(c): float(cross_val_score(model(c), features, y, cv=cv).mean())
                  for c in grid}
        best = max(scores, key=lambda c: (scores[c], -c))  # ties: the stronger regulariser
    else:  # a label with one text: no split keeps it on both sides
        best = float(grid[0])
    classifier = model(best).fit(features, y)
    digest = hashlib.sha256(repr((NGRAMS, best, list(map(str, texts)), y.tolist(),
                                  tuple(label_names))).encode()).hexdigest()[:12]
    vocab = len(vectorizer.vocabulary_)
    spec = ModelSpec(name=name, family=family, backend="sklearn", source="fitted in memory",
                     num_params=vocab * len(seen), memory_bytes=8 * vocab * (len(seen) + 2),
                     max_tokens=0, labels=tuple(label_names), fingerprint=f"{name}-{digest}")
    return NgramClassifier(spec, vectorizer, classifier, scores[best], best)
