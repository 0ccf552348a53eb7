"""Online serving of one gear plan (DESIGN.md section 6; issue 5, first part).

``Engine`` runs the optimizer's ``Dispatcher`` — the same scheduling policy the simulator uses —
on a ``WallClock`` with real model calls:

- one *scheduler* thread owns the dispatcher and processes events in order: arrivals
  (``submit``), finished batches from the device workers, and queue deadlines (max wait);
- one *worker* thread per device runs the batches placed on it, one at a time, with the
  models preloaded before serving starts. Model calls release the GIL inside torch, so workers
  on different devices run in parallel (each device has its own thread count).

Every submitted request gets exactly one ``Outcome``: a result, ``null`` for a NULL input,
``rejected`` when the bounded admission queue is full, ``error`` when its batch failed
``max_retries + 1`` times, or ``cancelled`` when the engine shut down before it ran. A worker
whose model call raised is replaced by a fresh thread and its batch is run again.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ken.errors import KenError
from ken.operators.certainty import certainty_fn
from ken.operators.model import Model
from ken.optimizer.plan import GearPlan
from ken.optimizer.policy import Batch, Dispatcher, WallClock

Status = Literal["ok", "null", "rejected", "error", "cancelled"]


class EngineError(KenError):
    """The engine cannot serve this plan (e.g. a model is missing) or is not running."""


@dataclass(frozen=True)
class Outcome:
    """What happened to one request (times in seconds on the engine's clock)."""

    request_id: int
    status: Status
    arrival_s: float
    completion_s: float
    label: str | None = None
    label_index: int | None = None
    certainty: float | None = None
    stage: int | None = None  # 0-based cascade stage that answered
    model: str | None = None
    gear: int | None = None  # QPS range active when the request was admitted
    error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.completion_s - self.arrival_s


@dataclass(frozen=True)
class LoadReport:
    """Models loaded before serving: seconds per model and in total."""

    seconds: Mapping[str, float]
    total_s: float


@dataclass
class _Request:
    text: str
    future: Future
    arrival_s: float


_STOP = object()


class Engine:
    """Serves one operator's gear plan on preloaded models (see the module docstring).

    ``models`` maps each model the plan places to a loaded ``Model`` or to a zero-argument
    loader; loaders run in ``start()`` and their time is reported. Replicas of one model on
    several CPU workers share the loaded weights (read-only).
    """

    def __init__(self, plan: GearPlan, models: Mapping[str, Model | Callable[[], Model]],
                 max_in_flight: int = 10_000, max_retries: int = 2,
                 clock: WallClock | None = None) -> None:
        missing = sorted({r.model for r in plan.placement} - set(models))
        if missing:
            raise EngineError(f"the plan places {missing} but no model was given for them")
        if any(r.degree > 1 for r in plan.placement):
            raise EngineError("tensor-parallel replicas need a GPU backend; this engine runs "
                              "one replica per CPU worker")
        if max_in_flight < 1 or max_retries < 0:
            raise EngineError("max_in_flight must be >= 1 and max_retries >= 0")
        self.plan = plan
        self._sources = dict(models)
        self._models: dict[str, Model] = {}
        self.clock = clock or WallClock()
        self.max_in_flight = max_in_flight
        self.max_retries = max_retries
        self._certainty = certainty_fn(plan.certainty)
        self._dispatcher = Dispatcher(plan, self.clock)
        self._events: queue.Queue = queue.Queue()
        self._device_queues: dict[str, queue.Queue] = {d: queue.Queue() for d in plan.devices}
        self._workers: dict[str, threading.Thread] = {}
        self._scheduler: threading.Thread | None = None
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._attempts: dict[int, int] = {}  # id(batch) -> failed attempts
        self._accepting = False
        self._lock = threading.Lock()
        self.worker_restarts = 0
        self.load_report: LoadReport | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> LoadReport:
        """Load every model of the plan, then start the scheduler and device workers."""
        if self._scheduler is not None:
            raise EngineError("the engine is already running")
        seconds = {}
        t0 = time.perf_counter()
        for name in sorted({r.model for r in self.plan.placement}):
            src = self._sources[name]
            t = time.perf_counter()
            self._models[name] = src if isinstance(src, Model) else src()
            seconds[name] = time.perf_counter() - t
        self.load_report = LoadReport(seconds, time.perf_counter() - t0)
        for device in self._device_queues:
            self._spawn_worker(device)
        self._scheduler = threading.Thread(target=self._schedule, name="ken-scheduler",
                                           daemon=True)
        self._accepting = True
        self._scheduler.start()
        return self.load_report

    def shutdown(self, drain: bool = True, timeout_s: float = 60.0) -> int:
        """Stop accepting requests. With ``drain``, wait (up to ``timeout_s``) for admitted
        requests to finish; whatever is still queued then ends ``cancelled``. Returns how many
        were cancelled."""
        with self._lock:
            self._accepting = False
        if self._scheduler is None:
            return 0
        deadline = time.monotonic() + timeout_s
        if drain:
            while self._requests and time.monotonic() < deadline:
                time.sleep(0.005)
        done: Future = Future()
        self._events.put(("stop", done))
        cancelled = done.result(timeout=max(deadline - time.monotonic(), 1.0))
        self._scheduler.join(timeout=5.0)
        for q in self._device_queues.values():
            q.put(_STOP)
        for w in self._workers.values():
            w.join(timeout=5.0)
        self._scheduler = None
        return cancelled

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- requests ---------------------------------------------------------------------------

    def submit(self, text: str | None) -> Future:
        """Queue one input row; the future resolves to its ``Outcome``."""
        future: Future = Future()
        now = self.clock.now()
        with self._lock:
            rid = next(self._ids)
            if not self._accepting:
                future.set_result(Outcome(rid, "cancelled", now, now,
                                          error="the engine is not running"))
                return future
            if text is None:
                future.set_result(Outcome(rid, "null", now, now))
                return future
            if not isinstance(text, str):
                raise EngineError(f"the engine classifies text; got {type(text).__name__}")
            if len(self._requests) >= self.max_in_flight:
                future.set_result(Outcome(rid, "rejected", now, now,
                                          error=f"{self.max_in_flight} requests in flight"))
                return future
            self._requests[rid] = _Request(text, future, now)
        self._events.put(("arrive", rid))
        return future

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    @property
    def gear_switches(self) -> list[tuple[float, int, int]]:
        """``(time, from range, to range)`` for every change of cascade so far."""
        return list(self._dispatcher.gears.switches)

    # -- scheduler thread -------------------------------------------------------------------

    def _schedule(self) -> None:
        disp = self._dispatcher
        while True:
            deadline = disp.next_deadline()
            timeout = None if deadline is None else max(deadline - self.clock.now(), 0.0)
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                self._launch(disp.expire())
                continue
            kind = event[0]
            if kind == "arrive":
                self._launch(disp.admit(event[1]))
            elif kind == "done":
                self._finished(*event[1:])
            elif kind == "failed":
                self._failed(*event[1:])
            elif kind == "stop":
                event[1].set_result(self._cancel_queued())
                return
            if deadline is not None and self.clock.now() >= deadline:
                self._launch(disp.expire())

    def _launch(self, batches: list[Batch] | tuple[Batch, ...]) -> None:
        for b in batches:
            self._device_queues[b.devices[0]].put(b)

    def _finished(self, batch: Batch, labels: np.ndarray, certs: np.ndarray,
                  label_names: tuple[str, ...]) -> None:
        self._attempts.pop(id(batch), None)
        gears = {rid: self._dispatcher.range_of(rid) for rid in batch.request_ids}
        fin = self._dispatcher.finish(batch, certs)
        now = self.clock.now()
        row = {rid: j for j, rid in enumerate(batch.request_ids)}
        for rid, stage in zip(fin.resolved, fin.resolved_stages, strict=True):
            req = self._requests.pop(rid)
            j = row[rid]
            idx = int(labels[j])
            req.future.set_result(Outcome(
                rid, "ok", req.arrival_s, now, label_names[idx], idx, float(certs[j]), stage,
                batch.model, gears[rid]))
        self._launch(fin.started)

    def _failed(self, batch: Batch, message: str) -> None:
        attempts = self._attempts.get(id(batch), 0) + 1
        self._attempts[id(batch)] = attempts
        if attempts <= self.max_retries:  # run the same batch again on a fresh worker
            self._device_queues[batch.devices[0]].put(batch)
            return
        del self._attempts[id(batch)]
        gears = {rid: self._dispatcher.range_of(rid) for rid in batch.request_ids}
        # resolve every row (certainty +inf never escalates) to free the devices
        fin = self._dispatcher.finish(batch, [np.inf] * len(batch.request_ids))
        now = self.clock.now()
        for rid in fin.resolved:
            req = self._requests.pop(rid)
            req.future.set_result(Outcome(
                rid, "error", req.arrival_s, now, model=batch.model, gear=gears[rid],
                error=f"{batch.model} failed {attempts} times: {message}"))
        self._launch(fin.started)

    def _cancel_queued(self) -> int:
        """At shutdown: every request still queued or running ends ``cancelled`` (a running
        batch's late result is ignored)."""
        now = self.clock.now()
        self._dispatcher.drain()
        with self._lock:
            left = list(self._requests.items())
            self._requests.clear()
        for rid, req in left:
            req.future.set_result(Outcome(rid, "cancelled", req.arrival_s, now,
                                          error="the engine shut down before it ran"))
        return len(left)

    # -- device workers ---------------------------------------------------------------------

    def _spawn_worker(self, device: str) -> None:
        w = threading.Thread(target=self._work, args=(device,), name=f"ken-worker-{device}",
                             daemon=True)
        self._workers[device] = w
        w.start()

    def _work(self, device: str) -> None:
        q = self._device_queues[device]
        while True:
            batch = q.get()
            if batch is _STOP:
                return
            try:
                texts = [self._requests[rid].text for rid in batch.request_ids]
            except KeyError:  # cancelled by shutdown while queued here
                continue
            try:
                pred = self._models[batch.model].predict(texts, batch_size=len(texts))
                certs = np.asarray(self._certainty(pred.probabilities), dtype=np.float64)
            except Exception as exc:  # noqa: BLE001 - any model failure: restart, re-run
                self._events.put(("failed", batch, f"{type(exc).__name__}: {exc}"))
                self.worker_restarts += 1
                self._spawn_worker(device)  # this thread ends; a fresh one serves the queue
                return
            self._events.put(("done", batch, pred.labels, certs, pred.label_names))
