"""Training ``sem_match``'s record matchers and calibrating their cascade.

Two :class:`~ken.models.records.RecordMatcher` s per data set (``lexical``: record features
into gradient-boosted trees; ``minilm-l6``: the same plus MiniLM-L6 similarities), each with
its decision threshold chosen for F1 on the validation split, and the escalation threshold of
the cascade lexical -> minilm-l6 (:func:`choose_threshold`). What was trained and measured is
a :class:`MatchCard`, stored with the featurizer and the trees as one store entry under
``KEN_HOME/families/sem-match/<dataset>/``.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ken import store
from ken.errors import DataError, ModelError, StoreError
from ken.models.model import DeviceConfig
from ken.models.records import (
    EMBEDDED_SLOTS,
    BoostedTrees,
    RecordFeaturizer,
    RecordMatcher,
    as_record,
    best_f1_threshold,
    embedding_similarities,
    f1_score,
    match_probabilities,
)
from ken.models.resources import Resources, sigmoid
from ken.ops.match_data import (
    DATASET_ALL,
    DEFAULT_DATASET,
    SPLITS,
    EntityPairs,
    data_hash,
    dataset_dir,
    has_data,
    schema,
    training_splits,
)
from ken.progress import Reporter

FAMILY = "sem-match"
DEFAULT_PER_DATASET = 2000  # training pairs per data set for the default matcher
MEMBERS = ("lexical", "minilm-l6")  # cheapest first: the cascade's stage order
SHORT_NAMES = {"lexical": "lex", "minilm-l6": "l6"}
CARD_SCHEMA_VERSION = 2
DEFAULT_TOLERANCE = 0.005  # the cascade may lose at most 0.5 F1 points against L6 alone


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
