"""Load-gear plans of generating cascades: the policy (gear choice by load, escalation), the
simulator against brute force and its invariants on random traces (hypothesis), and the
planner against brute-force enumeration."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ken.errors import PlanError, PlanningError, PolicyError, SimulationError
from ken.models.cascade import Cascade
from ken.optimizer.decode_sim import StageRows, simulate_decoding, simulate_gen_plan
from ken.optimizer.gen_planner import (
    GenCandidate,
    candidate_plans,
    cascade_candidates,
    frontier,
    pareto,
    plan_generation,
)
from ken.optimizer.tokens import TokenCost
from ken.policy.generating import GenDispatcher, pick_lane
from ken.policy.plan import GenGear, GenPlan, single_gear

SMALL, LARGE = Cascade(("s",)), Cascade(("l",))
PAIR = Cascade(("s", "l"), (0.5,))


def cost(prefill: float, decode: float, per_token: float = 0.0) -> TokenCost:
    return TokenCost("m", "hw", (), (), (prefill, 0.0, per_token), (decode, 0.0, 0.0), 0, 1)


COSTS = {"s": cost(0.05, 0.02), "l": cost(0.2, 0.08)}


def stages(n: int, seed: int = 0) -> dict[str, StageRows]:
    rng = np.random.default_rng(seed)
    return {
        "s": StageRows(rng.integers(5, 40, n), rng.integers(0, 10, n), rng.random(n),
                       rng.random(n) * 0.6),
        "l": StageRows(rng.integers(5, 40, n), rng.integers(1, 12, n), rng.random(n),
                       0.3 + rng.random(n) * 0.7)}


def test_plan_checks_and_round_trips() -> None:
    plan = GenPlan("sem_qa", (GenGear(PAIR, 4), GenGear(SMALL)), max_running=4,
                   kv_budget_tokens=900)
    assert GenPlan.from_json(plan.to_json()) == plan
    assert plan.models == ("s", "l")
    assert "load [0, 4): s -(0.500)-> l; load [4, inf): s" == "; ".join(plan.describe()[:2])
    with pytest.raises(PlanError, match="last gear"):
        GenPlan("f", (GenGear(PAIR, 4),))
    with pytest.raises(PlanError, match="increasing"):
        GenPlan("f", (GenGear(PAIR, 4), GenGear(LARGE, 2), GenGear(SMALL)))
    with pytest.raises(PlanError, match="hysteresis"):
        GenPlan("f", (GenGear(SMALL),), hysteresis=0)


def test_dispatcher_picks_gears_by_load_with_hysteresis() -> None:
    plan = GenPlan("f", (GenGear(PAIR, 2), GenGear(SMALL)), hysteresis=0.5)
    d = GenDispatcher(plan)
    assert d.admit(0, 0.0) == "s" and d.gear_of(0) == 0  # load 0 < 2: the cascade
    assert d.admit(1, 0.1) == "s" and d.gear_of(1) == 0  # load 1
    d.admit(2, 0.2)
    assert d.gear_of(2) == 1 and d.switches == [(0.2, 0, 1)]  # load 2: cheaper gear
    assert d.finished(0, 0.9) is None  # certain: answered
    d.admit(3, 0.3)
    assert d.gear_of(3) == 1  # load 2 again
    d.finished(1, 0.1)  # gear 0's cascade: escalates to l
    assert d.stage_of(1) == 1 and d.load == 3
    d.drop(2)
    d.admit(4, 0.4)
    assert d.gear_of(4) == 1  # load 2: not below 0.5 x 2
    d.drop(1), d.drop(3), d.drop(4)
    d.admit(5, 0.5)  # load 0 < 1: back to the cascade
    assert d.gear_of(5) == 0 and d.switches[-1] == (0.5, 1, 0)
    assert d.finished(5, 0.1) == "l" and d.finished(5, 0.0) is None  # last stage answers
    with pytest.raises(PolicyError, match="not in flight"):
        d.finished(5, 0.3)
    assert pick_lane([None, 3.0, 1.0]) == 2 and pick_lane([None, None]) is None


def test_one_gear_cascade_quality_equals_brute_force() -> None:
    n = 40
    s = stages(n, 1)
    rows = np.arange(n)
    run = simulate_gen_plan(single_gear("f", PAIR), COSTS, s, np.linspace(0, 10, n), rows)
    expect = np.where(s["s"].certainty < 0.5, s["l"].quality, s["s"].quality)
    assert np.allclose(run.quality, expect)
    assert np.array_equal(run.stage, (s["s"].certainty < 0.5).astype(int))
    up = s["s"].certainty < 0.5
    assert run.tokens == {"s": int(s["s"].output_tokens.sum()),
                          "l": int(s["l"].output_tokens[up].sum())}


def test_one_model_plan_is_simulate_decoding() -> None:
    arrivals, prompts, outputs = [0.0, 0.1, 0.15, 3.0], [10, 20, 30, 5], [4, 0, 7, 2]
    c = cost(0.1, 0.05, 0.001)
    one = simulate_decoding(c, arrivals, prompts, outputs, max_running=2)
    plan = single_gear("f", Cascade(("m",)), max_running=2)
    run = simulate_gen_plan(plan, {"m": c}, {"m": StageRows(
        np.array(prompts), np.array(outputs), np.ones(4), np.ones(4))}, arrivals, range(4))
    assert np.allclose(run.completion_s, one.completion_s)
    assert np.allclose(run.first_token_s, one.first_token_s)
    # by hand: request 0's prefill ends at 0.1 + 0.001 x 10; request 1 (arrived at 0.1)
    # joins alone (request 2 comes at 0.15): 0.11 + 0.1 + 0.001 x 20, and it wants no token
    assert one.first_token_s[0] == pytest.approx(0.11)
    assert one.first_token_s[1] == pytest.approx(0.23) == one.completion_s[1]


trace = st.lists(st.tuples(st.floats(0, 20), st.integers(0, 29)), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None)
@given(trace, st.integers(1, 5), st.sampled_from([None, 120, 300]),
       st.floats(0.1, 1.0), st.integers(0, 3))
def test_simulated_plans_answer_everyone_and_conserve_tokens(reqs, max_running, budget,
                                                             hysteresis, seed) -> None:  # noqa: ANN001
    reqs = sorted(reqs)
    arrivals = np.array([a for a, _ in reqs])
    rows = np.array([r for _, r in reqs])
    s = stages(30, seed)
    plan = GenPlan("f", (GenGear(Cascade(("l", "s"), (0.3,)), 2), GenGear(PAIR, 5),
                         GenGear(SMALL)), max_running, budget, hysteresis)
    run = simulate_gen_plan(plan, COSTS, s, arrivals, rows)
    assert np.all(arrivals <= run.first_token_s + 1e-12)
    assert np.all(run.first_token_s <= run.completion_s + 1e-12)
    reached = {"s": 0, "l": 0}
    for k in range(len(reqs)):
        cascade = plan.gears[run.gear[k]].cascade
        stage = 0  # the stage that answers follows the escalation rule
        while stage < len(cascade.thresholds) and \
                s[cascade.models[stage]].certainty[rows[k]] < cascade.thresholds[stage]:
            reached[cascade.models[stage]] += int(s[cascade.models[stage]].output_tokens[rows[k]])
            stage += 1
        reached[cascade.models[stage]] += int(s[cascade.models[stage]].output_tokens[rows[k]])
        assert run.stage[k] == stage
        assert run.quality[k] == s[cascade.models[stage]].quality[rows[k]]
    assert run.tokens == reached
    m = run.metrics()
    assert m.num_requests == len(reqs) and 0 <= m.escalated <= 1


def test_simulator_refuses_bad_traces() -> None:
    s = stages(5)
    with pytest.raises(SimulationError, match="sorted"):
        simulate_gen_plan(single_gear("f", SMALL), COSTS, s, [1.0, 0.0], [0, 1])
    with pytest.raises(SimulationError, match="index"):
        simulate_gen_plan(single_gear("f", SMALL), COSTS, s, [0.0], [7])
    with pytest.raises(SimulationError, match="no token cost"):
        simulate_gen_plan(single_gear("f", Cascade(("x",))), COSTS, s, [0.0], [0])
    with pytest.raises(SimulationError, match="KV budget"):
        simulate_gen_plan(single_gear("f", SMALL, kv_budget_tokens=3), COSTS, s, [0.0], [0])


def test_candidates_are_the_pareto_front_of_all_thresholds() -> None:
    s = stages(50, 2)
    found = cascade_candidates(("s", "l"), s, COSTS, max_running=4)
    assert found == sorted(found, key=lambda c: (-c.quality, c.work_s))
    for a in found:  # nothing kept is beaten on both
        assert not any(b.quality > a.quality and b.work_s < a.work_s for b in found)
    assert {c.cascade.models for c in found} <= {("s",), ("l",), ("s", "l")}
    brute = [GenCandidate(Cascade(("s",)), 0.5, 1.0), GenCandidate(Cascade(("l",)), 0.7, 3.0),
             GenCandidate(PAIR, 0.6, 3.5), GenCandidate(Cascade(("s", "l"), (0.2,)), 0.6, 2.0)]
    assert [c.work_s for c in pareto(brute)] == [3.0, 2.0, 1.0]


def test_planner_picks_the_most_accurate_feasible_plan_of_all_enumerated() -> None:
    s = stages(30, 3)
    rng = np.random.default_rng(4)
    arrivals = np.sort(rng.uniform(0, 30, 80))
    rows = rng.integers(0, 30, 80)
    candidates = cascade_candidates(("s", "l"), s, COSTS, max_running=4)
    best, tried = plan_generation("f", candidates, COSTS, s, arrivals, rows, target_ms=2500,
                                  max_gears=2, edges=(2, 6), max_running=4)
    assert len(tried) == len(candidate_plans("f", candidates, 2, (2, 6), 4))
    feasible = [c for c in tried if c.metrics.tgt_p95_ms <= 2500]
    assert best is not None and best in feasible
    assert best.metrics.accuracy == pytest.approx(max(c.metrics.accuracy for c in feasible))
    front = frontier(tried)
    assert [c.metrics.tgt_p95_ms for c in front] == sorted(c.metrics.tgt_p95_ms for c in front)
    qualities = [c.metrics.accuracy for c in front]
    assert all(b > a for a, b in zip(qualities[:-1], qualities[1:], strict=True))
    none, _ = plan_generation("f", candidates[:1], COSTS, s, arrivals, rows, target_ms=1e-3)
    assert none is None
    with pytest.raises(PlanningError, match="metric"):
        plan_generation("f", candidates, COSTS, s, arrivals, rows, 100, metric="p42")
    assert math.isinf(tried[0].plan.gears[-1].max_load)


def test_planning_on_several_windows_takes_the_worst_latency_and_the_mean_quality() -> None:
    s = stages(30, 5)
    rng = np.random.default_rng(6)
    windows = [(np.sort(rng.uniform(0, span, 40)), rng.integers(0, 30, 40))
               for span in (20.0, 60.0)]
    candidates = cascade_candidates(("s", "l"), s, COSTS, max_running=4)[:3]
    best, tried = plan_generation("f", candidates, COSTS, s, *windows[0], target_ms=5000,
                                  max_gears=2, edges=(3,), max_running=4,
                                  more_traces=windows[1:])
    for choice in tried:
        runs = [simulate_gen_plan(choice.plan, COSTS, s, a, r).metrics() for a, r in windows]
        assert choice.metrics.tgt_p95_ms == max(m.tgt_p95_ms for m in runs)
        assert choice.metrics.accuracy == pytest.approx(np.mean([m.accuracy for m in runs]))
    assert best is not None
    assert all(simulate_gen_plan(best.plan, COSTS, s, a, r).metrics().tgt_p95_ms <= 5000
               for a, r in windows)
