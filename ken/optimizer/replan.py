"""Re-planning a gear operator from what serving saw (issue 33, re-planning online).

``GearReplan`` is what the engine's ``Replanner`` calls when a ``DriftWatch`` says the workload
left what the plan covers: it plans a new frontier on the recent arrivals (their peak, with
``headroom``) and picks the plan for the user's target, as ``session.plan`` would, but a
latency target at ``margin`` (half) of itself: the new plan must also drain the backlog the
drift left queued. When the
inputs got harder (a stage passes on more rows than the profiling sample said),
``resampled_catalog`` first re-weights the sample's rows so that the first stage escalates at
the measured rate, and the planner simulates those rows from then on. When the model calls
ran slower or faster than the plan's runtimes (a *runtime* drift), ``scaled_catalog`` scales
every runtime by the factor measured, and the planner plans with those from then on.

Online planning competes with serving for the machine, so its default settings are lighter
than ``ken plan``'s (fewer load ranges and placement rounds, analytic placement scoring).
Even so a re-plan takes seconds, and most when it is most needed: on a machine the load
overwhelms, the planner (a niced process) gets the cores last; in the robustness benchmark one
took 18 s after the rate doubled, and the backlog of those 18 s was never drained. So on a rate
or latency drift ``stopgap`` first picks, without simulating, one of the one-gear plans the
operator was planned with (``fallbacks``) whose cascade sustains the load, and the replanner
swaps it in at once; the full re-plan follows and replaces it.

Both judge capacity by a model (``sustained_qps``, the planner's simulator), and on a machine
whose cores the load generator, the router and the planner share with the workers, that model
is optimistic: in the robustness benchmark a cascade it put at about 120 qps fell behind at
89. So where serving fell behind the arrivals on a rate or latency drift (``Drift.saturated``), the
rate it answered is taken as what the gear then serving sustains here, and its ratio to the
model (``served_share``) scales the rest: the stop-gap counts every fallback's capacity at that
share, and the re-plan plans with every runtime divided by it (``scaled_catalog``, not kept:
the next drift measures afresh), so its gears, predictions and batch runtimes are those of the
machine as it served.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ken.errors import QueryPlanError
from ken.models.cascade import Cascade
from ken.optimizer.perf import Catalog, sustained_qps
from ken.optimizer.planner import PlannerSettings, plan_frontier
from ken.optimizer.query import Target, choose_plans
from ken.optimizer.scheduler import PlanningError
from ken.optimizer.workload import Hardware, Trace
from ken.policy.drift import Drift, expected_escalation
from ken.policy.plan import GearPlan
from ken.policy.scheduling import GearSelector

#: a saturated plan's measured share of its modelled capacity is trusted down to this (a
#: window that answered next to nothing says the machine stalled, not that it is 10x slower)
MIN_SHARE = 0.2

#: the least share of a latency target a re-plan plans for (``GearReplan.margin`` halves
#: with each latency drift the p95 of the answers found)
MIN_MARGIN = 0.125

#: lighter than ``ken plan``'s: a re-plan runs while the devices serve
ONLINE_SETTINGS = PlannerSettings(num_ranges=6, max_rounds=4, beam_width=2, expansions=2,
                                  placement_scoring="estimate", gap_searches=4)


def resampled_catalog(catalog: Catalog, cascade: Cascade, escalation: float,
                      seed: int = 0) -> Catalog:
    """``catalog`` with its sample rows drawn again (as many, with replacement) so that the
    first stage of ``cascade`` passes on ``escalation`` of them: rows it passes on are drawn
    with weight ``escalation / share``, the others ``(1 - escalation) / (1 - share)``, where
    ``share`` is what the sample gave. Every model keeps its own answer to each drawn row."""
    if not 0.0 <= escalation <= 1.0:
        raise PlanningError(f"an escalation rate is a share in [0, 1], got {escalation}")
    if len(cascade.models) < 2:
        raise PlanningError(f"{cascade.describe()} has one stage: it escalates nothing")
    up = cascade.escalates(0, catalog.certainty(cascade.models[0], cascade.certainty))
    share = float(up.mean())
    if share in (0.0, 1.0):
        raise PlanningError(f"the sample gives no rows on one side of {cascade.describe()}'s "
                            "first threshold; cannot re-weight it")
    weights = np.where(up, escalation / share, (1 - escalation) / (1 - share))
    rows = np.random.default_rng(seed).choice(len(up), size=len(up), p=weights / weights.sum())
    return Catalog(catalog.perf, {m: q[rows] for m, q in catalog.quality.items()},
                   {m: s[rows] for m, s in catalog.scores.items()},
                   f"{catalog.sample_hash}-resampled-{escalation:.3f}", catalog.gpu_perf,
                   {m: v[rows] for m, v in catalog.row_sizes.items()})


def scaled_catalog(catalog: Catalog, factor: float, gpus: bool = False) -> Catalog:
    """``catalog`` with every CPU runtime (and with ``gpus`` every GPU runtime) ``factor``
    times as long: what serving measured against what the plan was made with (a ``runtime``
    drift: the CPU calls; a plan that fell behind: the whole machine)."""
    if not (np.isfinite(factor) and factor > 0):
        raise PlanningError(f"a runtime factor must be > 0, got {factor}")
    return catalog.with_perf({m: p.scaled(factor) for m, p in catalog.perf.items()},
                             {m: p.scaled(factor) for m, p in catalog.gpu_perf.items()}
                             if gpus else None)


def replicas(plan: GearPlan) -> set[tuple[str, str]]:
    """(model, device) of every model ``plan`` places on a device."""
    return {(r.model, d) for r in plan.placement for d in r.devices}


def plan_escalation(catalog: Catalog, plan: GearPlan) -> dict[Cascade, tuple[float, ...]]:
    """What ``plan`` expects each stage of each of its cascades to pass on, on ``catalog``'s
    sample (what a ``DriftWatch`` compares serving with)."""
    return {c: expected_escalation(catalog.stage_fractions(c)) for c in set(plan.cascades)}


@dataclass
class GearReplan:
    """Re-plans one gear operator (see the module docstring); called with the recent
    arrivals and the drift, returns the plan to swap in."""

    operator: str
    catalog: Catalog
    cascades: Sequence[Cascade]
    hardware: Hardware
    target: Target
    settings: PlannerSettings = field(default_factory=lambda: ONLINE_SETTINGS)
    headroom: float = 1.25  # the new plan's top gear covers the recent peak times this
    # a latency target is planned for at this share of it: a re-plan starts with a backlog
    # queued, on a machine already overloaded, so a plan the simulator puts just within the
    # target would not drain it
    margin: float = 0.5
    seed: int = 0
    # one-gear plans to fall back on at once when the load outgrows the plan (``stopgap``)
    fallbacks: Sequence[GearPlan] = ()
    # where serving fell behind, take what it answered as what the plan sustains
    # (``served_share``); False: judge capacity by the model alone (before 2026-11-29)
    measured: bool = True

    @property
    def latency_limit_ms(self) -> float | None:
        """What serving is held to: the target's p95 bound (None for an accuracy target)."""
        return self.target.max_p95_ms

    def __call__(self, trace: Trace, drift: Drift) -> GearPlan:
        if drift.kind == "escalation" and drift.cascade is not None \
                and drift.stage == 0 and drift.escalation is not None:
            # later re-plans keep the harder sample: it is what serving saw last
            self.catalog = resampled_catalog(self.catalog, drift.cascade, drift.escalation,
                                             self.seed)
        if drift.kind == "runtime" and drift.runtime_factor is not None:
            # the runtimes the calls take now: later re-plans (and the watch) keep them
            self.catalog = scaled_catalog(self.catalog, drift.runtime_factor)
        share = self.served_share(drift)
        # see the module docstring: where the plan fell behind, plan with the runtimes this
        # machine served it at (for this re-plan only)
        catalog = self.catalog if share == 1.0 else scaled_catalog(self.catalog, 1 / share,
                                                                   gpus=True)
        # the trace's first second may hold the backlog queued at the drift (``Replanner``):
        # the gears are sized for the load after it
        later = trace.arrival_s[trace.arrival_s >= 1.0]
        steady = Trace(later - 1.0, trace.name).qps_max() if later.size > 1 else 0.0
        peak = max(steady, drift.load_qps, 1.0) * self.headroom
        settings = replace(self.settings, seed=self.seed)
        frontier, _ = plan_frontier(self.operator, self.cascades, catalog, self.hardware,
                                    trace, qps_max=peak, settings=settings)
        if drift.kind == "latency" and not drift.behind_s:
            # the last plan, simulated within the target, missed it serving: plan for a
            # tighter bound each time this happens (a simulator that is optimistic near
            # saturation then still lands on a plan that holds), down to MIN_MARGIN. Not
            # where the backlog said serving fell behind: the runtimes scaled by the share
            # served (above) correct that shortfall already
            self.margin = max(self.margin / 2, min(MIN_MARGIN, self.margin))
        target = self.target
        if target.max_p95_ms is not None:
            target = replace(target, max_p95_ms=target.max_p95_ms * self.margin)
        try:
            plan = choose_plans({self.operator: frontier}, {self.operator: catalog},
                                trace, target, self.seed).plans[0]
        except QueryPlanError:  # out of reach at this load: the closest plan
            plan = (frontier.plans[0] if self.target.min_accuracy is None
                    else frontier.plans[-1])
        assert isinstance(plan, GearPlan)
        why = drift.detail
        if share < 1.0:
            why += (f"; planned with every runtime {1 / share:.2f}x the model's: the plan "
                    f"serving answered {share:.0%} of what the model says it sustains")
        return replace(plan, provenance=(*plan.provenance, ("replanned", why)))

    def expected(self, plan: GearPlan) -> Mapping[Cascade, tuple[float, ...]]:
        return plan_escalation(self.catalog, plan)

    def served_share(self, drift: Drift, plan: GearPlan | None = None) -> float:
        """What ``plan`` (default: the plan that drifted, ``Drift.plan``) sustained on this
        machine, as a share of what ``capacity`` models: where serving fell behind the
        arrivals on a rate or latency drift (``Drift.saturated``), the rate it answered over
        the modelled capacity of the gear that serves the load measured (``Drift.load_qps``:
        while behind, what arrived then), within
        [``MIN_SHARE``, 1]; else (or not ``measured``) 1. Escalation and runtime drifts
        re-plan with their own measure (a re-weighted sample, scaled runtimes)."""
        plan = plan if plan is not None else drift.plan
        if not self.measured or plan is None or drift.kind not in ("rate", "latency") \
                or not drift.saturated or drift.served_qps is None:
            return 1.0
        modelled = self.capacity(plan, drift.load_qps)
        return float(np.clip(drift.served_qps / modelled, MIN_SHARE, 1.0))

    def capacity(self, plan: GearPlan, rate: float | None = None) -> float:
        """Rows/s the fastest gear of ``plan`` (given ``rate``: the gear that serves it)
        sustains on its devices (``sustained_qps``, each device of ``hardware`` at its own
        speed; a device ``hardware`` lacks counts as a CPU)."""
        ids = set(plan.devices)
        known = tuple(d for d in self.hardware.devices if d.id in ids)
        devices: int | Hardware = Hardware(known) if len(known) == len(ids) else len(ids)
        cascades = (set(plan.cascades) if rate is None  # the scheduler's own gear choice
                    else {plan.cascade_of(GearSelector(plan).range_for(rate))})
        return max(sustained_qps(self.catalog, c, devices) for c in cascades)

    def stopgap(self, drift: Drift, current: GearPlan) -> GearPlan | None:
        """A plan to serve at once, before the re-plan (see the module docstring): on a rate drift,
        when ``current``'s fastest gear does not sustain the load measured (``Drift.load_qps``)
        times ``headroom``; on a latency drift (``current`` missed its target serving) while the
        load is within ``headroom`` of what ``current`` sustains (near capacity: an overload, not a
        slow window at low load, which the re-plan handles), one that sustains ``headroom`` times
        more than ``current`` too. Of the ``fallbacks`` that do, the most accurate, those whose
        models ``current`` already has on the same devices first (nothing to load); where none does,
        the one that sustains most, if more than ``current``. None for other drifts, without
        fallbacks, or when ``current`` suffices. Analytic, no simulation: per fallback, its
        cascade's stage fractions and accuracy on the sample. Where serving fell behind
        (``Drift.saturated``), every capacity counts at ``served_share``: what ``current`` answered
        is what it sustains."""
        if drift.kind not in ("rate", "latency") or not self.fallbacks:
            return None
        share = self.served_share(drift, current)
        have = self.capacity(current) * share
        need = max(drift.load_qps, 1.0) * self.headroom
        if drift.kind == "latency":
            if need < have:
                return None
            need = max(need, have * self.headroom)
        elif have >= need:
            return None
        loaded = replicas(current)
        sized = [(self.capacity(p) * share, p) for p in self.fallbacks]
        enough = [(cap, p) for cap, p in sized if cap >= need]
        if enough:
            return max(enough, key=lambda cp: (
                replicas(cp[1]) <= loaded, self.catalog.accuracy(cp[1].cascades[0]),
                cp[0]))[1]
        cap, best = max(sized, key=lambda cp: cp[0])
        return best if cap > have else None
