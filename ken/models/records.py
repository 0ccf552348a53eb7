"""Whole-record entity matching: similarity features of two records, boosted trees on top.

A record is a mapping of attribute names to text values. It arrives as text in one of three
forms (:func:`as_record`): the DeepMatcher/Ditto serialization ``COL name VAL ... COL price VAL
...``, a JSON object (what SQL passes for a struct or a whole row, ``to_json(l)``), or plain
text (a record of one attribute).

:class:`RecordFeaturizer` turns a pair of records into similarity features in the manner of
Magellan (Konda et al., PVLDB 2016): for each attribute and for the whole record, exact
equality, word and character-trigram Jaccard, overlap coefficient, edit-distance ratios,
IDF-weighted cosine, shared model-number tokens, numeric difference and digit equality. A
featurizer without attributes ("generic") uses only the first value and the whole record, so
it applies to records of any schema. :class:`BoostedTrees` holds gradient-boosted trees fitted
by scikit-learn and predicts with numpy alone (saved as arrays, no pickle), and
:class:`RecordMatcher` is the cascade model: features (plus, optionally, MiniLM cosine
similarities per attribute) -> trees -> P(match), shifted so that 0.5 is the decision threshold
chosen for F1 on validation pairs.
"""

from __future__ import annotations

import json
import math
import re
import zipfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rapidfuzz import fuzz

from ken import store
from ken.errors import DataError, ModelError
from ken.models.model import BOOLEAN_LABELS, DeviceConfig, Model, ModelSpec, Prediction
from ken.models.resources import boolean_probabilities, normalise_rows, sigmoid
from ken.models.transformers_backend import TransformersBody

PLAIN = "text"  # the attribute name of a plain-text record
_FIELD = re.compile(r"(?:^|\s)COL\s+(\S+)\s+VAL(?=\s|$)")
_WORD = re.compile(r"\w+")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_DIGIT = re.compile(r"\d")
_ROW_KEY = re.compile(r"(?:^|_)id$", re.IGNORECASE)
MISSING = -1.0  # a similarity that cannot be computed (an empty or non-numeric value)
# texts the MiniLM stage compares: the first value and the whole record (embedding every
# attribute as well costs 2-3x the time on long descriptions)
EMBEDDED_SLOTS = ("^", "*")


# ------------------------------------------------------------------------------ records


def parse_record(serialized: str) -> dict[str, str]:
    """``COL name VAL sony tv COL price VAL 10`` -> ``{"name": "sony tv", "price": "10"}``.

    Attribute order is kept (dicts are ordered): the first attribute is the record's name.
    """
    matches = list(_FIELD.finditer(serialized))
    if not matches:
        raise DataError(f"not a serialized entity (expected 'COL <attr> VAL <value> ...'): "
                        f"{serialized[:80]!r}")
    record: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(serialized)
        record[m.group(1)] = serialized[m.end():end].strip()
    return record


def _value_text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _without_keys(record: dict[str, str]) -> dict[str, str]:
    """The record without row identifiers (``id``, ``*_id``): keys of two tables differ for
    the same entity, and a whole row passed from SQL usually starts with one."""
    kept = {k: v for k, v in record.items() if not _ROW_KEY.search(k)}
    return kept or record


def as_record(value: object) -> dict[str, str]:
    """A record from a serialized entity, a JSON object or JSON string, a dict, or plain text.

    Attributes named ``id`` or ending in ``_id`` are left out (see :func:`_without_keys`).

    >>> as_record('{"name": "sony tv", "price": 10}')
    {'name': 'sony tv', 'price': '10'}
    >>> as_record("sony tv")
    {'text': 'sony tv'}
    """
    if isinstance(value, dict):
        return _without_keys({str(k): _value_text(v) for k, v in value.items()})
    if value is None:
        return {PLAIN: ""}
    text = str(value)
    head = text.lstrip()[:1]
    if head in ('{', '"'):
        try:
            decoded = json.loads(text)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            return _without_keys({str(k): _value_text(v) for k, v in decoded.items()})
        if isinstance(decoded, str):
            return {PLAIN: decoded}
    if "COL " in text and _FIELD.search(text):
        return _without_keys(parse_record(text))
    return {PLAIN: text}


# ------------------------------------------------------------------------------ similarities


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _codes(words: set[str]) -> set[str]:
    """Tokens that look like model or part numbers: mixed letters and digits, or 3+ digits."""
    return {w for w in words if len(w) >= 3 and not w.isalpha()}


def _trigrams(text: str) -> set[str]:
    padded = f"  {text} "
    return {padded[i:i + 3] for i in range(len(padded) - 2)}


def _jaccard(a: set, b: set) -> float:
    union = a | b
    return len(a & b) / len(union) if union else 0.0


def _number(text: str) -> float | None:
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[0]) if found else None


SIMILARITIES = ("both_empty", "one_empty", "exact", "word_jaccard", "overlap", "trigram_jaccard",
                "ratio", "token_set_ratio", "partial_ratio", "idf_cosine", "code_jaccard",
                "shares_code", "number_difference", "same_digits", "length_difference")


@dataclass(frozen=True)
class Idf:
    """Document frequencies of words over the training records' values of one attribute."""

    documents: int
    frequency: Mapping[str, int]  # words seen in 2+ documents; the rest count as 1

    @classmethod
    def fit(cls, texts: Sequence[str]) -> Idf:
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(set(_words(text)))
        return cls(len(texts), {w: c for w, c in counts.items() if c >= 2})

    def weight(self, word: str) -> float:
        return math.log((self.documents + 1) / (self.frequency.get(word, 1) + 1)) + 1.0

    def cosine(self, a: Sequence[str], b: Sequence[str]) -> float:
        ca, cb = Counter(a), Counter(b)
        if not ca or not cb:
            return 0.0
        va = {w: c * self.weight(w) for w, c in ca.items()}
        vb = {w: c * self.weight(w) for w, c in cb.items()}
        dot = sum(v * vb.get(w, 0.0) for w, v in va.items())
        return dot / math.sqrt(sum(v * v for v in va.values()) * sum(v * v for v in vb.values()))


def similarities(a: str, b: str, idf: Idf) -> list[float]:
    """The :data:`SIMILARITIES` of two values (symmetric in ``a`` and ``b``)."""
    wa_list, wb_list = _words(a), _words(b)
    na, nb = " ".join(wa_list), " ".join(wb_list)
    if not na or not nb:
        both = float(not na and not nb)
        return [both, 1.0 - both] + [MISSING] * (len(SIMILARITIES) - 2)
    wa, wb = set(wa_list), set(wb_list)
    ca, cb = _codes(wa), _codes(wb)
    xa, xb = _number(a), _number(b)
    da, db = "".join(_DIGIT.findall(a)), "".join(_DIGIT.findall(b))
    return [
        0.0, 0.0, float(na == nb), _jaccard(wa, wb), len(wa & wb) / min(len(wa), len(wb)),
        _jaccard(_trigrams(na), _trigrams(nb)), fuzz.ratio(na, nb) / 100,
        fuzz.token_set_ratio(na, nb) / 100,
        max(fuzz.partial_ratio(na, nb), fuzz.partial_ratio(nb, na)) / 100,
        idf.cosine(wa_list, wb_list),
        _jaccard(ca, cb) if ca | cb else MISSING, float(bool(ca & cb)),
        (abs(xa - xb) / max(abs(xa), abs(xb), 1e-9)) if xa is not None and xb is not None
        else MISSING,
        float(da == db) if da and db else MISSING,
        abs(len(na) - len(nb)) / max(len(na), len(nb)),
    ]


def whole_text(record: Mapping[str, str]) -> str:
    """Every non-empty value of the record, in order, joined by spaces."""
    return " ".join(v for v in record.values() if v)


def _first(record: Mapping[str, str]) -> str:
    return next(iter(record.values()), "")


@dataclass(frozen=True)
class RecordFeaturizer:
    """Similarity features of record pairs; fitted (IDF tables) on the training records.

    ``attributes`` empty: the generic featurizer (first value and whole record only).
    """

    attributes: tuple[str, ...]
    idf: Mapping[str, Idf]  # per attribute, plus "*" (whole record) and "^" (first value)

    @classmethod
    def fit(cls, records: Sequence[Mapping[str, str]], attributes: Sequence[str] = ()
            ) -> RecordFeaturizer:
        if not records:
            raise DataError("cannot fit record features on no records")
        idf = {a: Idf.fit([r.get(a, "") for r in records]) for a in attributes}
        idf["*"] = Idf.fit([whole_text(r) for r in records])
        idf["^"] = Idf.fit([_first(r) for r in records])
        return cls(tuple(attributes), idf)

    @property
    def slots(self) -> tuple[str, ...]:
        """Which text of a record each block of features compares: attributes, ``^`` (first
        value) and ``*`` (the whole record)."""
        return (*self.attributes, "^", "*")

    @staticmethod
    def text(record: Mapping[str, str], slot: str) -> str:
        if slot == "*":
            return whole_text(record)
        if slot == "^":
            return _first(record)
        return record.get(slot, "")

    @property
    def names(self) -> tuple[str, ...]:
        per = [f"{slot}.{s}" for slot in self.slots for s in SIMILARITIES]
        return (*per, "first_vs_whole", "whole_vs_first")

    def features(self, pairs: Sequence[tuple[Mapping[str, str], Mapping[str, str]]]
                 ) -> np.ndarray:
        rows = []
        whole = self.idf["*"]
        for left, right in pairs:
            row: list[float] = []
            for slot in self.slots:
                row += similarities(self.text(left, slot), self.text(right, slot),
                                    self.idf[slot])
            lf, rf, lw, rw = _first(left), _first(right), whole_text(left), whole_text(right)
            cross = sorted([whole.cosine(_words(lf), _words(rw)),
                            whole.cosine(_words(lw), _words(rf))])  # symmetric
            rows.append(row + cross)
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(self.names))

    def to_json(self) -> str:
        return json.dumps({"attributes": list(self.attributes),
                           "idf": {k: {"documents": v.documents, "frequency": v.frequency}
                                   for k, v in self.idf.items()}})

    @classmethod
    def from_json(cls, text: str) -> RecordFeaturizer:
        data = json.loads(text)
        idf = {k: Idf(int(v["documents"]), v["frequency"]) for k, v in data["idf"].items()}
        return cls(tuple(data["attributes"]), idf)


# ------------------------------------------------------------------------------ trees


@dataclass(frozen=True, eq=False)
class BoostedTrees:
    """Binary gradient-boosted regression trees: ``P = sigmoid(baseline + sum(tree values))``.

    Nodes of all trees are stacked in flat arrays; ``roots[t]`` is tree ``t``'s first node.
    A row goes left when its feature is ``<= threshold`` (or is NaN and ``nan_left``).
    """

    feature: np.ndarray  # int64 per node
    threshold: np.ndarray  # float64
    nan_left: np.ndarray  # bool
    left: np.ndarray  # int64, absolute node index
    right: np.ndarray
    leaf: np.ndarray  # bool
    value: np.ndarray  # float64, a leaf's contribution
    roots: np.ndarray  # int64
    baseline: float

    @classmethod
    def fit(cls, features: np.ndarray, labels: np.ndarray, *, seed: int = 0,
            max_iter: int = 300, learning_rate: float = 0.05) -> BoostedTrees:
        """Fit scikit-learn's ``HistGradientBoostingClassifier`` and keep its trees."""
        try:
            from sklearn.ensemble import HistGradientBoostingClassifier
        except ImportError as exc:  # a dependency of ken; broken environments only
            raise ModelError("training a record matcher needs scikit-learn "
                             "(pip install scikit-learn)") from exc
        labels = np.asarray(labels).astype(np.int64)
        if len(set(labels.tolist())) != 2:
            raise DataError("a record matcher needs both matching and non-matching pairs")
        clf = HistGradientBoostingClassifier(max_iter=max_iter, learning_rate=learning_rate,
                                             random_state=seed, early_stopping=False)
        clf.fit(features, labels)
        return cls.from_sklearn(clf)

    @classmethod
    def from_sklearn(cls, clf) -> BoostedTrees:  # noqa: ANN001 - a fitted sklearn model
        if clf.n_trees_per_iteration_ != 1:
            raise ModelError("only binary boosted trees are supported")
        parts = {k: [] for k in ("feature", "threshold", "nan_left", "left", "right", "leaf",
                                 "value")}
        roots, offset = [], 0
        for (tree,) in clf._predictors:
            nodes = tree.nodes
            if nodes["is_categorical"].any():
                raise ModelError("categorical splits are not supported")
            roots.append(offset)
            parts["feature"].append(nodes["feature_idx"].astype(np.int64))
            parts["threshold"].append(nodes["num_threshold"].astype(np.float64))
            parts["nan_left"].append(nodes["missing_go_to_left"].astype(bool))
            parts["left"].append(nodes["left"].astype(np.int64) + offset)
            parts["right"].append(nodes["right"].astype(np.int64) + offset)
            parts["leaf"].append(nodes["is_leaf"].astype(bool))
            parts["value"].append(nodes["value"].astype(np.float64))
            offset += len(nodes)
        arrays = {k: np.concatenate(v) for k, v in parts.items()}
        return cls(**arrays, roots=np.asarray(roots, dtype=np.int64),
                   baseline=float(np.ravel(clf._baseline_prediction)[0]))

    def raw(self, features: np.ndarray) -> np.ndarray:
        """The log-odds of a match per row."""
        x = np.asarray(features, dtype=np.float64)
        n = x.shape[0]
        total = np.full(n, self.baseline)
        rows = np.arange(n)
        for root in self.roots.tolist():
            node = np.full(n, root, dtype=np.int64)
            active = ~self.leaf[node]
            while active.any():
                idx = rows[active]
                at = node[idx]
                v = x[idx, self.feature[at]]
                go_left = np.where(np.isnan(v), self.nan_left[at], v <= self.threshold[at])
                node[idx] = np.where(go_left, self.left[at], self.right[at])
                active[idx] = ~self.leaf[node[idx]]
            total += self.value[node]
        return total

    def save(self, path: Path) -> None:
        arrays = {k: getattr(self, k) for k in ("feature", "threshold", "nan_left", "left",
                                                "right", "leaf", "value", "roots")}
        with store.atomic_path(path) as tmp, tmp.open("wb") as f:
            np.savez(f, baseline=np.asarray(self.baseline), **arrays)

    @classmethod
    def load(cls, path: Path) -> BoostedTrees:
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            raise ModelError(f"cannot read the boosted trees in {path}: {exc}") from exc
        baseline = float(arrays.pop("baseline"))
        return cls(**arrays, baseline=baseline)


# ------------------------------------------------------------------------------ the model


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def match_probabilities(raw: np.ndarray, threshold: float) -> np.ndarray:
    """``[[P(no match), P(match)], ...]`` from the trees' log-odds, shifted so that the
    decision ``threshold`` (a probability of the trees) sits at 0.5."""
    return boolean_probabilities(sigmoid(np.asarray(raw) - _logit(threshold)))


def embedding_similarities(body: TransformersBody, pairs: Sequence[tuple[Mapping, Mapping]],
                           slots: Sequence[str], batch_size: int = 32) -> np.ndarray:
    """Cosine similarity of the two records' texts per slot (``MISSING`` if one is empty);
    each distinct text is embedded once."""
    texts = [RecordFeaturizer.text(r, s) for pair in pairs for r in pair for s in slots]
    distinct = list(dict.fromkeys(t for t in texts if t.strip()))
    emb = (normalise_rows(body.features(distinct, batch_size).astype(np.float64))
           if distinct else np.zeros((0, 1)))
    where = {t: i for i, t in enumerate(distinct)}
    out = np.full((len(pairs), len(slots)), MISSING)
    for i, (left, right) in enumerate(pairs):
        for j, slot in enumerate(slots):
            a, b = RecordFeaturizer.text(left, slot), RecordFeaturizer.text(right, slot)
            if a in where and b in where:
                out[i, j] = float(emb[where[a]] @ emb[where[b]])
    return out


class RecordMatcher(Model):
    """P(the two records name the same entity) from similarity features and boosted trees.

    With ``body`` the features also hold the MiniLM cosine similarity of the first values and
    of the whole records (:data:`EMBEDDED_SLOTS`).
    ``threshold`` is the probability (of the trees) at which the matcher says "match"; the
    prediction is shifted so that 0.5 is that point, and certainty = distance from it.
    """

    def __init__(self, name: str, featurizer: RecordFeaturizer, trees: BoostedTrees,
                 threshold: float = 0.5, body: TransformersBody | None = None,
                 fingerprint: str = "", family: str = "sem-match",
                 device: DeviceConfig | None = None) -> None:
        if not 0.0 < threshold < 1.0:
            raise ModelError(f"{name}: decision threshold {threshold} is not in (0, 1)")
        self.featurizer = featurizer
        self.trees = trees
        self.threshold = float(threshold)
        self.body = body
        # without a body it computes on the host of whichever worker runs it: ``device`` says
        # which (profiles are keyed by it)
        self.device = body.device if body is not None else (device or DeviceConfig())
        params = int(len(trees.value)) + (body.num_params if body is not None else 0)
        self.spec = ModelSpec(
            name=name, family=family, backend="transformers" if body is not None else "numpy",
            source=body.config.source if body is not None else "boosted-trees",
            num_params=params, memory_bytes=body.memory_bytes if body is not None else 0,
            max_tokens=body.max_tokens if body is not None else 0, labels=BOOLEAN_LABELS,
            fingerprint=fingerprint, num_inputs=2)

    def features(self, pairs: Sequence[tuple[Mapping, Mapping]], batch_size: int = 32
                 ) -> np.ndarray:
        lexical = self.featurizer.features(pairs)
        if self.body is None:
            return lexical
        return np.hstack([lexical, embedding_similarities(self.body, pairs, EMBEDDED_SLOTS,
                                                          batch_size)])

    def predict(self, texts: Sequence, batch_size: int = 32) -> Prediction:
        pairs = [(as_record(a), as_record(b)) for a, b in check_pairs(self.name, texts)]
        probs = match_probabilities(self.trees.raw(self.features(pairs, batch_size)),
                                    self.threshold)
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, BOOLEAN_LABELS)


def check_pairs(name: str, texts: Sequence) -> list[tuple[object, object]]:
    """The rows of a two-column model as pairs; anything else is a clear error."""
    out = []
    for pair in texts:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise DataError(f"{name} takes pairs of records (two columns), got {pair!r}")
        out.append((pair[0], pair[1]))
    return out


def best_f1_threshold(probability: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """The probability cut-off with the highest F1 of the match class, and that F1.

    Candidates lie midway between neighbouring distinct probabilities; among equally good
    cut-offs the middle one of the best run is taken (robust to small shifts).
    """
    p = np.asarray(probability, dtype=np.float64)
    y = np.asarray(truth).astype(bool)
    if not y.any():
        raise DataError("cannot choose a match threshold without a matching pair")
    values = np.unique(p)
    cuts = np.concatenate([(values[:-1] + values[1:]) / 2, [values[-1] + 1e-9]])
    cuts = cuts[(cuts > 0) & (cuts < 1)]
    if not len(cuts):
        return 0.5, f1_score(p > 0.5, y)
    scores = np.array([f1_score(p > c, y) for c in cuts])
    best = np.flatnonzero(scores >= scores.max() - 1e-12)
    return float(cuts[best[len(best) // 2]]), float(scores.max())


def f1_score(predicted: np.ndarray, truth: np.ndarray) -> float:
    pred = np.asarray(predicted).astype(bool)
    true = np.asarray(truth).astype(bool)
    tp = int((pred & true).sum())
    return 2 * tp / (int(pred.sum()) + int(true.sum())) if tp else 0.0

