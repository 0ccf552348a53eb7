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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ken.errors import KenError, QueryPlanError
from ken.optimizer.perf import Catalog
from ken.optimizer.simulator import simulate_many
from ken.optimizer.workload import Trace
from ken.policy.plan import Frontier, GearPlan, PlanMetrics


@dataclass(frozen=True)
class Target:
    """The user's goal: exactly one of an accuracy floor or a p95 latency budget."""

    min_accuracy: float | None = None
    max_p95_ms: float | None = None

    def __post_init__(self) -> None:
        if (self.min_accuracy is None) == (self.max_p95_ms is None):
            raise QueryPlanError("give exactly one target: min_accuracy or max_p95_ms")
        if self.min_accuracy is not None and not 0 <= self.min_accuracy <= 1:
            raise QueryPlanError(f"min_accuracy is a fraction in [0, 1], got {self.min_accuracy}")
        if self.max_p95_ms is not None and self.max_p95_ms <= 0:
            raise QueryPlanError(f"max_p95_ms must be > 0, got {self.max_p95_ms}")

    @classmethod
    def parse(cls, text: str) -> Target:
        """``"accuracy >= 0.7"`` or ``"p95 <= 50"`` (milliseconds)."""
        parts = text.replace(" ", "").lower()
        for key, op in (("accuracy", ">="), ("p95", "<=")):
            if parts.startswith(key + op):
                try:
                    value = float(parts[len(key) + len(op):].rstrip("ms%"))
                except ValueError:
                    break
                if key == "accuracy":
                    return cls(min_accuracy=value / 100 if value > 1 else value)
                return cls(max_p95_ms=value)
        raise QueryPlanError(f"cannot read target {text!r}; write 'accuracy >= 0.7' or "
                             "'p95 <= 50' (milliseconds)")

    def describe(self) -> str:
        if self.min_accuracy is not None:
            return f"accuracy >= {self.min_accuracy:.1%}"
        return f"p95 <= {self.max_p95_ms:g} ms"


@dataclass(frozen=True)
class QueryPlan:
    """One gear plan per operator and what the joint simulation predicts."""

    target: Target
    plans: tuple[GearPlan, ...]
    accuracy: tuple[float, ...]  # per operator, from the joint simulation
    joint: PlanMetrics  # end-to-end latency of the query (accuracy of the first operator)

    def plan_for(self, operator: str) -> GearPlan:
        for p in self.plans:
            if p.operator == operator:
                return p
        raise QueryPlanError(f"no gear plan for operator {operator!r}")


def _joint(plans: list[GearPlan], catalogs: list[Catalog], trace: Trace,
           seed: int) -> tuple[tuple[float, ...], PlanMetrics]:
    result = simulate_many(plans, catalogs, trace, seed)
    accs = tuple(float(result.quality[k].mean()) for k in range(len(plans)))
    return accs, result.metrics(0, plans[0])


def choose_plans(frontiers: Mapping[str, Frontier], catalogs: Mapping[str, Catalog],
                 trace: Trace, target: Target, seed: int = 0) -> QueryPlan:
    """Pick one plan per operator (operators in the order given) to meet ``target``."""
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
