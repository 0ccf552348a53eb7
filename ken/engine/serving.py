"""Online serving of gear plans (DESIGN.md section 6; issue 5).

``Engine`` serves one pool of devices for any number of operators, one gear plan each (the
query optimizer plans them together on the same devices). Per operator it runs a
``Dispatcher`` — the same scheduling policy the simulator uses — on a ``WallClock`` with real
model calls; the dispatchers share the devices' busy set, so a device runs one batch at a time
whichever operator it is for:

- one *scheduler* thread owns the dispatcher and processes events in order: arrivals
  (``submit``), finished batches from the devices, queue deadlines (max wait), plan swaps
  (``dispatch.py``);
- one *device worker* per device of the plan runs the batches placed on it, one at a time, on
  models loaded before serving starts (``supervision.py``, ``workers.py``): its own process by
  default (a device of ``threads_per_device`` torch threads), or a thread of this process for
  models given already loaded.

This module is the engine's public face: argument checks, start, shutdown, plan swaps and
submission; admission is ``admission.py``, the bulk path ``bulk.py``.

Every submitted request gets exactly one ``Outcome``: a result, ``null`` for a NULL input,
``rejected`` when admission turned it away (with the reason and a retry hint), ``error`` when
its batch failed ``max_retries + 1`` times or its model is marked failed, ``cancelled`` when
the engine shut down before it ran, or ``dropped`` when a dropping policy found it could no
longer make its end-to-end deadline (below). Failure behaviour (DESIGN.md section 14):

- *admission*: an online request is admitted only while the gear plan can serve it within its
  latency target (by default the p99 the plan's simulation predicted, at least
  ``MIN_PLAN_TARGET_S``) at some replica of its first stage (``Admission.place``: the one
  the router picks when it can, else the one that would answer soonest; a replica whose
  worker reloads is routed around). A replica's estimate is the profiled work queued on its
  devices (``Dispatcher.queued_work_s``: the runtimes the simulator charges), plus what is
  left of the batch running there, its own row and the later-stage work it and the rows ahead
  will bring (escalation rates measured while serving, per cascade and stage; every row
  escalates until 20 have been answered), times the slowdown it measures while serving
  (``admission.Slowdown``: the 95th percentile of answered latency over estimate in the last
  5 s, for requests admitted near the limit, those still waiting counted by their wait so
  far). Over the target at every replica it is
  rejected at once, with the reason and a retry hint (a SQL query sends such rows again
  after the hint). ``max_in_flight`` stays as a hard cap on memory.
- *deadlines*: every batch has one, ``BatchDeadline.seconds`` of its profiled runtime (a
  plan without runtimes: of what its model's calls took while serving, or the first-call
  bound, 20 s by default, until one returned). A process worker that misses it is killed and
  replaced; a thread worker's call is abandoned (threads cannot be killed) and the device
  gets a fresh thread. The rows run once more (``max_retries``, counted per row), then they
  end in ``error`` saying the model did not return within the deadline. A process worker
  that died, hung or was killed with a batch is replaced at once, and the batch's rows run
  again on another replica of their model while it reloads (with none, after the reload).
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

*Deadlines through a pipeline* (``deadlines.py``): with a ``dropping`` policy an online request
may carry an end-to-end deadline and the operators still ahead of it (``submit(...,
deadline_s=, route=, job=)``); one ``PipelineDropper`` (``ken.policy.dropping``, the
simulator's) over the served operators drops, when a request reaches an operator or when an
operator forms a batch, a request that can no longer make it: it ends ``dropped`` at once,
``error`` saying where and why. ``deadline_metrics()``: goodput, drop rate, wasted model time.

``swap_plan`` installs a new gear plan while serving: rows still queued under the old plan are
moved to the new one's first stage, batches already running finish (and escalate) under the
old plan, nothing is lost.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Literal

import numpy as np

from ken.engine import collector
from ken.engine.admission import Admission, AdmissionMode
from ken.engine.deadlines import EngineDeadlines, drop_policy, job_key
from ken.engine.dispatch import Requests, Scheduler
from ken.engine.outcome import Outcome
from ken.engine.ray_runner import RayCluster
from ken.engine.request_path import PathLog
from ken.engine.sigterm import SigtermDrain
from ken.engine.supervision import (
    BatchDeadline,
    BatchRecord,
    Breaker,
    DevicePool,
    LoadReport,
    Source,
)
from ken.errors import EngineError
from ken.models.model import Model
from ken.policy.dropping import DeadlineMetrics, DropPolicy
from ken.policy.plan import GearPlan, Replica
from ken.policy.scheduling import Dispatcher, WallClock


def _is_row(value: object) -> bool:
    """A text, or a tuple of texts (a row of a model over several columns)."""
    return isinstance(value, str) or (isinstance(value, tuple) and bool(value)
                                      and all(isinstance(v, str) for v in value))


def _placed(*plans: GearPlan) -> dict[str, list[str]]:
    """Models each device of ``plans`` hosts."""
    out: dict[str, list[str]] = {d: [] for p in plans for d in p.devices}
    for p in plans:
        for r in p.placement:
            for d in r.devices:
                if r.model not in out[d]:
                    out[d].append(r.model)
    return out


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
    predicted p99, at least ``admission.MIN_PLAN_TARGET_S``; a plan without predicted latency or
    profiled runtimes is bounded by ``max_in_flight`` alone, as is every plan with
    ``admission="max_in_flight"``);
    ``deadline`` bounds each batch; ``max_retries`` re-runs a failed batch; ``max_crashes``
    crashes or hangs in a row mark a model failed; ``drain_on_sigterm`` drains for up to
    ``drain_timeout_s`` on SIGTERM, then exits. At start and at a plan swap each CPU worker
    process is checked against ``memory_budget_bytes`` (its resident memory) and each GPU
    worker against ``gpu_memory_budget_bytes`` (the GPU memory its allocator reserved;
    default: ``gpus.GPU_MEMORY_SHARE`` of the GPU, what a plan may place there).

    ``dropping`` (``"none"``, ``"reactive"``, ``"proactive"``, ``"proactive-profiled"`` or a
    ``DropPolicy``): serve the operators as stages of a pipeline whose requests carry
    end-to-end deadlines (see the module docstring; the plans, and plans swapped in for them,
    need profiled runtimes); None (the default): deadlines given
    to ``submit`` are ignored and nothing is dropped.

    ``standby`` (default True): with worker processes or Ray actors, each model a plan places
    on one CPU device only is also loaded on another CPU device of the plan, with no share of
    the rows, and serves the rows that would wait for its own worker while that worker
    reloads after a crash or a kill (``standby.py``); False loads only what the plans place.
    Not with ``dropping``: the forecast reads each plan's replicas as simulated.
    """

    def __init__(self, plan: GearPlan | Sequence[GearPlan], models: Mapping[str, Source],
                 max_in_flight: int = 10_000, max_retries: int = 1,
                 clock: WallClock | None = None, *,
                 workers: Literal["auto", "process", "thread", "ray"] = "auto",
                 threads_per_device: int = 1, bulk_batch_size: int | None = None,
                 memory_budget_bytes: int | None = None,
                 gpu_memory_budget_bytes: int | None = None,
                 admission: AdmissionMode = "plan",
                 latency_target_s: float | None = None,
                 deadline: BatchDeadline | None = None,
                 max_crashes: int = 3, drain_on_sigterm: bool = True,
                 drain_timeout_s: float = 30.0, ray_cluster: RayCluster | None = None,
                 gpu_models: Mapping[str, Source] | None = None,
                 dropping: DropPolicy | str | None = None, standby: bool = True) -> None:
        plans = [plan] if isinstance(plan, GearPlan) else list(plan)
        if not plans:
            raise EngineError("an engine needs at least one gear plan")
        if len({p.operator for p in plans}) != len(plans):
            raise EngineError("an engine serves one gear plan per operator; got "
                              f"{[p.operator for p in plans]}")
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
        if memory_budget_bytes is not None and memory_budget_bytes <= 0:
            raise EngineError("the memory budget per device must be > 0 bytes")
        if gpu_memory_budget_bytes is not None and gpu_memory_budget_bytes <= 0:
            raise EngineError("the GPU memory budget per GPU must be > 0 bytes")
        self.clock = clock or WallClock()
        self.breaker = Breaker(max_retries, max_crashes)
        self._requests = Requests(self.clock)
        self._events: queue.Queue = queue.Queue()
        self.pool = DevicePool(workers, threads_per_device, self.clock,
                               deadline or BatchDeadline(), self.breaker, self._requests.texts,
                               self._events.put, ray_cluster)
        self.pool.add_sources(models, gpu_models)
        self.pool.check_plans(plans)
        self.plans: dict[str, GearPlan] = {p.operator: p for p in plans}
        self.admission = Admission(self.clock, admission, latency_target_s)
        self.deadlines = None if dropping is None else \
            EngineDeadlines(drop_policy(dropping), self.plans)
        self._requests.deadlines = self.deadlines
        self.max_in_flight = max_in_flight
        self.memory_budget_bytes = memory_budget_bytes
        self.gpu_memory_budget_bytes = gpu_memory_budget_bytes
        self.drain_on_sigterm = drain_on_sigterm
        self.drain_timeout_s = drain_timeout_s
        self.scheduler = Scheduler(
            self.plans, self.clock, self._requests, self._events, self.pool, self.breaker,
            self.admission, bulk_batch_size or max(b for p in plans for b in p.max_batch),
            self.deadlines, standby and dropping is None)
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._shutdown_lock = threading.Lock()
        self._sigterm: SigtermDrain | None = None
        self._frozen: collector.Hold | None = None  # what was loaded, while serving
        self.load_report: LoadReport | None = None

    # -- what it serves, and how ------------------------------------------------------------

    @property
    def workers(self) -> str:
        return self.pool.workers

    @property
    def threads_per_device(self) -> int:
        return self.pool.threads_per_device

    @property
    def ray_cluster(self) -> RayCluster | None:
        return self.pool.ray_cluster

    @property
    def deadline(self) -> BatchDeadline:
        return self.pool.deadline

    @property
    def max_retries(self) -> int:
        return self.breaker.max_retries

    @property
    def max_crashes(self) -> int:
        return self.breaker.max_crashes

    @property
    def bulk_batch_size(self) -> int:
        return self.scheduler.bulk_batch_size

    def describe_serving(self, bulk_threshold: int, operator: str | None = None) -> str:
        """How the engine serves a query's calls; of ``operator``, its standby copies."""
        standby = self.standby_replicas(operator) if operator in self.plans else []
        return (f"served by the online engine ({self.workers} workers): chunks of < "
                f"{bulk_threshold} new inputs as online requests, larger ones as bulk rows of "
                f"gear 1 in batches of {self.bulk_batch_size}"
                + (f"; standby {', '.join(r.label() for r in standby)} (no share of the "
                   "rows: serves while its own worker reloads)" if standby else ""))

    def standby_replicas(self, operator: str | None = None) -> list[Replica]:
        """The standby copies the engine serves ``operator``'s plan with (``standby.py``): a
        replica of each model the plan places on one CPU worker, on another one."""
        return self._standby_of(self.plans[self._operator(operator)])

    def _standby_of(self, plan: GearPlan) -> list[Replica]:
        return list(self.scheduler.served(plan).placement[len(plan.placement):])

    @property
    def plan(self) -> GearPlan:
        """The gear plan served, when the engine serves one operator."""
        if len(self.plans) != 1:
            raise EngineError(f"this engine serves {len(self.plans)} operators "
                              f"({', '.join(self.plans)}); use engine.plans[operator]")
        return next(iter(self.plans.values()))

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
        if self._thread is not None:
            raise EngineError("the engine is already running")
        t0 = time.perf_counter()
        seconds = self.pool.add(_placed(*map(self.scheduler.served, self.plans.values())))
        rss, gpu = self._check_memory(self.plans.values(), stop=True)
        self.load_report = LoadReport(seconds, time.perf_counter() - t0, self.workers, rss, gpu)
        self._thread = threading.Thread(target=self.scheduler.run, name="ken-scheduler",
                                        daemon=True)
        self._accepting = True
        self._thread.start()
        self._frozen = collector.hold()  # no full collection walks what is loaded now
        if self.drain_on_sigterm:
            self._sigterm = SigtermDrain.install(lambda: self.shutdown(drain=True))
        return self.load_report

    def _check_memory(self, plans: Iterable[GearPlan], stop: bool
                      ) -> tuple[dict[str, int], dict[str, int]]:
        """``DevicePool.check_memory`` against the engine's budgets; an error over budget
        names the standby copies of ``plans`` that count too, and how to leave them out."""
        try:
            return self.pool.check_memory(self.memory_budget_bytes, stop=stop,
                                          gpu_budget=self.gpu_memory_budget_bytes)
        except EngineError as exc:
            standby = [r.label() for p in plans for r in self._standby_of(p)]
            if not standby:
                raise
            raise EngineError(f"{exc} (the standby copies {', '.join(standby)} count too: "
                              "Engine(standby=False), or session.serve(standby=False), loads "
                              "only what the plans place)") from exc

    def shutdown(self, drain: bool = True, timeout_s: float | None = None) -> int:
        """Stop accepting requests and restarting workers. With ``drain``, wait (up to
        ``timeout_s``, default ``drain_timeout_s``) for admitted requests to finish; whatever
        is still queued or running then ends ``cancelled``. Returns how many were cancelled.
        Safe to call twice and from any thread."""
        try:
            return self._shutdown(drain, timeout_s)
        finally:  # whatever failed on the way, the process's objects go back to the collector
            if self._frozen is not None:
                self._frozen.release()

    def _shutdown(self, drain: bool, timeout_s: float | None) -> int:
        with self._shutdown_lock:
            with self._requests.lock:
                self._accepting = False
            if self._thread is None:
                self._forget_sigterm()
                return 0
            self.pool.closing()  # a worker that dies now is not restarted
            wait_s = self.drain_timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + wait_s
            if drain:
                while len(self._requests) and time.monotonic() < deadline:
                    time.sleep(0.005)
            done: Future = Future()
            self._events.put(("stop", done))
            while not done.done() and self._thread.is_alive():
                time.sleep(0.005)
            # (a scheduler that died of a bug cannot cancel: do it here, nothing is lost)
            cancelled = done.result() if done.done() else self.scheduler.cancel_queued()
            try:
                self._thread.join(timeout=5.0)
                self.pool.close()
            finally:
                self._thread = None
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
        thread = self._thread
        if thread is None:
            raise EngineError("the engine is not running; start() it, or pass the plan to "
                              "Engine(...)")
        if self.deadlines is not None:
            self.deadlines.check_swap(plan)
        self.pool.add_sources(models, gpu_models)
        self.pool.check_plans([plan])
        self.pool.add(_placed(self.scheduler.served(plan)))
        if self.workers == "thread":  # its models were loaded in this process
            collector.refreeze()
        self.scheduler.bulk_batch_size = max(self.scheduler.bulk_batch_size, *plan.max_batch)
        self._check_memory([plan], stop=False)  # over: keep the old plan
        done: Future = Future()
        self._events.put(("swap", plan, done))
        while True:
            try:
                return done.result(timeout=0.5)
            except FutureTimeout:
                # shut down while the models loaded: the scheduler never reads the swap
                if not thread.is_alive() and not done.done():
                    raise EngineError(f"the engine shut down before {plan.operator}'s new "
                                      "plan took over") from None

    # -- requests ---------------------------------------------------------------------------

    def submit(self, text: str | tuple[str, ...] | None, operator: str | None = None, *,
               deadline_s: float | None = None, route: Sequence[str] = (),
               job: Hashable | None = None) -> Future:
        """Queue one input row (online) for ``operator`` (needed when the engine serves
        several): a text, or a tuple of texts for models over several columns; the future
        resolves to its ``Outcome``.

        With a dropping policy (``Engine(..., dropping=...)``): ``deadline_s``, the request's
        absolute end-to-end deadline on the engine's clock (``engine.clock.now()`` plus its
        budget); ``route``, the served operators still ahead of it after this one, in order;
        ``job``, a key its pipeline's hops share (a pipeline request is one job in
        ``deadline_metrics``; default: this request alone)."""
        if text is not None and not _is_row(text):
            raise EngineError(f"the engine answers text rows; got {type(text).__name__}")
        op = self._operator(operator)
        if deadline_s is not None and math.isnan(deadline_s):
            raise EngineError("a deadline is a time on the engine's clock, not NaN")
        ahead: tuple[str, ...] = ()
        if self.deadlines is not None:
            ahead = self.deadlines.check_route(op, route)
        else:
            deadline_s, job = None, None
        return self._admit([text], bulk=False, operator=op, deadline_s=deadline_s,
                           route=ahead, job=job)[0]

    def submit_many(self, texts: Iterable[str | tuple[str, ...] | None], bulk: bool = False,
                    operator: str | None = None, *, deadline_s: float | None = None
                    ) -> list[Future]:
        """Queue many rows at once; ``bulk`` rows run in throughput-sized batches (see the
        module docstring) and are not bounded by ``max_in_flight``: the caller holds them.
        ``deadline_s``: online rows' end-to-end deadline (engine clock), as ``submit``'s
        (each row its own job, no route ahead); ignored for bulk rows."""
        if bulk or self.deadlines is None:
            deadline_s = None
        return self._admit(list(texts), bulk=bulk, operator=self._operator(operator),
                           deadline_s=deadline_s)

    def _admit(self, texts: Sequence, bulk: bool, operator: str,
               deadline_s: float | None = None, route: tuple[str, ...] = (),
               job: Hashable | None = None) -> list[Future]:
        futures = []
        admitted = []
        now = self.clock.now()
        requests = self._requests
        with requests.lock:
            if not bulk:
                requests.arrived.add(operator, (now,), len(texts))
            for text in texts:
                future: Future = Future()
                futures.append(future)
                rid = requests.next_id()
                if not self._accepting:
                    future.set_result(Outcome(rid, "cancelled", now, now, error=(
                        "the engine is not accepting requests (not started, or shutting "
                        "down); nothing was run")))
                elif text is None:
                    future.set_result(Outcome(rid, "null", now, now))
                elif not _is_row(text):
                    future.set_result(Outcome(rid, "error", now, now, error=(
                        f"the engine answers text rows; got {type(text).__name__}")))
                elif not bulk and len(requests) >= self.max_in_flight:
                    self.scheduler.rejected += 1
                    future.set_result(Outcome(rid, "rejected", now, now, error=(
                        f"{self.max_in_flight} requests in flight (the engine's max_in_flight); "
                        "retry later"), retry_after_s=self.plans[operator].rate_window_s))
                    if self.deadlines is not None and deadline_s is not None:
                        self.deadlines.ledger.refused(job_key(rid, job), now, deadline_s)
                else:
                    requests.add(rid, text, future, now, "" if bulk else operator,
                                 deadline_s, route, job)
                    admitted.append(rid)
        if admitted:
            self._events.put(("bulk" if bulk else "arrive", operator, admitted))
        return futures

    # -- what happened ----------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def recent_answers(self, operator: str, since_s: float) -> np.ndarray:
        """(completion time on the engine clock, latency s) of ``operator``'s online requests
        answered ``ok`` since ``since_s``, one row each, oldest first."""
        return self._requests.recent_answers(operator, since_s)

    def in_flight_of(self, operator: str) -> int:
        """``operator``'s online requests in flight (its backlog)."""
        return self._requests.waiting(operator)

    @property
    def rejected(self) -> int:
        """Online requests admission turned away."""
        return self.scheduler.rejected

    def recent_arrivals(self, operator: str, since_s: float) -> list[float]:
        """Submit times (engine clock) of ``operator``'s online requests since ``since_s``,
        admitted or not (the offered load), oldest first."""
        return self._requests.recent_arrivals(operator, since_s)

    def deadline_metrics(self, since_s: float = -math.inf) -> DeadlineMetrics:
        """What the deadlines did to the jobs (pipeline requests with a deadline) that arrived
        since ``since_s`` (engine clock) and have ended: goodput (answered by their last hop
        within the deadline, per second of their arrivals), drop rate, late rate (rejected,
        failed and cancelled jobs count late) and the device seconds measured on jobs dropped
        or late (wasted) out of all."""
        if self.deadlines is None:
            raise EngineError("this engine serves without a dropping policy; start it with "
                              "Engine(..., dropping='none' | 'reactive' | 'proactive' | "
                              "'proactive-profiled' | 'proactive-first-model')")
        return self.deadlines.ledger.metrics(since_s)

    @property
    def plan_swaps(self) -> list[tuple[float, int]]:
        """``(time, queued rows moved)`` per plan swap."""
        return self.scheduler.plan_swaps

    @property
    def path_log(self) -> PathLog:
        """When each online request was admitted and each online batch formed, started,
        ended and was taken in (``request_path``: where a request's time went)."""
        return self.scheduler.path_log

    @property
    def batch_log(self) -> list[BatchRecord]:
        """The latest model calls (bounded: the oldest half is dropped at the limit)."""
        return self.pool.batch_log

    @property
    def failed_attempts(self) -> int:
        """Model calls that raised, hung or whose worker died."""
        return self.pool.failed_attempts

    @property
    def timeouts(self) -> int:
        """Batches that ran past their deadline."""
        return self.pool.timeouts

    @property
    def worker_restarts(self) -> int:
        """Workers replaced so far: processes restarted after dying or being killed at a
        deadline, threads abandoned at a deadline."""
        return self.pool.restarts

    @property
    def idle_deaths(self) -> int:
        """Worker processes found dead between batches and replaced at once (they are among
        ``worker_restarts``); ``revive_errors`` says which replacements failed, and why."""
        return self.pool.idle_deaths

    @property
    def moved_batches(self) -> int:
        """Batches whose worker died or hung (with the batch, or before it ran) and whose
        rows then ran on another replica of their model while the worker reloaded (their
        workers are among ``worker_restarts``)."""
        return self.scheduler.moved_batches

    @property
    def revive_errors(self) -> list[str]:
        """The latest replacements between batches that failed (the next batch sent there
        retries)."""
        return list(self.pool.revive_errors)

    @property
    def failed_models(self) -> Mapping[str, str]:
        """Models marked failed (they crashed or hung ``max_crashes`` times in a row), with
        the reason their rows get."""
        return self.breaker.failed_models

    def admission_target_s(self, operator: str | None = None) -> float | None:
        """The latency target admission holds ``operator``'s online requests to; None when
        only ``max_in_flight`` bounds them (``admission="max_in_flight"``, or a plan without
        predicted latency or profiled runtimes)."""
        return self.admission.target_s(self.plans[self._operator(operator)])

    @property
    def gear_switches(self) -> list[tuple[float, int, int]]:
        """``(time, from range, to range)`` for every change of cascade so far, of every
        operator in time order (across plan swaps: ranges are those of the plan active at the
        time); ``gear_switches_of(operator)`` for one."""
        return sorted(s for op in self.plans for s in self.gear_switches_of(op))

    def dispatcher(self, operator: str | None = None) -> Dispatcher:
        """The policy state of an operator's active plan (gear selector, queues), read-only
        use: diagnostics and tests."""
        return self.scheduler.dispatcher(self._operator(operator))

    def gear_switches_of(self, operator: str) -> list[tuple[float, int, int]]:
        return self.scheduler.gear_switches_of(self._operator(operator))

    def nodes(self) -> dict[str, str | None]:
        """Ray node id per device (None for local workers, or where Ray did not say)."""
        return self.pool.nodes()

    def pids(self) -> dict[str, int | None]:
        """Worker process id per device (None for thread workers)."""
        return self.pool.pids()

    def __repr__(self) -> str:
        return (f"Engine({', '.join(self.plans)}; {self.workers} workers, "
                f"{len(self._requests)} in flight)")
