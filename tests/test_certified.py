"""Gear plans that keep a target in every gear (issue 36): the planner's candidates certified
on the profile sample (``ken.optimizer.certified``), the planner serving nothing else, and a
served query with the target.

The synthetic population: a boolean oracle ``c`` (30% true) and two cheaper models ``a`` and
``b``, each certain in [0.5, 1] and agreeing with the oracle with probability equal to its
certainty, so thresholds trade agreement for cost smoothly. A profile sample is a uniform draw
of rows of it; a candidate's true metric is measured on the whole population.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
from fakes import FakeModel, Profiled

import ken
from ken.errors import GuaranteeError
from ken.models.cascade import Cascade
from ken.models.model import BOOLEAN_LABELS
from ken.optimizer import guarantee
from ken.optimizer.certified import certify_candidates, profile_values
from ken.optimizer.guarantee import (
    GuaranteeTarget,
    StageOutcomes,
    certified_settings,
    choose_thresholds,
    clopper_pearson_lower,
    quantile_path,
)
from ken.optimizer.planner import PlannerSettings, plan_frontier
from ken.optimizer.planning import planning_inputs
from ken.optimizer.profile import Profile
from ken.optimizer.workload import Hardware, poisson_trace

F, T = BOOLEAN_LABELS
SIZES = (1, 4, 16)
#: seconds per batch at SIZES: a is the cheapest, c (the default oracle) the costliest
RUNTIMES = {"a": (0.002, 0.005, 0.016), "b": (0.006, 0.015, 0.050), "c": (0.030, 0.090, 0.300)}


def population(size: int, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each model's (values, certainties) over the population."""
    rng = np.random.default_rng(seed)
    oracle = np.where(rng.random(size) < 0.3, T, F)
    out = {"c": (oracle, np.ones(size))}
    for name in ("a", "b"):
        cert = 0.5 + 0.5 * rng.random(size)
        flip = rng.random(size) > cert
        out[name] = (np.where(flip, np.where(oracle == T, F, T), oracle), cert)
    return out


def profiles_of(pop: dict, rows: np.ndarray, labels: np.ndarray) -> dict[str, Profile]:
    """Profiles of the three models on ``rows`` of the population (labels: the truth)."""
    out = {}
    for name, (values, cert) in pop.items():
        v, c = values[rows], np.minimum(cert[rows], 0.999)
        scores = np.where((v == T)[:, None], np.column_stack([1 - c, c]),
                          np.column_stack([c, 1 - c])).astype(np.float32)
        out[name] = Profile(name, "cpu-1t", SIZES, RUNTIMES[name], 2**20, 2**20, BOOLEAN_LABELS,
                            "pop", "pop-hash", f"fp-{name}",
                            (v == labels[rows]).astype(np.float64), scores, tuple(v))
    return out


def answers(pop: dict, cascade: Cascade) -> np.ndarray:
    """The cascade's answer on every population row (the escalation rule written out)."""
    n = len(pop["c"][0])
    out = np.empty(n, dtype=object)
    open_ = np.ones(n, dtype=bool)
    for i, model in enumerate(cascade.models):
        values, cert = pop[model]
        take = open_ if i == len(cascade.models) - 1 else open_ & (
            np.minimum(cert, 0.999) >= cascade.thresholds[i])
        out[take] = values[take]
        open_ &= ~take
    return out


def true_metric(pop: dict, cascade: Cascade, metric: str) -> float:
    said, truth = answers(pop, cascade) == T, pop["c"][0] == T
    if metric == "accuracy":
        return float(np.mean(said == truth))
    if metric == "precision":
        return float((said & truth).sum() / max(said.sum(), 1))
    return float((said & truth).sum() / truth.sum())


POP = population(40_000)
TRUTH = np.where(np.random.default_rng(9).random(40_000) < 0.1,
                 np.where(POP["c"][0] == T, F, T), POP["c"][0])


def misses(metric: str, target: float, delta: float, reps: int, rows: int = 800) -> int:
    """Fresh profile samples in which some certified candidate misses the target."""
    missed = 0
    for rep in range(reps):
        drawn = np.random.default_rng(1000 + rep).choice(40_000, rows, replace=False)
        certified = certify_candidates(profiles_of(POP, drawn, TRUTH),
                                       GuaranteeTarget(metric, target, delta))
        assert certified.oracle == "c"
        if any(true_metric(POP, c, metric) < target for c in certified.cascades):
            missed += 1
    return missed


@pytest.mark.parametrize(("metric", "target"), [("accuracy", 0.9), ("recall", 0.85)])
def test_every_candidate_meets_the_target_but_with_probability_delta(metric, target,
                                                                     monkeypatch) -> None:
    reps, delta = 60, 0.1
    allowed = delta + 2 * np.sqrt(delta * (1 - delta) / reps)  # two Monte Carlo errors
    held = misses(metric, target, delta, reps)
    assert held / reps <= allowed
    # the check has teeth: with the sample's estimate in place of the bound it fails
    monkeypatch.setattr(guarantee, "clopper_pearson_lower",
                        lambda k, n, _delta: np.asarray(k) / np.maximum(np.asarray(n), 1))
    naive = misses(metric, target, delta, reps)
    assert naive / reps > allowed and naive >= 3 * held


def test_candidates_are_certified_settings_of_sequences_ending_at_the_oracle() -> None:
    drawn = np.random.default_rng(3).choice(40_000, 1000, replace=False)
    profiles = profiles_of(POP, drawn, TRUTH)
    target = GuaranteeTarget("accuracy", 0.88, 0.1)
    certified = certify_candidates(profiles, target)
    assert certified.sequences == 3  # a -> c, b -> c, a -> b -> c
    assert not certified.oracle_only and len(certified.cascades) > 2
    assert certified.test_rows == 500 and certified.path_rows == 500
    # brute force: each candidate, run on the test rows, has its bound at delta / 3 >= target
    order = np.random.default_rng(0).permutation(1000)
    test = drawn[order[500:]]
    sub = {m: (POP[m][0][test], POP[m][1][test]) for m in POP}
    for cascade, bound in zip(certified.cascades, certified.bounds, strict=True):
        said = answers(sub, cascade)
        agree = int((said == sub["c"][0]).sum())
        assert cascade.models[-1] == "c" or len(cascade.models) == 1
        assert bound == pytest.approx(1.0 if cascade.models == ("c",) else
                                      float(clopper_pearson_lower(agree, 500, 0.1 / 3)))
        assert bound >= 0.88
    # the candidates are the cheapest certified setting and the safer ones before it
    seq = ("a", "c")
    path = quantile_path([profiles["a"].certainty()[order[:500]]])
    outcomes = StageOutcomes(seq, tuple(tuple(profile_values(profiles[m])[i]
                                              for i in order[500:]) for m in seq),
                             np.array([profiles[m].certainty()[order[500:]] for m in seq]))
    each = GuaranteeTarget("accuracy", 0.88, 0.1 / 3)
    settings = certified_settings(outcomes, each, path)
    cheapest = choose_thresholds(outcomes, each, path)
    assert settings and settings[-1][0] == cheapest.thresholds
    assert settings[-1][1] == pytest.approx(cheapest.lower_bound)


def test_nothing_cheaper_than_the_oracle_is_certified_for_a_target_of_one() -> None:
    drawn = np.random.default_rng(4).choice(40_000, 400, replace=False)
    certified = certify_candidates(profiles_of(POP, drawn, TRUTH),
                                   GuaranteeTarget("accuracy", 1.0))
    assert certified.oracle_only and certified.cascades == (Cascade(("c",)),)
    assert "nothing cheaper than the oracle met it" in certified.describe()


def test_a_named_oracle_and_what_a_certification_covers() -> None:
    drawn = np.random.default_rng(5).choice(40_000, 600, replace=False)
    profiles = profiles_of(POP, drawn, TRUTH)
    certified = certify_candidates(profiles, GuaranteeTarget("accuracy", 0.8, 0.1, "b"))
    assert certified.oracle == "b" and certified.sequences == 1  # a -> b
    assert all(set(c.models) <= {"a", "b"} for c in certified.cascades)
    assert certified.covers(GuaranteeTarget("accuracy", 0.75, 0.2, "b"))
    assert not certified.covers(GuaranteeTarget("accuracy", 0.75, 0.2))  # default: c
    assert not certified.covers(GuaranteeTarget("accuracy", 0.85, 0.1, "b"))  # stricter
    assert not certified.covers(GuaranteeTarget("accuracy", 0.8, 0.05, "b"))  # surer
    assert not certified.covers(GuaranteeTarget("recall", 0.8, 0.1, "b"))
    default = certify_candidates(profiles, GuaranteeTarget("accuracy", 0.8, 0.1))
    assert default.covers(GuaranteeTarget("accuracy", 0.8, 0.1, "c"))
    with pytest.raises(GuaranteeError, match="not a model of this function"):
        certify_candidates(profiles, GuaranteeTarget("accuracy", 0.8, oracle="z"))


def test_the_frontier_serves_only_certified_cascades() -> None:
    drawn = np.random.default_rng(6).choice(40_000, 800, replace=False)
    profiles = profiles_of(POP, drawn, TRUTH)
    certified = certify_candidates(profiles, GuaranteeTarget("accuracy", 0.9, 0.1))
    catalog, _ = planning_inputs(profiles)
    settings = PlannerSettings(num_ranges=3, placement_scoring="estimate", max_rounds=2)
    hw, trace = Hardware.cpu_workers(2, 2**30), poisson_trace(30.0, 8.0, seed=1)
    only = PlannerSettings(**{**vars(settings), "only_candidates": True})
    front, _ = plan_frontier("f", certified.cascades, catalog, hw, trace, settings=only)
    served = {c for p in front.all_plans for c in p.cascades}
    assert served <= set(certified.cascades)
    # without the flag, the single models join the frontier's alternatives
    loose, _ = plan_frontier("f", certified.cascades, catalog, hw, trace, settings=settings)
    assert {c for p in loose.all_plans for c in p.cascades} - set(certified.cascades)


# -- a served function with a target ------------------------------------------------------------


def served_session(home):  # noqa: ANN001, ANN201
    drawn = np.random.default_rng(7).choice(40_000, 800, replace=False)
    profiles = profiles_of(POP, drawn, TRUTH)
    s = ken.connect(builtins=False, home=home)
    models = {m: FakeModel(m, BOOLEAN_LABELS) for m in "abc"}
    s.register("fsem", Profiled("fsem", Cascade(("a", "c"), (0.8,)), models,
                                lambda _threads: profiles, output_type="boolean"))
    s.register_table("t", pa.table({"txt": [f"row {i}" for i in range(50)]}))
    return s


QUERY = "SELECT txt, fsem(txt) AS v FROM t"
PLAN = dict(functions=["fsem"], trace="poisson", peak_qps=30, duration_s=8.0, num_ranges=3,
            settings=PlannerSettings(num_ranges=3, placement_scoring="estimate", max_rounds=2))


def test_a_served_query_keeps_a_target_it_was_planned_under(tmp_path) -> None:
    s = served_session(tmp_path)
    s.set_target("fsem", "accuracy", 0.9, delta=0.1)
    s.plan("accuracy >= 0", **PLAN)
    certified = s.targets.certified["fsem"]
    assert set(s.plans["fsem"].cascades) <= set(certified.cascades)
    assert set(s.replans["fsem"].cascades) == set(certified.cascades)
    assert s.replans["fsem"].settings.only_candidates
    s.serve(workers="thread")
    try:
        explained = s.explain(QUERY)
        assert "target: accuracy >= 0.90 against the last stage (delta 0.1): served by its " \
            "gear plan, every gear certified: accuracy >= 0.9 against c (delta 0.1) on 400 " \
            "profile rows" in explained
        result = s.sql(QUERY)
        assert len(result.fetchall()) == 50
        run = result.stats["targets"][0]
        assert run.oracle == "c" and run.guarantee is None and run.sample_rows == 0
        assert run.note.startswith("served by its gear plan, every gear certified")
        # a stricter target than the plan's is refused, with how to get there
        s.set_target("fsem", "accuracy", 0.95, delta=0.1)
        with pytest.raises(GuaranteeError, match="planned under accuracy >= 0.90 .* does not "
                                                 "keep accuracy >= 0.95"):
            s.sql(QUERY)
        assert "the statement will fail" in s.explain(QUERY)
        # a plan set by hand that runs an uncertified cascade is refused too
        s.set_target("fsem", "accuracy", 0.9, delta=0.1)
        hand = next(p for p in s.frontiers["fsem"].all_plans
                    if any(c.thresholds for c in p.cascades))
        loosened = tuple(Cascade(c.models, tuple(t - 0.2 for t in c.thresholds))
                         for c in hand.cascades)  # escalates less than was certified
        s.use_plan(dataclasses.replace(hand, cascades=loosened))
        with pytest.raises(GuaranteeError, match="not certified"):
            s.sql(QUERY)
    finally:
        s.stop_serving()


def test_a_plan_made_without_the_target_is_refused_when_served(tmp_path) -> None:
    s = served_session(tmp_path)
    s.plan("accuracy >= 0", **PLAN)
    assert "fsem" not in s.targets.certified
    s.serve(workers="thread")
    try:
        s.sql("SET ken_accuracy_target = 0.9")
        with pytest.raises(GuaranteeError, match="not planned under accuracy >= 0.90 .* plan it "
                                                 "under the target"):
            s.sql(QUERY)
        s.sql("RESET ken_accuracy_target")
        assert len(s.sql(QUERY).fetchall()) == 50
    finally:
        s.stop_serving()
