"""The gear-plan frontier: the workload adapter over placement search and invocation scheduling
(DESIGN.md sections 5.3-5.5; paper section 4).

``plan_frontier`` starts from the most accurate cascade in every QPS range; each iteration tries,
for every range, the next cheaper cascade there, propagated to all higher ranges (a higher load
never gets a costlier cascade), re-optimises placement (beam search scored by simulated p95,
``placement.py``) and scheduling (load-balancing LP + queue lengths, ``plan_eval.py``) for each
candidate assignment, simulates it, and keeps the candidate with the best ``accuracy / p95``.
Each iteration emits one gear plan; the search stops at "cheapest everywhere" and returns the
Pareto-optimal plans among all the gear plans it simulated on the way (every candidate is a
complete plan).

Costs are kept down by exploiting structure, not by skipping the simulator: the LP's shares do
not change when a cascade's demand is scaled, so one LP per (cascade, placement) serves every
range that uses the cascade; simulated candidates are memoised by (assignment, placement); and
each placement search is warm-started from the previous iteration's placement. The fixed inputs
of a run (settings, cost-ordered cascades, ranges, caches) are in ``plan_context.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from ken.models.cascade import Cascade
from ken.optimizer.baselines import tune_dynamic_batching
from ken.optimizer.pareto import pareto_front
from ken.optimizer.perf import Catalog
from ken.optimizer.placement import adapt_placement, choose_placements, models_of, search_placement
from ken.optimizer.plan_context import (
    Placement,
    PlannerSettings,
    PlannerStats,
    PlanningContext,
    one_cascade_context,
    planning_context,
)
from ken.optimizer.plan_eval import estimate_score, evaluate_many, simulation_pool
from ken.optimizer.scheduler import PlanningError
from ken.optimizer.workload import Hardware, Trace
from ken.policy.metrics import PlanMetrics
from ken.policy.plan import Frontier, GearPlan
from ken.progress import QUIET, Reporter


def _screen_score(ctx: PlanningContext, assignment: Sequence[int], placement: Placement) -> float:
    adapted = adapt_placement(ctx, placement, models_of(ctx, assignment))
    return -np.inf if adapted is None else estimate_score(ctx, assignment, adapted)



# -- workload adapter --------------------------------------------------------------------------


def _candidates(assignment: Sequence[int],
                visited: Sequence[bool] | None = None) -> list[tuple[int, ...]]:
    """Every range's next cheaper cascade, propagated upward; deduplicated, in range order.

    Only ranges the sample trace visits (``visited``) are pivots: the simulator cannot tell
    what a change in a range without requests does; such ranges follow by propagation.
    """
    out: dict[tuple[int, ...], None] = {}
    for i, c in enumerate(assignment):
        if c == 0 or (visited is not None and not visited[i]):
            continue
        new = list(assignment)
        for j in range(i, len(new)):
            new[j] = min(new[j], c - 1)
        out[tuple(new)] = None
    return list(out)


def _score(metrics: PlanMetrics, current: PlanMetrics, kind: str) -> float:
    """``"ratio"``: the paper's ``acc / p95`` of the candidate. ``"tradeoff"``: p95 saved per
    accuracy point given up against the current plan ("minimal accuracy for maximum latency
    reduction"), which takes smaller steps and so emits a denser frontier."""
    if kind == "ratio":
        return metrics.accuracy / max(metrics.p95_ms, 1e-9)
    saved = current.p95_ms - metrics.p95_ms
    lost = max(current.accuracy - metrics.accuracy, 0.0) + 1e-6
    return saved / lost


def pareto_plans(plans: Sequence[GearPlan]) -> list[GearPlan]:
    """Plans not dominated in (lower p95, higher accuracy), sorted by p95 (``pareto_front``'s
    tie rules)."""
    front = pareto_front([(p.predicted.accuracy, p.predicted.p95_ms) for p in plans])
    return [plans[i] for i in front]



def plan_frontier(operator: str, cascades: Sequence[Cascade], catalog: Catalog,
                  hardware: Hardware, trace: Trace, qps_max: float | None = None,
                  settings: PlannerSettings | None = None, reporter: Reporter = QUIET,
                  on_plan: Callable[[GearPlan], None] | None = None,
                  ) -> tuple[Frontier, PlannerStats]:
    """Approximate the latency-accuracy frontier of gear plans for one operator.

    ``cascades``: the candidate set C (e.g. ``pareto_cascades``); it is ordered here by expected
    compute per row, and thinned to steps of at least ``settings.min_accuracy_step`` accuracy
    (the most accurate and the cheapest candidate are always kept).
    ``trace`` is the sample workload the simulator replays; ``qps_max``
    defaults to its peak rate in 1 s buckets. Every batch costs its profiled runtime plus
    ``hardware.dispatch_s`` (the hop to a Ray actor; 0 for local workers).
    """
    settings = settings or PlannerSettings()
    if not cascades:
        raise PlanningError("no candidate cascades; run the cascade search first")
    # devices reached over a hop (Ray actors) pay it on every batch: in the simulated
    # runtimes and in those the plan records for the engine
    catalog = catalog.with_overhead(hardware.dispatch_s)
    t0 = time.perf_counter()
    ctx = planning_context(operator, cascades, catalog, hardware, trace, qps_max, settings)
    if settings.workers > 1:
        ctx.pool = simulation_pool(catalog, trace, settings.workers, settings.seed)
    try:
        return _adapt(ctx, tuple(cascades), trace, catalog, settings, reporter, on_plan, t0)
    finally:
        if ctx.pool is not None:
            ctx.pool.shutdown()


def _adapt(ctx: PlanningContext, candidates: tuple[Cascade, ...], trace: Trace,
           catalog: Catalog, settings: PlannerSettings, reporter: Reporter,
           on_plan: Callable[[GearPlan], None] | None,
           t0: float) -> tuple[Frontier, PlannerStats]:
    """The workload adapter's iterations (see ``plan_frontier``)."""
    operator = ctx.operator
    stats, order, peak = ctx.stats, ctx.cascades, ctx.edges[-1]
    assignment = (len(order) - 1,) * settings.num_ranges
    visited = [bool(w > 0) for w in ctx.range_weights]
    plan, metrics = search_placement(ctx, assignment)
    emitted = [plan]
    if on_plan:
        on_plan(plan)
    reporter.note(f"plan 1: {_summary(plan)}")
    total = (len(order) - 1) * settings.num_ranges
    with reporter.task(f"gear plans for {operator}", total) as advance:
        while settings.max_iterations is None or stats.iterations < settings.max_iterations:
            cands = _candidates(assignment, visited)
            if not cands:
                if not any(assignment):
                    break
                cands = [(0,) * len(assignment)]  # unvisited ranges left: cheapest everywhere
            stats.iterations += 1
            best = None
            if settings.screen and len(cands) > settings.screen:
                cands.sort(key=lambda a: -_screen_score(ctx, a, plan.placement))
                cands = cands[: settings.screen]
            pairs = [(cand, p) for cand in cands
                     for p in choose_placements(ctx, cand, warm=plan.placement)]
            for (cand, _), (p, m) in zip(pairs, evaluate_many(ctx, pairs), strict=True):
                score = _score(m, metrics, settings.score)
                if best is None or score > best[2]:
                    best = (cand, (p, m), score)
            assert best is not None
            advance(sum(assignment) - sum(best[0]))
            assignment, (plan, metrics), _ = best
            emitted.append(plan)
            if on_plan:
                on_plan(plan)
    # every simulated candidate is a complete gear plan: the frontier is the Pareto set of all
    # of them, not only of each iteration's winner
    pool = [p for p, _ in ctx.sim_cache.values()]
    alternatives = one_gear_plans(ctx, candidates, reporter) if settings.include_static else []
    pool += alternatives
    pool += fill_gaps(ctx, pool, settings, reporter)
    pool += polish(ctx, pool, settings, reporter)
    front = pareto_plans(pool)
    # the alternatives the Pareto cut dropped, each serving configuration once
    kept = {p.serving_key() for p in front}
    dropped: dict[str, GearPlan] = {}
    for p in alternatives:
        dropped.setdefault(p.serving_key(), p)
    alts = sorted((p for k, p in dropped.items() if k not in kept),
                  key=lambda p: p.predicted.p95_ms)  # type: ignore[union-attr]
    stats.wall_s = time.perf_counter() - t0
    reporter.note(f"{len(emitted)} gear plans in {stats.wall_s:.1f} s "
                  f"({stats.simulations} simulations); {len(front)} on the frontier, "
                  f"{len(alts)} one-gear alternatives beside it")
    prov = (("trace", trace.name), ("qps_max", f"{peak:g}"),
            ("catalog.sample_hash", catalog.sample_hash), *settings.provenance())
    return Frontier(operator, tuple(front), prov, tuple(alts)), stats



def one_gear_plans(ctx: PlanningContext, candidates: Sequence[Cascade],
                   reporter: Reporter = QUIET) -> list[GearPlan]:
    """Every alternative a user could pick by hand, as a plan that serves one cascade at every
    load: each candidate cascade (also those the adapter's ladder thins out) and each single
    model, with ken's placement search and scheduling; and each single model with dynamic
    batching tuned on the trace (``baselines.tune_dynamic_batching``). All are simulated on
    the planning trace; they join the pool the frontier is the Pareto set of, so at every
    accuracy the frontier's simulated p95 is at most theirs."""
    certainty = candidates[0].certainty
    singles = [Cascade((m,), (), certainty) for m in sorted(ctx.catalog.models)]
    if ctx.settings.only_candidates:  # e.g. a target's certified cascades: nothing else
        singles = [s for s in singles if s in candidates]
    one = one_cascade_context(ctx, [*candidates, *singles])
    ranges = ctx.settings.num_ranges
    out: list[GearPlan] = []
    with reporter.task(f"one-cascade plans for {ctx.operator}",
                       len(one.cascades) + len(singles)) as advance:
        for c in range(len(one.cascades)):
            try:
                search_placement(one, (c,) * ranges)
            except PlanningError:  # e.g. a cascade whose models fit on no device together
                pass
            advance(1)
        out += [p for p, _ in one.sim_cache.values()]
        for single in singles:
            try:
                out.append(tune_dynamic_batching(
                    ctx.operator, single.models[0], ctx.catalog, ctx.hardware, ctx.trace,
                    seed=ctx.settings.seed, qps_max=ctx.edges[-1], certainty=certainty).plan)
            except PlanningError:  # a model that fits on no device
                pass
            advance(1)
    return out


def fill_gaps(ctx: PlanningContext, pool: Sequence[GearPlan], settings: PlannerSettings,
              reporter: Reporter = QUIET) -> list[GearPlan]:
    """Gear plans between frontier neighbours more than ``settings.max_gap`` apart in
    accuracy, so that a user asking for any accuracy gets a plan at most that much above it.

    Between neighbours ``a`` (less accurate) and ``b`` whose gears are both on the adapter's
    ladder, the candidates take ``b``'s cascades in the lowest load ranges and ``a``'s above
    (or the reverse), kept monotone (a higher load never gets a costlier cascade); the one
    whose accuracy, estimated from the trace's share of requests per range, is nearest the
    gap's middle is placed and simulated. At most ``settings.gap_searches`` searches."""
    rank = {c: i for i, c in enumerate(ctx.cascades)}
    added: list[GearPlan] = []
    tried: set[tuple[int, ...]] = set()
    weights = np.asarray(ctx.range_weights)
    for _ in range(settings.gap_searches):
        front = sorted(pareto_plans([*pool, *added]), key=lambda p: p.predicted.accuracy)
        best = None
        for a, b in zip(front, front[1:], strict=False):
            lo, hi = a.predicted.accuracy, b.predicted.accuracy
            if hi - lo <= settings.max_gap:
                continue
            for cand in _mixes(_assignment(a, rank, ctx), _assignment(b, rank, ctx)):
                if cand in tried:
                    continue
                est = float(sum(w * ctx.accuracy(c) for w, c in zip(weights, cand,
                                                                     strict=True)))
                if lo < est < hi:
                    score = (hi - lo, -abs(est - (lo + hi) / 2))
                    if best is None or score > best[0]:
                        best = (score, cand, b)
        if best is None:
            break
        _, cand, b = best
        tried.add(cand)
        try:
            added.append(search_placement(ctx, cand, warm=b.placement)[0])
        except PlanningError:
            continue
    if added:
        reporter.note(f"{len(added)} gear plans placed to fill accuracy gaps over "
                      f"{settings.max_gap:.1%}")
    return added


def polish(ctx: PlanningContext, pool: Sequence[GearPlan], settings: PlannerSettings,
           reporter: Reporter = QUIET) -> list[GearPlan]:
    """Cheaper gears in place: for each frontier plan of two or more gears on the adapter's
    ladder, each of its cascades is swapped, in the ranges that use it, for every cheaper
    ladder cascade at most ``settings.polish_gap`` less accurate on the sample (kept monotone:
    a higher load never gets a costlier cascade), on the plan's placement (adapted where the
    new cascade needs a model it lacks), and simulated. ``settings.polish_rounds`` rounds,
    each on the frontier the last one left.

    The greedy adapter keeps the most accurate cascade in the low-load ranges as long as
    dropping another range scores better, so a gear plan can keep a cascade that costs twice
    as much as one 0.3 points less accurate; at low load that gear still sets the tail (a
    burst catches the requests it admitted). The swaps cost one simulation each and no
    placement search."""
    rank = {c: i for i, c in enumerate(ctx.cascades)}
    added: list[GearPlan] = []
    tried: set[tuple] = set()
    for _ in range(settings.polish_rounds):
        pairs: list[tuple[tuple[int, ...], Placement]] = []
        for plan in pareto_plans([*pool, *added]):
            if len(plan.cascades) < 2:
                continue
            assignment = _assignment(plan, rank, ctx)
            if assignment is None:
                continue
            for c in sorted(set(assignment)):
                for cheaper in range(c - 1, -1, -1):
                    if ctx.accuracy(cheaper) < ctx.accuracy(c) - settings.polish_gap:
                        break
                    cand = [cheaper if a == c else a for a in assignment]
                    for r in range(1, len(cand)):
                        cand[r] = min(cand[r], cand[r - 1])
                    placement = adapt_placement(ctx, plan.placement, models_of(ctx, cand))
                    key = (tuple(cand), placement)
                    if placement is None or key in tried or tuple(cand) == assignment:
                        continue
                    tried.add(key)
                    pairs.append((tuple(cand), placement))
        if not pairs:
            break
        try:
            added += [p for p, _ in evaluate_many(ctx, pairs)]
        except PlanningError:
            break
    if added:
        reporter.note(f"{len(added)} gear plans simulated with cheaper gears in place "
                      f"(within {settings.polish_gap:.1%} accuracy)")
    return added


def _assignment(plan: GearPlan, rank: dict[Cascade, int], ctx: PlanningContext
                ) -> tuple[int, ...] | None:
    """The plan's cascade per load range as indices into ``ctx.cascades``; None when a gear's
    cascade is off the ladder or the plan has other ranges (baselines)."""
    if plan.qps_edges != ctx.edges:
        return None
    out = tuple(rank.get(plan.cascade_of(k), -1) for k in range(plan.num_ranges))
    return None if -1 in out else out


def _mixes(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> list[tuple[int, ...]]:
    """Assignments between ``a`` and ``b``: one's cascades below a load range, the other's
    from it on, made monotone (no costlier cascade at a higher load)."""
    if a is None or b is None:
        return []
    out: dict[tuple[int, ...], None] = {}
    for j in range(1, len(a)):
        for low, high in ((b, a), (a, b)):
            mix = list(low[:j] + high[j:])
            for r in range(1, len(mix)):
                mix[r] = min(mix[r], mix[r - 1])
            out[tuple(mix)] = None
    return [m for m in out if m not in (a, b)]


def _summary(plan: GearPlan) -> str:
    p = plan.predicted
    return (f"accuracy {p.accuracy:.1%}, p95 {p.p95_ms:.1f} ms, {len(plan.gears())} gears, "
            f"{len(plan.placement)} replicas")
