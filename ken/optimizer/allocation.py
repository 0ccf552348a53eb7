"""Accuracy scaling for a whole pipeline, Loki-style (issue 37, item 2; Loki, HPDC 2024, §4).

A pipeline's requests fall into **route classes** (the operators a request passes through, in
order, with the share of the demand that takes that route: ``PipelineSample.routes``). Every
operator has **variants** (its models), each with a throughput per worker at each batch size
and a multiplicative factor (requests it sends on per request it serves). A **path** is a route
class with one variant chosen at each of its operators; its accuracy is measured, not assumed
(the mean end-to-end quality of the sample rows of that route answered by those variants).

The allocation decides, for a demand ``D`` (requests/s), ``S`` workers and a latency SLO ``L``:
how many workers host each variant and at which maximum batch size, and what share ``c(p)`` of
the demand each path carries. Loki's MILP (solved here with SciPy's HiGHS):

- capacity: ``sum_{p through v} D c(p) m(p, v) <= sum_b w(v, b) q(v, b)`` for every variant
  ``v``, where ``w(v, b)`` workers host ``v`` at batch ``b`` (one batch size per variant) and
  ``m(p, v)`` is the product of the factors of the variants before ``v`` on ``p``;
- workers: ``sum w <= S``;
- latency: a path that carries traffic has ``sum_v b_v / q(v, b_v) <= L / 2`` (Loki halves the
  SLO: a request may wait one batch before its own);
- shares: ``sum_{p of route r} c(p) <= share(r)``: what a route cannot carry is dropped and
  counts as quality 0.

Step 1 (hardware scaling): serve every request with each operator's most accurate variant on
the fewest workers. If that is infeasible, step 2 (accuracy scaling): maximise
``sum_p c(p) A(p)``, the expected quality of all requests, dropped ones included.

``route_table`` turns an allocation into the probability of each path per route class (what a
router draws from); ``most_accurate_first`` is Loki's runtime routing (§5.1) of the current
demand over the allocated capacity, most accurate variant first.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from ken.errors import QueryPlanError
from ken.models.cascade import Cascade
from ken.optimizer.query import PipelineSample
from ken.policy.plan import GearPlan, RangeSchedule, Replica

#: a path: a route class (index) and one variant name per operator of its route
Path = tuple[int, tuple[str, ...]]


@dataclass(frozen=True)
class Variant:
    """One model an operator can run: ``qps[b]`` requests/s one worker serves at batch size
    ``b`` (batches full), its accuracy alone (orders variants for ``most_accurate_first``),
    and its multiplicative factor."""

    name: str
    accuracy: float
    qps: Mapping[int, float]
    factor: float = 1.0

    def __post_init__(self) -> None:
        if not self.qps or any(b < 1 or not q > 0 for b, q in self.qps.items()):
            raise QueryPlanError(f"variant {self.name}: give a positive throughput for at "
                                 "least one batch size >= 1")
        if not self.factor > 0:
            raise QueryPlanError(f"variant {self.name}: the factor must be positive")

    def batch_latency_s(self, b: int) -> float:
        """The time one full batch of ``b`` takes."""
        return b / self.qps[b]

    def runtimes_s(self, up_to: int) -> tuple[float, ...]:
        """The time of a batch of ``1..up_to`` rows (interpolated between the batch sizes
        ``qps`` gives, linear beyond them): what a plan of this variant carries as its
        profiled runtimes."""
        sizes = sorted(self.qps)
        times = [self.batch_latency_s(b) for b in sizes]
        out = np.interp(np.arange(1, up_to + 1), sizes, times)
        beyond = np.arange(1, up_to + 1) > sizes[-1]
        out[beyond] = times[-1] / sizes[-1] * np.arange(1, up_to + 1)[beyond]
        return tuple(float(t) for t in out)


@dataclass(frozen=True)
class AllocationProblem:
    """``operators[i]``'s variants; ``routes[r]`` the operators (indices) route class ``r``
    passes through, carrying ``shares[r]`` of the demand; ``accuracy[(r, names)]`` the
    measured quality of path ``(r, names)``; ``demand_qps``, ``workers`` and the SLO."""

    operators: tuple[str, ...]
    variants: tuple[tuple[Variant, ...], ...]
    routes: tuple[tuple[int, ...], ...]
    shares: tuple[float, ...]
    accuracy: Mapping[Path, float]
    demand_qps: float
    workers: int
    slo_s: float

    def __post_init__(self) -> None:
        if len(self.variants) != len(self.operators) or not all(self.variants):
            raise QueryPlanError("give at least one variant for every operator")
        if len(self.routes) != len(self.shares) or not self.routes:
            raise QueryPlanError("give one share per route class, and at least one route")
        if any(s < 0 for s in self.shares) or not math.isclose(sum(self.shares), 1.0,
                                                               abs_tol=1e-6):
            raise QueryPlanError(f"route shares must be >= 0 and sum to 1, got {self.shares}")
        for r in self.routes:
            if not r or not all(0 <= k < len(self.operators) for k in r):
                raise QueryPlanError(f"route {r} names operators outside 0.."
                                     f"{len(self.operators) - 1}")
        if self.workers < 1 or not self.demand_qps > 0 or not self.slo_s > 0:
            raise QueryPlanError("workers >= 1, and demand and SLO > 0, please")
        missing = [p for p in self.paths() if p not in self.accuracy]
        if missing:
            raise QueryPlanError(f"no measured accuracy for path {missing[0]} "
                                 f"({len(missing)} paths missing)")

    def paths(self) -> list[Path]:
        """Every path: each route class with every choice of one variant per operator."""
        out: list[Path] = []
        for r, route in enumerate(self.routes):
            for combo in itertools.product(*(self.variants[k] for k in route)):
                out.append((r, tuple(v.name for v in combo)))
        return out

    def variant(self, op: int, name: str) -> Variant:
        for v in self.variants[op]:
            if v.name == name:
                return v
        raise QueryPlanError(f"operator {self.operators[op]} has no variant {name}")


@dataclass(frozen=True)
class Allocation:
    """The solution: ``hosts[(op, name)] = (workers, batch size)``; ``shares[p]`` the share of
    the demand path ``p`` carries (paths with none left out); ``quality`` the expected quality
    of all requests (dropped ones count 0); ``served`` the share not dropped; ``step``:
    ``"hardware"`` (every request on the most accurate variants, fewest workers) or
    ``"accuracy"``."""

    hosts: Mapping[tuple[int, str], tuple[int, int]]
    shares: Mapping[Path, float]
    quality: float
    served: float
    step: str

    @property
    def workers_used(self) -> int:
        return sum(w for w, _ in self.hosts.values())

    def capacity_qps(self, problem: AllocationProblem, op: int, name: str) -> float:
        w, b = self.hosts.get((op, name), (0, 0))
        return w * problem.variant(op, name).qps[b] if w else 0.0

    def describe(self, problem: AllocationProblem) -> list[str]:
        lines = [f"{self.step} scaling: {self.workers_used} of {problem.workers} workers, "
                 f"expected quality {self.quality:.3f}, {self.served:.1%} of "
                 f"{problem.demand_qps:g} req/s served"]
        for (op, name), (w, b) in sorted(self.hosts.items()):
            lines.append(f"  {problem.operators[op]}: {name} x{w} (batch <= {b})")
        return lines


def _multiplier(problem: AllocationProblem, path: Path, pos: int) -> float:
    route = problem.routes[path[0]]
    return float(np.prod([problem.variant(route[j], path[1][j]).factor for j in range(pos)]))


def _milp(problem: AllocationProblem, maximise_quality: bool) -> Allocation | None:
    """One MILP: with ``maximise_quality`` Loki's step 2, else step 1 (most accurate variants
    only, every request served, fewest workers). None when infeasible."""
    paths = problem.paths()
    if not maximise_quality:
        best = {k: max(vs, key=lambda v: v.accuracy).name
                for k, vs in enumerate(problem.variants)}
        paths = [p for p in paths if all(n == best[k] for k, n in
                                          zip(problem.routes[p[0]], p[1], strict=True))]
    hosts = [(k, v.name, b) for k, vs in enumerate(problem.variants) for v in vs
             for b in sorted(v.qps)]
    nh, npth = len(hosts), len(paths)
    # variables: w[h] (integer workers), z[h] (binary: the variant's batch size), c[p], i[p]
    n = 2 * nh + 2 * npth
    w0, z0, c0, i0 = 0, nh, 2 * nh, 2 * nh + npth
    rows: list[np.ndarray] = []
    lo: list[float] = []
    hi: list[float] = []

    def add(row: np.ndarray, low: float, high: float) -> None:
        rows.append(row)
        lo.append(low)
        hi.append(high)

    S, D = problem.workers, problem.demand_qps
    by_variant: dict[tuple[int, str], list[int]] = {}
    for h, (k, name, _) in enumerate(hosts):
        by_variant.setdefault((k, name), []).append(h)
        row = np.zeros(n)  # w <= S z
        row[w0 + h], row[z0 + h] = 1.0, -S
        add(row, -np.inf, 0.0)
    for (k, name), hs in by_variant.items():
        row = np.zeros(n)  # one batch size per variant
        row[[z0 + h for h in hs]] = 1.0
        add(row, -np.inf, 1.0)
        row = np.zeros(n)  # capacity
        variant = problem.variant(k, name)
        for h in hs:
            row[w0 + h] = -variant.qps[hosts[h][2]]
        for j, p in enumerate(paths):
            route = problem.routes[p[0]]
            for pos, (op, vname) in enumerate(zip(route, p[1], strict=True)):
                if op == k and vname == name:
                    row[c0 + j] += D * _multiplier(problem, p, pos)
        add(row, -np.inf, 0.0)
    row = np.zeros(n)
    row[w0:w0 + nh] = 1.0
    add(row, -np.inf, float(S))
    budget = problem.slo_s / 2.0
    big = sum(max(v.batch_latency_s(b) for b in v.qps) for vs in problem.variants
              for v in vs) + budget
    for j, p in enumerate(paths):
        row = np.zeros(n)  # c <= i
        row[c0 + j], row[i0 + j] = 1.0, -1.0
        add(row, -np.inf, 0.0)
        row = np.zeros(n)  # latency of a path with traffic
        route = problem.routes[p[0]]
        for op, vname in zip(route, p[1], strict=True):
            for h in by_variant[(op, vname)]:
                row[z0 + h] += problem.variant(op, vname).batch_latency_s(hosts[h][2])
        row[i0 + j] = big
        add(row, -np.inf, budget + big)
        for op, vname in zip(route, p[1], strict=True):
            row = np.zeros(n)  # a path with traffic has a worker for each of its variants
            row[i0 + j] = 1.0
            row[[w0 + h for h in by_variant[(op, vname)]]] = -1.0
            add(row, -np.inf, 0.0)
    for r, share in enumerate(problem.shares):
        row = np.zeros(n)
        row[[c0 + j for j, p in enumerate(paths) if p[0] == r]] = 1.0
        if maximise_quality:
            add(row, 0.0, share)
        else:
            add(row, share, share)
    objective = np.zeros(n)
    if maximise_quality:
        for j, p in enumerate(paths):
            objective[c0 + j] = -problem.accuracy[p]
    else:
        objective[w0:w0 + nh] = 1.0
    upper = np.concatenate([np.full(nh, float(S)), np.ones(nh), np.ones(npth), np.ones(npth)])
    integrality = np.concatenate([np.ones(2 * nh), np.zeros(npth), np.ones(npth)])
    res = milp(objective, constraints=LinearConstraint(np.array(rows), lo, hi),
               integrality=integrality, bounds=Bounds(np.zeros(n), upper),
               options={"time_limit": 60.0})
    if res.x is None or res.status not in (0,):
        return None
    x = res.x
    a = np.array(rows)
    scale = 1e-6 * (1.0 + np.abs(a).sum(axis=1) * max(1.0, float(np.abs(x).max())))
    if np.any(a @ x < np.array(lo) - scale) or np.any(a @ x > np.array(hi) + scale):
        # HiGHS has been seen to report optimality for a point outside its constraints
        raise QueryPlanError("the allocation MILP returned a solution that breaks its own "
                             "constraints (a solver fault); retry, or allocate by hand")
    chosen: dict[tuple[int, str], tuple[int, int]] = {}
    for h, (k, name, b) in enumerate(hosts):
        workers = int(round(x[w0 + h]))
        if workers > 0:
            chosen[(k, name)] = (workers, b)
    shares = {p: float(x[c0 + j]) for j, p in enumerate(paths) if x[c0 + j] > 1e-9}
    quality = sum(s * problem.accuracy[p] for p, s in shares.items())
    return Allocation(chosen, shares, float(quality), float(sum(shares.values())),
                      "accuracy" if maximise_quality else "hardware")


def allocate(problem: AllocationProblem) -> Allocation:
    """Loki's two steps: the most accurate variants on the fewest workers if they can serve
    the whole demand within the SLO, else the allocation of greatest expected quality."""
    found = _milp(problem, maximise_quality=False)
    if found is not None:
        return found
    found = _milp(problem, maximise_quality=True)
    if found is None:  # step 2 is always feasible (serve nothing); the solver failed
        raise QueryPlanError("the allocation MILP found no solution")
    return found


def route_table(problem: AllocationProblem, allocation: Allocation
                ) -> dict[int, list[tuple[tuple[str, ...], float]]]:
    """Per route class, the paths a request of that class is sent along and the probability
    of each (the rest of the class is dropped)."""
    table: dict[int, list[tuple[tuple[str, ...], float]]] = {}
    for (r, names), share in sorted(allocation.shares.items()):
        if problem.shares[r] > 0:
            table.setdefault(r, []).append((names, share / problem.shares[r]))
    return table


def most_accurate_first(problem: AllocationProblem, allocation: Allocation,
                        demand_qps: float) -> dict[int, list[tuple[str, float]]]:
    """Loki's runtime routing (Algorithm 1) of ``demand_qps`` over the allocated capacity:
    per operator, the requests/s sent to each hosted variant, most accurate first, each filled
    to its capacity; what no variant can take is the last entry, named ``"drop"``.
    Operators are visited in the order of the routes (a request's operator sees the requests
    its route's earlier operators sent on, times their factors)."""
    incoming = np.zeros(len(problem.operators))
    out: dict[int, list[tuple[str, float]]] = {}
    order: list[int] = []
    for route in problem.routes:
        for k in route:
            if k not in order:
                order.append(k)
    for r, route in enumerate(problem.routes):  # each class enters at its first operator
        incoming[route[0]] += demand_qps * problem.shares[r]
    for k in order:
        hosted = sorted((v for v in problem.variants[k] if (k, v.name) in allocation.hosts),
                        key=lambda v: -v.accuracy)
        left, sent, factor_out = incoming[k], [], 0.0
        for v in hosted:
            take = min(left, allocation.capacity_qps(problem, k, v.name))
            if take > 0:
                sent.append((v.name, float(take)))
                factor_out += take * v.factor
                left -= take
        if left > 1e-12:
            sent.append(("drop", float(left)))
        out[k] = sent
        served = incoming[k] - max(left, 0.0)
        ratio = factor_out / served if served > 0 else 0.0
        # the classes through k split what it served by their shares of its traffic
        reach = sum(problem.shares[r] for r, route in enumerate(problem.routes) if k in route)
        for r, route in enumerate(problem.routes):  # pass the served requests on
            if k in route and route.index(k) + 1 < len(route) and reach > 0:
                nxt = route[route.index(k) + 1]
                incoming[nxt] += served * ratio * problem.shares[r] / reach
    return out


@dataclass(frozen=True)
class ServedAllocation:
    """An allocation as the simulator and the engine serve it: one one-gear plan per hosted
    variant (operator ``"<operator>:<variant>"``, one replica per worker, batches up to the
    allocated size) and every path with traffic as a route through those plans.
    ``paths[j]`` is the path ``routes[j]`` serves."""

    plans: tuple[GearPlan, ...]
    routes: tuple[tuple[int, ...], ...]
    paths: tuple[Path, ...]

    def draw(self, problem: AllocationProblem, allocation: Allocation, n: int,
             rng: np.random.Generator) -> np.ndarray:
        """Route ``n`` requests (``draw_paths`` over this allocation's ``paths``)."""
        return draw_paths(problem, allocation, self.paths, n, rng)


def draw_paths(problem: AllocationProblem, allocation: Allocation, paths: Sequence[Path],
               n: int, rng: np.random.Generator) -> np.ndarray:
    """Route ``n`` requests: each falls in a route class by the classes' shares, then takes a
    path of its class with the allocation's probability (``route_table``). The index into
    ``paths`` of each request's path, -1 where its class's share that no path carries turned
    it away."""
    table = route_table(problem, allocation)
    index = {p: j for j, p in enumerate(paths)}
    classes = rng.choice(len(problem.routes), size=n, p=np.asarray(problem.shares))
    out = np.full(n, -1, dtype=np.int64)
    for r in range(len(problem.routes)):
        mine = np.flatnonzero(classes == r)
        options = table.get(r, [])
        if not mine.size or not options:
            continue
        pick = rng.choice(len(options) + 1, size=mine.size, p=_class_weights(options))
        for i, k in zip(mine, pick, strict=True):
            if k < len(options):
                out[i] = index[(r, options[k][0])]
    return out


def _class_weights(options: Sequence[tuple[tuple[str, ...], float]]) -> np.ndarray:
    """The probability of each of a route class's paths (``route_table``), then of being
    turned away (what none carries)."""
    weights = np.array([q for _, q in options] + [0.0])
    weights[-1] = max(0.0, 1.0 - weights.sum())
    return weights / weights.sum()


def path_for(table: Mapping[int, Sequence[tuple[tuple[str, ...], float]]], route_class: int,
             rng: np.random.Generator, carried: bool = False) -> tuple[str, ...] | None:
    """The variants one request of ``route_class`` is sent along, drawn as ``draw_paths``
    draws them from ``table`` (``route_table``); None: turned away (the allocation carries
    only part of its class, or none). ``carried``: among the paths that carry the class only
    (a request already inside the pipeline, moved by a change of allocation, as the
    simulation moves it); None only where the class has none."""
    options = table.get(route_class, [])
    if not options:
        return None
    if carried:
        weights = np.array([q for _, q in options])
        return options[int(rng.choice(len(options), p=weights / weights.sum()))][0]
    k = int(rng.choice(len(options) + 1, p=_class_weights(options)))
    return options[k][0] if k < len(options) else None


def variant_plan(problem: AllocationProblem, op: int, name: str, devices: Sequence[str],
                 batch: int, max_wait_s: float = 0.005) -> GearPlan:
    """Variant ``name`` of operator ``op`` served alone (operator ``"<operator>:<name>"``),
    one replica per device, the rows split evenly, batches up to ``batch``, with the batch
    runtimes its throughput gives (``Variant.runtimes_s``: what the engine's batch deadlines
    and dropping forecast read)."""
    n = len(devices)
    runtimes = problem.variant(op, name).runtimes_s(batch)
    return GearPlan(f"{problem.operators[op]}:{name}", (0.0, 1e9), (Cascade((name,)),),
                    tuple(Replica(name, (d,)) for d in devices),
                    (RangeSchedule(0, (1.0 / n,) * n, (1,) * n),), (batch,) * n,
                    max_wait_s=max_wait_s, batch_runtime_s=(runtimes,) * n)


def serve_allocation(problem: AllocationProblem, allocation: Allocation,
                     devices: Sequence[str], max_wait_s: float = 0.005) -> ServedAllocation:
    """``allocation`` on ``devices`` (one per worker, handed out in operator order; at least
    ``allocation.workers_used``) as one-gear plans and routes (``ServedAllocation``)."""
    if len(devices) < allocation.workers_used:
        raise QueryPlanError(f"the allocation uses {allocation.workers_used} workers; "
                             f"{len(devices)} devices given")
    plans: list[GearPlan] = []
    where: dict[tuple[int, str], int] = {}
    free = list(devices)
    for (op, name), (workers, batch) in sorted(allocation.hosts.items()):
        mine, free = free[:workers], free[workers:]
        plans.append(variant_plan(problem, op, name, mine, batch, max_wait_s))
        where[(op, name)] = len(plans) - 1
    paths = tuple(sorted(allocation.shares))
    routes = tuple(tuple(where[(op, n)] for op, n in zip(problem.routes[r], names,
                                                        strict=True))
                   for r, names in paths)
    return ServedAllocation(tuple(plans), routes, paths)


def problem_from_sample(sample: PipelineSample, variants: Sequence[Sequence[Variant]],
                        demand_qps: float, workers: int, slo_s: float) -> AllocationProblem:
    """The allocation problem of a measured pipeline sample (``query.PipelineSample``): its
    distinct routes as route classes, their shares of the sample's rows, and each path's
    accuracy the mean quality of the rows of its route answered by its variants."""
    routes = sorted(set(sample.routes))
    counts = {r: 0 for r in routes}
    for r in sample.routes:
        counts[r] += 1
    shares = tuple(counts[r] / sample.num_rows for r in routes)
    accuracy: dict[Path, float] = {}
    for ri, route in enumerate(routes):
        rows = [q for q, r in enumerate(sample.routes) if r == route]
        for combo in itertools.product(*(variants[k] for k in route)):
            names = tuple(v.name for v in combo)
            values = [sample.quality.get((q, names)) for q in rows]
            if any(v is None for v in values):
                raise QueryPlanError(f"the sample lacks the outcome of route {route} with "
                                     f"{names}")
            accuracy[(ri, names)] = float(np.mean(values))
    return AllocationProblem(tuple(sample.operators), tuple(tuple(v) for v in variants),
                             tuple(routes), shares, accuracy, demand_qps, workers, slo_s)


__all__ = ["Allocation", "AllocationProblem", "ServedAllocation", "Variant", "allocate",
           "draw_paths", "most_accurate_first", "path_for", "problem_from_sample", "route_table",
           "serve_allocation", "variant_plan"]
