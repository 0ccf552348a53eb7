"""Baseline plans (dynamic batching, static cascades, placement heuristic) and the
matched-accuracy comparison, on the synthetic catalog of the planner tests."""

from __future__ import annotations

import numpy as np
import pytest

from ken.optimizer.baselines import (
    best_at_accuracy,
    dynamic_batching_plan,
    gear_accuracy,
    matched_plan,
    ratio_at_accuracy,
    served_accuracy,
    static_plans,
    tune_dynamic_batching,
)
from ken.optimizer.placement import heuristic_placement
from ken.optimizer.planner import PlannerSettings, plan_frontier, planning_context
from ken.optimizer.scheduler import PlanningError
from ken.optimizer.simulator import simulate
from ken.optimizer.workload import Device, Hardware, Trace, poisson_trace
from tests.test_planner import CASCADES, catalog, hardware, trace


def test_dynamic_batching_runs_full_batches_or_waits_at_most_the_delay() -> None:
    cat = catalog()
    plan = dynamic_batching_plan("op", "m", cat, hardware(2), 100.0, max_batch=4,
                                 max_wait_s=0.02)
    assert [r.label() for r in plan.placement] == ["m@d0", "m@d1"]
    assert plan.ranges[0].shares == (0.5, 0.5) and plan.ranges[0].min_queue == (4, 4)
    # 16 rows at t=0: four full batches, two per replica, nobody waits for the delay
    burst = Trace(np.zeros(16), "burst")
    res = simulate(plan, cat, burst)
    assert res.batches == 4
    one = cat.perf["m"].batch_runtime(4)
    assert res.latency_s.max() == pytest.approx(2 * one)
    # one lonely row waits the queue delay, then runs alone
    lonely = simulate(plan, cat, Trace(np.array([0.0]), "one"))
    assert lonely.latency_s[0] == pytest.approx(0.02 + cat.perf["m"].batch_runtime(1))
    # accuracy is the model's own
    assert simulate(plan, cat, trace()).metrics().accuracy == pytest.approx(
        cat.quality["m"][np.arange(len(trace())) % cat.num_rows].mean(), abs=0.06)


def test_dynamic_batching_rejects_bad_input() -> None:
    cat = catalog()
    with pytest.raises(PlanningError, match="profiled"):
        dynamic_batching_plan("op", "nope", cat, hardware(2), 10.0, 4, 0.0)
    with pytest.raises(PlanningError, match="fits on no device"):
        dynamic_batching_plan("op", "l", cat, hardware(2, mem=100), 10.0, 4, 0.0)
    with pytest.raises(PlanningError, match="max_batch"):
        dynamic_batching_plan("op", "m", cat, hardware(2), 10.0, 0, 0.0)


def test_tuning_picks_the_lowest_simulated_p95_of_the_grid() -> None:
    cat = catalog()
    tr = poisson_trace(400.0, 3.0, seed=2)
    tuned = tune_dynamic_batching("op", "m", cat, hardware(2), tr, batches=(1, 4, 16, 999),
                                  waits_s=(0.0, 0.01))
    assert len(tuned.grid) == 6  # 999 is above the profile: skipped
    by_brute = min(tuned.grid, key=lambda g: g[2])
    assert (tuned.plan.max_batch[0], tuned.plan.predicted.p95_ms) == (by_brute[0], by_brute[2])
    # at 400 qps on 3 ms single-row calls, batching is needed: batch 1 is not the winner
    assert tuned.plan.max_batch[0] > 1


def test_static_plans_use_one_cascade_everywhere() -> None:
    cat, hw, tr = catalog(), hardware(2), trace()
    settings = PlannerSettings(num_ranges=4)
    ctx = planning_context("op", CASCADES, cat, hw, tr, settings=settings)
    statics = static_plans(ctx)
    assert len(statics) == len(ctx.cascades)
    for plan, cascade in zip(statics, ctx.cascades, strict=True):
        assert plan.cascades == (cascade,) and {r.cascade for r in plan.ranges} == {0}
        assert plan.predicted is not None
    # the planner places every static plan too (include_static): on the planning trace no
    # static plan beats ken's frontier at its accuracy
    frontier, _ = plan_frontier("op", CASCADES, cat, hw, tr, settings=settings)
    ours = [(a, p) for p, a in frontier.points()]
    for plan in statics:
        m = plan.predicted
        got = ratio_at_accuracy((m.accuracy, m.p95_ms), ours, tolerance=0.0)
        assert got is not None and got[0] >= 1.0 - 1e-9
    # without them the adapter's frontier is reported too, and adding the static plans to
    # the candidates never makes the frontier worse: every plan the adapter alone finds is
    # matched (at its accuracy, at most its p95) by the frontier with them
    no_static = PlannerSettings(num_ranges=4, include_static=False)
    greedy, _ = plan_frontier("op", CASCADES, cat, hw, tr, settings=no_static)
    assert greedy.plans and all(p.predicted is not None for p in greedy.plans)
    for plan in greedy.plans:
        m = plan.predicted
        got = ratio_at_accuracy((m.accuracy, m.p95_ms), ours, tolerance=0.0)
        assert got is not None and got[0] >= 1.0 - 1e-9


def test_heuristic_placement() -> None:
    cat = catalog()  # memories: s 100, m 200, l 400
    # all fit on one device: every device holds all of them
    both = heuristic_placement(["l", "s"], hardware(2, mem=700), cat)
    assert sorted(r.label() for r in both) == ["l@d0", "l@d1", "s@d0", "s@d1"]
    # they do not fit together: a device of their own each, round robin
    hw3 = Hardware(tuple(Device(f"d{i}", "cpu", 450, 0) for i in range(3)))
    own = heuristic_placement(["s", "l"], hw3, cat)
    assert sorted(r.label() for r in own) == ["l@d0", "l@d2", "s@d1"]
    with pytest.raises(PlanningError, match="fewer devices than models"):
        heuristic_placement(["s", "m", "l"], hardware(2, mem=450), cat)
    # the planner uses it when asked, without a search
    settings = PlannerSettings(num_ranges=3, heuristic_placement=True)
    frontier, stats = plan_frontier("op", CASCADES, cat, hardware(2), trace(), settings=settings)
    assert stats.placement_searches == 0
    for plan in frontier.plans:
        models = {m for c in plan.cascades for m in c.models}
        assert {r.label() for r in plan.placement} == {f"{m}@d{i}" for m in models
                                                      for i in (0, 1)}


def brute_ratio(baseline, ours, tol):
    best = None
    for a, p in ours:
        if a >= baseline[0] - tol and (best is None or p < best):
            best = p
    return None if best is None else baseline[1] / best


def test_ratio_at_accuracy_matches_brute_force() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        ours = [(float(a), float(p)) for a, p in zip(rng.uniform(0.6, 0.8, 5),
                                                     rng.uniform(5, 500, 5), strict=True)]
        base = (float(rng.uniform(0.6, 0.8)), float(rng.uniform(5, 500)))
        got = ratio_at_accuracy(base, ours)
        want = brute_ratio(base, ours, 0.005)
        if want is None:
            assert got is None and best_at_accuracy(ours, base[0]) is None
        else:
            assert got[0] == pytest.approx(want)
            assert ours[got[1]][1] == pytest.approx(base[1] / want)
            assert best_at_accuracy(ours, base[0]) == got[1]


def test_gear_accuracy_is_the_served_cascades_sample_accuracy() -> None:
    cat = catalog()
    settings = PlannerSettings(num_ranges=3)
    frontier, _ = plan_frontier("op", CASCADES, cat, hardware(2), trace(), settings=settings)
    plan = max(frontier.plans, key=lambda p: len(p.gears()))
    res = simulate(plan, cat, trace())
    ranges = res.range_index[0]
    got = gear_accuracy(plan, cat, ranges)
    by_hand = np.mean([cat.accuracy(plan.cascade_of(int(k))) for k in ranges])
    assert got == pytest.approx(by_hand)
    # a static plan's is exactly its cascade's accuracy on the whole sample
    static = dynamic_batching_plan("op", "l", cat, hardware(2), 100.0, 4, 0.01)
    assert gear_accuracy(static, cat, np.zeros(7, int)) == pytest.approx(
        cat.accuracy(static.cascades[0]))
    with pytest.raises(PlanningError, match="every request"):
        gear_accuracy(static, cat, np.array([0, -1]))


def test_matched_plan_is_the_fastest_planned_plan_at_least_as_accurate_on_the_replayed_rows(
        ) -> None:
    cat, hw = catalog(), hardware(2)
    frontier, _ = plan_frontier("op", CASCADES, cat, hw, trace(),
                                settings=PlannerSettings(num_ranges=4, max_rounds=2))
    plans = list(frontier.plans)
    replayed = poisson_trace(150.0, 2.0, seed=5)  # another window: other rows, other gears
    served = [served_accuracy(p, cat, replayed, seed=3) for p in plans]
    # each plan's accuracy there is the simulated row accuracy of that window
    assert served == [simulate(p, cat, replayed, 3).metrics(0, p).accuracy for p in plans]
    for goal in sorted(set(served)) + [max(served) + 0.01]:
        ok = [i for i, a in enumerate(served) if a >= goal]
        expect = min(ok, key=lambda i: plans[i].predicted.p95_ms) if ok else None
        assert matched_plan(plans, goal, cat, replayed, seed=3) == expect
