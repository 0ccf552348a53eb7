"""A pipeline's allocation re-solved online from the recent demand (issue 37, item 2; Loki,
HPDC 2024, §5: the controller re-runs the MILP every few seconds on an EWMA of the demand).

``ken.optimizer.allocation`` solves one demand. Served for hours, the demand moves: an
allocation solved for the planning window's rate turns requests away when the rate doubles,
and one solved for the peak serves cheap variants all the time. Here the demand is measured
in periods of ``Resolving.every_s``; at the end of each period an EWMA of the measured rates
gives the demand the next period's allocation is solved for (``online_schedule``). Demands are
rounded onto a geometric grid (``Resolving.step``) so that nearby demands share one solve and
one set of hosted plans.

A ``Schedule`` is the allocation of every period; ``serve_schedule`` turns it into the plans
and routes the simulator serves (each distinct set of hosts once, as
``allocation.serve_allocation`` places it), ``simulate_schedule`` routes each request by the
allocation of the period it arrives in and simulates the whole trace at once; when the
allocation changes, the requests inside the pipeline move onto paths of the new one from the
hop they are at, so a change loses nothing (variants stay loaded: no model-load time is
charged, as on devices with memory for every variant).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ken.errors import QueryPlanError
from ken.optimizer.allocation import (
    Allocation,
    AllocationProblem,
    Path,
    allocate,
    draw_paths,
    route_table,
    serve_allocation,
)
from ken.optimizer.perf import Catalog
from ken.optimizer.sim_core import EventLoop
from ken.optimizer.simulator import simulate_many
from ken.optimizer.workload import Trace
from ken.policy.dropping import DropPolicy
from ken.policy.plan import GearPlan

#: below this share of the planned demand, a period keeps the last allocation
MIN_DEMAND_SHARE = 0.01


@dataclass(frozen=True)
class Resolving:
    """Re-solve every ``every_s`` seconds for ``(1 + headroom)`` x the EWMA of the demand
    (``alpha`` x the last period's measured rate + ``(1 - alpha)`` x the previous estimate),
    rounded to the nearest point of the grid ``(1 + step)^j`` requests/s (``step`` 0: no
    rounding). The headroom is what drains a backlog: the MILP fills capacity up to the
    demand it is given, and at a utilisation of 1 the queue a rise in demand left behind
    (the EWMA lags it) never empties."""

    every_s: float = 2.0
    alpha: float = 0.5
    step: float = 0.05
    headroom: float = 0.1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.every_s) and self.every_s > 0):
            raise QueryPlanError(f"re-solve period must be > 0 s, got {self.every_s}")
        if not 0 < self.alpha <= 1:
            raise QueryPlanError(f"EWMA weight must be in (0, 1], got {self.alpha}")
        if not (math.isfinite(self.step) and self.step >= 0):
            raise QueryPlanError(f"demand rounding step must be >= 0, got {self.step}")
        if not (math.isfinite(self.headroom) and self.headroom >= 0):
            raise QueryPlanError(f"headroom must be >= 0, got {self.headroom}")

    def rounded(self, demand_qps: float) -> float:
        if self.step == 0 or demand_qps <= 0:
            return max(demand_qps, 0.0)
        base = math.log1p(self.step)
        return math.exp(round(math.log(demand_qps) / base) * base)


def periods_of(arrival_s: np.ndarray, duration_s: float, every_s: float) -> int:
    """How many periods of ``every_s`` cover the trace (at least one)."""
    last = float(arrival_s[-1]) if len(arrival_s) else 0.0
    return max(1, math.ceil(max(duration_s, last + 1e-9) / every_s))


def measured_rates(arrival_s: np.ndarray, periods: int, every_s: float) -> np.ndarray:
    """Arrivals per second in each period."""
    k = np.minimum((np.asarray(arrival_s) // every_s).astype(np.int64), periods - 1)
    return np.bincount(k, minlength=periods)[:periods] / every_s


def ewma_demands(arrival_s: np.ndarray, periods: int, start_qps: float,
                 resolving: Resolving) -> np.ndarray:
    """Per period, the demand its allocation is solved for: ``start_qps`` (what the pipeline
    was planned for) in the first, then the EWMA of the rates measured in the periods before
    (known at the period's start), with the headroom, rounded (``Resolving.rounded``); a
    period whose estimate fell below ``MIN_DEMAND_SHARE`` of ``start_qps`` keeps the demand
    of the period before."""
    if not start_qps > 0:
        raise QueryPlanError(f"the planned demand must be > 0 requests/s, got {start_qps}")
    rates = measured_rates(arrival_s, periods, resolving.every_s)
    out = np.empty(periods)
    estimate = start_qps
    for k in range(periods):
        want = resolving.rounded(estimate * (1 + resolving.headroom) if k else estimate)
        # a demand that fell to (nearly) nothing keeps the allocation it had: there is
        # nothing to re-solve for, and the next requests need somewhere to go
        out[k] = want if want >= MIN_DEMAND_SHARE * start_qps or not k else out[k - 1]
        estimate = resolving.alpha * rates[k] + (1 - resolving.alpha) * estimate
    return out


@dataclass(frozen=True)
class Schedule:
    """The allocation of each period of ``period_s`` (``allocations[which[k]]`` in period
    ``k``, solved for ``demands[k]`` as ``problems[which[k]]``)."""

    period_s: float
    demands: tuple[float, ...]
    which: tuple[int, ...]
    problems: tuple[AllocationProblem, ...]
    allocations: tuple[Allocation, ...]

    def __post_init__(self) -> None:
        if not self.which or len(self.which) != len(self.demands):
            raise QueryPlanError("a schedule needs one demand and one allocation per period")
        if len(self.problems) != len(self.allocations) or not all(
                0 <= a < len(self.allocations) for a in self.which):
            raise QueryPlanError("a schedule's periods must name its allocations")

    @property
    def periods(self) -> int:
        return len(self.which)

    @property
    def changes(self) -> int:
        """How often the allocation changed between periods."""
        return sum(a != b for a, b in itertools.pairwise(self.which))

    def at(self, t: float) -> int:
        """The period time ``t`` falls in (the last for times beyond it)."""
        return min(int(t // self.period_s), self.periods - 1)


def schedule_for(problem_for: Callable[[float], AllocationProblem], demands: Sequence[float],
                 period_s: float) -> Schedule:
    """Solve each period's demand (each distinct demand once)."""
    index: dict[float, int] = {}
    problems: list[AllocationProblem] = []
    allocations: list[Allocation] = []
    which = []
    for d in demands:
        d = float(d)
        if d not in index:
            problem = problem_for(d)
            index[d] = len(problems)
            problems.append(problem)
            allocations.append(allocate(problem))
        which.append(index[d])
    return Schedule(period_s, tuple(float(d) for d in demands), tuple(which), tuple(problems),
                    tuple(allocations))


def fixed_schedule(problem: AllocationProblem, periods: int, period_s: float,
                   allocation: Allocation | None = None) -> Schedule:
    """One allocation for every period (solved for ``problem.demand_qps`` unless given)."""
    got = allocate(problem) if allocation is None else allocation
    return Schedule(period_s, (problem.demand_qps,) * periods, (0,) * periods, (problem,),
                    (got,))


def online_schedule(problem_for: Callable[[float], AllocationProblem], trace: Trace,
                    duration_s: float, start_qps: float, resolving: Resolving) -> Schedule:
    """Loki's controller on ``trace``: the first period's allocation for ``start_qps``, each
    later one for the EWMA of the demand measured before it (``ewma_demands``)."""
    periods = periods_of(trace.arrival_s, duration_s, resolving.every_s)
    return schedule_for(problem_for, ewma_demands(trace.arrival_s, periods, start_qps,
                                                  resolving), resolving.every_s)


@dataclass(frozen=True)
class ServedSchedule:
    """A schedule as the simulator serves it: ``plans`` (each distinct set of hosts placed
    once by ``serve_allocation``), ``routes[j]`` the plans of path ``paths[j]`` (allocation
    index, path), and per allocation the index of its first path (``first``)."""

    plans: tuple[GearPlan, ...]
    routes: tuple[tuple[int, ...], ...]
    paths: tuple[tuple[int, Path], ...]
    first: tuple[int, ...]

    def paths_of(self, allocation: int) -> list[Path]:
        """Allocation ``allocation``'s paths, in order (global index: ``first[allocation]``
        plus the position here)."""
        end = self.first[allocation + 1] if allocation + 1 < len(self.first) else len(self.paths)
        return [p for _, p in self.paths[self.first[allocation]:end]]


def serve_schedule(schedule: Schedule, devices: Sequence[str],
                   max_wait_s: float = 0.005) -> ServedSchedule:
    """Place every allocation of ``schedule`` on ``devices`` (``serve_allocation``); the
    allocations with the same hosts share their plans."""
    plans: list[GearPlan] = []
    placed: dict[tuple, int] = {}  # hosts -> offset of its plans
    routes: list[tuple[int, ...]] = []
    paths: list[tuple[int, Path]] = []
    first = []
    for a, (problem, alloc) in enumerate(zip(schedule.problems, schedule.allocations,
                                             strict=True)):
        served = serve_allocation(problem, alloc, devices, max_wait_s)
        key = tuple(sorted(alloc.hosts.items()))
        if key not in placed:
            placed[key] = len(plans)
            plans.extend(served.plans)
        offset = placed[key]
        first.append(len(routes))
        routes.extend(tuple(offset + k for k in route) for route in served.routes)
        paths.extend((a, p) for p in served.paths)
    return ServedSchedule(tuple(plans), tuple(routes), tuple(paths), tuple(first))


@dataclass(frozen=True)
class ScheduleRun:
    """Per request: its period, the path drawn for it at arrival (index into
    ``ServedSchedule.paths``; -1: turned away, its route class had no capacity left), whether
    a change of allocation moved it onto another path (``moved``), its latency (NaN when
    turned away or dropped) and its quality (the accuracy of the variants that answered it,
    when within the SLO; else 0)."""

    period: np.ndarray
    path: np.ndarray
    moved: np.ndarray
    latency_s: np.ndarray
    quality: np.ndarray
    on_time: np.ndarray

    def per_period(self, periods: int) -> list[dict[str, float]]:
        """Requests, mean quality and share on time in each period."""
        out = []
        for k in range(periods):
            mine = self.period == k
            n = int(mine.sum())
            out.append({"period": k, "requests": n,
                        "quality": float(self.quality[mine].mean()) if n else math.nan,
                        "on_time": float(self.on_time[mine].mean()) if n else math.nan})
        return out


def simulate_schedule(schedule: Schedule, served: ServedSchedule, catalog: Catalog,
                      trace: Trace, slo_s: float, seed: int = 0,
                      dropping: DropPolicy | None = None) -> ScheduleRun:
    """Route each request by the allocation of its arrival's period (its class by the
    classes' shares, its path by the allocation's probabilities: ``draw_paths``) and
    simulate every request through the plans at once (``simulate_many``). When the
    allocation changes, the requests inside the pipeline take a path of the new one (drawn
    for their class) from where they are: those queued leave their queues for the new plans
    (as the engine's plan swap moves them), one being served goes on to the new plans after
    its current hop; none is lost or turned away. With ``dropping`` (``ken.policy.dropping``)
    every request's deadline is the SLO and the policy drops those that cannot make it
    (Loki drops a request that falls behind); a dropped request counts as late. The catalog
    must profile every variant and hold at least as many sample rows as there are paths (a
    path index stands in for the row, as in ``benchmarks/pipeline_load.py``)."""
    n = len(trace)
    if catalog.num_rows < len(served.routes):
        raise QueryPlanError(f"the catalog has {catalog.num_rows} sample rows; simulating "
                             f"this schedule needs at least {len(served.routes)} (one per "
                             "path)")
    rng = np.random.default_rng(seed)
    period = np.minimum((trace.arrival_s // schedule.period_s).astype(np.int64),
                        schedule.periods - 1)  # ``Schedule.at`` of every arrival
    path = np.full(n, -1, dtype=np.int64)
    for k in range(schedule.periods):
        mine = np.flatnonzero(period == k)
        if not mine.size:
            continue
        a = schedule.which[k]
        problem, alloc = schedule.problems[a], schedule.allocations[a]
        local = draw_paths(problem, alloc, served.paths_of(a), mine.size, rng)
        path[mine] = np.where(local >= 0, local + served.first[a], -1)
    kept = np.flatnonzero(path >= 0)
    # per request inside the simulation (ids 0..len(kept)-1): its route class and the
    # variants that answer it, rewritten when a change moves it
    names = [served.paths[j][1][1] for j in path[kept]]
    moved = np.zeros(n, dtype=bool)
    timers = [(k * schedule.period_s, _change(schedule, served, path[kept], names, moved, kept,
                                              rng, schedule.which[k]))
              for k in range(1, schedule.periods) if schedule.which[k] != schedule.which[k - 1]]
    latency = np.full(n, np.nan)
    if kept.size:
        sub = Trace(trace.arrival_s[kept], trace.name)
        res = simulate_many(served.plans, [catalog] * len(served.plans), sub, seed,
                            routes=served.routes, rows=path[kept].tolist(), timers=timers,
                            deadline_s=None if dropping is None else slo_s,
                            dropping=dropping)
        latency[kept] = res.latency_s  # NaN where dropped
    accuracy = np.zeros(n)
    for i, j, got in zip(kept, path[kept], names, strict=True):
        a, (r, _) = served.paths[j]
        accuracy[i] = schedule.problems[a].accuracy[(r, got)]
    on_time = (path >= 0) & (np.nan_to_num(latency, nan=np.inf) <= slo_s)
    return ScheduleRun(period, path, moved, latency, np.where(on_time, accuracy, 0.0), on_time)


def _change(schedule: Schedule, served: ServedSchedule, drawn: np.ndarray,
            names: list[tuple[str, ...]], moved: np.ndarray, kept: np.ndarray,
            rng: np.random.Generator, new: int) -> Callable[[EventLoop, float], None]:
    """The timer that puts allocation ``new`` in place: every request inside the pipeline
    goes on along a path of ``new`` drawn for its class, from the hop it is at."""
    problem, alloc = schedule.problems[new], schedule.allocations[new]
    position = {p: served.first[new] + j for j, p in enumerate(served.paths_of(new))}
    options: dict[int, tuple[list[int], np.ndarray]] = {}
    for r, paths in route_table(problem, alloc).items():
        index = [position[(r, ns)] for ns, _ in paths]
        weights = np.array([q for _, q in paths])
        options[r] = (index, weights / weights.sum())

    def change(loop: EventLoop, now: float) -> None:
        inside = loop.inside()
        queued = {rid for k in range(len(served.plans)) for rid in loop.drain(k)}
        for rid, k in sorted(inside.items()):
            r = served.paths[drawn[rid]][1][0]
            route = loop.routes[rid]
            hop = route.index(k)
            found = options.get(r)
            if found is None:  # the new allocation serves none of its class: as it was
                if rid in queued:
                    loop.reroute(rid, route[hop:], k, now)
                continue
            j = found[0][rng.choice(len(found[0]), p=found[1])]
            target, variants = served.routes[j], served.paths[j][1][1]
            at = hop if rid in queued else hop + 1  # the first hop the new path takes
            names[rid] = names[rid][:at] + variants[at:]
            moved[kept[rid]] = True
            if rid in queued:
                loop.reroute(rid, target[at:], k, now)
            else:
                loop.retarget(rid, target[at:])

    return change


__all__ = ["Resolving", "Schedule", "ScheduleRun", "ServedSchedule", "ewma_demands",
           "fixed_schedule", "measured_rates", "online_schedule", "periods_of",
           "schedule_for", "serve_schedule", "simulate_schedule"]
