"""Query optimizer over gear plans (DESIGN.md section 5.7).

A query with several semantic operators gets one gear plan per operator from that operator's
frontier, so that the whole query meets the user's target:

- ``Target(min_accuracy=a)``: every operator reaches accuracy ``a``; among those plans the
  fastest is taken per operator.
- ``Target(max_p95_ms=t)``: start from each operator's most accurate plan and, while the
  query's simulated end-to-end p95 exceeds ``t``, move the operator whose next faster plan
  costs the least accuracy per millisecond saved.

Operators are simulated together (``simulate_many``: each request passes through them in
order, and plans that use the same device share it), so contention between operators counts.

A *pipeline* whose quality is only known end to end (multi-hop question answering: F1 of the
final answer, which depends on the models that answered every hop) is planned with
:func:`choose_pipeline`: each request of the stream is a labelled question with its own route
through the operators, its quality is looked up for the models that resolved its hops
(:class:`PipelineSample`), and the combinations of the operators' frontier plans are simulated
together to find the fastest that meets ``quality >= x`` or the best within ``p95 <= t``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ken.errors import KenError, QueryPlanError
from ken.optimizer.perf import Catalog
from ken.optimizer.simulator import SimResult, latency_percentiles, sample_rows, simulate_many
from ken.optimizer.workload import Trace
from ken.policy.dropping import DeadlineMetrics, DropPolicy
from ken.policy.plan import Frontier, GearPlan, Plan, PlanMetrics

#: latency bounds a target may set: the request latency percentile every plan has (``p95``; for
#: a generating function its total generation time), and the generation-only ones
LATENCY_BOUNDS = ("p95", "ttft_p95", "tgt_p95")
_QUALITY_WORDS = ("accuracy", "quality", "f1")
_TARGET_HELP = ("write 'accuracy >= 0.75' (or 'quality'/'f1 >= ...', a fraction or a percent), "
                "'p95 <= 200ms', 'ttft_p95 <= 2s' or 'tgt_p95 <= 15s' (a bare number is "
                "milliseconds)")


@dataclass(frozen=True)
class Target:
    """The user's goal, one vocabulary for every kind of operator: exactly one of a quality
    floor (accuracy, F1, ...: the operator's own metric) or a latency bound. ``max_p95_ms``
    bounds the p95 latency of a request (for a generating function: its total generation
    time), ``max_ttft_p95_ms`` and ``max_tgt_p95_ms`` the p95 time to first token and total
    generation time of a generating function.

    >>> Target.parse("ttft_p95 <= 2s")
    Target(min_accuracy=None, max_p95_ms=None, max_ttft_p95_ms=2000.0, max_tgt_p95_ms=None)
    """

    min_accuracy: float | None = None
    max_p95_ms: float | None = None
    max_ttft_p95_ms: float | None = None
    max_tgt_p95_ms: float | None = None

    def __post_init__(self) -> None:
        given = [v for v in (self.min_accuracy, self.max_p95_ms, self.max_ttft_p95_ms,
                             self.max_tgt_p95_ms) if v is not None]
        if len(given) != 1:
            raise QueryPlanError("give exactly one target: min_accuracy, max_p95_ms, "
                                 "max_ttft_p95_ms or max_tgt_p95_ms")
        if self.min_accuracy is not None and not 0 <= self.min_accuracy <= 1:
            raise QueryPlanError(f"min_accuracy is a fraction in [0, 1], got {self.min_accuracy}")
        if self.latency is not None and not given[0] > 0:
            raise QueryPlanError(f"a latency bound must be > 0 ms, got {given[0]}")

    @property
    def latency(self) -> str | None:
        """Which latency the target bounds (one of ``LATENCY_BOUNDS``), None for a quality
        floor."""
        for name, value in zip(LATENCY_BOUNDS, (self.max_p95_ms, self.max_ttft_p95_ms,
                                                self.max_tgt_p95_ms), strict=True):
            if value is not None:
                return name
        return None

    @property
    def max_latency_ms(self) -> float | None:
        """The latency bound in milliseconds (None for a quality floor)."""
        return next((v for v in (self.max_p95_ms, self.max_ttft_p95_ms, self.max_tgt_p95_ms)
                     if v is not None), None)

    @classmethod
    def parse(cls, text: str) -> Target:
        """``"accuracy >= 0.75"``, ``"f1 >= 25%"``, ``"p95 <= 200ms"``, ``"p95 <= 50"``
        (milliseconds), ``"ttft_p95 <= 2s"`` or ``"tgt_p95 <= 15 s"``."""
        parts = text.replace(" ", "").lower()
        for key in (*_QUALITY_WORDS, *LATENCY_BOUNDS):
            op = ">=" if key in _QUALITY_WORDS else "<="
            if not parts.startswith(key + op):
                continue
            number = parts[len(key) + len(op):]
            quality = key in _QUALITY_WORDS
            unit = next((u for u in (("%",) if quality else ("ms", "s")) if number.endswith(u)),
                        "")
            try:
                value = float(number[:len(number) - len(unit)])
            except ValueError:
                break
            if quality:  # a fraction or a percent; an F1 floor is a quality floor too
                return cls(min_accuracy=value / 100 if unit or value > 1 else value)
            return cls(**{f"max_{key}_ms": value * (1000.0 if unit == "s" else 1.0)})
        raise QueryPlanError(f"cannot read target {text!r}; {_TARGET_HELP}")

    def describe(self) -> str:
        if self.min_accuracy is not None:
            return f"accuracy >= {self.min_accuracy:.1%}"
        return f"{self.latency} <= {self.max_latency_ms:g} ms"

    def for_classifiers(self) -> Target:
        """This target for a classifier's gear plans, which have no tokens: a TTFT or TGT
        bound is refused with what to write instead."""
        if self.latency in ("ttft_p95", "tgt_p95"):
            raise QueryPlanError(f"{self.latency} is a latency of generating functions "
                                 "(sem_qa, sem_map, sem_extract); bound a classifier's "
                                 "latency with 'p95 <= ...'")
        return self


@dataclass(frozen=True)
class QueryPlan:
    """One plan per function and what the simulations predict: classifier functions' gear
    plans chosen together (``joint``: their end-to-end latency, None when the query has
    none), generating functions' generation plans each on its own."""

    target: Target
    plans: tuple[Plan, ...]
    accuracy: tuple[float, ...]  # per plan: from the joint simulation, or the plan's own
    joint: PlanMetrics | None  # end-to-end latency of the classifier functions

    def plan_for(self, operator: str) -> Plan:
        for p in self.plans:
            if p.operator == operator:
                return p
        raise QueryPlanError(f"no plan for operator {operator!r}")

    def with_plans(self, plans: Sequence[Plan], accuracy: Sequence[float]) -> QueryPlan:
        """This choice with more functions' plans (planned apart from these)."""
        return QueryPlan(self.target, (*self.plans, *plans), (*self.accuracy, *accuracy),
                         self.joint)


def _joint(plans: list[GearPlan], catalogs: list[Catalog], trace: Trace,
           seed: int) -> tuple[tuple[float, ...], PlanMetrics]:
    result = simulate_many(plans, catalogs, trace, seed)
    accs = tuple(float(result.quality[k].mean()) for k in range(len(plans)))
    return accs, result.metrics(0, plans[0])


def choose_plans(frontiers: Mapping[str, Frontier], catalogs: Mapping[str, Catalog],
                 trace: Trace, target: Target, seed: int = 0) -> QueryPlan:
    """Pick one plan per operator (operators in the order given) to meet ``target``."""
    target = target.for_classifiers()
    if not frontiers:
        raise QueryPlanError("the query has no semantic operators to plan")
    names = list(frontiers)
    missing = [n for n in names if n not in catalogs]
    if missing:
        raise QueryPlanError(f"no catalog (profiles) for operators {missing}")
    cats = [catalogs[n] for n in names]
    if target.min_accuracy is not None:
        chosen = []
        for n in names:
            try:
                chosen.append(frontiers[n].pick(min_accuracy=target.min_accuracy))
            except KenError as exc:
                raise QueryPlanError(f"operator {n!r}: {exc}") from None
        accs, joint = _joint(chosen, cats, trace, seed)
        return QueryPlan(target, tuple(chosen), accs, joint)

    budget = target.max_p95_ms
    assert budget is not None
    # frontier plans are sorted by p95; start at the most accurate (last) of each
    index = {n: len(frontiers[n].plans) - 1 for n in names}
    while True:
        chosen = [frontiers[n].plans[index[n]] for n in names]
        accs, joint = _joint(chosen, cats, trace, seed)
        if joint.p95_ms <= budget:
            return QueryPlan(target, tuple(chosen), accs, joint)
        best, best_cost = None, None
        for n in names:
            i = index[n]
            if i == 0:
                continue
            cur, nxt = frontiers[n].plans[i].predicted, frontiers[n].plans[i - 1].predicted
            assert cur is not None and nxt is not None
            saved = max(cur.p95_ms - nxt.p95_ms, 1e-9)
            cost = (cur.accuracy - nxt.accuracy) / saved
            if best_cost is None or cost < best_cost:
                best, best_cost = n, cost
        if best is None:
            raise QueryPlanError(f"no combination of gear plans meets p95 <= {budget:g} ms; "
                                 f"the fastest plans give a simulated p95 of "
                                 f"{joint.p95_ms:.1f} ms")
        index[best] -= 1


# -- pipelines scored end to end ---------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PipelineSample:
    """Labelled requests of a pipeline of operators (e.g. questions of a multi-hop QA run).

    ``routes[q]``: the operators (indices into ``operators``) request row ``q`` passes
    through, in order. ``quality[(q, models)]``: its end-to-end quality (e.g. F1) when
    ``models[j]`` resolved it at operator ``routes[q][j]``; every combination the plans can
    produce must be measured.
    """

    operators: tuple[str, ...]
    routes: tuple[tuple[int, ...], ...]
    quality: Mapping[tuple[int, tuple[str, ...]], float]

    def __post_init__(self) -> None:
        if not self.routes:
            raise QueryPlanError("a pipeline sample needs at least one request row")
        for r in self.routes:
            if not r or not all(0 <= k < len(self.operators) for k in r):
                raise QueryPlanError(f"route {r} names operators outside 0.."
                                     f"{len(self.operators) - 1}")

    @property
    def num_rows(self) -> int:
        return len(self.routes)

    def request_quality(self, result: SimResult, plans: Sequence[GearPlan],
                        rows: Sequence[int]) -> np.ndarray:
        """The end-to-end quality of each simulated request (request ``i`` is row
        ``rows[i]``), from the models that resolved its hops; 0 for a dropped request (no
        answer)."""
        out = np.empty(len(rows))
        dropped = {d.request_id for d in result.drops}
        for i, q in enumerate(rows):
            if i in dropped:
                out[i] = 0.0
                continue
            models = []
            for k in self.routes[q]:
                plan = plans[k]
                cascade = plan.cascades[plan.ranges[int(result.range_index[k, i])].cascade]
                models.append(cascade.models[int(result.stage[k, i])])
            key = (int(q), tuple(models))
            if key not in self.quality:
                raise QueryPlanError(f"no measured outcome of request row {q} with models "
                                     f"{key[1]}")
            out[i] = self.quality[key]
        return out


@dataclass(frozen=True)
class PipelinePoint:
    """One combination of plans, simulated: end-to-end quality and latency, and the p95 of
    the time each operator held a request (queueing and running; its route's requests)."""

    plans: tuple[GearPlan, ...]
    quality: float
    metrics: PlanMetrics  # end-to-end latency (its accuracy is the end-to-end quality)
    operator_p95_ms: tuple[float, ...]
    # with end-to-end deadlines: goodput, drops and wasted device time (latency percentiles
    # are then over the answered requests, quality counts a dropped request as 0)
    deadline: DeadlineMetrics | None = None


@dataclass(frozen=True)
class PipelinePlan:
    target: Target
    chosen: PipelinePoint
    points: tuple[PipelinePoint, ...]  # every combination simulated

    @property
    def plans(self) -> tuple[GearPlan, ...]:
        return self.chosen.plans


def evaluate_pipeline(plans: Sequence[GearPlan], catalogs: Sequence[Catalog], trace: Trace,
                      sample: PipelineSample, seed: int = 0,
                      rows: Sequence[int] | None = None,
                      deadline_s: float | Sequence[float] | np.ndarray | None = None,
                      dropping: DropPolicy | None = None) -> PipelinePoint:
    """Simulate ``plans`` (one per operator of ``sample``) together on ``trace``; request
    ``i`` is sample row ``rows[i]`` (default: a permutation of the rows drawn by ``seed``).

    ``deadline_s``: end-to-end deadlines (seconds after arrival; one for all or one per
    request) and ``dropping`` the policy dropping requests that cannot make them
    (``ken.policy.dropping``); the point then carries their ``DeadlineMetrics``."""
    if len(plans) != len(sample.operators):
        raise QueryPlanError(f"give one plan per operator {sample.operators}")
    if rows is None:
        rows = sample_rows(len(trace), sample.num_rows, seed)
    elif len(rows) != len(trace):
        raise QueryPlanError(f"{len(rows)} sample rows for {len(trace)} requests")
    result = simulate_many(plans, catalogs, trace, seed, routes=sample.routes, rows=rows,
                           deadline_s=deadline_s, dropping=dropping)
    quality = sample.request_quality(result, plans, rows)
    deadline = None
    if deadline_s is None:
        metrics = result.metrics(0)
        p50, p95, p99 = latency_percentiles(result.latency_s * 1000.0)
    else:
        deadline = result.deadline_metrics()
        answered = ~np.isnan(result.completion_s)
        kept = SimResult(result.arrival_s[answered], result.completion_s[answered],
                         result.quality[:, answered], result.stage[:, answered],
                         result.range_index[:, answered], result.gear_switches,
                         result.device_busy_s, result.batches, result.stage_rows)
        metrics = kept.metrics(0) if answered.any() else result.metrics(0)
        p50, p95, p99 = (latency_percentiles(kept.latency_s * 1000.0) if answered.any()
                         else (math.nan,) * 3)
    per_op = []
    for k in range(len(plans)):
        held = []
        for i, q in enumerate(rows):
            route = sample.routes[q]
            if k in route:
                j = route.index(k)
                entered = result.arrival_s[i] if j == 0 else result.resolved_s[route[j - 1], i]
                if not math.isnan(result.resolved_s[k, i]):  # NaN: dropped before it
                    held.append(result.resolved_s[k, i] - entered)
        per_op.append(float(np.percentile(held, 95)) * 1000.0 if held else 0.0)
    joint = PlanMetrics(accuracy=float(quality.mean()), p50_ms=p50, p95_ms=p95, p99_ms=p99,
                        mean_ms=metrics.mean_ms, num_requests=metrics.num_requests,
                        gear_switches=sum(len(g) for g in result.gear_switches),
                        duration_s=metrics.duration_s, utilisation=metrics.utilisation)
    return PipelinePoint(tuple(plans), float(quality.mean()), joint, tuple(per_op), deadline)


def spread_plans(plans: Sequence[GearPlan], keep: int) -> list[GearPlan]:
    """At most ``keep`` of ``plans``, spread evenly over them (the first and last kept)."""
    if len(plans) <= keep:
        return list(plans)
    idx = sorted({round(i * (len(plans) - 1) / (keep - 1)) for i in range(keep)})
    return [plans[i] for i in idx]


def choose_pipeline(frontiers: Mapping[str, Frontier | Sequence[GearPlan]],
                    catalogs: Mapping[str, Catalog], trace: Trace, sample: PipelineSample,
                    target: Target, seed: int = 0, max_plans: int = 8) -> PipelinePlan:
    """Simulate every combination of the operators' frontier plans (at most ``max_plans``
    each, spread over the frontier) and pick the fastest (p95) that meets
    ``target.min_accuracy`` end to end, or the most accurate within ``target.max_p95_ms``."""
    target = target.for_classifiers()
    missing = [n for n in sample.operators if n not in frontiers or n not in catalogs]
    if missing:
        raise QueryPlanError(f"no frontier or catalog for operators {missing}")
    options = [spread_plans(list(getattr(frontiers[n], "plans", frontiers[n])), max_plans)
               for n in sample.operators]
    if any(not o for o in options):
        raise QueryPlanError("an operator's frontier has no plans")
    cats = [catalogs[n] for n in sample.operators]
    points = tuple(evaluate_pipeline(combo, cats, trace, sample, seed)
                   for combo in itertools.product(*options))
    if target.min_accuracy is not None:
        ok = [p for p in points if p.quality >= target.min_accuracy - 1e-12]
        if not ok:
            best = max(p.quality for p in points)
            raise QueryPlanError(f"no combination of gear plans reaches quality "
                                 f"{target.min_accuracy:.1%}; the best reaches {best:.1%}")
        chosen = min(ok, key=lambda p: (p.metrics.p95_ms, -p.quality))
    else:
        assert target.max_p95_ms is not None
        ok = [p for p in points if p.metrics.p95_ms <= target.max_p95_ms]
        if not ok:
            fastest = min(p.metrics.p95_ms for p in points)
            raise QueryPlanError(f"no combination of gear plans meets p95 <= "
                                 f"{target.max_p95_ms:g} ms; the fastest gives "
                                 f"{fastest:.1f} ms")
        chosen = max(ok, key=lambda p: (p.quality, -p.metrics.p95_ms))
    return PipelinePlan(target, chosen, points)
