"""The discrete-event core both simulators run on (DESIGN.md section 5.6).

A simulation replays a trace on a ``VirtualClock``: requests arrive in order, work started on
devices completes once the time it is charged has passed, and the serving policies' deadlines
fire (a classifier queue's max wait, a decode lane's next pass). Each operator a request passes
through is a ``Runner``, which holds what differs by kind of cascade: the classifier's
``Dispatcher`` with its profiled batch runtimes per replica (``ken.optimizer.simulator``), or a
``GenDispatcher`` with one decode lane per model and each forward pass charged its
``TokenCost`` (``ken.optimizer.decode_sim``). The loop owns time: ``EventLoop.start`` is the one
place work is charged to its devices, so a change to how time is charged (an overhead per batch
or per hop) is made there.

At one instant the loop handles timers first (``EventLoop(timers=...)``: a change made at a
time, such as a new allocation whose plans take the requests still queued, through ``drain``,
``reroute`` and ``retarget``), then completions, then arrivals, then deadlines: a decode lane,
whose next pass is a deadline at the time its last pass ended, chooses that pass after every
request that arrived by then.

``Record`` is what a run leaves per request (arrival, first token, completion) and per operator
and request (when it resolved the request, the cascade stage that answered, the gear at
admission, the answer's quality); ``run_metrics`` turns a run's times into ``PlanMetrics``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from ken.errors import SimulationError
from ken.policy.dropping import Drop, PipelineDropper
from ken.policy.metrics import PlanMetrics, RangeMetrics, latency_percentiles
from ken.policy.scheduling import VirtualClock


class Work(Protocol):
    """What a runner starts: it occupies ``devices`` for the time its runner charges."""

    @property
    def devices(self) -> tuple[str, ...]: ...


class Runner(Protocol):
    """One operator's serving policy in a simulation. Each call returns the work that starts
    at ``now``."""

    def arrive(self, request_id: int, now: float) -> Iterable[Any]:
        """A request reaches this operator (from the trace or from the previous operator)."""
        ...

    def runtime_s(self, work: Any, now: float) -> float:
        """How long ``work`` occupies its devices; called once, as it starts at ``now``."""
        ...

    def complete(self, work: Any, now: float) -> tuple[Iterable[Any], Sequence[int]]:
        """``work`` ended: the work that starts now and the requests this operator resolved."""
        ...

    def freed(self, devices: tuple[str, ...], now: float) -> Iterable[Any]:
        """Another operator's work on ``devices`` ended (operators may share devices)."""
        ...

    def next_deadline(self) -> float | None: ...

    def expire(self, now: float) -> Iterable[Any]:
        """The deadline ``next_deadline`` gave has come."""
        ...


class Record:
    """Per request: arrival, first token and completion; per operator and request: when the
    operator resolved it, the 0-based cascade stage that answered, the gear at admission and
    the answer's quality (NaN, -1: the request did not pass through that operator)."""

    def __init__(self, arrival_s: np.ndarray, operators: int) -> None:
        n = arrival_s.size
        self.arrival_s = arrival_s
        self.first_token_s = [math.nan] * n
        self.completion_s = [math.nan] * n
        self.resolved_s = [[math.nan] * n for _ in range(operators)]
        self.stage = [[-1] * n for _ in range(operators)]
        self.gear = [[-1] * n for _ in range(operators)]
        self.quality = [[math.nan] * n for _ in range(operators)]
        self.resolutions = [[0] * n for _ in range(operators)]
        self.dropped: dict[int, Drop] = {}  # with deadlines: the requests dropped, and why
        self.device_s: list[float] | None = None  # with deadlines: device seconds per request


class EventLoop:
    """Runs requests through ``runners`` along their routes (``routes[i]``: the runners
    request ``i`` passes, in order) and fills ``record``."""

    def __init__(self, runners: Sequence[Runner], routes: Sequence[tuple[int, ...]],
                 clock: VirtualClock, record: Record, hits: Sequence[bool] | None = None,
                 dropper: PipelineDropper | None = None,
                 timers: Sequence[tuple[float, Callable[[EventLoop, float], None]]] = ()
                 ) -> None:
        """``hits[i]``: request ``i`` is answered by the result cache (``ken.cache``) before
        any runner sees it, as a query's call site does: done at arrival, free.

        ``dropper``: requests carry end-to-end deadlines (registered with it) and may be
        dropped when they reach an operator or when an operator forms a batch (its runners'
        dispatchers ask the dropper's gates; a runner hands those drops back through
        ``take_dropped``). A dropped request is resolved once, in ``record.dropped``, and
        its completion stays NaN; each request is charged its share of every batch's device
        time (``record.device_s``).

        ``timers``: ``(t, fn)``, ``fn(loop, t)`` called once the clock reaches ``t``, before
        anything else that happens at ``t``; it may move requests between runners (``drain``,
        ``reroute``, ``retarget``; the dropper learns the new routes)."""
        self.runners, self.clock, self.record = runners, clock, record
        self.routes = list(routes)  # a request's route, rewritten by reroute and retarget
        self._timers = sorted(timers, key=lambda t: t[0])
        self._at: dict[int, int] = {}  # with timers: request -> the runner it is in now
        self._track = bool(self._timers)
        self.hits = hits
        self.dropper = dropper
        if dropper is not None:
            record.device_s = [0.0] * len(routes)
        self.device_busy_s: dict[str, float] = {}
        self.started = 0  # pieces of work started (batches, forward passes)
        self._events: list[tuple[float, int, int, Any]] = []  # (end, seq, runner, work)

    def start(self, k: int, works: Iterable[Any], now: float) -> None:
        """Charge each piece of work its runtime on its devices and schedule its end."""
        runner, busy = self.runners[k], self.device_busy_s
        per_request = self.record.device_s
        for w in works:
            dt = runner.runtime_s(w, now)
            for d in w.devices:
                busy[d] = busy.get(d, 0.0) + dt
            if per_request is not None:
                ids = w.request_ids
                share = dt * len(w.devices) / len(ids)
                for rid in ids:
                    per_request[rid] += share
            self.started += 1
            heapq.heappush(self._events, (now + dt, self.started, k, w))
        if self.dropper is not None:
            self._collect(k)

    def enter(self, k: int, rid: int, now: float) -> None:
        """Request ``rid`` reaches runner ``k`` (unless the dropper drops it there)."""
        if self.dropper is not None:
            drop = self.dropper.enter(rid, k, now)
            if drop is not None:
                self._dropped(drop)
                return
        if self._track:
            self._at[rid] = k
        self.start(k, self.runners[k].arrive(rid, now), now)

    # -- moving requests (from timers) -----------------------------------------------------

    def inside(self) -> dict[int, int]:
        """The requests inside a runner now (queued or being served) and which runner (kept
        only when the loop has timers)."""
        return dict(self._at)

    def drain(self, k: int) -> list[int]:
        """Take every request queued (not being served) at runner ``k`` out of it; each must
        then be sent on with ``reroute``."""
        out = self.runners[k].drain()  # type: ignore[attr-defined]
        for rid in out:
            del self._at[rid]
        return out

    def reroute(self, rid: int, ahead: Sequence[int], k: int, now: float) -> None:
        """Request ``rid``, drained from runner ``k``, goes on through the runners ``ahead``
        (its route keeps the runners before ``k``, which resolved it)."""
        route = self.routes[rid]
        self.routes[rid] = route[:route.index(k)] + tuple(ahead)
        self._rerouted(rid)
        self.enter(ahead[0], rid, now)

    def retarget(self, rid: int, after: Sequence[int]) -> None:
        """Request ``rid``, being served at its runner, goes on through ``after`` once that
        runner resolves it."""
        route = self.routes[rid]
        self.routes[rid] = route[:route.index(self._at[rid]) + 1] + tuple(after)
        self._rerouted(rid)

    def _rerouted(self, rid: int) -> None:
        if self.dropper is not None:
            self.dropper.register(rid, self.dropper.deadline_s(rid), self.routes[rid])

    def _collect(self, k: int) -> None:
        """The requests runner ``k``'s dispatcher dropped while forming batches."""
        for drop in self.runners[k].take_dropped():  # type: ignore[attr-defined]
            self._dropped(drop)

    def _dropped(self, drop: Drop) -> None:
        if drop.request_id in self.record.dropped:
            raise SimulationError(f"request {drop.request_id} was dropped twice; this is a bug")
        self.record.dropped[drop.request_id] = drop
        self._at.pop(drop.request_id, None)

    def run(self) -> Record:
        runners, routes, clock, record, events = \
            self.runners, self.routes, self.clock, self.record, self._events
        arrivals = record.arrival_s.tolist()
        n, i, inf = len(arrivals), 0, math.inf
        timers, ti = self._timers, 0
        while True:
            t_arrival = arrivals[i] if i < n else inf
            t_event = events[0][0] if events else inf
            t_deadline, deadline_k = inf, -1
            for k, runner in enumerate(runners):
                d = runner.next_deadline()
                if d is not None and d < t_deadline:
                    t_deadline, deadline_k = d, k
            if ti < len(timers) and timers[ti][0] <= min(t_arrival, t_event, t_deadline) < inf:
                clock.t = max(clock.t, timers[ti][0])
                timers[ti][1](self, clock.t)
                ti += 1
                continue
            if t_event <= t_arrival and t_event <= t_deadline:
                if t_event == inf:
                    break
                now, _, k, work = heapq.heappop(events)
                clock.t = now
                started, resolved = runners[k].complete(work, now)
                self.start(k, started, now)
                for rid in resolved:
                    self._resolved(k, rid, now)
                if len(runners) > 1:
                    for j, other in enumerate(runners):
                        if j != k:
                            self.start(j, other.freed(work.devices, now), now)
            elif t_arrival <= t_deadline:
                clock.t = t_arrival
                if self.hits is not None and self.hits[i]:
                    record.completion_s[i] = t_arrival
                else:
                    self.enter(routes[i][0], i, t_arrival)
                i += 1
            else:  # a deadline already past (queue left behind by a full batch) fires now
                clock.t = max(clock.t, t_deadline)
                self.start(deadline_k, runners[deadline_k].expire(clock.t), clock.t)
        self._check()
        return record

    def _resolved(self, k: int, rid: int, now: float) -> None:
        """Operator ``k`` resolved request ``rid``: on to the next operator of its route."""
        self.record.resolved_s[k][rid] = now
        self.record.resolutions[k][rid] += 1
        route = self.routes[rid]
        step = route.index(k) + 1
        if step == len(route):
            if self._track:
                del self._at[rid]
            self.record.completion_s[rid] = now
        else:
            self.enter(route[step], rid, now)

    def _check(self) -> None:
        dropped = self.record.dropped
        unfinished = sum(1 for i, t in enumerate(self.record.completion_s)
                         if math.isnan(t) and i not in dropped)
        if unfinished:  # cannot happen: every queue eventually triggers by its max wait
            raise SimulationError(f"{unfinished} requests never completed; this is a bug")
        if any(not math.isnan(self.record.completion_s[i]) for i in dropped):
            raise SimulationError("a dropped request also completed; this is a bug")
        hits = self.hits if self.hits is not None else [False] * len(self.routes)

        def expected(k: int, i: int, route: tuple[int, ...], hit: bool) -> int:
            if k not in route or hit:
                return 0
            drop = dropped.get(i)  # operators before the one that dropped it resolved it
            return int(drop is None or route.index(k) < route.index(drop.stage))

        for k, counts in enumerate(self.record.resolutions):
            if not dropped:
                bad = sum(1 for c, route, hit in zip(counts, self.routes, hits, strict=True)
                          if c != int(k in route and not hit))
            else:
                bad = sum(1 for i, (c, route, hit) in enumerate(zip(counts, self.routes, hits,
                                                                    strict=True))
                          if c != expected(k, i, route, hit))
            if bad:
                raise SimulationError(f"{bad} requests were not resolved exactly once; "
                                      "this is a bug")


def run_metrics(arrival_s: np.ndarray, completion_s: np.ndarray,
                device_busy_s: Sequence[tuple[str, float]], accuracy: float,
                gear_switches: int, *, first_token_s: np.ndarray | None = None,
                tokens: int | None = None, per_range: Sequence[RangeMetrics] = (),
                **known: Any) -> PlanMetrics:
    """The metrics of a run from its per-request times (seconds): latency (arrival to answer;
    a generating run's TGT) percentiles, span and per-device utilisation; TTFT percentiles
    when ``first_token_s`` is given, token throughput when ``tokens`` is; and the ``known``
    fields its caller has (passes, escalated share, ...)."""
    lat_ms = (completion_s - arrival_s) * 1000.0
    span = float(completion_s.max() - arrival_s.min()) if lat_ms.size else 0.0
    p50, p95, p99 = latency_percentiles(lat_ms)
    if first_token_s is not None:
        ttft = latency_percentiles((first_token_s - arrival_s) * 1000.0)
        known.update(ttft_p50_ms=ttft[0], ttft_p95_ms=ttft[1], ttft_p99_ms=ttft[2])
    if tokens is not None:
        known["tokens_per_s"] = tokens / span if span > 0 else 0.0
    return PlanMetrics(
        accuracy=accuracy, p50_ms=p50, p95_ms=p95, p99_ms=p99, mean_ms=float(lat_ms.mean()),
        num_requests=int(lat_ms.size), gear_switches=gear_switches, duration_s=span,
        utilisation=tuple((d, b / span if span > 0 else 0.0) for d, b in device_busy_s),
        per_range=tuple(per_range), **known)
