"""``sem_classify(text, 'label1|label2|...') -> VARCHAR``: zero-shot classification into labels.

A two-stage cascade, bound per label list:

1. :class:`LabelSimilarityModel` (MiniLM cost): cosine similarity between the text's and each
   label name's sentence embedding; class probabilities are a softmax of the similarities
   times ``scale``.
2. :class:`LabelLLMModel` (SmolLM2-135M) for rows whose stage-1 certainty (max probability) is
   below the threshold: it scores every label as a continuation of a prompt holding the text,
   ``log P(label | prompt with text) - log P(label | prompt without text)`` (the label's
   prior is removed, so short or frequent label words do not win by default), and takes a
   softmax over labels. Constrained answers are scored, never parsed from generated text.

Without labelled data the scale and threshold are documented defaults (EXPLAIN says
``uncalibrated``). For planning, the operator is profiled on the family's held-out tweets with
the labels ``negative|neutral|positive`` (accuracy).

With labelled rows (``session.train("sem_classify", table, label="topic")`` or ``TRAIN
sem_classify ON t LABEL topic``) it learns the labels instead: logistic-regression heads on
MiniLM-L3 and MiniLM-L6 embeddings of four fifths of the rows, a cascade of the two chosen from
their profiles on the held-out fifth, served for calls whose label list is the label column's
values (other label lists stay zero-shot).

>>> # session.sql("SELECT sem_classify(text, 'sports|politics|weather') FROM posts")
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ken import store
from ken.errors import DataError, KenError, ModelError, StoreError
from ken.models import family
from ken.models.cascade import Cascade
from ken.models.data_text import encode_row
from ken.models.head import LinearHead, fit_logistic_cv
from ken.models.model import DeviceConfig, Model, ModelSpec, Prediction
from ken.models.quality import EvalSample
from ken.models.resources import CausalLM, Resources, normalise_rows, short_hash
from ken.models.transformers_backend import TransformersBody, TransformersClassifier
from ken.ops.base import (
    Bound,
    BoundSemantic,
    ClassifierBinding,
    OpContext,
    Operator,
    Stage,
    shared_resources,
)
from ken.ops.training import Trained, TrainingData, cascade_values
from ken.paths import ken_home

FAMILY = "sem-classify"
DEFAULT_SCALE = 20.0  # cosine similarities of short labels differ by ~0.05-0.2
DEFAULT_THRESHOLD = 0.6
EVAL_LABELS = "negative|neutral|positive"
PROMPT_VERSION = "v1"
PROMPT = "Text: {text}\nThe text is best described as:"
EMPTY_PROMPT = "Text:\nThe text is best described as:"
MAX_TEXT_TOKENS = 128
TRAIN_MEMBERS = ("minilm-l3", "minilm-l6")  # cheapest first
TRAIN_VERSION = "heads-v1"


def parse_labels(spec: str) -> tuple[str, ...]:
    """``'sports | politics|weather'`` -> ``('sports', 'politics', 'weather')``."""
    if not isinstance(spec, str):
        raise DataError("sem_classify needs its labels as one string, e.g. 'sports|politics'")
    labels = tuple(" ".join(part.split()) for part in spec.split("|"))
    if any(not label for label in labels):
        raise DataError(f"sem_classify's labels {spec!r} have an empty label; separate "
                        "labels with '|', e.g. 'sports|politics|weather'")
    if len(labels) < 2:
        raise DataError(f"sem_classify needs at least two labels separated by '|', got {spec!r}")
    if len(set(labels)) != len(labels):
        raise DataError(f"sem_classify's labels {spec!r} repeat a label")
    return labels


def similarity_name(labels: tuple[str, ...], encoder: str, scale: float = DEFAULT_SCALE) -> str:
    """The model name of a label-similarity stage (what plans and profiles call it)."""
    return f"cls-{encoder.replace('minilm-', '')}[{short_hash(labels, encoder, round(scale, 6))}]"


def llm_name(labels: tuple[str, ...], lm_name: str = "smollm2-135m") -> str:
    """The model name of an LLM stage scoring ``labels``."""
    key = short_hash(labels, lm_name, PROMPT_VERSION, MAX_TEXT_TOKENS)
    return f"cls-{lm_name.split('-')[0]}[{key}]"


def stage_name(kind: str, spec: str) -> str:
    """The name of the stage :func:`load_classify_stage` builds (no model is loaded)."""
    labels = parse_labels(spec)
    return llm_name(labels) if kind == "llm" else similarity_name(labels, kind)


def _softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def _prediction(probs: np.ndarray, labels: tuple[str, ...]) -> Prediction:
    probs = probs.reshape(-1, len(labels))
    return Prediction(probs.argmax(axis=1).astype(np.int64), probs, labels)


class LabelSimilarityModel(Model):
    """``P(label) = softmax(scale * cos(embed(text), embed(label)))`` over the labels."""

    def __init__(self, body: TransformersBody, labels: tuple[str, ...],
                 scale: float = DEFAULT_SCALE, encoder: str = "minilm-l6") -> None:
        self.body = body
        self.labels = labels
        self.scale = float(scale)
        self.device = body.device
        self.queries = normalise_rows(body.features(list(labels), len(labels))
                                      ).astype(np.float64)
        name = similarity_name(labels, encoder, self.scale)
        self.spec = ModelSpec(
            name=name, family=FAMILY, backend="transformers",
            source=body.config.source, num_params=body.num_params,
            memory_bytes=body.memory_bytes, max_tokens=body.max_tokens, labels=labels,
            fingerprint=f"{name}-{short_hash(store.content_id(body.config.source))}")

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        if not len(texts):
            return _prediction(np.zeros((0, len(self.labels)), np.float32), self.labels)
        sims = normalise_rows(self.body.features(list(texts), batch_size)) @ self.queries.T
        return _prediction(_softmax(self.scale * sims), self.labels)


class LabelLLMModel(Model):
    """SmolLM2 scoring each label as the continuation of a prompt with the text, minus the
    label's score without the text; a softmax over labels gives the probabilities."""

    def __init__(self, lm: CausalLM, labels: tuple[str, ...], lm_name: str = "smollm2-135m"
                 ) -> None:
        self.lm = lm
        self.labels = labels
        self.device = lm.device
        encode = lm.tokenizer.encode
        self.label_ids = [encode(" " + label, add_special_tokens=False) for label in labels]
        prior_context = encode(EMPTY_PROMPT, add_special_tokens=False)
        self.prior = lm.continuation_logprobs([prior_context] * len(labels), self.label_ids)
        name = llm_name(labels, lm_name)
        self.spec = ModelSpec(
            name=name, family=FAMILY, backend="transformers",
            source=lm.source, num_params=lm.num_params, memory_bytes=lm.memory_bytes,
            max_tokens=MAX_TEXT_TOKENS, labels=labels,
            fingerprint=f"{name}-{short_hash(store.content_id(lm.source))}")

    def prompt_ids(self, text: str) -> list[int]:
        tok = self.lm.tokenizer
        ids = encode_row(tok, text)[:MAX_TEXT_TOKENS]
        head, tail = PROMPT.split("{text}")
        return (tok.encode(head, add_special_tokens=False) + ids
                + tok.encode(tail, add_special_tokens=False))

    def predict(self, texts: Sequence[str], batch_size: int = 8) -> Prediction:
        k = len(self.labels)
        if not len(texts):
            return _prediction(np.zeros((0, k), np.float32), self.labels)
        contexts = [self.prompt_ids(t) for t in texts]
        rows = [c for c in contexts for _ in range(k)]
        scores = self.lm.continuation_logprobs(rows, self.label_ids * len(texts), batch_size)
        scores = scores.reshape(len(texts), k) - self.prior[None, :]
        return _prediction(_softmax(scores), self.labels)


def bind_sem_classify(spec: str, resources: Resources, encoder: str = "minilm-l6",
                      threshold: float = DEFAULT_THRESHOLD, llm: bool = True) -> BoundSemantic:
    """Bind ``sem_classify(text, spec)``: label similarity, escalating to the LLM below
    ``threshold`` (or similarity alone with ``llm=False``)."""
    labels = parse_labels(spec)
    sim = LabelSimilarityModel(resources.encoder(encoder), labels, encoder=encoder)
    models: dict[str, Model] = {sim.name: sim}
    cascade = Cascade((sim.name,))
    if llm:
        judge = LabelLLMModel(resources.causal_lm("smollm2-135m"), labels)
        models[judge.name] = judge
        cascade = Cascade((sim.name, judge.name), (threshold,))
    return BoundSemantic("sem_classify", cascade, models, "varchar", calibrated=False,
                         arguments=("|".join(labels),),
                         detail=f"default softmax scale {DEFAULT_SCALE:g}, threshold "
                                f"{threshold:g}; plan it for a calibrated cascade")


def load_classify_stage(resources: Resources, device: DeviceConfig, kind: str, spec: str
                        ) -> Model:
    """One zero-shot stage (a :class:`~ken.ops.base.Stage`'s load): ``kind`` is an encoder
    name (similarity) or ``"llm"``."""
    labels = parse_labels(spec)
    if kind == "llm":
        return LabelLLMModel(resources.causal_lm("smollm2-135m", device), labels)
    return LabelSimilarityModel(resources.encoder(kind, device), labels, encoder=kind)


def trained_dir(home: Path | None, key: str) -> Path:
    return (home or ken_home()) / "trained" / "sem_classify" / key


def trained_name(member: str, key: str) -> str:
    return f"classify-{member.removeprefix('minilm-')}[{key[:8]}]"


_RETRAIN = "run the same session.train('sem_classify', ...) / TRAIN sem_classify again"


def trained_entry(home: Path | None, key: str) -> store.Entry:
    """The store entry of heads trained on a user's labels: the card and one head per
    member."""
    return store.Entry(trained_dir(home, key), f"the sem_classify heads trained on {key}",
                       _RETRAIN, legacy=_adopt_trained)


def _adopt_trained(entry: store.Entry) -> tuple[str, ...]:
    """Check heads trained before ken kept manifests: the card parses and every head is a
    complete safetensors file."""
    card = store.check_json(entry.root / "card.json", entry)
    members = card.get("members") if isinstance(card, dict) else None
    if not isinstance(members, dict) or not members:
        raise StoreError(f"model store: {entry.root / 'card.json'} is not a sem_classify card. "
                         f"It belongs to {entry.what}. To fix it: {entry.fix}.")
    heads = tuple(f"{m}.head.safetensors" for m in members)
    for name in heads:
        store.check_safetensors(entry.root / name, entry)
    return ("card.json", *heads)


def load_trained(resources: Resources, device: DeviceConfig, member: str, key: str
                 ) -> TransformersClassifier:
    """A head trained on a user's labels (:meth:`SemClassify.train`) on its encoder, its
    files verified first (a :class:`~ken.ops.base.Stage`'s load)."""
    entry = trained_entry(resources.home, key)
    path = entry.root / f"{member}.head.safetensors"
    if not path.is_file():
        raise ModelError(f"the trained sem_classify head {path} is missing; {_RETRAIN}")
    store.ensure(entry)
    head = LinearHead.load(path)
    body = resources.encoder(member, device)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    spec = ModelSpec(trained_name(member, key), FAMILY,
                     "transformers", body.config.source, body.num_params + head.num_params,
                     body.memory_bytes, body.max_tokens, tuple(head.label_names), digest)
    return TransformersClassifier(spec, body, head)


class SemClassify(Operator):
    name = "sem_classify"
    num_columns = 1
    constants = ("labels",)
    output_type = "varchar"
    doc = "zero-shot classification into the labels 'label1|label2|...'"
    eval_constants = (EVAL_LABELS,)
    _kinds = ("minilm-l3", "minilm-l6", "llm")

    def __init__(self) -> None:
        self.trained: Trained | None = None
        self._key = ""  # the trained heads' folder under KEN_HOME/trained/sem_classify
        self._held_out: EvalSample | None = None

    def _serves_trained(self, spec: str) -> bool:
        return (self.trained is not None
                and set(parse_labels(spec)) == set(parse_labels(self.eval_constants[0])))

    def stages(self, ctx: OpContext, constants: tuple[str, ...]) -> list[Stage]:
        """The heads trained on the user's labels, for their label list; else the zero-shot
        stages (similarity on MiniLM-L3 and -L6, the LLM)."""
        if self._serves_trained(constants[0]):
            return [Stage(trained_name(m, self._key), load_trained, (m, self._key))
                    for m in TRAIN_MEMBERS]
        return [Stage(stage_name(kind, constants[0]), load_classify_stage, (kind, constants[0]))
                for kind in self._kinds]

    def bind(self, ctx: OpContext, constants: tuple[str, ...]) -> Bound:
        """Zero-shot: similarity on MiniLM-L6 then the LLM, with documented defaults; with
        trained heads, the cascade of them the profiles choose."""
        if not self._serves_trained(constants[0]):
            return bind_sem_classify(constants[0], shared_resources(ctx))
        assert self.trained is not None
        models = self.candidates(ctx, ctx.device)
        chosen = ctx.choose_cascade(self)
        return ClassifierBinding(self.name, chosen.cascade, models,
                                 stage_fractions=chosen.stage_fractions,
                                 expected_accuracy=chosen.accuracy,
                                 cost_ms_per_row=chosen.cost_ms_per_row,
                                 trained=self.trained.describe())

    def train(self, ctx: OpContext, data: TrainingData, *, labels: str = "",
              predicate: str = "", **options: object) -> Trained:
        """Learn the classes of the user's labelled texts (one text column; the label column's
        values are the classes): heads on MiniLM-L3 and -L6 embeddings of four fifths of the
        rows, measured on the last fifth beside the zero-shot cascade. ``labels`` (SQL:
        ``FOR 'a|b|c'``) must name exactly the label column's values. Cached by the rows'
        hash."""
        if options:
            raise KenError(f"sem_classify training takes labels=... only, not "
                           f"{', '.join(options)}")
        if len(data.columns) != 1:
            raise KenError(f"sem_classify reads one text column; {data.source} gives "
                           f"{len(data.columns)} ({', '.join(data.columns)})")
        data.need_classes(2)
        classes = data.classes
        asked = labels or predicate
        if asked:
            wanted = parse_labels(asked)
            unlabelled = [c for c in wanted if c not in classes]
            unknown = [c for c in classes if c not in wanted]
            problems = []
            if unlabelled:
                problems.append(f"no row is labelled {', '.join(unlabelled)}")
            if unknown:
                problems.append(f"rows labelled {', '.join(unknown)} are not among the labels")
            if problems:
                raise DataError(f"{data.source}: the labels {asked!r} and the values of "
                                f"{data.label!r} ({', '.join(classes)}) differ: "
                                + "; ".join(problems))
        spec = "|".join(classes)
        fit, held = data.split((0.8, 0.2))
        if len(held) < len(classes) or len(fit) < 2 * len(classes):
            raise DataError(f"{data.source}: {len(data)} rows are too few to train and "
                            f"validate {len(classes)} classes (at least {5 * len(classes)})")
        key = hashlib.sha256(f"{data.content_hash}|{TRAIN_VERSION}".encode()).hexdigest()[:16]
        entry = trained_entry(ctx.home, key)
        folder = entry.root
        texts = data.texts[0]
        index = {c: i for i, c in enumerate(classes)}
        truth = np.array([index[v] for v in data.labels], dtype=np.int64)
        held_texts = [texts[i] for i in held]
        resources = shared_resources(ctx)
        card = None
        if (folder / "card.json").is_file():
            try:  # a damaged entry is trained again from the rows at hand
                store.ensure(entry)
                card = json.loads((folder / "card.json").read_text())
            except (StoreError, OSError, ValueError) as exc:
                ctx.reporter.note(f"{exc}\n  -> training sem_classify again")
        if card is None:
            card = {"classes": list(classes), "members": {}}
            with store.store_lock(ctx.home or ken_home(), f"training sem_classify on "
                                  f"{data.source}", ctx.reporter.note), \
                    store.staging_dir(folder) as staging:
                for member in TRAIN_MEMBERS:
                    body = resources.encoder(member)
                    head = fit_logistic_cv(body.features([texts[i] for i in fit]),
                                           truth[fit], classes)
                    head.save(staging / f"{member}.head.safetensors")
                    picked = head.predict_proba(body.features(held_texts)).argmax(axis=1)
                    card["members"][member] = float(np.mean(picked == truth[held]))
                zero_shot = bind_sem_classify(spec, resources)
                answers = cascade_values(zero_shot.cascade, zero_shot.models, held_texts)
                card["zero_shot"] = float(np.mean([a == data.labels[i] for a, i in
                                                   zip(answers, held, strict=True)]))
                (staging / "card.json").write_text(json.dumps(card, indent=1))
                store.seal(store.Entry(staging, "", ""))
        self._key = key
        self.eval_constants = (spec,)
        self._held_out = EvalSample(f"{data.source}-heldout", tuple(held_texts),
                                    tuple(data.labels[i] for i in held), "accuracy")
        heads = ", ".join(f"{m} head {acc:.1%}" for m, acc in card["members"].items())
        self.trained = Trained(
            self.name, data.describe(), data.content_hash,
            f"held-out accuracy on {len(held)} rows: {heads}; zero-shot cascade "
            f"{card['zero_shot']:.1%}", str(folder))
        return self.trained

    def eval_sample(self, ctx: OpContext) -> EvalSample:
        if self._held_out is not None:
            return self._held_out
        return family.heldout_sample(ctx.data or family.default_data()).as_eval()

    def plannable(self) -> bool:
        return True

    def eval_description(self) -> str:
        if self.trained is not None:
            return f"the held-out fifth of {self.trained.data}, accuracy"
        return f"labels {EVAL_LABELS!r} on the family's held-out tweets, accuracy"

    def store_entries(self, home: Path) -> list[tuple[str, store.Entry]]:
        """Every folder of trained sem_classify heads in ``home``."""
        return [("trained sem_classify", trained_entry(home, folder.name))
                for folder in sorted((home / "trained" / "sem_classify").glob("*"))
                if folder.is_dir() and not store.is_leftover(folder)]


OPERATOR = SemClassify
