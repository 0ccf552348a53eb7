"""Serving manager: the plans of a session's semantic functions and the servers that serve
them.

One map from function to plan (``ken.policy.plan.Plan``, of either kind) and one map from
served function to its ``Server`` (``ken.engine.server``): every function with a gear plan is
served by the one online ``Engine`` on the session's pool of devices (started with each
function's models: picklable loaders for process workers, the loaded models for thread
workers; functions are added to it later and plans swapped in place), and each function with
a generation plan by a decode server of its own. What differs by kind is only how a server is
started and how it takes a new plan, looked up by the plan's ``kind``. The session keeps the
SQL side (connection, registry, bound operators).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, cast

from ken.engine.calibrate import recent_ratio
from ken.engine.decode import CPU_PRIORITIES, CascadeServer, GenerationEngine
from ken.engine.planner_process import PlannerProcess
from ken.engine.ray_runner import RayCluster
from ken.engine.replanning import ReplanEvent, Replanner
from ken.engine.server import Server
from ken.engine.serving import Engine
from ken.engine.sigterm import SigtermDrain
from ken.engine.supervision import BatchDeadline, LoadReport
from ken.engine.workers import gpu_index
from ken.errors import EngineError, KenError
from ken.models.model import DeviceConfig, Model
from ken.ops.base import Bound, OpContext, Operator
from ken.optimizer.replan import GearReplan
from ken.optimizer.tokens import load_or_measure_token_cost
from ken.policy.decoding import ServiceTargets
from ken.policy.dropping import POLICY_NAMES
from ken.policy.plan import GearPlan, GenPlan, Plan


class Statements(Protocol):
    """The statements a session runs on its database (``ken.sql.database.Database``), as
    SIGTERM ends them."""

    def refuse(self, reason: str) -> None:
        """Turn new statements away from now on; those running go on."""

    def settle(self) -> int:
        """Wait for the running statements to end (interrupting those that do not in time);
        then nothing enters the database any more."""


class ServingManager:
    """Plans per function and the servers of the functions that ``serve`` named.

    ``operators`` is the session's registry (read live), ``bind`` its cache of bound
    operators: thread workers and decode servers run the very models the session's
    in-process calls use. ``statements``: the session's, which SIGTERM ends too (see
    ``drain_on_sigterm``).
    """

    def __init__(self, operators: Mapping[str, Operator], ctx: OpContext,
                 bind: Callable[[str, tuple[str, ...]], Bound],
                 statements: Statements | None = None) -> None:
        self.operators = operators
        self.ctx = ctx
        self._bind = bind
        self.statements = statements
        self._plans: dict[str, Plan] = {}
        self._servers: dict[str, Server] = {}  # served function -> its server
        self._engine: Engine | None = None  # the one engine of the gear plans, once started
        self._bulk_threshold = 64
        # SIGTERM drains every server this manager runs, then exits (one handler for all)
        self._sigterm: SigtermDrain | None = None
        self._stopping = threading.Lock()
        # gear functions re-planned while served (``watch``), and every re-plan so far
        self._replanners: dict[str, Replanner] = {}
        self.replan_log: dict[str, list[ReplanEvent]] = {}
        # the one process every watch plans in (started with the first watch)
        self._planner: PlannerProcess | None = None
        # how a served function takes a new plan of its kind
        self._swap: dict[str, Callable[[str], None]] = {
            GearPlan.kind: self._swap_gear, GenPlan.kind: self._restart_generation}
        # how each decode server serves (``serve``'s settings; a restart for a new plan keeps
        # them)
        self._decode_settings: dict[str, dict[str, Any]] = {}

    @property
    def bulk_threshold(self) -> int:
        """Chunks with at least this many distinct new inputs enter as bulk rows."""
        return self._bulk_threshold

    @bulk_threshold.setter
    def bulk_threshold(self, value: int) -> None:
        if value < 1:
            raise KenError("bulk_threshold must be >= 1")
        self._bulk_threshold = value

    # -- plans -------------------------------------------------------------------------------

    @property
    def plans(self) -> Mapping[str, Plan]:
        return MappingProxyType(self._plans)

    def set_plan(self, name: str, plan: Plan) -> None:
        """Keep ``plan`` for ``name``; a server serving ``name`` takes it (the engine swaps
        it in place, a decode server is restarted with it). A served function keeps its
        plan's kind: giving it a plan of the other kind needs ``stop`` first."""
        old = self._plans.get(name)
        if name in self._servers and old is not None and old.kind != plan.kind:
            raise KenError(f"{name}() is served with a {old.kind} plan; stop serving "
                           f"(session.stop_serving()) before giving it a {plan.kind} plan")
        watcher = self._replanners.pop(name, None)
        if watcher is not None:  # a plan the user gives is kept: no more re-planning
            # first, so that a re-plan under way (it finishes) swaps its plan in before this
            # one, never after it
            watcher.stop()
        self._plans[name] = plan
        if name in self._servers:
            self._swap[plan.kind](name)

    def watch(self, name: str, replan: GearReplan) -> None:
        """Re-plan the served gear function ``name`` in the background when its workload
        leaves what its plan covers (``ken.engine.replanning``); each re-plan goes to the
        serving log (the progress reporter) and ``replan_log``, and its plan becomes the
        function's plan (EXPLAIN shows it). Stops with ``stop`` or a plan set by hand."""
        engine = self._engine
        if engine is None or self._servers.get(name) is not engine:
            raise KenError(f"{name}() is not served by the online engine; serve it first")
        if name in self._replanners:
            return

        def replanned(event: ReplanEvent) -> None:
            self.replan_log.setdefault(name, []).append(event)
            if not event.error:
                self._plans[name] = engine.plans[name]
            self.ctx.reporter.note(f"{name}(): {event.line()}")

        # the calls of the window against the runtimes the recipe plans with (it keeps them
        # after a runtime drift, so the watch then compares with the new ones)
        runtimes = None if replan.catalog is None else (
            lambda log, since: recent_ratio(log, replan.catalog, since))
        if self._planner is None:
            self._planner = PlannerProcess()
        self._replanners[name] = Replanner(
            engine, name, replan, replan.expected, latency_limit_ms=replan.latency_limit_ms,
            on_event=replanned, runtimes=runtimes, planner=self._planner,
            reporter=self.ctx.reporter).start()

    def _swap_gear(self, name: str) -> None:
        engine = self._engine
        assert engine is not None
        engine.swap_plan(self._gear_plan(name),
                         self._model_sources(name, engine.workers, engine.threads_per_device),
                         self._gpu_sources([name], engine.threads_per_device))

    def _restart_generation(self, name: str) -> None:
        self._servers.pop(name).shutdown()
        self._start_generation(name, **self._decode_settings.get(name, {}))

    def _gear_plan(self, name: str) -> GearPlan:
        """The plan of a function the engine serves (its kind is "gear")."""
        return cast(GearPlan, self._plans[name])

    def forget(self, name: str) -> None:
        """``name`` now names another operator: drop its plan; the other functions stay
        served and calls of ``name`` run in-process."""
        self._plans.pop(name, None)
        server = self._servers.pop(name, None)
        if server is not None and server is not self._engine:
            server.shutdown()

    # -- which server answers a call ---------------------------------------------------------

    @property
    def served(self) -> frozenset[str]:
        return frozenset(self._servers)

    def engines(self) -> Mapping[str, Server]:
        """The server of each served function (one engine serves every gear plan)."""
        return MappingProxyType(dict(self._servers))

    def planned_for_other_constants(self, function: str, constants: tuple[str, ...]) -> bool:
        """A plan of an operator with constants is made on its evaluation constants: its
        models answer those, so calls with other constants cannot use it."""
        planned_for = self.operators[function].eval_constants
        return bool(planned_for) and constants != planned_for

    def engine_for(self, function: str, constants: tuple[str, ...]) -> Server | None:
        """The server that answers a call, or None when the call runs in-process."""
        server = self._servers.get(function)
        if server is None or self.planned_for_other_constants(function, constants):
            return None
        return server

    # -- serving -----------------------------------------------------------------------------

    def serve(self, functions: Sequence[str] | None = None, workers: str = "auto",
              threads_per_device: int = 1, max_in_flight: int = 10_000,
              bulk_threshold: int | None = None, memory_gb: float | None = None,
              admission: str = "plan", latency_target_s: float | None = None,
              cluster: str | None = None, decode_targets: ServiceTargets | None = None,
              dropping: str | None = None, deadline: BatchDeadline | None = None,
              decode_priority: str = "normal", standby: bool = True
              ) -> dict[str, LoadReport]:
        """Serve ``functions`` (every function with a plan by default): the gear plans on one
        engine, each generation plan on a decode server; see ``Session.serve``."""
        if bulk_threshold is not None:
            self.bulk_threshold = bulk_threshold
        if cluster is not None and workers == "auto":
            workers = "ray"
        if workers not in ("auto", "process", "thread", "ray"):
            raise KenError(f"workers must be 'auto', 'process', 'thread' or 'ray' (got "
                           f"{workers!r})")
        if cluster is not None and workers != "ray":
            raise KenError(f"a Ray cluster serves with workers='ray', not {workers!r}")
        if admission not in ("plan", "max_in_flight"):
            raise KenError(f"admission must be 'plan' or 'max_in_flight' (got {admission!r})")
        if dropping is not None and dropping not in POLICY_NAMES:
            raise KenError(f"dropping must be one of {', '.join(map(repr, POLICY_NAMES))} "
                           f"(got {dropping!r})")
        if deadline is not None and not isinstance(deadline, BatchDeadline):
            raise KenError("deadline must be ken.engine.supervision.BatchDeadline(factor, "
                           f"floor_s, first_call_s), not {deadline!r}")
        if decode_priority not in CPU_PRIORITIES:
            raise KenError(f"decode_priority must be 'normal' or 'background', not "
                           f"{decode_priority!r}")
        if decode_targets is not None and not isinstance(decode_targets, ServiceTargets):
            raise KenError("decode_targets must be ken.ServiceTargets(ttft_s, tbt_s), not "
                           f"{decode_targets!r}")
        names = list(self._plans) if functions is None else [f.lower() for f in functions]
        if not names:
            raise KenError("nothing to serve: no function has a plan yet; run "
                           "session.plan(...) or session.use_plan(...) first")
        missing = [n for n in names if n not in self._plans]
        if missing:
            raise KenError(f"{', '.join(f'{n}()' for n in missing)} has no plan; run "
                           "session.plan(...) or session.use_plan(...) first")
        if self._sigterm is None:
            self._sigterm = SigtermDrain.install(self.drain_on_sigterm)
        by_kind: dict[str, list[str]] = {}
        for n in dict.fromkeys(names):
            if n not in self._servers:
                by_kind.setdefault(self._plans[n].kind, []).append(n)
        reports: dict[str, LoadReport] = {}
        for n in by_kind.pop(GenPlan.kind, []):
            self._decode_settings[n] = {
                "targets": decode_targets, "latency_target_s": latency_target_s,
                "admission": "target" if admission == "plan" else "none", "deadline": deadline,
                "cpu_priority": decode_priority}
            reports[n] = self._start_generation(n, **self._decode_settings[n])
        names = by_kind.pop(GearPlan.kind, [])
        if not names:
            return reports
        if self._engine is not None:
            return reports | self._add(names)
        kind = workers
        per_function: dict[str, Mapping[str, Any]] = {}
        if kind in ("auto", "process", "ray"):
            cpu = DeviceConfig(threads=threads_per_device)
            loaders = {n: self.operators[n].loaders(self.ctx, cpu) for n in names}
            if kind != "auto" or all(loaders.values()):
                kind = "process" if kind == "auto" else kind
                per_function = {n: _check_loaders(n, loaders[n]) for n in names}
            else:
                kind = "thread"
        if kind == "thread":
            per_function = {n: self._model_sources(n, kind, threads_per_device) for n in names}
        sources: dict[str, Any] = {}
        for models in per_function.values():
            for model, source in models.items():
                if sources.setdefault(model, source) is not source and kind == "thread":
                    raise KenError(f"two served functions name different models {model!r}; "
                                   "give the models distinct names")
        engine = Engine([self._gear_plan(n) for n in names], sources,
                        gpu_models=self._gpu_sources(names, threads_per_device),
                        max_in_flight=max_in_flight, workers=kind,  # type: ignore[arg-type]
                        threads_per_device=threads_per_device,
                        memory_budget_bytes=None if memory_gb is None
                        else int(memory_gb * 2**30),
                        admission=admission,  # type: ignore[arg-type]
                        latency_target_s=latency_target_s, drain_on_sigterm=False,
                        ray_cluster=None if cluster is None else RayCluster.connect(cluster),
                        dropping=dropping, deadline=deadline, standby=standby)
        devices = sorted({d for n in names for d in self._gear_plan(n).devices})
        with self.ctx.reporter.task(f"start the engine for {', '.join(f'{n}()' for n in names)}"
                                    f": {kind} workers on {', '.join(devices)}", 1) as advance:
            report = engine.start()
            advance(1)
        self._engine = engine
        self._servers.update(dict.fromkeys(names, engine))
        return reports | dict.fromkeys(names, report)

    def _start_generation(self, name: str, targets: ServiceTargets | None = None,
                          latency_target_s: float | None = None, admission: str = "target",
                          deadline: BatchDeadline | None = None,
                          cpu_priority: str = "normal") -> LoadReport:
        """A decode server for a generating function's plan, on the session's models (loaded
        in this process; the server's thread runs every pass); with ``targets``, joiners by
        deadline, each model's passes estimated by its token cost (measured once per
        machine). Admission by capacity (``admission="target"``) holds new requests to
        ``latency_target_s``, by default the plan's predicted p99; every pass has a deadline
        (``deadline``, the classifier engine's rule); ``cpu_priority`` as
        ``DecodeServer``'s."""
        plan = cast(GenPlan, self._plans[name])
        op = self.operators[name]
        started = time.perf_counter()
        models = dict(self._bind(name, op.eval_constants).models)
        if not set(plan.models) <= set(models):
            models.update(op.candidates(self.ctx, self.ctx.device))
        missing = [m for m in plan.models if m not in models]
        if missing:
            raise KenError(f"{name}()'s generation plan names models {missing} that "
                           f"{name}() does not have; it has {sorted(models)}")
        with self.ctx.reporter.task(f"start a decode server for {name}(): "
                                    f"{plan.summary()}", 1) as advance:
            costs = None if targets is None else {
                m: load_or_measure_token_cost(models[m].lm, Path(models[m].lm.source).name,
                                              home=self.ctx.home, reporter=self.ctx.reporter)
                for m in plan.models}
            server = CascadeServer({m: models[m] for m in plan.models}, plan,
                                   "fcfs" if targets is None else "deadline", targets,
                                   costs, latency_target_s=latency_target_s,
                                   admission=admission,  # type: ignore[arg-type]
                                   deadline=deadline,
                                   cpu_priority=cpu_priority,  # type: ignore[arg-type]
                                   ).start()
            advance(1)
        if cpu_priority == "background" and not server.yielded:
            self.ctx.reporter.warn(
                f"{name}()'s decode server keeps the normal CPU priority: decode_priority="
                f"'background' applies to a decode server on a CPU whose kernel has the idle "
                f"scheduling class and reports a thread's waits for a core (Linux); this one "
                f"runs on {server.lm.device.torch_device}")
        self._servers[name] = GenerationEngine(server)
        return LoadReport({}, time.perf_counter() - started, "thread")

    def _add(self, names: Sequence[str]) -> dict[str, LoadReport]:
        """Add functions to the running engine (their models load on its workers)."""
        engine = self._engine
        assert engine is not None
        reports = {}
        for name in names:
            started = time.perf_counter()
            engine.swap_plan(self._gear_plan(name), self._model_sources(
                name, engine.workers, engine.threads_per_device),
                self._gpu_sources([name], engine.threads_per_device))
            reports[name] = LoadReport({}, time.perf_counter() - started, engine.workers)
            self._servers[name] = engine
        return reports

    def _model_sources(self, name: str, workers: str, threads: int) -> Mapping[str, Any]:
        """What an engine of ``name`` loads: picklable loaders for process workers, the
        session's loaded models for thread workers."""
        op = self.operators[name]
        if workers in ("process", "ray"):
            return _check_loaders(name, op.loaders(self.ctx, DeviceConfig(threads=threads)))
        models = dict(self._bind(name, op.eval_constants).models)
        placed = {r.model for r in self._gear_plan(name).placement}
        if not placed <= set(models):  # a plan over candidates the binding does not use
            models.update(op.candidates(self.ctx, self.ctx.device))
        return models

    def _gpu_sources(self, names: Sequence[str], threads: int) -> dict[str, Any]:
        """Loaders onto ``cuda:0`` of the functions whose plans place models on GPUs: each
        GPU's worker sees its GPU alone, as ``cuda:0`` (``ken.engine.workers.worker_env``)."""
        gpu = DeviceConfig("cuda", 0, threads)
        out: dict[str, Any] = {}
        for name in names:
            gpus = [d for d in self._gear_plan(name).devices if gpu_index(d) is not None]
            if not gpus:
                continue
            loaders = self.operators[name].loaders(self.ctx, gpu)
            if not loaders:
                raise KenError(f"{name}()'s gear plan places models on GPUs ({', '.join(gpus)}),"
                               f" but {name}() has no model loaders: a GPU is served by a worker "
                               "process that loads its models there")
            out.update(loaders)
        return out

    def drain_on_sigterm(self) -> None:
        """SIGTERM's drain: the session turns new statements away, every server drains (the
        queries waiting on it get their rows, or ``cancelled`` rows and an error naming the
        shutdown), then the statements still running end, before the process exits: a
        thread left inside DuckDB as the interpreter finalizes aborts the process."""
        if self.statements is not None:
            self.statements.refuse("the process got SIGTERM")
        try:
            self.stop(drain=True)
        finally:
            if self.statements is not None:
                self.statements.settle()

    def stop(self, drain: bool = True) -> int:
        """Shut every server down (the decode servers, then the engine; draining admitted
        requests first, by default); returns how many requests they cancelled. The servers
        stay registered while they drain, so calls arriving meanwhile get their ``cancelled``
        outcomes rather than running in-process; a second ``stop`` (SIGTERM's, a session's
        close) waits for the first."""
        with self._stopping:
            for watcher in self._replanners.values():
                watcher.stop()
            self._replanners.clear()
            if self._planner is not None:
                self._planner.close()
                self._planner = None
            engine = self._engine
            servers = [s for s in self._servers.values() if s is not engine]  # decode servers
            cancelled = 0
            failed: EngineError | None = None
            try:
                for server in servers:  # each is stopped, even after one that fails to
                    try:
                        cancelled += server.shutdown(drain)
                    except EngineError as exc:
                        failed = failed or exc
                if failed is not None:
                    raise failed
            finally:
                try:
                    cancelled += 0 if engine is None else engine.shutdown(drain=drain)
                finally:
                    self._engine = None
                    self._servers.clear()
                    if self._sigterm is not None and self._sigterm.restore():
                        self._sigterm = None
            return cancelled

def _check_loaders(name: str, loaders: Mapping[str, Callable[[], Model]] | None
                   ) -> Mapping[str, Callable[[], Model]]:
    if not loaders:
        raise KenError(f"{name}() has no model loaders for worker processes; serve it "
                       "with workers='thread'")
    return loaders
