"""Dispatch in the online engine: the scheduler thread that owns every operator's
``Dispatcher`` — the scheduling policy the simulator uses — and processes events in order:
arrivals, finished and failed batches from the device workers (``supervision.DevicePool``),
queue deadlines (max wait), plan swaps and the stop at shutdown.

Every request in flight is in ``Requests`` until it gets its one ``Outcome``. The dispatchers
share the devices' busy set, so a device runs one batch at a time whichever operator it is
for; devices the online queues leave idle run bulk rows (``bulk.BulkRows``).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ken.engine.admission import Admission
from ken.engine.bulk import BulkBatch, BulkRows
from ken.engine.deadlines import EngineDeadlines
from ken.engine.outcome import Outcome, Status
from ken.engine.request_path import BatchPath, PathLog
from ken.engine.standby import with_standby
from ken.engine.supervision import BatchRecord, Breaker, DevicePool, RunnableBatch
from ken.models.certainty import certainty_of
from ken.policy.dropping import StageGate
from ken.policy.plan import GearPlan
from ken.policy.scheduling import Batch, Dispatcher, WallClock


@dataclass
class _Request:
    text: Any  # a text, or a tuple of texts
    future: Future
    arrival_s: float
    online: str = ""  # the operator of an online request ("" for a bulk row)
    deadline_s: float | None = None  # end-to-end deadline (engine clock), if any
    route: tuple[str, ...] = ()  # operators still ahead of it after this one
    job: Hashable | None = None  # the pipeline request its hops share (None: its own)


#: online submits and answers ``Requests`` keeps per operator for re-planning
#: (``Engine.recent_arrivals``, ``Engine.recent_answers``)
ARRIVAL_LOG = 200_000
ANSWER_LOG = 50_000


class TimeLog:
    """The newest ``capacity`` rows of ``width`` numbers per key (an operator), time first
    and in time order, in one preallocated float array per key: 8 bytes a number, allocated
    when a key is first seen, so a full log holds what an empty one did (a deque of tuples
    took about 100 bytes a row and grew for half an hour at 100 requests/s)."""

    def __init__(self, capacity: int, width: int) -> None:
        self.capacity, self.width = capacity, width
        self._rows: dict[str, np.ndarray] = {}
        self._count: dict[str, int] = {}  # rows ever added (the next row goes at count % cap)

    def add(self, key: str, row: Sequence[float], times: int = 1) -> None:
        """Add ``row`` ``times`` times (its time no earlier than the rows before)."""
        buf = self._rows.get(key)
        if buf is None:
            buf = self._rows[key] = np.empty((self.capacity, self.width))
            self._count[key] = 0
        start = self._count[key]
        times = min(times, self.capacity)  # more than a full log keeps the newest
        at = (start + np.arange(times)) % self.capacity
        buf[at] = row
        self._count[key] = start + times

    def since(self, key: str, since_s: float) -> np.ndarray:
        """The rows of ``key`` whose time is ``since_s`` or later, oldest first, shape
        ``(rows, width)``: a view of the ring until it wraps, so read it before the next
        ``add`` (under the lock that guards both)."""
        buf = self._rows.get(key)
        if buf is None:
            return np.empty((0, self.width))
        count = self._count[key]
        if count <= self.capacity:
            ordered = buf[:count]
        else:
            head = count % self.capacity
            ordered = np.concatenate([buf[head:], buf[:head]])
        return ordered[np.searchsorted(ordered[:, 0], since_s, side="left"):]


class Requests:
    """The requests in flight, by id, each with the future of its outcome; ``add`` and
    ``cancel_all`` may be called from any thread."""

    def __init__(self, clock: WallClock) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self._ids = itertools.count()
        self._requests: dict[int, _Request] = {}
        # per operator: submit times of online requests, admitted or not (the load offered),
        # and (completion time, latency s) of those answered "ok"; both in time order
        self.arrived = TimeLog(ARRIVAL_LOG, 1)
        self.answered = TimeLog(ANSWER_LOG, 2)
        self.deadlines: EngineDeadlines | None = None  # with a dropping policy

    def __len__(self) -> int:
        return len(self._requests)

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, rid: int, text: Any, future: Future, now: float, online: str = "",
            deadline_s: float | None = None, route: tuple[str, ...] = (),
            job: Hashable | None = None) -> None:
        """(Under ``lock``.) ``online``: the operator of an online request (not a bulk row);
        ``deadline_s``, ``route``, ``job``: its end-to-end deadline, the operators ahead of it
        and its pipeline request (``deadlines.EngineDeadlines``)."""
        self._requests[rid] = _Request(text, future, now, online, deadline_s, route, job)

    def get(self, rid: int) -> _Request:
        return self._requests[rid]

    def recent_arrivals(self, operator: str, since_s: float) -> list[float]:
        """Submit times of ``operator``'s online requests since ``since_s``, oldest first."""
        with self.lock:
            return self.arrived.since(operator, since_s)[:, 0].tolist()

    def recent_answers(self, operator: str, since_s: float) -> np.ndarray:
        """(completion time, latency s) of ``operator``'s online requests answered ``ok``
        since ``since_s``, oldest first (a copy)."""
        with self.lock:  # ``since`` may be a view of the ring: copy it under the lock
            return self.answered.since(operator, since_s).copy()

    def waiting(self, operator: str) -> int:
        """``operator``'s online requests in flight: arrived, not yet answered."""
        # list() copies the values in one step: other threads add and resolve meanwhile
        return sum(1 for req in list(self._requests.values()) if req.online == operator)

    def texts(self, batch: RunnableBatch) -> list | None:
        """The input rows of ``batch`` (None: shutdown cancelled its requests)."""
        try:
            return [self._requests[rid].text for rid in batch.request_ids]
        except KeyError:
            return None

    def resolve(self, rid: int, status: Status, now: float | None = None, **fields: Any
                ) -> float:
        """Give request ``rid`` its outcome (completed ``now``, by default the clock's time);
        returns its latency."""
        req = self._requests.pop(rid)
        now = self.clock.now() if now is None else now
        req.future.set_result(Outcome(rid, status, req.arrival_s, now, **fields))
        if req.online and self.deadlines is not None:
            self.deadlines.resolved(rid, status, now)
        if req.online and status == "ok":
            with self.lock:
                self.answered.add(req.online, (now, now - req.arrival_s))
        return now - req.arrival_s

    def cancel_all(self, message: str) -> int:
        """Every request still in flight ends ``cancelled``; returns how many."""
        now = self.clock.now()
        with self.lock:
            left = list(self._requests.items())
            self._requests.clear()
        for rid, req in left:
            req.future.set_result(Outcome(rid, "cancelled", req.arrival_s, now, error=message))
        return len(left)


class Scheduler:
    """The scheduler thread of an engine (see the module docstring). ``plans`` is the
    engine's map of active plans (kept up to date on swaps)."""

    def __init__(self, plans: dict[str, GearPlan], clock: WallClock, requests: Requests,
                 events: queue.Queue, pool: DevicePool, breaker: Breaker,
                 admission: Admission, bulk_batch_size: int,
                 deadlines: EngineDeadlines | None = None, standby: bool = True) -> None:
        self.plans = plans
        self.standby = standby  # serve each plan with its standby replicas (``served``)
        self.clock = clock
        self.requests = requests
        self.events = events
        self.pool = pool
        self.breaker = breaker
        self.admission = admission
        self.bulk_batch_size = bulk_batch_size
        self.deadlines = deadlines  # the dropping policy, if any (``deadlines.py``)
        self._busy: set[str] = set()  # devices running a batch, shared by all dispatchers
        # devices whose worker crashed, hung or was found dead and reloads, or that load a
        # model for a swapped-in plan: admission routes around them, no batch starts there,
        # and rows queued or escalated there move, until it is back (shared with the
        # dispatchers as their ``away``)
        self._reloading: set[str] = set()
        # those of them the pool announced (``("reloading")``), with how many announced
        # reloads are under way: back when the last one's ``("reloaded")`` comes, not when a
        # batch sent there before ends
        self._announced: Counter[str] = Counter()
        # the dispatcher of each operator's active plan (with its stage gate, if any)
        self._active: dict[str, Dispatcher] = {
            op: Dispatcher(self.served(p), clock, self._busy, self._gate(op), self._reloading)
            for op, p in plans.items()}
        self._retiring: list[Dispatcher] = []  # swapped-out plans finishing running batches
        self._owner: dict[int, Dispatcher] = {}  # id(batch) -> dispatcher that started it
        self._past_switches: dict[str, list[tuple[float, int, int]]] = {}
        self.plan_swaps: list[tuple[float, int]] = []  # (time, queued rows moved)
        self._bulk = BulkRows()
        # the devices of a failed or unrun batch whose rows were requeued, held busy until
        # the worker (keyed by the batch's first device) is back
        self._held: dict[str, tuple[str, ...]] = {}
        self._row_attempts: dict[int, int] = {}  # rows of failed batches -> their failures
        self._rerun: set[int] = set()  # id() of batches run again in place after a failure
        self.moved_batches = 0  # failed or unrun batches whose rows went to another replica
        self.rejected = 0  # online requests admission turned away (under requests.lock)
        self.path_log = PathLog()  # where online requests' time went (``request_path``)

    def dispatcher(self, operator: str) -> Dispatcher:
        return self._active[operator]

    def served(self, plan: GearPlan) -> GearPlan:
        """What the dispatcher of ``plan`` serves: ``plan`` with a standby replica of each
        model it places on one CPU worker (``standby.with_standby``), unless the engine was
        made without them. The workers load the standby models too; ``plans`` keeps the plan
        as given."""
        return with_standby(plan, self.pool.workers) if self.standby else plan

    def _gate(self, operator: str) -> StageGate | None:
        return None if self.deadlines is None else self.deadlines.gate(operator)

    def gear_switches_of(self, operator: str) -> list[tuple[float, int, int]]:
        return (self._past_switches.get(operator, [])
                + list(self._active[operator].gears.switches))

    def run(self) -> None:
        """The thread's loop, until a ``("stop", future)`` event."""
        while True:
            deadlines = [t for d in self._dispatchers() if (t := d.next_deadline()) is not None]
            deadline = min(deadlines) if deadlines else None
            timeout = None if deadline is None else max(deadline - self.clock.now(), 0.0)
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                self._expire()
                continue
            kind = event[0]
            if kind == "arrive":
                self._arrive(self._active[event[1]], event[2])
            elif kind == "bulk":
                self._bulk.arrive(self._active[event[1]], event[2])
                self._launch_bulk()
            elif kind == "done":
                self._finished(*event[1:])
            elif kind == "failed":
                self._failed(*event[1:])
            elif kind == "unrun":
                self._unrun(event[1])
            elif kind == "reloading":  # a worker restarts, or loads a swapped-in model
                self._announced.update(event[1])
                self._reload(event[1])
                if len(event) > 2:  # the pool waits for it before it queues the load
                    event[2].set()
            elif kind == "reloaded":
                self._reloaded(event[1])
            elif kind == "swap":
                self._swap(*event[1:])
            elif kind == "stop":
                event[1].set_result(self.cancel_queued())
                return
            if deadline is not None and self.clock.now() >= deadline:
                self._expire()

    def cancel_queued(self) -> int:
        """At shutdown: every request still queued or running ends ``cancelled`` (a running
        batch's late result is ignored)."""
        for disp in self._dispatchers():
            disp.drain()
        self._bulk.clear()
        self._row_attempts.clear()
        self._rerun.clear()
        self.admission.forget_all()
        return self.requests.cancel_all("the engine shut down before it ran")

    # -- events -----------------------------------------------------------------------------

    def _dispatchers(self) -> list[Dispatcher]:
        return [*self._active.values(), *self._retiring]

    def _expire(self) -> None:
        for disp in self._dispatchers():
            self._launch(disp, disp.expire())

    def _arrive(self, disp: Dispatcher, rids: Sequence[int]) -> None:
        """Admission (``admission.Admission``), then the dispatcher queues the rows. Every
        arrival is metered and routed, rejected ones too: the gear follows the offered load
        and the replicas keep their shares of it."""
        for rid in rids:
            now = self.clock.now()  # metered, and logged as admitted, at the same instant
            rng = disp.arrival(now)
            first = disp.plan.cascade_of(rng).models[0]
            reason = self.breaker.reason(first)
            if reason is not None:
                self.path_log.turn(rid, now, False)
                self.requests.resolve(rid, "error", model=first, gear=rng, error=reason)
                continue
            if self.deadlines is not None:
                req = self.requests.get(rid)
                drop = self.deadlines.arrive(rid, disp.plan.operator, self.clock.now(),
                                             req.arrival_s, req.deadline_s, req.route, req.job)
                if drop is not None:
                    self.path_log.turn(rid, now, False)
                    self.requests.resolve(rid, "dropped", gear=rng, error=drop.reason)
                    continue
            placed = self.admission.place(disp, rid, disp.route(), self._device_work,
                                          self._reloading | self.pool.loading())
            if placed.reason is not None:
                with self.requests.lock:
                    self.rejected += 1
                self.path_log.turn(rid, now, True)
                self.requests.resolve(rid, "rejected", gear=rng, error=placed.reason,
                                      retry_after_s=placed.retry_after_s)
                continue
            self.path_log.admit(rid, now)
            self._launch(disp, disp.admit(rid, metered=False, replica=placed.replica))

    def _device_work(self) -> dict[str, float]:
        """Profiled seconds of work each device has ahead of a new row: the rows queued on it
        (every plan's) and what is left of the batch it runs."""
        work: dict[str, float] = {}
        for disp in self._dispatchers():
            for d, seconds in (disp.queued_work_s() or {}).items():
                work[d] = work.get(d, 0.0) + seconds
        for d, seconds in self.pool.running_work().items():
            work[d] = work.get(d, 0.0) + seconds
        return work

    def _launch(self, disp: Dispatcher, batches: Iterable[Batch]) -> None:
        """Run the batches a dispatcher call started; answer the requests its stage gate
        dropped meanwhile (at once, with the drop's reason)."""
        for b in batches:
            self._owner[id(b)] = disp
            self.pool.run(b, disp.plan.batch_seconds(b.replica, len(b.request_ids)))
        if self.deadlines is not None:
            drops = self.deadlines.take_dropped(disp.plan.operator)
            now = self.clock.now() if drops else 0.0
            for drop in drops:
                self.admission.forget(drop.request_id)
                self._row_attempts.pop(drop.request_id, None)
                self.requests.resolve(drop.request_id, "dropped", now, error=drop.reason)

    def _freed(self, devices: tuple[str, ...]) -> None:
        """Devices came free: online queues first, then bulk rows."""
        if self._reloading:  # rows escalated to a reloading replica meanwhile
            self._move_off_reloading()
        for disp in self._dispatchers():
            self._launch(disp, disp.poll(devices))
        self._launch_bulk()
        self._retiring = [d for d in self._retiring if d.in_flight]

    def _finished(self, batch: Batch | BulkBatch, values: list, scores: np.ndarray,
                  record: BatchRecord) -> None:
        self.breaker.ran(batch)
        measured = id(batch) not in self._rerun  # a rerun's time counts its failed attempt
        self._rerun.discard(id(batch))
        now = self.clock.now()
        record = replace(record, report_s=now - record.end_s, handoff_s=(
            record.start_s - batch.started_s if measured and isinstance(batch, Batch) else 0.0))
        self.pool.log_call(record)
        if self._row_attempts:
            for rid in batch.request_ids:
                self._row_attempts.pop(rid, None)
        self._back(batch.devices)
        if isinstance(batch, BulkBatch):
            for d in batch.devices:
                self._busy.discard(d)
            for a in self._bulk.finished(batch, values, scores):
                self.requests.resolve(a.request_id, "ok", now, value=a.value, certainty=a.certainty,
                                      stage=a.stage, model=batch.model)
            self._freed(batch.devices)
            return
        disp = self._owner.pop(id(batch))
        certs = certainty_of(scores, disp.plan.certainty)
        gears = {rid: disp.range_of(rid) for rid in batch.request_ids}
        if measured:
            self.path_log.batch(BatchPath(record, batch.request_ids))
        if self.deadlines is not None:  # each row's share of the batch's device time
            share = (now - batch.started_s) * len(batch.devices) / len(batch.request_ids)
            for rid in batch.request_ids:
                self.deadlines.charge(rid, share)
        fin = disp.finish(batch, certs, measured)
        self.admission.count_escalations(disp.plan, batch.model, gears, fin.escalated)
        row = {rid: j for j, rid in enumerate(batch.request_ids)}
        for rid, stage in zip(fin.resolved, fin.resolved_stages, strict=True):
            j = row[rid]
            latency = self.requests.resolve(rid, "ok", now, value=values[j],
                                            certainty=float(certs[j]), stage=stage,
                                            model=batch.model, gear=gears[rid])
            self.admission.answered(rid, latency)
        self._launch(disp, fin.started)
        self._freed(batch.devices)

    def _failed(self, batch: Batch | BulkBatch, message: str, crashed: bool,
                expected_s: float | None, never_returned: bool = False) -> None:
        """A model call raised (``crashed``: or its worker died or hung; ``never_returned``:
        past the first-call bound): run its rows once more, else end them in error. When a
        process worker (or Ray actor) died or hung, its rows do not wait in the batch for its
        reload (``_requeue_failed``); otherwise the same batch runs again in place."""
        for rid in batch.request_ids:  # a failed attempt says nothing about queueing
            self.admission.forget(rid)
        self._rerun.discard(id(batch))  # added again below if it runs again in place
        if crashed and not isinstance(batch, BulkBatch) and \
                self.pool.revivable(batch.devices[0]):
            self._requeue_failed(batch, message, never_returned)
            return
        error = self.breaker.failed(batch, message, crashed, never_returned)
        if error is None:  # run the same batch again (the device stays busy)
            if crashed:
                self._reload(batch.devices)
            self._rerun.add(id(batch))  # its time then counts this attempt too
            self.pool.run(batch, expected_s)
            return
        self._back(batch.devices)
        if isinstance(batch, BulkBatch):
            for d in batch.devices:
                self._busy.discard(d)
            self._bulk.failed(batch)
            now = self.clock.now()
            for rid in batch.request_ids:
                self.requests.resolve(rid, "error", now, model=batch.model, error=error)
            self._freed(batch.devices)
            return
        disp = self._owner.pop(id(batch))
        gears = {rid: disp.range_of(rid) for rid in batch.request_ids}
        # resolve every row (certainty +inf never escalates) to free the devices
        fin = disp.finish(batch, [np.inf] * len(batch.request_ids), measured=False)
        now = self.clock.now()
        for rid in fin.resolved:  # admission forgot them above
            self.requests.resolve(rid, "error", now, model=batch.model, gear=gears[rid],
                                  error=error)
        self._launch(disp, fin.started)
        self._freed(batch.devices)

    def _requeue_failed(self, batch: Batch, message: str, never_returned: bool) -> None:
        """``batch``'s worker process died or hung: the pool replaces it at once, its devices
        held busy until the fresh worker has loaded (``_reloaded``). Each row counts its own
        failed attempts (``_row_attempts``, across the batches it was in): those past the
        retries end in error, the others go to the other replicas of the model
        (``Dispatcher.requeue``) instead of waiting for the reload, or, where there is none,
        back to the batch's own queue, to run once the worker is back. A device whose every
        model is marked failed is not revived (nothing would run there)."""
        ids = batch.request_ids
        attempts = [n + 1 for n in self._attempts_so_far(batch)]
        errors = self.breaker.failed_rows(batch, message, True, never_returned, attempts)
        failed = {rid: e for rid, e in zip(ids, errors, strict=True) if e is not None}
        device = batch.devices[0]
        if any(self.breaker.reason(m) is None for m in self.pool.models_on(device)):
            self._requeue(batch, attempts, failed)
            self.pool.revive(device)
        else:
            self._requeue(batch, attempts, failed, hold=False)

    def _unrun(self, batch: Batch) -> None:
        """``batch`` reached a worker process found dead before it ran (killed between
        batches): the pool replaces the worker (``("reloading")`` and ``("reloaded")``
        follow), its devices held busy until then. The batch's rows did not fail, so no
        attempt is counted: they go to the other replicas of the model at once, ahead of the
        rows queued after them, or, where there is none, back to their queue."""
        for rid in batch.request_ids:  # their wait so far was the dead worker's
            self.admission.forget(rid)
        self._requeue(batch, self._attempts_so_far(batch), {})

    def _attempts_so_far(self, batch: Batch) -> list[int]:
        """Each row's failed attempts before this batch's fate: its own (``_row_attempts``,
        taken), or the batch's failed runs in place (``Breaker.forget``), whichever is more."""
        before = self.breaker.forget(batch)
        return [max(self._row_attempts.pop(rid, 0), before) for rid in batch.request_ids]

    def _requeue(self, batch: Batch, attempts: Sequence[int], failed: Mapping[int, str],
                 hold: bool = True) -> None:
        """The rows of a batch that will not run where it was (``_requeue_failed``,
        ``_unrun``): those in ``failed`` end in error with it, the others keep their
        ``attempts`` and are queued again (``Dispatcher.requeue``). ``hold``: its devices
        stay busy and count as reloading until the fresh worker is back (``_reloaded``);
        otherwise they are freed now."""
        disp = self._owner.pop(id(batch))
        gears = {rid: disp.range_of(rid) for rid in failed}
        started, elsewhere = disp.requeue(batch, self._reloading | self.pool.loading(),
                                          failed)
        now = self.clock.now()
        for rid, error in failed.items():
            self.requests.resolve(rid, "error", now, model=batch.model, gear=gears[rid],
                                  error=error)
        for rid, n in zip(batch.request_ids, attempts, strict=True):
            if rid not in failed and n:
                self._row_attempts[rid] = n
        if elsewhere and len(failed) < len(batch.request_ids):
            self.moved_batches += 1
        if hold:
            self._held[batch.devices[0]] = batch.devices
            self._reload(batch.devices)
        else:
            self._busy.difference_update(batch.devices)
            self._freed(batch.devices)
        self._forget_queued(disp, {batch.model}, started)
        self._launch(disp, started)

    def _reloaded(self, devices: tuple[str, ...]) -> None:
        """A fresh worker on ``devices`` loaded its models: take its devices back (those a
        moved batch held too) and start what waits for them; a device with another announced
        reload under way (a load for a swapped-in plan beside a revive) stays away."""
        back = []
        for d in devices:
            if self._announced[d] > 1:
                self._announced[d] -= 1
            else:
                self._announced.pop(d, None)
                back.append(d)
        freed = set(back)
        for d in back:
            held = self._held.pop(d, ())
            freed.update(held)
            self._busy.difference_update(held)
        self._reloading.difference_update(freed)
        self._freed(tuple(freed))

    def _back(self, devices: tuple[str, ...]) -> None:
        """A batch on ``devices`` ended: a worker that reloaded to retry it in place is back,
        unless the pool announced the reload (then only ``("reloaded")`` ends it)."""
        if self._reloading:
            self._reloading.difference_update(d for d in devices if d not in self._announced)

    def _reload(self, devices: tuple[str, ...]) -> None:
        """A fresh worker on ``devices`` reloads its models for the retry of a batch: route
        new requests around it, and do not learn the slowdown from the rows already queued
        there (their wait is the reload's, not the load's)."""
        self._reloading.update(devices)
        for disp in self._dispatchers():
            for rep in disp.replicas_on(devices):
                for rid in disp.queued_ids(rep):
                    self.admission.forget(rid)
        self._move_off_reloading()

    def _move_off_reloading(self) -> None:
        """Rows queued at a replica whose worker reloads (``_reloading``: those queued when
        the crash was found, and rows escalated there since) would wait for the reload: move
        them to the other replicas of their model, not to one that loads too. The rows queued
        at those replicas are forgotten by admission as well: the moved rows, queued ahead
        of them by age, make their wait the reload's, not the load's."""
        loading = self._reloading | self.pool.loading()
        for disp in self._dispatchers():
            stuck = {rep for rep in disp.replicas_on(self._reloading) if disp.queued(rep)}
            if not stuck:
                continue
            models = {disp.plan.placement[rep].model for rep in stuck}
            started = disp.move_queued(self._reloading, loading)
            self._forget_queued(disp, models, started)
            self._launch(disp, started)

    def _forget_queued(self, disp: Dispatcher, models: set[str], started: list[Batch]) -> None:
        """Admission forgets the rows queued at ``models``' replicas and the rows of
        ``started``: rows moved there from a reloading replica, queued ahead of them by age,
        make their wait the reload's, not the load's."""
        for rep, r in enumerate(disp.plan.placement):
            if r.model in models:
                for rid in disp.queued_ids(rep):
                    self.admission.forget(rid)
        for b in started:
            for rid in b.request_ids:
                self.admission.forget(rid)

    def _swap(self, plan: GearPlan, done: Future) -> None:
        op = plan.operator
        old = self._active.get(op)
        moved: list[int] = []
        if old is not None:
            self._past_switches.setdefault(op, []).extend(old.gears.switches)
            moved = sorted(old.drain())  # request ids grow with arrival: oldest first
            if old.in_flight:
                self._retiring.append(old)
            if isinstance(old.gate, StageGate):  # its batches no longer tell the forecast
                old.gate = old.gate.retired()
        new = Dispatcher(self.served(plan), self.clock, self._busy, self._gate(op),
                         self._reloading)
        if self.deadlines is not None:
            self.deadlines.replanned(plan)
        self._active[op] = new
        self.plans[op] = plan
        for rid in moved:
            self._launch(new, new.admit(rid, metered=False))
        self._launch(new, new.poll(plan.devices))
        self.plan_swaps.append((self.clock.now(), len(moved)))
        done.set_result(len(moved))

    # -- bulk rows --------------------------------------------------------------------------

    def _launch_bulk(self) -> None:
        for b in self._bulk.batches(self._bulk_devices, self._busy, self.bulk_batch_size,
                                    self._reloading):
            self.pool.run(b, self._bulk_seconds(b.model, b.devices[0], len(b.request_ids)))

    def _bulk_devices(self, model: str) -> list[str]:
        placed = list(dict.fromkeys(d for plan in self.plans.values()
                                    for r in plan.replicas_of(model)
                                    for d in plan.placement[r].devices))
        return placed or self.pool.hosts(model)

    def _bulk_seconds(self, model: str, device: str, rows: int) -> float | None:
        """Profiled seconds of a bulk batch: a replica of ``model`` on ``device`` if a plan
        has one, else any replica of it."""
        found = [(device not in p.placement[r].devices, p, r) for p in self.plans.values()
                 for r in p.replicas_of(model)]
        for _, plan, r in sorted(found, key=lambda f: f[0]):
            seconds = plan.batch_seconds(r, rows)
            if seconds is not None:
                return seconds
        return None
