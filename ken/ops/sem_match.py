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

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ken import store
from ken.errors import DataError, KenError, ModelError, StoreError
from ken.models.cascade import Cascade
from ken.models.model import BOOLEAN_LABELS, DeviceConfig, Model, ModelSpec, Prediction
from ken.models.quality import EvalSample
from ken.models.records import RecordMatcher, as_record, check_pairs, whole_text
from ken.models.resources import Resources, boolean_probabilities, normalise_rows, sigmoid
from ken.models.transformers_backend import TransformersBody
from ken.ops.base import Bound, BoundSemantic, OpContext, Operator, Stage, shared_resources
from ken.ops.match_data import (
    DEFAULT_DATASET,
    SPLITS,
    EntityPairs,
    dataset_dir,
    has_data,
    load_pairs,
)
from ken.ops.match_training import (
    DEFAULT_TOLERANCE,
    FAMILY,
    MEMBERS,
    load_card,
    load_matcher,
    match_dir,
    match_entry,
    prepare_sem_match,
    train_matchers,
)
from ken.ops.training import Trained, TrainingData

EVAL_PAIRS = 2000  # test pairs the planner profiles the default matcher on


# Uncalibrated fallback (no data, no cached matcher): cosine similarity of all-MiniLM-L6-v2
# embeddings above 0.85 means a match. Measured on the first attribute of the test splits, the
# best fixed cut-off is 0.85 on Abt-Buy (F1 0.47), 0.9 on DBLP-ACM (0.90) and 0.8 on
# Amazon-Google (0.47); 0.85 costs at most 0.06 F1 on any of them. A rough rule, not a model.
FALLBACK_SCALE = 20.0
FALLBACK_OFFSET = 0.85


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


def load_member(resources: Resources, device: DeviceConfig, member: str, dataset: str
                ) -> RecordMatcher:
    """A trained record matcher (a :class:`~ken.ops.base.Stage`'s load)."""
    return load_matcher(resources, member, dataset, device)


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

    def stages(self, ctx: OpContext, constants: tuple[str, ...]) -> list[Stage]:
        """The two trained matchers, cheapest first (trained on first use; loads no model)."""
        card = prepare_sem_match(shared_resources(ctx), self.dataset)
        return [Stage(card.member(member).name, load_member, (member, self.dataset))
                for member in MEMBERS]

    def store_entries(self, home: Path) -> list[tuple[str, store.Entry]]:
        """Every trained matcher folder in ``home``."""
        return [("sem_match", match_entry(folder.name, home))
                for folder in sorted((home / "families" / FAMILY).glob("*"))
                if (folder / "card.json").exists() and not store.is_leftover(folder)]


OPERATOR = SemMatch
