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

>>> # session.sql("SELECT sem_classify(text, 'sports|politics|weather') FROM posts")
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from ken.errors import DataError
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig, Model, ModelSpec, Prediction
from ken.models.quality import EvalSample
from ken.models.resources import CausalLM, Resources, normalise_rows, short_hash
from ken.models.transformers_backend import TransformersBody
from ken.ops.base import Bound, BoundSemantic, OpContext, Operator, shared_resources

FAMILY = "sem-classify"
DEFAULT_SCALE = 20.0  # cosine similarities of short labels differ by ~0.05-0.2
DEFAULT_THRESHOLD = 0.6
EVAL_LABELS = "negative|neutral|positive"
PROMPT_VERSION = "v1"
PROMPT = "Text: {text}\nThe text is best described as:"
EMPTY_PROMPT = "Text:\nThe text is best described as:"
MAX_TEXT_TOKENS = 128


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
    """The name of the stage :func:`make_stage` builds (no model is loaded)."""
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
            fingerprint=f"{name}-{short_hash(body.config.source)}")

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
            fingerprint=f"{name}-{short_hash(lm.source)}")

    def prompt_ids(self, text: str) -> list[int]:
        tok = self.lm.tokenizer
        ids = tok.encode(text, add_special_tokens=False)[:MAX_TEXT_TOKENS]
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


def make_stage(resources: Resources, kind: str, spec: str,
               device: DeviceConfig | None = None) -> Model:
    """One sem_classify stage: ``kind`` is an encoder name (similarity) or ``"llm"``."""
    labels = parse_labels(spec)
    if kind == "llm":
        return LabelLLMModel(resources.causal_lm("smollm2-135m", device), labels)
    return LabelSimilarityModel(resources.encoder(kind, device), labels, encoder=kind)


def load_classify_stage(kind: str, spec: str, home: Path | None, threads: int) -> Model:
    """One sem_classify stage for a worker process (picklable via ``functools.partial``)."""
    return make_stage(Resources(DeviceConfig(threads=threads), home), kind, spec)


class SemClassify(Operator):
    name = "sem_classify"
    num_columns = 1
    constants = ("labels",)
    output_type = "varchar"
    doc = "zero-shot classification into the labels 'label1|label2|...'"
    eval_constants = (EVAL_LABELS,)
    _kinds = ("minilm-l3", "minilm-l6", "llm")

    def bind(self, ctx: OpContext, constants: tuple[str, ...]) -> Bound:
        return bind_sem_classify(constants[0], shared_resources(ctx))

    def eval_sample(self, ctx: OpContext) -> EvalSample:
        from ken.models import family

        return family.heldout_sample(ctx.data or family.default_data()).as_eval()

    def plannable(self) -> bool:
        return True

    def eval_description(self) -> str:
        return f"labels {EVAL_LABELS!r} on the family's held-out tweets, accuracy"

    def candidates(self, ctx: OpContext, device: DeviceConfig) -> Mapping[str, Model]:
        models = [make_stage(shared_resources(ctx), kind, EVAL_LABELS, device)
                  for kind in self._kinds]
        return {m.name: m for m in models}

    def loaders(self, ctx: OpContext, threads: int) -> Mapping[str, Callable[[], Model]]:
        return {stage_name(kind, EVAL_LABELS): functools.partial(
                    load_classify_stage, kind, EVAL_LABELS, ctx.home, threads)
                for kind in self._kinds}


OPERATOR = SemClassify
