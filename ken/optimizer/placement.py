"""Placement search (DESIGN.md section 5.4): which replicas of which models go on which devices
for one assignment of cascades to QPS ranges. A beam search over memory-feasible placements,
scored by simulated p95 (or by the analytic estimate), warm-started from the previous plan's
placement; plus the fixed placements of the ablations (every model everywhere, the simple
heuristic)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from ken.optimizer.perf import Catalog
from ken.optimizer.plan_context import Placement, PlanningContext
from ken.optimizer.plan_eval import (
    estimate_p95,
    evaluate_many,
    evaluate_plan,
    sub_placement,
    sub_schedule,
)
from ken.optimizer.scheduler import PlanningError
from ken.optimizer.workload import Hardware
from ken.policy.metrics import PlanMetrics
from ken.policy.plan import GearPlan, Replica


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


def canonical(placement: Sequence[Replica]) -> Placement:
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


def models_of(ctx: PlanningContext, assignment: Sequence[int]) -> list[str]:
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
    return canonical(kept)



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
    models = models_of(ctx, assignment)
    s = ctx.settings
    if s.full_replication:
        return [full_placement(ctx, assignment)]
    if s.heuristic_placement:
        return [heuristic_placement(models, ctx.hardware, ctx.catalog)]
    if warm is not None and s.placement_scoring == "estimate":
        adapted = adapt_placement(ctx, warm, models)
        if adapted is not None and set(models) <= {r.model for r in warm} and all(
                sub_schedule(ctx, k, c, sub_placement(ctx, c, adapted)).feasible
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
            p = canonical(cand)
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
                q = canonical((*p, new))
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



def full_placement(ctx: PlanningContext, assignment: Sequence[int]) -> Placement:
    """Every model of the assignment on every device (the restricted space of section 5.6)."""
    return canonical([Replica(m, (d,)) for m in models_of(ctx, assignment)
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
        return canonical([Replica(m, (d.id,)) for m in models for d in devices])
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
    return canonical(out)

