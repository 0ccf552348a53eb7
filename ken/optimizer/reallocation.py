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

That controller is open loop: its schedule is computed from the arrivals alone, before the
run, and never sees the requests a lagging allocation left queued. ``simulate_closed_loop``
closes the loop (``ClosedLoop``): at each period's start, inside the simulation, it reads the
backlog (the requests queued or in service in the pipeline) and solves for the EWMA plus the
backlog spread over ``ClosedLoop.drain_s`` (``period_demand``), with the same rounding and
the same cache of solves (``Solver``). The simulator needs every plan before it starts, so a
run whose controller picks an allocation with hosts no plan has yet restarts with its plans
added (the run up to that pick is the same; the result is that of one run with every plan
from the start).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ken.errors import KenError, QueryPlanError
from ken.optimizer.allocation import (
    Allocation,
    AllocationProblem,
    Path,
    allocate,
    draw_paths,
    path_for,
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
#: inside a period, a jump in demand (the rate so far, the backlog) re-solves at once only when
#: it asks for this much more than the period's demand (``Controller.urgent``;
#: ``ClosedLoop.checks``)
URGENT_RISE = 0.25


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


def period_demand(resolving: Resolving, start_qps: float, k: int, estimate_qps: float,
                  previous_qps: float, backlog_qps: float = 0.0) -> float:
    """The demand period ``k``'s allocation is solved for: ``start_qps`` in the first
    (rounded), then ``(1 + headroom)`` x (the EWMA ``estimate_qps`` + ``backlog_qps``, what
    the requests left inside the pipeline add), rounded (``Resolving.rounded``). A period
    whose estimate fell below ``MIN_DEMAND_SHARE`` of ``start_qps`` keeps ``previous_qps``
    (the demand of the period before), raised to what the backlog needs if that is more: a
    larger backlog never solves for less."""
    if not k:
        return resolving.rounded(start_qps)
    plain = resolving.rounded(estimate_qps * (1 + resolving.headroom))
    want = resolving.rounded((estimate_qps + backlog_qps) * (1 + resolving.headroom))
    if plain >= MIN_DEMAND_SHARE * start_qps:
        return want
    # a demand that fell to (nearly) nothing keeps the allocation it had: there is nothing
    # to re-solve for, and the next requests need somewhere to go
    return max(previous_qps, want) if backlog_qps > 0 else previous_qps


class Controller:
    """Loki's controller from one period to the next, in simulation (the functions below)
    and on the engine (``ken.engine.allocated``): ``decide(backlog_qps)`` is the demand the
    period starting now is solved for (``period_demand`` of the EWMA known now), and
    ``measured(rate_qps)`` takes the rate of arrivals the period just ended saw."""

    def __init__(self, resolving: Resolving, start_qps: float) -> None:
        if not start_qps > 0:
            raise QueryPlanError(f"the planned demand must be > 0 requests/s, got {start_qps}")
        self.resolving = resolving
        self.start_qps = start_qps
        self.estimate_qps = start_qps  # the EWMA of the rates measured so far
        self.demands: list[float] = []  # what each period so far was solved for

    def decide(self, backlog_qps: float = 0.0) -> float:
        previous = self.demands[-1] if self.demands else self.start_qps
        demand = period_demand(self.resolving, self.start_qps, len(self.demands),
                               self.estimate_qps, previous, backlog_qps)
        self.demands.append(demand)
        return demand

    def measured(self, rate_qps: float) -> None:
        alpha = self.resolving.alpha
        self.estimate_qps = alpha * rate_qps + (1 - alpha) * self.estimate_qps

    def urgent(self, backlog_qps: float, rate_qps: float = 0.0) -> float | None:
        """Inside a period: the demand to re-solve for now, when the demand in sight asks for
        at least ``URGENT_RISE`` more than the period's: ``(1 + headroom)`` x (the larger of
        the EWMA known at the period's start and ``rate_qps``, the rate of arrivals measured so
        far in this period, + ``backlog_qps``), rounded: a jump the EWMA has not measured yet.
        It becomes the period's demand. None: keep the allocation. The period's demand counts
        at least what the EWMA alone asks for (the first period's is the planned demand
        without headroom: no jump must not re-solve it)."""
        if not self.demands:
            return None
        r = self.resolving
        want = r.rounded((max(self.estimate_qps, rate_qps) + backlog_qps) * (1 + r.headroom))
        floor = max(self.demands[-1], r.rounded(self.estimate_qps * (1 + r.headroom)))
        if want < floor * (1 + URGENT_RISE):
            return None
        self.demands[-1] = want
        return want


def ewma_demands(arrival_s: np.ndarray, periods: int, start_qps: float,
                 resolving: Resolving) -> np.ndarray:
    """Per period, the demand its allocation is solved for (``Controller``: ``period_demand``
    of the EWMA of the rates measured in the periods before; no backlog)."""
    control = Controller(resolving, start_qps)
    for rate in measured_rates(arrival_s, periods, resolving.every_s):
        control.decide()
        control.measured(float(rate))
    return np.array(control.demands)


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


class Solver:
    """The allocation of each distinct demand, solved once (``allocate`` on
    ``problem_for(demand)``) however many schedules or runs ask for it; ``seconds``: the
    time the solves took.

    >>> solver = Solver(problem_for)  # doctest: +SKIP
    >>> problem, allocation = solver(7389.0)  # doctest: +SKIP
    """

    def __init__(self, problem_for: Callable[[float], AllocationProblem]) -> None:
        self.problem_for = problem_for
        self.solved: dict[float, tuple[AllocationProblem, Allocation]] = {}
        self.seconds = 0.0

    def __call__(self, demand_qps: float) -> tuple[AllocationProblem, Allocation]:
        got = self.solved.get(demand_qps)
        if got is None:
            started = time.perf_counter()
            problem = self.problem_for(demand_qps)
            got = (problem, allocate(problem))
            self.seconds += time.perf_counter() - started
            self.solved[demand_qps] = got
        return got


def schedule_for(problem_for: Callable[[float], AllocationProblem], demands: Sequence[float],
                 period_s: float) -> Schedule:
    """Solve each period's demand (each distinct demand once)."""
    return _schedule(period_s, [float(d) for d in demands], Solver(problem_for))


def _schedule(period_s: float, demands: Sequence[float], solver: Solver,
              order: Sequence[float] = ()) -> Schedule:
    """The schedule of ``demands``, its allocations those of the demands in ``order`` and
    then of the others in order of first use."""
    index = {d: j for j, d in enumerate(dict.fromkeys([*order, *demands]))}
    pairs = [solver(d) for d in index]
    return Schedule(period_s, tuple(demands), tuple(index[d] for d in demands),
                    tuple(p for p, _ in pairs), tuple(a for _, a in pairs))


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
    return _serve(list(zip(schedule.problems, schedule.allocations, strict=True)), devices,
                  max_wait_s)


def _serve(pairs: Sequence[tuple[AllocationProblem, Allocation]], devices: Sequence[str],
           max_wait_s: float) -> ServedSchedule:
    """``serve_schedule`` of these allocations; one appended later only appends plans (if
    its hosts are new), paths and routes: the indices of the others stay."""
    plans: list[GearPlan] = []
    placed: dict[tuple, int] = {}  # hosts -> offset of its plans
    routes: list[tuple[int, ...]] = []
    paths: list[tuple[int, Path]] = []
    first = []
    for a, (problem, alloc) in enumerate(pairs):
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
    period = _arrival_periods(trace.arrival_s, schedule.period_s, schedule.periods)
    path = np.full(n, -1, dtype=np.int64)
    for k in range(schedule.periods):
        mine = np.flatnonzero(period == k)
        if mine.size:
            path[mine] = _draw(schedule, served, schedule.which[k], mine.size, rng)
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
    return _outcome(schedule, served, period, path, names, moved, latency, slo_s)


def _arrival_periods(arrival_s: np.ndarray, period_s: float, periods: int) -> np.ndarray:
    """``Schedule.at`` of every arrival."""
    return np.minimum((arrival_s // period_s).astype(np.int64), periods - 1)


def _draw(schedule: Schedule, served: ServedSchedule, a: int, n: int,
          rng: np.random.Generator) -> np.ndarray:
    """The paths (``served.paths`` indices; -1: turned away) of ``n`` requests routed by
    allocation ``a`` (``draw_paths``)."""
    local = draw_paths(schedule.problems[a], schedule.allocations[a], served.paths_of(a), n,
                       rng)
    return np.where(local >= 0, local + served.first[a], -1)


def _outcome(schedule: Schedule, served: ServedSchedule, period: np.ndarray,
             path: np.ndarray, names: Sequence[tuple[str, ...]], moved: np.ndarray,
             latency: np.ndarray, slo_s: float) -> ScheduleRun:
    """The run's outcome per request: ``names`` are the variants that answered the
    requests routed (``path >= 0``, in order)."""
    kept = np.flatnonzero(path >= 0)
    accuracy = np.zeros(len(path))
    for i, j, got in zip(kept, path[kept], names, strict=True):
        a, (r, _) = served.paths[j]
        accuracy[i] = schedule.problems[a].accuracy[(r, got)]
    on_time = (path >= 0) & (np.nan_to_num(latency, nan=np.inf) <= slo_s)
    return ScheduleRun(period, path, moved, latency, np.where(on_time, accuracy, 0.0), on_time)


def _change(schedule: Schedule, served: ServedSchedule, drawn: np.ndarray,
            names: list[tuple[str, ...]], moved: np.ndarray, kept: np.ndarray,
            rng: np.random.Generator, new: int) -> Callable[[EventLoop, float], None]:
    """The timer that puts allocation ``new`` in place: every request inside the pipeline
    goes on along a path of ``new`` drawn among those that carry its class (``path_for(...,
    carried=True)``, as the engine's ``AllocatedPipeline`` moves it), from the hop it is at."""
    problem, alloc = schedule.problems[new], schedule.allocations[new]
    position = {p: served.first[new] + j for j, p in enumerate(served.paths_of(new))}
    table = route_table(problem, alloc)

    def change(loop: EventLoop, now: float) -> None:
        inside = loop.inside()
        queued = {rid for k in range(len(served.plans)) for rid in loop.drain(k)}
        for rid, k in sorted(inside.items()):
            r = served.paths[drawn[rid]][1][0]
            route = loop.routes[rid]
            hop = route.index(k)
            found = path_for(table, r, rng, carried=True)
            if found is None:  # the new allocation serves none of its class: as it was
                if rid in queued:
                    loop.reroute(rid, route[hop:], k, now)
                continue
            j = position[(r, found)]
            target, variants = served.routes[j], served.paths[j][1][1]
            at = hop if rid in queued else hop + 1  # the first hop the new path takes
            names[rid] = names[rid][:at] + variants[at:]
            moved[kept[rid]] = True
            if rid in queued:
                loop.reroute(rid, target[at:], k, now)
            else:
                loop.retarget(rid, target[at:])

    return change


# -- the controller closed over the backlog ------------------------------------------------


@dataclass(frozen=True)
class ClosedLoop:
    """Loki's controller (``resolving``) closed over the pipeline's backlog: at each
    period's start the demand solved for is ``(1 + headroom)`` x (the EWMA of the measured
    rates + the requests inside the pipeline, queued or in service, / ``drain_s``). The
    backlog is spread over ``drain_s`` seconds (None: one period, ``resolving.every_s``):
    shorter drains it sooner on more, cheaper capacity; the next period's re-solve sees what
    is left. In a steady state the backlog is the requests in service (Little's law: the
    rate x the latency), so the controller solves for about ``latency / drain_s`` more than
    the open loop even with no queue.

    ``checks`` > 1 also reads the backlog and the rate of arrivals so far in the period
    ``checks - 1`` times inside each period, evenly spaced, and re-solves at once when the
    demand jumped (``Controller.urgent``: at least ``URGENT_RISE`` above the period's), so a
    step in demand is met within a fraction of a period instead of at the next period's start;
    the EWMA still moves once a period."""

    resolving: Resolving = Resolving()
    drain_s: float | None = None
    checks: int = 1

    def __post_init__(self) -> None:
        if self.drain_s is not None and not (math.isfinite(self.drain_s) and self.drain_s > 0):
            raise QueryPlanError(f"the backlog's drain time must be > 0 s, got {self.drain_s}")
        if self.checks < 1:
            raise QueryPlanError(f"the backlog is read at least once a period, got {self.checks}")

    @property
    def check_s(self) -> float:
        """Seconds between two readings of the backlog."""
        return self.resolving.every_s / self.checks

    @property
    def drain(self) -> float:
        """``drain_s``, or one period."""
        return self.resolving.every_s if self.drain_s is None else self.drain_s


@dataclass(frozen=True)
class ClosedLoopRun:
    """A closed-loop controller's run (``simulate_closed_loop``): the allocation each period
    got as the controller chose it during the run (``schedule``; with ``ClosedLoop.checks``
    > 1 its periods are the stretches between two readings of the backlog), how the
    allocations were served, the outcome per request, the backlog the controller read at each
    of those readings (requests inside the pipeline) and how often the run restarted to place
    new plans."""

    schedule: Schedule
    served: ServedSchedule
    run: ScheduleRun
    backlog: tuple[int, ...]
    restarts: int


class _NewPlans(KenError):
    """The controller picked an allocation whose plans the running simulation lacks (never
    leaves ``simulate_closed_loop``, which restarts the run with them)."""


def simulate_closed_loop(control: ClosedLoop, solver: Solver, start_qps: float,
                         devices: Sequence[str], catalog: Catalog, trace: Trace,
                         duration_s: float, slo_s: float, seed: int = 0,
                         dropping: DropPolicy | None = None, max_wait_s: float = 0.005,
                         place: Sequence[float] = ()) -> ClosedLoopRun:
    """Loki's controller closed over the backlog on ``trace``, decided inside the
    simulation: at the start of each period, before anything else happens then, it reads
    the requests inside the pipeline (``EventLoop.inside``), solves for ``period_demand``
    of the EWMA of the rates measured so far plus that backlog / ``control.drain`` (each
    distinct demand once, through ``solver``: share one between runs to bound the solves),
    moves the requests inside onto the new allocation as ``simulate_schedule`` does, and
    routes the period's arrivals by it (``draw_paths``; those turned away never enter a
    plan). Served on ``devices`` as ``serve_schedule`` places allocations; otherwise as
    ``simulate_schedule`` (``dropping``, the SLO, quality per request). The plans of the
    demands in ``place`` (as the controller rounds them) are placed from the start; others
    as the controller picks them (a restart each: ``ClosedLoopRun.restarts``).

    >>> got = simulate_closed_loop(ClosedLoop(Resolving(every_s=2.0)), Solver(problem_for),
    ...                            7389.0, devices, catalog, trace, 60.0, 0.2)  # doctest: +SKIP
    >>> got.schedule.demands, got.backlog  # doctest: +SKIP
    """
    first = period_demand(control.resolving, start_qps, 0, start_qps, start_qps)
    known = list(dict.fromkeys([first, *map(float, place)]))
    restarts = 0
    while True:
        try:
            return _closed_run(control, solver, start_qps, known, devices, catalog, trace,
                               duration_s, slo_s, seed, dropping, max_wait_s, restarts)
        except _NewPlans:  # ``known`` now holds the demand that needs them
            restarts += 1


def _closed_run(closed: ClosedLoop, solver: Solver, start_qps: float, known: list[float],
                devices: Sequence[str], catalog: Catalog, trace: Trace, duration_s: float,
                slo_s: float, seed: int, dropping: DropPolicy | None, max_wait_s: float,
                restarts: int) -> ClosedLoopRun:
    """One try of ``simulate_closed_loop`` with the plans of the demands ``known``; raises
    ``_NewPlans`` (having added the demand to ``known``) when the controller needs more."""
    every, step_s, checks = closed.resolving.every_s, closed.check_s, closed.checks
    n = len(trace)
    periods = periods_of(trace.arrival_s, duration_s, every)
    slots = periods * checks  # the stretches between two readings of the backlog
    slot = _arrival_periods(trace.arrival_s, step_s, slots)
    bounds = np.searchsorted(slot, np.arange(slots + 1))  # arrivals are sorted
    rates = measured_rates(trace.arrival_s, periods, every)
    control = Controller(closed.resolving, start_qps)
    rng = np.random.default_rng(seed)
    served = _serve([solver(d) for d in known], devices, max_wait_s)
    now: Schedule | None = None  # the allocations the controller chose so far
    path = np.full(n, -1, dtype=np.int64)
    names: list[tuple[str, ...]] = [()] * n
    moved = np.zeros(n, dtype=bool)
    hits = [False] * n  # turned away: answered at arrival without entering a plan
    demands: list[float] = []  # per slot
    backlog: list[int] = []
    everyone = np.arange(n)

    def choose(j: int, inside: int, runners: int | None) -> int:
        """Slot ``j``'s allocation for the backlog ``inside`` (``runners``: the plans the
        running simulation has; None: after its end): at a period's start the controller's
        decision, inside one its urgent re-solve if the backlog jumped."""
        nonlocal now, served
        k, offset = divmod(j, checks)
        if offset == 0:
            if k:  # the period before has ended: its rate is measured now, not earlier
                control.measured(float(rates[k - 1]))
            demand = control.decide(inside / closed.drain)
        else:  # the arrivals so far in this period are known now
            so_far = (bounds[j] - bounds[k * checks]) / (offset * step_s)
            urgent = control.urgent(inside / closed.drain, float(so_far))
            demand = demands[-1] if urgent is None else urgent
        if demand not in known:
            known.append(demand)
            served = _serve([solver(d) for d in known], devices, max_wait_s)
            if runners is not None and len(served.plans) > runners:
                raise _NewPlans(f"demand {demand:g} needs new plans")
        demands.append(demand)
        backlog.append(inside)
        now = _schedule(step_s, demands, solver, known)
        return now.which[-1]

    def boundary(j: int) -> Callable[[EventLoop, float], None]:
        def decide(loop: EventLoop, t: float) -> None:
            was = -1 if now is None else now.which[-1]
            a = choose(j, len(loop.inside()), len(loop.runners))
            assert now is not None
            if was >= 0 and a != was:
                _change(now, served, path, names, moved, everyone, rng, a)(loop, t)
            lo, hi = int(bounds[j]), int(bounds[j + 1])
            path[lo:hi] = _draw(now, served, a, hi - lo, rng)
            for i in range(lo, hi):
                p = int(path[i])
                if p < 0:
                    hits[i] = True
                    continue
                loop.routes[i] = served.routes[p]
                names[i] = served.paths[p][1][1]
                if loop.dropper is not None:
                    loop.dropper.register(i, loop.dropper.deadline_s(i), served.routes[p])
        return decide

    # the first arrival of a slot is never before its decision (float edges of ``//``)
    timers = [(min(j * step_s, float(trace.arrival_s[bounds[j]])) if bounds[j] < n
               else j * step_s, boundary(j)) for j in range(slots)]
    res = simulate_many(served.plans, [catalog] * len(served.plans), trace, seed,
                        routes=served.routes, rows=[0] * n, hits=hits, timers=timers,
                        deadline_s=None if dropping is None else slo_s, dropping=dropping)
    for j in range(len(demands), slots):  # the run ended before these slots began:
        choose(j, 0, None)  # nothing inside, nothing arrives
    latency = np.where(path >= 0, res.latency_s, np.nan)  # NaN where dropped or turned away
    assert now is not None  # the first period's decision is made at 0 s
    run = _outcome(now, served, slot, path, [names[i] for i in np.flatnonzero(path >= 0)],
                   moved, latency, slo_s)
    return ClosedLoopRun(now, served, run, tuple(backlog), restarts)


__all__ = ["ClosedLoop", "ClosedLoopRun", "Controller", "Resolving", "Schedule", "ScheduleRun",
           "ServedSchedule", "Solver", "ewma_demands", "fixed_schedule",
           "measured_rates", "online_schedule", "period_demand", "periods_of", "schedule_for",
           "serve_schedule", "simulate_closed_loop", "simulate_schedule", "URGENT_RISE"]
