"""Official-style scoring of MultiModalQA and HybridQA answers: exact match (EM) and token F1.

Style ``mmqa`` follows ``baselines/evaluate.py`` of github.com/allenai/multimodalqa, itself
adapted from DROP's ``drop_eval.py`` (github.com/allenai/allennlp-reading-comprehension):

- Normalisation, token by token (tokens split at spaces and hyphens): lower case; punctuation
  removed unless the token is a number; numbers written as floats ("1976" -> "1976.0",
  "1,000" -> "1000.0") and so are single number words ("two" -> "2.0", via ``word2number``
  there; here only a whole token is a number word, where word2number also reads words
  inside a token holding a line break, "one\\ntwo" -> 3: no dev gold answer is affected);
  articles dropped. This is not :func:`ken.models.quality.normalise_answer` (the SQuAD rule):
  that one keeps hyphenated words whole and leaves numbers as they are.
- An answer is a list of spans (a plain string is a list of one), the prediction too; the
  whole ``answers`` list of a question is the one gold reference.
- EM is 1 when the sets of normalised spans are equal and the lists equally long: order does
  not matter, every gold span must be predicted and nothing else.
- F1 treats each span as a set of tokens and pairs predicted with gold spans one to one so that
  the summed span F1 is largest (Hungarian alignment, ``linear_sum_assignment``); a pair scores
  0 when the gold span holds numbers and the predicted span none of them. F1 is the summed
  score of the pairs over max(#gold, #predicted) spans, so missing and extra spans both count
  as 0, rounded to 2 decimals per question as the script does.

Style ``hybridqa`` follows ``evaluate_script.py`` of github.com/wenhuchen/HybridQA, the SQuAD
evaluation: SQuAD normalisation (``normalise_answer``), EM and multiset token F1 of the
predicted string against the best of the gold strings (HybridQA has one per question). A list
prediction is joined with ", " first.

In both styles a missing (``None``) or empty prediction scores 0, as a question without a
prediction does in the official scripts. :func:`summarise` reports percentages (x100), as
both scripts print them; :func:`score` returns fractions in [0, 1].
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
from scipy.optimize import linear_sum_assignment

from ken.errors import DataError
from ken.models.qa_data import OK, STATUSES, QAQuestion
from ken.models.quality import exact_match, token_f1

STYLES = ("mmqa", "hybridqa")
Prediction = str | Sequence[str] | None

_SPLIT = re.compile(r" |-")
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)
#: single number words as ``word2number`` reads them; a lone "point" is 0 there, so here too
_NUMBER_WORDS = {
    word: value for value, word in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen "
        "fourteen fifteen sixteen seventeen eighteen nineteen".split())
} | {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70,
     "eighty": 80, "ninety": 90, "hundred": 100, "thousand": 1000, "million": 1_000_000,
     "billion": 1_000_000_000, "point": 0}


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _normalise_token(token: str) -> str:
    token = token.lower()
    if not _is_number(token):
        token = "".join(ch for ch in token if ch not in _PUNCTUATION)
    if _is_number(token):
        token = str(float(token))
    elif token.strip() in _NUMBER_WORDS:
        token = str(float(_NUMBER_WORDS[token.strip()]))
    return " ".join(_ARTICLES.sub(" ", token).split())


def normalise_mmqa(text: str) -> str:
    """An answer span normalised as MultiModalQA's evaluation does (see the module docstring).

    >>> normalise_mmqa("The Jean-Paul Awards, 1,000 two")
    'jean paul awards 1000.0 2.0'
    """
    parts = (_normalise_token(token) for token in _SPLIT.split(text))
    return " ".join(part for part in parts if part.strip()).strip()


def _spans(answer: Sequence[str]) -> list[str]:
    return [normalise_mmqa(str(span)) for span in answer]


def _span_f1(predicted: frozenset[str], gold: frozenset[str]) -> float:
    common = len(predicted & gold)
    precision = common / len(predicted) if predicted else 1.0
    recall = common / len(gold) if gold else 1.0
    return 0.0 if precision == 0 and recall == 0 else 2 * precision * recall / (precision + recall)


def _numbers_agree(gold: frozenset[str], predicted: frozenset[str]) -> bool:
    """False when the gold span holds numbers and the predicted span none of them."""
    numbers = {token for token in gold if _is_number(token)}
    return not numbers or bool(numbers & predicted)


def _aligned_f1(predicted: list[str], gold: list[str]) -> float:
    """Best one-to-one pairing of predicted and gold spans, averaged over the longer list."""
    pred_bags = [frozenset(span.split()) for span in predicted]
    gold_bags = [frozenset(span.split()) for span in gold]
    scores = np.array([[_span_f1(p, g) if _numbers_agree(g, p) else 0.0 for p in pred_bags]
                       for g in gold_bags])
    rows, cols = linear_sum_assignment(scores, maximize=True)
    f1 = scores[rows, cols].sum() / max(len(gold_bags), len(pred_bags))
    return float(np.round(f1, 2))


def _mmqa_score(predicted: Sequence[str], gold: Sequence[str]) -> tuple[float, float]:
    pred, ref = _spans(predicted), _spans(gold)
    em = float(set(pred) == set(ref) and len(pred) == len(ref))
    return em, _aligned_f1(pred, ref)


def _hybridqa_score(predicted: Sequence[str], gold: Sequence[str]) -> tuple[float, float]:
    text = ", ".join(predicted)
    return float(exact_match([text], [list(gold)])[0]), float(token_f1([text], [list(gold)])[0])


def _as_spans(answer: Prediction) -> tuple[str, ...]:
    if answer is None:
        return ()
    if isinstance(answer, str):
        return (answer,)
    return tuple(str(span) for span in answer)


def _check_style(style: str) -> None:
    if style not in STYLES:
        raise DataError(f"unknown QA scoring style {style!r}; use one of: {', '.join(STYLES)}")


def score(predicted: Prediction, gold: Sequence[str] | str, *, style: str = "mmqa"
          ) -> tuple[float, float]:
    """``(EM, F1)`` of one prediction, each in [0, 1].

    ``mmqa``: ``gold`` is the list of spans of the one gold answer, ``predicted`` a string or a
    list of spans. ``hybridqa``: ``gold`` lists acceptable answer strings (the best counts).
    ``None`` or an empty prediction scores ``(0.0, 0.0)``.
    """
    _check_style(style)
    ref = _as_spans(gold)
    if not ref:
        raise DataError("a QA question without a gold answer cannot be scored; leave it out")
    pred = _as_spans(predicted)
    if not any(span.strip() for span in pred):
        return 0.0, 0.0
    return _mmqa_score(pred, ref) if style == "mmqa" else _hybridqa_score(pred, ref)


@dataclass(frozen=True)
class ScoreRow:
    """One question to score: its id, type, status, gold spans and the prediction (or None)."""

    qid: str
    qtype: str
    status: str
    gold: tuple[str, ...]
    predicted: str | tuple[str, ...] | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "gold", _as_spans(self.gold))
        if self.predicted is not None and not isinstance(self.predicted, str):
            object.__setattr__(self, "predicted", _as_spans(self.predicted))


def rows_for(questions: Iterable[QAQuestion], predictions: Mapping[str, Prediction]
             ) -> list[ScoreRow]:
    """Score rows for ``questions``; a question missing from ``predictions`` gets ``None``."""
    return [ScoreRow(q.qid, q.qtype, q.status, q.answers, predictions.get(q.qid))
            for q in questions]


@dataclass(frozen=True)
class TypeScore:
    """Mean EM and F1 (percent) of the scored questions of one type."""

    count: int
    em: float
    f1: float


@dataclass(frozen=True, eq=False)
class Summary:
    """Scores of a set of questions; EM and F1 in percent over the ``scored`` questions.

    ``statuses`` counts every row given by status, scored or not; ``scores`` holds each
    scored question's ``(EM, F1)`` as fractions. With nothing scored EM and F1 are 0.
    """

    style: str
    em: float
    f1: float
    scored: int
    by_type: Mapping[str, TypeScore] = field(repr=False)
    statuses: Mapping[str, int]
    scores: Mapping[str, tuple[float, float]] = field(repr=False)

    def standard_errors(self) -> tuple[float, float]:
        """Standard errors of EM and F1 (percent): each one's sample standard deviation over
        the scored questions divided by the square root of their number (0 below two)."""
        if len(self.scores) < 2:
            return 0.0, 0.0
        pairs = np.asarray(list(self.scores.values()), dtype=np.float64)
        se = pairs.std(axis=0, ddof=1) / np.sqrt(len(pairs))
        return 100.0 * float(se[0]), 100.0 * float(se[1])


def _means(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Mean EM and mean F1 of ``(EM, F1)`` pairs, in percent (0 for none)."""
    if not pairs:
        return 0.0, 0.0
    em, f1 = np.mean(np.asarray(pairs, dtype=np.float64), axis=0)
    return 100.0 * float(em), 100.0 * float(f1)


def summarise(rows: Iterable[ScoreRow], *, style: str = "mmqa", score_all: bool = False
              ) -> Summary:
    """Overall and per-type EM/F1 (percent) of the rows with status ``ok``, and the count of
    each status. With ``score_all`` every row is scored (image and missing-context questions
    too, usually with no prediction, so 0), as the official scripts score the whole split."""
    _check_style(style)
    rows = list(rows)
    statuses = dict.fromkeys(STATUSES, 0)
    scores: dict[str, tuple[float, float]] = {}
    by_type: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        statuses[row.status] = statuses.get(row.status, 0) + 1
        if row.status == OK or score_all:
            scores[row.qid] = pair = score(row.predicted, row.gold, style=style)
            by_type.setdefault(row.qtype, []).append(pair)
    everything = [pair for pairs in by_type.values() for pair in pairs]
    return Summary(style, *_means(everything), len(everything),
                   MappingProxyType({qtype: TypeScore(len(pairs), *_means(pairs))
                                     for qtype, pairs in sorted(by_type.items())}),
                   MappingProxyType(statuses), MappingProxyType(scores))
