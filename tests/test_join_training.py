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
from ken.models.resources import normalise_rows
from ken.ops.base import Stage
from ken.ops.join_training import (
    JoinFit,
    balanced,
    choose_side_head,
    combine,
    fit_join,
    fit_side_threshold,
    fit_threshold,
    head_log_odds,
    head_loss,
    log_odds,
)
from ken.ops.sem_join import HeadModel, SemJoin, ShiftedModel, SideRewrite, side_text

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
    headed = JoinFit("qwen", 1.5, -0.5, side_head=(1.0, 0.5, 2.0, -1.0),
                     side_encoder="minilm-l3", side_penalty=0.01, rewrite_threshold_only=0.75)
    back = JoinFit.from_dict(headed.to_dict())
    assert back == headed and back.side_head == (1.0, 0.5, 2.0, -1.0)
    assert "head over minilm-l3 embeddings (threshold alone 75.0%)" in back.describe()
    with pytest.raises(DataError, match="head"):
        JoinFit("qwen", 1.5, -0.5, side_head=(1.0, math.nan, 2.0), side_encoder="minilm-l3")
    with pytest.raises(DataError, match="head"):
        JoinFit("qwen", 1.5, None, side_head=(1.0, 0.0, 2.0), side_encoder="minilm-l3")
    with pytest.raises(DataError, match="does not read back"):
        JoinFit.from_dict({**headed.to_dict(), "unknown": 1})


@pytest.mark.parametrize("kind", ["both", "neither", "same", "different"])
def test_the_head_loss_gradient_matches_finite_differences(kind: str) -> None:
    rng = np.random.default_rng(3)
    n, d = 12, 3
    q = (rng.normal(size=n), rng.normal(size=n))
    e = (rng.normal(size=(n, d)), rng.normal(size=(n, d)))
    truth = rng.random(n) < 0.5
    params = rng.normal(size=d + 2)
    _, grad = head_loss(params, kind, q, e, truth, 0.05)
    for k in range(d + 2):
        step = np.zeros(d + 2)
        step[k] = 1e-6
        numeric = (head_loss(params + step, kind, q, e, truth, 0.05)[0] -
                   head_loss(params - step, kind, q, e, truth, 0.05)[0]) / 2e-6
        assert math.isclose(grad[k], numeric, rel_tol=1e-4, abs_tol=1e-7)


def _sides(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each side's hidden property (True/False) of ``n`` pairs."""
    rng = np.random.default_rng(seed)
    return rng.random(n) < 0.5, rng.random(n) < 0.5


@pytest.mark.parametrize("kind", ["both", "same"])
def test_a_head_learns_a_property_the_lm_cannot_see_from_the_pairs_labels(kind: str) -> None:
    left, right = _sides(120, 5)
    truth = combine(kind, left, right)
    rng = np.random.default_rng(6)
    # the LM's per-side P(yes) is noise; the first embedding dimension carries the property
    lm = (rng.uniform(0.3, 0.7, 120), rng.uniform(0.3, 0.7, 120))

    def embed(prop: np.ndarray) -> np.ndarray:
        return np.column_stack([np.where(prop, 1.0, -1.0), rng.normal(size=(len(prop), 3))])

    features = {"enc": (embed(left), embed(right))}
    fit = fit_join("lm", np.full(120, 0.5), truth, np.arange(96), np.arange(96, 120),
                   (kind, *lm), kind, features)
    assert fit.side_encoder == "enc" and fit.side_head is not None
    assert fit.rewrite_trained == 1.0 and fit.rewrite_threshold_only < 0.8
    assert fit.trust_rewrite
    # the fitted head says yes exactly for the sides that have the property (or, for
    # "same", exactly for those that do not: the labels cannot tell the two apart)
    x = head_log_odds(np.array(fit.side_head), log_odds(lm[0]), features["enc"][0])
    says = x >= fit.side_offset
    assert (says == left).all() or (kind == "same" and (says == ~left).all())


def test_noise_features_never_replace_a_perfect_lm() -> None:
    left, right = _sides(80, 7)
    truth = combine("both", left, right)
    rng = np.random.default_rng(8)
    lm = (np.where(left, 0.9, 0.6), np.where(right, 0.9, 0.6))
    noise = {"enc": (rng.normal(size=(80, 5)), rng.normal(size=(80, 5)))}
    choice = choose_side_head("both", (log_odds(lm[0]), log_odds(lm[1])), noise, truth)
    assert choice.encoder is None and choice.scores["none"] == 1.0
    fit = fit_join("lm", np.full(80, 0.5), truth, np.arange(60), np.arange(60, 80),
                   ("both", *lm), "both", noise)
    assert fit.side_head is None and fit.rewrite_trained == 1.0


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
        if self.role == "blind":
            return [0.9 for _ in texts]
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


def load_headed(resources, device, name: str, role: str, offset: float,  # noqa: ANN001
                head: tuple[str, tuple[float, ...]]) -> Model:
    inner = load_biased(resources, device, f"{name}~raw", role)
    yes = 0 if role == "choice" else 1
    return HeadModel(inner, offset, yes, name, WordBody(), head[0], head[1])


class WordBody:
    """A stand-in encoder: one feature, whether the text says "good"."""

    def features(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        return np.array([[1.0 if _good(t) else -1.0, 0.5] for t in texts])


class TrainableJoin(SemJoin):
    side_encoders = ("words",)
    #: the per-side question says the same for every text (it cannot see the property)
    blind_sides = False

    def embed_sides(self, resources, device, encoder: str, texts: Sequence[str]  # noqa: ANN001
                    ) -> np.ndarray:
        return normalise_rows(WordBody().features(texts)).astype(np.float64)

    def pair_stage(self, lm_name: str, predicate: str, offset: float | None = None) -> Stage:
        role = "pair-same" if "same" in predicate else "pair-both"
        name = role if offset is None else f"{role}~{offset:.4f}"
        return Stage(name, load_biased, (name, role, offset))

    def side_stage_on(self, rewrite: SideRewrite, lm_name: str, offset: float | None = None,
                      head: tuple[str, tuple[float, ...]] | None = None) -> Stage:
        role = "side" if rewrite.kind in ("both", "neither") else "choice"
        if self.blind_sides and role == "side":
            role = "blind"
        name = role if offset is None else f"{role}~{offset:.4f}"
        if head is not None:
            name = f"{name}~head"
            return Stage(name, load_headed, (name, role, offset, head))
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


@pytest.mark.models
def test_a_per_side_question_blind_to_the_property_is_rescued_by_a_head(session) -> None:  # noqa: ANN001
    s, a, b = session
    s.operators["sem_join"].blind_sides = True
    truth = {(i, j) for i, x in enumerate(a) for j, y in enumerate(b) if _good(x) and _good(y)}
    # another wording than the tests above, so that their fit is not read from the store
    predicate = "both of them are good"
    trained = s.train("sem_join", "labelled", label="both_good", columns=("l", "r"),
                      predicate=predicate)
    fit = s.operators["sem_join"].fit_for(predicate, "qwen2.5-coder-0.5b")
    assert fit is not None and fit.side_encoder == "words" and fit.trust_rewrite
    assert "per-side rewrite 100.0% trained with a head over words embeddings" in trained.quality
    after = s.sql(JOIN.replace("both are good", predicate))
    run = after.stats["join"][0]
    assert set(map(tuple, after.fetchall())) == truth and truth
    assert run.plan == "per-side rewrite" and run.pair_questions == 0
    assert run.side_questions == 30 + 25
    assert "with a head over words embeddings" in run.reason


class ScaledBody:
    """A stand-in encoder whose features are not unit rows: (length, 2)."""

    def features(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        return np.array([[float(len(t)), 2.0] for t in texts])


class SomeUndecided(BiasedChoice):
    """A two-option choice model that leaves empty texts undecided (NaN rows)."""

    def option_probabilities(self, texts: Sequence, batch_size: int = 16) -> np.ndarray:
        p = super().option_probabilities(texts, batch_size)
        p[[not t for t in texts]] = np.nan
        return p


def test_a_served_head_reads_the_features_training_read_and_skips_undecided_rows() -> None:
    texts = ["a good one", "", "bad", "quite good indeed", ""]
    params = (0.5, -0.2, 1.5, -3.0)
    model = HeadModel(SomeUndecided("side", "side"), 0.3, 0, "head", ScaledBody(), "enc",
                      params)
    out = model.predict(texts)
    live = [i for i, t in enumerate(texts) if t]
    assert [out.values[i] for i in range(len(texts)) if i not in live] == [None, None]

    class Resources:
        def encoder(self, name: str, device: object) -> ScaledBody:
            return ScaledBody()

    # training's features (SemJoin.embed_sides) are the ones the served head reads
    features = SemJoin().embed_sides(Resources(), DeviceConfig(), "enc", [texts[i] for i in live])
    assert np.allclose(np.linalg.norm(features, axis=1), 1.0)
    p = np.array([0.95 if _good(texts[i]) else 0.75 for i in live])
    x = head_log_odds(np.array(params), log_odds(p), features)
    want = np.where(1.0 / (1.0 + np.exp(-(x - 0.3))) >= 0.5, "good", "bad")
    assert [out.values[i] for i in live] == want.tolist()
    assert len(set(want.tolist())) == 2  # the head's features decide, not the LM alone
