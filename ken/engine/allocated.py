"""A pipeline served on the online engine by a joint allocation of its workers, re-solved
online from the measured demand (issue 37, item 2; Loki, HPDC 2024, §4-5).

``ken.optimizer.allocation`` decides which variants (models) of each operator the workers
host, at which batch size, and what share of each route class every path of variants
carries; ``ken.optimizer.reallocation`` re-solves it every period from an EWMA of the demand
(its ``Controller``), in simulation. ``AllocatedPipeline`` serves the same allocations on an
``Engine``, with the same controller, solver and routing:

- every variant of every operator is an engine operator ``"<operator>:<variant>"``
  (``allocation.variant_plan``), loaded on every device before serving starts, so a change of
  allocation loads nothing (as the simulation assumes); a variant the allocation hosts is
  placed on the devices it was given (``serve_allocation``), one it does not host keeps its
  last placement and gets no new requests;
- ``submit(row, route_class)`` draws the request's path from the allocation in force
  (``allocation.path_for``; turned away, ``rejected``, with the share of its class the
  allocation carries, where it carries only part) and sends it hop by hop: each hop is an
  engine request with the request's end-to-end deadline and the rest of its route, so an
  engine dropping policy (``dropping=``) sees them;
- with a controller (``control``: ``Resolving``, Loki's open loop, or ``ClosedLoop``, which
  adds the requests inside the pipeline to the demand, and with ``checks`` > 1 also reads
  them and the rate so far inside each period and re-solves at once when the demand jumped),
  a thread ends a period every
  ``every_s`` seconds of the engine's clock: the rate of arrivals it saw goes into the EWMA,
  the next period's demand is solved (``Solver``: each distinct demand once), and where the
  allocation changed the plans of the variants it now places are swapped in
  (``Engine.swap_plan``: nothing lost) before new requests are routed by it. A request inside
  the pipeline takes its next hops along a path of the new allocation drawn for its class (the
  simulation moves it the same way); the hop it is queued at finishes where it is (the
  simulation moves queued rows too: the one difference).

Every request gets exactly one ``PipelineOutcome``: ``ok`` with every hop's answer, or the
status of the hop that ended it (``rejected``, ``dropped``, ``error``, ``cancelled``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import numpy as np

from ken.engine.outcome import Outcome, Status
from ken.engine.serving import Engine
from ken.engine.supervision import Source
from ken.errors import EngineError
from ken.optimizer.allocation import (
    Allocation,
    AllocationProblem,
    path_for,
    route_table,
    serve_allocation,
    variant_plan,
)
from ken.optimizer.reallocation import ClosedLoop, Controller, Resolving, Solver
from ken.policy.plan import GearPlan


@dataclass(frozen=True)
class PipelineOutcome:
    """One pipeline request: its route class, the variants that answered its hops (in
    order; fewer than its route's operators when a hop ended it), each hop's answer, times on
    the engine's clock, whether a change of allocation moved its later hops onto another path,
    and the reason where it was not answered."""

    status: Status
    route_class: int
    variants: tuple[str, ...]
    values: tuple[Any, ...]
    arrival_s: float
    completion_s: float
    moved: bool = False
    error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.completion_s - self.arrival_s


@dataclass(frozen=True)
class AllocationChange:
    """The allocation a period's end put in place: when (engine clock), the demand it was
    solved for, what it hosts (``Allocation.describe``) and the plans swapped in."""

    time_s: float
    demand_qps: float
    hosts: tuple[str, ...]
    swapped: tuple[str, ...]


@dataclass
class _Request:
    id: int
    route_class: int
    row: Any
    variants: tuple[str, ...]  # the path it follows (rewritten when a change moves it)
    epoch: int  # the allocation its path was drawn from
    arrival_s: float
    deadline_s: float | None
    future: Future
    values: list = field(default_factory=list)
    moved: bool = False


class AllocatedPipeline:
    """Serve a pipeline's route classes on ``devices`` by the allocation ``solver`` gives for
    the demand (see the module docstring). ``models``: what loads each variant (by its
    name) on a worker; ``start_qps``: the demand the first allocation is solved for;
    ``control``: None keeps that allocation; ``Resolving`` or ``ClosedLoop`` re-solve it
    every period. ``hop_input(operator, previous value, row)`` gives a later hop its input
    (default: the request's row at every hop). ``engine_options`` go to the ``Engine``
    (``workers``, ``dropping``, ``threads_per_device``, ...; admission defaults to
    ``"max_in_flight"``: the allocation itself turns away what it cannot carry).

    >>> with AllocatedPipeline(Solver(problem_for), 40.0, ["cpu0", "cpu1"], loaders,
    ...                        control=Resolving(every_s=2.0)) as pipe:  # doctest: +SKIP
    ...     outcome = pipe.submit("a row", route_class=0).result()
    """

    def __init__(self, solver: Solver, start_qps: float, devices: Sequence[str],
                 models: Mapping[str, Source], *, control: Resolving | ClosedLoop | None = None,
                 seed: int = 0, max_wait_s: float = 0.005,
                 hop_input: Callable[[str, Any, Any], Any] | None = None,
                 **engine_options: Any) -> None:
        if not devices or len(set(devices)) != len(devices):
            raise EngineError(f"give distinct devices to serve the pipeline on, got {devices}")
        self.solver = solver
        self.devices = tuple(devices)
        self.control = control
        resolving = control.resolving if isinstance(control, ClosedLoop) else control
        self.period_s = resolving.every_s if resolving is not None else None
        self._controller = Controller(resolving or Resolving(), start_qps)
        self.max_wait_s = max_wait_s
        self.hop_input = hop_input
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._ids = count()
        self._inside: dict[int, _Request] = {}
        self._arrivals = 0  # in the period running now
        self._epoch = 0
        self._accepting = False
        self.changes: list[AllocationChange] = []
        self.moved = 0  # requests whose later hops a change moved onto another path
        self.turned_away = 0  # requests the allocation did not carry
        # a fixed allocation is solved for ``start_qps`` itself; a controller's first period
        # for it rounded onto its grid, as the simulation's
        demand = self._controller.decide() if control is not None else start_qps
        self.problem, self.allocation = solver(demand)
        if self.problem.workers > len(self.devices):
            raise EngineError(f"the allocation problem has {self.problem.workers} workers; "
                              f"{len(self.devices)} devices given ({', '.join(self.devices)})")
        names = {v.name for vs in self.problem.variants for v in vs}
        missing = sorted(names - set(models))
        if missing:
            raise EngineError(f"no model given for the variants {missing}")
        self._table = route_table(self.problem, self.allocation)
        # every variant on every device: loaded before serving, so no change loads a model
        everywhere = [variant_plan(self.problem, k, v.name, self.devices, max(v.qps), max_wait_s)
                      for k, vs in enumerate(self.problem.variants) for v in vs]
        self._placed: dict[str, GearPlan] = {p.operator: p for p in everywhere}
        engine_options.setdefault("admission", "max_in_flight")
        self.engine = Engine(everywhere, {n: models[n] for n in names}, **engine_options)
        self._forward: list[tuple[_Request, Outcome | None, str | None]] = []
        self._wake = threading.Condition(threading.Lock())
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.control_errors: list[str] = []  # periods whose re-solve or swap failed

    # -- start and stop ---------------------------------------------------------------------

    def start(self) -> AllocatedPipeline:
        """Start the engine (every variant loaded on every device), place the first
        allocation and, with a controller, its thread."""
        self.engine.start()
        swapped = self._place(self.problem, self.allocation)
        self.changes.append(AllocationChange(
            self.engine.clock.now(), self.problem.demand_qps,
            tuple(self.allocation.describe(self.problem)), swapped))
        self._accepting = True
        self._threads = [threading.Thread(target=self._forwarder, name="ken-pipeline-hops",
                                          daemon=True)]
        if self.period_s is not None:
            self._threads.append(threading.Thread(target=self._control, name="ken-allocation",
                                                  daemon=True))
        for t in self._threads:
            t.start()
        return self

    def shutdown(self, drain: bool = True, timeout_s: float = 30.0) -> int:
        """Stop taking requests and re-solving; with ``drain`` wait (up to ``timeout_s``)
        for the requests inside to finish their hops, then shut the engine down (what is
        still inside then ends ``cancelled``). Returns how many requests ended ``cancelled``
        here (a hop the engine never took); those whose hop the engine cancelled end so too."""
        with self._lock:
            self._accepting = False
        self._stop.set()
        until = time.monotonic() + timeout_s
        if drain:
            with self._idle:
                self._idle.wait_for(lambda: not self._inside, timeout=timeout_s)
        self.engine.shutdown(drain=drain,
                             timeout_s=max(until - time.monotonic(), 0.0) if drain else 0.0)
        with self._lock:
            left = list(self._inside.values())
        cancelled = sum(self._finish(req, "cancelled", "the pipeline shut down before its "
                                     "next hop ran") for req in left)
        with self._wake:
            self._wake.notify_all()
        for t in self._threads:
            t.join(timeout=5.0)
        return cancelled

    def __enter__(self) -> AllocatedPipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- requests ---------------------------------------------------------------------------

    def submit(self, row: Any, route_class: int = 0, *, deadline_s: float | None = None,
               ) -> Future:
        """Send one request of ``route_class`` (an index into the problem's routes) along a
        path of the allocation in force; ``deadline_s``: its end-to-end deadline on the
        engine's clock (every hop carries it). The future resolves to its
        ``PipelineOutcome``."""
        if not 0 <= route_class < len(self.problem.routes):
            raise EngineError(f"route class {route_class} is not one of the pipeline's "
                              f"{len(self.problem.routes)} (0..{len(self.problem.routes) - 1})")
        now = self.engine.clock.now()
        future: Future = Future()
        future.set_running_or_notify_cancel()  # its one outcome is set here, never cancelled
        with self._lock:
            if not self._accepting:
                raise EngineError("the pipeline is not serving: start() it (it stops at "
                                  "shutdown)")
            self._arrivals += 1
            path = path_for(self._table, route_class, self._rng)
            req = _Request(next(self._ids), route_class, row, path or (), self._epoch, now,
                           deadline_s, future)
            if path is None:
                self.turned_away += 1
                carried = sum(q for _, q in self._table.get(route_class, []))
                reason = (f"the allocation for {self.problem.demand_qps:g} requests/s carries "
                          f"{carried:.0%} of route class {route_class} "
                          f"({' -> '.join(self._operators(route_class))}): turned away")
            else:
                self._inside[req.id] = req
        if path is None:
            future.set_result(PipelineOutcome("rejected", route_class, (), (), now, now,
                                              error=reason))
        else:
            self._hop(req)
        return future

    def _operators(self, route_class: int) -> list[str]:
        return [self.problem.operators[k] for k in self.problem.routes[route_class]]

    def _hop(self, req: _Request) -> None:
        """Send ``req``'s next hop to the engine."""
        ops = self._operators(req.route_class)
        hop = len(req.values)
        names = [f"{op}:{v}" for op, v in zip(ops, req.variants, strict=True)]
        try:
            row = req.row if hop == 0 or self.hop_input is None else \
                self.hop_input(ops[hop], req.values[-1], req.row)
            fut = self.engine.submit(row, names[hop], deadline_s=req.deadline_s,
                                     route=names[hop + 1:], job=self._job(req))
        except Exception as exc:  # noqa: BLE001 - the request's outcome, not the caller's
            self._put(req, None, f"{type(exc).__name__}: {exc}")
            return
        fut.add_done_callback(lambda f: self._put(req, f.result(), None))

    def _job(self, req: _Request) -> Hashable:
        return ("pipeline", id(self), req.id)

    def _put(self, req: _Request, outcome: Outcome | None, error: str | None) -> None:
        """A hop ended (on the engine's scheduler thread): the forwarder takes it on."""
        with self._wake:
            self._forward.append((req, outcome, error))
            self._wake.notify()

    def _forwarder(self) -> None:
        """Later hops, off the engine's scheduler thread (a done callback must not submit)."""
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._forward or self._stop.is_set() and
                                    not self._inside)
                if not self._forward:
                    return
                req, outcome, error = self._forward.pop(0)
            try:
                if outcome is None:
                    self._finish(req, "error", error)
                elif outcome.status != "ok":
                    self._finish(req, outcome.status, outcome.error)
                else:
                    req.values.append(outcome.value)
                    if len(req.values) == len(req.variants):
                        self._finish(req, "ok", None)
                    else:
                        self._reroute(req)
                        self._hop(req)
            except Exception as exc:  # noqa: BLE001 - this thread must never die
                self._finish(req, "error", f"{type(exc).__name__}: {exc}")

    def _reroute(self, req: _Request) -> None:
        """A change of allocation since ``req``'s path was drawn: its later hops take a
        path of the new allocation drawn for its class (kept where the new one carries none
        of it)."""
        with self._lock:
            if req.epoch == self._epoch:
                return
            req.epoch = self._epoch
            path = path_for(self._table, req.route_class, self._rng, carried=True)
            hop = len(req.values)
            if path is None or path[hop:] == req.variants[hop:]:
                return
            req.variants = req.variants[:hop] + path[hop:]
            if not req.moved:
                self.moved += 1
            req.moved = True

    def _finish(self, req: _Request, status: Status, error: str | None) -> bool:
        """End ``req`` with its one outcome (False: it had ended already)."""
        with self._lock:
            if self._inside.pop(req.id, None) is None:
                return False  # already ended (at shutdown)
            self._idle.notify_all()
        now = self.engine.clock.now()
        req.future.set_result(PipelineOutcome(
            status, req.route_class, req.variants[:len(req.values) + (status != "ok")],
            tuple(req.values), req.arrival_s, now, req.moved, error))
        return True

    @property
    def inside(self) -> int:
        """Requests in the pipeline now (queued or in service at some hop)."""
        with self._lock:
            return len(self._inside)

    # -- the controller ---------------------------------------------------------------------

    def _control(self) -> None:
        """Every period: the rate measured, the next demand decided and solved; with a
        ``ClosedLoop`` of ``checks`` > 1 also ``checks - 1`` readings of the backlog and of
        the rate so far inside each period, re-solving at once when the demand jumped
        (``Controller.urgent``). A rate is arrivals over the seconds that really passed since
        the period began; readings a slow solve or swap overran are skipped, not bunched."""
        assert self.period_s is not None
        closed = self.control if isinstance(self.control, ClosedLoop) else None
        checks = closed.checks if closed is not None else 1
        step_s = self.period_s / checks
        clock = self.engine.clock
        began = clock.now()  # the period running now
        reading, boundary = 0, began + step_s
        while not self._stop.wait(max(boundary - clock.now(), 0.0)):
            now = clock.now()
            while boundary + step_s <= now:  # overran: skip to the latest reading due
                boundary += step_s
                reading += 1
            reading += 1
            ends = reading % checks == 0
            with self._lock:
                inside = len(self._inside)
                rate_so_far = self._arrivals / max(now - began, 1e-9)
                if ends:
                    rate, self._arrivals = rate_so_far, 0
            backlog = inside / closed.drain if closed is not None else 0.0
            if ends:
                began = now
                self._controller.measured(rate)
                demand: float | None = self._controller.decide(backlog)
            else:
                demand = self._controller.urgent(backlog, rate_so_far)
            if demand is not None:
                self._resolve(demand)
            boundary += step_s

    def _resolve(self, demand: float) -> None:
        """Solve for ``demand``; put the allocation in place where it changed, or where an
        earlier swap failed part of the way (a plan in service is not the allocation's)."""
        try:
            problem, allocation = self.solver(demand)
            changed = (allocation.hosts, allocation.shares) != (self.allocation.hosts,
                                                                self.allocation.shares)
            plans = serve_allocation(problem, allocation, self.devices, self.max_wait_s).plans
            if changed or any(self._placed.get(p.operator) != p for p in plans):
                swapped = self._place(problem, allocation, plans, reroute=changed)
                self.changes.append(AllocationChange(
                    self.engine.clock.now(), demand, tuple(allocation.describe(problem)),
                    swapped))
        except Exception as exc:  # noqa: BLE001 - the next reading tries again
            if self._stop.is_set():
                return  # shut down during the swap
            self.control_errors.append(f"{type(exc).__name__}: {exc}")
            del self.control_errors[:-8]

    def _place(self, problem: AllocationProblem, allocation: Allocation,
               plans: Sequence[GearPlan] | None = None, reroute: bool = True
               ) -> tuple[str, ...]:
        """Swap in the plans of the variants ``allocation`` places (``plans``, if already
        served; each only where its placement changed), then route new requests by it
        (``reroute``: and the requests inside at their next hop; not when only a failed swap
        is finished)."""
        if plans is None:
            plans = serve_allocation(problem, allocation, self.devices, self.max_wait_s).plans
        swapped = []
        for plan in plans:
            if self._placed.get(plan.operator) != plan:
                self.engine.swap_plan(plan)
                self._placed[plan.operator] = plan
                swapped.append(plan.operator)
        with self._lock:
            self.problem, self.allocation = problem, allocation
            self._table = route_table(problem, allocation)
            self._epoch += reroute
        return tuple(swapped)


__all__ = ["AllocatedPipeline", "AllocationChange", "PipelineOutcome"]
