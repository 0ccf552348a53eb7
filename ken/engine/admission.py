"""Admission by latency target (DESIGN.md section 14): whether an online request can still be
answered within its plan's latency target, from the profiled work queued ahead of it, the
later stages' work it will bring, and how much slower than its profile serving runs.

``Admission`` holds what it learns while serving — escalation rates per (cascade, stage) and
the slowdown per operator — and answers ``check`` for the engine's scheduler thread (one
thread: nothing here is locked).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Literal

import numpy as np

from ken.models.cascade import Cascade
from ken.policy.plan import GearPlan
from ken.policy.scheduling import Dispatcher, WallClock

#: answered rows of a cascade's stage before admission trusts its measured escalation rate
MIN_ESCALATION_ROWS = 20
#: the least latency target a plan's predicted p99 sets: models faster than the engine's own
#: hand-offs between threads (about a millisecond each) are simulated with p99s no wall-clock
#: engine can meet, and would have every request turned away
MIN_PLAN_TARGET_S = 0.02

AdmissionMode = Literal["plan", "max_in_flight"]


class Slowdown:
    """How much longer than its admission estimate a request admitted near the latency target
    takes to be answered: the ``quantile`` of the ratios of answered latency over estimate
    seen in the last ``horizon_s`` seconds (at most ``window`` of them), at least 1; 1 when
    there are none. A high quantile, not the mean: requests whose rows escalate wait in later
    stages' queues too, and admission holds the tail to the target. A recent window, not all
    history: a worker restart delays the requests behind it by seconds, and that must not
    keep admission shut once the worker is back."""

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


class Admission:
    """Admission of online requests to gear plans. ``mode="plan"`` admits a request while its
    estimated latency is within ``latency_target_s`` (default: each plan's predicted p99, at
    least ``MIN_PLAN_TARGET_S``); a plan without predicted latency or profiled runtimes, and
    every plan with ``mode="max_in_flight"``, is not checked here (the engine's
    ``max_in_flight`` alone bounds it)."""

    def __init__(self, clock: WallClock, mode: AdmissionMode = "plan",
                 latency_target_s: float | None = None) -> None:
        self.clock = clock
        self.mode = mode
        self.latency_target_s = latency_target_s
        # operator -> latency over estimate
        self._slowdown: defaultdict[str, Slowdown] = defaultdict(Slowdown)
        # (cascade, stage) -> (rows answered at that stage, rows escalated from it): a rate
        # belongs to a stage's threshold, so other gears and swapped-in plans start cold
        self._escalations: dict[tuple[Cascade, int], tuple[int, int]] = {}
        self._estimated: dict[int, tuple[str, float]] = {}  # rid -> (operator, estimate s)

    @property
    def escalations(self) -> Mapping[tuple[Cascade, int], tuple[int, int]]:
        """``(rows answered, rows escalated)`` per (cascade, stage) counted so far."""
        return MappingProxyType(self._escalations)

    def target_s(self, plan: GearPlan) -> float | None:
        """The latency target admission holds ``plan``'s requests to; None when it does not
        check them."""
        if self.mode != "plan" or not plan.batch_runtime_s:
            return None
        if self.latency_target_s is not None:
            return self.latency_target_s
        target = plan.latency_target_s()
        return None if target is None else max(target, MIN_PLAN_TARGET_S)

    def check(self, disp: Dispatcher, rid: int, replica: int,
              device_work: Callable[[], Mapping[str, float]]) -> tuple[str, float] | None:
        """Why request ``rid``, routed to first-stage ``replica`` of ``disp``'s plan, cannot
        be answered within the latency target, and when to retry; None when it can (or when
        the plan is not checked).

        Its latency is estimated as the profiled work queued on (and running on) the
        replica's devices (``device_work``: seconds per device) plus its own row, plus the
        later stages' work that it and the rows queued ahead of it will bring
        (``downstream_row_s``), times the slowdown measured while serving (``answered``):
        profiles time each model alone, and serving runs the same batches slower on a busy
        machine."""
        plan = disp.plan
        target = self.target_s(plan)
        if target is None:
            return None
        work = device_work()
        device = max(plan.placement[replica].devices, key=lambda d: work.get(d, 0.0))
        wait = work.get(device, 0.0)
        if wait <= 0.0:
            return None  # an idle replica admits whatever the target says
        row = plan.batch_seconds(replica, 1) or 0.0  # one more row costs at most a batch of 1
        raw = wait + row + (disp.queued(replica) + 1) * self.downstream_row_s(disp)
        slowdown = self._slowdown[plan.operator].value(self.clock.now())
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

    def downstream_row_s(self, disp: Dispatcher) -> float:
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

    def count_escalations(self, plan: GearPlan, model: str, gears: Mapping[int, int],
                          escalated: Sequence[int]) -> None:
        """Count a batch of ``model``'s rows (request id -> gear) and those of them that
        ``escalated``, per (cascade, stage) of their gears."""
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

    def answered(self, rid: int, latency_s: float) -> None:
        """Request ``rid`` was answered: add its latency over its estimate to its operator's
        slowdown (requests admitted near the limit only; ``Slowdown``)."""
        estimated = self._estimated.pop(rid, None)
        if estimated is not None:
            operator, seconds = estimated
            self._slowdown[operator].add(latency_s / seconds,
                                                                self.clock.now())

    def forget(self, rid: int) -> None:
        """Request ``rid`` ends otherwise (a failed attempt says nothing about queueing)."""
        self._estimated.pop(rid, None)

    def forget_all(self) -> None:
        self._estimated.clear()
