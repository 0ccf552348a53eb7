"""Admission by latency target (DESIGN.md section 14): whether an online request can still be
answered within its plan's latency target by some replica of its first stage, from the
profiled work queued ahead of it there, the later stages' work it will bring, and how much
slower than its profile serving runs; and which replica it goes to (a reloading one is routed
around).

``Admission`` holds what it learns while serving — escalation rates per (cascade, stage) and
the slowdown per operator — and answers ``place`` for the engine's scheduler thread (one
thread: nothing here is locked).
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import numpy as np

from ken.models.cascade import Cascade
from ken.policy.plan import GearPlan
from ken.policy.scheduling import Dispatcher, WallClock

#: answered rows of a cascade's stage before admission trusts its measured escalation rate
MIN_ESCALATION_ROWS = 20
#: seconds after which a request admitted and still waiting is no longer held by ``Slowdown``
FORGET_WAITING_S = 600.0
#: the least latency target a plan's predicted p99 sets: models faster than the engine's own
#: hand-offs between threads (about a millisecond each) are simulated with p99s no wall-clock
#: engine can meet, and would have every request turned away
MIN_PLAN_TARGET_S = 0.02

AdmissionMode = Literal["plan", "max_in_flight"]


@dataclass(frozen=True)
class Placed:
    """Where admission queues a request (a first-stage replica), or, with ``reason``, why it
    turned the request away and after how many seconds to retry."""

    replica: int
    reason: str | None = None
    retry_after_s: float | None = None


@dataclass(frozen=True)
class _Estimate:
    """A request's latency at one replica: the busiest of its devices, the profiled work
    waiting there, one row's own cost, all of it without and with the measured slowdown."""

    replica: int
    device: str
    wait_s: float
    row_s: float
    raw_s: float
    expected_s: float


class Slowdown:
    """How much longer than its admission estimate a request admitted near the latency target
    takes to be answered: the ``quantile`` of the ratios of answered latency over estimate
    seen in the last ``horizon_s`` seconds (at most ``window`` of them), at least 1; 1 when
    there are none. A high quantile, not the mean: requests whose rows escalate wait in later
    stages' queues too, and admission holds the tail to the target. A recent window, not all
    history: a worker restart delays the requests behind it by seconds, and that must not
    keep admission shut once the worker is back.

    Requests still waiting count too (``admitted``): one that has waited ``w`` seconds will
    take at least ``w`` over its estimate, so when such lower bounds reach past the answered
    quantile, the quantile is taken over the answered ratios and the lower bounds together
    (requests admitted more than ``horizon_s`` ago are left out of it; their answers are still
    learnt when they come, and one still waiting after ``FORGET_WAITING_S`` is forgotten).
    When the machine slows, the slowest requests are answered last: counting only answers
    would learn the slowdown a target's wait after admission had filled the queues at the old
    speed."""

    def __init__(self, quantile: float = 0.95, window: int = 400, horizon_s: float = 5.0,
                 every: int = 20, waiting_every_s: float = 0.02) -> None:
        self.quantile, self.horizon_s, self.every = quantile, horizon_s, every
        self.waiting_every_s = waiting_every_s
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)  # (time, ratio)
        self._value = 1.0
        self._new = 0
        self._pending: dict[int, tuple[float, float]] = {}  # rid -> (admitted at, estimate)
        self._waiting, self._waiting_at = 1.0, -math.inf

    def add(self, ratio: float, now: float) -> None:
        # never below 1: profiles time each model alone, serving is not faster than that
        self.samples.append((now, _ratio(ratio)))
        self._new += 1
        if self._new >= self.every:
            self._refresh()

    def admitted(self, rid: int, estimate_s: float, now: float) -> None:
        """Request ``rid`` was admitted at ``now`` with this estimate of its latency."""
        if estimate_s > 0:
            self._pending[rid] = (now, estimate_s)

    def answered(self, rid: int, latency_s: float, now: float) -> None:
        """Request ``rid`` was answered ``latency_s`` after it arrived: its ratio is learnt
        if it was ``admitted`` (and is still waiting) here."""
        pending = self._pending.pop(rid, None)
        if pending is not None:
            self.add(latency_s / pending[1], now)

    def forget(self, rid: int) -> None:
        """Request ``rid`` ends otherwise (a failed attempt says nothing about queueing)."""
        self._pending.pop(rid, None)

    def forget_all(self) -> None:
        self._pending.clear()

    @property
    def waiting(self) -> int:
        """Requests admitted and not yet answered or forgotten."""
        return len(self._pending)

    def value(self, now: float) -> float:
        """The slowdown to apply now (samples older than ``horizon_s`` are forgotten)."""
        stale = False
        while self.samples and self.samples[0][0] < now - self.horizon_s:
            self.samples.popleft()
            stale = True
        if stale:
            self._refresh()
        if now - self._waiting_at >= self.waiting_every_s:
            self._waiting, self._waiting_at = self._with_waiting(now), now
        return max(self._value, self._waiting)

    def _with_waiting(self, now: float) -> float:
        """The quantile over answered ratios and waiting requests' lower bounds, when any of
        those can raise it; 1 otherwise."""
        lost = now - FORGET_WAITING_S
        for rid in [r for r, (t, _) in self._pending.items() if t < lost]:
            del self._pending[rid]  # a bound on what is held, were an end ever missed
        old = now - self.horizon_s
        lows = [(now - t) / e for t, e in self._pending.values() if t >= old]
        if not lows or max(lows) <= self._value:
            return 1.0
        ratios = [r for _, r in self.samples] + [_ratio(r) for r in lows]
        return float(np.quantile(ratios, self.quantile))

    def _refresh(self) -> None:
        self._new = 0
        self._value = (float(np.quantile([r for _, r in self.samples], self.quantile))
                       if self.samples else 1.0)


def _ratio(ratio: float) -> float:
    """A latency-over-estimate ratio as the slowdown counts it: at least 1, at most 50."""
    return min(max(ratio, 1.0), 50.0)


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

    def place(self, disp: Dispatcher, rid: int, routed: int,
              device_work: Callable[[], Mapping[str, float]],
              reloading: Collection[str] = frozenset()) -> Placed:
        """The first-stage replica of ``disp``'s plan to queue request ``rid`` at, or why no
        replica can answer it within the latency target and when to retry.

        ``routed`` (the router's pick, which keeps the plan's shares) when it can; else the
        replica of the stage that would answer soonest, when that one can: a request is
        turned away only while no replica of the stage could serve it in time. Replicas on
        ``reloading`` devices (a worker loading its models afresh after a crash or a kill:
        seconds the profile does not know) are routed around while another replica
        remains. A plan admission does not check gets ``routed``, or another replica when
        ``routed`` is reloading.

        A replica's latency for the request is estimated as the profiled work queued on
        (and running on) its devices (``device_work``: seconds per device) plus the
        request's own row, plus the later stages' work that it and the rows queued ahead of
        it will bring (``downstream_row_s``), times the slowdown measured while serving
        (``answered``): profiles time each model alone, and serving runs the same batches
        slower on a busy machine."""
        plan = disp.plan
        ready = list(disp.first_stage_replicas(avoid=reloading))
        if routed not in ready:
            ready = ready or [routed]
            routed = ready[0]
        target = self.target_s(plan)
        if target is None:
            return Placed(routed)
        work = device_work()
        now = self.clock.now()
        slowdown = self._slowdown[plan.operator].value(now)

        def fits(e: _Estimate) -> bool:  # an idle replica admits whatever the target says
            return e.wait_s <= 0.0 or e.expected_s <= target

        best = self._estimate(disp, routed, work, slowdown)
        if not fits(best):
            others = [self._estimate(disp, r, work, slowdown) for r in ready if r != routed]
            best = min([best, *others], key=lambda e: (not fits(e), e.expected_s))
        if fits(best):
            if best.wait_s > 0.0 and best.expected_s >= target / 2:
                # near the limit: learn how far off the estimate is
                self._slowdown[plan.operator].admitted(rid, best.raw_s, now)
            return Placed(best.replica)
        retry = max(best.expected_s - target, best.row_s * slowdown)
        where = best.device if len(ready) == 1 else \
            f"{best.device} (the least loaded of its {len(ready)} replicas)"
        return Placed(routed, (
            f"{plan.operator}() is over capacity: its queue on {where} holds about "
            f"{best.wait_s * 1000:.0f} ms of profiled work (x{slowdown:.1f} as measured while "
            f"serving), so this request would miss the latency target of "
            f"{target * 1000:.0f} ms; retry in {retry * 1000:.0f} ms"), retry)

    def _estimate(self, disp: Dispatcher, replica: int, work: Mapping[str, float],
                  slowdown: float) -> _Estimate:
        plan = disp.plan
        device = max(plan.placement[replica].devices, key=lambda d: work.get(d, 0.0))
        wait = work.get(device, 0.0)
        row = plan.batch_seconds(replica, 1) or 0.0  # one more row costs at most a batch of 1
        raw = wait + row + (disp.queued(replica) + 1) * self.downstream_row_s(disp)
        return _Estimate(replica, device, wait, row, raw, raw * slowdown)

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
        slowdown (requests admitted near the limit only: the one operator whose ``Slowdown``
        waits for it learns it)."""
        now = self.clock.now()
        for slowdown in self._slowdown.values():
            slowdown.answered(rid, latency_s, now)

    def forget(self, rid: int) -> None:
        """Request ``rid`` ends otherwise (a failed attempt says nothing about queueing)."""
        for slowdown in self._slowdown.values():
            slowdown.forget(rid)

    def forget_all(self) -> None:
        for slowdown in self._slowdown.values():
            slowdown.forget_all()
