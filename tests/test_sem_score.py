"""``sem_score(text, 'rubric') -> DOUBLE`` (issue 35, item 3): the scale read from the rubric,
the closeness metric its evaluation sample is measured with, and through SQL a DOUBLE inside the
scale that is the expected point of the model's distribution for the row (NULL for NULL or
blank text), a clear error for a bad rubric, and (with Qwen) an obviously positive text above an
obviously negative one.

The SQL test runs the packaged SmolLM2-135M alone (``op.llms = ("smollm2-135m",)``); the Qwen
test is skipped, saying how to fetch it, where Qwen2.5-Coder-0.5B is absent."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pytest
from conftest import REFERENCE_DEVICE, SMALL_FAMILY
from test_easy_rows import QWEN, qwen_home  # found before ``home`` moves KEN_HOME

import ken
from ken.errors import DataError, KenError
from ken.models.llm import ScoreModel, end_of_turn_id, scale_certainty
from ken.models.model import DeviceConfig
from ken.models.quality import EvalSample, scale_closeness
from ken.models.resources import Resources
from ken.ops.base import OpContext
from ken.ops.prompts import SEM_SCORE
from ken.ops.sem_score import EVAL_RUBRIC, MAX_POINTS, SemScore, parse_scale

RUBRIC = "How positive is the text? 1 = very negative, 5 = very positive"
TEXTS = ["I absolutely love this phone, best purchase ever!", None,
         "This is the worst movie I have ever seen, total waste of money.", "   ",
         "The meeting is at 3 pm in room 12.",
         "I absolutely love this phone, best purchase ever!"]


@pytest.mark.parametrize(("rubric", "scale"), [
    ("How positive is the review?", (1, 5)),
    ("How much does the review praise the acting? 1 = not at all, 5 = very much", (1, 5)),
    (EVAL_RUBRIC, (1, 5)),
    ("How funny is it, on a scale of 1 to 10?", (1, 10)),
    ("Rate the plot (0-10)", (0, 10)),
    ("Rate the plot 1–7", (1, 7)),  # en dash
    ("Rate the plot 1 — 4", (1, 4)),  # em dash, spaced
    ("Score it from 1 to 10", (1, 10)),
    ("How clear is it? (1-7)", (1, 7)),
    ("Use a 1-10 scale", (1, 10)),
    ("Rate it between 0 and 3", (0, 3)),
    ("Rate it 1..4", (1, 4)),
    ("1-2 = poor, 3 = fair, 4-5 = good", (1, 5)),  # sub-ranges of one scale
    ("0: none\n10: lots", (0, 10)),  # anchors alone
    ("Score 0: useless, 6: perfect", (0, 6)),
    ("On a scale of 1 to 5 (1 = bad), how good?", (1, 5)),
    # numbers that are not scales
    ("Does the review from 2019 praise the acting?", (1, 5)),
    ("Is the review of the 2019 to 2021 season positive?", (1, 5)),
    ("Was the flight on 2020-01-05 late?", (1, 5)),
    ("Was the 3:30-4:30 slot busy?", (1, 5)),
    ("Was the stay 1.5-2 hours?", (1, 5)),
    ("Was the price $1-5 or more?", (1, 5)),
    ("Did prices rise 10-20%?", (1, 5)),
    ("Does it mention COVID-19?", (1, 5)),
    ("Step 7: rate how positive it is", (1, 5)),
    ("How helpful is it? Rate 1-5. Step 2: be strict", (1, 5)),
    ("Did the team that won 3-1 play well?", (1, 5)),  # a score line, not a scale
    ("Is the cast of 2-3 actors convincing?", (1, 5)),
    ("Does it name 1-2 causes?", (1, 5)),
    ("How good is it, 0-10?", (0, 10)),  # a bare range that reads as a scale
    ("Score it 1 to 7", (1, 7)),
    ("Graded from 2 to 6, how clear is it?", (2, 6)),
])
def test_the_scale_is_read_from_the_rubric(rubric: str, scale: tuple[int, int]) -> None:
    assert parse_scale(rubric) == scale


@pytest.mark.parametrize(("rubric", "message"), [
    ("", "needs a rubric"), ("   \n", "needs a rubric"), (None, "needs a rubric"),
    ("Rate it 5 to 1", "runs backwards"), ("Rate it (10-0)", "runs backwards"),
    ("Rate it 3-3", "one point"), ("scale of -1 to 1", "start at 0"),
    ("on a scale of 1 to 100", "at most 11 points"), ("Rate it 0-11", "12 points"),
    ("on a scale of 1 to 5, where 7 = perfect", "outside it"),
])
def test_bad_scales_are_clear_errors(rubric: object, message: str) -> None:
    with pytest.raises(DataError, match=message):
        parse_scale(rubric)


def test_the_widest_scale_has_eleven_points() -> None:
    assert parse_scale("scale of 0 to 10") == (0, 10) and MAX_POINTS == 11
    assert parse_scale("scale of 5 to 15") == (5, 15)


def test_scale_closeness_against_a_hand_computation() -> None:
    values = [5.0, 1.0, 3.5, None, 4.0, 9.0, float("nan")]
    refs = [5, 5, 3, 1, 1, 1, 3]
    # 1 - |v - r| / 4, clipped to [0, 1]; no value is 0
    expected = [1.0, 0.0, 1 - 0.5 / 4, 0.0, 1 - 3 / 4, 0.0, 0.0]
    assert scale_closeness(values, refs) == pytest.approx(expected)
    sample = EvalSample("s", ("a", "b"), (1, 5), "scale_closeness")
    assert sample.quality([2.0, 4.0]).tolist() == [0.75, 0.75]


def test_certainty_is_how_concentrated_the_distribution_is() -> None:
    points = np.arange(1.0, 6.0)
    assert scale_certainty(np.array([0, 0, 0, 1.0, 0]), points) == pytest.approx(1.0)
    assert scale_certainty(np.array([0.5, 0, 0, 0, 0.5]), points) == pytest.approx(0.0)
    # mass split between neighbours: a dependable mean, unlike a split between the ends
    assert scale_certainty(np.array([0, 0, 0, 0.5, 0.5]), points) == pytest.approx(0.75)
    uniform = scale_certainty(np.full(5, 0.2), points)
    assert uniform == pytest.approx(1 - np.sqrt(2) / 2)


def test_stages_are_named_per_rubric_and_scale_and_pickle(tmp_path) -> None:
    op = SemScore()
    ctx = OpContext(DeviceConfig(), home=tmp_path)
    assert op.signature() == "sem_score(text, 'rubric') -> DOUBLE"
    assert op.plannable() and "closeness" in op.eval_description()
    name = op.stage_name(QWEN, (RUBRIC,))
    assert name.startswith("score-qwen05[") and name == op.stage_name(QWEN, (f"  {RUBRIC} ",))
    others = {op.stage_name(QWEN, (r,)) for r in (
        RUBRIC, "How negative is the text?", "How positive is the text? (0-10)",
        "How positive is the text? (1-7)")}
    assert len(others) == 4  # profiles and plans of different rubrics never mix
    loaders = op.loaders(ctx, DeviceConfig(threads=1))
    assert all(callable(pickle.loads(pickle.dumps(f))) for f in loaders.values())
    assert "scale 0 to 10" in op.detail(("Rate it (0-10)",))
    with pytest.raises(DataError, match="runs backwards"):
        op.stage_name(QWEN, ("Rate it 5 to 1",))


def test_the_evaluation_sample_scores_sentiment_on_one_to_five() -> None:
    sample = SemScore().eval_sample(OpContext(data=SMALL_FAMILY))
    assert sample.metric == "scale_closeness" and set(sample.references) == {1, 3, 5}
    assert SemScore.eval_constants == (EVAL_RUBRIC,) and parse_scale(EVAL_RUBRIC) == (1, 5)


@pytest.mark.models
def test_sem_score_in_sql(home) -> None:  # noqa: ANN001
    # fp32: the test holds SQL's batched values to row-by-row ones
    s = ken.connect(device=REFERENCE_DEVICE, data=SMALL_FAMILY, home=home)
    try:
        s.operators["sem_score"].llms = ("smollm2-135m",)
        s.register_table("t", pa.table({"id": list(range(len(TEXTS))), "x": TEXTS,
                                        "g": ["a", "a", "b", "b", "b", "a"]}))
        table = s.sql(f"SELECT id, sem_score(x, '{RUBRIC}') AS s FROM t ORDER BY id").arrow()
        assert str(table.schema.field("s").type) == "double"
        got = table["s"].to_pylist()
        assert got[1] is None and got[3] is None  # NULL and blank text: NULL
        assert got[0] == got[5]
        live = [0, 2, 4]
        assert all(1.0 <= got[i] <= 5.0 for i in live)
        # differential: each value is sum(p_i * v_i) of the model's distribution for its row
        bound = s.bind("sem_score", (RUBRIC,))
        model = bound.models[bound.cascade.models[0]]
        assert isinstance(model, ScoreModel) and model.points.tolist() == [1, 2, 3, 4, 5]
        for i in live:
            p = model.score_distribution([TEXTS[i]])[0]
            assert p.sum() == pytest.approx(1.0)
            assert got[i] == pytest.approx(float(np.dot(p, [1, 2, 3, 4, 5])), abs=1e-4)
        # an aggregate over groups
        means = dict(s.sql(f"SELECT g, AVG(sem_score(x, '{RUBRIC}')) FROM t GROUP BY g"
                           ).fetchall())
        assert means["a"] == pytest.approx(got[0], abs=1e-4)
        assert means["b"] == pytest.approx((got[2] + got[4]) / 2, abs=1e-4)
        text = s.explain(f"SELECT sem_score(x, '{RUBRIC}') FROM t")
        assert "scale 1 to 5" in text and SEM_SCORE.key in text
        for bad, message in (("Rate it 5 to 1", "runs backwards"), ("  ", "needs a rubric"),
                             ("on a scale of 1 to 100", "at most 11 points")):
            with pytest.raises(KenError, match=message):
                s.sql(f"SELECT sem_score(x, '{bad}') FROM t")
    finally:
        s.close()


@pytest.mark.models
def test_a_scale_of_zero_to_ten_scores_whole_answers(home) -> None:  # noqa: ANN001
    """"10" is the tokens "1", "0": every point is scored up to the end of the turn, so "1"
    does not also collect the probability of "10"."""
    lm = Resources(REFERENCE_DEVICE, home=home).causal_lm("smollm2-135m")
    prompt = SEM_SCORE.with_constants({"rubric": "How positive? (0-10)", "lo": "0", "hi": "10"})
    model = ScoreModel(lm, (0, 10), prompt, "score-test", "test", SEM_SCORE.key)
    end = end_of_turn_id(lm)
    assert all(ids[-1] == end for ids in model.option_ids)
    assert model.option_ids[10][:-1] == lm.tokenizer.encode("10", add_special_tokens=False)
    out = model.predict([TEXTS[0], None])
    assert 0.0 <= out.values[0] <= 10.0 and out.values[1] is None
    assert 0.0 <= out.scores[0] <= 1.0 and out.scores[1] == 1.0
    # a 1-5 scale has no point whose tokens begin another's: the digits alone
    five = ScoreModel(lm, (1, 5), SEM_SCORE.with_constants(
        {"rubric": RUBRIC, "lo": "1", "hi": "5"}), "score-five", "test", SEM_SCORE.key)
    assert all(len(ids) == 1 for ids in five.option_ids)


@pytest.mark.models
def test_an_obviously_positive_text_scores_higher_with_qwen(home, monkeypatch) -> None:  # noqa: ANN001
    s = ken.connect(device=REFERENCE_DEVICE, home=qwen_home(home, monkeypatch))
    try:
        assert s.operators["sem_score"].llms == (QWEN,)  # the default
        s.register_table("r", pa.table({"id": [0, 1], "x": [
            "What a wonderful film, I loved every minute, the best movie of the year!",
            "Awful. The worst film I have ever seen, a total waste of money and time."]}))
        (positive,), (negative,) = s.sql(
            "SELECT sem_score(x, 'How positive is the review?') FROM r ORDER BY id").fetchall()
        assert 1.0 <= negative < positive <= 5.0
    finally:
        s.close()
