"""Online serving of gear plans (DESIGN.md section 6; issue 5).

``Engine`` serves one pool of devices for any number of operators, one gear plan each (the
query optimizer plans them together on the same devices). Per operator it runs a
``Dispatcher`` — the same scheduling policy the simulator uses — on a ``WallClock`` with real
model calls; the dispatchers share the devices' busy set, so a device runs one batch at a time
whichever operator it is for:

- one *scheduler* thread owns the dispatcher and processes events in order: arrivals
  (``submit``), finished batches from the devices, queue deadlines (max wait), plan swaps;
- one *device worker* per device of the plan runs the batches placed on it, one at a time, on
  models loaded before serving starts (``workers.py``): its own process by default (a device
  of ``threads_per_device`` torch threads), or a thread of this process for models given
  already loaded.

Every submitted request gets exactly one ``Outcome``: a result, ``null`` for a NULL input,
``rejected`` when admission turned it away (with the reason and a retry hint), ``error`` when
its batch failed ``max_retries + 1`` times or its model is marked failed, or ``cancelled`` when
the engine shut down before it ran. Failure behaviour (DESIGN.md section 14):

- *admission*: an online request is admitted only while the gear plan can serve it within its
  latency target (by default the p99 the plan's simulation predicted, at least
  ``MIN_PLAN_TARGET_S``). The scheduler routes it to a first-stage replica and estimates its
  latency as the profiled work queued on that replica's devices (``Dispatcher.queued_work_s``:
  the runtimes the simulator charges), plus what is left of the batch running there, its own
  row and the later-stage work it and the rows ahead will bring (escalation rates measured
  while serving, per cascade and stage; every row escalates until 20 have been answered),
  times the slowdown it
  measures while serving (``Slowdown``: the 95th percentile of answered latency over
  estimate in the last 5 s, for requests admitted near the limit). Over the target it is
  rejected at once, with the reason and a retry hint (a SQL query sends such rows again
  after the hint). ``max_in_flight`` stays as a hard cap on memory.
- *deadlines*: every batch has one, ``BatchDeadline.seconds`` of its profiled runtime. A
  process worker that misses it is killed and replaced; a thread worker's call is abandoned
  (threads cannot be killed) and the device gets a fresh thread. The batch runs once more
  (``max_retries``), then its rows end in ``error``.
- *crashes*: a model whose calls crash or hang their worker ``max_crashes`` times in a row is
  marked failed: its queued rows and later requests end in ``error`` at once, with the reason.
- *shutdown*: admission stops, nothing is restarted, admitted requests drain (up to a
  timeout), the rest end ``cancelled``. SIGTERM does the same when the engine was started in
  the main thread (``drain_on_sigterm``), then the process exits with status 143.

Two kinds of work share the devices:

- *online* requests (``submit``) go through the gear plan: metered, routed, batched by the
  queue triggers, escalated per stage;
- *bulk* rows (``submit_many(..., bulk=True)``, e.g. an analytical query's column) run the
  plan's lowest-load cascade (its most accurate gear) in throughput-sized batches on devices the
  online queues leave idle; they are not metered, so they never move the gear.

``swap_plan`` installs a new gear plan while serving: rows still queued under the old plan are
moved to the new one's first stage, batches already running finish (and escalate) under the
old plan, nothing is lost.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import numpy as np

from ken.engine.outcome import Outcome, Status
from ken.engine.ray_runner import RayCluster, RayRunner
from ken.engine.sigterm import SigtermDrain
from ken.engine.workers import (
    ProcessRunner,
    ThreadRunner,
    WorkerDied,
    WorkerError,
    gpu_index,
    warm_up,
)
from ken.errors import BatchTimeout, EngineError
from ken.models.cascade import Cascade
from ken.models.certainty import certainty_of
from ken.models.model import Model
from ken.policy.plan import GearPlan
from ken.policy.scheduling import Batch, Dispatcher, WallClock

Source = Model | Callable[[], Model]


def _is_row(value: object) -> bool:
    """A text, or a tuple of texts (a row of a model over several columns)."""
    return isinstance(value, str) or (isinstance(value, tuple) and bool(value)
                                      and all(isinstance(v, str) for v in value))


@dataclass(frozen=True)
class LoadReport:
    """Models loaded (and warmed up) before serving: seconds per (device, model), and wall
    time in total."""

    seconds: Mapping[str, float]
    total_s: float
    workers: str  # "process" | "thread"
    rss_bytes: Mapping[str, int] = field(default_factory=dict)  # per process worker, loaded


@dataclass(frozen=True)
class BatchRecord:
    """One model call as a device ran it (engine clock; includes the worker round trip)."""

    device: str
    model: str
    rows: int
    start_s: float
    end_s: float
    idle_before_s: float  # how long the device had been idle before this call
    bulk: bool = False

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class BatchDeadline:
    """How long a batch may run: ``factor`` times its profiled runtime, at least ``floor_s``;
    ``unprofiled_s`` when the plan carries no runtimes.

    10x leaves room for what serving adds to a profile (the worker round trip, a device that
    idled, a long row; benchmarks/e2e measured serving calls at 1.0-1.2x their profile at the
    median); the 2 s floor keeps a busy machine's stalls (page faults, another process on the
    core) from killing a healthy worker, whose restart costs more than the wait.
    """

    factor: float = 10.0
    floor_s: float = 2.0
    unprofiled_s: float = 60.0

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) and v > 0
                   for v in (self.factor, self.floor_s, self.unprofiled_s)):
            raise EngineError("a batch deadline needs a factor, a floor and an unprofiled "
                              "deadline that are finite and > 0")

    def seconds(self, profiled_s: float | None) -> float:
        if profiled_s is None:
            return self.unprofiled_s
        return max(self.factor * profiled_s, self.floor_s)


@dataclass
class _Request:
    text: str
    future: Future
    arrival_s: float


@dataclass(frozen=True, eq=False)
class _BulkBatch:
    """A throughput batch of bulk rows on one device (not the dispatcher's)."""

    model: str
    devices: tuple[str, ...]
    request_ids: tuple[int, ...]


_STOP = object()
#: answered rows of a cascade's stage before admission trusts its measured escalation rate
MIN_ESCALATION_ROWS = 20
#: the least latency target a plan's predicted p99 sets: models faster than the engine's own
#: hand-offs between threads (about a millisecond each) are simulated with p99s no wall-clock
#: engine can meet, and would have every request turned away
MIN_PLAN_TARGET_S = 0.02


class Slowdown:
    """How much longer than its admission estimate a request admitted near the latency target
    takes to be answered (``Engine._admission``): the ``quantile`` of the ratios of answered
    latency over estimate seen in the last ``horizon_s`` seconds (at most ``window`` of
    them), at least 1; 1 when there are none. A high quantile, not the mean: requests whose
    rows escalate wait in later stages' queues too, and admission holds the tail to the
    target. A recent window, not all history: a worker restart delays the requests behind it
    by seconds, and that must not keep admission shut once the worker is back."""

    def __init__(self, quantile: float = 0.95, window: int = 400, horizon_s: float = 5.0,
                 every: int = 20) -> None:
        self.quantile, self.horizon_s, self.every = quantile, horizon_s, every
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)  # (time, ratio)
        self._value = 1.0
        self._new = 0

    def add(self, ratio: float, now: float) -> None:
        # never below 1: profiles time each model alone, serving is not faster than that
        self.samples.append((now, min(max(ratio, 1.0), 50.0)))
        self._new += 1
        if self._new >= self.every:
            self._refresh()

    def value(self, now: float) -> float:
        """The slowdown to apply now (samples older than ``horizon_s`` are forgotten)."""
        stale = False
        while self.samples and self.samples[0][0] < now - self.horizon_s:
            self.samples.popleft()
            stale = True
        if stale:
            self._refresh()
        return self._value

    def _refresh(self) -> None:
        self._new = 0
        self._value = (float(np.quantile([r for _, r in self.samples], self.quantile))
                       if self.samples else 1.0)


class Engine:
    """Serves gear plans, one per operator, on one pool of preloaded devices (see the module
    docstring). ``plan`` is one ``GearPlan`` or several (for different operators).

    ``models`` maps each model the plans place to a loaded ``Model`` or to a zero-argument
    loader. ``workers="process"`` needs picklable loaders (each device process loads its own
    copy); ``"thread"`` loads each model once in this process and shares it; ``"ray"`` runs
    each device as a Ray actor (``ray_runner.py``) on ``ray_cluster`` (default: a local Ray
    started for this process), loaders again; ``"auto"`` picks processes when every source is
    a loader.

    Failure behaviour (see the module docstring): ``admission="plan"`` admits an online
    request while its estimated latency is within ``latency_target_s`` (default: each plan's
    predicted p99, at least ``MIN_PLAN_TARGET_S``; a plan without predicted latency or
    profiled runtimes is bounded by ``max_in_flight`` alone, as is every plan with
    ``admission="max_in_flight"``);
    ``deadline`` bounds each batch; ``max_retries`` re-runs a failed batch; ``max_crashes``
    crashes or hangs in a row mark a model failed; ``drain_on_sigterm`` drains for up to
    ``drain_timeout_s`` on SIGTERM, then exits.
    """

    def __init__(self, plan: GearPlan | Sequence[GearPlan], models: Mapping[str, Source],
                 max_in_flight: int = 10_000, max_retries: int = 1,
                 clock: WallClock | None = None, *,
                 workers: Literal["auto", "process", "thread", "ray"] = "auto",
                 threads_per_device: int = 1, bulk_batch_size: int | None = None,
                 memory_budget_bytes: int | None = None,
                 admission: Literal["plan", "max_in_flight"] = "plan",
                 latency_target_s: float | None = None,
                 deadline: BatchDeadline | None = None,
                 max_crashes: int = 3, drain_on_sigterm: bool = True,
                 drain_timeout_s: float = 30.0, ray_cluster: RayCluster | None = None,
                 gpu_models: Mapping[str, Source] | None = None) -> None:
        plans = [plan] if isinstance(plan, GearPlan) else list(plan)
        if not plans:
            raise EngineError("an engine needs at least one gear plan")
        if len({p.operator for p in plans}) != len(plans):
            raise EngineError("an engine serves one gear plan per operator; got "
                              f"{[p.operator for p in plans]}")
        self._gpu_sources: dict[str, Source] = dict(gpu_models or {})
        for p in plans:
            self._check_plan(p, models, self._gpu_sources)
        if max_in_flight < 1 or max_retries < 0 or max_crashes < 1:
            raise EngineError("max_in_flight and max_crashes must be >= 1 and max_retries >= 0")
        if admission not in ("plan", "max_in_flight"):
            raise EngineError(f"admission must be 'plan' or 'max_in_flight', not {admission!r}")
        if latency_target_s is not None and not (math.isfinite(latency_target_s)
                                                 and latency_target_s > 0):
            raise EngineError("latency_target_s must be finite and > 0 seconds")
        if not (math.isfinite(drain_timeout_s) and drain_timeout_s >= 0):
            raise EngineError("drain_timeout_s must be finite and >= 0 seconds")
        if workers == "auto":
            workers = "thread" if any(isinstance(s, Model) for s in models.values()) \
                else "process"
        if workers not in ("process", "thread", "ray"):
            raise EngineError(f"workers must be 'auto', 'process', 'thread' or 'ray', not "
                              f"{workers!r}")
        if ray_cluster is not None and workers != "ray":
            raise EngineError("a Ray cluster serves with workers='ray'")
        self.workers = workers
        self.ray_cluster = ray_cluster
        self._check_sources(models)
        self._check_sources(self._gpu_sources)
        self._check_gpu_workers(plans)
        if threads_per_device < 1:
            raise EngineError("a device needs at least one thread")
        self.plans: dict[str, GearPlan] = {p.operator: p for p in plans}
        self.threads_per_device = threads_per_device
        self._sources: dict[str, Source] = dict(models)
        self._models: dict[str, Model] = {}  # thread workers share these
        self.clock = clock or WallClock()
        self.max_in_flight = max_in_flight
        self.max_retries = max_retries
        self.admission = admission
        self.latency_target = latency_target_s
        self.deadline = deadline or BatchDeadline()
        self.max_crashes = max_crashes
        self.drain_on_sigterm = drain_on_sigterm
        self.drain_timeout_s = drain_timeout_s
        self.bulk_batch_size = bulk_batch_size or max(b for p in plans for b in p.max_batch)
        if memory_budget_bytes is not None and memory_budget_bytes <= 0:
            raise EngineError("the memory budget per device must be > 0 bytes")
        self.memory_budget_bytes = memory_budget_bytes
        self._busy: set[str] = set()  # devices running a batch, shared by all dispatchers
        # the dispatcher of each operator's active plan
        self._active: dict[str, Dispatcher] = {
            p.operator: Dispatcher(p, self.clock, self._busy) for p in plans}
        self._retiring: list[Dispatcher] = []  # swapped-out plans finishing running batches
        self._owner: dict[int, Dispatcher] = {}  # id(batch) -> dispatcher that started it
        self._past_switches: dict[str, list[tuple[float, int, int]]] = {}
        self.plan_swaps: list[tuple[float, int]] = []  # (time, queued rows moved)
        # a bulk row runs the lowest-load cascade of the plan active when it arrived, escalated
        # by that plan's dispatcher policy: rid -> (dispatcher, cascade index, stage)
        self._bulk_rows: dict[int, tuple[Dispatcher, int, int]] = {}
        self._bulk_queue: dict[str, deque[int]] = {}  # model -> waiting bulk rows
        self._events: queue.Queue = queue.Queue()
        self._device_queues: dict[str, queue.Queue] = {}
        self._runners: dict[str, ThreadRunner | ProcessRunner | RayRunner] = {}
        self._loaded_on: dict[str, set[str]] = {}  # device -> models loaded there
        self._threads: dict[str, threading.Thread] = {}
        self._scheduler: threading.Thread | None = None
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._attempts: dict[int, int] = {}  # id(batch) -> failed attempts
        self._crashes: dict[str, int] = {}  # model -> crashes or hangs in a row
        self._failed_models: dict[str, str] = {}  # model -> why it is not run any more
        self._running_until: dict[str, float] = {}  # device -> profiled end of its batch
        self._slowdown: dict[str, Slowdown] = {}  # operator -> latency over estimate
        # (cascade, stage) -> (rows answered at that stage, rows escalated from it): a rate
        # belongs to a stage's threshold, so other gears and swapped-in plans start cold
        self._escalations: dict[tuple[Cascade, int], tuple[int, int]] = {}
        self._estimated: dict[int, tuple[str, float]] = {}  # rid -> (operator, estimate s)
        self._accepting = False
        self._closing = False
        self._lock = threading.Lock()
        self._shutdown_lock = threading.Lock()
        self._sigterm: SigtermDrain | None = None
        # the latest model calls (bounded: the oldest half is dropped at the limit)
        self.batch_log: list[BatchRecord] = []
        self.batch_log_limit = 200_000
        self.failed_attempts = 0  # model calls that raised, hung or whose worker died
        self.timeouts = 0  # batches that ran past their deadline
        self.rejected = 0  # online requests admission turned away
        self.load_report: LoadReport | None = None

    @staticmethod
    def _check_plan(plan: GearPlan, models: Mapping[str, Source],
                    gpu_models: Mapping[str, Source]) -> None:
        on_gpu = {r.model for r in plan.placement if any(gpu_index(d) is not None
                                                         for d in r.devices)}
        on_cpu = {r.model for r in plan.placement if any(gpu_index(d) is None
                                                         for d in r.devices)}
        missing = sorted(on_cpu - set(models))
        if missing:
            raise EngineError(f"the plan places {missing} but no model was given for them")
        missing = sorted(on_gpu - set(gpu_models))
        if missing:
            raise EngineError(f"the plan places {missing} on GPUs but no GPU loader was given "
                              "for them (gpu_models=: loaders that load on cuda:0, the one GPU "
                              "each worker process sees)")
        if any(r.degree > 1 for r in plan.placement):
            raise EngineError("tensor-parallel replicas need a GPU backend; this engine runs "
                              "one replica per CPU worker")

    def _check_gpu_workers(self, plans: Sequence[GearPlan]) -> None:
        gpus = sorted({d for p in plans for d in p.devices if gpu_index(d) is not None})
        if gpus and self.workers == "thread":
            raise EngineError(f"the plan places models on GPUs ({', '.join(gpus)}): GPU devices "
                              "are served by worker processes (one per GPU) or Ray actors, not "
                              "threads; pass loaders and workers='process'")

    def _source(self, device: str, model: str) -> Source:
        """What loads ``model`` on ``device``: a GPU's loader for GPU devices."""
        return (self._sources if gpu_index(device) is None else self._gpu_sources)[model]

    def _check_sources(self, models: Mapping[str, Source]) -> None:
        if self.workers in ("process", "ray") and any(isinstance(s, Model)
                                                      for s in models.values()):
            raise EngineError(f"{self.workers} workers load their own models: pass loaders "
                              "(zero-argument functions), not loaded models, or use "
                              "workers='thread'")

    @property
    def plan(self) -> GearPlan:
        """The gear plan served, when the engine serves one operator."""
        if len(self.plans) != 1:
            raise EngineError(f"this engine serves {len(self.plans)} operators "
                              f"({', '.join(self.plans)}); use engine.plans[operator]")
        return next(iter(self.plans.values()))

    @staticmethod
    def _placed(*plans: GearPlan) -> dict[str, list[str]]:
        """Models each device of ``plans`` hosts."""
        out: dict[str, list[str]] = {d: [] for p in plans for d in p.devices}
        for p in plans:
            for r in p.placement:
                for d in r.devices:
                    if r.model not in out[d]:
                        out[d].append(r.model)
        return out

    def _operator(self, operator: str | None) -> str:
        if operator is None:
            if len(self.plans) != 1:
                raise EngineError(f"this engine serves {', '.join(self.plans)}: say which "
                                  "operator a row is for (operator=...)")
            return next(iter(self.plans))
        if operator not in self.plans:
            raise EngineError(f"this engine does not serve {operator}(); it serves "
                              f"{', '.join(self.plans)}")
        return operator

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> LoadReport:
        """Load every model of the plan on its devices, then start serving."""
        if self._scheduler is not None:
            raise EngineError("the engine is already running")
        t0 = time.perf_counter()
        seconds = self._add_devices(self._placed(*self.plans.values()))
        self.load_report = LoadReport(seconds, time.perf_counter() - t0, self.workers,
                                      self._check_memory())
        self._scheduler = threading.Thread(target=self._schedule, name="ken-scheduler",
                                           daemon=True)
        self._accepting = True
        self._scheduler.start()
        if self.drain_on_sigterm:
            self._sigterm = SigtermDrain.install(lambda: self.shutdown(drain=True))
        return self.load_report

    def _add_devices(self, placed: Mapping[str, list[str]]) -> dict[str, float]:
        """Start workers for devices not served yet (loading their models, in parallel) and
        load models new to running devices. Seconds per ``device/model``."""
        seconds: dict[str, float] = {}
        new = {d: ms for d, ms in placed.items() if d not in self._runners}
        if self.workers == "thread":
            for name in sorted({m for ms in placed.values() for m in ms} - set(self._models)):
                src = self._sources[name]
                t = time.perf_counter()
                self._models[name] = src if isinstance(src, Model) else src()
                warm_up(self._models[name])
                seconds[f"shared/{name}"] = time.perf_counter() - t
            runners = {d: ThreadRunner(d, self._models) for d in new}
        elif self.workers == "ray":
            if new and self.ray_cluster is None:
                self.ray_cluster = RayCluster.connect()  # a local Ray for this process
            cluster = self.ray_cluster
            runners = {d: RayRunner(d, {m: self._source(d, m) for m in ms},  # type: ignore[misc]
                                    self.threads_per_device,
                                    cluster.placement(d, self.threads_per_device))
                       for d, ms in new.items()}
        else:
            runners = {d: ProcessRunner(d, {m: self._source(d, m) for m in ms},  # type: ignore[misc]
                                        self.threads_per_device) for d, ms in new.items()}
        if runners:
            with ThreadPoolExecutor(len(runners)) as pool:
                started = {d: pool.submit(r.start) for d, r in runners.items()}
            failed = [f.exception() for f in started.values() if f.exception() is not None]
            if failed:  # stop the workers that did start; nothing is left running
                for r in runners.values():
                    r.close()
                raise failed[0]
            for d, f in started.items():
                seconds.update({f"{d}/{m}": s for m, s in f.result().items()})
        for d, runner in runners.items():
            self._runners[d] = runner
            self._loaded_on[d] = set(placed[d])
            self._device_queues[d] = queue.Queue()
            t = threading.Thread(target=self._work, args=(d,), name=f"ken-device-{d}",
                                 daemon=True)
            self._threads[d] = t
            t.start()
        for d, ms in placed.items():  # running devices that must host more models
            for m in ms:
                if m in self._loaded_on[d]:
                    continue
                done: Future = Future()
                self._device_queues[d].put(("load", m, self._source(d, m), done))
                seconds[f"{d}/{m}"] = done.result()
                self._loaded_on[d].add(m)
        return seconds

    def _check_memory(self, stop: bool = True) -> dict[str, int]:
        """Resident memory per process worker; over ``memory_budget_bytes`` an
        ``EngineError`` says which device holds what (at start, the workers are stopped). A GPU
        worker's host memory is not checked: its models live on the GPU, whose budget the
        plan kept, and its resident memory is mostly the CUDA libraries."""
        rss = {d: b for d, r in self._runners.items()
               if gpu_index(d) is None and (b := r.rss_bytes()) is not None}
        budget = self.memory_budget_bytes
        over = {d: b for d, b in rss.items() if budget is not None and b > budget}
        if over and stop:  # nothing is left running
            for q in self._device_queues.values():
                q.put(_STOP)
            for r in self._runners.values():
                r.close()
            self._runners.clear()
        if over:
            detail = "; ".join(f"{d} holds {b / 2**20:,.0f} MB with "
                               f"{', '.join(sorted(self._loaded_on[d]))}"
                               for d, b in over.items())
            raise EngineError(f"over the memory budget of {budget / 2**20:,.0f} MB per device: "
                              f"{detail}; give the devices more memory or plan with less")
        return rss

    def shutdown(self, drain: bool = True, timeout_s: float | None = None) -> int:
        """Stop accepting requests and restarting workers. With ``drain``, wait (up to
        ``timeout_s``, default ``drain_timeout_s``) for admitted requests to finish; whatever
        is still queued or running then ends ``cancelled``. Returns how many were cancelled.
        Safe to call twice and from any thread."""
        with self._shutdown_lock:
            with self._lock:
                self._accepting = False
            if self._scheduler is None:
                self._forget_sigterm()
                return 0
            self._closing = True
            for r in self._runners.values():
                r.closing = True  # a worker that dies now is not restarted
            wait_s = self.drain_timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + wait_s
            if drain:
                while self._requests and time.monotonic() < deadline:
                    time.sleep(0.005)
            done: Future = Future()
            self._events.put(("stop", done))
            while not done.done() and self._scheduler.is_alive():
                time.sleep(0.005)
            # (a scheduler that died of a bug cannot cancel: do it here, nothing is lost)
            cancelled = done.result() if done.done() else self._cancel_queued()
            self._scheduler.join(timeout=5.0)
            for q in self._device_queues.values():
                q.put(_STOP)
            for t in self._threads.values():
                t.join(timeout=2.0)
            for r in self._runners.values():
                r.close()
            self._scheduler = None
            self._forget_sigterm()
            return cancelled

    def _forget_sigterm(self) -> None:
        if self._sigterm is not None and self._sigterm.restore():
            self._sigterm = None

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- plan swap --------------------------------------------------------------------------

    def swap_plan(self, plan: GearPlan, models: Mapping[str, Source] | None = None,
                  gpu_models: Mapping[str, Source] | None = None) -> int:
        """Serve ``plan`` for its operator from now on (see the module docstring); an operator
        the engine did not serve yet is added. ``models`` (``gpu_models``: for GPU devices)
        adds sources for models the old plans did not use. Models the new plan places are
        loaded on their devices first (new devices get new workers). Returns the number of
        queued rows moved to the new plan."""
        if self._scheduler is None:
            raise EngineError("the engine is not running; start() it, or pass the plan to "
                              "Engine(...)")
        if models:
            self._check_sources(models)
            self._sources.update(models)
        if gpu_models:
            self._check_sources(gpu_models)
            self._gpu_sources.update(gpu_models)
        self._check_plan(plan, self._sources, self._gpu_sources)
        self._check_gpu_workers([plan])
        self._add_devices(self._placed(plan))
        self.bulk_batch_size = max(self.bulk_batch_size, *plan.max_batch)
        self._check_memory(stop=False)  # over budget: keep serving the old plan
        done: Future = Future()
        self._events.put(("swap", plan, done))
        return done.result()

    # -- requests ---------------------------------------------------------------------------

    def submit(self, text: str | tuple[str, ...] | None, operator: str | None = None
               ) -> Future:
        """Queue one input row (online) for ``operator`` (needed when the engine serves
        several): a text, or a tuple of texts for models over several columns; the future
        resolves to its ``Outcome``."""
        if text is not None and not _is_row(text):
            raise EngineError(f"the engine answers text rows; got {type(text).__name__}")
        return self._admit([text], bulk=False, operator=self._operator(operator))[0]

    def submit_many(self, texts: Iterable[str | tuple[str, ...] | None], bulk: bool = False,
                    operator: str | None = None) -> list[Future]:
        """Queue many rows at once; ``bulk`` rows run in throughput-sized batches (see the
        module docstring) and are not bounded by ``max_in_flight``: the caller holds them."""
        return self._admit(list(texts), bulk=bulk, operator=self._operator(operator))

    def _admit(self, texts: Sequence, bulk: bool, operator: str) -> list[Future]:
        futures = []
        admitted = []
        now = self.clock.now()
        with self._lock:
            for text in texts:
                future: Future = Future()
                futures.append(future)
                rid = next(self._ids)
                if not self._accepting:
                    future.set_result(Outcome(rid, "cancelled", now, now, error=(
                        "the engine is not accepting requests (not started, or shutting "
                        "down); nothing was run")))
                elif text is None:
                    future.set_result(Outcome(rid, "null", now, now))
                elif not _is_row(text):
                    future.set_result(Outcome(rid, "error", now, now, error=(
                        f"the engine answers text rows; got {type(text).__name__}")))
                elif not bulk and len(self._requests) >= self.max_in_flight:
                    self.rejected += 1
                    future.set_result(Outcome(rid, "rejected", now, now, error=(
                        f"{self.max_in_flight} requests in flight (the engine's max_in_flight); "
                        "retry later"), retry_after_s=self.plans[operator].rate_window_s))
                else:
                    self._requests[rid] = _Request(text, future, now)
                    admitted.append(rid)
        if admitted:
            self._events.put(("bulk" if bulk else "arrive", operator, admitted))
        return futures

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    @property
    def worker_restarts(self) -> int:
        """Workers replaced so far: processes restarted after dying or being killed at a
        deadline, threads abandoned at a deadline."""
        return sum(r.restarts for r in self._runners.values())

    @property
    def failed_models(self) -> Mapping[str, str]:
        """Models marked failed (they crashed or hung ``max_crashes`` times in a row), with
        the reason their rows get."""
        return MappingProxyType(dict(self._failed_models))

    def admission_target_s(self, operator: str | None = None) -> float | None:
        """The latency target admission holds ``operator``'s online requests to; None when
        only ``max_in_flight`` bounds them (``admission="max_in_flight"``, or a plan without
        predicted latency or profiled runtimes)."""
        plan = self.plans[self._operator(operator)]
        if self.admission != "plan" or not plan.batch_runtime_s:
            return None
        return self._target_s(plan)

    @property
    def gear_switches(self) -> list[tuple[float, int, int]]:
        """``(time, from range, to range)`` for every change of cascade so far, of every
        operator in time order (across plan swaps: ranges are those of the plan active at the
        time); ``gear_switches_of(operator)`` for one."""
        return sorted(s for op in self.plans for s in self.gear_switches_of(op))

    def dispatcher(self, operator: str | None = None) -> Dispatcher:
        """The policy state of an operator's active plan (gear selector, queues), read-only
        use: diagnostics and tests."""
        return self._active[self._operator(operator)]

    def gear_switches_of(self, operator: str) -> list[tuple[float, int, int]]:
        return (self._past_switches.get(operator, [])
                + list(self._active[self._operator(operator)].gears.switches))

    def nodes(self) -> dict[str, str | None]:
        """Ray node id per device (None for local workers, or where Ray did not say)."""
        return {d: getattr(r, "node_id", None) for d, r in self._runners.items()}

    def pids(self) -> dict[str, int | None]:
        """Worker process id per device (None for thread workers)."""
        return {d: r.pid for d, r in self._runners.items()}

    # -- scheduler thread -------------------------------------------------------------------

    def _dispatchers(self) -> list[Dispatcher]:
        return [*self._active.values(), *self._retiring]

    def _schedule(self) -> None:
        while True:
            deadlines = [t for d in self._dispatchers() if (t := d.next_deadline()) is not None]
            deadline = min(deadlines) if deadlines else None
            timeout = None if deadline is None else max(deadline - self.clock.now(), 0.0)
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                self._expire()
                continue
            kind = event[0]
            if kind == "arrive":
                self._arrive(self._active[event[1]], event[2])
            elif kind == "bulk":
                disp = self._active[event[1]]
                gear = disp.plan.ranges[0].cascade
                for rid in event[2]:
                    self._bulk_enqueue(rid, disp, gear, 0)
                self._launch_bulk()
            elif kind == "done":
                self._finished(*event[1:])
            elif kind == "failed":
                self._failed(*event[1:])
            elif kind == "swap":
                self._swap(*event[1:])
            elif kind == "stop":
                event[1].set_result(self._cancel_queued())
                return
            if deadline is not None and self.clock.now() >= deadline:
                self._expire()

    def _expire(self) -> None:
        for disp in self._dispatchers():
            self._launch(disp, disp.expire())

    def _resolve(self, rid: int, status: Status, **fields: Any) -> None:
        req = self._requests.pop(rid)
        req.future.set_result(Outcome(rid, status, req.arrival_s, self.clock.now(), **fields))

    def _arrive(self, disp: Dispatcher, rids: Sequence[int]) -> None:
        """Admission (see the module docstring), then the dispatcher queues the rows. Every
        arrival is metered and routed, rejected ones too: the gear follows the offered load
        and the replicas keep their shares of it."""
        for rid in rids:
            rng = disp.arrival()
            first = disp.plan.cascade_of(rng).models[0]
            reason = self._failed_models.get(first)
            if reason is not None:
                self._resolve(rid, "error", model=first, gear=rng, error=reason)
                continue
            replica = disp.route()
            over = self._admission(disp, rid, replica)
            if over is not None:
                with self._lock:
                    self.rejected += 1
                self._resolve(rid, "rejected", gear=rng, error=over[0], retry_after_s=over[1])
                continue
            self._launch(disp, disp.admit(rid, metered=False, replica=replica))

    def _admission(self, disp: Dispatcher, rid: int, replica: int) -> tuple[str, float] | None:
        """Why request ``rid``, routed to first-stage ``replica`` of ``disp``'s plan, cannot
        be answered within the latency target, and when to retry; None when it can (or when
        admission does not follow the plan).

        Its latency is estimated as the profiled work queued on (and running on) the
        replica's devices plus its own row, plus the later stages' work that it and the rows
        queued ahead of it will bring (``_downstream_row_s``), times the slowdown measured
        while serving (``_learn_slowdown``): profiles time each model alone, and serving runs
        the same batches slower on a busy machine."""
        plan = disp.plan
        if self.admission != "plan" or not plan.batch_runtime_s:
            return None
        target = self._target_s(plan)
        if target is None:
            return None
        work = self._device_work()
        device = max(plan.placement[replica].devices, key=lambda d: work.get(d, 0.0))
        wait = work.get(device, 0.0)
        if wait <= 0.0:
            return None  # an idle replica admits whatever the target says
        row = plan.batch_seconds(replica, 1) or 0.0  # one more row costs at most a batch of 1
        raw = wait + row + (disp.queued(replica) + 1) * self._downstream_row_s(disp)
        slowdown = self._slowdown.setdefault(plan.operator, Slowdown()).value(self.clock.now())
        expected = raw * slowdown
        if expected <= target:
            if expected >= target / 2:  # near the limit: learn how far off the estimate is
                self._estimated[rid] = (plan.operator, raw)
            return None
        retry = max(expected - target, row * slowdown)
        return (f"{plan.operator}() is over capacity: its queue on {device} holds about "
                f"{wait * 1000:.0f} ms of profiled work (x{slowdown:.1f} as measured while "
                f"serving), so this request would miss the latency target of "
                f"{target * 1000:.0f} ms; retry in {retry * 1000:.0f} ms", retry)

    def _downstream_row_s(self, disp: Dispatcher) -> float:
        """Expected profiled work a row admitted now brings to the later stages of the
        current gear's cascade: per stage, the share of rows that reach it (the escalation
        rates measured while serving; every row until ``MIN_ESCALATION_ROWS`` rows of the
        stage before were answered, so a cold engine does not over-admit) times a row's
        share of a full batch of its cheapest replica."""
        plan = disp.plan
        cascade = plan.cascade_of(disp.gears.current)
        reach, total = 1.0, 0.0
        for stage, model in enumerate(cascade.models[1:]):
            rows, escalated = self._escalations.get((cascade, stage), (0, 0))
            reach *= escalated / rows if rows >= MIN_ESCALATION_ROWS else 1.0
            total += reach * min((plan.batch_seconds(r, plan.max_batch[r]) or 0.0)
                                 / plan.max_batch[r] for r in plan.replicas_of(model))
        return total

    def _count_escalations(self, plan: GearPlan, model: str, gears: Mapping[int, int],
                           escalated: Sequence[int]) -> None:
        """Count a batch's rows and escalations per (cascade, stage) of their gears."""
        up = set(escalated)
        counts: dict[tuple[Cascade, int], list[int]] = {}
        for rid, gear in gears.items():
            cascade = plan.cascade_of(gear)
            c = counts.setdefault((cascade, cascade.models.index(model)), [0, 0])
            c[0] += 1
            c[1] += rid in up
        for key, (rows, ups) in counts.items():
            before = self._escalations.get(key, (0, 0))
            self._escalations[key] = (before[0] + rows, before[1] + ups)

    def _target_s(self, plan: GearPlan) -> float | None:
        """The latency target of ``plan``'s requests: the engine's ``latency_target_s`` if
        given, else the plan's predicted p99, at least ``MIN_PLAN_TARGET_S``."""
        if self.latency_target is not None:
            return self.latency_target
        target = plan.latency_target_s()
        return None if target is None else max(target, MIN_PLAN_TARGET_S)

    def _learn_slowdown(self, rid: int, latency_s: float) -> None:
        """Add an answered request's latency over its estimate to its operator's slowdown
        (requests admitted near the limit only; ``Slowdown``)."""
        estimated = self._estimated.pop(rid, None)
        if estimated is not None:
            operator, seconds = estimated
            self._slowdown.setdefault(operator, Slowdown()).add(latency_s / seconds,
                                                                self.clock.now())

    def _device_work(self) -> dict[str, float]:
        """Profiled seconds of work each device has ahead of a new row: the rows queued on it
        (every plan's) and what is left of the batch it runs."""
        work: dict[str, float] = {}
        for disp in self._dispatchers():
            for d, seconds in (disp.queued_work_s() or {}).items():
                work[d] = work.get(d, 0.0) + seconds
        now = self.clock.now()
        for d, until in list(self._running_until.items()):
            if until > now:
                work[d] = work.get(d, 0.0) + until - now
        return work

    def _launch(self, disp: Dispatcher, batches: Iterable[Batch]) -> None:
        for b in batches:
            self._owner[id(b)] = disp
            self._device_queues[b.devices[0]].put(
                ("run", b, disp.plan.batch_seconds(b.replica, len(b.request_ids))))

    def _freed(self, devices: tuple[str, ...]) -> None:
        """Devices came free: online queues first, then bulk rows."""
        for disp in self._dispatchers():
            self._launch(disp, disp.poll(devices))
        self._launch_bulk()
        self._retiring = [d for d in self._retiring if d.in_flight]

    def _finished(self, batch: Batch | _BulkBatch, values: list, scores: np.ndarray) -> None:
        self._attempts.pop(id(batch), None)
        self._crashes.pop(batch.model, None)  # it ran: crashes are no longer "in a row"
        if isinstance(batch, _BulkBatch):
            self._bulk_finished(batch, values, scores)
            return
        disp = self._owner.pop(id(batch))
        certs = certainty_of(scores, disp.plan.certainty)
        gears = {rid: disp.range_of(rid) for rid in batch.request_ids}
        fin = disp.finish(batch, certs)
        self._count_escalations(disp.plan, batch.model, gears, fin.escalated)
        now = self.clock.now()
        row = {rid: j for j, rid in enumerate(batch.request_ids)}
        for rid, stage in zip(fin.resolved, fin.resolved_stages, strict=True):
            req = self._requests.pop(rid)
            j = row[rid]
            req.future.set_result(Outcome(rid, "ok", req.arrival_s, now, values[j],
                                          float(certs[j]), stage, batch.model, gears[rid]))
            self._learn_slowdown(rid, now - req.arrival_s)
        self._launch(disp, fin.started)
        self._freed(batch.devices)

    def _failed(self, batch: Batch | _BulkBatch, message: str, crashed: bool,
                expected_s: float | None) -> None:
        """A model call raised (``crashed``: or its worker died or hung): run the batch once
        more on the replaced worker, else end its rows in error."""
        model = batch.model
        if crashed and model not in self._failed_models:
            crashes = self._crashes[model] = self._crashes.get(model, 0) + 1
            if crashes >= self.max_crashes:
                self._failed_models[model] = (
                    f"{model} is marked failed: it crashed or hung its worker {crashes} times "
                    f"in a row (last: {message}); the engine does not run it again: fix the "
                    "model and serve again")
        failed = self._failed_models.get(model)
        attempts = self._attempts.get(id(batch), 0) + 1
        self._attempts[id(batch)] = attempts
        for rid in batch.request_ids:  # a failed attempt says nothing about queueing
            self._estimated.pop(rid, None)
        if attempts <= self.max_retries and failed is None:
            # run the same batch again (the device stays busy)
            self._device_queues[batch.devices[0]].put(("run", batch, expected_s))
            return
        del self._attempts[id(batch)]
        now = self.clock.now()
        error = failed or f"{model} failed {attempts} times: {message}"
        if isinstance(batch, _BulkBatch):
            for d in batch.devices:
                self._busy.discard(d)
            for rid in batch.request_ids:
                self._bulk_rows.pop(rid, None)
                req = self._requests.pop(rid)
                req.future.set_result(Outcome(rid, "error", req.arrival_s, now,
                                              model=batch.model, error=error))
            self._freed(batch.devices)
            return
        disp = self._owner.pop(id(batch))
        gears = {rid: disp.range_of(rid) for rid in batch.request_ids}
        # resolve every row (certainty +inf never escalates) to free the devices
        fin = disp.finish(batch, [np.inf] * len(batch.request_ids))
        for rid in fin.resolved:
            self._estimated.pop(rid, None)
            req = self._requests.pop(rid)
            req.future.set_result(Outcome(rid, "error", req.arrival_s, now, model=batch.model,
                                          gear=gears[rid], error=error))
        self._launch(disp, fin.started)
        self._freed(batch.devices)

    def _swap(self, plan: GearPlan, done: Future) -> None:
        op = plan.operator
        old = self._active.get(op)
        moved: list[int] = []
        if old is not None:
            self._past_switches.setdefault(op, []).extend(old.gears.switches)
            moved = sorted(old.drain())  # request ids grow with arrival: oldest first
            if old.in_flight:
                self._retiring.append(old)
        new = Dispatcher(plan, self.clock, self._busy)
        self._active[op] = new
        self.plans[op] = plan
        for rid in moved:
            self._launch(new, new.admit(rid, metered=False))
        self._launch(new, new.poll(plan.devices))
        self.plan_swaps.append((self.clock.now(), len(moved)))
        done.set_result(len(moved))

    # -- bulk rows --------------------------------------------------------------------------

    def _bulk_enqueue(self, rid: int, disp: Dispatcher, cascade: int, stage: int) -> None:
        self._bulk_rows[rid] = (disp, cascade, stage)
        model = disp.escalation.models[cascade][stage]
        self._bulk_queue.setdefault(model, deque()).append(rid)

    def _bulk_devices(self, model: str) -> list[str]:
        placed = list(dict.fromkeys(d for plan in self.plans.values()
                                    for r in plan.replicas_of(model)
                                    for d in plan.placement[r].devices))
        return placed or [d for d, ms in self._loaded_on.items() if model in ms]

    def _launch_bulk(self) -> None:
        for model, q in self._bulk_queue.items():
            for device in self._bulk_devices(model):
                if not q:
                    break
                if device in self._busy:
                    continue
                ids = tuple(q.popleft() for _ in range(min(len(q), self.bulk_batch_size)))
                self._busy.add(device)
                self._device_queues[device].put(("run", _BulkBatch(model, (device,), ids),
                                                 self._bulk_seconds(model, device, len(ids))))

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

    def _bulk_finished(self, batch: _BulkBatch, values: list, scores: np.ndarray) -> None:
        for d in batch.devices:
            self._busy.discard(d)
        now = self.clock.now()
        certs: dict[str, np.ndarray] = {}  # certainty kind -> this batch's certainties
        for j, rid in enumerate(batch.request_ids):
            disp, cascade, stage = self._bulk_rows[rid]
            kind = disp.plan.certainty
            if kind not in certs:
                certs[kind] = certainty_of(scores, kind)
            cert = float(certs[kind][j])
            if disp.escalation.escalates(cascade, stage, cert):  # the dispatcher's rule
                self._bulk_enqueue(rid, disp, cascade, stage + 1)
                continue
            del self._bulk_rows[rid]
            req = self._requests.pop(rid)
            req.future.set_result(Outcome(rid, "ok", req.arrival_s, now, values[j], cert, stage,
                                          batch.model, None))
        self._freed(batch.devices)

    def _cancel_queued(self) -> int:
        """At shutdown: every request still queued or running ends ``cancelled`` (a running
        batch's late result is ignored)."""
        now = self.clock.now()
        for disp in self._dispatchers():
            disp.drain()
        self._bulk_queue.clear()
        self._bulk_rows.clear()
        self._estimated.clear()
        with self._lock:
            left = list(self._requests.items())
            self._requests.clear()
        for rid, req in left:
            req.future.set_result(Outcome(rid, "cancelled", req.arrival_s, now,
                                          error="the engine shut down before it ran"))
        return len(left)

    # -- device workers ---------------------------------------------------------------------

    def _work(self, device: str) -> None:
        q = self._device_queues[device]
        runner = self._runners[device]
        idle_since = self.clock.now()
        while True:
            item = q.get()
            if item is _STOP:
                return
            if item[0] == "load":
                _, name, source, done = item
                try:
                    done.set_result(runner.load(name, source))
                except Exception as exc:  # noqa: BLE001 - handed to swap_plan's caller
                    done.set_exception(exc)
                continue
            _, batch, expected_s = item
            failed = self._failed_models.get(batch.model)
            if failed is not None:  # not run again: its rows end in error at once
                self._events.put(("failed", batch, failed, False, expected_s))
                continue
            try:
                texts = [self._requests[rid].text for rid in batch.request_ids]
            except KeyError:  # cancelled by shutdown while queued here
                continue
            started = self.clock.now()
            if expected_s is not None:
                self._running_until[device] = started + expected_s
            try:
                values, scores = runner.run(batch.model, texts, self.deadline.seconds(expected_s))
            except Exception as exc:  # noqa: BLE001 - this thread must never die with a batch
                self._running_until.pop(device, None)
                self.failed_attempts += 1
                self.timeouts += isinstance(exc, BatchTimeout)
                message = str(exc) if isinstance(exc, WorkerError) else \
                    f"{type(exc).__name__}: {exc}"
                self._events.put(("failed", batch, message,
                                  isinstance(exc, WorkerDied | BatchTimeout), expected_s))
                continue
            self._running_until.pop(device, None)
            idle_since, idle_s = self.clock.now(), started - idle_since
            self.batch_log.append(BatchRecord(device, batch.model, len(texts), started,
                                              idle_since, idle_s,
                                              isinstance(batch, _BulkBatch)))
            if len(self.batch_log) > self.batch_log_limit:
                del self.batch_log[: len(self.batch_log) // 2]
            self._events.put(("done", batch, values, scores))
