"""What a gear plan assumed against what serving sees (issue 33, re-planning online).

A gear plan is made for a sample workload: its gears cover arrival rates up to its last QPS
edge, and its cascades were chosen for the escalation rates the profiling sample gave each
stage. ``DriftWatch`` compares both with what serving measures and says when the workload has
left what the plan covers:

- *rate*: the arrival rate over the last ``window_s`` is above ``rate_factor`` times the plan's
  top edge (the last gear then serves loads it was never planned for);
- *escalation*: a stage of a cascade in use passed on a share of its rows that differs from the
  share the plan expected by more than ``escalation_shift`` (the inputs got harder or easier),
  over at least ``min_rows`` rows answered in the last ``window_s``;
- *latency*: the p95 of the requests answered in the last ``window_s`` (at least ``min_rows``
  of them) is over ``latency_limit_ms``: the plan does not hold, whatever the cause (the
  simulator's runtimes, the machine's other work, a backlog); or, sooner, serving is behind
  by its backlog (below): the requests waiting will miss the limit before their answers say
  so;
- *runtime*: the model calls of the last ``window_s`` (at least ``min_calls``) took on
  average a factor further than ``runtime_shift`` from 1 of the runtimes the plan was made
  with (the machine got slower or faster than it was when it was calibrated).

Every drift also carries what serving kept up with: the requests answered per second
(``served_qps``) and the requests in flight when it was seen (``backlog``). Serving is behind
(``saturated``) when it answered well below what arrived over the window, or when, for at
least ``BEHIND_S``, more requests waited at every check than a plan within its latency limit
holds (by Little's law, the arrival rate times the limit) and their number grew (``behind_s``):
an overload shows so from its first seconds, while the window's counts still average it with
the load before. Behind, the workers never idle, so what serving answered, over the time it
was behind where that is known, is what the plan really sustains on this machine, whatever the
planner's model of it said (re-planning uses it: ``ken.optimizer.replan``), and what arrived
over that time (``behind_qps``) is the load it must now serve.

Like the scheduling policy it never reads a clock: the caller gives the time and the counts
(the online engine's ``Replanner`` on a wall clock; a test on made-up times).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from numbers import Integral
from typing import Any, Literal

import numpy as np

from ken.errors import PolicyError
from ken.models.cascade import Cascade
from ken.policy.plan import GearPlan

#: (cascade, 0-based stage) -> (rows answered at that stage, rows passed on), counted so far
Counts = Mapping[tuple[Cascade, int], tuple[int, int]]


DriftKind = Literal["rate", "escalation", "latency", "runtime"]


@dataclass(frozen=True)
class Drift:
    """Why a plan no longer covers the workload, at ``at_s``."""

    at_s: float
    kind: DriftKind
    detail: str  # one sentence for the serving log and EXPLAIN
    rate_qps: float  # the arrival rate measured over the watch's window
    cascade: Cascade | None = None  # "escalation": the cascade and stage that shifted
    stage: int | None = None
    escalation: float | None = None  # the share of that stage's rows passed on, measured
    runtime_factor: float | None = None  # "runtime": the calls' mean measured / planned
    # requests answered per second over the window, whenever they arrived (None: not counted)
    served_qps: float | None = None
    plan: GearPlan | None = field(default=None, compare=False)  # the plan that drifted
    backlog: int | None = None  # requests in flight (arrived, not answered) at ``at_s``
    # how long the backlog has been over its limit and growing (0: it is not); then
    # ``served_qps`` is over that time, and ``behind_qps`` is what arrived over it
    behind_s: float = 0.0
    behind_qps: float | None = None
    behind_since_s: float | None = None  # when the backlog's run over its limit began

    @property
    def saturated(self) -> bool:
        """Serving fell behind (an overload; ``served_qps`` is what the plan sustains on this
        machine): the backlog grew over its limit for ``behind_s``, or serving answered under
        ``SATURATED`` of what arrived over the window."""
        served = self.served_qps
        return served is not None and (self.behind_s > 0 or served < SATURATED * self.rate_qps)

    @property
    def load_qps(self) -> float:
        """The arrival rate to serve: the window's, or where serving has been behind, the
        rate over that time if higher (the window still averages in the load before)."""
        return max(self.rate_qps, self.behind_qps or 0.0)


#: answered under this share of the arrivals over a watch's window: an overload (a plan that
#: keeps up answers what arrives, late by its latency, well under a 5-s window)
SATURATED = 0.9

#: without a latency limit, a backlog of this many seconds of arrivals is more than a plan that
#: keeps up holds
BACKLOG_S = 1.0

#: the backlog over its limit, and growing, for this long (or a watch's whole window, if
#: shorter): serving is behind
BEHIND_S = 1.0


class DriftWatch:
    """Watches one gear plan (see the module docstring). ``expected`` gives, per cascade of
    the plan, the share of rows each stage passes on (``Catalog.stage_fractions`` ratios)."""

    def __init__(self, plan: GearPlan, expected: Mapping[Cascade, Sequence[float]],
                 window_s: float = 5.0, rate_factor: float = 1.25,
                 escalation_shift: float = 0.1, min_rows: int = 100,
                 latency_limit_ms: float | None = None, runtime_shift: float = 0.25,
                 min_calls: int = 20) -> None:
        if window_s <= 0 or rate_factor <= 0 or escalation_shift <= 0 or min_rows < 1 \
                or runtime_shift <= 0 or min_calls < 1:
            raise PolicyError("window_s, rate_factor, escalation_shift and runtime_shift "
                              "must be > 0, min_rows and min_calls >= 1")
        self.runtime_shift = runtime_shift
        self.min_calls = min_calls
        self.window_s = window_s
        self.rate_factor = rate_factor
        self.escalation_shift = escalation_shift
        self.min_rows = min_rows
        self.latency_limit_ms = latency_limit_ms
        self.plan = plan
        self.expected = {c: tuple(v) for c, v in expected.items()}
        self._snapshots: deque[tuple[float, dict]] = deque()
        # (time, requests in flight) at each check over the last window_s
        self._backlogs: deque[tuple[float, int]] = deque()
        # when the checks' unbroken run over their own backlog limits began (None: the newest
        # check was within its limit): a run longer than the window outlives the log
        self._over_since: float | None = None

    def rebase(self, plan: GearPlan, expected: Mapping[Cascade, Sequence[float]]) -> None:
        """Watch ``plan`` from now on (after a swap): earlier counts are forgotten."""
        self.plan = plan
        self.expected = {c: tuple(v) for c, v in expected.items()}
        self._snapshots.clear()
        self._backlogs.clear()
        self._over_since = None

    def check(self, now: float, arrivals: int | Sequence[float], counts: Counts,
              latencies_ms: Sequence[float] = (),
              runtime: tuple[float, int] | None = None,
              answered: int | Sequence[float] | None = None, backlog: int | None = None
              ) -> Drift | None:
        """The drift seen at ``now``, if any: ``arrivals`` is the number of requests that
        arrived in the last ``window_s``, or their arrival times (then the load and the rate
        answered while serving was behind are measured over that time, see ``behind``);
        ``counts`` the cumulative per-stage counts;
        ``latencies_ms`` those of the requests answered in the last ``window_s``;
        ``runtime`` the mean ratio of the model calls of the last ``window_s`` to the
        runtimes the plan was made with, and how many calls (None: not measured);
        ``answered`` how many requests were answered in the last ``window_s``, whenever they
        arrived, or when (each drift's ``served_qps``; None: not counted); ``backlog`` how
        many are in flight now (None: not counted). Serving is judged behind by its backlog
        (``behind``) only given the times of both arrivals and answers."""
        times = None if isinstance(arrivals, Integral) else np.asarray(arrivals, dtype=np.float64)
        rate = (int(arrivals) if times is None else times.size) / self.window_s
        answers = (None if answered is None or isinstance(answered, Integral)
                   else np.asarray(answered, dtype=np.float64))
        served = (None if answered is None else
                  (int(answered) if answers is None else answers.size) / self.window_s)
        behind: dict[str, Any] = {}
        if backlog is not None:
            behind = self.behind(now, backlog, rate, times, answers)
            if behind:
                served = behind.pop("served_qps")

        def seen(kind: DriftKind, detail: str, **fields: Any) -> Drift:
            drift = Drift(now, kind, detail, rate, served_qps=served, plan=self.plan,
                          backlog=backlog, **behind, **fields)
            if drift.saturated and kind in ("rate", "latency"):  # where re-planning acts on it
                queued = ("" if not drift.behind_s or "in flight" in detail else
                          f", {backlog} in flight, over the limit for {drift.behind_s:.1f} s")
                drift = replace(drift, detail=f"{detail}; {served:.0f} qps answered{queued}: "
                                              "falling behind")
            return drift

        top = self.plan.qps_edges[-1]
        if rate > self.rate_factor * top:
            return seen("rate", f"{rate:.0f} qps arrived over the last {self.window_s:g} s, "
                        f"{rate / top:.2f}x the {top:.0f} qps the plan's gears cover")
        limit = self.latency_limit_ms
        if limit is not None and behind:
            # the answers' p95 lags an overload by the very wait it measures: the queue shows it
            return seen("latency", f"{backlog} requests in flight, over the "
                        f"{self.backlog_limit(rate):.0f} a plan within {limit:.0f} ms holds at "
                        f"{rate:.0f} qps, and growing for {behind['behind_s']:.1f} s")
        if limit is not None and len(latencies_ms) >= self.min_rows:
            p95 = float(np.percentile(latencies_ms, 95))
            if p95 > limit:
                return seen("latency", f"the p95 of the last {len(latencies_ms)} answers was "
                            f"{p95:.0f} ms, over the {limit:.0f} ms the plan is held to")
        if runtime is not None:
            factor, calls = runtime
            if calls >= self.min_calls and abs(factor - 1.0) > self.runtime_shift:
                return seen("runtime", f"the last {calls} model calls took {factor:.2f}x the "
                            "runtimes the plan was made with", runtime_factor=factor)
        snap = dict(counts)
        self._snapshots.append((now, snap))
        while len(self._snapshots) > 1 and self._snapshots[1][0] <= now - self.window_s:
            self._snapshots.popleft()
        then = self._snapshots[0][1]
        for (cascade, stage), (rows, up) in snap.items():
            expected = self.expected.get(cascade)
            if expected is None or stage >= len(expected):
                continue  # another plan's cascade, or the last stage (it passes nothing on)
            rows0, up0 = then.get((cascade, stage), (0, 0))
            n = rows - rows0
            if n < self.min_rows:
                continue
            share = (up - up0) / n
            if abs(share - expected[stage]) > self.escalation_shift:
                model = cascade.models[stage]
                return seen("escalation", f"stage {stage + 1} ({model}) of "
                            f"{cascade.describe()} passed on {share:.0%} of the last {n} rows; "
                            f"the plan expected {expected[stage]:.0%}", cascade=cascade,
                            stage=stage, escalation=share)
        return None

    def backlog_limit(self, rate: float) -> float:
        """The requests a plan within its latency limit holds in flight at ``rate`` (Little's
        law: the rate times the limit, else ``BACKLOG_S``)."""
        return rate * (BACKLOG_S if self.latency_limit_ms is None
                       else self.latency_limit_ms / 1000)

    def behind(self, now: float, backlog: int, rate: float, times: np.ndarray | None,
               answers: np.ndarray | None) -> dict[str, Any]:
        """Record ``backlog`` at ``now``; given the arrival ``times`` and the ``answers``'
        times of the window, where the backlog has been over its limit (``backlog_limit``)
        at every check of at least the last ``BEHIND_S``
        (or the whole window, if shorter) and grew over that time: ``behind_since_s`` (when
        that run began), ``behind_s`` (that time, within the window), ``served_qps`` (the
        requests answered in it, per s) and ``behind_qps`` (those that arrived, per s); else
        nothing."""
        log = self._backlogs
        log.append((now, backlog))
        # keep the newest check at or before the window's start: a run can span the window
        while len(log) > 1 and log[1][0] <= now - self.window_s:
            log.popleft()
        limit = self.backlog_limit(rate)
        if backlog <= limit:
            self._over_since = None
        elif self._over_since is None:
            self._over_since = now
        start = None
        for at, queued in reversed(log):
            if queued <= limit:
                break
            start = (at, queued)
        if start is None or times is None or answers is None or backlog <= start[1] \
                or now - start[0] < min(BEHIND_S, self.window_s):
            return {}
        begin = max(start[0], now - self.window_s)  # the times given cover the window
        span = now - begin
        arrived = int(np.count_nonzero(times > begin))
        since = start[0]
        if start[0] == log[0][0] and self._over_since is not None:
            # the run spans the log kept: it began when the checks first went over
            since = min(since, self._over_since)
        return {"behind_s": span, "behind_qps": arrived / span, "behind_since_s": since,
                "served_qps": int(np.count_nonzero(answers > begin)) / span}


def expected_escalation(stage_fractions: Sequence[float]) -> tuple[float, ...]:
    """The share of rows each stage but the last passes on, from the fractions of rows that
    reach each stage (``Catalog.stage_fractions``)."""
    return tuple(b / a if a > 0 else 0.0
                 for a, b in zip(stage_fractions, stage_fractions[1:], strict=False))
