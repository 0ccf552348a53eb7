"""Continuous-time discrete-event simulator of gear plans (DESIGN.md section 5.6).

Replays a trace's arrivals through the same ``Dispatcher`` the online engine uses, on a
``VirtualClock``: a batch of ``b`` rows on a replica occupies its devices for the profiled
runtime of ``b`` rows (interpolated between profiled batch sizes), and each row's escalation is
decided by the certainty its model recorded for that row's sample in the profile. Request ``i``
of the trace is sample row ``order[i % rows]`` of a seeded permutation, so accuracy is measured
on the labelled sample.

Several operators (plans) can be simulated together: each request passes through them in
order (or along its own route of operators, e.g. a question that needs a text hop, a table hop
or both), and plans that place replicas on the same device share that device.

Each plan is a runner (``_Operator``) of the event loop in ``ken.optimizer.sim_core``, whose
work is a batch on a replica's devices, charged its profiled runtime.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ken.errors import SimulationError
from ken.optimizer.perf import Catalog, sized_runtime, woke
from ken.optimizer.sim_core import EventLoop, Record, run_metrics
from ken.optimizer.workload import Trace
from ken.policy.dropping import (
    DeadlineMetrics,
    Drop,
    DropPolicy,
    PipelineDropper,
    StageGate,
    StageProfile,
    deadline_metrics,
    stage_profile,
)
from ken.policy.metrics import PlanMetrics, RangeMetrics, latency_percentiles
from ken.policy.plan import GearPlan
from ken.policy.scheduling import Batch, Dispatcher, VirtualClock


@dataclass(frozen=True, eq=False)
class SimResult:
    """Per-request outcome of one simulation (arrays indexed by request)."""

    arrival_s: np.ndarray = field(repr=False)
    completion_s: np.ndarray = field(repr=False)
    quality: np.ndarray = field(repr=False)  # (operators, requests) float: answer quality
    stage: np.ndarray = field(repr=False)  # (operators, requests): 0-based resolving stage
    range_index: np.ndarray = field(repr=False)  # (operators, requests): gear at admission
    gear_switches: tuple[tuple[tuple[float, int, int], ...], ...]
    device_busy_s: tuple[tuple[str, float], ...]
    batches: int
    stage_rows: tuple[tuple[int, ...], ...]  # per operator: rows processed at each stage
    # (operators, requests): when the operator resolved the request (NaN: not on its route)
    resolved_s: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)), repr=False)
    # with end-to-end deadlines (``simulate_many(deadline_s=...)``): each request's absolute
    # deadline, the drops (completion NaN for those) and the device seconds each was charged
    deadline_s: np.ndarray | None = field(default=None, repr=False)
    drops: tuple[Drop, ...] = field(default=(), repr=False)
    device_s: np.ndarray | None = field(default=None, repr=False)
    operators: tuple[str, ...] = ()

    def deadline_metrics(self) -> DeadlineMetrics:
        """Goodput, drop rate and wasted device time of a run with deadlines."""
        if self.deadline_s is None or self.device_s is None:
            raise SimulationError("this run had no deadlines (simulate_many(deadline_s=...))")
        return deadline_metrics(self.arrival_s.tolist(), self.completion_s.tolist(),
                                self.deadline_s.tolist(), self.drops, self.device_s.tolist(),
                                self.operators)

    @property
    def latency_s(self) -> np.ndarray:
        return self.completion_s - self.arrival_s

    @property
    def num_requests(self) -> int:
        return int(self.arrival_s.size)

    def metrics(self, plan_index: int = 0, plan: GearPlan | None = None) -> PlanMetrics:
        """Accuracy of one operator and end-to-end latency percentiles, with per-range
        figures when ``plan`` (that operator's plan) is given."""
        quality = self.quality[plan_index]
        per_range = []
        if plan is not None:
            lat_ms = self.latency_s * 1000.0
            ranges = self.range_index[plan_index]
            for k in range(plan.num_ranges):
                mask = ranges == k
                n = int(mask.sum())
                if n == 0:
                    continue
                r50, r95, r99 = latency_percentiles(lat_ms[mask])
                per_range.append(RangeMetrics(plan.qps_edges[k], plan.qps_edges[k + 1], n,
                                              _mean(quality[mask]), r50, r95, r99))
        return run_metrics(self.arrival_s, self.completion_s, self.device_busy_s,
                           _mean(quality), len(self.gear_switches[plan_index]),
                           per_range=per_range)


def _mean(quality: np.ndarray) -> float:
    """Mean quality over the requests that passed through the operator (0 if none did)."""
    seen = quality[~np.isnan(quality)]
    return float(seen.mean()) if seen.size else 0.0


def sample_rows(num_requests: int, num_rows: int, seed: int) -> np.ndarray:
    order = np.random.default_rng(seed).permutation(num_rows)
    return order[np.arange(num_requests) % num_rows]


#: a batch's runtime given from outside the catalog (``simulate_many(runtimes=...)``): called
#: with the operator's index, the batch and the virtual time it starts; None: the catalog's
Runtimes = Callable[[int, Batch, float], "float | None"]


def simulate(plan: GearPlan, catalog: Catalog, trace: Trace, seed: int = 0,
             rows: Sequence[int] | None = None, runtimes: Runtimes | None = None
             ) -> SimResult:
    """Replay ``trace`` through one plan (``rows``, ``runtimes``: as ``simulate_many``'s)."""
    return simulate_many([plan], [catalog], trace, seed, rows=rows, runtimes=runtimes)


def simulate_many(plans: Sequence[GearPlan], catalogs: Sequence[Catalog], trace: Trace,
                  seed: int = 0, routes: Sequence[Sequence[int]] | None = None,
                  rows: Sequence[int] | None = None, hits: Sequence[bool] | None = None,
                  deadline_s: np.ndarray | Sequence[float] | float | None = None,
                  dropping: DropPolicy | None = None,
                  timers: Sequence[tuple[float, Callable[[EventLoop, float], None]]] = (),
                  runtimes: Runtimes | None = None,
                  replicas: Sequence[int | None] | None = None) -> SimResult:
    """Replay ``trace`` through ``plans`` in order (request ``i`` enters plan ``k + 1`` when
    plan ``k`` resolved it); plans share devices with the same id.

    ``hits`` (optional): request ``i`` is answered by the result cache when ``hits[i]``, as
    the engine's call sites answer it (``ken.sql.execute``): at arrival, with no device
    time, never entering a plan (its quality NaN and stage -1, like a request off its route).

    ``routes`` (optional, with ``rows``): request ``i`` is sample row ``rows[i]`` in every
    plan's catalog and passes through the plans ``routes[rows[i]]`` in that order (indices
    into ``plans``; each at most once). Plans a request's route leaves out never see it: its
    quality there is NaN and its stage -1.

    ``deadline_s`` (optional): each request's end-to-end deadline in seconds after its
    arrival (one number for all, or one per request), and ``dropping`` the policy that drops
    requests which cannot make it (``ken.policy.dropping``; default: never drop). Without
    deadlines the run is exactly what it was before deadlines existed.

    ``timers`` (optional): changes made at given times (``sim_core.EventLoop``), e.g. a new
    allocation of a pipeline's devices that takes the queued requests
    (``ken.optimizer.reallocation``).

    ``rows`` without ``routes``: request ``i`` is sample row ``rows[i]`` in every plan (an
    engine replay's rows), instead of the seeded permutation's.

    ``runtimes`` (optional): each batch's runtime from outside the catalog where it returns a
    number (e.g. the time the engine's batch of the same rows took: ``ken.engine.hindsight``),
    the catalog's where it returns None. ``replicas`` (optional, one plan): the first-stage
    replica each request is queued at where not None and a replica of the first model of the
    gear it is admitted in (an engine's admission, which may route around the router's pick;
    the router's turn is taken all the same), else the router's."""
    if not plans or len(plans) != len(catalogs):
        raise SimulationError("give one catalog per plan (and at least one plan)")
    n = len(trace)
    if routes is not None and rows is None:
        raise SimulationError("give routes with rows (each request's sample row)")
    if rows is not None and len(rows) != n:
        raise SimulationError(f"rows gives {len(rows)} sample rows for {n} requests")
    if routes is not None and rows is not None:
        path = [tuple(routes[r]) for r in rows]
        for r in routes:
            if not r or len(set(r)) != len(r) or not all(0 <= k < len(plans) for k in r):
                raise SimulationError(f"a route must name distinct plans 0..{len(plans) - 1}"
                                      f" (at least one), got {tuple(r)}")
    else:
        path = [tuple(range(len(plans)))] * n
    clock = VirtualClock()
    busy: set[str] = set()
    record = Record(trace.arrival_s.copy(), len(plans))
    dropper, absolute = None, None
    if deadline_s is not None:
        budget = np.broadcast_to(np.asarray(deadline_s, dtype=np.float64), (n,))
        if not np.all(budget > 0):
            raise SimulationError("deadlines are seconds after arrival, > 0")
        absolute = record.arrival_s + budget
        dropper = PipelineDropper(dropping or DropPolicy(), [
            _stage_profile(p, c) for p, c in zip(plans, catalogs, strict=True)])
        for i in range(n):
            dropper.register(i, float(absolute[i]), path[i])
    elif dropping is not None:
        raise SimulationError("a dropping policy needs deadlines (deadline_s)")
    # a policy that never drops nor reorders needs no gate (its queues stay the dispatcher's)
    gated = dropper is not None and (dropper.policy.rule, dropper.policy.priority) != \
        ("none", "fcfs")
    if replicas is not None and (len(plans) != 1 or len(replicas) != n):
        raise SimulationError("replicas: one plan, and one first-stage replica (or None) per "
                              f"request; got {len(plans)} plans, {len(replicas)} for {n}")
    ops = [_Operator(k, p, c, clock, busy, record, seed + k, rows,
                     dropper.gate(k) if gated and dropper is not None else None, runtimes,
                     replicas)
           for k, (p, c) in enumerate(zip(plans, catalogs, strict=True))]
    if hits is not None and len(hits) != n:
        raise SimulationError(f"hits gives {len(hits)} flags for {n} requests")
    loop = EventLoop(ops, path, clock, record, hits, dropper, timers)
    loop.run()
    extra: dict = {}
    if dropper is not None:
        assert record.device_s is not None
        extra = dict(deadline_s=absolute, device_s=np.asarray(record.device_s),
                     drops=tuple(sorted(record.dropped.values(), key=lambda d: d.request_id)),
                     operators=tuple(p.operator for p in plans))
    return SimResult(
        arrival_s=record.arrival_s, completion_s=np.asarray(record.completion_s, np.float64),
        quality=np.array(record.quality, dtype=np.float64),
        stage=np.array(record.stage, dtype=np.int64),
        range_index=np.array(record.gear, dtype=np.int64),
        gear_switches=tuple(tuple(op.dispatcher.gears.switches) for op in ops),
        device_busy_s=tuple(sorted(loop.device_busy_s.items())),
        batches=loop.started,
        stage_rows=tuple(op.stage_rows() for op in ops),
        resolved_s=np.array(record.resolved_s, dtype=np.float64),
        **extra,
    )


def _stage_profile(plan: GearPlan, catalog: Catalog) -> StageProfile:
    """``dropping.stage_profile`` with the catalog's profiled runtimes."""
    _check_profiled(plan, catalog)

    def runtimes(rep: int) -> list[float]:
        r = plan.placement[rep]
        return catalog.perf_on(r.model, r.devices).runtime_table(
            r.degree, plan.max_batch[rep])[1:]

    return stage_profile(plan, runtimes)


def _check_profiled(plan: GearPlan, catalog: Catalog) -> None:
    missing = sorted({r.model for r in plan.placement} - set(catalog.perf))
    if missing:
        raise SimulationError(f"plan {plan.operator!r} places {missing}, which have no "
                              f"profile in the catalog ({list(catalog.models)})")


class _Operator:
    """One plan inside a simulation (a ``Runner`` of the event loop): its dispatcher, the
    profiled runtimes of its replicas and what its models did on each request's sample row."""

    def __init__(self, index: int, plan: GearPlan, catalog: Catalog, clock: VirtualClock,
                 busy: set[str], record: Record, seed: int,
                 rows: Sequence[int] | None = None, gate: StageGate | None = None,
                 runtimes: Runtimes | None = None,
                 first: Sequence[int | None] | None = None) -> None:
        _check_profiled(plan, catalog)
        self._index = index
        self._given = runtimes
        self._first = first
        self.dispatcher = Dispatcher(plan, clock, busy, gate)
        self._gate = gate
        kind = plan.certainty
        if rows is None:
            rows = sample_rows(record.arrival_s.size, catalog.num_rows, seed)
        elif max(rows, default=0) >= catalog.num_rows:
            raise SimulationError(f"plan {plan.operator!r}: sample row {max(rows)} is beyond "
                                  f"its catalog's {catalog.num_rows} rows")
        rows = np.asarray(rows, dtype=np.int64)
        used = {r.model for r in plan.placement}
        # per model, per request: the certainty and quality of that request's sample row
        self._cert = {m: catalog.certainty(m, kind)[rows].tolist() for m in used}
        self._quality = {m: catalog.quality[m][rows].tolist() for m in used}
        perf = [catalog.perf_on(r.model, r.devices) for r in plan.placement]
        self._runtime = [p.runtime_table(r.degree, plan.max_batch[i])
                         for i, (p, r) in enumerate(zip(perf, plan.placement, strict=True))]
        self._spread = [p.spread for p in perf]
        self._wake = [p.wake for p in perf]
        self._woken = any(w != 1.0 for w in self._wake)  # else idle times are not tracked
        self._free_at: dict[str, float] = {}  # device -> when its last batch ends
        # per replica: its size share and the expected largest row size, per batch size
        self._sizing = [catalog.size_factors(r.model, r.devices, plan.max_batch[i])
                        for i, r in enumerate(plan.placement)]
        # per replica: each request's row size as its model counts sizes (None: unknown)
        by_model = {m: None if (v := catalog.sizes_of(m)) is None else v[rows].tolist()
                    for m in used}
        self._size = [by_model[r.model] for r in plan.placement]
        self._rng = random.Random(seed)  # draws runtime spread factors (if any)
        self._stage, self._gear, self._quality_of = \
            record.stage[index], record.gear[index], record.quality[index]
        self._depth = max(c.num_stages for c in plan.cascades)

    def arrive(self, request_id: int, now: float) -> list[Batch]:
        given = None if self._first is None else self._first[request_id]
        if given is None:
            started = self.dispatcher.admit(request_id)
        else:  # as the engine: metered, the router's turn taken, queued where admission said
            d = self.dispatcher
            d.arrival(now)
            routed = d.route()
            first = d.plan.cascade_of(d.current_range).models[0]
            if d.plan.placement[given].model != first:  # not a replica of this gear's first
                given = routed
            started = d.admit(request_id, metered=False, replica=given)
        self._gear[request_id] = self.dispatcher.current_range
        return started

    def runtime_s(self, batch: Batch, now: float) -> float:
        """The profiled runtime of the batch's size on its replica, scaled by the size of
        its largest row against an average batch's (``perf.size_factor``, where the profile
        measured a size share), times a drawn spread factor where the profile has them, times
        the model's ``wake`` factor when its devices idled ``WAKE_IDLE_S`` or more before it
        (a device's first batch too: the engine's workers idle from warm-up to the first).
        A runtime given from outside (``simulate_many(runtimes=...)``) replaces all of it."""
        given = None if self._given is None else self._given(self._index, batch, now)
        if given is not None:
            if self._woken:
                for d in batch.devices:
                    self._free_at[d] = now + given
            return given
        b = len(batch.request_ids)
        dt = self._runtime[batch.replica][b]
        sizes = self._size[batch.replica]
        if sizes is not None:
            dt = sized_runtime(dt, self._sizing[batch.replica], b,
                               max(sizes[i] for i in batch.request_ids))
        factors = self._spread[batch.replica]
        if factors:
            dt *= factors[self._rng.randrange(len(factors))]
        if self._woken:
            free = self._free_at
            if woke(now - max(free.get(d, -np.inf) for d in batch.devices)):
                dt *= self._wake[batch.replica]
            for d in batch.devices:
                free[d] = now + dt
        return dt

    def complete(self, batch: Batch, now: float) -> tuple[tuple[Batch, ...], tuple[int, ...]]:
        cert = self._cert[batch.model]
        done = self.dispatcher.finish(batch, [cert[i] for i in batch.request_ids])
        quality, ok, stage = self._quality[batch.model], self._quality_of, self._stage
        for rid, st in zip(done.resolved, done.resolved_stages, strict=True):
            ok[rid] = quality[rid]
            stage[rid] = st
        return done.started, done.resolved

    def drain(self) -> list[int]:
        """Take the queued (not running) requests out (``EventLoop.drain``)."""
        return self.dispatcher.drain()

    def take_dropped(self) -> list[Drop]:
        """The requests the dispatcher's gate dropped since the last call."""
        return [] if self._gate is None else self._gate.take()

    def freed(self, devices: tuple[str, ...], now: float) -> list[Batch]:
        return self.dispatcher.poll(devices)

    def next_deadline(self) -> float | None:
        return self.dispatcher.next_deadline()

    def expire(self, now: float) -> list[Batch]:
        return self.dispatcher.expire()

    def stage_rows(self) -> tuple[int, ...]:
        """Rows that reached each stage (a row resolved at stage s ran stages 0..s)."""
        st = np.asarray(self._stage, dtype=np.int64)
        resolved_at = np.bincount(st[st >= 0], minlength=self._depth)
        return tuple(int(c) for c in np.cumsum(resolved_at[::-1])[::-1])
