"""``sem_match(a, b) -> boolean``: do two records (or texts) name the same entity?

Arguments are whole records: in SQL a struct or a row (``sem_match(l, r)``,
``sem_match({'title': l.title, 'price': l.price}, ...)``) or a text column (a record of one
attribute); in Python a JSON object, a ``COL name VAL ... COL price VAL ...`` serialization
(the DeepMatcher/Ditto format) or plain text (:func:`ken.models.records.as_record`).

Served by a cascade of two :class:`~ken.models.records.RecordMatcher` s: similarity features of
every attribute and of the whole record (word/trigram Jaccard, edit-distance ratios, IDF
cosine, shared model numbers, numeric difference, ...) into gradient-boosted trees, then the
same features plus MiniLM-L6 cosine similarities (first value, whole record) into a second
set of trees. Each member's
decision threshold is chosen for F1 on the validation split; the cascade escalates the pairs
the first member is least sure of, with the escalation threshold calibrated there too.

The default matcher (``DATASET_ALL``) is trained on the train splits of every entity-matching
data set in ``../shared/data/entity-matching`` with schema-free features (first value and whole
record), so it applies to any records; per-dataset matchers (``prepare_sem_match(resources,
"Abt-Buy")``) and matchers trained on a user's pairs (``session.train("sem_match", ...)``) use
every attribute. Trained matchers are cached under ``KEN_HOME/families/sem-match/<dataset>/``
with a JSON card of validation and test F1. Without data and without a cached matcher,
``sem_match`` falls back to :class:`SimilarityPairModel`, an *uncalibrated* cosine rule.

>>> # bound = bind_sem_match(Resources())
>>> # result = run_cascade(bound.cascade, bound.models, [left_records, right_records])
>>> # bound.to_sql_values(result.labels)  # [True, False, None, ...]
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ken import store
from ken.errors import DataError, KenError, ModelError, StoreError
from ken.models.cascade import Cascade
from ken.models.model import BOOLEAN_LABELS, DeviceConfig, Model, ModelSpec, Prediction
from ken.models.quality import EvalSample
from ken.models.records import (
    EMBEDDED_SLOTS,
    PLAIN,
    BoostedTrees,
    RecordFeaturizer,
    RecordMatcher,
    as_record,
    best_f1_threshold,
    check_pairs,
    embedding_similarities,
    f1_score,
    match_probabilities,
    parse_record,
    whole_text,
)
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
DATASETS = ("Abt-Buy", "Amazon-Google", "Beer", "DBLP-ACM", "Fodors-Zagats")
DATASET_ALL = "all"  # the default: every data set above that is present, schema-free features
DEFAULT_DATASET = DATASET_ALL
DEFAULT_PER_DATASET = 2000  # training pairs per data set for the default matcher
EVAL_PAIRS = 2000  # test pairs the planner profiles the default matcher on
SPLITS = ("train", "valid", "test")
MEMBERS = ("lexical", "minilm-l6")  # cheapest first: the cascade's stage order
SHORT_NAMES = {"lexical": "lex", "minilm-l6": "l6"}
CARD_SCHEMA_VERSION = 2
DEFAULT_TOLERANCE = 0.005  # the cascade may lose at most 0.5 F1 points against L6 alone

# Uncalibrated fallback (no data, no cached matcher): cosine similarity of all-MiniLM-L6-v2
# embeddings above 0.85 means a match. Measured on the first attribute of the test splits, the
# best fixed cut-off is 0.85 on Abt-Buy (F1 0.47), 0.9 on DBLP-ACM (0.90) and 0.8 on
# Amazon-Google (0.47); 0.85 costs at most 0.06 F1 on any of them. A rough rule, not a model.
FALLBACK_SCALE = 20.0
FALLBACK_OFFSET = 0.85

# ------------------------------------------------------------------------------- data


@dataclass(frozen=True, eq=False)
class EntityPairs:
    """Labelled pairs of entity records as text (see :func:`as_record`); 1 means a match."""

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

    def sample(self, limit: int | None, seed: int = 0) -> EntityPairs:
        """At most ``limit`` pairs, drawn at random (seeded) and kept in file order."""
        if limit is None or limit >= len(self):
            return self
        if limit < 1:
            raise DataError(f"cannot sample {limit} pairs")
        keep = np.sort(np.random.default_rng(seed).permutation(len(self))[:limit])
        return self.subset(keep, f"{self.name}[{limit}]")

    @staticmethod
    def concat(parts: Sequence[EntityPairs], name: str) -> EntityPairs:
        return EntityPairs(name, tuple(t for p in parts for t in p.left),
                           tuple(t for p in parts for t in p.right),
                           np.concatenate([p.labels for p in parts]).astype(np.int64))


def dataset_dir(dataset: str, data_dir: Path | None = None) -> Path:
    return (data_dir or shared_data_dir()) / "entity-matching" / dataset


def present_datasets(data_dir: Path | None = None) -> tuple[str, ...]:
    return tuple(d for d in DATASETS if _has_files(d, data_dir))


def _has_files(dataset: str, data_dir: Path | None) -> bool:
    folder = dataset_dir(dataset, data_dir)
    return all((folder / f"{s}.txt").is_file() for s in SPLITS)


def has_data(dataset: str, data_dir: Path | None = None) -> bool:
    if dataset == DATASET_ALL:
        return bool(present_datasets(data_dir))
    return _has_files(dataset, data_dir)


def load_pairs(dataset: str, split: str, data_dir: Path | None = None,
               attribute: str | None = None) -> EntityPairs:
    """One split of an entity-matching dataset: whole records (``COL ... VAL ...`` text), or
    one attribute's values with ``attribute`` (``"first"``: each record's first attribute).

    Lines are ``<left record> TAB <right record> TAB <label>``.
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of: {', '.join(SPLITS)}")
    if dataset == DATASET_ALL:
        return EntityPairs.concat([load_pairs(d, split, data_dir, attribute)
                                   for d in _need(data_dir)], f"{DATASET_ALL}-{split}")
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
                if attribute is None:
                    parse_record(side)  # fail here, with the line, on a malformed record
                    out.append(side.strip())
                    continue
                record = parse_record(side)
                key = next(iter(record)) if attribute == "first" else attribute
                if key not in record:
                    raise DataError(f"{path}:{number}: no attribute {key!r}; this dataset has "
                                    f"{', '.join(record)}")
                out.append(record[key])
            labels.append(int(parts[2]))
    return EntityPairs(f"{dataset}-{split}", tuple(left), tuple(right),
                       np.asarray(labels, dtype=np.int64))


def _need(data_dir: Path | None) -> tuple[str, ...]:
    present = present_datasets(data_dir)
    if not present:
        raise DataError(f"no entity-matching data sets at {dataset_dir('', data_dir)} "
                        f"(expected folders {', '.join(DATASETS)})")
    return present


def data_hash(dataset: str, data_dir: Path | None = None) -> str:
    h = hashlib.sha256()
    names = _need(data_dir) if dataset == DATASET_ALL else (dataset,)
    for name in names:
        h.update(name.encode())
        for split in SPLITS:
            h.update((dataset_dir(name, data_dir) / f"{split}.txt").read_bytes())
    return h.hexdigest()[:16]


def training_splits(dataset: str, data_dir: Path | None = None,
                    per_dataset: int | None = None) -> dict[str, EntityPairs]:
    """Train / valid / test pairs; ``per_dataset`` caps the training pairs of each data set.
    For :data:`DATASET_ALL` it also caps validation and test pairs at half as many per data
    set (a single data set keeps them whole)."""
    names = _need(data_dir) if dataset == DATASET_ALL else (dataset,)
    half = None if per_dataset is None or dataset != DATASET_ALL else max(1, per_dataset // 2)
    caps = {"train": per_dataset, "valid": half, "test": half}
    splits = {}
    for split in SPLITS:
        parts = [load_pairs(name, split, data_dir).sample(caps[split]) for name in names]
        splits[split] = EntityPairs.concat(parts, f"{dataset}-{split}")
    return splits


def schema(records: Sequence[Mapping[str, str]]) -> tuple[str, ...]:
    """The attributes to compare one by one: those of the records if they all share them,
    else none (schema-free features)."""
    if not records:
        return ()
    keys = tuple(records[0])
    if keys == (PLAIN,) or any(tuple(r) != keys for r in records):
        return ()
    return keys


# ------------------------------------------------------------------------------- models


class SimilarityPairModel(Model):
    """Uncalibrated fallback: ``P(match) = sigmoid(scale * (cos(u, v) - offset))`` of the two
    records' whole texts."""

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
        texts = [(whole_text(as_record(a)), whole_text(as_record(b))) for a, b in pairs]
        distinct = list(dict.fromkeys(t for pair in texts for t in pair))
        if not distinct:
            return np.zeros(0)
        emb = normalise_rows(self.body.features(distinct, batch_size).astype(np.float64))
        where = {t: i for i, t in enumerate(distinct)}
        return np.array([float(emb[where[a]] @ emb[where[b]]) for a, b in texts])

    def predict(self, texts: Sequence, batch_size: int = 32) -> Prediction:
        pairs = check_pairs(self.name, texts)
        probs = boolean_probabilities(sigmoid(self.scale * (self.cosine(pairs, batch_size)
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
    """The threshold escalating the fewest rows while staying within ``tolerance`` F1 of the
    strong model alone.

    Candidates lie midway between neighbouring certainties of the cheap model (so float
    rounding at run time does not move rows across), plus "escalate nothing" (0) and
    "escalate everything" (just above the largest certainty).
    """
    sure = np.asarray(cheap, dtype=np.float64).max(axis=1)
    truth = np.asarray(truth)
    n = len(truth)
    if n == 0:
        raise DataError("cannot calibrate a cascade threshold on no rows")
    cheap_labels, strong_labels = cheap.argmax(axis=1), strong.argmax(axis=1)
    goal = f1_score(strong_labels, truth) - tolerance
    order = np.argsort(sure, kind="stable")  # least certain first: escalated first
    s = sure[order]
    for k in range(n + 1):
        if 0 < k < n and not s[k - 1] < s[k]:
            continue  # ties cannot be split by a threshold
        labels = cheap_labels.copy()
        labels[order[:k]] = strong_labels[order[:k]]
        if f1_score(labels, truth) >= goal - 1e-12:
            if k == 0:
                return 0.0
            if k == n:
                return float(np.nextafter(s[-1], np.inf))
            return float((s[k - 1] + s[k]) / 2)
    return float(np.nextafter(s[-1], np.inf))  # unreachable: k == n reaches the strong F1


# ------------------------------------------------------------------------------- cards


@dataclass(frozen=True)
class MemberCard:
    """One trained record matcher: where its trees are and how it scored."""

    name: str  # model name in cascades, e.g. "match-lex[abt-buy]"
    member: str  # lexical / minilm-l6
    trees_file: str  # relative to the card's folder
    fingerprint: str
    threshold: float  # P(match) of the trees at which it says "match" (best F1 on valid)
    valid: MatchScores
    test: MatchScores
    ms_per_pair: float  # features and trees, measured on the test pairs


@dataclass(frozen=True)
class MatchCard:
    """What ``prepare_sem_match`` trained and measured for one dataset."""

    dataset: str
    attributes: tuple[str, ...]  # compared one by one; () = schema-free features
    data_hash: str
    num_train: int  # training pairs used
    per_dataset: int | None  # cap on training pairs per data set (None: whole train splits)
    members: tuple[MemberCard, ...]
    threshold: float
    tolerance: float
    cascade_valid: MatchScores
    cascade_test: MatchScores
    escalation_valid: float
    escalation_test: float
    featurizer_file: str = "features.json"
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
        data["attributes"] = tuple(data["attributes"])
        data["members"] = tuple(
            MemberCard(**{**m, "valid": MatchScores(**m["valid"]),
                          "test": MatchScores(**m["test"])}) for m in data["members"])
        return cls(**data)


def match_dir(dataset: str, home: Path) -> Path:
    """``KEN_HOME/families/sem-match/<dataset>``."""
    return home / "families" / FAMILY / dataset


def model_name(member: str, dataset: str) -> str:
    return f"match-{SHORT_NAMES[member]}[{dataset.lower()}]"


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _reusable(card: MatchCard, present: bool, dataset: str, data_dir: Path | None,
              per_dataset: int | None, tolerance: float) -> bool:
    if not present:
        return True  # cannot retrain: a trained matcher beats the uncalibrated fallback
    same = card.per_dataset == per_dataset and card.tolerance == tolerance
    return same and card.data_hash == data_hash(dataset, data_dir)


def prepare_sem_match(resources: Resources, dataset: str = DEFAULT_DATASET,
                      data_dir: Path | None = None, *, per_dataset: int | None = None,
                      tolerance: float = DEFAULT_TOLERANCE, force: bool = False,
                      batch_size: int = 32, reporter: Reporter | None = None) -> MatchCard:
    """Train (or reuse) the two record matchers of ``dataset`` and calibrate the cascade.

    ``dataset`` is one of :data:`DATASETS` (every attribute compared) or :data:`DATASET_ALL`
    (every present data set, schema-free features, ``per_dataset`` defaulting to
    :data:`DEFAULT_PER_DATASET` training pairs each). Matchers train on ``train``, thresholds
    are chosen on ``valid`` and ``test`` is only scored. A cached card is reused when it was
    made with the same settings from the same files, or when the files are absent.
    """
    if dataset == DATASET_ALL and per_dataset is None:
        per_dataset = DEFAULT_PER_DATASET
    reporter = reporter or resources.reporter
    folder = match_dir(dataset, resources.home)
    present = has_data(dataset, data_dir)
    damage = ""
    if (folder / "card.json").exists() and not force:
        try:
            card = load_card(resources, dataset)
            if _reusable(card, present, dataset, data_dir, per_dataset, tolerance):
                return card
        except StoreError as exc:
            if not present:
                raise
            damage = str(exc)
    if not present:
        raise DataError(f"no entity-matching data for {dataset} at "
                        f"{dataset_dir(dataset, data_dir)} and no trained matcher in {folder}")
    with store.store_lock(resources.home, f"training the sem_match matchers of {dataset}",
                          reporter.note):
        if (folder / "card.json").exists() and not force:  # trained by another process?
            try:
                card = load_card(resources, dataset)
                if _reusable(card, present, dataset, data_dir, per_dataset, tolerance):
                    return card
            except StoreError:
                pass
        splits = training_splits(dataset, data_dir, per_dataset)
        return train_matchers(resources, dataset, splits, data_hash(dataset, data_dir), folder,
                              schema_free=dataset == DATASET_ALL, per_dataset=per_dataset,
                              tolerance=tolerance, batch_size=batch_size, reporter=reporter,
                              damage=damage)


#: training cost per pair (record features, two MiniLM-L6 embeddings, trees) on 2 threads
_TRAIN_MS_PER_PAIR = 12.0


def training_notice(dataset: str, splits: Mapping[str, EntityPairs], threads: int,
                    damage: str = "") -> str:
    """What training the matchers does and roughly how long it takes, said before it starts."""
    pairs = sum(len(p) for p in splits.values())
    seconds = pairs * _TRAIN_MS_PER_PAIR / 1000 * (2.0 / max(1, threads)) ** 0.75 + 10
    took = (f"about {max(10, round(seconds, -1)):.0f} seconds" if seconds < 90
            else f"about {round(seconds / 60):.0f} minutes")
    head = f"{damage}\n  -> training it again\n" if damage else ""
    return (f"{head}training the sem_match record matchers of {dataset} "
            f"({'again' if damage else 'first use'}): {len(splits['train']):,} training pairs, "
            f"{pairs:,} in all, {took} on {threads} CPU thread(s), once (kept in KEN_HOME). "
            "Progress below.")


def train_matchers(resources: Resources, dataset: str, splits: Mapping[str, EntityPairs],
                   content_hash: str, folder: Path, *, schema_free: bool = False,
                   per_dataset: int | None = None, tolerance: float = DEFAULT_TOLERANCE,
                   batch_size: int = 32, reporter: Reporter | None = None,
                   damage: str = "") -> MatchCard:
    """Fit the record features and both members' trees on ``splits["train"]``, choose their
    thresholds and the cascade's on ``splits["valid"]``, score ``splits["test"]``; write the
    featurizer, the trees and the card to ``folder`` (a store entry, renamed into place
    whole). The reporter says first what it does and how long it takes (``damage``: what was
    wrong with the matchers it replaces)."""
    reporter = reporter or resources.reporter
    with reporter.long_work(training_notice(dataset, splits, resources.device.threads,
                                            damage)), store.staging_dir(folder) as staging:
        card = _train_matchers(resources, dataset, splits, content_hash, staging,
                               schema_free, per_dataset, tolerance, batch_size, reporter)
        store.seal(store.Entry(staging, "", ""), _card_files(card))
    return card


def _train_matchers(resources: Resources, dataset: str, splits: Mapping[str, EntityPairs],
                    content_hash: str, folder: Path, schema_free: bool,
                    per_dataset: int | None, tolerance: float, batch_size: int,
                    reporter: Reporter) -> MatchCard:
    records = {s: [(as_record(a), as_record(b)) for a, b in p.pairs] for s, p in splits.items()}
    train_records = [r for pair in records["train"] for r in pair]
    attributes = () if schema_free else schema(train_records)
    featurizer = RecordFeaturizer.fit(train_records, attributes)
    (folder / "features.json").write_text(featurizer.to_json())
    what = f"{', '.join(attributes)}" if attributes else "schema-free"
    reporter.note(f"sem_match: training record matchers on {len(splits['train'])} {dataset} "
                  f"pairs ({what}), {len(splits['valid'])} for thresholds, "
                  f"{len(splits['test'])} held out")
    lexical = {}
    test_seconds = 0.0  # computing the test pairs' features: a member's cost per pair
    with reporter.task("record features", len(SPLITS)) as advance:
        for s in SPLITS:
            started = time.perf_counter()
            lexical[s] = featurizer.features(records[s])
            test_seconds += time.perf_counter() - started if s == "test" else 0.0
            advance(1)
    members: list[MemberCard] = []
    probs: dict[str, dict[str, np.ndarray]] = {}
    for member in MEMBERS:
        name = model_name(member, dataset)
        body = None if member == "lexical" else resources.encoder(member)
        feats = lexical
        cost = test_seconds
        if body is not None:
            with reporter.task(f"{name}: embedding the records", len(SPLITS)) as advance:
                feats = {}
                for s in SPLITS:
                    started = time.perf_counter()
                    feats[s] = np.hstack([lexical[s], embedding_similarities(
                        body, records[s], EMBEDDED_SLOTS, batch_size)])
                    cost += time.perf_counter() - started if s == "test" else 0.0
                    advance(1)
        trees = BoostedTrees.fit(feats["train"], splits["train"].labels)
        trees_file = f"{member}.trees.npz"
        trees.save(folder / trees_file)
        threshold, _ = best_f1_threshold(sigmoid(trees.raw(feats["valid"])),
                                         splits["valid"].labels)
        started = time.perf_counter()
        probs[member] = {"test": match_probabilities(trees.raw(feats["test"]), threshold)}
        cost += time.perf_counter() - started
        probs[member]["valid"] = match_probabilities(trees.raw(feats["valid"]), threshold)
        ms_per_pair = cost / max(1, len(splits["test"])) * 1000
        scores = {s: MatchScores.of(probs[member][s].argmax(axis=1), splits[s].labels)
                  for s in ("valid", "test")}
        members.append(MemberCard(name, member, trees_file, _file_digest(folder / trees_file),
                                  threshold, scores["valid"], scores["test"], ms_per_pair))
        reporter.note(f"  {name}: test F1 {scores['test'].f1:.3f}, "
                      f"accuracy {scores['test'].accuracy:.3f}, {ms_per_pair:.2f} ms/pair")
    cheap, strong = MEMBERS
    threshold = choose_threshold(probs[cheap]["valid"], probs[strong]["valid"],
                                 splits["valid"].labels, tolerance)
    cascade_scores = {}
    escalation = {}
    for s in ("valid", "test"):
        labels = cascade_labels(probs[cheap][s], probs[strong][s], threshold)
        cascade_scores[s] = MatchScores.of(labels, splits[s].labels)
        escalation[s] = float((probs[cheap][s].max(axis=1) < threshold).mean())
    card = MatchCard(dataset, attributes, content_hash, len(splits["train"]), per_dataset,
                     tuple(members), threshold, tolerance, cascade_scores["valid"],
                     cascade_scores["test"], escalation["valid"], escalation["test"])
    (folder / "card.json").write_text(card.to_json())  # in the staging folder
    reporter.note(f"  cascade {cheap} -({threshold:.3f})-> {strong}: test F1 "
                  f"{cascade_scores['test'].f1:.3f}, escalates {escalation['test']:.0%}")
    return card


def load_card(resources: Resources, dataset: str = DEFAULT_DATASET) -> MatchCard:
    """The verified card of a prepared dataset (see :func:`prepare_sem_match`)."""
    entry = match_entry(dataset, resources.home)
    if not (entry.root / "card.json").exists():
        raise ModelError(f"sem_match is not prepared for {dataset} in {entry.root}; "
                         "run prepare_sem_match (or bind_sem_match) with the data present")
    store.ensure(entry)
    return _read_card(entry)


def _read_card(entry: store.Entry) -> MatchCard:
    path = entry.root / "card.json"
    try:
        return MatchCard.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"model store: {path} cannot be read as a sem_match card ({exc}). It "
                         f"belongs to {entry.what}. To fix it: {entry.fix}.") from None


def _card_files(card: MatchCard) -> tuple[str, ...]:
    return ("card.json", card.featurizer_file, *(m.trees_file for m in card.members))


def match_entry(dataset: str, home: Path) -> store.Entry:
    """The store entry of the matchers trained on ``dataset``: card, featurizer, trees."""
    if dataset.startswith("user-"):
        fix = ("train sem_match again on the same pairs (session.train('sem_match', ...) or "
               "TRAIN sem_match ...)")
    else:
        fix = ("run the query again with the entity-matching data present (it trains them "
               f"again), or prepare_sem_match(resources, {dataset!r}, force=True)")
    return store.Entry(match_dir(dataset, home), f"the sem_match matchers of {dataset}", fix,
                       legacy=_adopt_matchers)


def _adopt_matchers(entry: store.Entry) -> tuple[str, ...]:
    """Check matchers trained before ken kept manifests: the card reads, every trees file has
    the fingerprint its card recorded and the featurizer parses."""
    store.check_json(entry.root / "card.json", entry)
    card = _read_card(entry)
    for m in card.members:
        path = entry.root / m.trees_file
        try:
            digest = _file_digest(path)
        except OSError as exc:
            raise StoreError(f"model store: {path} cannot be read ({exc.strerror or exc}). It "
                             f"belongs to {entry.what}. To fix it: {entry.fix}.") from None
        if digest != m.fingerprint:
            raise StoreError(f"model store: {path} differs from what its card recorded "
                             f"(fingerprint {digest}, recorded {m.fingerprint}). It belongs to "
                             f"{entry.what}. To fix it: {entry.fix}.")
    store.check_json(entry.root / card.featurizer_file, entry)
    return _card_files(card)


def store_entries(home: Path) -> list[store.Entry]:
    """Every trained matcher folder in ``home``."""
    return [match_entry(folder.name, home)
            for folder in sorted((home / "families" / FAMILY).glob("*"))
            if (folder / "card.json").exists() and not store.is_leftover(folder)]


def load_matcher(resources: Resources, member: str, dataset: str = DEFAULT_DATASET,
                 device: DeviceConfig | None = None) -> RecordMatcher:
    """The trained record matcher of ``member`` (``lexical`` / ``minilm-l6``) from the cache,
    its files verified first (StoreError names a damaged one and the fix)."""
    card = load_card(resources, dataset)
    m = card.member(member)
    folder = match_dir(dataset, resources.home)
    try:
        featurizer = RecordFeaturizer.from_json((folder / card.featurizer_file).read_text())
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot read {folder / card.featurizer_file} ({exc}); prepare "
                         "sem_match again (force=True)") from exc
    body = None if member == "lexical" else resources.encoder(member, device)
    return RecordMatcher(m.name, featurizer, BoostedTrees.load(folder / m.trees_file),
                         m.threshold, body, fingerprint=f"{m.fingerprint}-{card.data_hash}",
                         device=device or resources.device)


def bind_sem_match(resources: Resources, dataset: str = DEFAULT_DATASET,
                   data_dir: Path | None = None, *, per_dataset: int | None = None,
                   tolerance: float = DEFAULT_TOLERANCE, single: str | None = None,
                   device: DeviceConfig | None = None) -> BoundSemantic:
    """Bind ``sem_match(a, b)``: the calibrated two-matcher cascade, or the fallback.

    Trains the matchers on first use (cached in ``KEN_HOME``; see :func:`prepare_sem_match`).
    ``single`` binds one member alone (``"lexical"`` or ``"minilm-l6"``). Without data and
    without a cached matcher it binds :class:`SimilarityPairModel` and reports itself
    uncalibrated; it never fails for lack of data.
    """
    if single is not None and single not in MEMBERS:
        raise ModelError(f"unknown sem_match model {single!r}; use one of: {', '.join(MEMBERS)}")
    folder = match_dir(dataset, resources.home)
    if not has_data(dataset, data_dir) and not (folder / "card.json").exists():
        body = resources.encoder("minilm-l6", device)
        fallback = SimilarityPairModel(body)
        return BoundSemantic(
            "sem_match", Cascade((fallback.name,)), {fallback.name: fallback}, "boolean",
            calibrated=False,
            detail=(f"no entity-matching data at {dataset_dir(dataset, data_dir)}: fixed rule "
                    f"cos > {FALLBACK_OFFSET:g}"))
    card = prepare_sem_match(resources, dataset, data_dir, per_dataset=per_dataset,
                             tolerance=tolerance)
    names = (single,) if single else MEMBERS
    models = {}
    for member in names:
        model = load_matcher(resources, member, dataset, device)
        models[model.name] = model
    what = f"{dataset} ({', '.join(card.attributes) or 'schema-free'})"
    if single:
        m = card.member(single)
        cascade = Cascade((m.name,))
        detail = f"{what}: test F1 {m.test.f1:.3f}"
    else:
        cascade = Cascade(tuple(models), (card.threshold,))
        detail = (f"{what}: thresholds from validation, test F1 "
                  f"{card.cascade_test.f1:.3f}, escalates {card.escalation_test:.0%}")
    return BoundSemantic("sem_match", cascade, models, "boolean", calibrated=True,
                         detail=detail)


# -- the operator --------------------------------------------------------------------------------


def load_member(member: str, home: Path | None, device: DeviceConfig,
                dataset: str = DEFAULT_DATASET) -> RecordMatcher:
    """A trained record matcher for a worker process (picklable via ``functools.partial``)."""
    return load_matcher(Resources(device, home), member, dataset)


class SemMatch(Operator):
    name = "sem_match"
    num_columns = 2
    constants = ()
    output_type = "boolean"
    doc = "do two records (structs, rows or texts) name the same entity"
    record_columns = True

    def __init__(self, dataset: str = DEFAULT_DATASET) -> None:
        """``dataset``: the matcher to serve until ``train`` runs (:data:`DATASET_ALL`, or one
        of :data:`DATASETS` to compare that data set's attributes)."""
        self.dataset = dataset  # user-<hash> once train() ran
        self._default = dataset
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
        """Train the record matchers on the user's labelled pairs (two columns of records or
        texts, a true/false label): 70% train, 15% to choose the thresholds, 15% held out to
        score them. Records sharing one schema are compared attribute by attribute. Cached by
        the rows' hash (``KEN_HOME/families/sem-match/user-<hash>``)."""
        if options:
            raise KenError(f"sem_match training takes no option {', '.join(options)}")
        if len(data.columns) != 2:
            raise KenError(f"sem_match compares two columns (records or texts); {data.source} "
                           f"gives {len(data.columns)} ({', '.join(data.columns)}): name them, "
                           "e.g. columns=('left', 'right')")
        truth = data.booleans().astype(np.int64)
        pairs = EntityPairs(data.source, data.texts[0], data.texts[1], truth)
        parts = data.split((0.7, 0.15, 0.15))
        if any(len(part) == 0 or not truth[part].any() for part in parts):
            raise DataError(f"{data.source}: {len(data)} pairs with {int(truth.sum())} "
                            "matches are too few to train, calibrate and validate sem_match "
                            "(each of 70/15/15% needs a match)")
        dataset = f"user-{data.content_hash}"
        resources = shared_resources(ctx)
        folder = match_dir(dataset, resources.home)
        card, damage = None, ""
        if (folder / "card.json").exists():
            try:
                card = load_card(resources, dataset)
            except StoreError as exc:
                damage = str(exc)  # trained again from the rows at hand
        if card is None:
            splits = {name: pairs.subset(part, f"{dataset}-{name}")
                      for name, part in zip(SPLITS, parts, strict=True)}
            with store.store_lock(resources.home, f"training sem_match on {data.source}",
                                  ctx.reporter.note):
                card = train_matchers(resources, dataset, splits, data.content_hash, folder,
                                      damage=damage)
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
        if not has_data(self._default):
            return None
        return load_pairs(self._default, "test").sample(EVAL_PAIRS)

    def eval_sample(self, ctx: OpContext) -> EvalSample | None:
        """2,000 test pairs of the data sets the default matcher learnt from (whole records),
        or the held-out pairs of the user's training; None without either."""
        pairs = self._eval_pairs()
        if pairs is None:
            return None
        return EvalSample(pairs.name, tuple(pairs.pairs),
                          tuple(bool(v) for v in pairs.labels.tolist()), "balanced_accuracy")

    def plannable(self) -> bool:
        return self._held_out is not None or has_data(self._default)

    def eval_description(self) -> str:
        if self.trained is not None:
            return f"the held-out 15% of {self.trained.data}, balanced accuracy"
        where = dataset_dir("", None)
        state = "" if has_data(self._default) else f" (absent: not found at {where})"
        return (f"up to {EVAL_PAIRS} test pairs of {self._default}{state}, balanced accuracy")

    def candidates(self, ctx: OpContext, device: DeviceConfig) -> Mapping[str, Model]:
        resources = shared_resources(ctx)
        prepare_sem_match(resources, self.dataset)
        return {m.name: m for m in (load_matcher(resources, member, self.dataset, device)
                                    for member in MEMBERS)}

    def loaders(self, ctx: OpContext, device: DeviceConfig
                ) -> Mapping[str, Callable[[], Model]]:
        card = prepare_sem_match(shared_resources(ctx), self.dataset)  # loads no model
        return {card.member(member).name: functools.partial(load_member, member, ctx.home,
                                                             device, self.dataset)
                for member in MEMBERS}


OPERATOR = SemMatch
