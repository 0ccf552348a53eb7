"""Loki-style allocation of a pipeline's workers (``ken.optimizer.allocation``): the MILP
against brute force on small pipelines, and the routing it hands to the router."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from ken.errors import KenError
from ken.optimizer.allocation import (
    AllocationProblem,
    Variant,
    allocate,
    most_accurate_first,
    problem_from_sample,
    route_table,
)
from ken.optimizer.query import PipelineSample


def brute_force(problem: AllocationProblem) -> tuple[str, float]:
    """Every integer hosting (one batch size per variant, at most ``workers`` in all), the
    path shares by an LP; step 1 if the most accurate variants can serve everything (then the
    fewest workers), else the greatest expected quality."""
    keys = [(k, v) for k, vs in enumerate(problem.variants) for v in vs]
    per_variant = [[(0, 0)] + [(w, b) for w in range(1, problem.workers + 1)
                               for b in sorted(v.qps)] for _, v in keys]
    paths = problem.paths()
    best_acc = {k: max(vs, key=lambda v: v.accuracy).name
                for k, vs in enumerate(problem.variants)}
    fewest, quality = None, -1.0
    for choice in itertools.product(*per_variant):
        if sum(w for w, _ in choice) > problem.workers:
            continue
        hosts = {(k, v.name): (w, b) for (k, v), (w, b) in zip(keys, choice, strict=True)
                 if w > 0}
        cap = {key: w * problem.variant(*key).qps[b] for key, (w, b) in hosts.items()}
        usable = []
        for p in paths:
            route = problem.routes[p[0]]
            if not all((op, n) in hosts for op, n in zip(route, p[1], strict=True)):
                continue
            lat = sum(problem.variant(op, n).batch_latency_s(hosts[(op, n)][1])
                      for op, n in zip(route, p[1], strict=True))
            if lat <= problem.slo_s / 2 + 1e-9:
                usable.append(p)
        if not usable:
            if quality < 0:
                quality = 0.0
            continue
        a_ub, b_ub = [], []
        for key, c in cap.items():
            row = []
            for p in usable:
                route = problem.routes[p[0]]
                m, load = 1.0, 0.0
                for op, n in zip(route, p[1], strict=True):
                    if (op, n) == key:
                        load += problem.demand_qps * m
                    m *= problem.variant(op, n).factor
                row.append(load)
            a_ub.append(row)
            b_ub.append(c)
        for r, share in enumerate(problem.shares):
            a_ub.append([1.0 if p[0] == r else 0.0 for p in usable])
            b_ub.append(share)
        res = linprog([-problem.accuracy[p] for p in usable], A_ub=a_ub, b_ub=b_ub,
                      bounds=(0, 1), method="highs")
        quality = max(quality, -res.fun)
        only_best = [p for p in usable if all(
            n == best_acc[op] for op, n in zip(problem.routes[p[0]], p[1], strict=True))]
        if only_best:
            full = linprog(np.zeros(len(only_best)),
                           A_ub=[[row[usable.index(p)] for p in only_best]
                                 for row in a_ub[:len(cap)]] or None,
                           b_ub=b_ub[:len(cap)] or None,
                           A_eq=[[1.0 if p[0] == r else 0.0 for p in only_best]
                                 for r in range(len(problem.shares))],
                           b_eq=list(problem.shares), bounds=(0, 1), method="highs")
            used = sum(w for w, _ in hosts.values())
            if full.status == 0 and (fewest is None or used < fewest):
                fewest = used
    if fewest is not None:
        return "hardware", float(fewest)
    return "accuracy", quality


def variants_strategy() -> st.SearchStrategy:
    qps = st.floats(2.0, 40.0)
    return st.builds(
        lambda a1, a2, q1, q2, q3, f: (Variant("small", a1, {1: q1, 4: q3}),
                                       Variant("large", a1 + a2, {1: q2}, factor=f)),
        st.floats(0.2, 0.6), st.floats(0.01, 0.3), qps, st.floats(1.0, 10.0), qps,
        st.sampled_from([1.0, 2.0]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=variants_strategy(), second=variants_strategy(),
       demand=st.floats(1.0, 60.0), workers=st.integers(1, 3),
       slo=st.floats(0.2, 2.0), share=st.sampled_from([1.0, 0.6]),
       seed=st.integers(0, 1000))
def test_allocation_matches_brute_force(first, second, demand, workers, slo, share, seed
                                        ) -> None:
    rng = np.random.default_rng(seed)
    routes = ((0, 1), (0,)) if share < 1 else ((0, 1),)
    shares = (share, 1 - share) if share < 1 else (1.0,)
    variants = (first, second)
    accuracy = {}
    for r, route in enumerate(routes):
        for combo in itertools.product(*(variants[k] for k in route)):
            accuracy[(r, tuple(v.name for v in combo))] = float(
                np.prod([v.accuracy for v in combo]) * rng.uniform(0.9, 1.0))
    problem = AllocationProblem(("a", "b"), variants, routes, shares, accuracy, demand,
                                workers, slo)
    got = allocate(problem)
    step, value = brute_force(problem)
    assert got.step == step
    if step == "hardware":
        assert got.workers_used == value
        assert got.served == pytest.approx(1.0, abs=1e-6)
    else:
        assert got.quality == pytest.approx(value, abs=1e-6)
    # what the allocation promises holds: capacity, workers, latency of every used path
    assert got.workers_used <= workers
    for (op, name), _ in got.hosts.items():
        load = 0.0
        for (r, names), s in got.shares.items():
            m = 1.0
            for k, n in zip(routes[r], names, strict=True):
                if (k, n) == (op, name):
                    load += demand * s * m
                m *= problem.variant(k, n).factor
        assert load <= got.capacity_qps(problem, op, name) * (1 + 1e-6) + 1e-6
    for r, names in got.shares:
        lat = sum(problem.variant(k, n).batch_latency_s(got.hosts[(k, n)][1])
                  for k, n in zip(routes[r], names, strict=True))
        assert lat <= slo / 2 + 1e-6


def two_stage(demand: float, workers: int = 4) -> AllocationProblem:
    small = Variant("small", 0.6, {1: 20.0, 8: 80.0})
    large = Variant("large", 0.8, {1: 5.0, 8: 10.0})
    reader = (Variant("r-small", 0.5, {1: 10.0}), Variant("r-large", 0.7, {1: 4.0}))
    accuracy = {}
    for a in (small, large):
        for b in reader:
            accuracy[(0, (a.name, b.name))] = a.accuracy * b.accuracy
    return AllocationProblem(("detect", "read"), ((small, large), reader), ((0, 1),), (1.0,),
                             accuracy, demand, workers, 2.0)


def test_light_demand_uses_the_most_accurate_variants_on_the_fewest_workers() -> None:
    problem = two_stage(demand=3.0)
    got = allocate(problem)
    assert got.step == "hardware"
    assert set(got.hosts) == {(0, "large"), (1, "r-large")}
    assert got.workers_used == 2
    assert got.quality == pytest.approx(0.8 * 0.7)
    assert route_table(problem, got) == {0: [(("large", "r-large"), pytest.approx(1.0))]}


def test_heavy_demand_scales_accuracy_down_and_routes_the_split() -> None:
    problem = two_stage(demand=30.0)
    got = allocate(problem)
    assert got.step == "accuracy"
    assert got.quality < 0.8 * 0.7
    table = route_table(problem, got)[0]
    assert sum(p for _, p in table) == pytest.approx(got.served)
    assert any(names[1] == "r-small" for names, _ in table)
    text = "\n".join(got.describe(problem))
    assert "accuracy scaling" in text and "read" in text


def test_most_accurate_first_fills_the_best_variant_then_drops() -> None:
    problem = two_stage(demand=3.0)
    got = allocate(problem)
    # batch 8 of "large" would take 0.8 s, over the 1-s half SLO with the reader's 0.25 s
    assert got.hosts == {(0, "large"): (1, 1), (1, "r-large"): (1, 1)}
    routed = most_accurate_first(problem, got, demand_qps=6.0)
    assert routed[0] == [("large", pytest.approx(5.0)), ("drop", pytest.approx(1.0))]
    assert routed[1] == [("r-large", pytest.approx(4.0)), ("drop", pytest.approx(1.0))]
    assert most_accurate_first(problem, got, demand_qps=2.0) == {
        0: [("large", pytest.approx(2.0))], 1: [("r-large", pytest.approx(2.0))]}


def test_bad_problems_are_refused() -> None:
    v = Variant("m", 0.5, {1: 1.0})
    with pytest.raises(KenError, match="positive throughput"):
        Variant("m", 0.5, {1: 0.0})
    with pytest.raises(KenError, match="sum to 1"):
        AllocationProblem(("a",), ((v,),), ((0,),), (0.5,), {(0, ("m",)): 0.5}, 1.0, 1, 1.0)
    with pytest.raises(KenError, match="no measured accuracy"):
        AllocationProblem(("a",), ((v,),), ((0,),), (1.0,), {}, 1.0, 1, 1.0)


def test_problem_from_a_pipeline_sample() -> None:
    sample = PipelineSample(
        ("type", "text", "table"), ((0, 1), (0, 1), (0, 2)),
        {(q, ("t", m)): f for q, m, f in
         [(0, "s", 0.2), (0, "l", 0.6), (1, "s", 0.4), (1, "l", 1.0), (2, "s", 0.0),
          (2, "l", 0.5)]})
    t = Variant("t", 1.0, {1: 100.0})
    s, lg = Variant("s", 0.3, {1: 10.0}), Variant("l", 0.8, {1: 2.0})
    problem = problem_from_sample(sample, [(t,), (s, lg), (s, lg)], 1.0, 4, 4.0)
    assert problem.routes == ((0, 1), (0, 2))
    assert problem.shares == pytest.approx((2 / 3, 1 / 3))
    assert problem.accuracy[(0, ("t", "l"))] == pytest.approx(0.8)
    assert problem.accuracy[(1, ("t", "s"))] == pytest.approx(0.0)
    got = allocate(problem)
    assert got.step == "hardware" and got.quality == pytest.approx(2 / 3 * 0.8 + 1 / 3 * 0.5)


def test_hardware_scaling_takes_the_larger_batch_to_save_a_worker() -> None:
    large = Variant("large", 0.8, {1: 5.0, 8: 10.0})
    small = Variant("small", 0.5, {1: 50.0})
    problem = AllocationProblem(("m",), ((small, large),), ((0,),), (1.0,),
                                {(0, ("small",)): 0.5, (0, ("large",)): 0.8}, 8.0, 6, 4.0)
    got = allocate(problem)
    assert got.step == "hardware"
    assert got.hosts == {(0, "large"): (1, 8)}
    tight = AllocationProblem(("m",), ((small, large),), ((0,),), (1.0,),
                              {(0, ("small",)): 0.5, (0, ("large",)): 0.8}, 8.0, 6, 1.0)
    assert allocate(tight).hosts == {(0, "large"): (2, 1)}  # batch 8 takes 0.8 s > 0.5 s


def test_served_allocation_routes_requests_along_the_paths_it_hosts() -> None:
    from ken.optimizer.allocation import serve_allocation

    problem = two_stage(demand=30.0)
    got = allocate(problem)
    served = serve_allocation(problem, got, [f"gpu{i}" for i in range(4)])
    assert len(served.plans) == len(got.hosts)
    assert sum(len(p.placement) for p in served.plans) == got.workers_used
    for route, (r, names) in zip(served.routes, served.paths, strict=True):
        assert [served.plans[k].operator for k in route] == [
            f"{problem.operators[op]}:{n}" for op, n in zip(problem.routes[r], names,
                                                            strict=True)]
    picks = served.draw(problem, got, 20000, np.random.default_rng(0))
    for j, path in enumerate(served.paths):
        assert np.mean(picks == j) == pytest.approx(got.shares[path], abs=0.02)
    assert np.mean(picks == -1) == pytest.approx(1 - got.served, abs=0.02)
    with pytest.raises(KenError, match="devices given"):
        serve_allocation(problem, got, ["gpu0"])
