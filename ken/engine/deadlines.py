"""Deadlines through a pipeline in the online engine (issue 37, item 1): the dropping policy of
``ken.policy.dropping`` — the same ``PipelineDropper`` the simulator runs on its virtual clock
— on the engine's wall clock.

An online request may carry an absolute end-to-end deadline (engine clock) and its route: the
served operators still ahead of it after this one (a pipeline's caller submits each hop to its
operator when the previous hop answered, with the same deadline and the rest of the route).
With a dropping policy (``Engine(..., dropping="proactive")``) every served operator is one
stage of one ``PipelineDropper``, profiled by its plan (``stage_profile``):

- when a request reaches an operator (``EngineDeadlines.arrive``) the dropper's ``enter``
  decides whether it is still worth serving;
- when an operator's ``Dispatcher`` forms a batch, its ``StageGate`` chooses the rows (by
  remaining budget under ``proactive``) and drops the requests that can no longer make it;
  the scheduler collects those drops after each dispatcher call (``take_dropped``).

A dropped request is answered at once with status ``dropped``, its ``error`` the drop's
reason (where and why). Requests without a deadline are never dropped (their deadline is
infinite; under the adaptive priority they are served last while a stage keeps up, first
when it is overloaded, as their budget is the largest).

``DeadlineLedger`` keeps what the deadlines did, per *job* (a pipeline request: the hops that
share a ``job`` key; by default each request is its own job): device seconds charged to it (its
share of every batch it ran in, measured), and how it ended: answered by its last hop (on time
or late), dropped, or ended otherwise (rejected, failed, cancelled: counted late, their device
time wasted). ``deadline_metrics`` turns it into ``DeadlineMetrics``: goodput, drop rate,
wasted model seconds.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from ken.errors import EngineError
from ken.policy.dropping import (
    DeadlineMetrics,
    Drop,
    DropPolicy,
    PipelineDropper,
    StageGate,
    StageProfile,
    deadline_metrics,
)
from ken.policy.dropping import (
    stage_profile as dropping_stage_profile,
)
from ken.policy.plan import GearPlan

#: finished jobs the ledger keeps for ``deadline_metrics``
JOB_LOG = 100_000


@dataclass(frozen=True)
class CallDeadline:
    """The end-to-end deadline of the online calls made in a context (``within``), on the
    monotonic clock (``time.monotonic()``): a query's served calls carry it to the engine,
    converted to the engine's clock (``engine_deadline_s``)."""

    monotonic_s: float

    def engine_deadline_s(self, engine_now_s: float) -> float:
        return self.monotonic_s - time.monotonic() + engine_now_s


_CALL_DEADLINE: ContextVar[CallDeadline | None] = ContextVar("ken_call_deadline", default=None)


@contextmanager
def within(monotonic_s: float) -> Iterator[CallDeadline]:
    """Online engine calls made in this block (this thread or task; a SQL query's served
    function calls included) carry the end-to-end deadline ``monotonic_s``; under a dropping
    policy a call that can no longer make it is dropped (``ken.errors.RequestDropped``)."""
    deadline = CallDeadline(monotonic_s)
    token = _CALL_DEADLINE.set(deadline)
    try:
        yield deadline
    finally:
        _CALL_DEADLINE.reset(token)


def call_deadline() -> CallDeadline | None:
    """The deadline of the enclosing ``within`` block, if any."""
    return _CALL_DEADLINE.get()


def stage_profile(plan: GearPlan) -> StageProfile:
    """What the dropping forecast knows of a served operator: the profiled batch runtimes of
    every replica, and the replicas of each model of each gear's cascade
    (``dropping.stage_profile``) — the
    simulator's ``_stage_profile``, read from the runtimes the plan carries."""
    if not plan.batch_runtime_s:
        raise EngineError(f"dropping needs profiled batch runtimes; the plan of "
                          f"{plan.operator!r} carries none")
    return dropping_stage_profile(plan, lambda rep: plan.batch_runtime_s[rep])


def drop_policy(dropping: DropPolicy | str) -> DropPolicy:
    """A policy, or the name of one (``DropPolicy.named``: ``none``, ``reactive``,
    ``proactive``, ``proactive-profiled``, ``proactive-first-model``)."""
    return dropping if isinstance(dropping, DropPolicy) else DropPolicy.named(dropping)


def job_key(rid: int, job: Hashable | None) -> Hashable:
    """The job a request belongs to: the caller's key, else the request alone."""
    return ("request", rid) if job is None else job


@dataclass
class _Job:
    arrival_s: float
    deadline_s: float
    device_s: float = 0.0


class DeadlineLedger:
    """Per job: arrival (its first hop's), deadline, device seconds and how it ended. Open
    jobs (a hop in flight, or waiting for its caller's next hop) are not in the metrics."""

    def __init__(self, stage_names: Sequence[str], keep: int = JOB_LOG) -> None:
        self.stage_names = tuple(stage_names)
        self._lock = threading.Lock()
        self._open: dict[Hashable, _Job] = {}
        # (arrival, completion, deadline, device s, drop): completion NaN when dropped,
        # +inf when the job ended without an answer otherwise
        self._done: deque[tuple[float, float, float, float, Drop | None]] = deque(maxlen=keep)

    def opened(self, job: Hashable, arrival_s: float, deadline_s: float) -> None:
        with self._lock:
            if job not in self._open:
                self._open[job] = _Job(arrival_s, deadline_s)

    def charge(self, job: Hashable, seconds: float) -> None:
        with self._lock:
            j = self._open.get(job)
            if j is not None:
                j.device_s += seconds

    def closed(self, job: Hashable, completion_s: float, drop: Drop | None = None) -> None:
        with self._lock:
            j = self._open.pop(job, None)
            if j is not None:
                self._done.append((j.arrival_s, completion_s, j.deadline_s, j.device_s, drop))

    def refused(self, job: Hashable, arrival_s: float, deadline_s: float) -> None:
        """A hop of ``job`` was turned away before the scheduler saw it (the engine's
        ``max_in_flight``, or not accepting): the job ends unanswered."""
        with self._lock:
            j = self._open.pop(job, None) or _Job(arrival_s, deadline_s)
            self._done.append((j.arrival_s, math.inf, j.deadline_s, j.device_s, None))

    @property
    def open_jobs(self) -> int:
        with self._lock:
            return len(self._open)

    def metrics(self, since_s: float = -math.inf) -> DeadlineMetrics:
        """The jobs that arrived at or after ``since_s`` and have ended."""
        with self._lock:
            done = [d for d in self._done if d[0] >= since_s]
        drops = [dataclasses.replace(d[4], request_id=i) for i, d in enumerate(done)
                 if d[4] is not None]
        return deadline_metrics([d[0] for d in done], [d[1] for d in done],
                                [d[2] for d in done], drops, [d[3] for d in done],
                                self.stage_names)


class EngineDeadlines:
    """The dropping policy of an engine's operators (see the module docstring). Called from
    the scheduler thread only, except ``ledger`` (any thread)."""

    def __init__(self, policy: DropPolicy, plans: Mapping[str, GearPlan]) -> None:
        self.policy = policy
        self.stage_of = {op: k for k, op in enumerate(plans)}
        self.dropper = PipelineDropper(policy, [stage_profile(p) for p in plans.values()])
        # a policy that neither drops nor reorders needs no gate (as in the simulator)
        gated = (policy.rule, policy.priority) != ("none", "fcfs")
        self._gates = {op: self.dropper.gate(k) for op, k in self.stage_of.items()} \
            if gated else {}
        self.ledger = DeadlineLedger(list(plans))
        self._job: dict[int, tuple[Hashable, bool]] = {}  # rid -> (job, is its last hop)

    def check_route(self, operator: str, route: Sequence[str]) -> tuple[str, ...]:
        """The operators ahead of a request at ``operator``, checked (served, distinct)."""
        route = tuple(route)
        unknown = [r for r in route if r not in self.stage_of]
        if unknown:
            raise EngineError(f"a route names {unknown}, which this engine does not serve "
                              f"under its dropping policy ({', '.join(self.stage_of)})")
        if len(set(route)) != len(route) or operator in route:
            raise EngineError(f"a route passes each operator once; got {operator!r} then "
                              f"{route}")
        return route

    def gate(self, operator: str) -> StageGate | None:
        return self._gates.get(operator)

    def check_swap(self, plan: GearPlan) -> None:
        """A plan to swap in for an operator under the policy must carry profiled runtimes
        (as at the start): the forecast reads them (raises ``EngineError``)."""
        if plan.operator in self.stage_of:
            stage_profile(plan)

    def replanned(self, plan: GearPlan) -> None:
        """``plan`` now serves its operator (a swap; checked by ``check_swap``): the forecast
        reads its runtimes."""
        stage = self.stage_of.get(plan.operator)
        if stage is not None:
            self.dropper.forecast.restage(stage, stage_profile(plan))

    def arrive(self, rid: int, operator: str, now: float, arrival_s: float,
               deadline_s: float | None, route: Sequence[str], job: Hashable | None
               ) -> Drop | None:
        """Request ``rid`` reaches ``operator``: registered with the dropper (an infinite
        deadline when it has none), then asked; its drop, or None."""
        stage = self.stage_of.get(operator)
        if stage is None:  # an operator added later by a plan swap: not under the policy
            return None
        self.dropper.register(rid, math.inf if deadline_s is None else deadline_s,
                              (stage, *(self.stage_of[r] for r in route)))
        if deadline_s is not None:
            key = job_key(rid, job)
            self._job[rid] = (key, not route)
            self.ledger.opened(key, arrival_s, deadline_s)
        return self.dropper.enter(rid, stage, now)

    def take_dropped(self, operator: str) -> list[Drop]:
        """The requests ``operator``'s gate dropped since the last call."""
        gate = self._gates.get(operator)
        return [] if gate is None else gate.take()

    def charge(self, rid: int, seconds: float) -> None:
        """Request ``rid`` ran ``seconds`` of device time (its share of a batch)."""
        entry = self._job.get(rid)
        if entry is not None:
            self.ledger.charge(entry[0], seconds)

    def resolved(self, rid: int, status: str, now: float) -> None:
        """Request ``rid`` got its outcome: the dropper forgets it; its job ends unless it was
        answered with hops still ahead."""
        drop = self.dropper.drops.get(rid)
        self.dropper.forget(rid)
        entry = self._job.pop(rid, None)
        if entry is None:
            return
        job, last = entry
        if status == "ok":
            if last:
                self.ledger.closed(job, now)
        elif status == "dropped":
            self.ledger.closed(job, math.nan, drop)
        else:
            self.ledger.closed(job, math.inf)
