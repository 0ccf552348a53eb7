"""Admission by capacity for decode servers (issue 38): a generating function's request is
admitted only while the server can answer it within its latency target, as the classifier
engine's ``Admission`` does for gear plans.

The estimate is the decode scheduler's own rule run forward from the queue it holds
(``DecodeScheduler.completion_s``), each pass charged what this server's passes were seen to
take (``PassTimes``: the model's token cost scaled to the measured passes, or a fit of the
measured passes alone), each request expected to generate what this lane's recent answers
did (``AnswerLengths``), plus the work queued on the server's other lanes (they share the
device), plus the request's own work on the later stages of its cascade that enough
requests reach (``later_stages_s``, from each lane's measured share passed on), times the
slowdown measured while serving (``Slowdown``, shared with the classifier
engine: answered latency over estimate for requests admitted near the target, those still
waiting counted by their wait so far).

Until a lane has measured passes of both kinds (or has a token cost) it admits one batch
(``max_running`` requests) and turns the rest away: a cold server under a flood does not
queue without bound.

Everything here runs on the decode server's loop thread, at pass boundaries.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ken.engine.admission import Slowdown
from ken.policy.decoding import DecodeScheduler, PassCost

#: measured passes of a kind before they are trusted (with no token cost to scale)
MIN_PASSES = 4
#: answers of a lane before their lengths replace the budget (max_new) in estimates
MIN_ANSWERS = 20
#: a later stage of a request's cascade is part of its estimate while at least this share of
#: requests reach it (the target is a p99: a stage 1 in 100 requests reach makes the tail)
MIN_REACH = 0.01


class PassTimes:
    """Seconds a lane's passes take, learned from the passes it ran (the latest ``window``
    of each kind). With a ``base`` cost (e.g. the model's ``TokenCost``): the base times the
    median ratio of measured over base; without: a non-negative least-squares fit of the
    base's form, ``a + b x batch + c x batch x tokens``, to the measured passes."""

    def __init__(self, base: PassCost | None = None, window: int = 256,
                 refit_every: int = 16) -> None:
        self.base = base
        self.refit_every = refit_every
        self._seen: dict[str, deque[tuple[int, int, float]]] = {
            k: deque(maxlen=window) for k in ("prefill", "decode")}
        self._new = dict.fromkeys(self._seen, 0)
        self._fit: dict[str, tuple[float, float, float] | float | None] = \
            dict.fromkeys(self._seen)

    def add(self, kind: str, batch: int, tokens: int, seconds: float) -> None:
        """A ``kind`` pass of ``batch`` rows over ``tokens`` (the prefill's longest prompt, the
        decode's width) took ``seconds``."""
        self._seen[kind].append((max(batch, 1), max(tokens, 1), max(seconds, 0.0)))
        self._new[kind] += 1
        if self._new[kind] >= self.refit_every or self._fit[kind] is None:
            self._refit(kind)

    @property
    def ready(self) -> bool:
        """Whether estimates can be made (a base cost, or measured passes of both kinds)."""
        return self.base is not None or all(self._fit[k] is not None for k in self._seen)

    def measured(self, kind: str) -> bool:
        """Whether passes of ``kind`` were measured (else estimates are the base's alone)."""
        return self._fit[kind] is not None

    def expected_s(self, kind: str, batch: int, tokens: int) -> float | None:
        """What such a pass is expected to take, for its deadline: the estimate, or the
        slowest recent pass of the kind scaled up to this one's rows x tokens where that is
        more (a fit is not trusted beyond the passes it saw); None when nothing says (no
        base, no measured pass of that kind)."""
        if self.base is None and self._fit[kind] is None:
            return None
        work = max(batch, 1) * max(tokens, 1)
        slowest = max((sec * max(1.0, work / (n * t)) for n, t, sec in self._seen[kind]),
                      default=0.0)
        return max(self._seconds(kind, batch, tokens), slowest)

    def prefill_s(self, batch: int, tokens: int) -> float:
        return self._seconds("prefill", batch, tokens)

    def decode_s(self, batch: int, width: int) -> float:
        return self._seconds("decode", batch, width)

    def _seconds(self, kind: str, batch: int, tokens: int) -> float:
        fit = self._fit[kind]
        if self.base is not None:
            base = self._base(kind, batch, tokens)
            return base * (fit if isinstance(fit, float) else 1.0)
        if not isinstance(fit, tuple):
            raise ValueError(f"no {kind} pass measured yet (check PassTimes.ready)")
        a, b, c = fit
        return a + b * batch + c * batch * tokens

    def _base(self, kind: str, batch: int, tokens: int) -> float:
        assert self.base is not None
        if kind == "prefill":
            return self.base.prefill_s(batch, tokens)
        return self.base.decode_s(batch, tokens)

    def _refit(self, kind: str) -> None:
        self._new[kind] = 0
        seen = self._seen[kind]
        if self.base is not None:
            ratios = [s / b for n, t, s in seen if (b := self._base(kind, n, t)) > 0]
            self._fit[kind] = float(np.median(ratios)) if ratios else None
            return
        if len(seen) < MIN_PASSES:
            return
        from scipy.optimize import nnls

        x = np.array([(1.0, n, n * t) for n, t, _ in seen])
        y = np.array([s for _, _, s in seen])
        scale = x.max(axis=0)  # columns of unlike size (1, rows, rows x tokens)
        try:
            coef, _ = nnls(x / scale, y, maxiter=50 * x.shape[1])
        except (RuntimeError, ValueError):  # no fit this time: keep the last one
            return
        coef = coef / scale
        self._fit[kind] = (float(coef[0]), float(coef[1]), float(coef[2]))


class AnswerLengths:
    """How many tokens a lane's answers take: the ``quantile`` of the last ``window``
    answers, as a share of their budget (a request's expected tokens scale with its
    ``max_new``); the whole budget until ``MIN_ANSWERS`` answers were seen."""

    def __init__(self, quantile: float = 0.9, window: int = 200) -> None:
        self.quantile = quantile
        self._shares: deque[float] = deque(maxlen=window)
        self._value = 1.0
        self._added = 0  # answers seen in all (the window stops growing; this does not)

    def add(self, tokens: int, max_new: int) -> None:
        self._shares.append(min(1.0, tokens / max_new) if max_new > 0 else 1.0)
        self._added += 1
        if self._added >= MIN_ANSWERS and (self._added - MIN_ANSWERS) % 10 == 0:
            self._value = float(np.quantile(self._shares, self.quantile))

    def expected(self, max_new: int) -> int:
        """Tokens a request with budget ``max_new`` is expected to generate."""
        if len(self._shares) < MIN_ANSWERS:
            return max_new
        return max(1, min(max_new, math.ceil(self._value * max_new)))


@dataclass(frozen=True)
class Verdict:
    """Admission's answer for one request: admitted (``reason`` None), with the estimate to
    learn from when it was near the target, or why not and when to retry."""

    reason: str | None = None
    retry_after_s: float | None = None
    estimate_s: float | None = None


class DecodeAdmission:
    """Admission by capacity for one decode server (see the module docstring). ``target_s``:
    the latency (arrival to last token) a request is held to; None: every request is
    admitted."""

    def __init__(self, target_s: float | None = None,
                 base_costs: Mapping[str, PassCost | None] | None = None) -> None:
        self.target_s = target_s
        self.base_costs = dict(base_costs or {})
        self.times: dict[str, PassTimes] = {}
        self.lengths: dict[str, AnswerLengths] = {}
        self.slowdown = Slowdown()
        self.rejected = 0
        self._others: tuple[int, str, float] | None = None  # (boundary, lane, seconds)
        self._onward: dict[str, deque[bool]] = {}  # lane -> recent answers passed on or not

    @property
    def active(self) -> bool:
        return self.target_s is not None

    def lane_times(self, lane: str) -> PassTimes:
        if lane not in self.times:
            self.times[lane] = PassTimes(self.base_costs.get(lane))
        return self.times[lane]

    def lane_lengths(self, lane: str) -> AnswerLengths:
        return self.lengths.setdefault(lane, AnswerLengths())

    def stage_ended(self, lane: str, escalated: bool) -> None:
        """A request's stage on ``lane`` answered: passed on to the next stage, or not."""
        self._onward.setdefault(lane, deque(maxlen=200)).append(escalated)

    def onward(self, lane: str) -> float:
        """The share of ``lane``'s answers passed on to a next stage (1 until
        ``MIN_ANSWERS`` were seen: the stage after it counts in estimates until measured)."""
        seen = self._onward.get(lane)
        if seen is None or len(seen) < MIN_ANSWERS:
            return 1.0
        return sum(seen) / len(seen)

    def later_stages_s(self, lane: str, later: Sequence[tuple[str, int]],
                       lanes: Mapping[str, DecodeScheduler], prompt_tokens: int) -> float:
        """Seconds of the request's own work on the stages after ``lane`` (``later``: each
        stage's lane and budget) that at least ``MIN_REACH`` of requests reach: a prefill of
        its prompt and its expected tokens in passes as wide as that lane's load, by that
        lane's measured passes (a lane not measured yet counts nothing; its queue is in the
        other lanes' work)."""
        total, reach, previous = 0.0, 1.0, lane
        for name, max_new in later:
            reach *= self.onward(previous)
            previous = name
            if reach < MIN_REACH:
                break
            times = self.lane_times(name)
            if not times.ready or name not in lanes:
                continue
            sched = lanes[name]
            batch = max(1, min(sched.max_running, sched.load + 1))
            tokens = self.lane_lengths(name).expected(max_new)
            total += times.prefill_s(1, prompt_tokens) + max(0, tokens - 1) * \
                times.decode_s(batch, prompt_tokens + max_new)
        return total

    def passed(self, lane: str, kind: str, batch: int, tokens: int, seconds: float) -> None:
        """A pass of ``lane`` ran (see ``PassTimes.add``)."""
        self.lane_times(lane).add(kind, batch, tokens, seconds)

    def answered(self, rid: int, lane: str, tokens: int, max_new: int,
                 latency_s: float, now: float) -> None:
        """Request ``rid``'s answer on ``lane`` took ``tokens`` of ``max_new``; ``latency_s``
        from arrival (the slowdown learns from it when its estimate was near the target)."""
        self.lane_lengths(lane).add(tokens, max_new)
        self.slowdown.answered(rid, latency_s, now)

    def forget(self, rid: int) -> None:
        """Request ``rid`` ended without an answer. (An escalated request is not forgotten:
        its answered latency, later stages included, is set against its first lane's
        estimate, so the slowdown learns the later stages' share too.)"""
        self.slowdown.forget(rid)

    def check(self, rid: int, lane: str, lanes: Mapping[str, DecodeScheduler],
              prompt_tokens: int, max_new: int, arrival: float, now: float,
              boundary: int = 0, later: Sequence[tuple[str, int]] = ()) -> Verdict:
        """Whether request ``rid`` (on ``lane``, with this prompt and budget, arrived at
        ``arrival``) would be answered within its target, given the queues of ``lanes``
        (every lane of the server, ``lane`` among them) at pass boundary number
        ``boundary`` (the other lanes' work is estimated once per boundary). ``later``: the
        stages its cascade may pass it on to, each ``(lane, budget)``
        (``later_stages_s``)."""
        target = self.target_s
        if target is None:
            return Verdict()
        sched = lanes[lane]
        if all(s.load == 0 for s in lanes.values()):
            return Verdict()  # an idle server admits whatever the target says
        times = self.lane_times(lane)
        if not times.ready:
            if sched.load < sched.max_running:
                return Verdict()
            self.rejected += 1
            return Verdict(
                f"the decode server has not measured its passes yet and holds a full batch "
                f"({sched.load} requests); retry in a moment", 0.1)
        slowdown = self.slowdown.value(now)
        lengths = self.lane_lengths(lane)
        others = self._other_lanes_s(lane, lanes, now, boundary, target)
        if later:
            others += self.later_stages_s(lane, later, lanes, prompt_tokens)
        waited = max(0.0, now - arrival)  # in the inbox, until this boundary
        horizon = target / slowdown - others - waited
        if horizon > 0 and sched.order == "fcfs" and sched.mode == "continuous":
            # a cheap bound first: each request waiting ahead joins a prefill, max_running a
            # prefill at most (a long queue of bulk rows is not simulated per arrival)
            rounds = math.ceil((sched.queued + 1) / sched.max_running)
            if rounds * times.prefill_s(1, 1) > horizon:
                horizon = 0.0
        done = math.inf if horizon <= 0 else sched.completion_s(
            now, times, (prompt_tokens, max_new), lengths.expected, horizon,
            new_arrival_s=arrival, new_id=rid) - now + others + waited
        expected = done * slowdown
        if expected <= target:
            if expected >= target / 2:
                self.slowdown.admitted(rid, done, arrival)  # done counts from arrival
            return Verdict(estimate_s=done)
        self.rejected += 1
        alone = times.prefill_s(1, prompt_tokens) + max(0, max_new - 1) * \
            times.decode_s(1, prompt_tokens + max_new)
        # past the horizon the estimate stopped: the queue holds at least a target's work
        retry = max(alone, target if math.isinf(done) else expected - target)
        return Verdict(
            f"the decode server is over capacity: {sched.load} requests running or queued "
            f"on its lane ahead of this one (passes x{slowdown:.1f} as measured while "
            f"serving), so it would miss the latency target of {target * 1000:.0f} ms; "
            f"retry in {retry * 1000:.0f} ms", retry)

    def _other_lanes_s(self, lane: str, lanes: Mapping[str, DecodeScheduler], now: float,
                       boundary: int, target: float) -> float:
        """Seconds of work queued on the server's other lanes (they share the device, and
        their older requests go first: an upper bound), once per pass boundary."""
        if self._others is not None and self._others[:2] == (boundary, lane):
            return self._others[2]
        total = 0.0
        for name, s in lanes.items():
            if name != lane and s.load:
                t = self.lane_times(name)
                if t.ready:
                    total += s.completion_s(now, t, tokens=self.lane_lengths(name).expected,
                                            horizon_s=target) - now
        self._others = (boundary, lane, total)
        return total
