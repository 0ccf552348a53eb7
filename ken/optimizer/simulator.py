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
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ken.errors import SimulationError
from ken.optimizer.perf import Catalog
from ken.optimizer.workload import Trace
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

    @property
    def latency_s(self) -> np.ndarray:
        return self.completion_s - self.arrival_s

    @property
    def num_requests(self) -> int:
        return int(self.arrival_s.size)

    def metrics(self, plan_index: int = 0, plan: GearPlan | None = None) -> PlanMetrics:
        """Accuracy of one operator and end-to-end latency percentiles, with per-range
        figures when ``plan`` (that operator's plan) is given."""
        lat_ms = self.latency_s * 1000.0
        duration = float(self.completion_s.max() - self.arrival_s.min()) \
            if self.num_requests else 0.0
        p50, p95, p99 = latency_percentiles(lat_ms)
        quality = self.quality[plan_index]
        per_range = []
        if plan is not None:
            ranges = self.range_index[plan_index]
            for k in range(plan.num_ranges):
                mask = ranges == k
                n = int(mask.sum())
                if n == 0:
                    continue
                r50, r95, r99 = latency_percentiles(lat_ms[mask])
                per_range.append(RangeMetrics(plan.qps_edges[k], plan.qps_edges[k + 1], n,
                                              _mean(quality[mask]), r50, r95, r99))
        util = tuple((d, b / duration if duration > 0 else 0.0) for d, b in self.device_busy_s)
        return PlanMetrics(
            accuracy=_mean(quality), p50_ms=p50, p95_ms=p95, p99_ms=p99,
            mean_ms=float(lat_ms.mean()), num_requests=self.num_requests,
            gear_switches=len(self.gear_switches[plan_index]), duration_s=duration,
            utilisation=util, per_range=tuple(per_range))


def _mean(quality: np.ndarray) -> float:
    """Mean quality over the requests that passed through the operator (0 if none did)."""
    seen = quality[~np.isnan(quality)]
    return float(seen.mean()) if seen.size else 0.0


def sample_rows(num_requests: int, num_rows: int, seed: int) -> np.ndarray:
    order = np.random.default_rng(seed).permutation(num_rows)
    return order[np.arange(num_requests) % num_rows]


def simulate(plan: GearPlan, catalog: Catalog, trace: Trace, seed: int = 0) -> SimResult:
    """Replay ``trace`` through one plan."""
    return simulate_many([plan], [catalog], trace, seed)


def simulate_many(plans: Sequence[GearPlan], catalogs: Sequence[Catalog], trace: Trace,
                  seed: int = 0, routes: Sequence[Sequence[int]] | None = None,
                  rows: Sequence[int] | None = None) -> SimResult:
    """Replay ``trace`` through ``plans`` in order (request ``i`` enters plan ``k + 1`` when
    plan ``k`` resolved it); plans share devices with the same id.

    ``routes`` (optional, with ``rows``): request ``i`` is sample row ``rows[i]`` in every
    plan's catalog and passes through the plans ``routes[rows[i]]`` in that order (indices
    into ``plans``; each at most once). Plans a request's route leaves out never see it: its
    quality there is NaN and its stage -1."""
    if not plans or len(plans) != len(catalogs):
        raise SimulationError("give one catalog per plan (and at least one plan)")
    n = len(trace)
    if (routes is None) != (rows is None):
        raise SimulationError("give routes and rows together")
    if routes is not None and rows is not None:
        if len(rows) != n:
            raise SimulationError(f"rows gives {len(rows)} sample rows for {n} requests")
        path = [tuple(routes[r]) for r in rows]
        for r in routes:
            if not r or len(set(r)) != len(r) or not all(0 <= k < len(plans) for k in r):
                raise SimulationError(f"a route must name distinct plans 0..{len(plans) - 1}"
                                      f" (at least one), got {tuple(r)}")
    else:
        path = [tuple(range(len(plans)))] * n
    clock = VirtualClock()
    busy: set[str] = set()
    ops = [_Operator(p, c, clock, busy, n, seed + k, rows)
           for k, (p, c) in enumerate(zip(plans, catalogs, strict=True))]
    arrivals = trace.arrival_s.tolist()
    completion = [math.nan] * n
    resolved_s = np.full((len(ops), n), np.nan)
    events: list[tuple[float, int, int, Batch]] = []  # (end time, seq, operator, batch)
    seq = 0
    device_busy: dict[str, float] = {}
    inf = math.inf
    i = 0

    def launch(k: int, batches: list[Batch] | tuple[Batch, ...], now: float) -> None:
        nonlocal seq
        op = ops[k]
        runtime, spread = op.runtime, op.spread
        for b in batches:
            dt = runtime[b.replica][len(b.request_ids)]
            factors = spread[b.replica]
            if factors:
                dt *= factors[op.rng.randrange(len(factors))]
            for d in b.devices:
                device_busy[d] = device_busy.get(d, 0.0) + dt
            seq += 1
            heapq.heappush(events, (now + dt, seq, k, b))

    while True:
        t_arrival = arrivals[i] if i < n else inf
        t_event = events[0][0] if events else inf
        t_deadline = inf
        deadline_op = -1
        for k, op in enumerate(ops):
            d = op.dispatcher.next_deadline()
            if d is not None and d < t_deadline:
                t_deadline, deadline_op = d, k
        if t_event <= t_arrival and t_event <= t_deadline:
            if t_event == inf:
                break
            now, _, k, batch = heapq.heappop(events)
            clock.t = now
            op = ops[k]
            done = op.dispatcher.finish(batch, op.certainties(batch))
            launch(k, done.started, now)
            if done.resolved:
                op.record(done.resolved, batch.model, done.resolved_stages)
                for rid in done.resolved:
                    resolved_s[k, rid] = now
                    route = path[rid]
                    step = route.index(k) + 1
                    if step == len(route):
                        completion[rid] = now
                    else:
                        launch(route[step], ops[route[step]].admit(rid), now)
            for j, other in enumerate(ops):
                if j != k and len(ops) > 1:
                    launch(j, other.dispatcher.poll(batch.devices), now)
        elif t_arrival <= t_deadline:
            clock.t = t_arrival
            first = path[i][0]
            launch(first, ops[first].admit(i), t_arrival)
            i += 1
        else:  # a deadline already past (queue left behind by a full batch) fires now
            clock.t = max(clock.t, t_deadline)
            launch(deadline_op, ops[deadline_op].dispatcher.expire(), clock.t)

    completion_s = np.asarray(completion, dtype=np.float64)
    unfinished = int(np.isnan(completion_s).sum()) if n else 0
    if unfinished:  # cannot happen: every queue eventually triggers by its max wait
        raise SimulationError(f"{unfinished} requests never completed; this is a bug")
    for k, op in enumerate(ops):
        op.check_complete([k in p for p in path])
    return SimResult(
        arrival_s=trace.arrival_s.copy(), completion_s=completion_s,
        quality=np.array([op.quality for op in ops], dtype=np.float64),
        stage=np.array([op.stage for op in ops], dtype=np.int64),
        range_index=np.array([op.range_index for op in ops], dtype=np.int64),
        gear_switches=tuple(tuple(op.dispatcher.gears.switches) for op in ops),
        device_busy_s=tuple(sorted(device_busy.items())),
        batches=seq,
        stage_rows=tuple(op.stage_rows() for op in ops),
        resolved_s=resolved_s,
    )


class _Operator:
    """One plan inside a simulation: its dispatcher plus the per-request bookkeeping."""

    def __init__(self, plan: GearPlan, catalog: Catalog, clock: VirtualClock, busy: set[str],
                 num_requests: int, seed: int, rows: Sequence[int] | None = None) -> None:
        missing = sorted({r.model for r in plan.placement} - set(catalog.perf))
        if missing:
            raise SimulationError(f"plan {plan.operator!r} places {missing}, which have no "
                                  f"profile in the catalog ({list(catalog.models)})")
        self.dispatcher = Dispatcher(plan, clock, busy)
        kind = plan.certainty
        if rows is None:
            rows = sample_rows(num_requests, catalog.num_rows, seed)
        elif max(rows, default=0) >= catalog.num_rows:
            raise SimulationError(f"plan {plan.operator!r}: sample row {max(rows)} is beyond "
                                  f"its catalog's {catalog.num_rows} rows")
        rows = np.asarray(rows, dtype=np.int64)
        used = {r.model for r in plan.placement}
        # per model, per request: the certainty and quality of that request's sample row
        self._cert = {m: catalog.certainty(m, kind)[rows].tolist() for m in used}
        self._quality = {m: catalog.quality[m][rows].tolist() for m in used}
        perf = [catalog.perf_on(r.model, r.devices) for r in plan.placement]
        self.runtime = [p.runtime_table(r.degree, plan.max_batch[i])
                        for i, (p, r) in enumerate(zip(perf, plan.placement, strict=True))]
        self.spread = [p.spread for p in perf]
        self.rng = random.Random(seed)  # draws runtime spread factors (if any)
        self.quality = [math.nan] * num_requests
        self.stage = [-1] * num_requests
        self.range_index = [-1] * num_requests
        self.resolved = [0] * num_requests
        self._depth = max(c.num_stages for c in plan.cascades)

    def admit(self, rid: int) -> list[Batch]:
        started = self.dispatcher.admit(rid)
        self.range_index[rid] = self.dispatcher.current_range
        return started

    def certainties(self, batch: Batch) -> list[float]:
        cert = self._cert[batch.model]
        return [cert[i] for i in batch.request_ids]

    def record(self, ids: Sequence[int], model: str, stages: Sequence[int]) -> None:
        quality, ok, stage, resolved = self._quality[model], self.quality, self.stage, \
            self.resolved
        for rid, st in zip(ids, stages, strict=True):
            ok[rid] = quality[rid]
            stage[rid] = st
            resolved[rid] += 1

    def stage_rows(self) -> tuple[int, ...]:
        """Rows that reached each stage (a row resolved at stage s ran stages 0..s)."""
        st = np.asarray(self.stage, dtype=np.int64)
        resolved_at = np.bincount(st[st >= 0], minlength=self._depth)
        return tuple(int(c) for c in np.cumsum(resolved_at[::-1])[::-1])

    def check_complete(self, visited: Sequence[bool]) -> None:
        bad = sum(1 for r, v in zip(self.resolved, visited, strict=True) if r != int(v))
        if bad:
            raise SimulationError(f"{bad} requests were not resolved exactly once; this is a bug")
