"""``sem_join(left, right, 'predicate') -> BOOLEAN``: is a predicate true of a pair of texts
(or records), by an LLM. Written where a join condition goes:

    SELECT m.title, r.review FROM movies m JOIN reviews r
        ON sem_join(m.plot, r.review, 'the review discusses the plot')

Each pair is asked as one yes/no question (prompt ``sem_join/v1``: text A, text B, the
statement), scored by option likelihood and calibrated against content-free inputs like
``sem_filter``'s ``choice-qwen`` stage (:class:`PairChoiceModel`); ``P(true)`` is the
calibrated probability of "yes". Arguments are texts, structs or whole rows (a record is shown
to the model as ``name: value; ...``, without ``id`` columns). A pair with a NULL side is
NULL. By default Qwen2.5-Coder-0.5B answers alone (``llms``; SmolLM2-135M is near chance on
yes/no questions, ``ken/ops/sem_filter.py``).

How a join runs is the query's plan, not the operator's (``ken/sql/join.py``): every pair
(the nested loop), the pairs that embedding similarity puts in each left row's top few
(blocking, with the recall it loses estimated on a sample), or, when the predicate compares one
property of each side, one call per row of each side (:func:`side_rewrite`: "both ...",
"neither ...", "the same <property>", "different / opposite <property>"), trusted only when it
agrees with the pair question on a sample of pairs.

Evaluation sample (for planning): pairs of the family's held-out tweets with the predicate
:data:`EVAL_PREDICATE`, true when both tweets are labelled positive, balanced accuracy.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ken import store
from ken.errors import DataError, KenError, StoreError
from ken.models import family
from ken.models.model import DeviceConfig, Model, Output, Prediction
from ken.models.quality import EvalSample
from ken.models.records import PLAIN, as_record, check_pairs
from ken.models.resources import CausalLM, Resources, normalise_rows, short_hash, sigmoid
from ken.ops.base import OpContext, Stage, shared_resources
from ken.ops.filter_models import ChoiceFilterModel
from ken.ops.join_training import (
    HEAD_FOLDS,
    HEAD_PENALTIES,
    JoinFit,
    fit_join,
    head_log_odds,
    log_odds,
)
from ken.ops.llm_operator import LLMOperator, stage_prefix
from ken.ops.prompts import SEM_CHOICE, SEM_FILTER_CHOICE, SEM_JOIN
from ken.ops.sem_choice import load_choice_stage
from ken.ops.training import Trained, TrainingData, check_predicate_option
from ken.paths import ken_home

FAMILY = "sem-join"
#: how a query may run its pairs (``ken/sql/join.py``)
PLANS = ("auto", "nested", "blocking", "rewrite")
#: the settings a session may change (``SET sem_join_<name> = ...``): type and range
OPTIONS = {"plan": (str, None, None), "block_size": (int, 1, 1000),
           "nested_max": (int, 0, 10**9), "check_pairs": (int, 2, 10_000),
           "check_agreement": (float, 0.0, 1.0), "recall_target": (float, 0.0, 1.0)}
EVAL_PREDICATE = "both texts express a positive opinion"
#: labelled pairs training needs at least
MIN_TRAIN_PAIRS = 10
#: pairs in the evaluation sample (half of them true)
EVAL_PAIRS = 200
#: properties compared per side without options in the predicate, and their values
KNOWN_PROPERTIES = {"sentiment": ("positive", "negative"), "opinion": ("positive", "negative"),
                    "polarity": ("positive", "negative"), "tone": ("positive", "negative")}


_RETRAIN = "run the same session.train('sem_join', ...) / TRAIN sem_join again"


def trained_entry(home: Path | None, key: str) -> store.Entry:
    """The store entry of a sem_join trained on a user's pairs: its fit, one JSON file in
    ``KEN_HOME/trained/sem_join``."""
    return store.Entry((home or ken_home()) / "trained" / "sem_join",
                       f"the sem_join trained on {key[:16]}", _RETRAIN,
                       files=(f"{key[:16]}.json",))


def check_predicate(predicate: object) -> str:
    """The predicate, one line; DataError unless it has words."""
    text = " ".join(str(predicate).split()).rstrip("?.! ") if isinstance(predicate, str) else ""
    if not text:
        raise DataError("sem_join needs a predicate about the two texts, e.g. "
                        "sem_join(l.review, r.review, 'both reviews praise the acting'); "
                        f"got {predicate!r}")
    return text


def side_text(value: object) -> str | None:
    """One side of a pair as the model reads it: a text as itself, a record (a JSON object, a
    struct or row from SQL) as ``name: value; ...`` without its ``id`` columns."""
    if value is None:
        return None
    record = as_record(value)
    if list(record) == [PLAIN]:
        return record[PLAIN]
    return "; ".join(f"{k}: {v}" for k, v in record.items() if v)


class PairChoiceModel(ChoiceFilterModel):
    """``P(true)`` of the predicate for a pair: "yes" against "no" as the answer to the prompt
    ``sem_join/v1``, scored as ``sem_filter``'s yes/no choice is (calibrated against
    content-free inputs); each side is shown as :func:`side_text` makes it."""

    def __init__(self, lm: CausalLM, predicate: str, name: str) -> None:
        super().__init__(lm, predicate, name=name, prompt=SEM_JOIN, family=FAMILY, num_inputs=2)

    def predict(self, texts: Sequence, batch_size: int = 8) -> Prediction:
        rows = [(side_text(a), side_text(b)) for a, b in check_pairs(self.name, texts)]
        return super().predict(rows, batch_size)


def two_way(model: Model, texts: Sequence, batch_size: int = 8) -> np.ndarray:
    """A two-answer model's probabilities, ``(rows, 2)``: a classifier's (``Prediction``),
    or a two-option choice model's calibrated option distribution (NaN rows: no prompt)."""
    if hasattr(model, "option_probabilities"):  # ChoiceModel: its Output has no distribution
        probs = np.asarray(model.option_probabilities(list(texts), batch_size), np.float64)
    else:
        out = model.predict(list(texts), batch_size)
        if not isinstance(out, Prediction):
            raise DataError(f"{model.name} gives no probabilities to move a boundary in")
        probs = out.probabilities.astype(np.float64)
    if probs.ndim != 2 or probs.shape[1] != 2:
        raise DataError(f"{model.name} answers {probs.shape[-1]} ways; a trained sem_join "
                        "boundary needs two (yes/no, or a property with two values)")
    return probs


class ShiftedModel(Model):
    """A two-answer model with its boundary moved to ``offset`` on the log-odds of column
    ``yes`` (a threshold fitted on labelled pairs, ``ken.ops.join_training``): a yes/no
    classifier (``Prediction`` out) or a two-option choice model (``Output`` out, its values
    the options, its certainty as ``ChoiceModel`` gives it); rows the inner model leaves
    undecided (NaN) stay undecided."""

    def __init__(self, inner: Model, offset: float, yes: int, name: str) -> None:
        self.inner, self.offset, self.yes = inner, float(offset), yes
        self.device = inner.device
        fingerprint = inner.spec.fingerprint and f"{inner.spec.fingerprint}~{self.offset:.6g}"
        self.spec = replace(inner.spec, name=name, fingerprint=fingerprint)

    def yes_log_odds(self, texts: Sequence, p: np.ndarray, batch_size: int) -> np.ndarray:
        """The log-odds of yes of rows the inner model decided, from its P(yes) ``p``."""
        return log_odds(p)

    def predict(self, texts: Sequence, batch_size: int = 8) -> Prediction | Output:
        probs = two_way(self.inner, texts, batch_size)
        p = probs[:, self.yes]
        live = ~np.isnan(p)
        x = self.yes_log_odds([t for t, ok in zip(texts, live, strict=True) if ok], p[live],
                              batch_size)
        probs[live, self.yes] = sigmoid(x - self.offset)
        probs[live, 1 - self.yes] = 1.0 - probs[live, self.yes]
        best = np.where(live, np.nan_to_num(probs).argmax(axis=1), 0).astype(np.int64)
        options = getattr(self.inner, "options", None)
        if options is None:
            undecided = np.full(2, 0.5)
            probs[~live] = undecided
            return Prediction(best, probs.astype(np.float32), self.spec.labels)
        values = [options[b] if ok else None for b, ok in zip(best, live, strict=True)]
        certainty = np.where(live, 2.0 * np.nan_to_num(probs).max(axis=1) - 1.0, 1.0)
        return Output(values, certainty)


def side_features(body: object, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
    """Each side's sentence embedding as a per-side head reads it, in training and serving:
    ``body.features`` (an encoder's mean-pooled features), rows scaled to unit length."""
    features = body.features(list(texts), batch_size)  # type: ignore[attr-defined]
    return normalise_rows(np.asarray(features, dtype=np.float64))


class HeadModel(ShiftedModel):
    """A per-side model whose yes log-odds are a trained head over the inner model's log-odds
    and the side's sentence embedding (``ken.ops.join_training.head_log_odds``), with its
    boundary at ``offset``."""

    def __init__(self, inner: Model, offset: float, yes: int, name: str, body: object,
                 encoder: str, params: Sequence[float]) -> None:
        super().__init__(inner, offset, yes, name)
        self.body, self.params = body, np.asarray(params, dtype=np.float64)
        fingerprint = self.spec.fingerprint and \
            f"{self.spec.fingerprint}~{encoder}-{short_hash(tuple(self.params.round(8)))}"
        self.spec = replace(self.spec, fingerprint=fingerprint)

    def yes_log_odds(self, texts: Sequence, p: np.ndarray, batch_size: int) -> np.ndarray:
        if len(p) == 0:
            return np.zeros(0)
        return head_log_odds(self.params, log_odds(p), side_features(self.body, texts,
                                                                     batch_size))


def load_pair_stage(resources: Resources, device: DeviceConfig, name: str, lm_name: str,
                    predicate: str, offset: float | None = None) -> Model:
    """The pair question; with ``offset``, its boundary as trained on labelled pairs."""
    if offset is None:
        return PairChoiceModel(resources.causal_lm(lm_name, device), predicate, name)
    inner = PairChoiceModel(resources.causal_lm(lm_name, device), predicate, f"{name}~raw")
    return ShiftedModel(inner, offset, 1, name)


# ------------------------------------------------------------------- the per-side rewrite

_NEGATION = re.compile(r"\b(?:not|no|never|none|nor|without)\b|n't\b")
_SIDES = (r"(?:(?:the\s+)?(?:two\s+)?(?:texts?|reviews?|sides?|items?|rows?|records?|"
          r"documents?|sentences?|comments?|posts?|messages?|tweets?|them|a\s+and\s+b)\s+)?")
_BOTH = re.compile(rf"^(?P<which>both|each)\s+(?:of\s+)?{_SIDES}(?P<rest>\S.*)$")
_NEITHER = re.compile(rf"^neither\s+(?:of\s+)?{_SIDES}(?P<rest>\S.*)$")
_SAME = re.compile(r"^(?P<lead>(?:[a-z]+\s+){0,5}?)(?:the\s+)?same\s+(?P<prop>[a-z][a-z ]*)$")
_DIFFERENT = re.compile(r"^(?P<lead>(?:[a-z]+\s+){0,5}?)(?:(?P<kind>opposite|different|"
                        r"contrasting)\s+(?P<prop>[a-z][a-z ]*)|differ\s+in\s+(?:their\s+)?"
                        r"(?P<prop2>[a-z][a-z ]*))$")
_OPTIONS = re.compile(r"\s*\((?P<options>[^()]*\|[^()]*)\)\s*$")
#: a verb after "both ..." in its third person singular, for the per-side statement
_BE = {"are": "is", "were": "was", "have": "has", "do": "does"}


def _singular(verb: str) -> str:
    if verb in _BE:
        return _BE[verb]
    if re.search(r"(?:s|sh|ch|x|z|o)$", verb):
        return verb + "es"
    if re.search(r"[^aeiou]y$", verb):
        return verb[:-1] + "ies"
    return verb + "s"


@dataclass(frozen=True)
class SideRewrite:
    """A predicate that compares one property of each side, as one question per side:
    ``both`` / ``neither`` (``statement`` true of both / of neither side) or ``same`` /
    ``different`` / ``opposite`` (``prop``, one of ``options`` per side)."""

    kind: str
    statement: str = ""
    prop: str = ""
    options: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind in ("both", "neither"):
            return f"{self.kind} sides: {self.statement!r}"
        return f"{self.kind} {self.prop} of each side, one of {'|'.join(self.options)}"

    def combine(self, left: object, right: object) -> bool | None:
        """The pair's value from the two sides' values (NULL when either side has none)."""
        if left is None or right is None:
            return None
        if self.kind == "both":
            return left == "true" and right == "true"
        if self.kind == "neither":
            return left == "false" and right == "false"
        if self.kind == "same":
            return left == right
        return left != right  # different; opposite (two options)


def side_rewrite(predicate: str) -> tuple[SideRewrite | None, str]:
    """The per-side form of ``predicate``, or None and why there is none.

    >>> side_rewrite("both reviews praise the acting")[0].statement
    'the text praises the acting'
    >>> side_rewrite("they express the same sentiment")[0].options
    ('positive', 'negative')
    """
    original = check_predicate(predicate)
    text = original.lower()
    if _NEGATION.search(re.sub(r"^neither\b", "", text)):
        return None, "the predicate has a negation, which a per-side rewrite could misread"
    for pattern, kind in ((_BOTH, "both"), (_NEITHER, "neither")):
        match = pattern.match(text)
        if match:
            verb, _, rest = match.group("rest").partition(" ")
            if kind == "neither" or match.group("which") == "both":  # "both are": plural
                verb = _BE.get(verb, verb) if kind == "neither" else _singular(verb)
            statement = f"the text {verb} {rest}".strip()
            return SideRewrite(kind, statement=statement), ""
    options: tuple[str, ...] = ()
    found = _OPTIONS.search(original)  # the values as the user wrote them
    if found:
        options = tuple(dict.fromkeys(o.strip() for o in found.group("options").split("|")
                                      if o.strip()))
        text = text[:found.start()]
    match = _SAME.match(text)
    kind, prop = ("same", match.group("prop").strip()) if match else ("", "")
    if not match:
        match = _DIFFERENT.match(text)
        if match:
            kind = match.group("kind") or "different"
            kind = "different" if kind == "contrasting" else kind
            prop = (match.group("prop") or match.group("prop2")).strip()
    if not kind:
        return None, ("the predicate does not compare one property of each side (a per-side "
                      "rewrite needs 'both ...', 'neither ...', 'the same <property>' or "
                      "'different / opposite <property>')")
    if not options:
        word = prop.split()[-1]
        options = KNOWN_PROPERTIES.get(word) or KNOWN_PROPERTIES.get(word.removesuffix("s"), ())
    if len(options) < 2:
        return None, (f"the values of {prop!r} are not known; name them to compare per side, "
                      f"e.g. '{kind} {prop} (a|b|c)'")
    if kind == "opposite" and len(options) != 2:
        return None, f"'opposite {prop}' needs exactly two values, not {'|'.join(options)}"
    return SideRewrite(kind, prop=prop, options=options), ""


def load_side_stage(resources: Resources, device: DeviceConfig, name: str, lm_name: str,
                    rewrite: SideRewrite, offset: float | None = None,
                    head: tuple[str, tuple[float, ...]] | None = None) -> Model:
    """The per-side model of ``rewrite``: the statement as ``sem_filter``'s yes/no choice, or
    the property's values as ``sem_choice``'s options; with ``offset``, the boundary between
    yes and no (or the first and second of two values) as trained on labelled pairs; with
    ``head`` (an encoder and its weights), that boundary on a trained head over the LM's
    log-odds and the side's embedding."""
    inner_name = name if offset is None else f"{name}~raw"
    if rewrite.kind in ("both", "neither"):
        model: Model = ChoiceFilterModel(resources.causal_lm(lm_name, device),
                                         rewrite.statement, lm_name, inner_name)
        yes = 1
    else:
        model = load_choice_stage(resources, device, inner_name, lm_name, rewrite.options)
        yes = 0
    if offset is None:
        return model
    if head is None:
        return ShiftedModel(model, offset, yes, name)
    encoder, params = head
    return HeadModel(model, offset, yes, name, resources.encoder(encoder, device), encoder,
                     params)


def side_scores(model: Model, texts: Sequence[str], kind: str) -> np.ndarray:
    """P(yes) of each text from a per-side model of a ``kind`` rewrite (P of the first of
    two values for same / different / opposite), as training fits it."""
    column = 1 if kind in ("both", "neither") else 0
    return np.nan_to_num(two_way(model, texts)[:, column], nan=0.5)


class SemJoin(LLMOperator):
    name = "sem_join"
    num_columns = 2
    constants = ("predicate",)
    output_type = "boolean"
    record_columns = True
    doc = ("whether a predicate holds of a pair of texts or records (LLM-scored); plans: "
           "nested loop, embedding blocking, per-side rewrite")
    llms = ("qwen2.5-coder-0.5b",)
    eval_constants = (EVAL_PREDICATE,)
    #: how a query runs its pairs: "auto" (the optimizer chooses), "nested", "blocking" or
    #: "rewrite" (``ken/sql/join.py``)
    plan = "auto"
    #: blocking: the right rows each left row is paired with (by embedding similarity)
    block_size = 5
    #: "auto" runs every pair when there are at most this many
    nested_max = 400
    #: pairs the per-side rewrite is checked on, and the share that must agree
    check_pairs = 32
    check_agreement = 0.95
    #: blocking: estimated recall below which "auto" does not block (it runs every pair)
    recall_target = 0.9
    #: encoders whose embeddings training may add to the per-side questions (a head chosen
    #: by cross-validation, ``ken.ops.join_training``); empty: a threshold only
    side_encoders: tuple[str, ...] = ("minilm-l3", "minilm-l6")

    def set_option(self, name: str, value: str | None) -> object:
        """Set one of :data:`OPTIONS` from its SQL text (``SET sem_join_plan = 'blocking'``),
        or restore its default with None; returns the value now in force. DataError for a bad
        name or value (nothing changes)."""
        if name not in OPTIONS:
            raise DataError(f"sem_join has no setting {name!r}; its settings are "
                            f"{', '.join('sem_join_' + o for o in OPTIONS)}")
        if value is None:
            self.__dict__.pop(name, None)  # the class default
            return getattr(self, name)
        kind, low, high = OPTIONS[name]
        try:
            parsed = kind(value.strip().lower())
        except ValueError:
            parsed = None
        if kind is str and parsed not in PLANS:
            raise DataError(f"sem_join_plan must be one of {', '.join(PLANS)}, not {value!r}")
        if kind is not str and (parsed is None or not low <= parsed <= high):
            what = "an integer" if kind is int else "a number"
            raise DataError(f"sem_join_{name} must be {what} from {low} to {high}, not "
                            f"{value!r}")
        setattr(self, name, parsed)
        return parsed

    def __init__(self) -> None:
        #: (predicate, LM) -> (the fit, what trained it), set by train()
        self.trained: dict[tuple[str, str], tuple[JoinFit, Trained]] = {}

    def fit_for(self, predicate: str, lm_name: str) -> JoinFit | None:
        """The fit trained for this predicate on this LM, if any."""
        found = self._trained_for(predicate, lm_name)
        return found[0] if found else None

    def trusted_fit(self, predicate: str) -> JoinFit | None:
        """The fit of ``predicate`` on the pairs' LM when its rewrite is trusted unchecked."""
        fit = self.fit_for(predicate, self.llms[-1])
        return fit if fit is not None and fit.trust_rewrite and \
            fit.side_offset is not None else None

    def _trained_for(self, predicate: str, lm_name: str) -> tuple[JoinFit, Trained] | None:
        trained = getattr(self, "trained", {})  # a subclass may not call __init__
        return trained.get((check_predicate(predicate), lm_name))

    def llm_stage(self, lm_name: str, constants: tuple[str, ...]) -> Stage:
        predicate = check_predicate(constants[0])
        fit = self.fit_for(predicate, lm_name)
        return self.pair_stage(lm_name, predicate, fit.pair_offset if fit else None)

    def pair_stage(self, lm_name: str, predicate: str, offset: float | None = None) -> Stage:
        """The pair question on ``lm_name``; with ``offset``, its trained boundary."""
        name = f"{stage_prefix(self.name, lm_name)}[{short_hash(SEM_JOIN.key, predicate)}]"
        if offset is None:
            return Stage(name, load_pair_stage, (name, lm_name, predicate))
        name = f"{name}~t{short_hash(repr(offset))}"
        return Stage(name, load_pair_stage, (name, lm_name, predicate, offset))

    def side_stage(self, rewrite: SideRewrite, predicate: str | None = None,
                   lm_name: str | None = None) -> Stage:
        """The per-side model of ``rewrite`` on ``lm_name`` (default: the cascade's last LM,
        the one whose pair answers the rewrite is checked against), with the side threshold
        trained for ``predicate`` when there is one."""
        lm_name = lm_name or self.llms[-1]
        fit = self.fit_for(predicate, lm_name) if predicate is not None else None
        if fit is None or fit.side_offset is None:
            return self.side_stage_on(rewrite, lm_name)
        head = None if fit.side_head is None else (fit.side_encoder or "", fit.side_head)
        return self.side_stage_on(rewrite, lm_name, fit.side_offset, head)

    def side_stage_on(self, rewrite: SideRewrite, lm_name: str, offset: float | None = None,
                      head: tuple[str, tuple[float, ...]] | None = None) -> Stage:
        """The per-side model of ``rewrite`` on ``lm_name``; with ``offset``, its trained
        boundary, on a trained ``head`` (encoder, weights) when given."""
        key = (SEM_FILTER_CHOICE.key if rewrite.kind in ("both", "neither") else SEM_CHOICE.key)
        name = (f"{stage_prefix('join_side', lm_name)}"
                f"[{short_hash(key, rewrite.kind, rewrite.statement, rewrite.options)}]")
        if offset is None:
            return Stage(name, load_side_stage, (name, lm_name, rewrite))
        name = f"{name}~t{short_hash(repr(offset))}"
        if head is None:
            return Stage(name, load_side_stage, (name, lm_name, rewrite, offset))
        name = f"{name}~{head[0]}-{short_hash(head[1])}"
        return Stage(name, load_side_stage, (name, lm_name, rewrite, offset, head))

    def embed_sides(self, resources: Resources, device: DeviceConfig, encoder: str,
                    texts: Sequence[str]) -> np.ndarray:
        """Each text's sentence embedding by ``encoder`` (unit rows), as a per-side head
        reads it."""
        return side_features(resources.encoder(encoder, device), texts)

    def binding_key(self) -> tuple:
        return (*super().binding_key(), self.plan, self.block_size, self.nested_max,
                self.check_pairs, self.check_agreement, self.recall_target,
                self.side_encoders,
                tuple(sorted((k, v[0].pair_offset, v[0].side_offset, v[0].side_head)
                             for k, v in getattr(self, "trained", {}).items())))

    def train(self, ctx: OpContext, data: TrainingData, *, predicate: str = "",
              **options: object) -> Trained:
        """Learn where ``sem_join(left, right, predicate)`` says yes from pairs labelled
        true/false (two text columns, left then right): the pair question's threshold, and
        the per-side rewrite's when the predicate has one with at most two values
        (``ken.ops.join_training``), fitted on four fifths of the pairs and scored on the
        rest; the rewrite's per-side questions may gain a head over each side's embedding by
        one of :attr:`side_encoders`, when cross-validation on those pairs prefers it.
        Trained for the last LM of ``llms`` (the one that answers pairs). A rewrite at least
        as accurate as the pair question on the held-out pairs is trusted: queries run it
        without the agreement check. Cached by the rows' hash, the predicate, the LM and the
        encoders."""
        check_predicate_option(self.name, options, predicate,
                               "session.train('sem_join', 'pairs', label='both_positive', "
                               "predicate='both reviews are positive')")
        if len(data.columns) != 2:
            raise KenError(f"sem_join trains on pairs: two text columns (left, right); "
                           f"{data.source} gives {len(data.columns)} "
                           f"({', '.join(data.columns)}); name them with columns=[...] / "
                           "USING left, right")
        self.check_llms(ctx)
        normal = check_predicate(predicate)
        lm_name = self.llms[-1]
        truth = data.booleans()
        prompts = (f"{SEM_JOIN.key}|{SEM_FILTER_CHOICE.key}|{SEM_CHOICE.key}|"
                   f"{','.join(self.side_encoders)}|{HEAD_PENALTIES}|{HEAD_FOLDS}")
        key = hashlib.sha256(f"{data.content_hash}|{normal}|{lm_name}|{prompts}".encode()
                             ).hexdigest()
        entry = trained_entry(ctx.home, key)
        fit = None
        if entry.main.exists():
            try:  # a damaged entry is trained again from the rows at hand
                store.ensure(entry)
                fit = JoinFit.from_dict(json.loads(entry.main.read_text())["fit"])
            except (StoreError, DataError, OSError, ValueError, KeyError, TypeError) as exc:
                ctx.reporter.note(f"{exc}\n  -> training sem_join again")
                fit = None
        if fit is None:
            fit = self._fit(ctx, data, normal, lm_name, truth)
            with store.store_lock(ctx.home or ken_home(), f"training sem_join on "
                                  f"{data.source}", ctx.reporter.note):
                store.write_text(entry.main, json.dumps({"fit": fit.to_dict(),
                                                         "data": data.describe()}))
                store.seal(entry)
        trained = Trained(self.name, data.describe(), data.content_hash, fit.describe(),
                          str(entry.main))
        self.trained[(normal, lm_name)] = (fit, trained)
        return trained

    def _fit(self, ctx: OpContext, data: TrainingData, predicate: str, lm_name: str,
             truth: np.ndarray) -> JoinFit:
        fit, held = data.split((0.8, 0.2))
        if len(data) < MIN_TRAIN_PAIRS or len(held) == 0 or truth.all() or not truth.any():
            raise DataError(f"{data.source}: {len(data)} pairs are too few to train and "
                            f"validate sem_join (at least {MIN_TRAIN_PAIRS}, with both labels)")
        resources = shared_resources(ctx)
        left, right = (list(c) for c in data.texts)
        ctx.reporter.note(f"training sem_join on {len(data)} labelled pairs ({lm_name}): the "
                          "pair question on every pair")
        pair = self.pair_stage(lm_name, predicate).build(resources, ctx.device)
        pair_p = np.nan_to_num(two_way(pair, list(zip(left, right, strict=True)))[:, 1],
                               nan=0.5)
        rewrite, _ = side_rewrite(predicate)
        side = None
        features: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if rewrite is not None and (rewrite.kind in ("both", "neither") or
                                    len(rewrite.options) == 2):
            values = sorted(set(left) | set(right))
            ctx.reporter.note(f"training sem_join: the per-side question on {len(values)} "
                              "distinct texts")
            model = self.side_stage_on(rewrite, lm_name).build(resources, ctx.device)
            shown = [side_text(v) or "" for v in values]
            p = dict(zip(values, side_scores(model, shown, rewrite.kind), strict=True))
            side = (rewrite.kind, np.array([p[v] for v in left]),
                    np.array([p[v] for v in right]))
            at = {v: i for i, v in enumerate(values)}
            li, ri = [at[v] for v in left], [at[v] for v in right]
            reused = len(left) + len(right) - len(values)
            if self.side_encoders and reused > 0.1 * (len(left) + len(right)):
                ctx.reporter.note(
                    f"sem_join: {reused} of the {len(left) + len(right)} sides repeat a text "
                    "of another pair; the pairs are split for validation by pair, so a "
                    "per-side head can learn those texts and its validation scores read "
                    "high. Labelled pairs of distinct texts validate it honestly.")
            for encoder in self.side_encoders:
                ctx.reporter.note(f"training sem_join: {encoder} embeddings of the "
                                  f"{len(values)} texts, for a per-side head")
                e = self.embed_sides(resources, ctx.device, encoder, shown)
                features[encoder] = (e[li], e[ri])
        return fit_join(lm_name, pair_p, truth, fit, held, side,
                        rewrite.describe() if side is not None else "", features)

    def store_entries(self, home: Path) -> list[tuple[str, store.Entry]]:
        """Every trained sem_join in ``home``."""
        return [("trained sem_join", trained_entry(home, path.stem))
                for path in sorted((home / "trained" / "sem_join").glob("*.json"))
                if not path.name.startswith(".")]

    def detail(self, constants: tuple[str, ...]) -> str:
        text = f"pairs asked yes/no by likelihood; {SEM_JOIN.describe_truncation()}"
        found = self._trained_for(constants[0], self.llms[-1])
        return f"{text}; {found[1].describe()}" if found else text

    def eval_sample(self, ctx: OpContext) -> EvalSample:
        sample = family.heldout_sample(ctx.data or family.default_data())
        names = [sample.label_names[i] for i in sample.labels.tolist()]
        positive = [i for i, n in enumerate(names) if n == "positive"]
        rng = np.random.default_rng(0)
        pairs, truth = [], []
        for k in range(EVAL_PAIRS):
            if k % 2 == 0 and len(positive) >= 2:
                a, b = rng.choice(positive, 2, replace=False)
            else:
                a, b = rng.choice(len(names), 2, replace=False)
            pairs.append((sample.texts[a], sample.texts[b]))
            truth.append(names[a] == "positive" and names[b] == "positive")
        return EvalSample(f"{sample.name}-pairs", tuple(pairs), tuple(truth),
                          "balanced_accuracy")

    def plannable(self) -> bool:
        return True

    def eval_description(self) -> str:
        return (f"{EVAL_PAIRS} pairs of the family's held-out tweets, {EVAL_PREDICATE!r}, "
                "balanced accuracy")


OPERATOR = SemJoin
