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

Without labelled data the sigmoid and threshold are documented defaults (the operator is
*uncalibrated*). :func:`calibrate_filter` fits both on a labelled sample and keeps the LLM stage
only if it beats stage 1 on the sample rows that would reach it.

>>> # bound = bind_sem_filter("complains about a flight delay", Resources())
>>> # result = run_cascade(bound.cascade, bound.models, table["text"])
>>> # bound.to_sql_values(result.labels)  # [True, False, None, ...]
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ken import store
from ken.errors import DataError, KenError, ModelError, StoreError
from ken.models.cascade import Cascade
from ken.models.data_text import defuse, encode_rows
from ken.models.head import LinearHead, fit_logistic_cv
from ken.models.model import BOOLEAN_LABELS, DeviceConfig, Model, ModelSpec, Prediction
from ken.models.quality import EvalSample, balanced_accuracy
from ken.models.resources import (
    CausalLM,
    Resources,
    boolean_probabilities,
    normalise_rows,
    short_hash,
    sigmoid,
)
from ken.models.transformers_backend import TransformersBody, TransformersClassifier
from ken.ops.base import Bound, BoundSemantic, OpContext, Operator, shared_resources
from ken.ops.training import Trained, TrainingData, cascade_values
from ken.paths import ken_home

__all__ = [
    "BoundSemantic", "FilterCalibration", "FilterSample", "Resources", "SimilarityModel",
    "YesNoLLMModel", "bind_sem_filter", "calibrate_filter", "fit_similarity_calibration",
]

FAMILY = "sem-filter"
SHORT_NAMES = {"minilm-l3": "l3", "minilm-l6": "l6"}

# Uncalibrated defaults, read off all-MiniLM-L6-v2 cosine similarities between short predicates
# and texts: texts on the predicate's topic mostly score 0.2-0.7, unrelated texts -0.1-0.15, and
# texts that share words but not meaning (a punctual flight for "complains about a flight
# delay") 0.25-0.35. The sigmoid is centred in that gap; threshold 0.8 escalates rows with
# |sim - 0.22| < logit(0.8) / 15 ~ 0.09, i.e. similarities in about [0.13, 0.31].
DEFAULT_SCALE = 15.0
DEFAULT_OFFSET = 0.22
DEFAULT_THRESHOLD = 0.80
DEFAULT_TARGET_ACCURACY = 0.90
CALIBRATION_SCHEMA_VERSION = 1
# The channel stage's log-likelihood ratio is in nats; 0 is its Bayes boundary (see
# ChannelLLMModel) and a scale of 0.5 keeps a 1-nat margin from looking certain.
CHANNEL_SCALE = 0.5
CHANNEL_OFFSET = 0.0

# SmolLM2's answer starts right after "<|im_start|>assistant\n", where it writes "Yes"/"No"
# without a leading space; lower-case and space-prefixed spellings also carry probability (and
# other templates or models prefer them). Summing over every single-token spelling measures
# "the answer is yes" independent of surface form; multi-token spellings ("YES" is "Y" + "ES")
# are left out because their first token does not identify the answer.
YES_SPELLINGS = ("Yes", "yes", " Yes", " yes", "YES", " YES")
NO_SPELLINGS = ("No", "no", " No", " no", "NO", " NO")
SYSTEM_PROMPT = ("You judge whether a statement is true of a text. "
                 "Answer with a single word: Yes or No.")
TEXT_MARKER = "\x00KEN-TEXT\x00"


@dataclass(frozen=True)
class FilterSample:
    """Labelled rows for calibrating one predicate: texts and whether each satisfies it."""

    texts: tuple[str, ...]
    labels: tuple[bool, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "texts", tuple(self.texts))
        object.__setattr__(self, "labels", tuple(bool(v) for v in self.labels))
        if len(self.texts) != len(self.labels):
            raise DataError(f"a filter sample needs one label per text: {len(self.texts)} texts,"
                            f" {len(self.labels)} labels")
        if any(not isinstance(t, str) for t in self.texts):
            raise DataError("a filter sample's texts must be strings (drop NULL rows first)")

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def truth(self) -> np.ndarray:
        return np.asarray(self.labels, dtype=bool)


@dataclass(frozen=True)
class FilterCalibration:
    """Stage-1 sigmoid and escalation threshold of one predicate, and what they scored.

    ``calibrated`` is False for the documented defaults. Accuracies are on the calibration
    sample (NaN when not measured): ``stage1_accuracy`` of stage 1 alone, ``resolved_accuracy``
    on the rows stage 1 keeps at ``threshold``, ``llm_accuracy`` and ``stage1_escalated_accuracy``
    of the LLM and of stage 1 on (up to ``llm_rows``) rows that escalate.
    """

    scale: float = DEFAULT_SCALE
    offset: float = DEFAULT_OFFSET
    threshold: float = DEFAULT_THRESHOLD
    use_llm: bool = True
    calibrated: bool = False
    num_rows: int = 0
    target_accuracy: float = DEFAULT_TARGET_ACCURACY
    stage1_accuracy: float = math.nan
    resolved_accuracy: float = math.nan
    escalation_rate: float = math.nan
    llm_rows: int = 0
    llm_accuracy: float = math.nan
    stage1_escalated_accuracy: float = math.nan
    schema_version: int = CALIBRATION_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and math.isfinite(self.offset)):
            raise ModelError(f"filter calibration needs finite scale and offset, got "
                             f"{self.scale}, {self.offset}")

    def describe(self) -> str:
        """A short note for EXPLAIN."""
        sigmoid_text = f"sigmoid({self.scale:.1f} * (sim - {self.offset:.3f}))"
        if not self.calibrated:
            return f"default {sigmoid_text}; pass a labelled sample to calibrate"
        text = (f"{sigmoid_text} fitted on {self.num_rows} rows: stage 1 "
                f"{self.stage1_accuracy:.0%}, escalates {self.escalation_rate:.0%}")
        if self.llm_rows:
            text += (f", LLM {self.llm_accuracy:.0%} vs stage 1 "
                     f"{self.stage1_escalated_accuracy:.0%} on {self.llm_rows} escalated rows")
        return text + ("" if self.use_llm else ", LLM stage dropped")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> FilterCalibration:
        if data.get("schema_version") != CALIBRATION_SCHEMA_VERSION:
            raise ModelError("filter calibration has an old schema; calibrate again")
        return cls(**data)  # type: ignore[arg-type]

    def to_json(self) -> str:
        """JSON (unmeasured accuracies are written as ``null``)."""
        return json.dumps({k: None if isinstance(v, float) and math.isnan(v) else v
                           for k, v in self.to_dict().items()})

    @classmethod
    def from_json(cls, text: str) -> FilterCalibration:
        data = {k: math.nan if v is None else v for k, v in json.loads(text).items()}
        return cls.from_dict(data)


class SimilarityModel(Model):
    """``P(true) = sigmoid(scale * (cos(embed(text), embed(predicate)) - offset))``.

    The predicate is embedded once, here; ``predict`` embeds only the texts.
    """

    def __init__(self, body: TransformersBody, predicate: str, scale: float = DEFAULT_SCALE,
                 offset: float = DEFAULT_OFFSET, name: str | None = None,
                 encoder: str = "minilm-l6") -> None:
        self.body = body
        self.predicate = predicate
        self.scale = float(scale)
        self.offset = float(offset)
        self.device = body.device
        self.query = normalise_rows(body.features([predicate], 1))[0].astype(np.float64)
        short = SHORT_NAMES.get(encoder, encoder)
        key = short_hash(predicate, encoder, round(self.scale, 6), round(self.offset, 6))
        self.spec = ModelSpec(
            name=name or f"sim-{short}[{key}]", family=FAMILY, backend="transformers",
            source=body.config.source, num_params=body.num_params,
            memory_bytes=body.memory_bytes, max_tokens=body.max_tokens, labels=BOOLEAN_LABELS,
            fingerprint=f"sim-{short}-{short_hash(key, store.content_id(body.config.source))}",
        )

    def similarity(self, texts: Sequence[str], batch_size: int = 32,
                   on_batch: Callable[[int], None] | None = None) -> np.ndarray:
        """Cosine similarity of each text to the predicate, float64, in input order."""
        features = self.body.features(list(texts), batch_size, on_batch)
        return normalise_rows(features).astype(np.float64) @ self.query

    def probabilities(self, similarities: np.ndarray) -> np.ndarray:
        return boolean_probabilities(sigmoid(self.scale * (similarities - self.offset)))

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        probs = self.probabilities(self.similarity(texts, batch_size))
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, BOOLEAN_LABELS)


class YesNoLLMModel(Model):
    """SmolLM2 asked whether the predicate is true of the text; ``P(true)`` from yes vs no.

    The prompt (chat template, system prompt, then ``Text:`` and the question) is tokenized once
    around a marker, so each row only tokenizes its own text, truncated to
    ``max_text_tokens``. ``P(true) = softmax(log P(yes), log P(no))[yes]``, shifted by
    ``log_odds_offset`` (0 unless a caller corrects the model's prior towards "no").

    Measured here: zero-shot, this 135M model (de-quantised from 4 bits) separates true from
    false rows no better than chance (ROC AUC 0.41-0.58 on small synthetic topical and
    sentiment sets, 0.45 and 0.57 on 200 tweets for "is about air travel" and "expresses a
    negative opinion"; other prompt layouts did no better), and it answers "no" to most
    questions. Kept for larger instruction-tuned models; not the default stage.
    """

    def __init__(self, lm: CausalLM, predicate: str, max_text_tokens: int = 128,
                 log_odds_offset: float = 0.0, name: str | None = None,
                 lm_name: str = "smollm2-135m") -> None:
        if max_text_tokens < 1:
            raise ModelError(f"max_text_tokens must be at least 1, got {max_text_tokens}")
        self.lm = lm
        self.predicate = predicate
        self.max_text_tokens = int(max_text_tokens)
        self.log_odds_offset = float(log_odds_offset)
        self.device = lm.device
        self.prefix_ids, self.suffix_ids = self._prompt_ids(lm, predicate)
        self.yes_ids = lm.single_token_ids(YES_SPELLINGS)
        self.no_ids = lm.single_token_ids(NO_SPELLINGS)
        if not self.yes_ids or not self.no_ids:
            raise ModelError(f"{lm.source}: its tokenizer has no single-token 'yes'/'no'; "
                             "use another language model for sem_filter")
        room = lm.context_tokens - len(self.prefix_ids) - len(self.suffix_ids)
        if room < 1:
            raise ModelError("the sem_filter predicate is longer than the language model's "
                             "context; shorten the predicate")
        self.max_text_tokens = min(self.max_text_tokens, room)
        short = lm_name.split("-")[0]
        key = short_hash(predicate, lm_name, self.max_text_tokens, round(self.log_odds_offset, 6))
        self.spec = ModelSpec(
            name=name or f"yesno-{short}[{key}]", family=FAMILY, backend="transformers",
            source=lm.source, num_params=lm.num_params, memory_bytes=lm.memory_bytes,
            max_tokens=len(self.prefix_ids) + self.max_text_tokens + len(self.suffix_ids),
            labels=BOOLEAN_LABELS,
            fingerprint=f"yesno-{short}-{short_hash(key, store.content_id(lm.source))}",
        )

    @staticmethod
    def _prompt_ids(lm: CausalLM, predicate: str) -> tuple[list[int], list[int]]:
        # The text goes on its own line after "Text:\n", so the prefix ends in a newline token
        # and the text's first word is tokenized as it would be at a line start.
        question = (f"Text:\n{TEXT_MARKER}\n\nQuestion: is the following true of the text: "
                    f"{defuse(predicate, lm.tokenizer)}? Answer yes or no.")
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": question}]
        try:
            rendered = lm.tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=True)
        except (ValueError, AttributeError) as exc:
            raise ModelError(f"{lm.source} has no chat template; sem_filter needs an "
                             f"instruction-tuned model: {exc}") from exc
        before, after = rendered.split(TEXT_MARKER)
        encode = lm.tokenizer.encode
        return (encode(before, add_special_tokens=False),
                encode(after, add_special_tokens=False))

    def prompt_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """The full prompt of every text, its text truncated to ``max_text_tokens`` tokens."""
        if not texts:
            return []
        ids = encode_rows(self.lm.tokenizer, texts, add_special_tokens=False, truncation=True,
                          max_length=self.max_text_tokens)
        return [self.prefix_ids + list(row) + self.suffix_ids for row in ids]

    def log_odds(self, texts: Sequence[str], batch_size: int = 8) -> np.ndarray:
        """``log P(yes) - log P(no)`` of the next token, per text, before the offset."""
        scores = self.lm.next_token_scores(self.prompt_ids(texts), [self.yes_ids, self.no_ids],
                                           batch_size)
        return scores[:, 0] - scores[:, 1]

    def predict(self, texts: Sequence[str], batch_size: int = 8) -> Prediction:
        probs = boolean_probabilities(sigmoid(self.log_odds(texts, batch_size)
                                              - self.log_odds_offset))
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, BOOLEAN_LABELS)


class ChannelLLMModel(Model):
    """SmolLM2 as a *noisy channel*: does the predicate make the text more likely?

    Scores ``pmi = log P(text | "Here is a text that <predicate>:") - log P(text | "Here is a
    text:")`` (two forward passes per row, batched together), and ``P(true) = sigmoid(scale *
    (pmi - offset))``. By Bayes' rule the pmi is the log-likelihood ratio of the predicate
    given the text, so 0 is a principled uncalibrated boundary. Scoring how well the text fits
    the predicate, instead of asking the model to answer a question about it, is what works for
    small LMs (Min et al., ACL 2022, "Noisy Channel Language Model Prompting"): measured here
    it reaches ROC AUC 0.99 / 0.89 on small synthetic topical sets and 0.72 on 200 tweets ("is
    about air travel") where the yes/no question is at chance (0.47 / 0.58 / 0.45). Like the
    similarity stage it is weak on sentiment ("expresses a negative opinion": 0.58).
    """

    def __init__(self, lm: CausalLM, predicate: str, max_text_tokens: int = 128,
                 scale: float = CHANNEL_SCALE, offset: float = CHANNEL_OFFSET,
                 name: str | None = None, lm_name: str = "smollm2-135m") -> None:
        if max_text_tokens < 1:
            raise ModelError(f"max_text_tokens must be at least 1, got {max_text_tokens}")
        self.lm = lm
        self.predicate = predicate
        self.scale = float(scale)
        self.offset = float(offset)
        self.device = lm.device
        encode = lm.tokenizer.encode
        self.context_ids = encode(f"Here is a text that {predicate}:\n", add_special_tokens=False)
        self.neutral_ids = encode("Here is a text:\n", add_special_tokens=False)
        room = lm.context_tokens - len(self.context_ids)
        if room < 1:
            raise ModelError("the sem_filter predicate is longer than the language model's "
                             "context; shorten the predicate")
        self.max_text_tokens = min(int(max_text_tokens), room)
        short = lm_name.split("-")[0]
        key = short_hash(predicate, lm_name, self.max_text_tokens, round(self.scale, 6),
                         round(self.offset, 6))
        self.spec = ModelSpec(
            name=name or f"channel-{short}[{key}]", family=FAMILY, backend="transformers",
            source=lm.source, num_params=lm.num_params, memory_bytes=lm.memory_bytes,
            max_tokens=len(self.context_ids) + self.max_text_tokens, labels=BOOLEAN_LABELS,
            fingerprint=f"channel-{short}-{short_hash(key, store.content_id(lm.source))}",
        )

    def pmi(self, texts: Sequence[str], batch_size: int = 8) -> np.ndarray:
        """``log P(text | predicate context) - log P(text | neutral context)`` per text."""
        if not texts:
            return np.zeros(0)
        ids = encode_rows(self.lm.tokenizer, texts, add_special_tokens=False, truncation=True,
                          max_length=self.max_text_tokens)
        n = len(ids)
        scores = self.lm.continuation_logprobs([self.context_ids] * n + [self.neutral_ids] * n,
                                               list(ids) * 2, batch_size)
        return scores[:n] - scores[n:]

    def predict(self, texts: Sequence[str], batch_size: int = 8) -> Prediction:
        probs = boolean_probabilities(sigmoid(self.scale * (self.pmi(texts, batch_size)
                                                            - self.offset)))
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, BOOLEAN_LABELS)


#: the LLM stages ``bind_sem_filter(llm=...)`` offers: (how it scores, which language model)
LLM_STAGES: dict[str, tuple[type[YesNoLLMModel] | type[ChannelLLMModel], str]] = {
    "channel": (ChannelLLMModel, "smollm2-135m"),
    "yesno": (YesNoLLMModel, "smollm2-135m"),
    "yesno-qwen": (YesNoLLMModel, "qwen2.5-coder-0.5b"),
}


def fit_similarity_calibration(similarities: np.ndarray, labels: np.ndarray,
                               target_accuracy: float = DEFAULT_TARGET_ACCURACY,
                               min_resolved_fraction: float = 0.1) -> FilterCalibration:
    """Fit the stage-1 sigmoid on similarities and pick the escalation threshold.

    The sigmoid's centre ``offset`` is the cut ``sim > offset`` that is most accurate on the
    sample (a one-dimensional threshold, hard to overfit); its ``scale`` is then the maximum-
    likelihood slope around that centre (with a small L2 penalty, so separable samples keep a
    finite slope). A plain logistic regression was tried first: similarities of true rows have
    a long low tail, and its likelihood-optimal centre was less accurate than the default on
    real tweets (0.63 vs 0.71 held out), while the most accurate cut never is on the sample.

    The threshold is the smallest one at which the rows stage 1 keeps (certainty
    ``max(p, 1 - p) >= threshold``) are at least ``target_accuracy`` accurate, so as few rows
    as possible escalate; it must keep at least ``min_resolved_fraction`` of the rows, since
    accuracy on a handful of rows means little. When no threshold qualifies,
    ``DEFAULT_THRESHOLD`` is used. Thresholds fall midway between neighbouring certainties so
    that float rounding at run time does not move rows across.
    """
    sims = np.asarray(similarities, dtype=np.float64)
    truth = np.asarray(labels, dtype=bool)
    n = len(sims)
    if n != len(truth):
        raise DataError(f"{n} similarities but {len(truth)} labels")
    if n < 4 or truth.all() or not truth.any():
        raise DataError(f"calibrating sem_filter needs at least 4 labelled rows with both true "
                        f"and false among them; got {int(truth.sum())} true of {n}")
    if not 0.5 <= target_accuracy <= 1.0:
        raise DataError(f"target accuracy must be in [0.5, 1], got {target_accuracy}")
    offset = _most_accurate_cut(sims, truth)
    scale = _max_likelihood_scale(sims - offset, truth)
    p = sigmoid(scale * (sims - offset)).astype(np.float32).astype(np.float64)
    certainty = np.maximum(p, 1.0 - p)
    correct = (p > 0.5) == truth
    threshold, resolved_acc = _smallest_threshold(certainty, correct, target_accuracy,
                                                  max(1, math.ceil(min_resolved_fraction * n)))
    escalated = certainty < threshold
    if threshold == DEFAULT_THRESHOLD and math.isnan(resolved_acc):
        kept = ~escalated
        resolved_acc = float(correct[kept].mean()) if kept.any() else math.nan
    return FilterCalibration(
        scale=scale, offset=offset, threshold=threshold, use_llm=bool(escalated.any()),
        calibrated=True, num_rows=n, target_accuracy=target_accuracy,
        stage1_accuracy=float(correct.mean()), resolved_accuracy=resolved_acc,
        escalation_rate=float(escalated.mean()),
    )


def _most_accurate_cut(sims: np.ndarray, truth: np.ndarray) -> float:
    """The ``c`` maximising the accuracy of ``sims > c``; the middle one of equally good cuts."""
    order = np.argsort(sims, kind="stable")
    s, t = sims[order], truth[order]
    n = len(s)
    # cutting before sorted row k predicts false for rows < k and true for the rest
    false_below = np.concatenate([[0], np.cumsum(~t)])
    true_above = int(t.sum()) - np.concatenate([[0], np.cumsum(t)])
    accuracy = (false_below + true_above) / n
    possible = np.ones(n + 1, bool)
    possible[1:n] = s[:-1] < s[1:]  # equal similarities cannot be cut apart
    best = np.flatnonzero(possible & (accuracy >= accuracy[possible].max() - 1e-12))
    k = int(best[len(best) // 2])
    spread = max(float(s[-1] - s[0]), 1e-3)
    if k == 0:
        return float(s[0] - 0.05 * spread)
    if k == n:
        return float(s[-1] + 0.05 * spread)
    return float((s[k - 1] + s[k]) / 2)


def _max_likelihood_scale(centred: np.ndarray, truth: np.ndarray) -> float:
    """Slope ``a >= 1`` maximising the likelihood of ``sigmoid(a * centred)``, L2-penalised."""
    from scipy.optimize import minimize_scalar

    sign = np.where(truth, 1.0, -1.0)
    n = len(centred)
    spread = float(centred.std()) or 1.0

    def loss(a: float) -> float:
        # mean log(1 + exp(-sign * a * x)) plus the penalty fit_logistic uses (l2 = 1 on the
        # standardised feature)
        return float(np.logaddexp(0.0, -sign * a * centred).mean() + 0.5 * (a * spread) ** 2 / n)

    # The lower bound keeps P(true) > 0.5 exactly where sim > offset even after rounding to
    # float32 (a slope of 1 is still nearly flat: |sim - offset| <= 1 means p in [0.27, 0.73]).
    result = minimize_scalar(loss, bounds=(1.0, 1000.0), method="bounded",
                             options={"xatol": 1e-4})
    return float(result.x)


def _smallest_threshold(certainty: np.ndarray, correct: np.ndarray, target: float,
                        min_resolved: int) -> tuple[float, float]:
    """Smallest threshold whose resolved rows reach ``target`` accuracy (or the default)."""
    order = np.argsort(-certainty, kind="stable")  # most certain first
    c = certainty[order]
    hits = np.cumsum(correct[order])
    n = len(c)
    # keeping the k most certain rows is a real threshold only where c[k-1] > c[k]
    for k in range(n, min_resolved - 1, -1):
        if k < n and not c[k - 1] > c[k]:
            continue
        accuracy = hits[k - 1] / k
        if accuracy >= target:
            threshold = 0.0 if k == n else float((c[k - 1] + c[k]) / 2)
            return threshold, float(accuracy)
    return DEFAULT_THRESHOLD, math.nan


LLMModel = YesNoLLMModel | ChannelLLMModel


def calibrate_filter(similarity_model: SimilarityModel, sample: FilterSample,
                     llm: LLMModel | None = None,
                     target_accuracy: float = DEFAULT_TARGET_ACCURACY, llm_rows: int = 64,
                     batch_size: int = 32) -> FilterCalibration:
    """Calibrate a predicate on a labelled sample; decide whether the LLM stage earns its cost.

    Fits the similarity sigmoid and the threshold (:func:`fit_similarity_calibration`). Then,
    if ``llm`` is given and rows escalate, runs it on up to ``llm_rows`` escalated sample rows
    and keeps the LLM stage only if it is more accurate there than stage 1 (on ties stage 1
    wins: it is 10-20x cheaper).
    """
    sims = similarity_model.similarity(sample.texts, batch_size)
    calibration = fit_similarity_calibration(sims, sample.truth, target_accuracy)
    if llm is None or not calibration.use_llm:
        return replace(calibration, use_llm=False)
    p = sigmoid(calibration.scale * (sims - calibration.offset)).astype(np.float32)
    certainty = np.maximum(p, 1.0 - p)
    up = np.flatnonzero(certainty < calibration.threshold)[:llm_rows]
    truth = sample.truth[up]
    llm_pred = llm.predict([sample.texts[i] for i in up], batch_size=8).labels == 1
    llm_acc = float((llm_pred == truth).mean())
    stage1_acc = float(((p[up] > 0.5) == truth).mean())
    return replace(calibration, use_llm=llm_acc > stage1_acc, llm_rows=len(up),
                   llm_accuracy=llm_acc, stage1_escalated_accuracy=stage1_acc)


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
    from ken.models import family

    train, test = (ctx.data or family.default_data()).splits()
    negative = train.label_names.index("negative")
    rows = min(EVAL_CALIBRATION_ROWS, len(train))
    calibration = FilterSample(train.texts[:rows],
                               tuple(int(v) == negative for v in train.labels[:rows]))
    sample = EvalSample(f"{test.name}-negative", test.texts,
                        tuple(int(v) == negative for v in test.labels), "balanced_accuracy")
    return calibration, sample


def load_filter_stage(kind: str, predicate: str, scale: float, offset: float,
                      home: Path | None, device: DeviceConfig) -> Model:
    """One sem_filter stage for a worker process (picklable via ``functools.partial``):
    ``kind`` is an encoder name (similarity stage) or ``"channel"``."""
    resources = Resources(device, home)
    if kind == "channel":
        return ChannelLLMModel(resources.causal_lm("smollm2-135m"), predicate)
    return SimilarityModel(resources.encoder(kind), predicate, scale, offset, encoder=kind)


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


def store_entries(home: Path) -> list[store.Entry]:
    """Every trained sem_filter in ``home``."""
    return [trained_entry(home, path.stem)
            for path in sorted((home / "trained" / "sem_filter").glob("*.json"))
            if not path.name.startswith(".")]


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
        if options:
            raise KenError(f"sem_filter training takes predicate=... only, not "
                           f"{', '.join(options)}")
        if not predicate or not predicate.strip():
            raise KenError("training sem_filter needs the predicate the labels answer, e.g. "
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

    def _stages(self, ctx: OpContext) -> list[tuple[str, float, float]]:
        """(kind, scale, offset) of each candidate: both similarity encoders, calibrated on
        the calibration rows, and the channel LLM stage."""
        def fit() -> list[tuple[str, float, float]]:
            calibration, _sample = tweets_filter_sample(ctx)
            out = []
            for encoder in ("minilm-l3", "minilm-l6"):
                probe = SimilarityModel(shared_resources(ctx).encoder(encoder), EVAL_PREDICATE,
                                        encoder=encoder)
                fitted = fit_similarity_calibration(probe.similarity(calibration.texts),
                                                    calibration.truth)
                out.append((encoder, fitted.scale, fitted.offset))
            return [*out, ("channel", CHANNEL_SCALE, CHANNEL_OFFSET)]

        return ctx.resource("sem-filter-eval-stages", fit)

    def candidates(self, ctx: OpContext, device: DeviceConfig) -> Mapping[str, Model]:
        resources = shared_resources(ctx)
        models: dict[str, Model] = {}
        for kind, scale, offset in self._stages(ctx):
            if kind == "channel":
                model: Model = ChannelLLMModel(resources.causal_lm("smollm2-135m", device),
                                               EVAL_PREDICATE)
            else:
                model = SimilarityModel(resources.encoder(kind, device), EVAL_PREDICATE, scale,
                                        offset, encoder=kind)
            models[model.name] = model
        return models

    def loaders(self, ctx: OpContext, device: DeviceConfig
                ) -> Mapping[str, Callable[[], Model]]:
        names = list(self.candidates(ctx, ctx.device))
        return {name: functools.partial(load_filter_stage, kind, EVAL_PREDICATE, scale, offset,
                                        ctx.home, device)
                for name, (kind, scale, offset) in zip(names, self._stages(ctx), strict=True)}


OPERATOR = SemFilter
