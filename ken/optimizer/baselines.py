"""Baseline serving strategies as gear plans (DESIGN.md section 8; paper section 5.2).

Each baseline is a ``GearPlan``, so the simulator and the online engine serve it with exactly the
same policy classes as ken's own plans; only the plan differs:

- ``dynamic_batching_plan``: one model on every device, Triton / Ray Serve style dynamic
  batching: a replica runs once ``max_batch`` rows are queued or the oldest row has waited
  ``max_wait_s`` (one QPS range, no cascade, no switching).
- ``static_plans``: one cascade in every QPS range, with ken's placement search and invocation
  scheduling (the paper's AlpaServe+ when the cascade is chosen knowing the trace, and the
  "no switching" ablation).
- Model switching (MS+) and the other ablations are ``plan_frontier`` runs on restricted inputs
  (single-model cascades; ``PlannerSettings.heuristic_placement``).

``ratio_at_accuracy`` compares two sets of (accuracy, p95) points at matched accuracy, and
``gear_accuracy`` gives a served plan's accuracy without the row-sampling noise of a short run.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ken.models.cascade import Cascade
from ken.optimizer.perf import Catalog
from ken.optimizer.placement import search_placement
from ken.optimizer.plan_context import PlanningContext
from ken.optimizer.plan_eval import batch_runtimes
from ken.optimizer.scheduler import PlanningError
from ken.optimizer.simulator import simulate
from ken.optimizer.workload import Hardware, Trace
from ken.policy.plan import GearPlan, RangeSchedule, Replica

NO_WAIT_S = 1e-4  # "max queue delay 0": plans need a positive wait


def dynamic_batching_plan(operator: str, model: str, catalog: Catalog, hardware: Hardware,
                          qps_max: float, max_batch: int, max_wait_s: float,
                          certainty: str = "max_prob") -> GearPlan:
    """``model`` alone on every device that fits it, requests spread evenly over the replicas,
    each replica batching up to ``max_batch`` rows with a ``max_wait_s`` queue delay."""
    if max_batch < 1:
        raise PlanningError(f"max_batch must be >= 1, got {max_batch}")
    if model not in catalog.perf:
        raise PlanningError(f"no profile of {model!r}; profiled: {', '.join(catalog.models)}")
    devices = [d.id for d in hardware.devices
               if d.memory_bytes >= catalog.perf_on(model, d.id).memory(1)]
    if not devices:
        need = catalog.perf[model].memory(1)
        raise PlanningError(f"{model} ({need / 1e6:.0f} MB) fits on no device")
    n = len(devices)
    placement = tuple(Replica(model, (d,)) for d in devices)
    return GearPlan(
        operator=operator, qps_edges=(0.0, float(qps_max)),
        cascades=(Cascade((model,), (), certainty),),
        placement=placement,
        ranges=(RangeSchedule(0, (1.0 / n,) * n, (max_batch,) * n),),
        max_batch=(max_batch,) * n, max_wait_s=max(max_wait_s, NO_WAIT_S),
        provenance=(("baseline", "dynamic batching"), ("catalog.sample_hash",
                                                       catalog.sample_hash)),
        batch_runtime_s=batch_runtimes(catalog, placement, (max_batch,) * n))


@dataclass(frozen=True)
class Tuned:
    """The best configuration of a grid, and every configuration's simulated p95 (ms)."""

    plan: GearPlan
    grid: tuple[tuple[int, float, float], ...]  # (max_batch, max_wait_s, p95_ms)


def tune_dynamic_batching(operator: str, model: str, catalog: Catalog, hardware: Hardware,
                          trace: Trace, batches: Sequence[int] = (1, 4, 8, 16, 32),
                          waits_s: Sequence[float] = (0.0, 0.005, 0.02), seed: int = 0,
                          qps_max: float | None = None, certainty: str = "max_prob") -> Tuned:
    """The (max batch, max queue delay) pair with the lowest simulated p95 on ``trace``, as an
    operator would tune Triton for a known workload. Batches above the profile are skipped."""
    top = catalog.perf[model].max_batch
    grid = []
    best = None
    for b, w in itertools.product(sorted(set(batches)), sorted(set(waits_s))):
        if b > top:
            continue
        plan = dynamic_batching_plan(operator, model, catalog, hardware,
                                     qps_max or trace.qps_max(), b, w, certainty)
        m = simulate(plan, catalog, trace, seed).metrics(0, plan)
        grid.append((b, w, m.p95_ms))
        if best is None or m.p95_ms < best[1].p95_ms:
            best = (plan, m)
    if best is None:
        raise PlanningError(f"no batch size in {list(batches)} is profiled for {model}")
    return Tuned(best[0].with_predicted(best[1]), tuple(grid))


def static_plans(ctx: PlanningContext) -> list[GearPlan]:
    """Every candidate cascade of ``ctx`` alone in all QPS ranges, placed by ken's beam search
    and scheduled by its LP and queue lengths; sorted from cheapest to most accurate."""
    ranges = ctx.settings.num_ranges
    return [search_placement(ctx, (c,) * ranges)[0] for c in range(len(ctx.cascades))]


def ratio_at_accuracy(baseline: tuple[float, float], ours: Sequence[tuple[float, float]],
                      tolerance: float = 0.005) -> tuple[float, int] | None:
    """``baseline``'s p95 over the lowest p95 among ``ours`` points (accuracy, p95) whose
    accuracy is at least the baseline's minus ``tolerance``; with that point's index.
    None when no point of ours is that accurate."""
    i = best_at_accuracy(ours, baseline[0], tolerance)
    return None if i is None else (baseline[1] / ours[i][1], i)


def best_at_accuracy(points: Sequence[tuple[float, float]], accuracy: float,
                     tolerance: float = 0.005) -> int | None:
    """Index of the lowest-p95 point (accuracy, p95) at least ``accuracy - tolerance``
    accurate: the best a strategy offers at that accuracy (None if it never gets there)."""
    matches = [(p, i) for i, (a, p) in enumerate(points) if a >= accuracy - tolerance]
    return min(matches)[1] if matches else None


def gear_accuracy(plan: GearPlan, catalog: Catalog, ranges: Sequence[int] | np.ndarray) -> float:
    """Accuracy of a served plan without the row-sampling noise: the mean, over requests, of
    the whole-sample accuracy of the cascade of the gear each was admitted in (``ranges``:
    ``SimResult.range_index[k]`` of a simulation or a replay).

    A few hundred replayed rows estimate a cascade's accuracy only to about +-2 points; which
    gear served each request is known exactly, and so is each cascade's accuracy on the whole
    held-out sample, so this is what systems are matched on."""
    acc = np.array([catalog.accuracy(plan.cascade_of(k)) for k in range(plan.num_ranges)])
    ranges = np.asarray(ranges)
    if ranges.size == 0 or (ranges < 0).any():
        raise PlanningError("gear_accuracy needs the gear of every request (all served)")
    return float(acc[ranges].mean())


def served_accuracy(plan: GearPlan, catalog: Catalog, trace: Trace, seed: int = 0) -> float:
    """Accuracy on the rows a replay of ``trace`` sends (``simulator.sample_rows``: the same
    rows as ``ken.engine.replay`` with this seed), each answered by the cascade of the gear the
    simulator serves it in: what a replay of the plan is expected to score on those rows."""
    return simulate(plan, catalog, trace, seed).metrics(0, plan).accuracy


def matched_plan(plans: Sequence[GearPlan], accuracy: float, catalog: Catalog, trace: Trace,
                 seed: int = 0, served: dict[int, float] | None = None) -> int | None:
    """The plan ken serves against a baseline of ``accuracy`` (issue 33's rule): of
    ``plans`` (a frontier, each with ``predicted`` metrics of its planning window), the
    fastest there whose accuracy on ``trace``'s replayed rows (``served_accuracy``) is at
    least ``accuracy``. Its index, or None when no plan is that accurate on those rows.
    ``served``: plan index -> its served accuracy, filled as plans are simulated; pass the
    same dict when matching several baselines on one trace, so no plan is simulated twice."""
    served = {} if served is None else served
    for i in sorted(range(len(plans)), key=lambda i: plans[i].predicted.p95_ms):
        if i not in served:
            served[i] = served_accuracy(plans[i], catalog, trace, seed)
        if served[i] >= accuracy - 1e-12:
            return i
    return None
