"""The fixed inputs of one gear-plan search (DESIGN.md section 5.3): the planner's settings, the
candidate cascades ordered by cost, the QPS ranges with the share of the sample trace in each,
and the caches that the placement search and the workload adapter share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ken.models.cascade import Cascade
from ken.optimizer.pareto import pareto_front
from ken.optimizer.perf import Catalog
from ken.optimizer.scheduler import PlanningError
from ken.optimizer.workload import Hardware, Trace
from ken.policy.plan import Replica

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
    # also place every candidate cascade and every single model alone at all loads (and each
    # model with tuned dynamic batching; ``planner.one_gear_plans``): the greedy adapter does
    # not visit every such plan, and one of them can beat its gear plans at their accuracy
    include_static: bool = True
    # serve nothing but the candidate cascades: no single model alone unless it is one of them
    # (a target's certified candidates, ``ken.optimizer.certified``)
    only_candidates: bool = False
    # fill frontier gaps wider than this accuracy (``planner.fill_gaps``), with at most
    # ``gap_searches`` more placement searches
    max_gap: float = 0.005
    gap_searches: int = 12
    # after the search, each gear of a multi-gear frontier plan tries the ladder's cheaper
    # cascades that are at most this much less accurate on the sample, on the plan's placement
    # (``planner.polish``), for ``polish_rounds`` rounds (0: off)
    polish_gap: float = 0.005
    polish_rounds: int = 2
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
        if self.polish_gap < 0 or self.polish_rounds < 0:
            raise PlanningError("polish_gap and polish_rounds must be >= 0")
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



def range_weights(trace: Trace, edges: Sequence[float], window_s: float) -> np.ndarray:
    """Fraction of the trace's requests that arrive in a rate-meter window whose rate falls
    in each QPS range (windows from the first arrival, as ``RateMeter`` cuts them)."""
    buckets = np.floor((trace.arrival_s - trace.arrival_s[0]) / window_s).astype(np.int64)
    counts = np.bincount(buckets)
    rates = counts / window_s
    k = np.clip(np.searchsorted(np.asarray(edges), rates, side="right") - 1, 0, len(edges) - 2)
    weights = np.bincount(k, weights=counts, minlength=len(edges) - 1)
    return weights / weights.sum()



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



def one_cascade_context(ctx: PlanningContext, cascades: Sequence[Cascade]) -> PlanningContext:
    """A context over exactly ``cascades`` (cheapest first, none dropped) with ``ctx``'s
    trace, load ranges and settings, sharing its counters and simulation pool: for the plans
    that serve one cascade at every load (``planner.one_gear_plans``), which must include the
    cascades the adapter's ladder thins out."""
    order = tuple(sorted(dict.fromkeys(cascades),
                         key=lambda c: (_cost(c, ctx.catalog, ctx.settings), c.describe())))
    out = PlanningContext(ctx.operator, order, ctx.catalog, ctx.hardware, ctx.trace, ctx.edges,
                          ctx.settings, ctx.stats)
    out.range_weights, out.pool = ctx.range_weights, ctx.pool
    return out


def _cost(c: Cascade, catalog: Catalog, settings: PlannerSettings) -> float:
    """Expected device seconds per row of cascade ``c`` at each model's largest batch."""
    total = 0.0
    for m, f in zip(c.models, catalog.stage_fractions(c), strict=True):
        perf = catalog.perf[m]
        b = perf.max_batch if settings.max_batch is None else min(perf.max_batch,
                                                                  settings.max_batch)
        total += f * perf.per_row_s(b)
    return total


def _by_cost(cascades: Sequence[Cascade], catalog: Catalog,
             settings: PlannerSettings) -> tuple[Cascade, ...]:
    """Candidates ordered by expected device seconds per row (cheapest first)."""
    def cost(c: Cascade) -> float:
        return _cost(c, catalog, settings)

    unique = list(dict.fromkeys(cascades))
    # Pareto under this cost (batch sizes may differ from the cascade search's): drop every
    # cascade that a cheaper one matches in accuracy
    ordered = [unique[i]
               for i in pareto_front([(catalog.accuracy(c), cost(c)) for c in unique])]
    # walk down from the most accurate; keep the cheapest (the "cheapest everywhere" anchor)
    kept = [ordered[-1]]
    for c in reversed(ordered[:-1]):
        acc = catalog.accuracy(c)
        if acc <= catalog.accuracy(kept[-1]) - settings.min_accuracy_step or c is ordered[0]:
            kept.append(c)
    return tuple(reversed(kept))

