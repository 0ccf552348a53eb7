"""Training ``sem_join`` on labelled pairs (issue 35): the thresholds against brute force,
and a session trained on pairs whose pair and per-side questions say yes to everything (as
Qwen2.5-Coder-0.5B does on SST-2 pairs, docs/results.md) answering the labels afterwards.

The pair and per-side models are deterministic stand-ins with a boundary in the wrong
place: a text is "good" when it says so."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pytest
from conftest import SMALL_FAMILY
from hypothesis import given, settings
from hypothesis import strategies as st

import ken
from ken.errors import DataError, KenError
from ken.models.model import (
    BOOLEAN_LABELS,
    DeviceConfig,
    Model,
    ModelSpec,
    Output,
    Prediction,
)
from ken.ops.base import Stage
from ken.ops.join_training import (
    JoinFit,
    balanced,
    combine,
    fit_join,
    fit_side_threshold,
    fit_threshold,
    log_odds,
)
from ken.ops.sem_join import SemJoin, ShiftedModel, SideRewrite, side_text

TOPICS = ("food", "service", "music", "parking")


def _good(text: str) -> bool:
    return " good " in f" {text} "


def brute_balanced(pred: Sequence[bool], truth: Sequence[bool]) -> float:
    parts = []
    for cls in (True, False):
        rows = [p == t for p, t in zip(pred, truth, strict=True) if t == cls]
        if rows:
            parts.append(sum(rows) / len(rows))
    return sum(parts) / len(parts)


scores = st.lists(st.integers(-6, 6), min_size=2, max_size=14)


@settings(max_examples=150, deadline=None)
@given(scores, st.data())
def test_the_pair_threshold_is_the_best_of_every_threshold(xs, data) -> None:  # noqa: ANN001
    truth = data.draw(st.lists(st.booleans(), min_size=len(xs), max_size=len(xs)))
    x = np.array(xs, float) / 2
    t, best = fit_threshold(x, np.array(truth))
    grid = sorted(set(x.tolist())) + [x.max() + 1]  # yes iff x >= t: these are all the cuts
    brute = max(brute_balanced([v >= g for v in x], truth) for g in grid)
    assert math.isclose(best, brute) and math.isclose(brute_balanced(x >= t, truth), brute)


@settings(max_examples=150, deadline=None)
@given(scores, st.data(), st.sampled_from(["both", "neither", "same", "different"]))
def test_the_side_threshold_is_the_best_of_every_threshold(xs, data, kind) -> None:  # noqa: ANN001
    n = len(xs)
    right = data.draw(st.lists(st.integers(-6, 6), min_size=n, max_size=n))
    truth = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    xl, xr = np.array(xs, float), np.array(right, float)
    t, best = fit_side_threshold(kind, xl, xr, np.array(truth))
    grid = sorted(set(xl.tolist()) | set(xr.tolist())) + [max(xl.max(), xr.max()) + 1]
    rule = {"both": lambda a, b: a and b, "neither": lambda a, b: not a and not b,
            "same": lambda a, b: a == b, "different": lambda a, b: a != b}[kind]
    brute = max(brute_balanced([rule(a >= g, b >= g) for a, b in zip(xl, xr, strict=True)],
                               truth) for g in grid)
    assert math.isclose(best, brute)
    assert math.isclose(float(balanced(combine(kind, xl >= t, xr >= t), np.array(truth))[0]),
                        brute)


def test_a_fit_round_trips_and_refuses_what_it_cannot_use() -> None:
    fit = JoinFit("qwen", 1.5, -0.5, "both sides: 'x'", True, 40, 10, 0.5, 0.9, math.nan, 1.0)
    back = JoinFit.from_dict(fit.to_dict())
    assert back.pair_offset == 1.5 and back.side_offset == -0.5 and back.trust_rewrite
    assert math.isnan(back.rewrite_untrained) and back.rewrite_trained == 1.0
    with pytest.raises(DataError, match="schema"):
        JoinFit.from_dict({**fit.to_dict(), "schema_version": 0})
    with pytest.raises(DataError, match="finite"):
        JoinFit("qwen", math.inf)


def test_fitting_moves_a_boundary_that_says_yes_to_everything() -> None:
    truth = np.array([True, False] * 20)
    pair_p = np.where(truth, 0.97, 0.85)  # every pair "yes" before training
    fit = fit_join("lm", pair_p, truth, np.arange(30), np.arange(30, 40))
    assert fit.pair_untrained == 0.5 and fit.pair_trained == 1.0
    assert log_odds(np.array([0.85]))[0] < fit.pair_offset < log_odds(np.array([0.97]))[0]
    assert fit.side_offset is None and not fit.trust_rewrite


# ------------------------------------------------------------------------ the stand-ins

class Biased(Model):
    """P(yes) high for everything, higher where the answer is yes. ``role``: ``pair-both``
    (both texts good), ``pair-same`` (both good or both bad), ``side`` (the text is good)."""

    def __init__(self, name: str, role: str) -> None:
        self.spec = ModelSpec(name, "fake", "fake", "", 10, 40, 64, BOOLEAN_LABELS,
                              f"fp-{name}", 2 if role.startswith("pair") else 1)
        self.device = DeviceConfig()
        self.role = role
        self.rows = 0

    def p_yes(self, texts: Sequence) -> list[float]:
        self.rows += len(texts)
        if self.role == "side":
            return [0.95 if _good(t) else 0.75 for t in texts]
        moods = [(_good(side_text(a)), _good(side_text(b))) for a, b in texts]
        if self.role == "pair-same":
            return [0.97 if a == b else 0.85 for a, b in moods]
        return [0.97 if a and b else 0.9 if a or b else 0.8 for a, b in moods]

    def predict(self, texts: Sequence, batch_size: int = 32) -> Prediction:
        probs = np.array([[1 - v, v] for v in self.p_yes(texts)], np.float32)
        return Prediction(probs.argmax(axis=1), probs, BOOLEAN_LABELS)


class BiasedChoice(Biased):
    """A two-option choice model shaped as ``ChoiceModel``: ``option_probabilities`` and an
    ``Output`` of the options; "good" is likelier for every text, more so for good ones."""

    options = ("good", "bad")

    def option_probabilities(self, texts: Sequence, batch_size: int = 16) -> np.ndarray:
        return np.array([[v, 1 - v] for v in self.p_yes(texts)])

    def predict(self, texts: Sequence, batch_size: int = 32) -> Output:  # type: ignore[override]
        p = self.option_probabilities(texts)
        return Output([self.options[int(r.argmax())] for r in p], 2 * p.max(axis=1) - 1)


BUILT: dict[str, Biased] = {}


def load_biased(resources, device, name: str, role: str, offset: float | None = None  # noqa: ANN001
                ) -> Model:
    kind = BiasedChoice if role == "choice" else Biased
    inner = BUILT.setdefault(f"{name}:{role}", kind(name if offset is None else f"{name}~raw",
                                                    "side" if role == "choice" else role))
    yes = 0 if role == "choice" else 1
    return inner if offset is None else ShiftedModel(inner, offset, yes, name)


class TrainableJoin(SemJoin):
    def pair_stage(self, lm_name: str, predicate: str, offset: float | None = None) -> Stage:
        role = "pair-same" if "same" in predicate else "pair-both"
        name = role if offset is None else f"{role}~{offset:.4f}"
        return Stage(name, load_biased, (name, role, offset))

    def side_stage_on(self, rewrite: SideRewrite, lm_name: str,
                      offset: float | None = None) -> Stage:
        role = "side" if rewrite.kind in ("both", "neither") else "choice"
        name = role if offset is None else f"{role}~{offset:.4f}"
        return Stage(name, load_biased, (name, role, offset))


def reviews(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"the {rng.choice(TOPICS)} was {rng.choice(['good', 'bad'])} number {seed}-{i}"
            for i in range(n)]


@pytest.fixture
def session(home):  # noqa: ANN001
    BUILT.clear()
    s = ken.connect(device=DeviceConfig(threads=2), data=SMALL_FAMILY, home=home)
    s.register("sem_join", TrainableJoin())
    a, b = reviews(30, 1), reviews(25, 2)
    s.register_table("a", pa.table({"id": list(range(30)), "text": a}))
    s.register_table("b", pa.table({"id": list(range(25)), "text": b}))
    left, right = reviews(200, 3), reviews(200, 4)
    s.register_table("labelled", pa.table({
        "l": left, "r": right,
        "both_good": [_good(x) and _good(y) for x, y in zip(left, right, strict=True)],
        "same": [_good(x) == _good(y) for x, y in zip(left, right, strict=True)]}))
    yield s, a, b
    s.close()


JOIN = ("SELECT a.id, b.id FROM a JOIN b ON sem_join(a.text, b.text, 'both are good') "
        "ORDER BY 1, 2")


@pytest.mark.models
def test_training_makes_a_join_that_said_yes_to_every_pair_answer_the_labels(session) -> None:  # noqa: ANN001
    s, a, b = session
    truth = {(i, j) for i, x in enumerate(a) for j, y in enumerate(b) if _good(x) and _good(y)}
    before = s.sql(JOIN)
    assert len(before.fetchall()) == 30 * 25  # both questions say yes: the check agrees
    trained = s.train("sem_join", "labelled", label="both_good", columns=("l", "r"),
                      predicate="both are good")
    assert "per-side rewrite 100.0% trained" in trained.quality
    assert "trusted without a check" in trained.quality
    after = s.sql(JOIN)
    run = after.stats["join"][0]
    assert set(map(tuple, after.fetchall())) == truth and truth
    assert run.plan == "per-side rewrite" and run.check_pairs == 0
    assert run.pair_questions == 0 and "trained on labelled pairs" in run.reason
    explain = s.explain(JOIN)
    assert "chosen: per-side rewrite (trained on labelled pairs" in explain
    assert "trained on labelled (200 rows" in explain  # the operator's line names the rows
    # the pair question answers by its trained boundary too
    s.operators["sem_join"].plan = "nested"
    nested = s.sql(JOIN)
    assert set(map(tuple, nested.fetchall())) == truth


@pytest.mark.models
def test_training_again_on_the_same_pairs_is_cached_and_bad_input_is_clear(session) -> None:  # noqa: ANN001
    s, _, _ = session
    first = s.train("sem_join", "labelled", label="both_good", columns=("l", "r"),
                    predicate="both are good")
    asked = sum(m.rows for m in BUILT.values())
    again = s.sql("TRAIN sem_join ON labelled LABEL both_good USING l, r "
                  "FOR 'both are good'").fetchall()
    assert sum(m.rows for m in BUILT.values()) == asked  # nothing asked: read from the cache
    assert again[0][2] == first.quality
    with pytest.raises(KenError, match="two text columns"):
        s.train("sem_join", "labelled", label="both_good", columns=["l"],
                predicate="both are good")
    with pytest.raises(KenError, match="needs the predicate"):
        s.train("sem_join", "labelled", label="both_good", columns=("l", "r"))
    s.register_table("one_label", pa.table({"l": ["a good x"] * 12, "r": ["a good y"] * 12,
                                            "y": [True] * 12}))
    with pytest.raises(KenError, match="negative examples"):
        s.train("sem_join", "one_label", label="y", predicate="both are good")


@pytest.mark.models
def test_a_two_valued_property_trains_through_the_choice_model(session) -> None:  # noqa: ANN001
    s, a, b = session
    query = JOIN.replace("both are good", "the same mood (good|bad)")
    truth = {(i, j) for i, x in enumerate(a) for j, y in enumerate(b) if _good(x) == _good(y)}
    assert len(s.sql(query).fetchall()) == 30 * 25  # every text "good": every pair the same
    trained = s.train("sem_join", "labelled", label="same", columns=("l", "r"),
                      predicate="the same mood (good|bad)")
    assert "per-side rewrite 100.0% trained" in trained.quality
    after = s.sql(query)
    assert set(map(tuple, after.fetchall())) == truth
    assert after.stats["join"][0].plan == "per-side rewrite"


def test_a_rewrite_is_trusted_only_on_enough_held_out_pairs_of_each_label() -> None:
    truth = np.array([True, False] * 30)
    pair_p = np.where(truth, 0.9, 0.8)
    side = ("both", np.where(truth, 0.95, 0.6), np.full(60, 0.95))  # right side always yes
    enough = fit_join("lm", pair_p, truth, np.arange(40), np.arange(40, 60), side, "both")
    assert enough.rewrite_trained == 1.0 and enough.trust_rewrite  # 10 pairs of each label
    few = fit_join("lm", pair_p, truth, np.arange(40), np.arange(40, 48), side, "both")
    assert few.rewrite_trained == 1.0 and not few.trust_rewrite  # 4 of each: not enough
