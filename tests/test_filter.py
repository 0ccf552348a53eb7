"""sem_filter: calibration logic (fast, no weights) and the real models on small inputs.

The integration tests run MiniLM-L6 and SmolLM2-135M in a temporary KEN_HOME (SmolLM2 is
converted from its GGUF there once per session, ~30 s), so they never touch the user's cache.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from ken.engine.batch import run_cascade
from ken.errors import DataError, KenError, ModelError
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig
from ken.models.resources import Resources
from ken.ops.base import BoundSemantic
from ken.ops.filter_calibration import (
    FilterCalibration,
    FilterSample,
    calibrate_filter,
    fit_similarity_calibration,
)
from ken.ops.filter_models import (
    DEFAULT_THRESHOLD,
    ChannelLLMModel,
    SimilarityModel,
    YesNoLLMModel,
)
from ken.ops.sem_filter import bind_sem_filter

DELAY = "complains about a flight delay"
DELAYED = "I hate this airline, my flight was delayed for 5 hours"
BEACH = "what a lovely sunny day at the beach"

# A small synthetic labelled sample for the predicate "is about food".
FOOD = [
    "Best pizza I've ever had, the crust was perfect",
    "I cooked pasta with tomato sauce and basil tonight",
    "This burger place serves amazing fries",
    "Chocolate cake for dessert, what a treat",
    "The sushi was fresh and delicious",
    "We had pancakes with maple syrup for breakfast",
    "The curry at that new Indian restaurant is so spicy",
    "Baking bread at home takes a lot of patience",
    "This salad with goat cheese and walnuts is great",
    "The steak was overcooked and the soup was cold",
    "Homemade dumplings taste better than takeout",
    "I can't stop eating these salty crisps",
]
NOT_FOOD = [
    "Stocks fell sharply today after the earnings report",
    "The football match ended two to one",
    "It is raining again in London",
    "She finished her thesis on quantum physics",
    "My laptop battery died in the middle of the meeting",
    "The train to Boston was cancelled this morning",
    "I finally fixed the leaking faucet in the bathroom",
    "The new phone has a brilliant camera",
    "We adopted a puppy from the shelter",
    "Traffic on the highway was terrible",
    "The museum opens a new exhibition on Monday",
    "He practices the violin every evening",
]


# ----------------------------------------------------------------- calibration logic, no models


def test_fit_recovers_a_separating_sigmoid_and_meets_the_target() -> None:
    rng = np.random.default_rng(0)
    truth = rng.random(400) < 0.4
    sims = np.where(truth, 0.45, 0.05) + rng.normal(0, 0.08, 400)
    cal = fit_similarity_calibration(sims, truth, target_accuracy=0.95)
    assert cal.calibrated and cal.num_rows == 400
    assert cal.scale > 0 and 0.1 < cal.offset < 0.4
    p = 1 / (1 + np.exp(-cal.scale * (sims - cal.offset)))
    certainty = np.maximum(p, 1 - p)
    kept = certainty >= cal.threshold
    assert ((p[kept] > 0.5) == truth[kept]).mean() >= 0.95
    assert cal.resolved_accuracy >= 0.95
    assert cal.escalation_rate == pytest.approx(1 - kept.mean())
    # the threshold is the smallest that reaches the target: one notch lower misses it
    lower = np.sort(certainty[~kept])[-1:] if (~kept).any() else np.array([])
    if lower.size:
        more = certainty >= lower[0]
        assert ((p[more] > 0.5) == truth[more]).mean() < 0.95


def test_fitted_centre_is_the_most_accurate_cut_on_the_sample() -> None:
    rng = np.random.default_rng(2)
    for _ in range(40):
        n = int(rng.integers(4, 40))
        truth = rng.random(n) < rng.uniform(0.2, 0.8)
        truth[:2] = [True, False]
        sims = np.round(rng.normal(0.2, 0.15, n) + 0.2 * truth * rng.random(), 2)  # ties
        cal = fit_similarity_calibration(sims, truth)
        accuracy = float(((sims > cal.offset) == truth).mean())
        brute = max(float(((sims > c) == truth).mean()) for c in [sims.min() - 1, *sims])
        assert accuracy == pytest.approx(brute)
        assert cal.stage1_accuracy == pytest.approx(accuracy)  # what the model will predict
        assert cal.scale >= 1.0


def test_fit_escalates_nothing_when_stage_one_is_good_enough() -> None:
    truth = np.array([True] * 10 + [False] * 10)
    sims = np.where(truth, 0.6, 0.0) + np.linspace(0, 0.01, 20)
    cal = fit_similarity_calibration(sims, truth, target_accuracy=0.9)
    assert cal.threshold == 0.0 and cal.escalation_rate == 0.0
    assert not cal.use_llm  # nothing would ever reach it
    assert cal.stage1_accuracy == 1.0


def test_fit_falls_back_to_the_default_threshold_when_no_threshold_qualifies() -> None:
    rng = np.random.default_rng(1)
    truth = rng.random(60) < 0.5
    cal = fit_similarity_calibration(rng.normal(0.2, 0.1, 60), truth, target_accuracy=0.99)
    assert cal.threshold == DEFAULT_THRESHOLD and cal.calibrated


def test_fit_needs_both_classes() -> None:
    with pytest.raises(DataError, match="both true and false"):
        fit_similarity_calibration(np.array([0.1, 0.2, 0.3, 0.4]), np.ones(4, bool))
    with pytest.raises(DataError, match="one label per text"):
        FilterSample(("a", "b"), (True,))


def test_calibration_round_trips_and_describes_itself() -> None:
    cal = FilterCalibration(scale=12.0, offset=0.3, threshold=0.7, calibrated=True,
                            num_rows=10, stage1_accuracy=0.8, escalation_rate=0.2)
    assert FilterCalibration.from_dict(cal.to_dict()) == cal
    again = FilterCalibration.from_json(cal.to_json())
    assert math.isnan(again.llm_accuracy) and again.threshold == 0.7 and again.calibrated
    assert "fitted on 10 rows" in cal.describe()
    assert "pass a labelled sample" in FilterCalibration().describe()
    with pytest.raises(ModelError):
        FilterCalibration(scale=math.nan)


# ----------------------------------------------------------------- real models

# one thread: tolerant of other work on a 2-core machine; fp32: the LLM stages are held to
# row-by-row references at fp32 tolerances (LMs run in bf16 by default where the CPU has it)
DEVICE = DeviceConfig(threads=1, precision="fp32")


@pytest.fixture(scope="module")
def resources(tmp_path_factory):
    path = tmp_path_factory.mktemp("ken_home_filter")
    mp = pytest.MonkeyPatch()
    mp.setenv("KEN_HOME", str(path))
    yield Resources(DEVICE, home=path)
    mp.undo()


@pytest.fixture(scope="module")
def delay_filter(resources) -> BoundSemantic:
    return bind_sem_filter(DELAY, resources)


@pytest.mark.models
def test_obvious_cases_through_run_cascade(delay_filter) -> None:
    texts = [DELAYED, BEACH, None, "", "Stuck at JFK for 3 hours, our flight keeps getting "
             "pushed back", "The pasta was delicious"]
    result = run_cascade(delay_filter.cascade, delay_filter.models, pa.array(texts), 4)
    values = delay_filter.to_sql_values(result.values)
    assert values[0] is True and values[1] is False
    assert values[2] is None  # NULL in, NULL out
    assert isinstance(values[3], bool)  # the empty string is a text like any other
    assert values[4] is True and values[5] is False
    assert sum(s.resolved_rows for s in result.stages) == 5
    assert not delay_filter.calibrated and "uncalibrated" in delay_filter.describe()
    sim, llm = delay_filter.cascade.models
    assert sim.startswith("sim-l6[") and llm.startswith("channel-smollm2[")
    assert delay_filter.cascade.thresholds == (DEFAULT_THRESHOLD,)


@pytest.mark.models
def test_every_stage_gets_the_obvious_cases_right(resources, delay_filter) -> None:
    for name in delay_filter.cascade.models:
        pred = delay_filter.models[name].predict([DELAYED, BEACH])
        assert pred.label_strings() == ["true", "false"], name


@pytest.mark.models
def test_escalated_rows_null_and_empty_reach_the_llm(resources) -> None:
    everything_escalates = FilterCalibration(threshold=1.5)
    for llm in ("channel", "yesno"):
        bound = bind_sem_filter(DELAY, resources, llm=llm, calibration=everything_escalates)
        result = run_cascade(bound.cascade, bound.models,
                             pa.array([None, "", "   ", DELAYED, None]), batch_size=2)
        values = bound.to_sql_values(result.values)
        assert values[0] is None and values[4] is None
        assert all(isinstance(v, bool) for v in values[1:4])
        assert result.stages[1].input_rows == 3 and result.stages[1].resolved_rows == 3


@pytest.mark.models
def test_llm_stage_names_its_language_model(resources) -> None:
    """``llm="yesno-qwen"`` asks Qwen2.5-Coder-0.5B; the wiring is checked with SmolLM2 standing
    in (so the test needs no download), the stage's name and fingerprint carry the model."""
    asked = []

    class Recording:
        def encoder(self, name, device=None):  # noqa: ANN001, ANN202
            return resources.encoder(name, device)

        def causal_lm(self, name, device=None):  # noqa: ANN001, ANN202
            asked.append(name)
            return resources.causal_lm("smollm2-135m", device)

    bound = bind_sem_filter(DELAY, Recording(), llm="yesno-qwen")  # type: ignore[arg-type]
    assert asked == ["qwen2.5-coder-0.5b"]
    stage = bound.models[bound.cascade.models[1]]
    assert stage.name.startswith("yesno-qwen2.5[") and "qwen2.5" in stage.spec.fingerprint
    with pytest.raises(ModelError, match="yesno-qwen"):
        bind_sem_filter(DELAY, resources, llm="qwen")


@pytest.mark.models
def test_llm_batches_equal_row_by_row_and_truncate(resources) -> None:
    texts = [DELAYED, BEACH, "", "ok", "Flight 123 delayed again, third time this month, "
             "and nobody at the gate can tell us anything useful at all", FOOD[0]]
    lm = resources.causal_lm()
    yesno = YesNoLLMModel(lm, DELAY, max_text_tokens=24)
    channel = ChannelLLMModel(lm, DELAY, max_text_tokens=24)
    batched = yesno.log_odds(texts, batch_size=4)
    single = np.array([yesno.log_odds([t], batch_size=1)[0] for t in texts])
    np.testing.assert_allclose(batched, single, atol=2e-3)
    batched = channel.pmi(texts, batch_size=4)
    single = np.array([channel.pmi([t], batch_size=1)[0] for t in texts])
    np.testing.assert_allclose(batched, single, atol=2e-3)
    probs = yesno.predict(texts, batch_size=3).probabilities
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-6)
    long = " ".join(["the flight was delayed"] * 200)
    prompt = yesno.prompt_ids([long])[0]
    assert len(prompt) == len(yesno.prefix_ids) + 24 + len(yesno.suffix_ids)
    prefix = " ".join(long.split()[:60])  # already longer than 24 tokens
    assert yesno.log_odds([long])[0] == pytest.approx(yesno.log_odds([prefix])[0], abs=1e-5)
    assert len(yesno.yes_ids) >= 2 and len(yesno.no_ids) >= 2  # Yes, yes, " Yes", ...


@pytest.mark.models
def test_calibration_keeps_or_improves_accuracy(resources) -> None:
    # calibrate on even rows, evaluate stage 1 on odd rows it never saw
    texts, truth = FOOD + NOT_FOOD, [True] * len(FOOD) + [False] * len(NOT_FOOD)
    fit = FilterSample(tuple(texts[0::2]), tuple(truth[0::2]))
    held_texts, held_truth = texts[1::2], np.array(truth[1::2])
    body = resources.encoder("minilm-l6")
    default = SimilarityModel(body, "is about food")
    cal = calibrate_filter(default, fit)  # no LLM given: stage 1 alone
    assert cal.calibrated and not cal.use_llm
    tuned = SimilarityModel(body, "is about food", cal.scale, cal.offset)
    default_acc = float(((default.predict(held_texts).labels == 1) == held_truth).mean())
    tuned_acc = float(((tuned.predict(held_texts).labels == 1) == held_truth).mean())
    assert tuned_acc >= default_acc
    assert tuned_acc >= 0.9


@pytest.mark.models
def test_bind_with_a_sample_is_calibrated(resources) -> None:
    sample = FilterSample(tuple(FOOD[:8] + NOT_FOOD[:8]), (True,) * 8 + (False,) * 8)
    bound = bind_sem_filter("is about food", resources, sample)
    assert bound.calibrated and "uncalibrated" not in bound.describe()
    assert "fitted on 16 rows" in bound.describe()
    held = FOOD[8:] + NOT_FOOD[8:]
    result = run_cascade(bound.cascade, bound.models, held, batch_size=8)
    values = bound.to_sql_values(result.values)
    assert np.mean([v == (i < 4) for i, v in enumerate(values)]) >= 0.75


@pytest.mark.models
def test_predicates_share_networks_and_get_unique_names(resources, delay_filter) -> None:
    food = bind_sem_filter("is about food", resources)
    assert set(food.models).isdisjoint(delay_filter.models)
    sim_a = delay_filter.models[delay_filter.cascade.models[0]]
    sim_b = food.models[food.cascade.models[0]]
    assert sim_a.body is sim_b.body  # one MiniLM for every predicate
    llm_a = delay_filter.models[delay_filter.cascade.models[1]]
    llm_b = food.models[food.cascade.models[1]]
    assert llm_a.lm is llm_b.lm  # and one SmolLM2
    assert sorted(resources.loaded()) == ["minilm-l6@cpu-1t", "smollm2-135m@cpu-1t"]
    again = bind_sem_filter(DELAY, resources)
    assert again.cascade == delay_filter.cascade  # names are deterministic
    assert again.describe() == delay_filter.describe()
    assert "\n" not in again.describe() and "'complains about a flight delay'" in again.describe()


@pytest.mark.models
def test_similarity_only_and_errors(resources) -> None:
    bound = bind_sem_filter("  complains   about a flight delay?  ", resources, llm=None)
    assert bound.cascade.num_stages == 1 and bound.arguments == (DELAY,)
    assert bound.to_sql_values(["true", None, "false"]) == [True, None, False]
    with pytest.raises(DataError, match="predicate"):
        bind_sem_filter("   ", resources)
    with pytest.raises(DataError, match="no words"):
        bind_sem_filter("??", resources)
    with pytest.raises(ModelError, match="unknown sem_filter LLM stage"):
        bind_sem_filter(DELAY, resources, llm="gpt")
    with pytest.raises(DataError, match="label"):
        bound.to_sql_values(["maybe"])
    with pytest.raises(ModelError, match="cascade names"):
        BoundSemantic("sem_filter", Cascade(("missing",)), bound.models, "boolean", False)
    assert issubclass(DataError, KenError)


# ----------------------------------------------------------------- sem_classify (same networks)


@pytest.mark.models
def test_sem_classify_on_the_real_networks(resources) -> None:
    from ken.ops.sem_classify import LabelLLMModel, bind_sem_classify, stage_name

    spec = "sports|politics|weather"
    bound = bind_sem_classify(spec, resources)
    assert bound.describe().startswith("sem_classify('sports|politics|weather'): cls-l6[")
    # worker loaders are named without loading a model: the names must be the models' own
    assert list(bound.models) == [stage_name("minilm-l6", spec), stage_name("llm", spec)]
    texts = ["the striker scored twice in the final", "parliament passed the budget vote",
             None, "heavy rain and strong winds tomorrow", ""]
    result = run_cascade(bound.cascade, bound.models, texts, batch_size=4)
    values = bound.to_sql_values(result.values)
    assert values[2] is None
    assert all(v in spec.split("|") for i, v in enumerate(values) if i != 2)
    # the LLM stage answers a row the same alone as inside a padded batch
    judge = next(m for m in bound.models.values() if isinstance(m, LabelLLMModel))
    together = judge.predict([t for t in texts if t], batch_size=4).probabilities
    alone = judge.predict([texts[3]], batch_size=1).probabilities
    assert np.allclose(together[2], alone[0], atol=1e-4)
    assert np.allclose(together.sum(axis=1), 1.0, atol=1e-5)
