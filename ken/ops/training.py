"""A user's labelled rows for training or calibrating an operator (``session.train``).

``TrainingData.from_arrow`` reads the text columns and the label column of a table, checks them
(clear errors for a missing column, NULL labels or texts, a single class, no positive label for
a boolean operator) and fingerprints the rows: the hash covers the values only, never where
they came from, so the same rows from a DuckDB table, a Parquet file or a DataFrame train the
same models and hit the same cache, and any changed text or label gives a new hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ken.errors import DataError, KenError
from ken.models.certainty import certainty_fn
from ken.ops.base import suggest

_TRUE = frozenset({"true", "t", "yes", "y", "1"})
_FALSE = frozenset({"false", "f", "no", "n", "0"})


@dataclass(frozen=True, eq=False)
class TrainingData:
    """Labelled rows: ``texts[c][i]`` is column ``columns[c]`` of row i, ``labels[i]`` its
    label as text (booleans as ``"true"`` / ``"false"``)."""

    source: str  # where the rows came from (a table name or a file), for messages and EXPLAIN
    columns: tuple[str, ...]
    label: str
    texts: tuple[tuple[str, ...], ...] = field(repr=False)
    labels: tuple[str, ...] = field(repr=False)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.labels)))

    @property
    def content_hash(self) -> str:
        h = hashlib.sha256(repr(len(self.columns)).encode())
        for i in range(len(self)):
            for column in self.texts:
                h.update(column[i].encode("utf-8", "replace") + b"\x1f")
            h.update(self.labels[i].encode("utf-8", "replace") + b"\x1e")
        return h.hexdigest()[:16]

    def describe(self) -> str:
        counts = {c: self.labels.count(c) for c in self.classes}
        spread = ", ".join(f"{c}: {n}" for c, n in counts.items())
        return (f"{self.source} ({len(self)} rows, {'+'.join(self.columns)} -> {self.label}; "
                f"{spread}; hash {self.content_hash})")

    def split(self, fractions: Sequence[float], seed: int = 0) -> list[np.ndarray]:
        """Row indices in disjoint parts of the given fractions (the last takes the rest),
        stratified by label so that every part keeps each class where it can."""
        rng = np.random.default_rng(seed)
        parts: list[list[int]] = [[] for _ in fractions]
        labels = np.array(self.labels, dtype=object)
        for c in self.classes:
            rows = rng.permutation(np.flatnonzero(labels == c))
            start = 0
            for k, fraction in enumerate(fractions):
                stop = len(rows) if k == len(fractions) - 1 else \
                    start + int(round(fraction * len(rows)))
                parts[k].extend(rows[start:stop].tolist())
                start = stop
        return [np.sort(np.array(p, dtype=np.int64)) for p in parts]

    def need_classes(self, minimum: int = 2) -> None:
        if len(self.classes) < minimum:
            found = f"only {self.classes[0]!r}" if self.classes else "no labels"
            raise DataError(f"{self.source}: the label column {self.label!r} has {found} in "
                            f"{len(self)} rows; training needs at least {minimum} classes")

    def booleans(self) -> np.ndarray:
        """Labels as booleans (true/false, yes/no, 1/0); an error names any other value and
        a sample without a true (or without a false) label."""
        out = np.zeros(len(self), dtype=bool)
        for i, value in enumerate(self.labels):
            v = value.strip().lower()
            if v not in _TRUE | _FALSE:
                raise DataError(f"{self.source}: label {value!r} of row {i} in column "
                                f"{self.label!r} is not a boolean (true/false, yes/no, 1/0)")
            out[i] = v in _TRUE
        if not out.any():
            raise DataError(f"{self.source}: no row has a true label in {self.label!r} "
                            f"({len(self)} rows); training needs positive examples")
        if out.all():
            raise DataError(f"{self.source}: every row has a true label in {self.label!r}; "
                            "training needs negative examples too")
        return out

    @classmethod
    def from_arrow(cls, table: pa.Table, label: str, columns: Sequence[str] | None = None,
                   source: str = "table") -> TrainingData:
        """The rows of ``table``: ``columns`` (default: every column but the label that holds
        text) and ``label``. NULL labels or texts are errors that count and locate them."""
        names = list(table.column_names)
        if label not in names:
            raise DataError(f"{source} has no label column {label!r} (columns: "
                            f"{', '.join(names)}).{suggest(label, names)}")
        if columns is None:
            columns = [n for n in names if n != label and _is_text_or_record(
                table.schema.field(n).type)]
            if not columns:
                raise DataError(f"{source} has no text or struct column besides {label!r}; "
                                "name the columns to train on")
        for c in columns:
            if c not in names:
                raise DataError(f"{source} has no column {c!r} (columns: {', '.join(names)})."
                                f"{suggest(c, names)}")
            if c == label:
                raise DataError(f"{label!r} is the label column; it cannot also be an input")
        if table.num_rows == 0:
            raise DataError(f"{source} has no rows to train on")
        raw_labels = table.column(label).to_pylist()
        nulls = [i for i, v in enumerate(raw_labels) if v is None]
        if nulls:
            raise DataError(f"{source}: {len(nulls)} of {len(raw_labels)} rows have a NULL label "
                            f"in {label!r} (first: row {nulls[0]}); drop or fill them, e.g. "
                            f"WHERE {label} IS NOT NULL")
        texts = []
        for c in columns:
            values = table.column(c).to_pylist()
            missing = [i for i, v in enumerate(values) if v is None]
            if missing:
                raise DataError(f"{source}: {len(missing)} rows have a NULL {c!r} (first: row "
                                f"{missing[0]}); drop or fill them")
            texts.append(tuple(_cell_text(v) for v in values))
        labels = tuple(_label_text(v) for v in raw_labels)
        return cls(source, tuple(columns), label, tuple(texts), labels)


def _is_text_or_record(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_struct(kind)


def _cell_text(value: object) -> str:
    """A cell as text: structs and lists (a record, a row) as JSON objects."""
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def _label_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@dataclass(frozen=True)
class Trained:
    """What ``session.train`` made: shown by EXPLAIN beside the operator's cascade."""

    function: str
    data: str  # TrainingData.describe()
    content_hash: str
    quality: str  # the validation quality, e.g. "validation accuracy 81.2% on 240 rows"
    where: str  # the cache folder

    def describe(self) -> str:
        return f"trained on {self.data}; {self.quality}"


def check_predicate_option(function: str, options: Mapping[str, object], predicate: str,
                           example: str) -> None:
    """KenError unless training ``function`` got a predicate and no other option
    (``example``: a call that gives one, for the message)."""
    if options:
        raise KenError(f"{function} training takes predicate=... only, not "
                       f"{', '.join(options)}")
    if not predicate or not predicate.strip():
        raise KenError(f"training {function} needs the predicate the labels answer, e.g. "
                       f"{example}")


def cascade_values(cascade: Any, models: Mapping[str, Any], inputs: Sequence) -> list[str]:
    """The value each row gets from ``cascade`` (its escalation rule, stage by stage): for
    measuring a trained operator on held-out rows. ``inputs`` are texts, or pairs for a pair
    model."""
    values: list[str] = [""] * len(inputs)
    pending = np.arange(len(inputs))
    score = certainty_fn(cascade.certainty)
    for stage, name in enumerate(cascade.models):
        if not len(pending):
            break
        pred = models[name].predict([inputs[i] for i in pending])
        escalate = cascade.escalates(stage, score(pred.probabilities))
        for row, value, up in zip(pending.tolist(), pred.label_strings(), escalate.tolist(),
                                  strict=True):
            if not up:
                values[row] = value
        pending = pending[escalate]
    return values

