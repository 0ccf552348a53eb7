"""Where a request's time goes in the online engine (issue 33, item 3).

A simulator charges a request its queue waits and its model calls. The engine spends more:
the scheduler thread takes an arrival in some time after ``submit`` (``admit``); a batch it
starts waits for its device's thread to hand it to the worker (``handoff``); the call's
answer waits in the event queue until the scheduler takes it in and resolves the rows or
escalates them (``report``). During ``handoff`` and ``report`` the device counts as busy to
the dispatcher, so the next batch cannot start either: time the device is held without
computing. Since session 37 the calibration fits the time a batch held its device
(``BatchRecord.held_s``), so the simulator charges hand-offs and reports through its factors;
admission it does not charge (it runs on the scheduler thread and delays every request alike).

``PathLog`` (the scheduler keeps one, ``Engine.path_log``) records when each online request
was admitted and, per finished online batch, when it was formed, started, ended and taken in.
``request_paths`` splits each answered request's latency into those parts; ``PathSummary``
gives the medians and the per-batch host time (``handoff + report``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ken.engine.outcome import Outcome
from ken.engine.supervision import BatchRecord

#: batches and admissions a ``PathLog`` keeps (the newest; a 60-s replay at 100 requests/s
#: is 6,000 admissions and at most as many batches)
PATH_LOG = 20_000


@dataclass(frozen=True, slots=True)
class BatchPath:
    """One finished online batch: its call (with the hand-off and report times the scheduler
    measured) and its rows."""

    record: BatchRecord
    request_ids: tuple[int, ...]

    @property
    def formed_s(self) -> float:
        """When the dispatcher started it (the device counts as busy from here)."""
        return self.record.start_s - self.record.handoff_s

    @property
    def taken_s(self) -> float:
        """When the scheduler took its answer in (rows resolved or escalated)."""
        return self.record.end_s + self.record.report_s


class PathLog:
    """The newest ``capacity`` admissions (request id, time), finished online batches, and
    requests the scheduler metered and turned away (a replay of more requests is split over
    its newest ``capacity``). Written by the scheduler thread; the readers copy it under its
    lock, from any thread."""

    def __init__(self, capacity: int = PATH_LOG) -> None:
        self._lock = threading.Lock()
        self._admitted: deque[tuple[int, float]] = deque(maxlen=capacity)
        self._batches: deque[BatchPath] = deque(maxlen=capacity)
        self._turned: deque[tuple[int, float, bool]] = deque(maxlen=capacity)

    def admit(self, rid: int, now: float) -> None:
        with self._lock:
            self._admitted.append((rid, now))

    def turn(self, rid: int, now: float, routed: bool) -> None:
        """Request ``rid`` was metered at ``now`` and turned away (its model failed, its
        deadline could not be met, or admission rejected it: ``routed``, the router's turn
        taken)."""
        with self._lock:
            self._turned.append((rid, now, routed))

    def turned(self) -> list[tuple[int, float, bool]]:
        with self._lock:
            return list(self._turned)

    def batch(self, path: BatchPath) -> None:
        with self._lock:
            self._batches.append(path)

    def admitted(self) -> dict[int, float]:
        with self._lock:
            return dict(self._admitted)

    def batches(self) -> list[BatchPath]:
        with self._lock:
            return list(self._batches)


@dataclass(frozen=True)
class RequestPath:
    """One answered request's latency in parts (seconds; they sum to its latency)."""

    request_id: int
    admit_s: float  # submit to the scheduler admitting it
    wait_s: float  # in queues: admitted (or escalated) to its batch being formed, per stage
    handoff_s: float  # its batches formed to their calls started
    call_s: float  # its model calls
    report_s: float  # its calls ended to the scheduler taking their answers in
    resolve_s: float  # the last answer taken in to its outcome (0 unless it was held)
    stages: int

    @property
    def latency_s(self) -> float:
        return (self.admit_s + self.wait_s + self.handoff_s + self.call_s + self.report_s
                + self.resolve_s)

    @property
    def host_s(self) -> float:
        """The parts outside queues and model calls: admission, hand-offs, reports."""
        return self.admit_s + self.handoff_s + self.report_s + self.resolve_s


def request_paths(outcomes: Iterable[Outcome], log: PathLog) -> list[RequestPath]:
    """The parts of every ``ok`` online request's latency that the log covers (requests
    admitted before the log's oldest admission, or answered by a batch the log no longer
    holds, are left out; so is a request whose batch ran again in place after a failure).
    A batch that failed or reached a dead worker and whose rows were queued again is not in
    the log (only batches whose answers were taken in are): its time counts as its rows'
    wait."""
    admitted = log.admitted()
    by_request: dict[int, list[BatchPath]] = {}
    for b in log.batches():
        for rid in b.request_ids:
            by_request.setdefault(rid, []).append(b)
    out = []
    for o in outcomes:
        if o.status != "ok" or o.request_id not in admitted or o.request_id not in by_request:
            continue
        batches = sorted(by_request[o.request_id], key=lambda b: b.formed_s)
        if o.stage is not None and len(batches) != o.stage + 1:
            continue  # a retried batch, or one the log dropped
        at = admitted[o.request_id]
        wait = 0.0
        for b in batches:
            wait += b.formed_s - at
            at = b.taken_s
        out.append(RequestPath(
            o.request_id, admitted[o.request_id] - o.arrival_s, wait,
            sum(b.record.handoff_s for b in batches), sum(b.record.seconds for b in batches),
            sum(b.record.report_s for b in batches), o.completion_s - at, len(batches)))
    return out


@dataclass(frozen=True)
class PathSummary:
    """Medians (and 95th percentiles) of the parts, in milliseconds, over requests; and the
    per-batch host time over batches."""

    requests: int
    batches: int
    median_ms: dict[str, float]
    p95_ms: dict[str, float]
    batch_host_ms: dict[str, float]  # handoff + report per batch: mean, median, p95
    host_share: float  # host parts / latency, summed over requests

    def describe(self) -> str:
        """One line: the median and p95 of each part, and the host parts' share."""
        names = {"admit": "admission", "wait": "queues", "handoff": "hand-offs",
                 "call": "model calls", "report": "reports"}
        parts = ", ".join(f"{label} {self.median_ms[k]:.1f}/{self.p95_ms[k]:.1f}"
                          for k, label in names.items())
        return (f"where the time went, ms median/p95 per request over {self.requests:,} "
                f"answered: {parts}; admission, hand-offs and reports "
                f"{100 * self.host_share:.1f}% of all latency")

    def to_dict(self) -> dict:
        return {"requests": self.requests, "batches": self.batches,
                "median_ms": self.median_ms, "p95_ms": self.p95_ms,
                "batch_host_ms": self.batch_host_ms, "host_share": self.host_share}


PARTS = ("admit", "wait", "handoff", "call", "report", "resolve", "host", "latency")


def where_time_went(outcomes: Iterable[Outcome], log: PathLog) -> PathSummary | None:
    """``summarize`` of ``request_paths`` and the log's batches; None when the log covers no
    answered request."""
    paths = request_paths(outcomes, log)
    return summarize(paths, log.batches()) if paths else None


def summarize(paths: Sequence[RequestPath], batches: Sequence[BatchPath]) -> PathSummary:
    """``PathSummary`` of ``request_paths`` and the log's batches."""
    if not paths:
        raise ValueError("no answered request is in the log")
    cols = {p: np.array([getattr(r, f"{p}_s") for r in paths]) * 1000.0 for p in PARTS}
    host = np.array([b.record.handoff_s + b.record.report_s for b in batches]) * 1000.0
    return PathSummary(
        len(paths), len(batches),
        {p: float(np.median(v)) for p, v in cols.items()},
        {p: float(np.percentile(v, 95)) for p, v in cols.items()},
        {"mean": float(host.mean()) if host.size else 0.0,
         "median": float(np.median(host)) if host.size else 0.0,
         "p95": float(np.percentile(host, 95)) if host.size else 0.0},
        float(cols["host"].sum() / cols["latency"].sum()))
