"""``sem_filter(text, 'predicate') -> boolean``: does a text satisfy a natural-language predicate.

Served by a two-stage cascade, bound per predicate:

1. :class:`SimilarityModel` (cheap, MiniLM cost): cosine similarity between the text's and the
   predicate's sentence embeddings, squashed by a sigmoid ``P(true) = sigmoid(scale * (sim -
   offset))``. Good at topical predicates ("is about food"); blind to negation and sentiment.
2. An LLM stage on SmolLM2-135M-Instruct for rows whose stage-1 certainty (max probability) is
   below the threshold. Two are implemented:

   * :class:`ChannelLLMModel` (default): does the predicate make the text more likely
     (``log P(text | predicate) - log P(text)``)?
   * :class:`YesNoLLMModel`: the model is asked, with its chat template, whether the predicate
     is true of the text; ``P(true)`` compares the next-token probabilities of "yes" and "no".
     At 135M parameters (de-quantised from a 4-bit GGUF) its answers are near chance on every
     predicate tried here, so it is not the default; ``bind_sem_filter(..., llm="yesno")``.
     ``llm="yesno-qwen"`` (or ``session.operators["sem_filter"].llm = "yesno-qwen"``) asks
     Qwen2.5-Coder-0.5B-Instruct instead (fetched on first use).
   * :class:`ChoiceFilterModel` (``llm="choice-qwen"``): the predicate as a yes/no choice to
     Qwen2.5-Coder-0.5B, calibrated against content-free inputs (``ChoiceModel``). It separates
     better than the default on the rows measured (``benchmarks/filter_stages.py``: ROC AUC 0.63
     against 0.46 on "expresses a negative opinion", 10 of 11 obvious rows against 8) at 5-6x
     the time per escalated row, and it needs Qwen, so it is offered, not the default.

Without labelled data the sigmoid and threshold are documented defaults (the operator is
*uncalibrated*). :func:`calibrate_filter` fits both on a labelled sample and keeps the LLM stage
only if it beats stage 1 on the sample rows that would reach it.

>>> # bound = bind_sem_filter("complains about a flight delay", Resources())
>>> # result = run_cascade(bound.cascade, bound.models, table["text"])
>>> # bound.to_sql_values(result.labels)  # [True, False, None, ...]
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from ken import store
from ken.errors import DataError, KenError, ModelError, StoreError
from ken.models import family
from ken.models.cascade import Cascade
from ken.models.head import LinearHead, fit_logistic_cv
from ken.models.model import BOOLEAN_LABELS, DeviceConfig, Model, ModelSpec
from ken.models.quality import EvalSample, balanced_accuracy
from ken.models.resources import Resources
from ken.models.transformers_backend import TransformersClassifier
from ken.ops.base import Bound, BoundSemantic, OpContext, Operator, Stage, shared_resources
from ken.ops.filter_calibration import (
    DEFAULT_TARGET_ACCURACY,
    FilterCalibration,
    FilterSample,
    calibrate_filter,
    fit_similarity_calibration,
)
from ken.ops.filter_models import (
    CHANNEL_OFFSET,
    CHANNEL_SCALE,
    DEFAULT_OFFSET,
    DEFAULT_SCALE,
    LLM_STAGES,
    ChannelLLMModel,
    LLMModel,
    SimilarityModel,
    channel_name,
    similarity_name,
)
from ken.ops.training import Trained, TrainingData, cascade_values, check_predicate_option
from ken.paths import ken_home


def _normal_predicate(predicate: str) -> str:
    return " ".join(str(predicate).split()).rstrip("?.! ")


def bind_sem_filter(predicate: str, resources: Resources, sample: FilterSample | None = None,
                    *, encoder: str = "minilm-l6", llm: str | None = "channel",
                    calibration: FilterCalibration | None = None,
                    target_accuracy: float = DEFAULT_TARGET_ACCURACY,
                    device: DeviceConfig | None = None) -> BoundSemantic:
    """Bind ``sem_filter(text, predicate)``: the similarity stage, then (maybe) an LLM stage.

    ``llm`` picks the second stage: ``"channel"`` (:class:`ChannelLLMModel` on SmolLM2, the
    default: it measurably works), ``"yesno"`` (:class:`YesNoLLMModel` on SmolLM2, near chance
    at 135M parameters), ``"yesno-qwen"`` (the yes/no question to Qwen2.5-Coder-0.5B, fetched
    on first use) or ``None`` (similarity alone). ``sample`` calibrates the operator (see
    :func:`calibrate_filter`); a given ``calibration`` (e.g. cached by the caller) is used as
    is; otherwise the documented defaults apply and the operator reports itself uncalibrated.
    Model names carry a hash of the predicate and parameters (``sim-l6[1a2b3c4d]``), so several
    predicates in one query never collide; the heavy networks come from ``resources`` and are
    shared by every predicate.

    >>> # bound = bind_sem_filter("complains about a flight delay", Resources())
    >>> # bound.describe()
    >>> # "sem_filter('complains about a flight delay'): sim-l6[..] -(0.800)-> channel-smollm2[..]
    >>> #  [max_prob], uncalibrated; default sigmoid(15.0 * (sim - 0.220)); ..."
    """
    if not isinstance(predicate, str) or not predicate.strip():
        raise DataError("sem_filter needs a non-empty predicate, e.g. "
                        "sem_filter(text, 'complains about a flight delay')")
    original, predicate = predicate, _normal_predicate(predicate)
    if not predicate:
        raise DataError(f"sem_filter's predicate {original!r} has no words; describe the "
                        "condition, e.g. 'is about food'")
    if llm is not None and llm not in LLM_STAGES:
        raise ModelError(f"unknown sem_filter LLM stage {llm!r}; use one of: "
                         f"{', '.join(LLM_STAGES)}, or None for the similarity stage alone")
    body = resources.encoder(encoder, device)
    stage2: LLMModel | None = None
    if llm is not None and (calibration is None or calibration.use_llm):
        kind, lm_name = LLM_STAGES[llm]
        stage2 = kind(resources.causal_lm(lm_name, device), predicate, lm_name=lm_name)
    if calibration is None:
        if sample is not None:
            probe = SimilarityModel(body, predicate, encoder=encoder)
            calibration = calibrate_filter(probe, sample, stage2, target_accuracy)
        else:
            calibration = FilterCalibration(use_llm=stage2 is not None)
    sim = SimilarityModel(body, predicate, calibration.scale, calibration.offset,
                          encoder=encoder)
    models: dict[str, Model] = {sim.name: sim}
    if stage2 is not None and calibration.use_llm:
        models[stage2.name] = stage2
        cascade = Cascade((sim.name, stage2.name), (calibration.threshold,))
    else:
        cascade = Cascade((sim.name,))
    return BoundSemantic("sem_filter", cascade, models, "boolean", calibration.calibrated,
                         (predicate,), calibration.describe())


# -- the operator --------------------------------------------------------------------------------

#: the predicate sem_filter is profiled and planned on, with its labels from the family's tweets
EVAL_PREDICATE = "expresses a negative opinion"
EVAL_CALIBRATION_ROWS = 300


def tweets_filter_sample(ctx: OpContext) -> tuple[FilterSample, EvalSample]:
    """Calibration rows and the evaluation sample for :data:`EVAL_PREDICATE`: the family's
    tweets, true where a tweet is labelled negative (calibration from the training split, the
    evaluation sample is the held-out split)."""
    train, test = (ctx.data or family.default_data()).splits()
    negative = train.label_names.index("negative")
    rows = min(EVAL_CALIBRATION_ROWS, len(train))
    calibration = FilterSample(train.texts[:rows],
                               tuple(int(v) == negative for v in train.labels[:rows]))
    sample = EvalSample(f"{test.name}-negative", test.texts,
                        tuple(int(v) == negative for v in test.labels), "balanced_accuracy")
    return calibration, sample


def load_filter_stage(resources: Resources, device: DeviceConfig, kind: str, predicate: str,
                      scale: float, offset: float) -> Model:
    """One candidate stage (a :class:`~ken.ops.base.Stage`'s load): ``kind`` is an encoder
    name (similarity stage) or ``"channel"`` (the channel LLM stage on SmolLM2)."""
    if kind == "channel":
        return ChannelLLMModel(resources.causal_lm("smollm2-135m", device), predicate)
    return SimilarityModel(resources.encoder(kind, device), predicate, scale, offset,
                           encoder=kind)


def filter_stage(kind: str, predicate: str, scale: float, offset: float) -> Stage:
    name = (channel_name(predicate) if kind == "channel"
            else similarity_name(predicate, kind, scale, offset))
    return Stage(name, load_filter_stage, (kind, predicate, scale, offset))


_RETRAIN = "run the same session.train('sem_filter', ...) / TRAIN sem_filter again"


def trained_entry(home: Path | None, key: str) -> store.Entry:
    """The store entry of a sem_filter trained on a user's rows: its calibration JSON and its
    head, two files in ``KEN_HOME/trained/sem_filter``."""
    return store.Entry((home or ken_home()) / "trained" / "sem_filter",
                       f"the sem_filter trained on {key[:16]}", _RETRAIN,
                       files=(f"{key[:16]}.json", f"{key[:16]}.head.safetensors"),
                       legacy=_adopt_trained)


def _adopt_trained(entry: store.Entry) -> None:
    """Check a sem_filter trained before ken kept manifests: its JSON holds a calibration of
    this ken and its head is a complete safetensors file."""
    saved = store.check_json(entry.main, entry)
    try:
        FilterCalibration.from_dict(saved["calibration"])  # type: ignore[index]
        _ = saved["quality"], saved["use_head"]  # type: ignore[index]
    except (ModelError, KeyError, TypeError) as exc:
        raise StoreError(f"model store: {entry.main} is not a sem_filter calibration of this "
                         f"ken ({exc}). It belongs to {entry.what}. To fix it: "
                         f"{entry.fix}.") from None
    store.check_safetensors(entry.root / entry.files[1], entry)  # type: ignore[index]


class SemFilter(Operator):
    name = "sem_filter"
    num_columns = 1
    constants = ("predicate",)
    output_type = "boolean"
    doc = "does the text satisfy a natural-language predicate"
    eval_constants = (EVAL_PREDICATE,)

    #: the LLM stage of calls from SQL (a key of ``LLM_STAGES``, or None for similarity alone);
    #: ``session.operators["sem_filter"].llm = "yesno-qwen"`` asks Qwen2.5-Coder-0.5B. Set it
    #: before the session binds a predicate (bindings are cached per session); planning and
    #: served calls use the candidates below (the similarity encoders and the channel stage)
    llm: str | None = "channel"

    def __init__(self) -> None:
        #: predicate -> (calibration, what trained it, the head model or None), set by train()
        self.trained: dict[str, tuple[FilterCalibration, Trained, Model | None]] = {}

    def bind(self, ctx: OpContext, constants: tuple[str, ...]) -> Bound:
        predicate = _normal_predicate(constants[0])
        if predicate in self.trained:
            calibration, trained, head_model = self.trained[predicate]
            if head_model is not None:
                return BoundSemantic("sem_filter", Cascade((head_model.name,)),
                                     {head_model.name: head_model}, "boolean", True,
                                     (predicate,), trained.describe())
            bound = bind_sem_filter(constants[0], shared_resources(ctx), llm=self.llm,
                                    calibration=calibration)
            return replace(bound, detail=f"{bound.detail}; {trained.describe()}")
        return bind_sem_filter(constants[0], shared_resources(ctx), llm=self.llm)

    def train(self, ctx: OpContext, data: TrainingData, *, predicate: str = "",
              **options: object) -> Trained:
        """Learn ``sem_filter(text, predicate)`` from the user's rows labelled true/false.

        Two candidates are fitted on four fifths of the rows and scored (balanced accuracy) on
        the held-out fifth: the calibrated cascade (similarity sigmoid + LLM threshold) and a
        logistic-regression head on the rows' MiniLM-L6 embeddings, which learns what the
        labels mean rather than only how far to trust the predicate's wording. The better one
        serves SQL calls with this predicate. Cached by the rows' hash, the predicate and the
        LLM stage."""
        check_predicate_option(self.name, options, predicate,
                               "session.train('sem_filter', 'reviews', label='is_positive', "
                               "predicate='expresses a positive opinion')")
        if len(data.columns) != 1:
            raise KenError(f"sem_filter reads one text column; {data.source} gives "
                           f"{len(data.columns)} ({', '.join(data.columns)})")
        truth = data.booleans()
        normal = _normal_predicate(predicate)
        key = hashlib.sha256(f"{data.content_hash}|{normal}|{self.llm}".encode()).hexdigest()
        entry = trained_entry(ctx.home, key)
        path = entry.main
        head_path = path.with_suffix(".head.safetensors")
        resources = shared_resources(ctx)
        saved = None
        if path.exists():
            try:  # a damaged entry is trained again from the rows at hand
                store.ensure(entry)
                saved = json.loads(path.read_text())
                calibration = FilterCalibration.from_dict(saved["calibration"])
                quality, use_head = saved["quality"], saved["use_head"]
            except (StoreError, ModelError, OSError, ValueError, KeyError, TypeError) as exc:
                ctx.reporter.note(f"{exc}\n  -> training sem_filter again")
                saved = None
        if saved is None:
            fit, held = data.split((0.8, 0.2))
            if len(held) == 0 or len(fit) < 4:
                raise DataError(f"{data.source}: {len(data)} rows are too few to calibrate "
                                "and validate sem_filter (at least 10 with both labels)")
            texts = data.texts[0]
            sample = FilterSample(tuple(texts[i] for i in fit), tuple(truth[fit].tolist()))
            stage2 = None
            if self.llm is not None:
                kind, lm_name = LLM_STAGES[self.llm]
                stage2 = kind(resources.causal_lm(lm_name), normal, lm_name=lm_name)
            probe = SimilarityModel(resources.encoder("minilm-l6"), normal, encoder="minilm-l6")
            calibration = calibrate_filter(probe, sample, stage2)
            bound = bind_sem_filter(predicate, resources, llm=self.llm, calibration=calibration)
            held_texts = [texts[i] for i in held]
            kept = np.array(cascade_values(bound.cascade, bound.models, held_texts)) == "true"
            reference = truth[held].tolist()
            calibrated = float(np.mean(balanced_accuracy(kept.tolist(), reference)))
            body = resources.encoder("minilm-l6")
            head = fit_logistic_cv(body.features(list(sample.texts)), truth[fit].astype(np.int64),
                                   BOOLEAN_LABELS)
            picked = head.predict_proba(body.features(held_texts)).argmax(axis=1) == 1
            learned = float(np.mean(balanced_accuracy(picked.tolist(), reference)))
            use_head = learned > calibrated
            quality = (f"validation balanced accuracy on {len(held)} held-out rows: head on "
                       f"MiniLM-L6 embeddings {learned:.1%}, calibrated similarity cascade "
                       f"{calibrated:.1%}; serving the "
                       f"{'head' if use_head else 'calibrated cascade'}")
            with store.store_lock(ctx.home or ken_home(), f"training sem_filter on "
                                  f"{data.source}", ctx.reporter.note):
                head.save(head_path)
                store.write_text(path, json.dumps({"calibration": calibration.to_dict(),
                                                   "quality": quality,
                                                   "use_head": bool(use_head),
                                                   "data": data.describe()}))
                store.seal(entry)
        trained = Trained(self.name, data.describe(), data.content_hash, quality, str(path))
        head_model = None
        if use_head:
            body = resources.encoder("minilm-l6")
            spec = ModelSpec(f"head-l6[{key[:8]}]", "sem-filter", "transformers",
                             body.config.source, body.num_params, body.memory_bytes,
                             body.max_tokens, BOOLEAN_LABELS, key[:16])
            head_model = TransformersClassifier(spec, body, LinearHead.load(head_path))
        self.trained[normal] = (calibration, trained, head_model)
        return trained

    def eval_sample(self, ctx: OpContext) -> EvalSample:
        return tweets_filter_sample(ctx)[1]

    def plannable(self) -> bool:
        return True

    def eval_description(self) -> str:
        return (f"predicate {EVAL_PREDICATE!r} on the family's held-out tweets (true where "
                "labelled negative), balanced accuracy")

    def stages(self, ctx: OpContext, constants: tuple[str, ...]) -> list[Stage]:
        """The candidates for a predicate: the similarity stage on MiniLM-L3 and on -L6 (their
        sigmoids fitted on the calibration rows of the evaluation predicate, the defaults for
        any other) and the channel LLM stage. Calls from SQL bind ``bind_sem_filter``."""
        predicate = _normal_predicate(constants[0])
        if predicate == EVAL_PREDICATE:
            fitted = ctx.resource("sem-filter-eval-stages", lambda: _eval_sigmoids(ctx))
        else:
            fitted = [(e, DEFAULT_SCALE, DEFAULT_OFFSET) for e in ("minilm-l3", "minilm-l6")]
        return [filter_stage(kind, predicate, scale, offset)
                for kind, scale, offset in [*fitted, ("channel", CHANNEL_SCALE, CHANNEL_OFFSET)]]

    def store_entries(self, home: Path) -> list[tuple[str, store.Entry]]:
        """Every trained sem_filter in ``home``."""
        return [("trained sem_filter", trained_entry(home, path.stem))
                for path in sorted((home / "trained" / "sem_filter").glob("*.json"))
                if not path.name.startswith(".")]


def _eval_sigmoids(ctx: OpContext) -> list[tuple[str, float, float]]:
    """(encoder, scale, offset) of both similarity encoders, fitted on the calibration rows
    of :data:`EVAL_PREDICATE`."""
    calibration, _sample = tweets_filter_sample(ctx)
    out = []
    for encoder in ("minilm-l3", "minilm-l6"):
        probe = SimilarityModel(shared_resources(ctx).encoder(encoder), EVAL_PREDICATE,
                                encoder=encoder)
        fitted = fit_similarity_calibration(probe.similarity(calibration.texts),
                                            calibration.truth)
        out.append((encoder, fitted.scale, fitted.offset))
    return out


OPERATOR = SemFilter
