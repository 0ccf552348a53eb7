"""Planner: invocation scheduling per range, placement search, workload adapter, query optimizer.

Synthetic catalogs only (fast); brute force where the search space is tiny.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ken.models.cascade import Cascade
from ken.optimizer.perf import Catalog, ModelPerf
from ken.optimizer.placement import (
    adapt_placement,
    fits,
    full_placement,
    memory_used,
    search_placement,
)
from ken.optimizer.plan_eval import evaluate_plan
from ken.optimizer.planner import PlannerSettings, _candidates, plan_frontier, planning_context
from ken.optimizer.query import (
    PipelineSample,
    QueryPlanError,
    Target,
    choose_pipeline,
    choose_plans,
    evaluate_pipeline,
)
from ken.optimizer.scheduler import PlanningError, balance_load
from ken.optimizer.simulator import sample_rows
from ken.optimizer.workload import Device, Hardware, gamma_trace, poisson_trace
from ken.policy.plan import Frontier

ROWS = 400
SIZES = (1, 4, 16, 64)


def catalog(seed: int = 0) -> Catalog:
    """Three models: cheap/weak, middle, costly/strong, with correlated certainties."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(ROWS)
    perf, quality, probs = {}, {}, {}
    for name, skill, ms, mem in (("s", 0.6, 1.0, 100), ("m", 0.9, 3.0, 200),
                                 ("l", 1.2, 9.0, 400)):
        p = 1 / (1 + np.exp(-(2 * (skill - z) + rng.standard_normal(ROWS))))
        quality[name] = (p > 0.5).astype(np.float64)  # 1/0 correctness
        probs[name] = np.column_stack([p, 1 - p])
        per_batch = tuple(ms / 1000 * (1 + 0.25 * (b - 1)) for b in SIZES)
        perf[name] = ModelPerf(name, SIZES, (per_batch,), (mem,))
    return Catalog(perf, quality, probs, f"test-{seed}")


CASCADES = (Cascade(("s",)), Cascade(("s", "m"), (0.8,)), Cascade(("s", "l"), (0.75,)),
            Cascade(("m", "l"), (0.85,)), Cascade(("l",)))


def hardware(n: int = 2, mem: int = 700) -> Hardware:
    return Hardware(tuple(Device(f"d{i}", "cpu", mem, 0) for i in range(n)))


def trace(rate: float = 300.0, seconds: float = 6.0):
    return gamma_trace(rate, seconds, cv=3.0, seed=1)


def test_candidates_propagate_upward_and_never_raise_cost() -> None:
    a = (3, 3, 2, 2, 1)
    cands = _candidates(a)
    assert cands == [(2, 2, 2, 2, 1), (3, 2, 2, 2, 1), (3, 3, 1, 1, 1), (3, 3, 2, 1, 1),
                     (3, 3, 2, 2, 0)]
    for c in cands:
        assert all(x <= y for x, y in zip(c, a, strict=True))
        assert all(b <= a_ for a_, b in itertools.pairwise(c))  # monotone
    assert _candidates((0, 0)) == []
    assert _candidates((2, 1, 1), visited=[False, True, True]) == [(2, 0, 0), (2, 1, 0)]


def test_frontier_plans_are_pareto_and_higher_load_never_gets_a_costlier_cascade() -> None:
    cat = catalog()
    frontier, stats = plan_frontier("op", CASCADES, cat, hardware(), trace(),
                                    settings=PlannerSettings(num_ranges=5, max_rounds=3))
    assert stats.iterations >= 1 and stats.simulations >= 1
    pts = frontier.points()
    assert [p for p, _ in pts] == sorted(p for p, _ in pts)
    assert all(b[1] > a[1] for a, b in itertools.pairwise(pts))  # Pareto: accuracy rises
    ctx = planning_context("op", CASCADES, cat, hardware(), trace(),
                           settings=PlannerSettings(num_ranges=5))
    cost_rank = {c: i for i, c in enumerate(ctx.cascades)}
    for plan in frontier.plans:
        assert fits(plan.placement, cat, hardware())
        if len(set(plan.cascades)) == 1:  # one cascade at every load (also off the ladder)
            continue
        ranks = [cost_rank[plan.cascade_of(k)] for k in range(plan.num_ranges)]
        assert all(b <= a for a, b in itertools.pairwise(ranks)), ranks
    # JSON round trip of the whole frontier
    again = Frontier.from_json(frontier.to_json())
    assert again == frontier


def test_placement_search_never_exceeds_device_memory() -> None:
    cat = catalog()
    hw = Hardware((Device("a", "cpu", 450, 0), Device("b", "cpu", 650, 0),
                   Device("c", "cpu", 300, 1)))
    ctx = planning_context("op", CASCADES, cat, hw, trace(), settings=PlannerSettings(
        num_ranges=4, beam_width=3, expansions=4, max_rounds=6))
    for a in [(4, 4, 4, 4), (3, 2, 1, 0), (2, 2, 1, 1)]:
        plan, _ = search_placement(ctx, a)
        used = memory_used(plan.placement, cat)
        assert all(used[d] <= hw.device(d).memory_bytes for d in used)
        pairs = [(r.model, d) for r in plan.placement for d in r.devices]
        assert len(pairs) == len(set(pairs))
        needed = {m for k in range(plan.num_ranges) for m in plan.cascade_of(k).models}
        assert needed <= {r.model for r in plan.placement}


def test_a_model_that_fits_nowhere_is_a_clear_error() -> None:
    cat = catalog()
    ctx = planning_context("op", CASCADES, cat, hardware(2, mem=300), trace(),
                           settings=PlannerSettings(num_ranges=2))
    with pytest.raises(PlanningError, match="does not fit"):
        search_placement(ctx, (4, 4))
    assert adapt_placement(ctx, (), ["l"]) is None


def test_scheduling_per_range_raises_queues_only_where_needed() -> None:
    cat = catalog()
    ctx = planning_context("op", CASCADES, cat, hardware(1), poisson_trace(300, 4.0, seed=0),
                           settings=PlannerSettings(num_ranges=4))
    a = (4, 4, 4, 4)  # the large model alone: 9 ms per row at batch 1
    plan, metrics = evaluate_plan(ctx, a, full_placement(ctx, a))
    queues = [r.min_queue[0] for r in plan.ranges]
    assert queues[0] == 1  # low load: no batching
    assert queues == sorted(queues)  # more load, bigger batch triggers
    assert metrics.num_requests == len(ctx.trace)


def test_lp_with_a_tensor_parallel_replica_matches_brute_force() -> None:
    # model x on (d0) and on (d0, d1) tensor-parallel; model y on d1
    replicas = {"x": ["d0", ("d0", "d1")], "y": ["d1"]}
    cost = {("x", "d0"): 0.002, ("x", ("d0", "d1")): 0.0015, ("y", "d1"): 0.003}
    demand = {"x": 200.0, "y": 100.0}
    alloc = balance_load(demand, replicas, cost, ["d0", "d1"])

    def objective(share0: float) -> float:
        b0 = demand["x"] * (share0 * 0.002 + (1 - share0) * 0.0015)
        b1 = demand["x"] * (1 - share0) * 0.0015 + demand["y"] * 0.003
        mean = (b0 + b1) / 2
        return abs(b0 - mean) + abs(b1 - mean)

    best = min(objective(s / 1000) for s in range(1001))
    assert alloc.deviation_s_per_s == pytest.approx(best, abs=1e-6)
    assert sum(alloc.shares["x"]) == pytest.approx(1.0)


def test_query_optimizer_meets_targets_and_explains_failure() -> None:
    cat = catalog()
    tr = trace()
    settings = PlannerSettings(num_ranges=4, max_rounds=2)
    f1, _ = plan_frontier("first", CASCADES, cat, hardware(), tr, settings=settings)
    f2, _ = plan_frontier("second", CASCADES[:3], cat, hardware(), tr, settings=settings)
    frontiers = {"first": f1, "second": f2}
    cats = {"first": cat, "second": cat}
    floor = min(p.predicted.accuracy for p in f2.plans)
    q = choose_plans(frontiers, cats, tr, Target(min_accuracy=floor))
    assert [p.operator for p in q.plans] == ["first", "second"]
    assert q.plan_for("second").predicted.accuracy >= floor
    loose = choose_plans(frontiers, cats, tr, Target(max_p95_ms=1e6))
    assert loose.joint.p95_ms <= 1e6
    assert loose.plans[0] == f1.plans[-1]  # nothing to give up: most accurate plans
    with pytest.raises(QueryPlanError, match="no combination"):
        choose_plans(frontiers, cats, tr, Target(max_p95_ms=1e-6))
    with pytest.raises(QueryPlanError, match="no plan reaches"):
        choose_plans(frontiers, cats, tr, Target(min_accuracy=0.999))


def pipeline_sample(cat: Catalog) -> PipelineSample:
    """Rows of four routes through two operators; a row's quality is the mean of the
    catalog's per-row quality of the models that resolved its hops."""
    routes = tuple([(0,), (1,), (0, 1), (1, 0)][q % 4] for q in range(ROWS))
    quality = {}
    for q, route in enumerate(routes):
        for models in itertools.product(cat.models, repeat=len(route)):
            quality[(q, models)] = float(np.mean([cat.quality[m][q] for m in models]))
    return PipelineSample(("first", "second"), routes, quality)


def test_pipeline_optimizer_scores_requests_by_the_models_that_resolved_them() -> None:
    cat = catalog()
    tr = trace(rate=150.0, seconds=3.0)
    sample = pipeline_sample(cat)
    settings = PlannerSettings(num_ranges=2, max_rounds=1)
    one = Cascade(("s", "l"), (0.75,))
    # that cascade alone (no single-model plans beside it)
    only = PlannerSettings(num_ranges=2, max_rounds=1, include_static=False)
    plan_one = {n: plan_frontier(n, (one,), cat, hardware(), tr, settings=only)[0].plans[-1]
                for n in sample.operators}
    point = evaluate_pipeline(list(plan_one.values()), [cat, cat], tr, sample, seed=4)
    # independent: every hop runs the same cascade, so a row's quality is the mean of the
    # cascade's per-row quality over its hops, whatever the order
    per_row = cat.quality_per_row(one)
    rows = sample_rows(len(tr), ROWS, 4)
    assert point.quality == pytest.approx(float(np.mean(
        [per_row[q] for q in rows])))  # both hops of a row see the same sample row
    assert len(point.operator_p95_ms) == 2 and min(point.operator_p95_ms) > 0
    assert point.metrics.p95_ms >= max(point.operator_p95_ms) - 1e-9

    frontiers = {n: plan_frontier(n, CASCADES, cat, hardware(), tr, settings=settings)[0]
                 for n in sample.operators}
    cats = {"first": cat, "second": cat}
    floor = float(np.median([p.quality for p in choose_pipeline(
        frontiers, cats, tr, sample, Target(max_p95_ms=1e9), max_plans=3).points]))
    chosen = choose_pipeline(frontiers, cats, tr, sample, Target(min_accuracy=floor),
                             max_plans=3)
    assert chosen.chosen.quality >= floor
    assert chosen.chosen.metrics.p95_ms == min(p.metrics.p95_ms for p in chosen.points
                                               if p.quality >= floor)
    assert len(chosen.points) == np.prod([min(3, len(f.plans)) for f in frontiers.values()])
    budget = chosen.chosen.metrics.p95_ms
    within = choose_pipeline(frontiers, cats, tr, sample, Target(max_p95_ms=budget),
                             max_plans=3)
    assert within.chosen.metrics.p95_ms <= budget and within.chosen.quality >= floor
    assert max(p.quality for p in chosen.points) < 1.0
    with pytest.raises(QueryPlanError, match="the best reaches"):
        choose_pipeline(frontiers, cats, tr, sample, Target(min_accuracy=1.0), max_plans=3)
    with pytest.raises(QueryPlanError, match="no frontier"):
        choose_pipeline({"first": frontiers["first"]}, cats, tr, sample,
                        Target(min_accuracy=0.1))


def test_target_parsing() -> None:
    assert Target.parse("accuracy >= 0.7") == Target(min_accuracy=0.7)
    assert Target.parse("f1 >= 25%") == Target(min_accuracy=0.25)
    assert Target.parse("accuracy>=70%") == Target(min_accuracy=0.7)
    assert Target.parse("p95 <= 50ms") == Target(max_p95_ms=50)
    with pytest.raises(QueryPlanError, match="cannot read target"):
        Target.parse("fast please")
    with pytest.raises(QueryPlanError, match="exactly one"):
        Target()


def test_a_hop_to_the_devices_is_charged_on_every_batch() -> None:
    cat, tr = catalog(), trace(rate=100.0, seconds=3.0)
    settings = PlannerSettings(num_ranges=1, max_rounds=1, include_static=False)
    hop = Hardware(tuple(Device(f"d{i}", "cpu", 700, 0, dispatch_s=0.004) for i in range(2)))
    assert hop.dispatch_s == 0.004
    assert Hardware.from_json(hop.to_json()) == hop
    assert "dispatch_s" not in hardware().to_json()  # local devices: files as before
    near = plan_frontier("op", CASCADES[:1], cat, hardware(), tr, settings=settings)[0].plans[0]
    far = plan_frontier("op", CASCADES[:1], cat, hop, tr, settings=settings)[0].plans[0]
    assert near.placement == far.placement
    for a, b in zip(near.batch_runtime_s, far.batch_runtime_s, strict=True):
        assert np.allclose(np.array(b) - np.array(a), 0.004)
    assert far.predicted.p50_ms > near.predicted.p50_ms + 3.0  # every request waits a hop
    with pytest.raises(Exception, match="dispatch_s must be >= 0"):
        Device("d", "cpu", 1, 0, dispatch_s=-1.0)
