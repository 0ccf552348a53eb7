"""``sem_score(text, 'rubric') -> DOUBLE``: a score for the text on the rubric's scale, by an LLM.

Each point of the scale (1 to 5 unless the rubric names another, :func:`parse_scale`) is scored
as the assistant's answer to the prompt ``sem_score/v1`` (``ken/ops/prompts.py``), which holds
the text (cut to 256 tokens, keeping its start), the rubric and the scale and asks for the
number only; nothing is parsed from generated text. The scores are calibrated against
content-free inputs like ``sem_choice``'s options (``ken.models.llm.ScoreModel``, a
``ChoiceModel`` over the points), and the value is the expected point under that
distribution: a DOUBLE inside the scale, so ``AVG(sem_score(...)) ... GROUP BY`` averages
graded judgements rather than rounded ones. NULL or blank text gives NULL. The certainty a
cascade escalates on is how concentrated the distribution is, ``1 - std / ((hi - lo) / 2)``.

By default Qwen2.5-Coder-0.5B answers alone (``llms``; fetched from PyPI on first use, 478
MB). On 60 rows of the evaluation sample (20 per class, 2 CPU threads) SmolLM2-135M's mean
closeness was 0.624, below a constant 3 (0.667 on balanced classes), and its values did not
follow the text (mean 3.43 / 3.44 / 3.36 on negative / neutral / positive rows, correlation
with the reference -0.21; 4.8 rows/s); Qwen's was 0.661, its values followed the text but
stayed near the middle of the scale (3.23 / 3.33 / 3.51, correlation 0.48; 1.9 rows/s; on the
same rows ``sem_choice`` with Qwen chose 40% right). So SmolLM2 is no useful first stage here,
as for ``sem_choice`` (``docs/results.md``, "sem_score"). Name other LMs with
``session.operators["sem_score"].llms``.

Evaluation sample (for planning): the family's held-out texts with the rubric
:data:`EVAL_RUBRIC` on a 1-5 scale, references 1 / 3 / 5 for negative / neutral / positive,
quality ``scale_closeness`` (``1 - |value - reference| / 4``, ``ken.models.quality``).

>>> # session.sql("SELECT movie, AVG(sem_score(review, 'How positive is the review?')) "
>>> #             "FROM reviews GROUP BY movie")
"""

from __future__ import annotations

import re

from ken.errors import DataError
from ken.models import family
from ken.models.llm import ScoreModel
from ken.models.model import DeviceConfig, Model
from ken.models.quality import EvalSample
from ken.models.resources import Resources, short_hash
from ken.ops.base import OpContext, Stage
from ken.ops.llm_operator import LLMOperator, stage_prefix
from ken.ops.prompts import SEM_SCORE

EVAL_RUBRIC = "How positive is the text? 1 = very negative, 3 = neutral, 5 = very positive"
#: the evaluation sample's reference score of each sentiment label
EVAL_REFERENCES = {"negative": 1, "neutral": 3, "positive": 5}
DEFAULT_SCALE = (1, 5)
#: the most points a scale may have (0 to 10): each point is one more scored answer per row
MAX_POINTS = 11

# A number that stands alone: not part of a word, a decimal, a date, a time, an amount or
# another range (so "2020-01-05", "3:30-4:30", "1.5-2", "$1-5", "COVID-19" are not scales).
_START = r"(?<![\w.,:/$€£\u2010-\u2014\u2212-])"
_END = r"(?![\w%]|[.,:/\u2010-\u2014\u2212-]\d)"
_DASH = r"[\u2010-\u2014\u2212-]"  # hyphen, non-breaking hyphen, figure/en/em dash, minus
_RANGE = re.compile(
    rf"{_START}(?P<lo>-?\d+)(?:\s*(?:{_DASH}|\.\.)\s*|\s+to\s+)(?P<hi>-?\d+){_END}"
    rf"|\bbetween\s+{_START}(?P<blo>-?\d+)\s+and\s+(?P<bhi>-?\d+){_END}", re.IGNORECASE)
#: "on a scale of", "scale from", "scale (": the range that follows names the scale
_SCALE_BEFORE = re.compile(r"\bscale\b[^.?!;\n\d]{0,25}$", re.IGNORECASE)
#: "1-10 scale", "1 to 7 point scale"
_SCALE_AFTER = re.compile(rf"^\s*(?:{_DASH}\s*)?(?:points?\s*)?scale\b", re.IGNORECASE)
#: anchors of the points: "1 = not at all"; "0: none" at the start of a line or list item
#: or after "score" / "point" / "rating" / "grade"
_ANCHORS = (re.compile(rf"{_START}(?P<n>\d+)\s*=\s*(?=[^\W\d_]|[\"'(])"),
            re.compile(r"(?:^|[\n,;(]|\b(?:score|point|rating|grade)s?\b)\s*(?P<n>\d+)\s*:\s*"
                       r"(?=[^\W\d_]|[\"'(])", re.IGNORECASE))
#: a range after "rate", "score", "grade" or "from" is meant as the scale ("Rate it 1-5"), as
#: is one that anchors a description ("1-2 = poor"); any other starts at 0 or 1 and spans 3
#: points or more to be read as one ("won 3-1", "2-3 actors" are not scales)
_RATE_BEFORE = re.compile(r"\b(?:rate[ds]?|rating|score[ds]?|grade[ds]?|from)\b[^.?!;\n\d]{0,20}$",
                          re.IGNORECASE)
_ANCHOR_AFTER = re.compile(r"\s*[=:]")
#: at most this many digits in a range that no "scale" names (years are not scale bounds)
_BARE_DIGITS = 3


def check_rubric(rubric: object) -> str:
    """The rubric, stripped; DataError unless it is a non-blank string."""
    if not isinstance(rubric, str) or not rubric.strip():
        raise DataError("sem_score needs a rubric: a non-empty string saying what to score, "
                        "e.g. sem_score(review, 'How positive is the review? 1 = very "
                        f"negative, 5 = very positive'); got {rubric!r}")
    return rubric.strip()


def _check_range(lo: int, hi: int, rubric: str) -> None:
    where = f"the rubric {rubric!r} names the scale {lo} to {hi}"
    if lo < 0 or hi < 0:
        raise DataError(f"sem_score: {where}; scales start at 0 or above (e.g. 'on a scale "
                        "of 0 to 10')")
    if lo > hi:
        raise DataError(f"sem_score: {where}, which runs backwards; write the low end "
                        f"first: 'on a scale of {hi} to {lo}'")
    if lo == hi:
        raise DataError(f"sem_score: {where}, which has one point; a scale needs at least "
                        "two, e.g. 'on a scale of 1 to 5'")


def parse_scale(rubric: object) -> tuple[int, int]:
    """The integer scale ``(lo, hi)`` a rubric names; ``(1, 5)`` when it names none.

    Read are ranges ("1-5", "1 to 5", "1–5", "from 1 to 10", "between 1 and 7", "on a scale of
    0 to 10", "(1-7)", "a 1-10 scale"; a range no rating word, "scale" or "=" marks must start at
    0 or 1 and span three points or more, so "won 3-1" and "2-3 actors" are not scales) and
    anchors of points ("1 = not at all, 5 = very
    much"; "0: none" at the start of a line or list item, or after "score", "point", "rating"
    or "grade"). A range after or before the word
    "scale", or alone in parentheses, is the scale (the first such). Otherwise the scale spans
    every range (of numbers of at most three digits, so "reviews from 2019 to 2021" is no
    scale) and, when there are two or more, every anchor: "1-2 = poor, 3 = fair, 4-5 = good"
    is 1 to 5. A number inside a word, date, time, decimal, amount or percentage is not read.

    DataError for a blank rubric; a range that runs backwards ("5 to 1"), has one point
    ("3-3") or goes below 0; a scale of more than :data:`MAX_POINTS` points; and anchors
    outside a scale the rubric names.

    >>> parse_scale("How positive is it, on a scale of 0 to 10?")
    (0, 10)
    >>> parse_scale("Does the review from 2019 praise the acting?")
    (1, 5)
    """
    text = check_rubric(rubric)
    named: tuple[int, int] | None = None
    bounds: list[int] = []
    for match in _RANGE.finditer(text):
        lo_text = match.group("lo") or match.group("blo")
        hi_text = match.group("hi") or match.group("bhi")
        lo, hi = int(lo_text), int(hi_text)
        parenthesised = (re.search(r"\(\s*$", text[:match.start()]) is not None
                         and re.match(r"\s*\)", text[match.end():]) is not None)
        scale = (parenthesised or _SCALE_BEFORE.search(text[:match.start()]) is not None
                 or _SCALE_AFTER.match(text[match.end():]) is not None)
        meant = (scale or _RATE_BEFORE.search(text[:match.start()]) is not None
                 or _ANCHOR_AFTER.match(text[match.end():]) is not None)
        if not scale and max(len(lo_text.lstrip("-")), len(hi_text.lstrip("-"))) > _BARE_DIGITS:
            continue
        if not meant and (lo > 1 or hi - lo < 2):
            continue  # a range of numbers, not a scale: "won 3-1", "2-3 actors"
        _check_range(lo, hi, text)
        if scale:
            named = (lo, hi)
            break
        bounds += [lo, hi]
    anchors = sorted({int(m.group("n")) for pattern in _ANCHORS for m in pattern.finditer(text)})
    if named is not None:
        outside = [a for a in anchors if not named[0] <= a <= named[1]]
        if outside:
            raise DataError(f"sem_score: the rubric {text!r} names the scale {named[0]} to "
                            f"{named[1]} but describes the point(s) {outside} outside it")
        lo, hi = named
    else:
        if len(anchors) >= 2:
            bounds += anchors
        if not bounds:
            return DEFAULT_SCALE
        lo, hi = min(bounds), max(bounds)
    if hi - lo + 1 > MAX_POINTS:
        raise DataError(f"sem_score: the rubric {text!r} names the scale {lo} to {hi} "
                        f"({hi - lo + 1} points); sem_score scores at most {MAX_POINTS} "
                        "points (e.g. 'on a scale of 0 to 10'): rescale the rubric")
    return lo, hi


def load_score_stage(resources: Resources, device: DeviceConfig, name: str, lm_name: str,
                     rubric: str, scale: tuple[int, int]) -> Model:
    prompt = SEM_SCORE.with_constants({"rubric": rubric, "lo": str(scale[0]),
                                       "hi": str(scale[1])})
    return ScoreModel(resources.causal_lm(lm_name, device), scale, prompt, name, "sem-score",
                      SEM_SCORE.key)


class SemScore(LLMOperator):
    name = "sem_score"
    num_columns = 1
    constants = ("rubric",)
    output_type = "double"
    doc = ("a score on the rubric's scale (1-5 unless it names one): the expected value "
           "under the LLM's calibrated distribution over the points")
    llms = ("qwen2.5-coder-0.5b",)
    eval_constants = (EVAL_RUBRIC,)

    def llm_stage(self, lm_name: str, constants: tuple[str, ...]) -> Stage:
        rubric = check_rubric(constants[0])
        scale = parse_scale(rubric)
        name = (f"{stage_prefix(self.name, lm_name)}"
                f"[{short_hash(SEM_SCORE.key, rubric, scale)}]")
        return Stage(name, load_score_stage, (name, lm_name, rubric, scale))

    def detail(self, constants: tuple[str, ...]) -> str:
        lo, hi = parse_scale(constants[0])
        return (f"scale {lo} to {hi}, the expected point under the calibrated scores; "
                f"{SEM_SCORE.describe_truncation()}")

    def eval_sample(self, ctx: OpContext) -> EvalSample:
        sample = family.heldout_sample(ctx.data or family.default_data())
        references = tuple(EVAL_REFERENCES[sample.label_names[i]]
                           for i in sample.labels.tolist())
        return EvalSample(f"{sample.name}-score", sample.texts, references, "scale_closeness")

    def plannable(self) -> bool:
        return True

    def eval_description(self) -> str:
        return (f"the rubric {EVAL_RUBRIC!r} on the family's held-out tweets (1 / 3 / 5 for "
                "negative / neutral / positive), closeness on the 1-5 scale")


OPERATOR = SemScore
