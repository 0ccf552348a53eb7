"""A candidate gear plan scored: an assignment of cascades to QPS ranges on a placement is
scheduled (per range: load-balancing LP shares and raised queue lengths, DESIGN.md section 5.5),
built into a ``GearPlan`` and simulated (memoised, in parallel with ``settings.workers > 1``),
or its p95 estimated analytically for screening (no simulation).

The LP's shares do not change when a cascade's demand is scaled, so one LP per (cascade,
placement) serves every range that uses the cascade; schedules and estimates are cached by the
replicas of the cascade's own models, so they hit when a search adds a replica of another model.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from ken.optimizer.perf import Catalog
from ken.optimizer.plan_context import Placement, PlanningContext
from ken.optimizer.scheduler import (
    Allocation,
    balance_load,
    device_busy,
    raise_queue_lengths,
)
from ken.optimizer.simulator import simulate
from ken.optimizer.workload import Trace
from ken.policy.metrics import PlanMetrics
from ken.policy.plan import GearPlan, RangeSchedule, Replica

# -- invocation scheduling ---------------------------------------------------------------------


def _replica_map(placement: Placement) -> dict[str, list[tuple[str, ...]]]:
    out: dict[str, list[tuple[str, ...]]] = {}
    for r in placement:
        out.setdefault(r.model, []).append(r.devices if r.degree > 1 else r.devices[0])
    return out


def _replica_index(placement: Placement) -> dict[tuple[str, int], int]:
    """``(model, j)`` -> position in ``placement`` of the model's ``j``-th replica."""
    index: dict[tuple[str, int], int] = {}
    seen: dict[str, int] = {}
    for i, r in enumerate(placement):
        index[(r.model, seen.get(r.model, 0))] = i
        seen[r.model] = seen.get(r.model, 0) + 1
    return index


def sub_placement(ctx: PlanningContext, c: int, placement: Placement) -> Placement:
    """The replicas of cascade ``c``'s models: all that its schedule depends on (so caches
    keyed by it hit when the beam search adds a replica of some other model)."""
    models = ctx.cascades[c].models
    return tuple(r for r in placement if r.model in models)


def _allocation(ctx: PlanningContext, c: int, sub: Placement) -> Allocation:
    """LP shares for cascade ``c`` at 1 request/s (valid at every rate: scaling every model's
    demand by the same factor scales the objective and keeps the optimum)."""
    key = (c, sub)
    alloc = ctx.lp_cache.get(key)
    if alloc is None:
        unit = ctx.unit_demand(c)
        replicas = _replica_map(sub)
        if all(len(replicas[m]) == 1 for m in unit):  # nothing to balance
            shares = {m: (1.0,) for m in unit}
            busy = device_busy(unit, replicas, shares, ctx.per_row, ctx.hardware.ids)
            alloc = Allocation(shares, busy, max(busy.values()), 0.0, True)
        else:
            alloc = balance_load(unit, replicas, ctx.per_row, ctx.hardware.ids)
            ctx.stats.lp_solves += 1
        ctx.lp_cache[key] = alloc
    return alloc


def sub_schedule(ctx: PlanningContext, k: int, c: int, sub: Placement) -> RangeSchedule:
    """Shares and raised queue lengths of ``sub``'s replicas for cascade ``c`` in range ``k``
    (at the range's top rate)."""
    key = (k, c, sub)
    hit = ctx.range_cache.get(key)
    if hit is not None:
        return hit
    unit = ctx.unit_demand(c)
    replicas = _replica_map(sub)
    alloc = _allocation(ctx, c, sub)
    top = ctx.edges[k + 1]
    demand = {m: f * top for m, f in unit.items()}
    batch_cap = min(ctx.max_batch(m) for m in unit)
    qp = raise_queue_lengths(demand, replicas, ctx.per_row, ctx.hardware.ids, batch_cap,
                             allocation=alloc)
    index = _replica_index(sub)
    shares = [0.0] * len(sub)
    queues = [1] * len(sub)
    for m in unit:
        for j, share in enumerate(alloc.shares[m]):
            shares[index[(m, j)]] = share
            queues[index[(m, j)]] = qp.queue_lengths[m][j]
    out = RangeSchedule(c, tuple(shares), tuple(queues), qp.feasible)
    ctx.range_cache[key] = out
    return out


def range_schedule(ctx: PlanningContext, k: int, c: int, placement: Placement) -> RangeSchedule:
    """Range ``k``'s schedule for cascade ``c``, laid out per replica of ``placement``
    (replicas of models outside the cascade get share 0 and queue length 1)."""
    models = ctx.cascades[c].models
    part = sub_schedule(ctx, k, c, sub_placement(ctx, c, placement))
    shares = [0.0] * len(placement)
    queues = [1] * len(placement)
    j = 0
    for i, r in enumerate(placement):
        if r.model in models:
            shares[i] = part.shares[j]
            queues[i] = part.min_queue[j]
            j += 1
    return RangeSchedule(c, tuple(shares), tuple(queues), part.feasible)


def schedule_ranges(ctx: PlanningContext, assignment: Sequence[int],
                    placement: Placement) -> tuple[RangeSchedule, ...]:
    """Per range: LP shares and raised queue lengths, laid out per replica of ``placement``."""
    return tuple(range_schedule(ctx, k, c, placement) for k, c in enumerate(assignment))


def build_plan(ctx: PlanningContext, assignment: Sequence[int], placement: Placement) -> GearPlan:
    """A gear plan (without prediction) for an assignment of cascade indices to ranges."""
    used = sorted(set(assignment))
    remap = {c: i for i, c in enumerate(used)}
    ranges = schedule_ranges(ctx, assignment, placement)
    ranges = tuple(RangeSchedule(remap[r.cascade], r.shares, r.min_queue, r.feasible)
                   for r in ranges)
    max_batch = tuple(ctx.max_batch(r.model) for r in placement)
    return GearPlan(
        operator=ctx.operator, qps_edges=ctx.edges,
        cascades=tuple(ctx.cascades[c] for c in used), placement=placement, ranges=ranges,
        max_batch=max_batch,
        max_wait_s=ctx.settings.max_wait_s, alpha=ctx.settings.alpha,
        rate_window_s=ctx.settings.rate_window_s,
        provenance=(("catalog.sample_hash", ctx.catalog.sample_hash),
                    *ctx.settings.provenance()),
        batch_runtime_s=batch_runtimes(ctx.catalog, placement, max_batch))


def batch_runtimes(catalog: Catalog, placement: Sequence[Replica], max_batch: Sequence[int]
                   ) -> tuple[tuple[float, ...], ...]:
    """Per replica, the profiled seconds of batches of 1..max batch rows: the runtimes the
    simulator charges, recorded in the plan for the engine's deadlines and admission."""
    return tuple(tuple(catalog.perf_on(r.model, r.devices).runtime_table(r.degree, b)[1:])
                 for r, b in zip(placement, max_batch, strict=True))


def evaluate_plan(ctx: PlanningContext, assignment: Sequence[int],
                  placement: Placement) -> tuple[GearPlan, PlanMetrics]:
    """Schedule and simulate (memoised by assignment and placement)."""
    key = (tuple(assignment), placement)
    hit = ctx.sim_cache.get(key)
    if hit is not None:
        ctx.stats.memo_hits += 1
        return hit
    plan = build_plan(ctx, assignment, placement)
    t0 = time.perf_counter()
    metrics = simulate(plan, ctx.catalog, ctx.trace, ctx.settings.seed).metrics(0, plan)
    ctx.stats.simulate_s += time.perf_counter() - t0
    ctx.stats.simulations += 1
    result = (plan.with_predicted(metrics), metrics)
    ctx.sim_cache[key] = result
    return result



_WORKER: dict = {}


def simulation_pool(catalog: Catalog, trace: Trace, workers: int,
                    seed: int) -> ProcessPoolExecutor:
    """Processes that simulate candidate plans for ``evaluate_many``."""
    # spawn, not fork: the caller may hold model threads (torch) that fork would break
    return ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(catalog, trace, seed))


def _init_worker(catalog: Catalog, trace: Trace, seed: int) -> None:
    _WORKER.update(catalog=catalog, trace=trace, seed=seed)


def _simulate_in_worker(plan: GearPlan) -> PlanMetrics:
    return simulate(plan, _WORKER["catalog"], _WORKER["trace"], _WORKER["seed"]).metrics(0, plan)


def evaluate_many(ctx: PlanningContext, pairs: Sequence[tuple[Sequence[int], Placement]],
                  ) -> list[tuple[GearPlan, PlanMetrics]]:
    """``evaluate_plan`` for several (assignment, placement) pairs, simulated in parallel
    when ``settings.workers > 1``."""
    todo: dict[tuple, GearPlan] = {}
    for a, p in pairs:
        key = (tuple(a), p)
        if key not in ctx.sim_cache and key not in todo:
            todo[key] = build_plan(ctx, a, p)
    if ctx.pool is not None and len(todo) > 1:
        t0 = time.perf_counter()
        metrics = list(ctx.pool.map(_simulate_in_worker, list(todo.values())))
        ctx.stats.simulate_s += time.perf_counter() - t0
        ctx.stats.simulations += len(todo)
        for (key, plan), m in zip(todo.items(), metrics, strict=True):
            ctx.sim_cache[key] = (plan.with_predicted(m), m)
    return [evaluate_plan(ctx, a, p) for a, p in pairs]



# -- analytic estimate ------------------------------------------------------------------------


def _range_latency(ctx: PlanningContext, k: int, c: int, placement: Placement) -> float:
    """Rough mean latency (s) of range ``k`` under cascade ``c``: per stage, batch runtime
    inflated by the device's load (M/D/1-like ``1 / (1 - rho)``) plus the time to fill the
    batch trigger; an overloaded device counts as 1000 s times its overload."""
    placement = sub_placement(ctx, c, placement)
    key = (k, c, placement)
    hit = ctx.estimate_cache.get(key)
    if hit is not None:
        return hit
    rs = sub_schedule(ctx, k, c, placement)
    rate = max((ctx.edges[k] + ctx.edges[k + 1]) / 2.0, 1e-9)
    unit = ctx.unit_demand(c)
    busy: dict[str, float] = {}
    for i, r in enumerate(placement):
        if rs.shares[i] > 0 and r.model in unit:
            work = rate * unit[r.model] * rs.shares[i] * \
                ctx.per_row(r.model, r.devices, rs.min_queue[i])
            for d in r.devices:
                busy[d] = busy.get(d, 0.0) + work
    latency = 0.0
    for m, frac in unit.items():
        stage = 0.0
        for i, r in enumerate(placement):
            share = rs.shares[i]
            if r.model != m or share <= 0:
                continue
            b = rs.min_queue[i]
            rho = max(busy[d] for d in r.devices)
            if rho >= 1.0:
                stage += share * 1000.0 * rho
                continue
            run = ctx.catalog.perf_on(m, r.devices).batch_runtime(b, r.degree)
            fill = (b - 1) / (2.0 * rate * frac * share) if b > 1 else 0.0
            stage += share * (run / (1.0 - rho) + fill)
        latency += frac * stage
    ctx.estimate_cache[key] = latency
    return latency


def _estimate_parts(ctx: PlanningContext, assignment: Sequence[int],
                    placement: Placement) -> tuple[float, float]:
    """Estimated ``(accuracy, p95 seconds)`` without simulating: accuracy weighted by the
    trace's time in each range, p95 as the weighted 95th percentile of per-range latencies."""
    w = ctx.range_weights
    assert w is not None
    acc = sum(w[k] * ctx.accuracy(c) for k, c in enumerate(assignment))
    lat = [_range_latency(ctx, k, c, placement) for k, c in enumerate(assignment)]
    order = np.argsort(lat)
    cum = np.cumsum(w[order])
    p95 = lat[int(order[min(int(np.searchsorted(cum, 0.95)), len(lat) - 1)])]
    return acc, p95


def estimate_p95(ctx: PlanningContext, assignment: Sequence[int], placement: Placement) -> float:
    return _estimate_parts(ctx, assignment, placement)[1] * 1000.0


def estimate_score(ctx: PlanningContext, assignment: Sequence[int], placement: Placement) -> float:
    """Estimated ``accuracy / p95``, the adapter's score, for screening candidates."""
    acc, p95 = _estimate_parts(ctx, assignment, placement)
    return acc / max(p95, 1e-12)

