"""``sem_join(l, r, 'predicate')`` and its plans (issue 35, item 1): the per-side form of a
predicate; the rewrite, blocking and the nested loop against each other on the same pair model
(the rewrite equals the nested loop wherever its check accepts it; a rewrite the pair model
disagrees with is refused; blocking only ever drops pairs); EXPLAIN's plans with their pair
counts; clear errors; and the packaged SmolLM2 answering pairs through SQL.

The pair and per-side models here are deterministic stand-ins: a text is "good" when it says
so, and a pair's answer follows the rule each test names."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pytest
from conftest import REFERENCE_DEVICE, SMALL_FAMILY

import ken
from ken.errors import DataError, SqlError
from ken.models.model import BOOLEAN_LABELS, DeviceConfig, Model, ModelSpec, Prediction
from ken.ops.base import OpContext, Stage
from ken.ops.sem_join import EVAL_PREDICATE, SemJoin, SideRewrite, side_rewrite, side_text

MOODS = ("good", "bad")
TOPICS = ("food", "service", "music", "parking", "price", "decor")


def _mood(text: str) -> str:
    return "good" if " good " in f" {text} " else "bad"


class PairRule(Model):
    """A pair model: ``both`` — both texts are good; ``same`` — both good or both bad;
    ``topic`` — they share a topic word."""

    def __init__(self, name: str, rule: str) -> None:
        self.spec = ModelSpec(name, "fake", "fake", "", 10, 40, 64, BOOLEAN_LABELS,
                              f"fp-{name}", 2)
        self.device = DeviceConfig()
        self.rule = rule
        self.pairs: list[tuple[str, str]] = []

    def predict(self, texts: Sequence, batch_size: int = 32) -> Prediction:
        rows = [(side_text(a), side_text(b)) for a, b in texts]
        self.pairs += rows
        if self.rule == "both":
            truth = [_mood(a) == "good" and _mood(b) == "good" for a, b in rows]
        elif self.rule == "same":
            truth = [_mood(a) == _mood(b) for a, b in rows]
        else:
            truth = [bool(set(a.split()) & set(b.split()) & set(TOPICS)) for a, b in rows]
        p = np.array([[0.1, 0.9] if t else [0.9, 0.1] for t in truth], np.float32)
        return Prediction(p.argmax(axis=1), p, BOOLEAN_LABELS)


class SideRule(Model):
    """A per-side model: ``true`` / ``false`` (is the text good) for both / neither, the
    text's mood for same / different / opposite."""

    def __init__(self, name: str, kind: str) -> None:
        labels = BOOLEAN_LABELS if kind in ("both", "neither") else MOODS
        self.spec = ModelSpec(name, "fake", "fake", "", 10, 40, 64, labels, f"fp-{name}")
        self.device = DeviceConfig()
        self.kind = kind
        self.texts: list[str] = []

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        self.texts += list(texts)
        good = [_mood(t) == "good" for t in texts]
        if self.kind in ("both", "neither"):  # labels ("false", "true")
            p = np.array([[0.1, 0.9] if g else [0.9, 0.1] for g in good], np.float32)
        else:  # labels ("good", "bad")
            p = np.array([[0.9, 0.1] if g else [0.1, 0.9] for g in good], np.float32)
        return Prediction(p.argmax(axis=1), p, self.spec.labels)


MODELS: dict[str, Model] = {}  # the models a test's operator built, by name


def load_pair(resources, device, name: str, rule: str) -> Model:  # noqa: ANN001
    return MODELS.setdefault(name, PairRule(name, rule))


def load_side(resources, device, name: str, kind: str) -> Model:  # noqa: ANN001
    return MODELS.setdefault(name, SideRule(name, kind))


class FakeJoin(SemJoin):
    """sem_join on the stand-ins; ``rule`` is what the pair model answers."""

    rule = "both"

    def stages(self, ctx: OpContext, constants: tuple[str, ...]) -> list[Stage]:
        return [Stage(f"pair-{self.rule}", load_pair, (f"pair-{self.rule}", self.rule))]

    def side_stage(self, rewrite: SideRewrite, predicate: str | None = None,
                   lm_name: str | None = None) -> Stage:
        return Stage(f"side-{rewrite.kind}", load_side, (f"side-{rewrite.kind}", rewrite.kind))

    def binding_key(self) -> tuple:
        return (*super().binding_key(), self.rule)


def reviews(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    texts = [f"the {rng.choice(TOPICS)} was {rng.choice(MOODS)} and the "
             f"{rng.choice(TOPICS)} was fine number {i}" for i in range(n)]
    return pa.table({"id": list(range(n)), "text": texts})


@pytest.fixture
def session(home):  # noqa: ANN001
    MODELS.clear()
    s = ken.connect(device=DeviceConfig(threads=2), data=SMALL_FAMILY, home=home)
    s.register("sem_join", FakeJoin())
    s.register_table("a", reviews(30, 1))
    s.register_table("b", reviews(25, 2))
    yield s
    s.close()


JOIN = ("SELECT a.id AS l, b.id AS r FROM a JOIN b ON sem_join(a.text, b.text, '{p}') "
        "ORDER BY l, r")


def pairs(s: ken.Session, predicate: str) -> tuple[set[tuple[int, int]], dict]:
    result = s.sql(JOIN.format(p=predicate))
    return set(map(tuple, result.fetchall())), result.stats


@pytest.mark.parametrize(("predicate", "expected"), [
    ("both reviews praise the acting",
     SideRewrite("both", statement="the text praises the acting")),
    ("Both are positive.", SideRewrite("both", statement="the text is positive")),
    ("each review mentions food", SideRewrite("both", statement="the text mentions food")),
    ("both of them discuss the plot", SideRewrite("both", statement="the text discusses the plot")),
    ("neither is positive", SideRewrite("neither", statement="the text is positive")),
    ("they express the same sentiment",
     SideRewrite("same", prop="sentiment", options=("positive", "negative"))),
    ("the same topic (Sports|Politics|Tech)",
     SideRewrite("same", prop="topic", options=("Sports", "Politics", "Tech"))),
    ("they have opposite sentiments",
     SideRewrite("opposite", prop="sentiments", options=("positive", "negative"))),
    ("differ in sentiment", SideRewrite("different", prop="sentiment",
                                        options=("positive", "negative"))),
])
def test_predicates_that_compare_one_property_of_each_side(predicate, expected) -> None:  # noqa: ANN001
    assert side_rewrite(predicate) == (expected, "")


@pytest.mark.parametrize(("predicate", "why"), [
    ("the review discusses the plot of the movie", "does not compare one property"),
    ("both are not positive", "negation"),
    ("they are about the same topic", "values of 'topic' are not known"),
    ("opposite topic (a|b|c)", "exactly two values"),
])
def test_predicates_without_a_per_side_form_say_why(predicate, why) -> None:  # noqa: ANN001
    rewrite, reason = side_rewrite(predicate)
    assert rewrite is None and why in reason


def test_combining_the_two_sides() -> None:
    both = SideRewrite("both", statement="x")
    assert [both.combine(a, b) for a, b in (("true", "true"), ("true", "false"))] == [True, False]
    assert SideRewrite("neither", statement="x").combine("false", "false") is True
    same = SideRewrite("same", prop="p", options=("u", "v"))
    assert (same.combine("u", "u"), same.combine("u", "v"), same.combine(None, "u")) == \
        (True, False, None)
    assert SideRewrite("opposite", prop="p", options=("u", "v")).combine("u", "v") is True


def test_records_are_shown_without_their_ids() -> None:
    assert side_text('"plain text"') == "plain text"
    assert side_text('{"id": 3, "title": "Heat", "year": 1995}') == "title: Heat; year: 1995"
    assert side_text(None) is None


@pytest.mark.models
def test_the_rewrite_equals_the_nested_loop_where_its_check_accepts_it(session) -> None:  # noqa: ANN001
    op = session.operators["sem_join"]
    op.plan = "nested"
    nested, stats = pairs(session, "both are good")
    assert stats["join"][0].plan == "nested loop" and stats["join"][0].pair_questions == 30 * 25
    assert stats["join"][0].all_pairs == 750
    op.plan = "auto"  # 750 pairs > nested_max
    got, stats = pairs(session, "both are good")
    run = stats["join"][0]
    assert run.plan == "per-side rewrite" and got == nested and len(nested) > 0
    assert run.check_agreed == run.check_pairs == op.check_pairs
    assert run.side_questions == 30 + 25
    assert run.pair_questions == op.check_pairs  # the check's pairs, nothing else
    assert (30 * 25) / (run.side_questions + run.pair_questions) > 8
    # the check's sample holds pairs the rewrite calls true, not only the easy false ones
    assert sum(1 for a, b in MODELS["pair-both"].pairs[-op.check_pairs:]
               if _mood(a) == _mood(b) == "good") == op.check_pairs // 2


@pytest.mark.models
def test_a_same_property_rewrite_equals_the_nested_loop(session) -> None:  # noqa: ANN001
    op = session.operators["sem_join"]
    op.rule, op.plan = "same", "nested"
    nested, _ = pairs(session, "the same sentiment (good|bad)")
    op.plan = "auto"
    got, stats = pairs(session, "the same sentiment (good|bad)")
    assert stats["join"][0].plan == "per-side rewrite" and got == nested


@pytest.mark.models
def test_a_rewrite_the_pair_model_disagrees_with_is_refused(session) -> None:  # noqa: ANN001
    op = session.operators["sem_join"]
    op.rule = "topic"  # the pair model answers something else than "both are good"
    op.plan = "nested"
    nested, _ = pairs(session, "both are good")
    op.plan, op.recall_target = "auto", 1.01  # no blocking either: every pair
    got, stats = pairs(session, "both are good")
    run = stats["join"][0]
    assert run.check_pairs == op.check_pairs and run.check_agreed < run.check_pairs
    assert run.plan == "nested loop" and "check failed" in run.reason
    assert got == nested  # the check's answers are the pair model's, kept in the memo
    assert run.pair_questions == 30 * 25


@pytest.mark.models
def test_blocking_only_drops_pairs_and_asks_few(session) -> None:  # noqa: ANN001
    op = session.operators["sem_join"]
    op.rule = "topic"
    op.plan = "nested"
    nested, _ = pairs(session, "they talk about a common topic")
    op.plan = "blocking"
    got, stats = pairs(session, "they talk about a common topic")
    run = stats["join"][0]
    assert run.plan == "blocking" and got <= nested and got
    assert run.pair_questions <= 30 * op.block_size + run.recall_pairs
    assert run.recall is not None and 0.0 < run.recall <= 1.0
    assert run.recall_pairs <= 8 * 8 and run.shortcut_pairs > 0


@pytest.mark.models
def test_a_small_join_runs_every_pair(session) -> None:  # noqa: ANN001
    session.register_table("c", reviews(6, 3))
    result = session.sql("SELECT count(*) FROM a JOIN c ON a.id < 8 AND "
                         "sem_join(a.text, c.text, 'both are good')")
    run = result.stats["join"][0]
    # the one-side conjunct a.id < 8 limits the left values
    assert (run.plan, run.left_values, run.right_values) == ("nested loop", 8, 6)
    assert run.pair_questions == 48
    # a VALUES list with an alias is a side too
    result = session.sql("SELECT count(*) FROM a, (VALUES ('the food was good'), (NULL)) v(t) "
                         "WHERE a.id < 3 AND sem_join(a.text, v.t, 'both are good')")
    run = result.stats["join"][0]
    assert (run.left_values, run.right_values, run.pair_questions) == (3, 1, 3)


@pytest.mark.models
def test_explain_lists_the_plans_with_their_pair_counts(session) -> None:  # noqa: ANN001
    text = session.explain(JOIN.format(p="both are good"))
    assert "30 distinct a values x 25 distinct b values (750 pairs)" in text
    assert "nested loop: 750 pair questions" in text
    assert "blocking: 150 pair questions" in text
    assert "per-side rewrite (both sides: 'the text is good'): 55 per-side questions" in text
    analyzed = session.explain(JOIN.format(p="both are good"), analyze=True)
    assert "sem_join s0: per-side rewrite over 30 x 25 values" in analyzed
    assert "agreed with the pair model on 32 of 32" in analyzed
    text = session.explain(JOIN.format(p="the review is longer"))
    assert "per-side rewrite: not possible: the predicate does not compare" in text


@pytest.mark.models
def test_bad_arguments_are_clear_errors(session) -> None:  # noqa: ANN001
    with pytest.raises(SqlError, match="over one side only"):
        session.sql("SELECT * FROM a JOIN b ON sem_join(a.text, a.text, 'both are good')")
    op = session.operators["sem_join"]
    op.plan = "rewrite"
    with pytest.raises(SqlError, match="plan is 'rewrite', but the predicate does not"):
        pairs(session, "the first is longer than the second")
    op.plan = "fastest"
    with pytest.raises(SqlError, match="must be one of auto, nested, blocking, rewrite"):
        pairs(session, "both are good")
    op.plan = "auto"
    with pytest.raises(DataError, match="needs a predicate"):
        session.sql("SELECT * FROM a JOIN b ON sem_join(a.text, b.text, '  ')")


def test_the_plan_is_a_session_setting_in_sql() -> None:
    s = ken.connect()
    try:
        assert s.sql("SET sem_join_plan = 'blocking'").fetchall() == [("sem_join_plan",
                                                                       "blocking")]
        assert s.sql("set sem_join_block_size to 8").fetchall()[0][1] == "8"
        op = s.operators["sem_join"]
        assert (op.plan, op.block_size) == ("blocking", 8)
        s.sql("RESET sem_join_plan")
        assert op.plan == "auto"
        for bad, message in (("SET sem_join_plan = 'fast'", "one of auto, nested"),
                             ("SET sem_join_colour = 3", "no setting 'colour'"),
                             ("SET sem_join_recall_target = 2", "a number from 0.0 to 1.0"),
                             ("SET sem_join_plan", "needs a value")):
            with pytest.raises(SqlError, match=message):
                s.sql(bad)
        assert (op.plan, op.block_size, op.recall_target) == ("auto", 8, 0.9)
    finally:
        s.close()


def test_the_evaluation_sample_is_balanced_pairs() -> None:
    sample = SemJoin().eval_sample(OpContext(data=SMALL_FAMILY))
    assert sample.metric == "balanced_accuracy" and len(sample) == 200
    assert all(isinstance(x, tuple) and len(x) == 2 for x in sample.inputs)
    assert 0.4 <= np.mean(sample.references) <= 0.6
    assert SemJoin.eval_constants == (EVAL_PREDICATE,)


@pytest.mark.models
def test_smollm2_answers_pairs_through_sql(home) -> None:  # noqa: ANN001
    s = ken.connect(device=REFERENCE_DEVICE, data=SMALL_FAMILY, home=home)
    try:
        s.operators["sem_join"].llms = ("smollm2-135m",)
        s.register_table("m", pa.table({"id": [1, 2], "plot": ["A heist in Los Angeles.",
                                                               None]}))
        s.register_table("r", pa.table({"id": [7, 8, 9], "review": [
            "The heist scenes are great.", "I loved the songs.", "  "]}))
        table = s.sql("SELECT m.id AS movie, r.id AS review, sem_join(m.plot, r.review, "
                      "'the review talks about the plot') AS hit FROM m, r WHERE "
                      "sem_join(m.plot, r.review, 'the review talks about the plot') "
                      "OR true ORDER BY movie, review").arrow()
        hits = table["hit"].to_pylist()
        assert len(hits) == 6 and all(h is None for h in hits[3:])  # NULL plot: NULL
        assert all(isinstance(h, bool) for h in hits[:2])
        bound = s.bind("sem_join", ("the review talks about the plot",))
        assert "sem_join/v1" in bound.describe()
    finally:
        s.close()
