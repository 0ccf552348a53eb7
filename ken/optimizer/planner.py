"""The gear-plan frontier: workload adapter, placement beam search, invocation scheduling
(DESIGN.md sections 5.3-5.5; paper section 4).

``plan_frontier`` starts from the most accurate cascade in every QPS range; each iteration tries,
for every range, the next cheaper cascade there, propagated to all higher ranges (a higher load
never gets a costlier cascade), re-optimises placement (beam search scored by simulated p95)
and scheduling (load-balancing LP + queue lengths) for each candidate assignment, simulates it,
and keeps the candidate with the best ``accuracy / p95``. Each iteration emits one gear plan;
the search stops at "cheapest everywhere" and returns the Pareto-optimal plans among all the
gear plans it simulated on the way (every candidate is a complete plan).

Costs are kept down by exploiting structure, not by skipping the simulator: the LP's shares do
not change when a cascade's demand is scaled, so one LP per (cascade, placement) serves every
range that uses the cascade; simulated candidates are memoised by (assignment, placement); and
each placement search is warm-started from the previous iteration's placement.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ken.models.cascade import Cascade
from ken.optimizer.perf import Catalog
from ken.optimizer.scheduler import (
    Allocation,
    PlanningError,
    balance_load,
    device_busy,
    raise_queue_lengths,
)
from ken.optimizer.simulator import simulate
from ken.optimizer.workload import Hardware, Trace
from ken.policy.plan import Frontier, GearPlan, PlanMetrics, RangeSchedule, Replica
from ken.progress import QUIET, Reporter

Placement = tuple[Replica, ...]


@dataclass(frozen=True)
class PlannerSettings:
    """Knobs of the offline search (defaults follow the papers where they give one)."""

    num_ranges: int = 10  # |Q|: equal QPS ranges over [0, qps_max]
    beam_width: int = 2  # bw: placements kept per beam round
    expansions: int = 3  # k: new placements sampled from each beam member per round
    initial_samples: int = 4  # one-replica-per-model placements the beam starts from
    max_rounds: int = 12  # beam rounds per placement search (it also stops on no improvement)
    max_batch: int | None = None  # cap on batch size; None: each model's largest profiled batch
    full_replication: bool = False  # every model on every device (paper section 5.6); no search
    heuristic_placement: bool = False  # the ablation's simple rule (``heuristic_placement``)
    # also place every candidate cascade alone at all loads: the greedy adapter does not visit
    # every static plan, and one of them can beat its gear plans at their accuracy
    include_static: bool = True
    screen: int = 3  # per iteration, candidates simulated after an analytic ranking; 0: all
    max_iterations: int | None = None  # stop the adapter early (None: at cheapest everywhere)
    placement_scoring: str = "simulate"  # or "estimate": see search_placement
    # candidate cascades less than this much more accurate (on the sample) than the next
    # cheaper kept one are dropped: the sample cannot tell them apart, and each would cost the
    # adapter another round of iterations
    min_accuracy_step: float = 0.002
    workers: int = 1  # processes that simulate candidates in parallel
    score: str = "ratio"  # adapter's choice per iteration: "ratio" (paper) or "tradeoff"
    max_wait_s: float = 0.05
    alpha: float = 8.0
    rate_window_s: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise PlanningError(f"workers must be >= 1, got {self.workers}")
        if self.num_ranges < 1 or self.beam_width < 1 or self.expansions < 0 \
                or self.initial_samples < 1 or self.max_rounds < 0 or self.screen < 0:
            raise PlanningError("num_ranges, beam_width and initial_samples must be >= 1; "
                                "expansions and max_rounds >= 0")
        if self.score not in ("ratio", "tradeoff"):
            raise PlanningError(f"score must be 'ratio' or 'tradeoff', got {self.score!r}")
        if self.min_accuracy_step < 0:
            raise PlanningError("min_accuracy_step must be >= 0")
        if self.placement_scoring not in ("simulate", "estimate"):
            raise PlanningError("placement_scoring must be 'simulate' or 'estimate', got "
                                f"{self.placement_scoring!r}")
        if self.max_batch is not None and self.max_batch < 1:
            raise PlanningError(f"max_batch must be >= 1, got {self.max_batch}")

    def provenance(self) -> tuple[tuple[str, str], ...]:
        return tuple((f"planner.{k}", str(v)) for k, v in sorted(vars(self).items()))


@dataclass
class PlannerStats:
    """Counts and time of one planning run (what the paper's Figure 14 reports)."""

    simulations: int = 0
    memo_hits: int = 0
    lp_solves: int = 0
    placement_searches: int = 0
    iterations: int = 0
    wall_s: float = 0.0
    simulate_s: float = 0.0


@dataclass
class PlanningContext:
    """Everything fixed during one planning run."""

    operator: str
    cascades: tuple[Cascade, ...]  # sorted cheapest first
    catalog: Catalog
    hardware: Hardware
    trace: Trace
    edges: tuple[float, ...]
    settings: PlannerSettings
    stats: PlannerStats
    fractions: dict[int, tuple[float, ...]] = field(default_factory=dict)
    accuracies: dict[int, float] = field(default_factory=dict)
    lp_cache: dict = field(default_factory=dict)
    range_cache: dict = field(default_factory=dict)
    estimate_cache: dict = field(default_factory=dict)
    range_weights: np.ndarray | None = None  # fraction of trace requests arriving per range
    pool: Any = None  # a process pool for simulations (settings.workers > 1)
    sim_cache: dict = field(default_factory=dict)

    def max_batch(self, model: str) -> int:
        top = self.catalog.perf[model].max_batch
        cap = self.settings.max_batch
        return top if cap is None else min(top, cap)

    def stage_fractions(self, c: int) -> tuple[float, ...]:
        if c not in self.fractions:
            self.fractions[c] = self.catalog.stage_fractions(self.cascades[c])
        return self.fractions[c]

    def accuracy(self, c: int) -> float:
        if c not in self.accuracies:
            self.accuracies[c] = self.catalog.accuracy(self.cascades[c])
        return self.accuracies[c]

    def unit_demand(self, c: int) -> dict[str, float]:
        """Rows per second each model of cascade ``c`` sees per 1 request per second."""
        return dict(zip(self.cascades[c].models, self.stage_fractions(c), strict=True))

    def per_row(self, model: str, devices: str | tuple[str, ...], batch: int) -> float:
        """Seconds per row of ``model`` on ``devices`` (a replica's; "" for the default
        device kind) in batches of ``batch``."""
        degree = 1 if isinstance(devices, str) else len(devices)
        return self.catalog.perf_on(model, devices).per_row_s(
            min(batch, self.max_batch(model)), degree)


def qps_edges(qps_max: float, num_ranges: int) -> tuple[float, ...]:
    if not qps_max > 0:
        raise PlanningError(f"qps_max must be > 0, got {qps_max}")
    return tuple(float(x) for x in np.linspace(0.0, qps_max, num_ranges + 1))


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


def _sub_placement(ctx: PlanningContext, c: int, placement: Placement) -> Placement:
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


def _sub_schedule(ctx: PlanningContext, k: int, c: int, sub: Placement) -> RangeSchedule:
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
    part = _sub_schedule(ctx, k, c, _sub_placement(ctx, c, placement))
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


# -- analytic screening ------------------------------------------------------------------------


def range_weights(trace: Trace, edges: Sequence[float], window_s: float) -> np.ndarray:
    """Fraction of the trace's requests that arrive in a rate-meter window whose rate falls
    in each QPS range."""
    buckets = np.floor(trace.arrival_s / window_s).astype(np.int64)
    counts = np.bincount(buckets)
    rates = counts / window_s
    k = np.clip(np.searchsorted(np.asarray(edges), rates, side="right") - 1, 0, len(edges) - 2)
    weights = np.bincount(k, weights=counts, minlength=len(edges) - 1)
    return weights / weights.sum()


def _range_latency(ctx: PlanningContext, k: int, c: int, placement: Placement) -> float:
    """Rough mean latency (s) of range ``k`` under cascade ``c``: per stage, batch runtime
    inflated by the device's load (M/D/1-like ``1 / (1 - rho)``) plus the time to fill the
    batch trigger; an overloaded device counts as 1000 s times its overload."""
    placement = _sub_placement(ctx, c, placement)
    key = (k, c, placement)
    hit = ctx.estimate_cache.get(key)
    if hit is not None:
        return hit
    rs = _sub_schedule(ctx, k, c, placement)
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


def _screen_score(ctx: PlanningContext, assignment: Sequence[int], placement: Placement) -> float:
    adapted = adapt_placement(ctx, placement, _models_of(ctx, assignment))
    return -np.inf if adapted is None else estimate_score(ctx, assignment, adapted)


# -- placement ---------------------------------------------------------------------------------


def memory_used(placement: Placement, catalog: Catalog) -> dict[str, int]:
    used: dict[str, int] = {}
    for r in placement:
        need = catalog.perf_on(r.model, r.devices).memory(r.degree)
        for d in r.devices:
            used[d] = used.get(d, 0) + need
    return used


def fits(placement: Placement, catalog: Catalog, hardware: Hardware) -> bool:
    """Memory-feasible and no model twice on one device."""
    used = memory_used(placement, catalog)
    if any(used[d] > hardware.device(d).memory_bytes for d in used):
        return False
    pairs = [(r.model, d) for r in placement for d in r.devices]
    return len(pairs) == len(set(pairs))


def _canonical(placement: Sequence[Replica]) -> Placement:
    return tuple(sorted(placement, key=lambda r: (r.model, r.devices)))


def _sample_replica(rng: random.Random, ctx: PlanningContext, placement: Placement,
                    model: str) -> Replica | None:
    """A random memory-feasible new replica of ``model`` (None if none fits)."""
    perf = ctx.catalog.perf[model]
    used = memory_used(placement, ctx.catalog)
    hosting = {d for r in placement if r.model == model for d in r.devices}
    options = []
    for degree in perf.degrees:
        by_node: dict[int, list[str]] = {}
        for dev in ctx.hardware.devices:
            need = ctx.catalog.perf_on(model, dev.id).memory(degree)
            if dev.id not in hosting and used.get(dev.id, 0) + need <= dev.memory_bytes:
                by_node.setdefault(dev.node, []).append(dev.id)
        options += [(degree, devs) for devs in by_node.values() if len(devs) >= degree]
    if not options:
        return None
    degree, devs = rng.choice(options)
    return Replica(model, tuple(sorted(rng.sample(devs, degree))))


def _models_of(ctx: PlanningContext, assignment: Sequence[int]) -> list[str]:
    return sorted({m for c in set(assignment) for m in ctx.cascades[c].models})


def adapt_placement(ctx: PlanningContext, placement: Placement,
                    models: Sequence[str]) -> Placement | None:
    """``placement`` reduced to ``models``, plus one replica of each missing model on the
    device with the most free memory (None if a missing model fits nowhere)."""
    kept = [r for r in placement if r.model in models]
    for m in models:
        if any(r.model == m for r in kept):
            continue
        used = memory_used(tuple(kept), ctx.catalog)
        free = sorted(((d.memory_bytes - used.get(d.id, 0)
                        - ctx.catalog.perf_on(m, d.id).memory(1), d.id)
                       for d in ctx.hardware.devices), reverse=True)
        if not free or free[0][0] < 0:
            return None
        kept.append(Replica(m, (free[0][1],)))
    return _canonical(kept)


def _latency_key(metrics: PlanMetrics) -> float:
    return metrics.p95_ms


def search_placement(ctx: PlanningContext, assignment: Sequence[int],
                     warm: Placement | None = None) -> tuple[GearPlan, PlanMetrics]:
    """Beam search over placements for one assignment; the best simulated plan."""
    results = evaluate_many(ctx, [(assignment, p)
                                  for p in choose_placements(ctx, assignment, warm)])
    return min(results, key=lambda r: _latency_key(r[1]))


def choose_placements(ctx: PlanningContext, assignment: Sequence[int],
                      warm: Placement | None = None) -> list[Placement]:
    """The placements worth simulating for an assignment (the final beam).

    With ``placement_scoring="simulate"`` every placement in the beam is scored by simulated p95
    latency (the paper's method). With ``"estimate"`` expansions are ranked by the analytic
    estimate and only the best final placement is simulated; and the previous plan's placement
    (``warm``) is kept without a search when it already hosts every model of the assignment and
    the scheduler finds every range feasible on it — a cheaper assignment seldom needs more.
    """
    models = _models_of(ctx, assignment)
    s = ctx.settings
    if s.full_replication:
        return [full_placement(ctx, assignment)]
    if s.heuristic_placement:
        return [heuristic_placement(models, ctx.hardware, ctx.catalog)]
    if warm is not None and s.placement_scoring == "estimate":
        adapted = adapt_placement(ctx, warm, models)
        if adapted is not None and set(models) <= {r.model for r in warm} and all(
                _sub_schedule(ctx, k, c, _sub_placement(ctx, c, adapted)).feasible
                for k, c in enumerate(assignment)):
            return [adapted]
    ctx.stats.placement_searches += 1
    rng = random.Random(hash((s.seed, tuple(assignment))) & 0xFFFFFFFF)
    starts: list[Placement] = []
    if warm is not None:
        adapted = adapt_placement(ctx, warm, models)
        if adapted is not None:
            starts.append(adapted)
    tries = 0
    # a warm start needs fewer random company: one sample keeps the beam from getting stuck
    wanted = 1 + len(starts) if starts else s.initial_samples
    while len(starts) < wanted and tries < 20 * s.initial_samples:
        tries += 1
        cand: list[Replica] = []
        for m in rng.sample(models, len(models)):
            new = _sample_replica(rng, ctx, tuple(cand), m)
            if new is None:
                break
            cand.append(new)
        else:
            p = _canonical(cand)
            if p not in starts:
                starts.append(p)
    if not starts:
        raise PlanningError(f"no memory-feasible placement of {models} on "
                            f"{len(ctx.hardware.devices)} devices: a model does not fit")
    simulated = s.placement_scoring == "simulate"

    def latency(p: Placement) -> float:
        if simulated:
            return evaluate_plan(ctx, assignment, p)[1].p95_ms
        return estimate_p95(ctx, assignment, p)

    need = _peak_need(ctx, assignment, models)
    scored = sorted(((latency(p), p) for p in starts), key=lambda x: x[0])
    beam = scored[: s.beam_width]
    best = beam[0][0]
    for _ in range(s.max_rounds):
        pool = list(beam)
        seen = {p for _, p in pool}
        for _, p in beam:
            for _ in range(s.expansions):
                m = _pick_model_to_replicate(rng, need, p)
                new = _sample_replica(rng, ctx, p, m)
                if new is None:
                    continue
                q = _canonical((*p, new))
                if q in seen:
                    continue
                seen.add(q)
                pool.append((latency(q), q))
        pool.sort(key=lambda x: x[0])
        beam = pool[: s.beam_width]
        if beam[0][0] >= best:
            break
        best = beam[0][0]
    # the final beam is scored by simulation (in estimate mode only its best member)
    return [p for _, p in beam[: None if simulated else 1]]


def _peak_need(ctx: PlanningContext, assignment: Sequence[int],
               models: Sequence[str]) -> dict[str, float]:
    """Device seconds per second each model needs at the peak rate (largest over the
    assignment's cascades, at its largest batch)."""
    peak = ctx.edges[-1]
    need = dict.fromkeys(models, 0.0)
    for c in set(assignment):
        for m, f in ctx.unit_demand(c).items():
            need[m] = max(need[m], f * peak * ctx.per_row(m, "", ctx.max_batch(m)))
    return need


def _pick_model_to_replicate(rng: random.Random, need: dict[str, float],
                             placement: Placement) -> str:
    """Sample a model, weighted by its peak need per replica (a model that is busy and has
    few replicas is the one that gains from another copy)."""
    models = list(need)
    count = {m: sum(1 for r in placement if r.model == m) for m in models}
    weights = [need[m] / count[m] + 1e-12 for m in models]
    return rng.choices(models, weights=weights, k=1)[0]


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
    """Plans not dominated in (lower p95, higher accuracy), sorted by p95."""
    pts = sorted(plans, key=lambda p: (p.predicted.p95_ms, -p.predicted.accuracy))
    out: list[GearPlan] = []
    best_acc = -1.0
    for p in pts:
        if p.predicted.accuracy > best_acc:
            out.append(p)
            best_acc = p.predicted.accuracy
    return out


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
        # spawn, not fork: the caller may hold model threads (torch) that fork would break
        ctx.pool = ProcessPoolExecutor(settings.workers, multiprocessing.get_context("spawn"),
                                       initializer=_init_worker,
                                       initargs=(catalog, trace, settings.seed))
    try:
        return _adapt(ctx, trace, catalog, settings, reporter, on_plan, t0)
    finally:
        if ctx.pool is not None:
            ctx.pool.shutdown()


def _adapt(ctx: PlanningContext, trace: Trace, catalog: Catalog, settings: PlannerSettings,
           reporter: Reporter, on_plan: Callable[[GearPlan], None] | None,
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
    if settings.include_static:
        with reporter.task(f"static plans for {operator}", len(order)) as advance:
            for c in range(len(order)):
                search_placement(ctx, (c,) * settings.num_ranges)
                advance(1)
    # every simulated candidate is a complete gear plan: the frontier is the Pareto set of all
    # of them, not only of each iteration's winner
    front = pareto_plans([p for p, _ in ctx.sim_cache.values()])
    stats.wall_s = time.perf_counter() - t0
    reporter.note(f"{len(emitted)} gear plans in {stats.wall_s:.1f} s "
                  f"({stats.simulations} simulations); {len(front)} on the frontier")
    prov = (("trace", trace.name), ("qps_max", f"{peak:g}"),
            ("catalog.sample_hash", catalog.sample_hash), *settings.provenance())
    return Frontier(operator, tuple(front), prov), stats


def planning_context(operator: str, cascades: Sequence[Cascade], catalog: Catalog,
                     hardware: Hardware, trace: Trace, qps_max: float | None = None,
                     settings: PlannerSettings | None = None) -> PlanningContext:
    """The fixed inputs of a planning run; ``ctx.cascades`` is ``cascades`` ordered by cost.

    Exposed so benchmarks can score assignments (``evaluate_plan``) the same way."""
    settings = settings or PlannerSettings()
    order = _by_cost(cascades, catalog, settings)
    peak = trace.qps_max() if qps_max is None else qps_max
    ctx = PlanningContext(operator, order, catalog, hardware, trace,
                          qps_edges(peak, settings.num_ranges), settings, PlannerStats())
    ctx.range_weights = range_weights(trace, ctx.edges, settings.rate_window_s)
    return ctx


def full_placement(ctx: PlanningContext, assignment: Sequence[int]) -> Placement:
    """Every model of the assignment on every device (the restricted space of section 5.6)."""
    return _canonical([Replica(m, (d,)) for m in _models_of(ctx, assignment)
                       for d in ctx.hardware.ids])


def heuristic_placement(models: Sequence[str], hardware: Hardware,
                        catalog: Catalog) -> Placement:
    """The simple placement rule of the paper's ablation (section 5.7), without search.

    If all ``models`` fit on one device together, every device holds all of them (collocated,
    and replicated so no device idles); otherwise each model gets devices of its own (device
    ``i`` goes to model ``i mod len(models)``). Raises ``PlanningError`` when neither fits.
    """
    models = sorted(dict.fromkeys(models))
    devices = hardware.devices
    if all(d.memory_bytes >= sum(catalog.perf_on(m, d.id).memory(1) for m in models)
           for d in devices):
        return _canonical([Replica(m, (d.id,)) for m in models for d in devices])
    if len(models) > len(devices):
        raise PlanningError(f"the placement heuristic cannot place {models} on "
                            f"{len(devices)} devices: they do not fit on one together and "
                            "there are fewer devices than models")
    out = []
    for i, d in enumerate(devices):
        m = models[i % len(models)]
        if catalog.perf_on(m, d.id).memory(1) > d.memory_bytes:
            raise PlanningError(f"{m} does not fit on device {d.id}")
        out.append(Replica(m, (d.id,)))
    return _canonical(out)


def _by_cost(cascades: Sequence[Cascade], catalog: Catalog,
             settings: PlannerSettings) -> tuple[Cascade, ...]:
    """Candidates ordered by expected device seconds per row (cheapest first)."""
    def cost(c: Cascade) -> float:
        fr = catalog.stage_fractions(c)
        total = 0.0
        for m, f in zip(c.models, fr, strict=True):
            perf = catalog.perf[m]
            b = perf.max_batch if settings.max_batch is None else min(perf.max_batch,
                                                                      settings.max_batch)
            total += f * perf.per_row_s(b)
        return total

    unique = list(dict.fromkeys(cascades))
    ranked = sorted(unique, key=lambda c: (cost(c), -catalog.accuracy(c)))
    # Pareto under this cost (batch sizes may differ from the cascade search's): drop every
    # cascade that a cheaper one matches in accuracy
    ordered = []
    for c in ranked:
        if not ordered or catalog.accuracy(c) > catalog.accuracy(ordered[-1]):
            ordered.append(c)
    # walk down from the most accurate; keep the cheapest (the "cheapest everywhere" anchor)
    kept = [ordered[-1]]
    for c in reversed(ordered[:-1]):
        acc = catalog.accuracy(c)
        if acc <= catalog.accuracy(kept[-1]) - settings.min_accuracy_step or c is ordered[0]:
            kept.append(c)
    return tuple(reversed(kept))


def _summary(plan: GearPlan) -> str:
    p = plan.predicted
    return (f"accuracy {p.accuracy:.1%}, p95 {p.p95_ms:.1f} ms, {len(plan.gears())} gears, "
            f"{len(plan.placement)} replicas")
