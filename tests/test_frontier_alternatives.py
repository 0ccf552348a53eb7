"""The frontier contains every alternative a user could pick by hand (issue 33, item 1): on
random catalogs, every single model and every candidate cascade served alone at every load
(with ken's placement and scheduling, and each model with tuned dynamic batching) is matched
by a frontier plan at least as accurate and at most as slow, on the planning trace; and the
frontier has no accuracy gap that a mix of its neighbours' gears could fill."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ken.models.cascade import Cascade
from ken.optimizer.baselines import tune_dynamic_batching
from ken.optimizer.perf import Catalog, ModelPerf
from ken.optimizer.placement import search_placement
from ken.optimizer.plan_context import one_cascade_context
from ken.optimizer.planner import PlannerSettings, fill_gaps, plan_frontier, planning_context
from ken.optimizer.scheduler import PlanningError
from ken.optimizer.workload import Device, Hardware, gamma_trace
from ken.policy.plan import Frontier

ROWS = 300
SIZES = (1, 4, 16)


def random_catalog(seed: int, n_models: int) -> Catalog:
    """Models of random skill, speed and memory, with certainties correlated to correctness."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(ROWS)
    perf, quality, probs = {}, {}, {}
    for i in range(n_models):
        name = f"m{i}"
        skill, ms = rng.uniform(0.2, 1.5), rng.uniform(0.5, 8.0)
        p = 1 / (1 + np.exp(-(2 * (skill - z) + rng.standard_normal(ROWS))))
        quality[name] = (p > 0.5).astype(np.float64)
        probs[name] = np.column_stack([p, 1 - p])
        per_batch = tuple(ms / 1000 * (1 + rng.uniform(0.1, 0.5) * (b - 1)) for b in SIZES)
        perf[name] = ModelPerf(name, SIZES, (per_batch,), (int(rng.integers(100, 400)),))
    return Catalog(perf, quality, probs, f"random-{seed}")


def random_cascades(seed: int, models: list[str]) -> list[Cascade]:
    rng = np.random.default_rng(seed + 1)
    out = []
    for a, b in itertools.permutations(models, 2):
        out.append(Cascade((a, b), (float(rng.uniform(0.6, 0.95)),)))
    return out


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n_models=st.integers(2, 3))
def test_frontier_matches_every_single_model_and_static_cascade(seed: int, n_models: int) -> None:
    cat = random_catalog(seed, n_models)
    cands = random_cascades(seed, sorted(cat.models))
    hw = Hardware(tuple(Device(f"d{i}", "cpu", 700, 0) for i in range(2)))
    tr = gamma_trace(200.0, 3.0, cv=3.0, seed=seed)
    s = PlannerSettings(num_ranges=3, max_rounds=2, seed=seed)
    frontier, _ = plan_frontier("op", cands, cat, hw, tr, settings=s)
    ours = [(p.predicted.accuracy, p.predicted.p95_ms) for p in frontier.plans]

    # the alternatives, built independently of the planner's pool: every candidate cascade
    # (none thinned out) and every single model alone at all loads, and each model with
    # dynamic batching tuned on the same trace
    ctx = planning_context("op", cands, cat, hw, tr, settings=s)
    singles = [Cascade((m,)) for m in sorted(cat.models)]
    one = one_cascade_context(ctx, [*cands, *singles])
    assert set(one.cascades) == {*cands, *singles}
    alternatives = [search_placement(one, (c,) * s.num_ranges)[1]
                    for c in range(len(one.cascades))]
    alternatives += [tune_dynamic_batching("op", m, cat, hw, tr, seed=seed,
                                           qps_max=ctx.edges[-1]).plan.predicted
                     for m in sorted(cat.models)]
    for m in alternatives:
        assert any(a >= m.accuracy - 1e-12 and p <= m.p95_ms + 1e-9 for a, p in ours), (
            f"no frontier plan at {m.accuracy:.2%} with p95 <= {m.p95_ms:.1f} ms: {ours}")
    # and each alternative is itself servable: on the frontier or kept beside it (another
    # window may need the plain cascade, where a gear plan that beat it here shifts down)
    servable = {p.serving_key() for p in frontier.all_plans}
    for c in range(len(one.cascades)):
        plan = search_placement(one, (c,) * s.num_ranges)[0]
        assert plan.serving_key() in servable, plan.headline()
    assert not {p.serving_key() for p in frontier.plans} & {
        p.serving_key() for p in frontier.alternatives}
    assert Frontier.from_json(frontier.to_json()).all_plans == frontier.all_plans


def test_gaps_between_frontier_neighbours_are_filled_where_their_gears_mix() -> None:
    cat = random_catalog(7, 3)
    cands = random_cascades(7, sorted(cat.models))
    hw = Hardware(tuple(Device(f"d{i}", "cpu", 700, 0) for i in range(2)))
    tr = gamma_trace(300.0, 4.0, cv=3.0, seed=3)
    coarse = PlannerSettings(num_ranges=4, max_rounds=2, max_gap=1.0)  # no filling
    fine = PlannerSettings(num_ranges=4, max_rounds=2, max_gap=0.002, gap_searches=20)

    def widest(settings: PlannerSettings) -> float:
        f, _ = plan_frontier("op", cands, cat, hw, tr, settings=settings)
        accs = sorted(p.predicted.accuracy for p in f.plans)
        return max(b - a for a, b in itertools.pairwise(accs))

    assert widest(fine) <= widest(coarse)
    # fill_gaps only adds plans between neighbours, each a gear mix on the ladder
    ctx = planning_context("op", cands, cat, hw, tr, settings=fine)
    f, _ = plan_frontier("op", cands, cat, hw, tr, settings=coarse)
    added = fill_gaps(ctx, list(f.plans), fine)
    accs = [p.predicted.accuracy for p in f.plans]
    for p in added:
        assert set(p.cascades) <= set(ctx.cascades)
        assert min(accs) <= p.predicted.accuracy <= max(accs) + 0.05


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n_models=st.integers(2, 3),
       gap=st.sampled_from([0.0, 0.02, 0.2, 1.0]))
def test_polish_swaps_each_gear_for_every_close_cheaper_cascade(seed: int, n_models: int,
                                                                gap: float) -> None:
    """``polish`` (one round) on a gear plan that runs the costliest ladder cascade below the
    middle load and the cheapest above simulates exactly the swaps a brute-force enumeration
    gives; and a polished frontier is at least as good as the unpolished one everywhere."""
    from dataclasses import replace

    from ken.optimizer.placement import adapt_placement, models_of
    from ken.optimizer.planner import _assignment, polish

    cat = random_catalog(seed, n_models)
    cands = random_cascades(seed, sorted(cat.models))
    hw = Hardware(tuple(Device(f"d{i}", "cpu", 700, 0) for i in range(2)))
    tr = gamma_trace(200.0, 3.0, cv=3.0, seed=seed)
    s = PlannerSettings(num_ranges=4, max_rounds=2, seed=seed, polish_gap=gap, polish_rounds=1)
    ctx = planning_context("op", cands, cat, hw, tr, settings=s)
    top = len(ctx.cascades) - 1
    if top < 1:
        return
    a = (top, top, 0, 0)
    try:
        plan = search_placement(ctx, a)[0]
    except PlanningError:  # the models do not fit on the two devices together
        return
    expected = set()
    for c, cheaper in itertools.product(set(a), range(len(ctx.cascades))):
        if cheaper < c and all(ctx.accuracy(x) >= ctx.accuracy(c) - gap
                               for x in range(cheaper, c)):
            cand = [cheaper if x == c else x for x in a]
            cand = [min(cand[: i + 1]) for i in range(len(cand))]
            if tuple(cand) != a and adapt_placement(ctx, plan.placement,
                                                    models_of(ctx, cand)) is not None:
                expected.add(tuple(cand))
    rank = {c: i for i, c in enumerate(ctx.cascades)}
    got = [_assignment(p, rank, ctx) for p in polish(ctx, [plan], s)]
    assert sorted(got) == sorted(expected)
    if gap == 1.0:  # every cheaper cascade is close enough: each gear tries them all
        assert (0, 0, 0, 0) in got
    plain, _ = plan_frontier("op", cands, cat, hw, tr, settings=replace(s, polish_rounds=0))
    polished, _ = plan_frontier("op", cands, cat, hw, tr, settings=s)
    for p in plain.plans:
        assert any(q.predicted.accuracy >= p.predicted.accuracy - 1e-12
                   and q.predicted.p95_ms <= p.predicted.p95_ms + 1e-9
                   for q in polished.plans)
