"""Worker supervision of the online engine (DESIGN.md section 14): the device workers that run
batches, their deadlines, retries, the crash-loop breaker, restarts and memory checks.

- ``DevicePool``: one *device worker* per device — its own process by default
  (``ProcessRunner``), a thread of this process for models given already loaded
  (``ThreadRunner``), or a Ray actor (``RayRunner``) — fed by a queue that a thread of this
  process reads, one batch at a time. Each batch runs under a deadline (``BatchDeadline``:
  from its profiled runtime, else from what its model's calls took while serving,
  ``ObservedRuntimes``, else a first-call bound); a worker that dies or misses it is
  replaced by its runner (``workers.py``); one found dead while its device is idle is replaced
  at once (looked for every ``IDLE_CHECK_S``, and before each batch), as is one whose
  failed batch the scheduler moved to another replica (``revive``). What a batch did is
  reported as an event: ``("done", batch, values, scores, record)`` (its ``BatchRecord``,
  which the scheduler completes and logs, ``log_call``),
  ``("failed", batch, message, crashed, expected_s, never_returned)``, or
  ``("unrun", batch)`` when an online batch reached a worker process found dead before it
  ran (the scheduler runs its rows elsewhere; a bulk batch waits for the fresh worker); a
  replacement, or a model a swapped-in plan loads on a running worker, as
  ``("reloading", devices)`` (with an event the scheduler sets once it routes around them,
  for the load) then ``("reloaded", devices)``.
- ``Breaker``: whether a failed batch runs again (``max_retries``) and which models are
  marked failed: after ``max_crashes`` crashes or hangs in a row, or at once when a batch of
  a model that never returned a call spent its retries past the first-call bound.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Protocol

from ken.engine.bulk import BulkBatch
from ken.engine.ray_runner import RayCluster, RayRunner
from ken.engine.workers import (
    ProcessRunner,
    ThreadRunner,
    WorkerDied,
    WorkerError,
    gpu_index,
)
from ken.errors import BatchTimeout, EngineError
from ken.models.gpus import Gpu, gpu_budget_bytes
from ken.models.model import Model
from ken.policy.plan import GearPlan
from ken.policy.scheduling import WallClock

#: how often an idle device thread looks whether its worker process died (seconds)
IDLE_CHECK_S = 0.25
#: idle deaths further apart than this (seconds) do not count as in a row
IDLE_DEATHS_FORGET_S = 60.0
#: how long a load for a swapped-in plan waits for the scheduler to route around its device
ANNOUNCE_WAIT_S = 5.0

Source = Model | Callable[[], Model]
Workers = Literal["process", "thread", "ray"]
_STOP = object()


class RunnableBatch(Protocol):
    """A batch the device workers run: the dispatcher's ``Batch`` or a ``BulkBatch``."""

    model: str
    devices: tuple[str, ...]
    request_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadReport:
    """Models loaded (and warmed up) before serving: seconds per (device, model), and wall
    time in total."""

    seconds: Mapping[str, float]
    total_s: float
    workers: str  # "process" | "thread"
    rss_bytes: Mapping[str, int] = field(default_factory=dict)  # per process worker, loaded
    # per GPU device: the most GPU memory its worker's allocator reserved (loading included)
    gpu_bytes: Mapping[str, int] = field(default_factory=dict)


#: model calls an engine keeps in ``batch_log`` (calibration and the fidelity replays use
#: well under it: a 60-s replay at 500 calls/s is 30,000)
BATCH_LOG = 50_000


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One model call as a device ran it (engine clock; includes the worker round trip), and
    how long the engine held the device around it: from the dispatcher starting the batch to
    the call (``handoff_s``: the device's thread taking it), and from the call's answer to the
    scheduler taking it in (``report_s``: the event queue). The device counts as busy to the
    dispatcher for all of it (``held_s``), which is what the simulator charges a batch."""

    device: str
    model: str
    rows: int
    start_s: float
    end_s: float
    idle_before_s: float  # how long the device had been idle before this call
    bulk: bool = False
    largest: int = 0  # its largest row's size (``Model.row_sizes``), which its runtime grows with
    handoff_s: float = 0.0  # online batches: dispatcher start to this call's start
    report_s: float = 0.0  # this call's end to the scheduler taking its answer in

    @property
    def seconds(self) -> float:
        """The call itself (the worker round trip)."""
        return self.end_s - self.start_s

    @property
    def held_s(self) -> float:
        """The device held for the batch: hand-off, call, report."""
        return self.handoff_s + self.end_s - self.start_s + self.report_s


@dataclass(frozen=True)
class BatchDeadline:
    """How long a batch may run: ``factor`` times what it is expected to take, at least
    ``floor_s``. Expected is its profiled runtime when the plan carries runtimes; else what
    its model was seen to take while serving (``ObservedRuntimes``: a plan written by hand, a
    user's model); ``first_call_s`` while no call of the model has returned yet.

    10x leaves room for what serving adds to a profile (the worker round trip, a device that
    idled, a long row; benchmarks/e2e measured serving calls at 1.0-1.2x their profile at the
    median); the 2 s floor keeps a busy machine's stalls (page faults, another process on the
    core) from killing a healthy worker, whose restart costs more than the wait.

    ``first_call_s`` = 20 s: models are loaded and warmed up before serving starts (a
    restarted worker loads before its clock starts too), so a first call pays only its own
    work and what a model does lazily on its first real batch (allocator and kernel choice,
    caches, pages of mapped weights): 20 s leaves room for that on a large user model on a
    busy machine, and bounds a model that never returns at 2 x 20 s (the batch is retried
    once; then the model is marked failed, so a query's later batches of it fail at once)
    rather than the two minutes of the old 60-s default. A model known to take longer
    on its first batch needs ``BatchDeadline(first_call_s=...)`` (``Engine(deadline=)``,
    ``Session.serve(deadline=)``) or a profile.
    """

    factor: float = 10.0
    floor_s: float = 2.0
    first_call_s: float = 20.0

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) and v > 0
                   for v in (self.factor, self.floor_s, self.first_call_s)):
            raise EngineError("a batch deadline needs a factor, a floor and a first-call "
                              "bound that are finite and > 0")

    def seconds(self, profiled_s: float | None, observed_s: float | None = None) -> float:
        """The deadline of a batch profiled at ``profiled_s`` (None: not profiled) whose
        model was seen to take ``observed_s`` on such a batch (None: never returned yet)."""
        return self.explain(profiled_s, observed_s)[0]

    def explain(self, profiled_s: float | None, observed_s: float | None = None
                ) -> tuple[float, str]:
        """``seconds``, and where the figure comes from (for the error of a batch past it)."""
        for expected, what in ((profiled_s, "profiled"), (observed_s, "observed")):
            if expected is not None:
                bound = max(self.factor * expected, self.floor_s)
                return bound, (f"{self.factor:g}x its {what} {expected:.3g} s a batch, at "
                               f"least {self.floor_s:g} s")
        return self.first_call_s, ("the first-call bound: no call of it had returned yet; "
                                   "set it with BatchDeadline(first_call_s=...)")


class ObservedRuntimes:
    """Seconds the completed calls of each model took while serving (the latest ``window``
    per model), for the deadlines of models without profiled runtimes. Called from every
    device thread, hence the lock."""

    def __init__(self, window: int = 32) -> None:
        self.window = window
        self._calls: dict[str, deque[tuple[int, float]]] = {}  # model -> (rows, seconds)
        self._lock = threading.Lock()

    def add(self, model: str, rows: int, seconds: float) -> None:
        with self._lock:
            calls = self._calls.setdefault(model, deque(maxlen=self.window))
            calls.append((max(rows, 1), max(seconds, 0.0)))

    def expected_s(self, model: str, rows: int) -> float | None:
        """What a call of ``model`` on ``rows`` rows is expected to take: the slowest recent
        call, scaled up linearly to ``rows`` where it had fewer (a batch costs at most that;
        batching makes rows cheaper, not dearer); None before any call returned."""
        with self._lock:
            calls = list(self._calls.get(model, ()))
        if not calls:
            return None
        return max(s * max(1.0, rows / r) for r, s in calls)


class Breaker:
    """Retries of failed batches and the crash-loop breaker: a batch that failed runs again
    up to ``max_retries`` times; a model whose calls crash or hang their worker
    ``max_crashes`` times in a row is marked failed (its rows then end in error at once)."""

    def __init__(self, max_retries: int = 1, max_crashes: int = 3,
                 crash: str = "crashed or hung its worker") -> None:
        """``crash``: what a crash is, for the reason a model is marked failed (a decode
        server's is a forward pass that failed for every request in it)."""
        if max_retries < 0 or max_crashes < 1:
            raise EngineError("max_crashes must be >= 1 and max_retries >= 0")
        self.max_retries = max_retries
        self.max_crashes = max_crashes
        self.crash = crash
        self._attempts: dict[int, int] = {}  # id(batch) -> failed attempts
        self._crashes: dict[str, int] = {}  # model -> crashes or hangs in a row
        self._failed: dict[str, str] = {}  # model -> why it is not run any more

    @property
    def failed_models(self) -> Mapping[str, str]:
        """Models marked failed, with the reason their rows get."""
        return MappingProxyType(dict(self._failed))

    def reason(self, model: str) -> str | None:
        """Why ``model`` is not run any more (None: it is)."""
        return self._failed.get(model)

    def ran(self, batch: RunnableBatch) -> None:
        """``batch`` ran: its model's crashes are no longer "in a row"."""
        self._attempts.pop(id(batch), None)
        self._crashes.pop(batch.model, None)

    def failed(self, batch: RunnableBatch, message: str, crashed: bool,
               never_returned: bool = False) -> str | None:
        """An attempt of ``batch`` raised (``crashed``: or its worker died or hung), and the
        same batch would run again in place. None: run it again; else the error its rows end
        with. ``never_returned``: it hung past the first-call bound, no call of its model
        having ever returned; when its retries are spent too the model is marked failed at
        once (the next batch would only wait the bound again), not after ``max_crashes``."""
        self._count(batch.model, message, crashed)
        attempts = self._attempts.get(id(batch), 0) + 1
        self._attempts[id(batch)] = attempts
        error = self._verdicts(batch.model, message, [attempts], never_returned)[0]
        if error is not None:
            del self._attempts[id(batch)]
        return error

    def forget(self, batch: RunnableBatch) -> int:
        """``batch`` leaves without running again (its rows go on in other batches): its
        failed attempts so far (run again in place), which the caller carries per row."""
        return self._attempts.pop(id(batch), 0)

    def failed_rows(self, batch: RunnableBatch, message: str, crashed: bool,
                    never_returned: bool, attempts: Sequence[int]) -> list[str | None]:
        """An attempt of ``batch`` raised, as in ``failed``, and its rows run again in other
        batches (a process worker that died or hung: they do not wait in this batch for its
        reload). ``attempts``: each row's failed attempts, this one included. Per row: None
        (it runs again) or the error it ends with."""
        self._count(batch.model, message, crashed)
        self._attempts.pop(id(batch), None)
        return self._verdicts(batch.model, message, attempts, never_returned)

    def _count(self, model: str, message: str, crashed: bool) -> None:
        """A crash or hang of ``model`` in a row; at ``max_crashes`` it is marked failed."""
        if crashed and model not in self._failed:
            crashes = self._crashes[model] = self._crashes.get(model, 0) + 1
            if crashes >= self.max_crashes:
                self._failed[model] = (
                    f"{model} is marked failed: it {self.crash} {crashes} times "
                    f"in a row (last: {message}); the engine does not run it again: fix the "
                    "model and serve again")

    def _verdicts(self, model: str, message: str, attempts: Sequence[int],
                  never_returned: bool) -> list[str | None]:
        spent = [a for a in attempts if a > self.max_retries]
        if spent and never_returned and model not in self._failed:
            self._failed[model] = (
                f"{model} failed {max(spent)} times: {message}; no call of it has ever "
                "returned, so it is marked failed and not run again: fix the model, or give "
                "its first batch more time with BatchDeadline(first_call_s=...), and serve "
                "again")
        failed = self._failed.get(model)
        return [failed if failed is not None else
                None if a <= self.max_retries else f"{model} failed {a} times: {message}"
                for a in attempts]


class DevicePool:
    """The device workers of an engine and the models they host (see the module docstring).

    ``workers``: ``"process"`` needs picklable loaders (each device process loads its own
    copy); ``"thread"`` loads each model once in this process and shares it; ``"ray"`` runs
    each device as a Ray actor on ``ray_cluster`` (default: a local Ray started for this
    process). ``texts_of(batch)`` gives a batch's input rows (None: its requests were
    cancelled); ``report(event)`` receives what each batch did."""

    def __init__(self, workers: Workers, threads_per_device: int, clock: WallClock,
                 deadline: BatchDeadline, breaker: Breaker,
                 texts_of: Callable[[RunnableBatch], list | None],
                 report: Callable[[tuple], None], ray_cluster: RayCluster | None = None
                 ) -> None:
        if threads_per_device < 1:
            raise EngineError("a device needs at least one thread")
        self.workers = workers
        self.threads_per_device = threads_per_device
        self.clock = clock
        self.deadline = deadline
        self.breaker = breaker
        self.ray_cluster = ray_cluster
        self._texts_of = texts_of
        self._report = report
        self._sources: dict[str, Source] = {}
        self._gpu_sources: dict[str, Source] = {}
        self._models: dict[str, Model] = {}  # thread workers share these
        self._queues: dict[str, queue.Queue] = {}
        self._runners: dict[str, ThreadRunner | ProcessRunner | RayRunner] = {}
        self._loaded_on: dict[str, set[str]] = {}  # device -> models loaded there
        self._threads: dict[str, threading.Thread] = {}
        self._running_until: dict[str, float] = {}  # device -> profiled end of its batch
        # the latest model calls (bounded: the oldest half is dropped at the limit; a record
        # holds about 200 bytes, so the log holds at most about 10 MB: 200,000 held 40 MB,
        # which an hour's soak took 45 minutes to fill)
        self.batch_log: list[BatchRecord] = []
        self.batch_log_limit = BATCH_LOG
        self.observed = ObservedRuntimes()  # what each model's calls took while serving
        self._loading: set[str] = set()  # devices loading a model for a swapped-in plan
        self.failed_attempts = 0  # model calls that raised, hung or whose worker died
        self.idle_deaths = 0  # worker processes found dead between batches (and replaced)
        self.revive_errors: list[str] = []  # the latest replacements of those that failed
        self.timeouts = 0  # batches that ran past their deadline

    # -- sources and plans ------------------------------------------------------------------

    def add_sources(self, models: Mapping[str, Source] | None,
                    gpu_models: Mapping[str, Source] | None = None) -> None:
        """What loads each model: on CPU devices (``models``) and GPUs (``gpu_models``)."""
        for given, into in ((models, self._sources), (gpu_models, self._gpu_sources)):
            if not given:
                continue
            if self.workers in ("process", "ray") and any(isinstance(s, Model)
                                                          for s in given.values()):
                raise EngineError(f"{self.workers} workers load their own models: pass "
                                  "loaders (zero-argument functions), not loaded models, or "
                                  "use workers='thread'")
            into.update(given)

    def check_plans(self, plans: Sequence[GearPlan]) -> None:
        """Every model the plans place has a source for its devices, on devices these
        workers can serve."""
        for plan in plans:
            on_gpu = {r.model for r in plan.placement if any(gpu_index(d) is not None
                                                             for d in r.devices)}
            on_cpu = {r.model for r in plan.placement if any(gpu_index(d) is None
                                                             for d in r.devices)}
            missing = sorted(on_cpu - set(self._sources))
            if missing:
                raise EngineError(f"the plan places {missing} but no model was given for them")
            missing = sorted(on_gpu - set(self._gpu_sources))
            if missing:
                raise EngineError(f"the plan places {missing} on GPUs but no GPU loader was "
                                  "given for them (gpu_models=: loaders that load on cuda:0, "
                                  "the one GPU each worker process sees)")
            if any(r.degree > 1 for r in plan.placement):
                raise EngineError("tensor-parallel replicas need a GPU backend; this engine "
                                  "runs one replica per CPU worker")
        gpus = sorted({d for p in plans for d in p.devices if gpu_index(d) is not None})
        if gpus and self.workers == "thread":
            raise EngineError(f"the plan places models on GPUs ({', '.join(gpus)}): GPU devices "
                              "are served by worker processes (one per GPU) or Ray actors, not "
                              "threads; pass loaders and workers='process'")

    def _source(self, device: str, model: str) -> Source:
        """What loads ``model`` on ``device``: a GPU's loader for GPU devices."""
        return (self._sources if gpu_index(device) is None else self._gpu_sources)[model]

    # -- workers ----------------------------------------------------------------------------

    def add(self, placed: Mapping[str, list[str]]) -> dict[str, float]:
        """Start workers for devices not served yet (loading their models, in parallel) and
        load models new to running devices. Seconds per ``device/model``."""
        seconds: dict[str, float] = {}
        new = {d: ms for d, ms in placed.items() if d not in self._runners}
        if self.workers == "thread":
            for name in sorted({m for ms in placed.values() for m in ms} - set(self._models)):
                src = self._sources[name]
                t = time.perf_counter()
                self._models[name] = src if isinstance(src, Model) else src()
                self._models[name].warm_up()
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
            self._queues[d] = queue.Queue()
            t = threading.Thread(target=self._work, args=(d,), name=f"ken-device-{d}",
                                 daemon=True)
            self._threads[d] = t
            t.start()
        for d, ms in placed.items():  # running devices that must host more models
            for m in ms:
                if m in self._loaded_on[d]:
                    continue
                seconds[f"{d}/{m}"] = self._load_on_running(d, m)
                self._loaded_on[d].add(m)
        return seconds

    def _load_on_running(self, device: str, model: str) -> float:
        """Load ``model`` on the running ``device`` (a swapped-in plan adds it), between its
        batches; seconds. Admission routes around the device meanwhile (``loading``), and the
        scheduler, told before the load is queued, starts no batch there (it would wait
        behind the load) and moves the rows queued or escalated there. An engine that shuts
        down meanwhile ends the wait with an ``EngineError``."""
        done: Future = Future()
        self._loading.add(device)
        told = threading.Event()
        try:
            self._report(("reloading", (device,), told))
            told.wait(ANNOUNCE_WAIT_S)  # a scheduler that stopped never answers
            self._queues[device].put(("load", model, self._source(device, model), done))
            while True:
                try:
                    return done.result(timeout=0.5)
                except FutureTimeout:
                    if not self._threads[device].is_alive():  # stopped: nobody loads it
                        raise EngineError(f"the engine shut down while {device} was loading "
                                          f"{model} for a new plan") from None
        finally:
            self._loading.discard(device)
            self._report(("reloaded", (device,)))

    def check_memory(self, budget: int | None, stop: bool = True,
                     gpu_budget: int | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """Memory per worker: (resident memory of each CPU device's process, peak GPU memory
        each GPU device's worker reserved). A CPU device over ``budget``, or a GPU device over
        ``gpu_budget`` (default: ``gpus.gpu_budget_bytes``, what a plan may place on it),
        raises an ``EngineError`` that says which device holds what (with ``stop``, the
        workers are stopped first). A GPU worker's host memory is not checked: its models live
        on the GPU, and its resident memory is mostly the CUDA libraries."""
        rss = {d: b for d, r in self._runners.items()
               if gpu_index(d) is None and (b := r.rss_bytes()) is not None}
        on_gpu = {d: u for d, r in self._runners.items()
                  if gpu_index(d) is not None and (u := r.gpu_usage()) is not None}
        over = [f"{d} holds {b / 2**20:,.0f} MB with {', '.join(sorted(self._loaded_on[d]))}, "
                f"over the memory budget of {budget / 2**20:,.0f} MB per device"
                for d, b in rss.items() if budget is not None and b > budget]
        for d, (held, total) in on_gpu.items():
            allowed = gpu_budget if gpu_budget is not None else \
                gpu_budget_bytes(Gpu(gpu_index(d) or 0, d, total))
            if held > allowed:
                over.append(f"{d}'s worker reserved {held / 2**20:,.0f} MB of GPU memory with "
                            f"{', '.join(sorted(self._loaded_on[d]))}, over its budget of "
                            f"{allowed / 2**20:,.0f} MB (the GPU has {total / 2**20:,.0f} MB)")
        if over and stop:  # nothing is left running
            for q in self._queues.values():
                q.put(_STOP)
            for r in self._runners.values():
                r.close()
            self._runners.clear()
        if over:
            raise EngineError(f"{'; '.join(over)}: give the devices more memory or plan with "
                              "less")
        return rss, {d: held for d, (held, _) in on_gpu.items()}

    def run(self, batch: RunnableBatch, expected_s: float | None) -> None:
        """Queue ``batch`` on its first device (``expected_s``: its profiled runtime)."""
        self._queues[batch.devices[0]].put(("run", batch, expected_s))

    def log_call(self, record: BatchRecord) -> None:
        """Keep a finished call in ``batch_log`` (the scheduler, when it takes the answer in,
        with the hand-off and report times; a call whose answer comes after the scheduler
        stopped, at shutdown, is not logged)."""
        self.batch_log.append(record)
        if len(self.batch_log) > self.batch_log_limit:
            del self.batch_log[: len(self.batch_log) // 2]

    def models_on(self, device: str) -> frozenset[str]:
        """The models ``device`` hosts."""
        return frozenset(self._loaded_on.get(device, ()))

    def revivable(self, device: str) -> bool:
        """Whether ``device``'s worker is a process or a Ray actor that ``revive`` replaces
        (or reloads, after Ray restarted it) between batches (a thread worker has nothing to
        reload)."""
        return isinstance(self._runners.get(device), ProcessRunner | RayRunner)

    def revive(self, device: str) -> None:
        """Replace ``device``'s worker, which died or was killed with a batch that now runs
        elsewhere: reported as ``("reloading", (device,))`` then ``("reloaded", (device,))``
        (see ``_revive``), in turn with what else is queued there."""
        self._queues[device].put(("revive",))

    def hosts(self, model: str) -> list[str]:
        """Devices that have ``model`` loaded."""
        return [d for d, ms in self._loaded_on.items() if model in ms]

    def loading(self) -> set[str]:
        """Devices loading models now: a worker process started afresh (or a Ray actor
        reloading its models after a restart), or a model a swapped-in plan adds to a running
        device (the load runs between its batches: seconds in which
        the rows queued there wait)."""
        return {d for d, r in list(self._runners.items()) if r.restarting} | set(self._loading)

    def running_work(self) -> dict[str, float]:
        """Profiled seconds left of the batch each busy device runs."""
        now = self.clock.now()
        return {d: until - now for d, until in list(self._running_until.items()) if until > now}

    def closing(self) -> None:
        """The engine shuts down: a worker that dies from now on is not restarted."""
        for r in self._runners.values():
            r.closing = True

    def close(self) -> None:
        """Stop the device threads and their workers."""
        for q in self._queues.values():
            q.put(_STOP)
        for t in self._threads.values():
            t.join(timeout=2.0)
        for r in self._runners.values():
            r.close()

    @property
    def restarts(self) -> int:
        """Workers replaced so far: processes restarted after dying or being killed at a
        deadline, threads abandoned at a deadline."""
        return sum(r.restarts for r in self._runners.values())

    def pids(self) -> dict[str, int | None]:
        return {d: r.pid for d, r in self._runners.items()}

    def nodes(self) -> dict[str, str | None]:
        return {d: getattr(r, "node_id", None) for d, r in self._runners.items()}

    def _work(self, device: str) -> None:
        q = self._queues[device]
        runner = self._runners[device]
        idle_since = self.clock.now()
        idle_deaths = 0  # deaths found between batches since this device last ran one
        last_death = -math.inf

        def replaced_if_dead(first: tuple | None = None) -> bool:
            """Replace a worker that died between batches (reporting ``first`` before);
            one that dies again and again without running a batch is left to the next batch
            and the breaker. Whether it was replaced."""
            nonlocal idle_deaths, last_death
            if self.clock.now() - last_death > IDLE_DEATHS_FORGET_S:
                idle_deaths = 0  # deaths this far apart are not a crash loop
            if idle_deaths >= self.breaker.max_crashes or (code := runner.died_idle()) is None:
                return False
            idle_deaths += 1
            if first is not None:
                self._report(first)
            self._revive(device, runner, code)
            last_death = self.clock.now()
            return True

        while True:
            try:
                item = q.get(timeout=IDLE_CHECK_S)
            except queue.Empty:
                # a worker killed while idle is replaced now, not by the next batch sent to it
                # (whose rows would wait for the reload)
                replaced_if_dead()
                continue
            if item is _STOP:
                return
            if item[0] == "revive":
                self._revive(device, runner, None)
                continue
            if item[0] == "load":
                _, name, source, done = item
                try:
                    done.set_result(runner.load(name, source))
                except Exception as exc:  # noqa: BLE001 - handed to swap_plan's caller
                    done.set_exception(exc)
                continue
            _, batch, expected_s = item
            failed = self.breaker.reason(batch.model)
            if failed is not None:  # not run again: its rows end in error at once
                self._report(("failed", batch, failed, False, expected_s, False))
                continue
            texts = self._texts_of(batch)
            if texts is None:  # cancelled by shutdown while queued here
                continue
            # killed between batches and found by this batch before the idle check: an online
            # batch goes back unrun (its rows run elsewhere meanwhile, no attempt counted)
            # rather than wait in ``runner.run`` for a fresh worker to load its models; a bulk
            # batch waits for it, with the device announced as reloading (so the online rows
            # queued or escalated there move meanwhile)
            online = not isinstance(batch, BulkBatch)
            if replaced_if_dead(("unrun", batch) if online else None) and online:
                continue
            started = self.clock.now()
            if expected_s is not None:
                self._running_until[device] = started + expected_s
            observed_s = self.observed.expected_s(batch.model, len(texts))
            timeout_s, why = self.deadline.explain(expected_s, observed_s)
            try:
                values, scores, largest = runner.run(batch.model, texts, timeout_s)
            except Exception as exc:  # noqa: BLE001 - this thread must never die with a batch
                self._running_until.pop(device, None)
                self.failed_attempts += 1
                self.timeouts += isinstance(exc, BatchTimeout)
                message = str(exc) if isinstance(exc, WorkerError) else \
                    f"{type(exc).__name__}: {exc}"
                never = isinstance(exc, BatchTimeout) and expected_s is None \
                    and observed_s is None  # past the first-call bound
                if isinstance(exc, BatchTimeout):
                    message += f" (the deadline: {why})"
                self._report(("failed", batch, message,
                              isinstance(exc, WorkerDied | BatchTimeout), expected_s, never))
                continue
            self._running_until.pop(device, None)
            idle_deaths = 0
            idle_since, idle_s = self.clock.now(), started - idle_since
            self.observed.add(batch.model, len(texts), idle_since - started)
            record = BatchRecord(device, batch.model, len(texts), started, idle_since,
                                 idle_s, isinstance(batch, BulkBatch), largest)
            self._report(("done", batch, values, scores, record))  # logged when taken in

    def _revive(self, device: str, runner: ProcessRunner | ThreadRunner | RayRunner,
                code: int | None) -> None:
        """Replace ``device``'s worker process (or reload the models of its Ray actor, which
        Ray restarted), found dead between batches (exit ``code``: by the idle check, or by
        a batch it then handed back unrun), or (``code`` None) asked by ``revive``: its batch
        died with it and runs elsewhere.
        The scheduler routes around the device and moves the rows queued there meanwhile
        (``("reloading", devices)``), and takes it back when the fresh worker has loaded its
        models (``("reloaded", devices)``). A fresh worker that fails to start is left to the
        next batch sent there, whose failure the breaker counts."""
        if code is not None:
            self.idle_deaths += 1
        self._report(("reloading", (device,)))
        try:
            runner.revive()
        except Exception as exc:  # noqa: BLE001 - this thread must never die
            why = "its batch ran elsewhere" if code is None else f"exit code {code}"
            self.revive_errors.append(f"{device} ({why}): {exc}")
            del self.revive_errors[:-8]
        self._report(("reloaded", (device,)))
