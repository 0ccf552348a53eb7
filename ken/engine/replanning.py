"""Re-planning while serving (issue 33): a background thread that watches what an operator's
gear plan assumed and swaps in a new plan when the workload leaves it.

Every ``poll_s`` the ``Replanner`` gives a ``DriftWatch`` (``ken.policy.drift``) the arrivals
of the last ``window_s`` (``Engine.recent_arrivals``: every online request submitted, admitted
or not), the latencies of the requests answered then (``Engine.recent_answers``; judged
against ``latency_limit_ms``, e.g. the user's latency target), the per-stage escalation counts
admission keeps, the answers of the window and the operator's requests in flight
(``Engine.recent_answers``, ``Engine.in_flight_of``) and, where given, how the model calls of
the window compared with the plan's runtimes (``runtimes``). On a drift it builds a trace of
the requests in flight (the backlog, arriving at once) and the last ``window_s`` of arrivals
repeated to fill ``history_s`` (the new load, sustained), calls ``replan(trace, drift)``
(``GearReplan``: a new frontier for that load, the plan picked for the user's target) while the
engine keeps serving the old plan (in a helper thread, the watching thread watching meanwhile:
see below), and swaps the new plan in (``Engine.swap_plan``: queued rows move to the new plan,
running batches finish under the old one, nothing is lost). It then waits ``settle_s`` before
it watches again, so the new plan's first seconds (its queues draining) are not taken for
another drift (a stop-gap swapped in while a re-plan runs gets no such wait: it is judged only
by a backlog that grew over its limit after the swap). Every swap is a ``ReplanEvent`` in
``events`` and a line in the serving log (``on_event``, by default the progress reporter's
note).

Where ``replan`` can be pickled (``GearReplan`` can), it runs in a child process at a lower
CPU priority (``planner_process.PlannerProcess``, started with the watch): planning then
takes neither this process's interpreter from the engine's threads nor, on a machine the
workers fill, a core from the workers. What the call changed in ``replan`` (a ``GearReplan``
keeps the catalog a drift changed) is copied back into it. A ``replan`` that cannot be pickled
(a closure) runs in this process, in the helper thread (with ``early=False``, in the watching
thread), as ``isolate=False`` asks for; it may then run while the watching thread calls its
``stopgap``.

A re-plan takes seconds, most on a machine the load overwhelms. Where ``replan`` has a
``stopgap(drift, plan)`` (``GearReplan``: one of the one-gear plans the operator was planned
with that sustains the load, chosen without simulating), a rate or latency drift first swaps
that plan in at once (a ``ReplanEvent`` with ``stopgap`` set), and the re-plan then replaces
it. Each drift carries how many requests the window answered (``Drift.served_qps``) and how
many are in flight (``Drift.backlog``): where serving falls behind the arrivals (or its
backlog grows past what the latency limit allows), both the stop-gap and the re-plan take
what it answered as what the plan really sustains on this machine.

An overload often shows in full only after the drift that started it: a drift fires within a
second or two of a step in the load, while the window still averages in the load before, and
the stop-gap and the re-plan are sized for that. So every re-plan is watched while it runs:
if the plan serving (the old one, or the stop-gap) falls behind meanwhile by its backlog
(``Drift.behind_s``), the stop-gap for that drift is swapped in at once, and the plan the
re-plan returns, made for a load or a capacity serving has since disproved, is dropped for
one planned on that drift (what the dropped re-plan changed in ``replan`` is undone first).

Answers to requests that arrived in the first ``settle_s`` after the watch starts are not
judged against the latency limit (nor, after a swap, those that arrived before it): the first
seconds of a freshly started engine run cold and say little of the plan.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ken.engine.planner_process import PlannerProcess, picklable
from ken.engine.serving import Engine
from ken.engine.supervision import BatchRecord
from ken.errors import KenError
from ken.models.cascade import Cascade
from ken.optimizer.workload import Trace
from ken.policy.drift import Drift, DriftWatch
from ken.policy.plan import GearPlan
from ken.progress import QUIET, Reporter

#: how many of the watch's own errors ``Replanner.watch_errors`` keeps
WATCH_ERRORS = 20


@dataclass(frozen=True)
class ReplanEvent:
    """One re-plan: when the drift was seen, why, how long planning took, and the swap."""

    at_s: float  # engine clock, when the drift was seen
    drift: Drift
    planning_s: float
    swapped_at_s: float  # engine clock, when the new plan took over
    moved: int  # queued rows moved to the new plan
    old: str  # the plans' one-line summaries
    new: str
    error: str = ""  # planning failed: the old plan stays
    stopgap: bool = False  # swapped in at once, before the re-plan (``GearReplan.stopgap``)

    def line(self) -> str:
        if self.stopgap and self.error:
            return (f"stop-gap at {self.at_s:.1f} s failed ({self.error}); serving the old plan "
                    f"while the re-plan runs. Why: {self.drift.detail}")
        if self.stopgap:
            return (f"fell back at {self.at_s:.1f} s ({self.drift.kind}: {self.drift.detail}) "
                    f"to a one-gear plan of the frontier, swapped at {self.swapped_at_s:.1f} s "
                    f"while the re-plan runs, {self.moved} queued rows moved; was: {self.old}; "
                    f"now: {self.new}")
        if self.error:
            return (f"re-plan at {self.at_s:.1f} s failed ({self.error}); serving the old plan. "
                    f"Why: {self.drift.detail}")
        return (f"re-planned at {self.at_s:.1f} s ({self.drift.kind}: {self.drift.detail}); "
                f"planning took {self.planning_s:.1f} s; swapped at {self.swapped_at_s:.1f} s, "
                f"{self.moved} queued rows moved; was: {self.old}; now: {self.new}")


class Replanner:
    """Re-plans ``operator`` of a started ``engine`` (see the module docstring).

    ``replan(trace, drift)`` returns the plan to swap in; ``expected(plan)`` the share of rows
    each stage of each of its cascades is expected to pass on (``GearReplan.expected``);
    ``runtimes(batch_log, since_s)``, where given, the mean ratio of the engine's model calls
    since then to the runtimes the plan was made with, and how many
    (``calibrate.recent_ratio`` against ``GearReplan.catalog``): a *runtime* drift beyond
    ``runtime_shift``. ``isolate`` (default): plan in a child process where ``replan`` can
    be pickled (see the module docstring): ``planner``, one shared with other watches (its
    owner closes it), else one of this watch's own. ``early`` (default): judge serving behind
    by its backlog too and watch while re-planning (see the module docstring); False: by the
    window's counts alone, as before 2026-11-29 (the A/B of ``benchmarks/robustness.py``)."""

    def __init__(self, engine: Engine, operator: str,
                 replan: Callable[[Trace, Drift], GearPlan],
                 expected: Callable[[GearPlan], Mapping[Cascade, tuple[float, ...]]], *,
                 window_s: float = 5.0, history_s: float = 15.0, poll_s: float = 0.25,
                 settle_s: float = 5.0, rate_factor: float = 1.25,
                 escalation_shift: float = 0.1, min_rows: int = 100,
                 latency_limit_ms: float | None = None, reporter: Reporter = QUIET,
                 on_event: Callable[[ReplanEvent], None] | None = None,
                 runtimes: Callable[[Sequence[BatchRecord], float],
                                    tuple[float, int] | None] | None = None,
                 runtime_shift: float = 0.25, isolate: bool = True,
                 planner: PlannerProcess | None = None, early: bool = True) -> None:
        if history_s < window_s or poll_s <= 0 or settle_s < 0:
            raise KenError("history_s must be >= window_s, poll_s > 0 and settle_s >= 0")
        self.engine = engine
        self.operator = operator
        self.replan = replan
        self.expected = expected
        self.history_s = history_s
        self.poll_s = poll_s
        self.settle_s = settle_s
        plan = engine.plans[operator]
        self.runtimes = runtimes
        self.watch = DriftWatch(plan, expected(plan), window_s, rate_factor,
                                escalation_shift, min_rows, latency_limit_ms, runtime_shift)
        self.events: list[ReplanEvent] = []
        # errors of the watch itself (engine clock, message), the latest ``WATCH_ERRORS``
        self.watch_errors: list[tuple[float, str]] = []
        self._failing: str | None = None  # the watch's error said last in the serving log
        self._reporter = reporter
        self._on_event = on_event or (lambda e: reporter.note(f"{operator}: {e.line()}"))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._quiet_until = 0.0
        # engine clock of the last swap (at start: the end of the first settle_s); answers to
        # requests that arrived before it are not judged against the latency limit
        self._swapped_at = -float("inf")
        self.early = early
        self.planner = (planner or PlannerProcess()) if isolate and picklable(replan) else None
        self._owns_planner = planner is None

    def start(self) -> Replanner:
        if self._thread is not None:
            raise KenError("this replanner is already running")
        if self.planner is not None:
            self.planner.start()  # its imports paid now, not when a drift is seen
        self._quiet_until = self.engine.clock.now() + self.settle_s
        self._swapped_at = self._quiet_until
        self._thread = threading.Thread(target=self._run, name=f"ken-replan-{self.operator}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (a re-plan under way finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.planner is not None and self._owns_planner:
            self.planner.close()

    def __enter__(self) -> Replanner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.engine.clock.now() < self._quiet_until:
                continue
            seen = self._watched()
            if seen is None:
                continue
            try:
                self._handle(*seen)
            except Exception as exc:  # noqa: BLE001 - recorded; the watch goes on
                self._quiet_until = self.engine.clock.now() + self.settle_s
                self._watch_failed(exc)

    def _watched(self) -> tuple[Drift, list[float]] | None:
        """``_look``, with an error recorded (``_watch_failed``) rather than raised: a read
        that failed once (the engine's logs change under it) must neither end the watch
        for good nor throw away a re-plan it watches."""
        try:
            return self._look()
        except Exception as exc:  # noqa: BLE001 - recorded; the watch goes on
            self._watch_failed(exc)
            return None

    def _watch_failed(self, exc: Exception) -> None:
        """Record an error of the watch itself in ``watch_errors`` (the last
        ``WATCH_ERRORS``) and in the serving log, unless it is the error said there last."""
        message = f"{type(exc).__name__}: {exc}"
        now = self.engine.clock.now()
        self.watch_errors.append((now, message))
        del self.watch_errors[:-WATCH_ERRORS]
        if message != self._failing:
            self._failing = message
            self._reporter.note(f"{self.operator}: the re-planning watch failed at {now:.1f} s "
                                f"({message}); it goes on watching")

    def _look(self) -> tuple[Drift, list[float]] | None:
        """The drift the watch sees now, if any, with the last ``window_s`` of arrivals."""
        now = self.engine.clock.now()
        since = now - self.watch.window_s
        arrivals = self.engine.recent_arrivals(self.operator, since)
        # every answer of the window, whenever it arrived: what serving kept up with
        rows = self.engine.recent_answers(self.operator, since)
        answered = rows[:, 0]
        # requests that arrived before the last swap waited in the old plan's backlog:
        # their latencies say nothing of the plan serving now
        latencies = 1000.0 * rows[rows[:, 0] - rows[:, 1] > self._swapped_at, 1]
        runtime = None if self.runtimes is None else self.runtimes(
            self.engine.batch_log, max(since, self._swapped_at))
        backlog = self.engine.in_flight_of(self.operator) if self.early else None
        drift = self.watch.check(now, arrivals, self.engine.admission.escalations,
                                 latencies, runtime, answered, backlog)
        return None if drift is None else (drift, arrivals)

    def _trace(self, now: float, arrivals: list[float]) -> Trace:
        """What to plan on: the requests in flight now (the backlog the new plan must drain)
        arriving at once, then ``arrivals`` (those of the last ``window_s``: the load that
        drifted, not the older load it replaced) repeated to fill ``history_s``, so the
        planner sees that load sustained, bursts included."""
        window = self.watch.window_s
        times = np.asarray(arrivals, dtype=np.float64)
        if times.size < 2:
            raise KenError("too few recent arrivals to plan on")
        times = times - (now - window)
        copies = max(1, int(np.ceil(self.history_s / window)))
        backlog = self.engine.in_flight_of(self.operator)
        tiled = np.concatenate([np.zeros(backlog),
                                *(times + k * window for k in range(copies))])
        return Trace(np.sort(tiled), f"{self.operator} serving: {backlog} queued, then the "
                                     f"last {window:g} s x {copies}")

    def _stopgap(self, drift: Drift, old: GearPlan) -> GearPlan:
        """Swap in ``replan.stopgap``'s plan at once, where it has one for ``drift``; the plan
        serving afterwards."""
        pick = getattr(self.replan, "stopgap", None)
        if pick is None:
            return old
        started = time.perf_counter()
        try:
            quick = pick(drift, old)
            if quick is None or quick == old:
                return old
            expected = self.expected(quick)
            moved = self.engine.swap_plan(quick)
        except Exception as exc:  # noqa: BLE001 - the re-plan still follows
            self._record(ReplanEvent(drift.at_s, drift, time.perf_counter() - started,
                                     self.engine.clock.now(), 0, describe(old), describe(old),
                                     error=f"{type(exc).__name__}: {exc}", stopgap=True))
            return old
        self._swapped_at = self.engine.clock.now()
        self.watch.rebase(quick, expected)
        self._record(ReplanEvent(drift.at_s, drift, time.perf_counter() - started,
                                 self._swapped_at, moved, describe(old), describe(quick),
                                 stopgap=True))
        return quick

    def _record(self, event: ReplanEvent) -> None:
        self.events.append(event)
        self._on_event(event)

    def _handle(self, drift: Drift, arrivals: list[float]) -> None:
        engine, old = self.engine, self.engine.plans[self.operator]
        started = time.perf_counter()
        # what a re-plan for a rate or latency drift may change in itself (``GearReplan``: its
        # margin), undone if its plan is dropped (a runtime or escalation drift's rescaled or
        # resampled catalog is kept: the re-plan that follows does not measure it again)
        state = (dict(vars(self.replan)) if hasattr(self.replan, "__dict__")
                 and drift.kind in ("rate", "latency") else None)
        try:
            trace = self._trace(drift.at_s, arrivals)  # the backlog as the drift left it
            old = self._stopgap(drift, old)
            started = time.perf_counter()  # the re-plan's own time, the stop-gap's swap apart
            new, error, late = self._plan_watching(trace, drift)
            if late is not None and not self._stop.is_set():
                # serving fell behind while it planned: that plan was made for a load or a
                # capacity serving has since disproved; plan again on that drift
                drift, trace = late
                old = engine.plans[self.operator]
                if state is not None:
                    restore(self.replan, state)
                started = time.perf_counter()
                new, error = self._plan(trace, drift), None
            if error is not None:
                raise error
            if new is None:
                raise KenError("the re-plan returned no plan")
            planning_s = time.perf_counter() - started
            moved = engine.swap_plan(new)
        except Exception as exc:  # noqa: BLE001 - a failed re-plan keeps the old plan serving
            serving = engine.plans[self.operator]
            event = ReplanEvent(drift.at_s, drift, time.perf_counter() - started,
                                engine.clock.now(), 0, describe(serving), describe(serving),
                                error=f"{type(exc).__name__}: {exc}")
        else:
            self._swapped_at = engine.clock.now()
            event = ReplanEvent(drift.at_s, drift, planning_s, self._swapped_at, moved,
                                describe(old), describe(new))
            self.watch.rebase(new, self.expected(new))
        self._quiet_until = engine.clock.now() + self.settle_s
        self._record(event)

    def _plan_watching(self, trace: Trace, drift: Drift
                       ) -> tuple[GearPlan | None, BaseException | None,
                                  tuple[Drift, Trace] | None]:
        """``_plan(trace, drift)``, watching serving meanwhile: a re-plan on a machine the
        load overwhelms takes tens of seconds, and an overload often shows in full only after
        the drift that started it (the rate's window still averages in the load before), so
        the plan serving (the old one, or a stop-gap sized for that drift) may fall behind
        while it plans. When its backlog says so (``Drift.behind_s``) on a rate or latency
        drift (unless ``drift`` was behind already and the backlog's run began before it:
        that is what this re-plan is for), the stop-gap for that drift is swapped in at once
        (one per re-plan); returns the plan (None: the re-plan failed), its error, and that
        drift and the trace to plan on again, if one was seen."""
        if not self.early:
            return self._plan(trace, drift), None, None
        box: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["plan"] = self._plan(trace, drift)
            except BaseException as exc:  # noqa: BLE001 - raised in the watching thread
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=work, name=f"ken-replan-{self.operator}-planning",
                         daemon=True).start()
        late: tuple[Drift, Trace] | None = None
        try:
            while not done.wait(self.poll_s):
                seen = None if late is not None or self._stop.is_set() else self._watched()
                if seen is None or not behind_anew(seen[0], drift):
                    continue
                try:
                    late = (seen[0], self._trace(seen[0].at_s, seen[1]))
                except KenError:
                    continue
                try:
                    self._stopgap(seen[0], self.engine.plans[self.operator])
                except Exception as exc:  # noqa: BLE001 - e.g. a user's on_event: the
                    self._watch_failed(exc)  # re-plan goes on
        finally:
            done.wait()  # an error above: the planning thread ends before this returns
        return box.get("plan"), box.get("error"), late

    def _plan(self, trace: Trace, drift: Drift) -> GearPlan:
        """``replan(trace, drift)``, in the planner process where there is one."""
        if self.planner is None:
            return self.replan(trace, drift)
        plan, after = self.planner.call(self.replan, trace, drift)
        if type(after) is type(self.replan) and hasattr(after, "__dict__"):
            vars(self.replan).update(vars(after))  # what the call changed, kept here
        return plan


def behind_anew(seen: Drift, drift: Drift) -> bool:
    """``seen``, while the re-plan for ``drift`` runs, says serving fell behind by its backlog
    (the window's counts still hold the time before the last swap) on a rate or latency drift,
    and that is news: not the backlog ``drift`` already found behind (what the re-plan is
    for)."""
    if seen.kind not in ("rate", "latency") or not seen.behind_s:
        return False
    known = drift.saturated and seen.behind_since_s is not None \
        and seen.behind_since_s < drift.at_s
    return not known


def restore(obj: object, state: Mapping[str, Any]) -> None:
    """Give ``obj`` back the attributes ``state`` saved (set each, remove those added since:
    never an instant without them, for a thread reading them meanwhile)."""
    for name in set(vars(obj)) - set(state):
        delattr(obj, name)
    for name, value in state.items():
        setattr(obj, name, value)


def describe(plan: GearPlan) -> str:
    """A plan on one line: its gears and, when simulated, what was predicted."""
    p = plan.predicted
    guess = "" if p is None else f" (predicted {p.accuracy:.1%}, p95 {p.p95_ms:.0f} ms)"
    return f"{plan.headline()}{guess}"
