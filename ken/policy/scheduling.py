"""Scheduling policy shared by the simulator and the online engine (DESIGN.md section 6).

One policy, two clocks: these classes decide *what* happens — which gear is active, which
replica a row goes to, when a replica's queue runs a batch, which rows escalate — and never
sleep or read the time themselves. The caller owns a ``Clock``: the simulator advances a
``VirtualClock`` from event to event and charges profiled runtimes; the engine uses a
``WallClock`` and real model calls. Both drive the same ``Dispatcher``:

- ``admit(request_id)`` when a request arrives (meters the rate, may switch gear, routes the
  row to a first-stage replica);
- ``finish(batch, certainties)`` when a batch's model call returns (frees the devices,
  escalates rows below their stage threshold, resolves the rest);
- ``expire()`` when ``next_deadline()`` has passed (a queue waited ``max_wait_s``).

Each returns the batches that may start now; devices run one batch at a time.
"""

from __future__ import annotations

import heapq
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ken.errors import PolicyError
from ken.models.cascade import escalates_row
from ken.policy.escalation import Escalation
from ken.policy.plan import GearPlan

# -- clocks ------------------------------------------------------------------------------------


class Clock(Protocol):
    def now(self) -> float: ...


class VirtualClock:
    """Simulated time in seconds; the simulator sets ``t`` before each event."""

    __slots__ = ("t",)

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


class WallClock:
    """Seconds since construction on the monotonic clock."""

    def __init__(self) -> None:
        self._start = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._start


# -- the policy pieces -------------------------------------------------------------------------


class RateMeter:
    """Arrivals per second in the last complete window of ``window_s`` seconds.

    Windows are fixed buckets ``[t0 + k * window_s, t0 + (k + 1) * window_s)`` from the first
    time ``t0`` the meter is asked (its first arrival, in a dispatcher). Anchored there, the
    simulator and the engine cut one trace into the same windows, whatever their clocks'
    origins (anchored at each clock's zero, the engine's windows fell at a random phase of
    the trace and its gears were not the simulated ones: ``docs/results.md``, "The rate meter
    cut the engine's trace at another phase"). ``record`` returns True when it opened a new
    window, i.e. when the measured rate may have changed.
    """

    __slots__ = ("window_s", "_origin", "_window", "_count", "_last")

    def __init__(self, window_s: float = 0.1) -> None:
        if window_s <= 0:
            raise PolicyError(f"rate window must be > 0 s, got {window_s}")
        self.window_s = window_s
        self._origin: float | None = None
        self._window = -1
        self._count = 0
        self._last = 0

    def _roll(self, now: float) -> bool:
        if self._origin is None:
            self._origin = now
        w = int((now - self._origin) // self.window_s)
        if w == self._window:
            return False
        self._last = self._count if w == self._window + 1 else 0
        self._window = w
        self._count = 0
        return True

    def record(self, now: float, n: int = 1) -> bool:
        rolled = self._roll(now)
        self._count += n
        return rolled

    def rate(self, now: float) -> float:
        self._roll(now)
        return self._last / self.window_s


class GearSelector:
    """Maps a measured rate to a QPS range, with the papers' hysteresis (alpha).

    Moving to a lower range (a costlier, more accurate cascade) is held back while the
    first-stage queue still holds more than ``rate / alpha`` rows: the backlog of a burst is
    served by the gear that was chosen for it. Moving up is immediate.
    """

    def __init__(self, plan: GearPlan) -> None:
        self._edges = plan.qps_edges
        self._last = plan.num_ranges - 1
        self._cascade = [r.cascade for r in plan.ranges]
        self.alpha = plan.alpha
        self.current = 0
        self.switches: list[tuple[float, int, int]] = []  # (time, from range, to range)
        self.held = 0  # how often hysteresis kept the current gear

    def range_for(self, rate: float) -> int:
        i = bisect_right(self._edges, rate) - 1
        return 0 if i < 0 else (self._last if i > self._last else i)

    def update(self, now: float, rate: float, first_stage_queued: int) -> int:
        target = self.range_for(rate)
        cur = self.current
        if target == cur:
            return cur
        if target < cur and first_stage_queued > rate / self.alpha:
            self.held += 1
            return cur
        if self._cascade[target] != self._cascade[cur]:
            self.switches.append((now, cur, target))
        self.current = target
        return target


class Router:
    """Picks a replica of a model by the plan's shares for a range.

    Smooth weighted round-robin, precomputed as a cycle of ``cycle`` picks (so a pick is O(1)):
    deterministic, and every prefix of picks follows the shares to within ``1 / cycle``.
    """

    def __init__(self, plan: GearPlan, cycle: int = 1000) -> None:
        self._plan = plan
        self._cycle = cycle
        self._table: dict[tuple[int, str], list] = {}  # [sequence, position], built lazily
        self._sequences: dict[tuple, list[int]] = {}  # ranges with equal shares share one

    def _entry(self, range_index: int, model: str) -> list:
        reps = tuple(self._plan.replicas_of(model))
        if not reps:
            raise PolicyError(f"the plan has no replica of {model!r}")
        shares = self._plan.ranges[range_index].shares
        weights = tuple(shares[r] for r in reps)
        if sum(weights) <= 0:  # no share planned here: spread evenly
            weights = (1.0,) * len(reps)
        key = (reps, weights)
        if key not in self._sequences:
            self._sequences[key] = _smooth_round_robin(reps, weights, self._cycle)
        entry = self._table[(range_index, model)] = [self._sequences[key], 0]
        return entry

    def pick(self, range_index: int, model: str) -> int:
        entry = self._table.get((range_index, model))
        if entry is None:
            entry = self._entry(range_index, model)
        seq, pos = entry
        entry[1] = pos + 1 if pos + 1 < len(seq) else 0
        return seq[pos]


def _smooth_round_robin(items: Sequence[int], weights: Sequence[float], n: int) -> list[int]:
    keep = [(r, w) for r, w in zip(items, weights, strict=True) if w > 0]
    if len(keep) == 1:
        return [keep[0][0]]
    total = sum(w for _, w in keep)
    current = [0.0] * len(keep)
    out = []
    for _ in range(n):
        best = 0
        for j, (_, w) in enumerate(keep):
            current[j] += w
            if current[j] > current[best]:
                best = j
        current[best] -= total
        out.append(keep[best][0])
    return out


class QueueTrigger:
    """A queue runs a batch once it holds ``min_queue`` rows or its oldest row waited
    ``max_wait_s``."""

    __slots__ = ("max_wait_s",)

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s

    def deadline(self, oldest_s: float) -> float:
        return oldest_s + self.max_wait_s

    def ready(self, queued: int, min_queue: int, oldest_s: float, now: float) -> bool:
        """``oldest_s``: when the oldest queued row arrived (compared as ``now >= oldest +
        max_wait``, the same sum the deadline uses, so a deadline event always fires)."""
        return queued >= min_queue or (queued > 0 and now >= oldest_s + self.max_wait_s)


# -- the dispatcher ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """Rows a replica runs as one model call."""

    replica: int
    model: str
    devices: tuple[str, ...]
    request_ids: tuple[int, ...]
    started_s: float


@dataclass(frozen=True)
class Finished:
    """What ``Dispatcher.finish`` did: rows resolved (with their 0-based stage), rows
    escalated, and batches that may start now."""

    resolved: tuple[int, ...]
    resolved_stages: tuple[int, ...]
    escalated: tuple[int, ...]
    started: tuple[Batch, ...]


class BatchGate(Protocol):
    """Chooses a batch's rows (at most ``take``, in serving order) from the queue of one
    replica (request ids in arrival order, queued since ``since``) and the requests to drop
    now; told how long each batch it let start ran and how many of its rows escalated
    (``ran``) and which gear the dispatcher serves in (``gear``)."""

    def select(self, queued: Sequence[int], since: Sequence[float], now: float, take: int,
               replica: int | None = None) -> tuple[list[int], list[int]]: ...

    def ran(self, replica: int, rows: int, seconds: float, escalated: int = 0) -> None:
        """A batch of ``rows`` rows on ``replica`` finished after ``seconds``; ``escalated``
        of them went on to the cascade's next model."""

    def gear(self, current: int) -> None:
        """The dispatcher serves in gear (range) ``current`` from now on."""


class Dispatcher:
    """Queues, devices and per-request state of one gear plan (see the module docstring)."""

    def __init__(self, plan: GearPlan, clock: Clock, busy: set[str] | None = None,
                 gate: BatchGate | None = None, away: set[str] | None = None) -> None:
        """``busy``: the set of busy device ids, shared with other dispatchers whose plans
        place replicas on the same devices (a device still runs one batch at a time).
        ``gate``: when a batch is formed, chooses its rows from the whole queue and drops
        requests (``ken.policy.dropping``); None: the oldest rows, nothing dropped.
        ``away``: devices that start no batch for now though not busy (the engine's: a worker
        that reloads its models), shared likewise; their rows wait in their queues (or are
        moved, ``move_queued``) instead of in the device's."""
        self.plan = plan
        self.gate = gate
        self.clock = clock
        self.meter = RateMeter(plan.rate_window_s)
        self.gears = GearSelector(plan)
        self.router = Router(plan)
        self.trigger = QueueTrigger(plan.max_wait_s)
        self.escalation = Escalation(plan)
        n = len(plan.placement)
        self._model = [r.model for r in plan.placement]
        self._devices = [r.devices for r in plan.placement]
        self._max_batch = list(plan.max_batch)
        self._min_queue = [list(r.min_queue) for r in plan.ranges]
        self._range_cascade = [r.cascade for r in plan.ranges]
        self._first_model = [plan.cascade_of(k).models[0] for k in range(plan.num_ranges)]
        self._replicas_of = {m: plan.replicas_of(m) for m in set(self._model)}
        self._on_device: dict[str, list[int]] = {}
        for i, devs in enumerate(self._devices):
            for d in devs:
                self._on_device.setdefault(d, []).append(i)
        self._queue: list[deque[int]] = [deque() for _ in range(n)]
        self._since: list[deque[float]] = [deque() for _ in range(n)]
        self._busy: set[str] = set() if busy is None else busy
        self._away: set[str] = set() if away is None else away
        self._deadlines: list[tuple[float, int]] = []
        self._running: dict[int, Batch] = {}  # replica -> its batch in flight
        self._req_cascade: dict[int, int] = {}
        self._req_range: dict[int, int] = {}
        self._req_stage: dict[int, int] = {}
        if gate is not None:
            gate.gear(self.gears.current)

    # -- state views ------------------------------------------------------------------------

    @property
    def current_range(self) -> int:
        return self.gears.current

    def queued(self, replica: int | None = None) -> int:
        if replica is not None:
            return len(self._queue[replica])
        return sum(len(q) for q in self._queue)

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet resolved."""
        return len(self._req_stage)

    def range_of(self, request_id: int) -> int:
        return self._req_range[request_id]

    def busy_devices(self) -> frozenset[str]:
        return frozenset(self._busy)

    # -- events -----------------------------------------------------------------------------

    def admit(self, request_id: int, metered: bool = True, replica: int | None = None
              ) -> list[Batch]:
        """A new request: meter it, maybe switch gear, queue it at a first-stage replica.

        ``metered=False`` queues without counting it as an arrival (a request moved here from
        another plan's queues when a plan is swapped in, or one an engine metered and routed
        before admitting it); ``replica``: the first-stage replica ``route`` picked for it."""
        if request_id in self._req_stage:
            raise PolicyError(f"request {request_id} was already admitted")
        now = self.clock.now()
        if metered:
            self.arrival(now)
        rng = self.gears.current
        cascade = self._range_cascade[rng]
        rep = self.route() if replica is None else replica
        self._req_cascade[request_id] = cascade
        self._req_range[request_id] = rng
        self._req_stage[request_id] = 0
        self._enqueue(rep, request_id, now)
        return self._start_ready((rep,), now)

    def arrival(self, now: float | None = None) -> int:
        """Meter one arrival and maybe switch gear (what ``admit`` does before queueing);
        returns the current range. An engine meters the requests its admission rejects this
        way too: the gear follows the offered load, not only the admitted part."""
        if now is None:
            now = self.clock.now()
        if self.meter.record(now):
            was = self.gears.current
            first = self._first_model[was]
            backlog = sum(len(self._queue[r]) for r in self._replicas_of[first])
            if self.gears.update(now, self.meter.rate(now), backlog) != was \
                    and self.gate is not None:
                self.gate.gear(self.gears.current)
        return self.gears.current

    def first_stage_replicas(self, avoid: Collection[str] = ()) -> tuple[int, ...]:
        """The replicas a new request may be queued at: those of the current range's first
        model that the range gives a share (all of them when it gives none, as ``route``),
        none on a device in ``avoid`` (e.g. a worker reloading its models). When every
        replica with a share is on such a device, the model's other replicas (a standby
        copy the range gives no share); empty when every replica is."""
        rng = self.gears.current
        shares = self.plan.ranges[rng].shares
        replicas = [r for r in self._replicas_of[self._first_model[rng]]
                    if not any(d in avoid for d in self._devices[r])]
        return tuple(r for r in replicas if shares[r] > 0) or tuple(replicas)

    def queued_ids(self, replica: int) -> tuple[int, ...]:
        """The requests waiting in ``replica``'s queue, oldest first."""
        return tuple(self._queue[replica])

    def replicas_on(self, devices: Iterable[str]) -> tuple[int, ...]:
        """The replicas placed on any of ``devices``."""
        return tuple(dict.fromkeys(r for d in devices for r in self._on_device.get(d, ())))

    def route(self) -> int:
        """The first-stage replica of the current range that the next request goes to (the
        router's turn is taken: an engine that rejects the request after looking at that
        replica's queue keeps the plan's shares over the requests offered)."""
        rng = self.gears.current
        return self.router.pick(rng, self._first_model[rng])

    def queued_work_s(self) -> dict[str, float] | None:
        """Profiled seconds each device needs to run the rows queued on it now (running
        batches not included), in batches of each replica's max batch: the plan's
        ``batch_runtime_s``, the runtimes the simulator charges. None when the plan carries
        no runtimes."""
        plan = self.plan
        if not plan.batch_runtime_s:
            return None
        work: dict[str, float] = {}
        for rep, q in enumerate(self._queue):
            n = len(q)
            if not n:
                continue
            top = self._max_batch[rep]
            full, rest = divmod(n, top)
            table = plan.batch_runtime_s[rep]
            seconds = full * table[top - 1] + (table[rest - 1] if rest else 0.0)
            for d in self._devices[rep]:
                work[d] = work.get(d, 0.0) + seconds
        return work

    def finish(self, batch: Batch, certainties: np.ndarray | Sequence[float],
               measured: bool = True) -> Finished:
        """A batch's model call returned ``certainties`` (one per row, in batch order);
        ``measured=False``: its time since ``started_s`` is not a model call's (it failed, or
        ran again after a failure), so the gate is not told it."""
        now = self.clock.now()
        ids = batch.request_ids
        if len(certainties) != len(ids):
            raise PolicyError(f"batch of {len(ids)} rows got {len(certainties)} certainties")
        if self._running.get(batch.replica) is not batch:
            raise PolicyError(f"batch on replica {batch.replica} is not running here")
        del self._running[batch.replica]
        for d in batch.devices:
            self._busy.discard(d)
        if isinstance(certainties, np.ndarray):
            certainties = certainties.tolist()
        req_cascade, req_stage, req_range = self._req_cascade, self._req_stage, self._req_range
        thresholds, models = self.escalation.thresholds, self.escalation.models
        resolved: list[int] = []
        resolved_stages: list[int] = []
        escalated: list[int] = []
        touched: list[int] = []
        for j, rid in enumerate(ids):
            try:
                cascade, stage = req_cascade[rid], req_stage[rid]
            except KeyError:
                raise PolicyError(f"request {rid} is not in flight") from None
            if escalates_row(certainties[j], thresholds[cascade][stage]):
                stage += 1
                req_stage[rid] = stage
                rep = self.router.pick(req_range[rid], models[cascade][stage])
                self._enqueue(rep, rid, now)
                escalated.append(rid)
                touched.append(rep)
            else:
                resolved.append(rid)
                resolved_stages.append(stage)
                del req_stage[rid], req_cascade[rid], req_range[rid]
        if self.gate is not None and measured:  # the dropping forecast reads batch times
            self.gate.ran(batch.replica, len(ids), now - batch.started_s, len(escalated))
        candidates = [r for d in batch.devices for r in self._on_device[d]]
        candidates.extend(dict.fromkeys(touched))
        started = self._start_ready(candidates, now)
        return Finished(tuple(resolved), tuple(resolved_stages), tuple(escalated),
                        tuple(started))

    def next_deadline(self) -> float | None:
        """When the earliest waiting queue reaches its maximum wait (None: nothing waits)."""
        heap = self._deadlines
        while heap:
            t, rep = heap[0]
            since = self._since[rep]
            if since and self.trigger.deadline(since[0]) == t:
                return t
            heapq.heappop(heap)  # stale: that queue was emptied or its head changed
        return None

    def expire(self) -> list[Batch]:
        """Start batches of queues whose oldest row has waited ``max_wait_s`` (if their devices
        are free; otherwise they run when the devices free up)."""
        now = self.clock.now()
        due = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            due.append(heapq.heappop(heap)[1])
        return self._start_ready(dict.fromkeys(due), now) if due else []

    def poll(self, devices: Iterable[str]) -> list[Batch]:
        """Start ready batches on ``devices`` (e.g. freed by another dispatcher's batch)."""
        now = self.clock.now()
        return self._start_ready([r for d in devices for r in self._on_device.get(d, ())], now)

    def move_queued(self, devices: Iterable[str], avoid: Iterable[str] = ()) -> list[Batch]:
        """Move the rows queued at the replicas placed on ``devices`` (e.g. a worker that
        reloads its models after a crash: seconds in which they would wait) to the other
        replicas of the same model not on ``devices`` nor ``avoid`` (other devices that
        load), each row to the one with the shortest queue, keeping the time it was queued
        (queues stay oldest first); start what is ready. Rows of a model with no such
        replica stay where they are."""
        source = set(devices)
        away = source | set(avoid)
        now = self.clock.now()
        moved: dict[int, None] = {}
        for rep in self.replicas_on(source):
            q, s = self._queue[rep], self._since[rep]
            others = self._other_replicas(rep, away)
            if not q or not others:
                continue
            rows = list(zip(q, s, strict=True))
            q.clear()
            s.clear()
            for rid, t in rows:
                to = min(others, key=lambda r: len(self._queue[r]))
                self._insert(to, rid, t)
                moved[to] = None
        return self._start_ready(moved, now)

    def requeue(self, batch: Batch, avoid: Iterable[str] = (), failed: Iterable[int] = ()
                ) -> tuple[list[Batch], bool]:
        """A running batch failed with its worker (killed, crashed or hung), which now
        reloads for seconds. The rows in ``failed`` leave this dispatcher (the caller ends
        them in error). The others are queued at the other replicas of the batch's model
        not on its devices nor ``avoid`` (other devices that load), each at the shortest
        queue, or, where there is none, back at the batch's own replica, where they run once
        its devices are free again; either way ahead of the rows queued after the batch
        started. The batch's devices stay busy (the caller frees them when the worker is
        back). Returns the batches that start now, and whether the rows went to other
        replicas."""
        if self._running.get(batch.replica) is not batch:
            raise PolicyError(f"batch on replica {batch.replica} is not running here")
        gone = set(failed)
        for rid in (*batch.request_ids, *gone):
            if rid not in self._req_stage or rid not in batch.request_ids:
                raise PolicyError(f"request {rid} is not in flight in this batch")
        others = self._other_replicas(batch.replica, set(batch.devices) | set(avoid))
        del self._running[batch.replica]
        for rid in gone:
            del self._req_stage[rid], self._req_cascade[rid], self._req_range[rid]
        targets = others or [batch.replica]
        rows = [rid for rid in batch.request_ids if rid not in gone]
        queued: dict[int, None] = {}
        for rid in reversed(rows):  # each ahead of the rows queued since it started
            to = min(targets, key=lambda r: len(self._queue[r]))
            self._insert(to, rid, batch.started_s, ahead=True)
            queued[to] = None
        return self._start_ready(queued, self.clock.now()), bool(others)

    def drain(self) -> list[int]:
        """Remove every queued (not running) request and return their ids, e.g. on shutdown."""
        out = []
        for q, s in zip(self._queue, self._since, strict=True):
            while q:
                rid = q.popleft()
                s.popleft()
                out.append(rid)
                del self._req_stage[rid], self._req_cascade[rid], self._req_range[rid]
        self._deadlines.clear()
        return out

    # -- internals --------------------------------------------------------------------------

    def _other_replicas(self, rep: int, away: set[str]) -> list[int]:
        """The replicas of ``rep``'s model other than ``rep`` on none of the devices ``away``
        (where rows waiting for ``rep`` may go instead)."""
        return [r for r in self._replicas_of[self._model[rep]]
                if r != rep and away.isdisjoint(self._devices[r])]

    def _enqueue(self, rep: int, rid: int, now: float) -> None:
        q = self._queue[rep]
        q.append(rid)
        self._since[rep].append(now)
        if len(q) == 1:
            heapq.heappush(self._deadlines, (self.trigger.deadline(now), rep))

    def _insert(self, rep: int, rid: int, since_s: float, ahead: bool = False) -> None:
        """Queue ``rid`` at ``rep`` as if it had been queued at ``since_s`` (``ahead``: before
        the rows queued at that same time too)."""
        q, s = self._queue[rep], self._since[rep]
        at = len(s)
        while at > 0 and (s[at - 1] > since_s or (ahead and s[at - 1] == since_s)):
            at -= 1
        q.insert(at, rid)
        s.insert(at, since_s)
        if at == 0:  # a new head: its own deadline (the old head's goes stale)
            heapq.heappush(self._deadlines, (self.trigger.deadline(since_s), rep))

    def _gated(self, rep: int, now: float) -> tuple[int, ...]:
        """The gate's rows of replica ``rep``'s queue; the ones it dropped leave the queue
        and this dispatcher, the rest keep waiting in arrival order."""
        assert self.gate is not None
        q, s = self._queue[rep], self._since[rep]
        ids, dropped = self.gate.select(list(q), list(s), now, self._max_batch[rep], rep)
        gone = set(ids) | set(dropped)
        rest = [(r, t) for r, t in zip(q, s, strict=True) if r not in gone]
        q.clear()
        s.clear()
        for r, t in rest:
            q.append(r)
            s.append(t)
        for rid in dropped:  # the gate keeps their drops for the caller (``StageGate.take``)
            del self._req_stage[rid], self._req_cascade[rid], self._req_range[rid]
        return tuple(ids)

    def _start_ready(self, candidates: Iterable[int], now: float) -> list[Batch]:
        """Start, oldest queue head first, every candidate replica whose trigger fired and
        whose devices are all free."""
        busy, away = self._busy, self._away
        queue, since = self._queue, self._since
        min_queue = self._min_queue[self.gears.current]
        ready = []
        for rep in candidates:
            q = queue[rep]
            if not q:
                continue
            if any(d in busy or d in away for d in self._devices[rep]):
                continue
            if self.trigger.ready(len(q), min_queue[rep], since[rep][0], now):
                ready.append((since[rep][0], rep))
        if not ready:
            return []
        if len(ready) > 1:
            ready.sort()
        started = []
        for _, rep in ready:
            devs = self._devices[rep]
            if any(d in busy for d in devs):
                continue  # an older queue just took a shared device
            q, s = queue[rep], since[rep]
            if self.gate is None:
                take = min(len(q), self._max_batch[rep])
                ids = tuple(q.popleft() for _ in range(take))
                for _ in range(take):
                    s.popleft()
            else:
                ids = self._gated(rep, now)
            if s:  # the rest keeps waiting: its new head gets a deadline
                heapq.heappush(self._deadlines, (self.trigger.deadline(s[0]), rep))
            if not ids:
                continue
            busy.update(devs)
            batch = Batch(rep, self._model[rep], devs, ids, now)
            self._running[rep] = batch
            started.append(batch)
        return started
