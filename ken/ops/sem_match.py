"""``sem_match(a, b) -> boolean``: do two texts name the same entity (product, paper, ...)?

Served by a cascade of two pair classifiers, :class:`PairModel` on MiniLM-L3 then on MiniLM-L6:
each embeds both sides, builds the symmetric features ``[|u - v|, u * v, cos(u, v)]`` (plus, by
default, two lexical ones: word overlap and a shared model-number token) and applies a
logistic-regression head trained on labelled entity-matching pairs (the Magellan/DeepMatcher
benchmarks in ``../shared/data/entity-matching``). Users write ``sem_match(l.title, r.title)``,
so the heads train on one attribute per record (the first: a product's name, a paper's title).

Trained heads are cached under ``KEN_HOME/families/sem-match/<dataset>/<attribute>/`` with a
JSON card of validation and test F1 / accuracy and the cascade threshold, which is calibrated on
the validation split. On a machine without the data and without cached heads, ``sem_match``
falls back to :class:`SimilarityPairModel`, an *uncalibrated* cosine-similarity rule.

>>> # bound = bind_sem_match(Resources())
>>> # result = run_cascade(bound.cascade, bound.models, [left_titles, right_titles])
>>> # bound.to_sql_values(result.labels)  # [True, False, None, ...]
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ken.errors import DataError, KenError, ModelError
from ken.models.cascade import Cascade
from ken.models.head import LinearHead, fit_logistic_cv
from ken.models.model import BOOLEAN_LABELS, DeviceConfig, Model, ModelSpec, Prediction
from ken.models.quality import EvalSample
from ken.models.resources import (
    Resources,
    boolean_probabilities,
    normalise_rows,
    sigmoid,
)
from ken.models.transformers_backend import TransformersBody
from ken.ops.base import Bound, BoundSemantic, OpContext, Operator, shared_resources
from ken.ops.training import Trained, TrainingData
from ken.paths import shared_data_dir
from ken.progress import Reporter

FAMILY = "sem-match"
DEFAULT_DATASET = "Abt-Buy"
SPLITS = ("train", "valid", "test")
MEMBERS = ("minilm-l3", "minilm-l6")  # cheapest first: the cascade's stage order
SHORT_NAMES = {"minilm-l3": "l3", "minilm-l6": "l6"}
CARD_SCHEMA_VERSION = 1
DEFAULT_TOLERANCE = 0.005  # the cascade may lose at most 0.5 accuracy points against L6 alone
DEFAULT_FEATURES = "embedding+lexical"

# Uncalibrated fallback (no data, no cached heads): cosine similarity of all-MiniLM-L6-v2
# embeddings above 0.85 means a match. Measured on the first attribute of the test splits, the
# best fixed cut-off is 0.85 on Abt-Buy (F1 0.47), 0.9 on DBLP-ACM (0.90) and 0.8 on
# Amazon-Google (0.47); 0.85 costs at most 0.06 F1 on any of them. A rough rule, not a model.
FALLBACK_SCALE = 20.0
FALLBACK_OFFSET = 0.85

_FIELD = re.compile(r"(?:^|\s)COL\s+(\S+)\s+VAL(?=\s|$)")


# ------------------------------------------------------------------------------- data


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


@dataclass(frozen=True, eq=False)
class EntityPairs:
    """Labelled pairs of entity texts (one attribute per side); label 1 means a match."""

    name: str
    left: tuple[str, ...]
    right: tuple[str, ...]
    labels: np.ndarray  # int64, 0 = no match, 1 = match

    def __post_init__(self) -> None:
        if not len(self.left) == len(self.right) == len(self.labels):
            raise DataError(f"{self.name}: {len(self.left)} left, {len(self.right)} right "
                            f"texts and {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.left)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        return list(zip(self.left, self.right, strict=True))

    def subset(self, indices: Sequence[int], name: str) -> EntityPairs:
        idx = np.asarray(indices, dtype=np.int64)
        return EntityPairs(name, tuple(self.left[i] for i in idx),
                           tuple(self.right[i] for i in idx), self.labels[idx])


def dataset_dir(dataset: str, data_dir: Path | None = None) -> Path:
    return (data_dir or shared_data_dir()) / "entity-matching" / dataset


def has_data(dataset: str, data_dir: Path | None = None) -> bool:
    folder = dataset_dir(dataset, data_dir)
    return all((folder / f"{s}.txt").is_file() for s in SPLITS)


def load_pairs(dataset: str, split: str, data_dir: Path | None = None,
               attribute: str | None = None) -> EntityPairs:
    """One split of an entity-matching dataset, one attribute per side (default: the first).

    Lines are ``<left record> TAB <right record> TAB <label>``, records serialized as in
    :func:`parse_record`.
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of: {', '.join(SPLITS)}")
    path = dataset_dir(dataset, data_dir) / f"{split}.txt"
    if not path.is_file():
        raise DataError(f"entity-matching data not found at {path}; put the DeepMatcher/Ditto "
                        f"files in <data-dir>/entity-matching/{dataset}/ or pass data_dir")
    left: list[str] = []
    right: list[str] = []
    labels: list[int] = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 3 or parts[2].strip() not in ("0", "1"):
                raise DataError(f"{path}:{number}: expected '<left> TAB <right> TAB 0|1'")
            for side, out in ((parts[0], left), (parts[1], right)):
                record = parse_record(side)
                key = attribute or next(iter(record))
                if key not in record:
                    raise DataError(f"{path}:{number}: no attribute {key!r}; this dataset has "
                                    f"{', '.join(record)}")
                out.append(record[key])
            labels.append(int(parts[2]))
    return EntityPairs(f"{dataset}-{split}", tuple(left), tuple(right),
                       np.asarray(labels, dtype=np.int64))


def first_attribute(dataset: str, data_dir: Path | None = None) -> str:
    """Name of the first attribute of the dataset's records (``name``, ``title``)."""
    path = dataset_dir(dataset, data_dir) / "train.txt"
    with path.open(encoding="utf-8", errors="replace") as f:
        return next(iter(parse_record(f.readline().split("\t")[0])))


def data_hash(dataset: str, data_dir: Path | None = None) -> str:
    h = hashlib.sha256()
    for split in SPLITS:
        h.update((dataset_dir(dataset, data_dir) / f"{split}.txt").read_bytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------- models


def pair_embeddings(body: TransformersBody, pairs: Sequence[tuple[str, str]],
                    batch_size: int = 32, on_batch: Callable[[int], None] | None = None,
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Unit-norm embeddings ``(u, v)`` of both sides; each distinct text is embedded once.

    A join compares every left value with many right values, so distinct texts are far fewer
    than pairs; embedding them once is where most of the time goes.
    """
    if not pairs:
        dim = int(body.net.config.hidden_size)
        return np.zeros((0, dim)), np.zeros((0, dim))
    distinct = list(dict.fromkeys(t for pair in pairs for t in pair))
    where = {t: i for i, t in enumerate(distinct)}
    emb = normalise_rows(body.features(distinct, batch_size, on_batch).astype(np.float64))
    u = emb[[where[a] for a, _ in pairs]]
    v = emb[[where[b] for _, b in pairs]]
    return u, v


FEATURE_SETS = ("embedding", "embedding+lexical")
_WORD = re.compile(r"\w+")


def _code_tokens(words: set[str]) -> set[str]:
    """Tokens that look like model or part numbers (letters and digits, 4+ characters)."""
    return {w for w in words if len(w) >= 4 and not w.isdigit() and not w.isalpha()}


def lexical_features(left: Sequence[str], right: Sequence[str]) -> np.ndarray:
    """Per pair: word-set Jaccard overlap, and 1 if both share a model-number-like token.

    Sentence embeddings blur exactly what identifies a product ("lds4821ww" vs "lds4820ww");
    on Abt-Buy names these two features lift the pair heads' test F1 from ~0.5 to ~0.63.
    """
    out = np.zeros((len(left), 2))
    for i, (a, b) in enumerate(zip(left, right, strict=True)):
        wa, wb = set(_WORD.findall(a.lower())), set(_WORD.findall(b.lower()))
        out[i, 0] = len(wa & wb) / len(wa | wb) if wa | wb else 0.0
        out[i, 1] = float(bool(_code_tokens(wa) & _code_tokens(wb)))
    return out


def pair_features(u: np.ndarray, v: np.ndarray, pairs: Sequence[tuple[str, str]] | None = None,
                  feature_set: str = "embedding") -> np.ndarray:
    """``[|u - v|, u * v, cos(u, v)]`` (+ :func:`lexical_features` of ``pairs``).

    Every feature is symmetric in the two sides, so the pair models are too.
    """
    if feature_set not in FEATURE_SETS:
        raise ModelError(f"unknown sem_match feature set {feature_set!r}; use one of: "
                         f"{', '.join(FEATURE_SETS)}")
    parts = [np.abs(u - v), u * v, (u * v).sum(axis=1, keepdims=True)]
    if feature_set == "embedding+lexical":
        if pairs is None:
            raise ModelError("lexical features need the texts of the pairs")
        parts.append(lexical_features([a for a, _ in pairs], [b for _, b in pairs]))
    return np.hstack(parts)


def _check_pairs(name: str, pairs: Sequence) -> list[tuple[str, str]]:
    out = []
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise DataError(f"{name} takes pairs of texts (two columns), got {pair!r}")
        out.append((pair[0], pair[1]))
    return out


class PairModel(Model):
    """Entity match from a MiniLM pair embedding and a logistic-regression head."""

    def __init__(self, body: TransformersBody, head: LinearHead, name: str,
                 fingerprint: str = "", feature_set: str = "embedding") -> None:
        if tuple(head.label_names) != BOOLEAN_LABELS:
            raise ModelError(f"{name}: head labels {head.label_names} != {BOOLEAN_LABELS}")
        hidden = int(body.net.config.hidden_size)
        expected = 2 * hidden + 1 + (2 if feature_set == "embedding+lexical" else 0)
        if head.weight.shape[0] != expected:
            raise ModelError(f"{name}: the head takes {head.weight.shape[0]} features but "
                             f"{feature_set} features of a {hidden}-wide body are {expected}; "
                             "prepare sem_match again (prepare_sem_match(..., force=True))")
        self.body = body
        self.head = head
        self.feature_set = feature_set
        self.device = body.device
        self.spec = ModelSpec(
            name=name, family=FAMILY, backend="transformers", source=body.config.source,
            num_params=body.num_params + head.num_params, memory_bytes=body.memory_bytes,
            max_tokens=body.max_tokens, labels=BOOLEAN_LABELS, fingerprint=fingerprint,
            num_inputs=2,
        )

    def features(self, pairs: Sequence[tuple[str, str]], batch_size: int = 32,
                 on_batch: Callable[[int], None] | None = None) -> np.ndarray:
        pairs = _check_pairs(self.name, pairs)
        u, v = pair_embeddings(self.body, pairs, batch_size, on_batch)
        return pair_features(u, v, pairs, self.feature_set)

    def predict(self, texts: Sequence, batch_size: int = 32) -> Prediction:
        probs = self.head.predict_proba(self.features(texts, batch_size))
        probs = probs.reshape(len(texts), len(BOOLEAN_LABELS))
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, BOOLEAN_LABELS)


class SimilarityPairModel(Model):
    """Uncalibrated fallback: ``P(match) = sigmoid(scale * (cos(u, v) - offset))``."""

    def __init__(self, body: TransformersBody, scale: float = FALLBACK_SCALE,
                 offset: float = FALLBACK_OFFSET, name: str = "simpair-l6") -> None:
        self.body = body
        self.scale = float(scale)
        self.offset = float(offset)
        self.device = body.device
        self.spec = ModelSpec(
            name=name, family=FAMILY, backend="transformers", source=body.config.source,
            num_params=body.num_params, memory_bytes=body.memory_bytes,
            max_tokens=body.max_tokens, labels=BOOLEAN_LABELS,
            fingerprint=f"{name}-{self.scale:g}-{self.offset:g}", num_inputs=2,
        )

    def cosine(self, pairs: Sequence, batch_size: int = 32) -> np.ndarray:
        u, v = pair_embeddings(self.body, _check_pairs(self.name, pairs), batch_size)
        return (u * v).sum(axis=1)

    def predict(self, texts: Sequence, batch_size: int = 32) -> Prediction:
        probs = boolean_probabilities(sigmoid(self.scale * (self.cosine(texts, batch_size)
                                                            - self.offset)))
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, BOOLEAN_LABELS)


# ------------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class MatchScores:
    """Accuracy and F1 of the "match" class on one labelled split."""

    accuracy: float
    f1: float
    precision: float
    recall: float
    num_rows: int

    @classmethod
    def of(cls, predicted: np.ndarray, truth: np.ndarray) -> MatchScores:
        pred = np.asarray(predicted).astype(bool)
        true = np.asarray(truth).astype(bool)
        tp = int((pred & true).sum())
        precision = tp / pred.sum() if pred.sum() else 0.0
        recall = tp / true.sum() if true.sum() else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        return cls(float((pred == true).mean()) if len(true) else math.nan, float(f1),
                   float(precision), float(recall), int(len(true)))


def cascade_labels(cheap: np.ndarray, strong: np.ndarray, threshold: float) -> np.ndarray:
    """Labels of a two-stage max-prob cascade given both stages' probabilities (rows, 2)."""
    sure = np.asarray(cheap, dtype=np.float64).max(axis=1)
    return np.where(sure < threshold, strong.argmax(axis=1), cheap.argmax(axis=1))


def choose_threshold(cheap: np.ndarray, strong: np.ndarray, truth: np.ndarray,
                     tolerance: float = DEFAULT_TOLERANCE) -> float:
    """The threshold escalating the fewest rows while staying within ``tolerance`` accuracy of
    the strong model alone.

    Candidates lie midway between neighbouring certainties of the cheap model (so float
    rounding at run time does not move rows across), plus "escalate nothing" (0) and
    "escalate everything" (just above the largest certainty).
    """
    sure = np.asarray(cheap, dtype=np.float64).max(axis=1)
    truth = np.asarray(truth)
    right_cheap = cheap.argmax(axis=1) == truth
    right_strong = strong.argmax(axis=1) == truth
    n = len(truth)
    if n == 0:
        raise DataError("cannot calibrate a cascade threshold on no rows")
    goal = right_strong.mean() - tolerance
    order = np.argsort(sure, kind="stable")  # least certain first: escalated first
    s = sure[order]
    # accuracy when the k least certain rows escalate
    gain = np.concatenate([[0], np.cumsum(right_strong[order].astype(int)
                                          - right_cheap[order].astype(int))])
    accuracy = (right_cheap.sum() + gain) / n
    for k in range(n + 1):
        if 0 < k < n and not s[k - 1] < s[k]:
            continue  # ties cannot be split by a threshold
        if accuracy[k] >= goal - 1e-12:
            if k == 0:
                return 0.0
            if k == n:
                return float(np.nextafter(s[-1], np.inf))
            return float((s[k - 1] + s[k]) / 2)
    return float(np.nextafter(s[-1], np.inf))  # unreachable: k == n meets the goal


# ------------------------------------------------------------------------------- cards


@dataclass(frozen=True)
class MemberCard:
    """One trained pair model: where its head is and how it scored."""

    name: str  # model name in cascades, e.g. "pair-l3[abt-buy.name]"
    member: str  # body: minilm-l3 / minilm-l6
    head_file: str  # relative to the card's folder
    fingerprint: str
    l2: float
    valid: MatchScores
    test: MatchScores
    ms_per_text: float  # embedding one distinct text (a pair costs up to two)


@dataclass(frozen=True)
class MatchCard:
    """What ``prepare_sem_match`` trained and measured for one dataset and attribute."""

    dataset: str
    attribute: str
    feature_set: str
    data_hash: str
    num_train: int  # training pairs used
    num_train_requested: int | None  # None: the whole train split
    members: tuple[MemberCard, ...]
    threshold: float
    tolerance: float
    cascade_valid: MatchScores
    cascade_test: MatchScores
    escalation_valid: float
    escalation_test: float
    schema_version: int = CARD_SCHEMA_VERSION

    def member(self, name: str) -> MemberCard:
        for m in self.members:
            if m.member == name:
                return m
        raise ModelError(f"the sem-match card of {self.dataset} has no {name}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> MatchCard:
        data = json.loads(text)
        if data.get("schema_version") != CARD_SCHEMA_VERSION:
            raise ModelError("the sem-match card has an old schema; prepare it again "
                             "(prepare_sem_match(..., force=True))")
        for key in ("cascade_valid", "cascade_test"):
            data[key] = MatchScores(**data[key])
        data["members"] = tuple(
            MemberCard(**{**m, "valid": MatchScores(**m["valid"]),
                          "test": MatchScores(**m["test"])}) for m in data["members"])
        return cls(**data)


def match_dir(dataset: str, attribute: str | None, home: Path) -> Path:
    """``KEN_HOME/families/sem-match/<dataset>/<attribute or 'first'>``."""
    return home / "families" / FAMILY / dataset / (attribute or "first")


def model_name(member: str, dataset: str, attribute: str) -> str:
    return f"pair-{SHORT_NAMES[member]}[{dataset.lower()}.{attribute}]"


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _reusable(card: MatchCard, present: bool, dataset: str, data_dir: Path | None,
              feature_set: str, num_train: int | None, tolerance: float) -> bool:
    if not present:
        return True  # cannot retrain: trained heads beat the uncalibrated fallback
    same = (card.feature_set == feature_set and card.num_train_requested == num_train
            and card.tolerance == tolerance)
    return same and card.data_hash == data_hash(dataset, data_dir)


def prepare_sem_match(resources: Resources, dataset: str = DEFAULT_DATASET,
                      data_dir: Path | None = None, attribute: str | None = None, *,
                      feature_set: str = DEFAULT_FEATURES, num_train: int | None = None,
                      tolerance: float = DEFAULT_TOLERANCE, force: bool = False,
                      batch_size: int = 32, reporter: Reporter | None = None) -> MatchCard:
    """Train (or reuse) the L3 and L6 pair heads and calibrate the cascade threshold.

    Heads train on the ``train`` split (or ``num_train`` pairs of it; L2 strength chosen on a
    held-out fifth), the threshold is chosen on ``valid`` (:func:`choose_threshold`), and
    ``test`` is only scored. A cached card is reused when it was made with the same settings
    from the same files, or when the files are absent. Each member embeds every distinct text
    of all three splits once (a product appears in many pairs).
    """
    if feature_set not in FEATURE_SETS:
        raise ModelError(f"unknown sem_match feature set {feature_set!r}; use one of: "
                         f"{', '.join(FEATURE_SETS)}")
    reporter = reporter or resources.reporter
    folder = match_dir(dataset, attribute, resources.home)
    card_path = folder / "card.json"
    present = has_data(dataset, data_dir)
    if card_path.exists() and not force:
        card = MatchCard.from_json(card_path.read_text())
        if _reusable(card, present, dataset, data_dir, feature_set, num_train, tolerance):
            return card
    if not present:
        raise DataError(f"no entity-matching data for {dataset} at "
                        f"{dataset_dir(dataset, data_dir)} and no trained heads in {folder}")
    resolved = attribute or first_attribute(dataset, data_dir)
    splits = {s: load_pairs(dataset, s, data_dir, attribute) for s in SPLITS}
    if num_train is not None and num_train < len(splits["train"]):
        keep = np.sort(np.random.default_rng(0).permutation(len(splits["train"]))[:num_train])
        splits["train"] = splits["train"].subset(keep, f"{dataset}-train{num_train}")
    return train_pair_heads(resources, dataset, resolved, splits, data_hash(dataset, data_dir),
                            folder, feature_set=feature_set, num_train=num_train,
                            tolerance=tolerance, batch_size=batch_size, reporter=reporter)


def train_pair_heads(resources: Resources, dataset: str, attribute: str,
                     splits: Mapping[str, EntityPairs], content_hash: str, folder: Path, *,
                     feature_set: str = DEFAULT_FEATURES, num_train: int | None = None,
                     tolerance: float = DEFAULT_TOLERANCE, batch_size: int = 32,
                     reporter: Reporter | None = None) -> MatchCard:
    """Train the L3 and L6 pair heads on ``splits["train"]``, choose the cascade threshold on
    ``splits["valid"]``, score ``splits["test"]``; write the heads and the card to ``folder``."""
    if feature_set not in FEATURE_SETS:
        raise ModelError(f"unknown sem_match feature set {feature_set!r}; use one of: "
                         f"{', '.join(FEATURE_SETS)}")
    reporter = reporter or resources.reporter
    card_path = folder / "card.json"
    reporter.note(f"sem_match: training pair heads on {len(splits['train'])} {dataset} pairs "
                  f"({attribute}, {feature_set} features), {len(splits['valid'])} for "
                  f"calibration, {len(splits['test'])} held out")
    distinct = list(dict.fromkeys(t for p in splits.values() for t in (*p.left, *p.right)))
    where = {t: i for i, t in enumerate(distinct)}
    folder.mkdir(parents=True, exist_ok=True)
    members: list[MemberCard] = []
    probs: dict[str, dict[str, np.ndarray]] = {}
    for member in MEMBERS:
        body = resources.encoder(member)
        name = model_name(member, dataset, attribute)
        with reporter.task(f"{name}: {len(distinct)} distinct texts", len(distinct)) as adv:
            started = time.perf_counter()
            emb = normalise_rows(body.features(distinct, batch_size, adv).astype(np.float64))
            ms_per_text = (time.perf_counter() - started) / max(1, len(distinct)) * 1000
        feats = {}
        for split, pairs in splits.items():
            u = emb[[where[t] for t in pairs.left]]
            v = emb[[where[t] for t in pairs.right]]
            feats[split] = pair_features(u, v, pairs.pairs, feature_set)
        head = fit_logistic_cv(feats["train"], splits["train"].labels, BOOLEAN_LABELS)
        head_file = f"{member}.head.safetensors"
        head.save(folder / head_file)
        probs[member] = {s: head.predict_proba(feats[s]) for s in ("valid", "test")}
        scores = {s: MatchScores.of(probs[member][s].argmax(axis=1), splits[s].labels)
                  for s in ("valid", "test")}
        members.append(MemberCard(name, member, head_file, _file_digest(folder / head_file),
                                  head.l2, scores["valid"], scores["test"], ms_per_text))
        reporter.note(f"  {name}: test F1 {scores['test'].f1:.3f}, "
                      f"accuracy {scores['test'].accuracy:.3f}")
    cheap, strong = MEMBERS
    threshold = choose_threshold(probs[cheap]["valid"], probs[strong]["valid"],
                                 splits["valid"].labels, tolerance)
    cascade_scores = {}
    escalation = {}
    for s in ("valid", "test"):
        labels = cascade_labels(probs[cheap][s], probs[strong][s], threshold)
        cascade_scores[s] = MatchScores.of(labels, splits[s].labels)
        escalation[s] = float((probs[cheap][s].max(axis=1) < threshold).mean())
    card = MatchCard(dataset, attribute, feature_set, content_hash,
                     len(splits["train"]), num_train, tuple(members), threshold, tolerance,
                     cascade_scores["valid"], cascade_scores["test"], escalation["valid"],
                     escalation["test"])
    card_path.write_text(card.to_json())
    reporter.note(f"  cascade {cheap} -({threshold:.3f})-> {strong}: test F1 "
                  f"{cascade_scores['test'].f1:.3f}, escalates {escalation['test']:.0%}")
    return card


def load_card(resources: Resources, dataset: str = DEFAULT_DATASET,
              attribute: str | None = None) -> MatchCard:
    """The cached card of a prepared dataset (see :func:`prepare_sem_match`)."""
    path = match_dir(dataset, attribute, resources.home) / "card.json"
    if not path.exists():
        raise ModelError(f"sem_match is not prepared for {dataset} in {path.parent}; "
                         "run prepare_sem_match (or bind_sem_match) with the data present")
    return MatchCard.from_json(path.read_text())


def load_pair_model(resources: Resources, member: str, dataset: str = DEFAULT_DATASET,
                    attribute: str | None = None, device: DeviceConfig | None = None
                    ) -> PairModel:
    """The trained pair model of ``member`` (``minilm-l3`` / ``minilm-l6``) from the cache."""
    card = load_card(resources, dataset, attribute)
    m = card.member(member)
    head = LinearHead.load(match_dir(dataset, attribute, resources.home) / m.head_file)
    return PairModel(resources.encoder(member, device), head, m.name, m.fingerprint,
                     card.feature_set)


def bind_sem_match(resources: Resources, dataset: str = DEFAULT_DATASET,
                   data_dir: Path | None = None, attribute: str | None = None, *,
                   feature_set: str = DEFAULT_FEATURES, num_train: int | None = None,
                   tolerance: float = DEFAULT_TOLERANCE, single: str | None = None,
                   device: DeviceConfig | None = None) -> BoundSemantic:
    """Bind ``sem_match(a, b)``: the calibrated L3 -> L6 pair cascade, or the fallback.

    Trains the heads on first use (~30 s on one thread, cached in ``KEN_HOME``; see
    :func:`prepare_sem_match` for ``feature_set`` and ``num_train``). ``single`` binds
    one member alone (``"minilm-l3"`` or ``"minilm-l6"``). Without data and without cached
    heads it binds :class:`SimilarityPairModel` and reports itself uncalibrated; it never fails
    for lack of data.

    >>> # bound = bind_sem_match(Resources())
    >>> # run_cascade(bound.cascade, bound.models, [pa.array(["sony tv"]), pa.array(["tv sony"])])
    """
    if single is not None and single not in MEMBERS:
        raise ModelError(f"unknown sem_match model {single!r}; use one of: {', '.join(MEMBERS)}")
    folder = match_dir(dataset, attribute, resources.home)
    if not has_data(dataset, data_dir) and not (folder / "card.json").exists():
        body = resources.encoder("minilm-l6", device)
        fallback = SimilarityPairModel(body)
        return BoundSemantic(
            "sem_match", Cascade((fallback.name,)), {fallback.name: fallback}, "boolean",
            calibrated=False,
            detail=(f"no {dataset} entity-matching data at {dataset_dir(dataset, data_dir)}: "
                    f"fixed rule cos > {FALLBACK_OFFSET:g}"))
    card = prepare_sem_match(resources, dataset, data_dir, attribute, feature_set=feature_set,
                             num_train=num_train, tolerance=tolerance)
    names = (single,) if single else MEMBERS
    models = {}
    for member in names:
        model = load_pair_model(resources, member, dataset, attribute, device)
        models[model.name] = model
    if single:
        m = card.member(single)
        cascade = Cascade((m.name,))
        detail = f"{dataset}.{card.attribute}: test F1 {m.test.f1:.3f}"
    else:
        cascade = Cascade(tuple(models), (card.threshold,))
        detail = (f"{dataset}.{card.attribute}: threshold from validation, test F1 "
                  f"{card.cascade_test.f1:.3f}, escalates {card.escalation_test:.0%}")
    return BoundSemantic("sem_match", cascade, models, "boolean", calibrated=True,
                         detail=detail)


# -- the operator --------------------------------------------------------------------------------


def load_member(member: str, home: Path | None, threads: int,
                dataset: str = DEFAULT_DATASET) -> PairModel:
    """A trained pair model for a worker process (picklable via ``functools.partial``)."""
    return load_pair_model(Resources(DeviceConfig(threads=threads), home), member, dataset)


class SemMatch(Operator):
    name = "sem_match"
    num_columns = 2
    constants = ()
    output_type = "boolean"
    doc = "do two texts name the same entity"

    def __init__(self) -> None:
        self.dataset = DEFAULT_DATASET  # user-<hash> once train() ran
        self.trained: Trained | None = None
        self._held_out: EntityPairs | None = None

    def bind(self, ctx: OpContext, constants: tuple[str, ...]) -> Bound:
        def make() -> BoundSemantic:
            bound = bind_sem_match(shared_resources(ctx), self.dataset)
            if self.trained is None:
                return bound
            return replace(bound, detail=f"{bound.detail}; {self.trained.describe()}")

        return ctx.resource(f"sem-match-binding-{self.dataset}", make)

    def train(self, ctx: OpContext, data: TrainingData, **options: object) -> Trained:
        """Train the pair heads on the user's labelled pairs (two text columns, a true/false
        label): 70% train, 15% to choose the cascade threshold, 15% held out to score it.
        Cached by the rows' hash (``KEN_HOME/families/sem-match/user-<hash>``)."""
        if options:
            raise KenError(f"sem_match training takes no option {', '.join(options)}")
        if len(data.columns) != 2:
            raise KenError(f"sem_match compares two text columns; {data.source} gives "
                           f"{len(data.columns)} ({', '.join(data.columns)}): name them, e.g. "
                           "columns=('left_title', 'right_title')")
        truth = data.booleans().astype(np.int64)
        pairs = EntityPairs(data.source, data.texts[0], data.texts[1], truth)
        parts = data.split((0.7, 0.15, 0.15))
        if any(len(part) == 0 or not truth[part].any() for part in parts):
            raise DataError(f"{data.source}: {len(data)} pairs with {int(truth.sum())} "
                            "matches are too few to train, calibrate and validate sem_match "
                            "(each of 70/15/15% needs a match)")
        dataset = f"user-{data.content_hash}"
        resources = shared_resources(ctx)
        folder = match_dir(dataset, None, resources.home)
        if (folder / "card.json").exists():
            card = MatchCard.from_json((folder / "card.json").read_text())
        else:
            splits = {name: pairs.subset(part, f"{dataset}-{name}")
                      for name, part in zip(SPLITS, parts, strict=True)}
            card = train_pair_heads(resources, dataset, data.columns[0], splits,
                                    data.content_hash, folder)
        self.dataset = dataset
        self._held_out = pairs.subset(parts[2], f"{dataset}-test")
        self.trained = Trained(
            self.name, data.describe(), data.content_hash,
            f"F1 {card.cascade_valid.f1:.1%} on {len(parts[1])} validation pairs (threshold "
            f"chosen there), {card.cascade_test.f1:.1%} on {len(parts[2])} held-out pairs",
            str(folder))
        return self.trained

    def _eval_pairs(self) -> EntityPairs | None:
        if self._held_out is not None:
            return self._held_out
        return load_pairs(DEFAULT_DATASET, "test") if has_data(DEFAULT_DATASET) else None

    def eval_sample(self, ctx: OpContext) -> EvalSample | None:
        """The Abt-Buy test pairs (first attribute), or the held-out pairs of the user's
        training; None without either."""
        pairs = self._eval_pairs()
        if pairs is None:
            return None
        return EvalSample(pairs.name, tuple(pairs.pairs),
                          tuple(bool(v) for v in pairs.labels.tolist()), "balanced_accuracy")

    def plannable(self) -> bool:
        return self._held_out is not None or has_data(DEFAULT_DATASET)

    def eval_description(self) -> str:
        if self.trained is not None:
            return f"the held-out 15% of {self.trained.data}, balanced accuracy"
        where = dataset_dir(DEFAULT_DATASET)
        state = "" if has_data(DEFAULT_DATASET) else f" (absent: not found at {where})"
        return f"{DEFAULT_DATASET} test pairs{state}, balanced accuracy"

    def candidates(self, ctx: OpContext, device: DeviceConfig) -> Mapping[str, Model]:
        resources = shared_resources(ctx)
        prepare_sem_match(resources, self.dataset)
        return {m.name: m for m in (load_pair_model(resources, member, self.dataset,
                                                    device=device)
                                    for member in MEMBERS)}

    def loaders(self, ctx: OpContext, threads: int) -> Mapping[str, Callable[[], Model]]:
        card = prepare_sem_match(shared_resources(ctx), self.dataset)  # loads no model
        return {card.member(member).name: functools.partial(load_member, member, ctx.home,
                                                             threads, self.dataset)
                for member in MEMBERS}


OPERATOR = SemMatch
