"""Deadlines through a pipeline: proactive request dropping and adaptive priority (PARD), shared
by the simulator and the online engine (``ken.engine.deadlines``) — the same rule on a virtual
or a wall clock.

A request to a pipeline of operators (stages) carries an end-to-end deadline. Each time a
stage is about to spend model time on it — when it enters the stage, and when the stage forms a
batch from its queue — the policy decides whether it is still worth serving:

- ``none``: never drop (today's behaviour: every admitted request runs every stage);
- ``reactive``: drop only a request already late (``now > deadline``), in arrival order — what
  Clipper-like systems do;
- ``proactive`` (PARD, section 4.2): drop a request whose *predicted* finish is past its
  deadline: ``now + (this stage's time) + (predicted time of the stages still ahead on its
  route) > deadline``. The time of a stage ahead is, for the first model of the gear the stage
  serves in now (its dispatcher says when it switches), the recent measured wait at its
  replicas (PARD's queueing delay and batch wait: in ken's dispatcher both are the time a row
  spends in a queue, so they are measured together, as a sliding-window mean) plus its
  profiled execution time at their recent mean batch size; and, for a cascade, the same for
  each later model times the share of rows that reach it, measured as the stage's rows
  escalate (the share of each model's rows in its last ``ESCALATION_BATCHES`` batches that went
  on; none before any batch). A batch formed at a later model of the cascade is charged that
  model's profile. With no recent measurement (idle stages) the prediction is the profiled
  time of a batch of one per model, so a request that can make its deadline on idle stages is
  never dropped. The profiled times are scaled by how fast the stage's batches
  actually ran: the median of measured over profiled seconds of its last ``runtime_batches``
  batches (each against the profile of the replica that ran it; 1 before any batch). A
  machine that got busier, or quieter, since the profiles were measured (or calibrated) then
  moves the forecast with it, where a profile alone drops requests the engine would have
  answered in time, or keeps ones it will answer late.

**Which requests a batch takes** (PARD section 4.3). Under ``proactive`` the requests a stage
keeps are ordered by their remaining budget (deadline minus now minus the predicted time left,
this stage included): *Low Budget First* (least slack first, EDF-like) while the stage keeps up
with its load, *High Budget First* (most slack first) when it is overloaded, so that queueing
does not eat the budget of every request. The stage's load factor ``rho = lambda / mu``
(arrival rate over the last window / profiled throughput) picks the mode with a delayed
transition: HBF once ``rho >= 1 + delta``, LBF once ``rho <= 1 - delta``, unchanged in between,
with ``delta = max(delta_min, |lambda_short - lambda| / mu)`` wider when the load moves fast
(our reading of the paper's dynamic boundary; its symbols are lost in our copy of the text).
``none`` and ``reactive`` take requests in arrival order (FIFO).

Every drop is a :class:`Drop`: the stage, when, the predicted finish and the deadline, so an
outcome can say where and why. Nothing here reads a clock: callers pass ``now``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ken.errors import PolicyError
from ken.policy.plan import GearPlan

#: how many of a model's last batches give the share of its rows that escalate
ESCALATION_BATCHES = 16

DropRule = Literal["none", "reactive", "proactive"]
PriorityRule = Literal["fcfs", "lbf", "hbf", "adaptive"]
DROP_RULES: tuple[DropRule, ...] = ("none", "reactive", "proactive")
#: the policies ``DropPolicy.named`` knows
POLICY_NAMES = (*DROP_RULES, "proactive-profiled", "proactive-first-model")
PRIORITIES: tuple[PriorityRule, ...] = ("fcfs", "lbf", "hbf", "adaptive")


@dataclass(frozen=True)
class DropPolicy:
    """When to drop (``rule``) and in which order a stage serves its queue (``priority``);
    ``window_s``: the sliding window of the measured waits, batch sizes and arrival rates;
    ``delta_min``: the narrowest band of the adaptive priority's delayed transition;
    ``runtime_batches``: how many of a stage's last batches scale its profiled runtimes by
    their measured speed (0: the profiles as they are); ``escalations``: the forecast follows
    a cascade's later models (each batch charged its own model, a stage's time the later
    models' times the measured share of rows that reach them); False: every batch and stage
    charged the serving gear's first model alone (the forecast before session 28)."""

    rule: DropRule = "none"
    priority: PriorityRule = "fcfs"
    window_s: float = 1.0
    delta_min: float = 0.1
    runtime_batches: int = 16
    escalations: bool = True

    def __post_init__(self) -> None:
        if self.rule not in DROP_RULES:
            raise PolicyError(f"drop rule must be one of {DROP_RULES}, got {self.rule!r}")
        if self.priority not in PRIORITIES:
            raise PolicyError(f"priority must be one of {PRIORITIES}, got {self.priority!r}")
        if not (math.isfinite(self.window_s) and self.window_s > 0
                and 0 <= self.delta_min < 1):
            raise PolicyError("window_s must be > 0 and delta_min in [0, 1)")
        if isinstance(self.runtime_batches, bool) or not isinstance(self.runtime_batches, int) \
                or self.runtime_batches < 0:
            raise PolicyError(f"runtime_batches must be an int >= 0, got "
                              f"{self.runtime_batches!r}")

    @classmethod
    def named(cls, name: str, **kwargs: float) -> DropPolicy:
        """The policies compared: ``none`` and ``reactive`` (FIFO), ``proactive`` (PARD:
        predicted finish and adaptive priority), ``proactive-profiled`` (the same on the
        profiled runtimes alone, not scaled by the measured speed: ``runtime_batches=0``) and
        ``proactive-first-model`` (a cascade charged its first model alone:
        ``escalations=False``)."""
        if name == "proactive":
            return cls("proactive", "adaptive", **kwargs)  # type: ignore[arg-type]
        if name == "proactive-profiled":
            return cls("proactive", "adaptive", **{"runtime_batches": 0, **kwargs})  # type: ignore[arg-type]
        if name == "proactive-first-model":
            return cls("proactive", "adaptive", **{"escalations": False, **kwargs})  # type: ignore[arg-type]
        if name in ("none", "reactive"):
            return cls(name, "fcfs", **kwargs)  # type: ignore[arg-type]
        raise PolicyError(f"no dropping policy {name!r}; use one of {POLICY_NAMES}")


@dataclass(frozen=True)
class Drop:
    """A request dropped at ``stage`` (index into the pipeline's stages) at ``at_s``: its
    predicted finish (``at_s`` itself for a reactive drop) was past ``deadline_s``."""

    request_id: int
    stage: int
    stage_name: str
    at_s: float
    predicted_finish_s: float
    deadline_s: float
    rule: DropRule

    @property
    def reason(self) -> str:
        if self.rule == "reactive":
            return (f"late at {self.stage_name}: {self.at_s - self.deadline_s:.4f} s past its "
                    f"deadline")
        return (f"at {self.stage_name}: predicted finish {self.predicted_finish_s:.4f} s > "
                f"deadline {self.deadline_s:.4f} s")


def should_drop(rule: DropRule, deadline_s: float, now: float, remaining_s: float) -> bool:
    """The drop rule: ``remaining_s`` is the predicted time still needed (this stage and the
    ones ahead)."""
    if rule == "none":
        return False
    if rule == "reactive":
        return now > deadline_s
    return now + remaining_s > deadline_s


def priority_order(budgets: Sequence[float], mode: Literal["fcfs", "lbf", "hbf"]
                   ) -> list[int]:
    """Indices of ``budgets`` (remaining latency budgets, in arrival order) in serving order:
    arrival order, least budget first or most budget first (ties: arrival order)."""
    idx = range(len(budgets))
    if mode == "fcfs":
        return list(idx)
    if mode == "lbf":
        return sorted(idx, key=lambda i: (budgets[i], i))
    return sorted(idx, key=lambda i: (-budgets[i], i))


class AdaptivePriority:
    """PARD's delayed transition between LBF and HBF on a stage's load factor ``rho``."""

    def __init__(self, mode: Literal["lbf", "hbf"] = "lbf") -> None:
        self.mode: Literal["lbf", "hbf"] = mode
        self.switches = 0

    def update(self, rho: float, delta: float) -> Literal["lbf", "hbf"]:
        new = "hbf" if rho >= 1 + delta else "lbf" if rho <= 1 - delta else self.mode
        if new != self.mode:
            self.mode = new  # type: ignore[assignment]
            self.switches += 1
        return self.mode


class _Window:
    """Samples of the last ``span_s`` seconds (time-ordered): mean value and rate."""

    __slots__ = ("span_s", "_t", "_v", "_sum")

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self._t: deque[float] = deque()
        self._v: deque[float] = deque()
        self._sum = 0.0

    def add(self, now: float, value: float = 1.0) -> None:
        self._t.append(now)
        self._v.append(value)
        self._sum += value

    def _roll(self, now: float) -> None:
        t, v = self._t, self._v
        while t and t[0] <= now - self.span_s:
            t.popleft()
            self._sum -= v.popleft()
        if not t:
            self._sum = 0.0

    def mean(self, now: float, empty: float) -> float:
        self._roll(now)
        return self._sum / len(self._t) if self._t else empty

    def rate(self, now: float) -> float:
        self._roll(now)
        return self._sum / self.span_s


class _Escalations:
    """The last ``ESCALATION_BATCHES`` batches of one replica: (rows escalated, rows), and
    their sums."""

    def __init__(self) -> None:
        self.runs: deque[tuple[int, int]] = deque()
        self.up = self.rows = 0

    def add(self, up: int, rows: int) -> None:
        if len(self.runs) == ESCALATION_BATCHES:
            old_up, old_rows = self.runs.popleft()
            self.up -= old_up
            self.rows -= old_rows
        self.runs.append((up, rows))
        self.up += up
        self.rows += rows


@dataclass(frozen=True)
class StageProfile:
    """What the forecast knows of a stage from its profile: seconds of a batch of 1, 2, ...,
    ``max_batch`` rows on one replica, and how many replicas share its load (both of the first
    model of the plan's first gear); ``replica_runtime_s``: per replica of the stage's plan
    (every model it places), the profiled seconds of its batches of 1, 2, ... rows, against
    which a batch's measured time is read (empty: ``batch_runtime_s`` for every replica);
    ``gear_cascades``: per gear of the plan, per model of its cascade in order, that model's
    replicas, whose profiles the forecast reads while that gear serves (empty: one model,
    ``batch_runtime_s``, in every gear)."""

    name: str
    batch_runtime_s: tuple[float, ...]
    replicas: int = 1
    replica_runtime_s: tuple[tuple[float, ...], ...] = ()
    gear_cascades: tuple[tuple[tuple[int, ...], ...], ...] = ()

    def __post_init__(self) -> None:
        rt = self.batch_runtime_s
        if not rt or not all(math.isfinite(t) and t > 0 for t in rt) or self.replicas < 1:
            raise PolicyError(f"stage {self.name!r}: need positive batch runtimes and >= 1 "
                              "replica")
        if not all(row and all(math.isfinite(t) and t > 0 for t in row)
                   for row in self.replica_runtime_s):
            raise PolicyError(f"stage {self.name!r}: need positive runtimes for every "
                              "replica")
        if not all(models and all(reps and all(0 <= r < len(self.replica_runtime_s)
                                               for r in reps) for reps in models)
                   for models in self.gear_cascades):
            raise PolicyError(f"stage {self.name!r}: each gear needs, per model of its "
                              "cascade, replicas of the stage's profiled replicas")

    @property
    def gear_replicas(self) -> tuple[tuple[int, ...], ...]:
        """Per gear, the replicas of its cascade's first model."""
        return tuple(models[0] for models in self.gear_cascades)

    def cascade(self, gear: int) -> tuple[tuple[int, ...], ...]:
        """Per model of ``gear``'s cascade, its replicas (``((-1,),)`` where the profile does
        not know the gear: one model, read from ``batch_runtime_s``)."""
        gears = self.gear_cascades
        return gears[gear] if 0 <= gear < len(gears) else ((-1,),)

    def runtimes(self, gear: int = 0) -> tuple[float, ...]:
        """Profiled seconds of batches of 1, 2, ... rows of the first model of ``gear`` (of
        the first gear where the profile does not know that gear)."""
        gears = self.gear_cascades
        return self.replica_runtime_s[gears[gear][0][0]] if 0 <= gear < len(gears) \
            else self.batch_runtime_s

    def profiled_s(self, replica: int, rows: int) -> float:
        """Profiled seconds of a batch of ``rows`` rows on ``replica`` (the largest profiled
        batch for more rows; ``batch_runtime_s`` for a replica the profile does not know)."""
        reps = self.replica_runtime_s
        rt = reps[replica] if 0 <= replica < len(reps) else self.batch_runtime_s
        return rt[min(max(rows, 1), len(rt)) - 1]

    def capacity(self, gear: int = 0) -> float:
        """Rows per second ``gear``'s first model sustains with full batches on every
        replica."""
        rt = self.runtimes(gear)
        gears = self.gear_cascades
        replicas = len(gears[gear][0]) if 0 <= gear < len(gears) else self.replicas
        return replicas * len(rt) / rt[-1]

    @property
    def capacity_qps(self) -> float:
        """Rows per second the stage's first gear sustains with full batches on every
        replica."""
        return self.capacity(0)


def stage_profile(plan: GearPlan, runtimes: Callable[[int], Sequence[float]]) -> StageProfile:
    """What the forecast knows of an operator served by ``plan``: the batch runtimes
    (``runtimes(replica)``: seconds of a batch of 1, 2, ... rows) of one replica of the first
    model of its first gear, how many replicas that model has, every replica's runtimes and
    the replicas of each model of each gear's cascade."""
    first = plan.cascade_of(0).models[0]
    reps = plan.replicas_of(first)
    every = tuple(tuple(float(t) for t in runtimes(r)) for r in range(len(plan.placement)))
    gears = tuple(tuple(tuple(plan.replicas_of(m)) for m in plan.cascade_of(k).models)
                  for k in range(plan.num_ranges))
    return StageProfile(plan.operator, every[reps[0]], len(reps), every, gears)


class PipelineForecast:
    """Per stage, its profile and what was measured: per replica, rows' waits in its queue and
    its batch sizes over the last ``window_s``; the stage's arrivals; the measured speed of its
    last ``runtime_batches`` batches; per gear and replica, the share of rows that escalated in
    its last ``ESCALATION_BATCHES`` batches. Predicts the time a request still needs."""

    def __init__(self, stages: Sequence[StageProfile], window_s: float = 1.0,
                 runtime_batches: int = 0, escalations: bool = True) -> None:
        self.stages = tuple(stages)
        self.window_s = window_s
        self.escalations = escalations  # False: every stage charged its first model alone
        n = len(self.stages)
        self._wait: list[dict[int, _Window]] = [{} for _ in range(n)]  # per replica
        self._batch: list[dict[int, _Window]] = [{} for _ in range(n)]  # per replica
        self._arrive = [_Window(window_s) for _ in range(n)]
        self._arrive_short = [_Window(window_s / 5) for _ in range(n)]
        # measured / profiled seconds of each stage's last ``runtime_batches`` batches
        self._speed: list[deque[float]] = [deque(maxlen=runtime_batches or 1) for _ in range(n)]
        self._learn = runtime_batches > 0
        self._median = [1.0] * n  # of ``_speed``, kept as batches finish
        self._gear = [0] * n  # the gear each stage serves in now
        # per (gear, replica): (escalated, rows) of its last batches, and their sums (kept as
        # batches finish, not added up again for every request's forecast)
        self._esc: list[dict[tuple[int, int], _Escalations]] = [{} for _ in range(n)]

    def observe_arrival(self, stage: int, now: float) -> None:
        self._arrive[stage].add(now)
        self._arrive_short[stage].add(now)

    def observe_batch(self, stage: int, now: float, waits: Sequence[float],
                      replica: int | None = None) -> None:
        """A batch started on ``replica`` of ``stage`` (None: the serving gear's first model's
        first replica): its rows waited ``waits`` seconds in the queue. Without
        ``escalations`` every batch of the stage goes into one window (the stage's)."""
        if not self.escalations:
            replica = -1
        elif replica is None:
            replica = self.first_replica(stage)
        w = self._wait[stage].get(replica)
        if w is None:
            w = self._wait[stage][replica] = _Window(self.window_s)
            self._batch[stage][replica] = _Window(self.window_s)
        for x in waits:
            w.add(now, x)
        self._batch[stage][replica].add(now, float(len(waits)))

    def first_replica(self, stage: int) -> int:
        """The first replica of the first model of the gear ``stage`` serves in."""
        return self.stages[stage].cascade(self._gear[stage])[0][0]

    def restage(self, stage: int, profile: StageProfile) -> None:
        """``stage`` is served by another plan from now on (a re-plan): its profile, and the
        speeds, waits and escalations measured against the old one's replicas forgotten."""
        stages = list(self.stages)
        stages[stage] = profile
        self.stages = tuple(stages)
        self._speed[stage].clear()
        self._median[stage] = 1.0
        self._gear[stage] = 0
        self._wait[stage].clear()
        self._batch[stage].clear()
        self._esc[stage].clear()

    def observe_gear(self, stage: int, gear: int) -> None:
        """``stage`` serves in ``gear`` from now on (its plan's range index)."""
        self._gear[stage] = gear

    def observe_run(self, stage: int, replica: int, rows: int, seconds: float,
                    escalated: int = 0) -> None:
        """A batch of ``rows`` rows on ``replica`` of ``stage`` took ``seconds`` (started to
        answered, as the caller measures it) and sent ``escalated`` of them on to the
        cascade's next model."""
        if rows > 0:
            key = (self._gear[stage], replica)
            runs = self._esc[stage].get(key)
            if runs is None:
                runs = self._esc[stage][key] = _Escalations()
            runs.add(min(max(escalated, 0), rows), rows)
        if self._learn and seconds >= 0 and math.isfinite(seconds):
            ratios = self._speed[stage]
            ratios.append(seconds / self.stages[stage].profiled_s(replica, rows))
            ordered = sorted(ratios)  # once per batch, not per request forecast
            mid = len(ordered) // 2
            self._median[stage] = ordered[mid] if len(ordered) % 2 else \
                0.5 * (ordered[mid - 1] + ordered[mid])

    def speed(self, stage: int) -> float:
        """Measured over profiled seconds of the stage's recent batches (the median; 1 before
        any batch, or when the policy reads the profiles alone)."""
        return self._median[stage]

    def exec_at(self, stage: int, rows: float, replica: int | None = None) -> float:
        """Predicted execution of a batch of ``rows`` rows (rounded) on ``replica`` of
        ``stage`` (None: the first model of the gear it serves in), scaled by the measured
        speed."""
        if replica is None:
            replica = self.first_replica(stage)
        return self.stages[stage].profiled_s(replica, int(round(rows))) * self.speed(stage)

    def escalation(self, stage: int, replicas: Sequence[int]) -> float:
        """The share of the rows of ``replicas`` (one model's) that escalated in their last
        batches in the gear the stage serves in now (0 before any batch)."""
        gear, esc = self._gear[stage], self._esc[stage]
        up = rows = 0
        for r in replicas:
            runs = esc.get((gear, r))
            if runs is not None:
                up += runs.up
                rows += runs.rows
        return up / rows if rows else 0.0

    def model_s(self, stage: int, replicas: Sequence[int], now: float) -> float:
        """Predicted time a row arriving now at one model's ``replicas`` spends there: per
        replica its recent mean wait plus execution at its recent mean batch size, averaged
        over the replicas weighted by their recent rows (equally when none ran)."""
        waits, batches = self._wait[stage], self._batch[stage]
        total = weight = 0.0
        for r in replicas:
            b = batches.get(r)
            rows = b.rate(now) if b is not None else 0.0
            t = (waits[r].mean(now, 0.0) if b is not None else 0.0) + \
                self.exec_at(stage, b.mean(now, 1.0) if b is not None else 1.0, r)
            total += t * rows
            weight += rows
        if weight > 0:
            return total / weight
        return math.fsum(self.exec_at(stage, 1.0, r) for r in replicas) / len(replicas)

    def from_model(self, stage: int, position: int, now: float) -> float:
        """Predicted time left at ``stage`` for a row arriving now at model ``position`` of the
        cascade of the gear it serves in: that model's time, then each later model's times
        the measured share of rows that reach it."""
        if not self.escalations:  # the stage's window, charged its gear's first model
            b = self._batch[stage].get(-1)
            if b is None:
                return self.exec_at(stage, 1.0)
            return self._wait[stage][-1].mean(now, 0.0) + self.exec_at(stage, b.mean(now, 1.0))
        models = self.stages[stage].cascade(self._gear[stage])
        total, reach = 0.0, 1.0
        for reps in models[position:]:
            total += reach * self.model_s(stage, reps, now)
            reach *= self.escalation(stage, reps)
            if reach <= 0.0:
                break
        return total

    def after_batch(self, stage: int, replica: int, now: float) -> float:
        """Predicted time at ``stage`` after a batch on ``replica`` for one of its rows: the
        later models of the cascade times the share that reaches them (0 for a replica not in
        the serving gear's cascade, or at its last model)."""
        models = self.stages[stage].cascade(self._gear[stage])
        for p, reps in enumerate(models):
            if replica in reps:
                if p + 1 >= len(models):
                    return 0.0
                up = self.escalation(stage, reps)
                return up * self.from_model(stage, p + 1, now) if up > 0 else 0.0
        return 0.0

    def stage_s(self, stage: int, now: float) -> float:
        """Predicted time a request arriving now spends at ``stage``: from its gear's first
        model through the escalations of its cascade."""
        return self.from_model(stage, 0, now)

    def remaining_s(self, ahead: Sequence[int], now: float) -> float:
        """Predicted time of the stages ``ahead``, in route order."""
        return math.fsum(self.stage_s(k, now) for k in ahead)

    def load(self, stage: int, now: float) -> tuple[float, float]:
        """The stage's load factor ``rho`` and the delayed-transition band ``delta`` (without
        its floor)."""
        mu = self.stages[stage].capacity(self._gear[stage])
        lam = self._arrive[stage].rate(now)
        short = self._arrive_short[stage].rate(now)
        return lam / mu, abs(short - lam) / mu


class PipelineDropper:
    """The dropping policy of one pipeline: requests' deadlines and routes, the forecast, one
    adaptive priority per stage and every drop made. ``enter`` is asked when a request reaches
    a stage; ``select`` when a stage forms a batch from its queue.

    >>> dropper = PipelineDropper(DropPolicy.named("proactive"),
    ...                           [StageProfile("a", (0.01,)), StageProfile("b", (0.02,))])
    >>> dropper.register(0, deadline_s=0.025, route=(0, 1))
    >>> dropper.enter(0, 0, now=0.0).reason  # 10 ms at a, 20 ms at b: 30 ms > 25 ms
    'at a: predicted finish 0.0300 s > deadline 0.0250 s'
    """

    def __init__(self, policy: DropPolicy, stages: Sequence[StageProfile]) -> None:
        self.policy = policy
        self.forecast = PipelineForecast(stages, policy.window_s, policy.runtime_batches,
                                         policy.escalations)
        self.priority = [AdaptivePriority() for _ in stages]
        self.drops: dict[int, Drop] = {}
        self._deadline: dict[int, float] = {}
        self._route: dict[int, tuple[int, ...]] = {}

    def register(self, request_id: int, deadline_s: float, route: Sequence[int]) -> None:
        """A request of the pipeline: its absolute deadline and the stages it passes."""
        self._deadline[request_id] = deadline_s
        self._route[request_id] = tuple(route)

    def deadline_s(self, request_id: int) -> float:
        return self._deadline[request_id]

    def forget(self, request_id: int) -> None:
        """``request_id`` got its outcome (a long-running engine keeps no state of it)."""
        self._deadline.pop(request_id, None)
        self._route.pop(request_id, None)
        self.drops.pop(request_id, None)

    def _ahead(self, request_id: int, stage: int) -> tuple[int, ...]:
        route = self._route[request_id]
        return route[route.index(stage) + 1:]

    def _drop(self, rid: int, stage: int, now: float, predicted: float) -> Drop:
        if rid in self.drops:
            raise PolicyError(f"request {rid} was already dropped")
        rule = self.policy.rule
        d = Drop(rid, stage, self.forecast.stages[stage].name, now,
                 now if rule == "reactive" else predicted, self._deadline[rid], rule)
        self.drops[rid] = d
        return d

    def enter(self, request_id: int, stage: int, now: float) -> Drop | None:
        """``request_id`` reaches ``stage``: the drop if it is dropped here, else None."""
        self.forecast.observe_arrival(stage, now)
        rule = self.policy.rule
        if rule == "none":
            return None
        f = self.forecast
        left = f.stage_s(stage, now) + f.remaining_s(self._ahead(request_id, stage), now) \
            if rule == "proactive" else 0.0
        if should_drop(rule, self._deadline[request_id], now, left):
            return self._drop(request_id, stage, now, now + left)
        return None

    def mode(self, stage: int, now: float) -> Literal["fcfs", "lbf", "hbf"]:
        """The order ``stage`` serves its queue in now (updating the adaptive priority)."""
        prio = self.policy.priority
        if prio != "adaptive":
            return prio
        rho, spread = self.forecast.load(stage, now)
        return self.priority[stage].update(rho, max(self.policy.delta_min, spread))

    def select(self, stage: int, queued: Sequence[int], since: Sequence[float], now: float,
               take: int, replica: int | None = None) -> tuple[list[int], list[Drop]]:
        """``stage`` forms a batch of at most ``take`` rows from ``queued`` (request ids in
        arrival order, queued since ``since``) on ``replica`` (None: the first model of the
        gear it serves in): the rows it runs, in serving order, and the requests dropped now
        (the whole queue is checked)."""
        rule, f = self.policy.rule, self.forecast
        # the model the batch is charged: its own, or (without ``escalations``, or for a
        # queue of a swapped-out plan) the serving gear's first
        charge = replica if self.policy.escalations else None
        kept: list[int] = []
        budgets: list[float] = []
        drops: list[Drop] = []
        if rule == "none" and self.policy.priority == "fcfs":
            kept = list(queued[:take])
        else:
            exec_now = f.exec_at(stage, min(len(queued), take), charge)
            if charge is not None:  # a cascade's later models, for the rows that escalate
                exec_now += f.after_batch(stage, charge, now)
            ahead_cache: dict[tuple[int, ...], float] = {}
            for rid in queued:
                ahead = self._ahead(rid, stage)
                rest = ahead_cache.get(ahead)
                if rest is None:
                    rest = ahead_cache[ahead] = f.remaining_s(ahead, now)
                left = exec_now + rest
                deadline = self._deadline[rid]
                if should_drop(rule, deadline, now, left):
                    drops.append(self._drop(rid, stage, now, now + left))
                else:
                    kept.append(rid)
                    budgets.append(deadline - now - left)
            order = priority_order(budgets, self.mode(stage, now))
            kept = [kept[i] for i in order[:take]]
        if kept:
            pos = {rid: i for i, rid in enumerate(queued)}
            f.observe_batch(stage, now, [now - since[pos[r]] for r in kept], replica)
        return kept, drops

    def gate(self, stage: int) -> StageGate:
        return StageGate(self, stage)


class StageGate:
    """What one stage's dispatcher asks when it forms a batch (``PipelineDropper.select``
    bound to the stage); the drops wait in ``dropped`` for the caller to collect."""

    def __init__(self, dropper: PipelineDropper, stage: int) -> None:
        self.dropper, self.stage = dropper, stage
        self.dropped: list[Drop] = []

    def select(self, queued: Sequence[int], since: Sequence[float], now: float, take: int,
               replica: int | None = None) -> tuple[list[int], list[int]]:
        kept, drops = self.dropper.select(self.stage, queued, since, now, take, replica)
        self.dropped.extend(drops)
        return kept, [d.request_id for d in drops]

    def ran(self, replica: int, rows: int, seconds: float, escalated: int = 0) -> None:
        """A batch the stage's dispatcher started finished (``Dispatcher.finish``)."""
        self.dropper.forecast.observe_run(self.stage, replica, rows, seconds, escalated)

    def gear(self, current: int) -> None:
        """The stage's dispatcher serves in gear ``current`` from now on."""
        self.dropper.forecast.observe_gear(self.stage, current)

    def retired(self) -> RetiredGate:
        """This gate for a dispatcher whose plan was swapped out: it still chooses and drops
        the rows that finish there, but its batches and gears no longer tell the forecast,
        which reads the new plan's profile."""
        return RetiredGate(self)

    def take(self) -> list[Drop]:
        """The drops made since the last call (the caller answers them)."""
        out, self.dropped = self.dropped, []
        return out


class RetiredGate:
    """A ``StageGate`` whose ``ran`` and ``gear`` are ignored (``StageGate.retired``)."""

    def __init__(self, gate: StageGate) -> None:
        self.inner = gate

    def select(self, queued: Sequence[int], since: Sequence[float], now: float, take: int,
               replica: int | None = None) -> tuple[list[int], list[int]]:
        """Chosen by the new plan's forecast; ``replica`` is the old plan's, which its
        profile does not know, so the batch is charged (and its waits counted) as one of the
        serving gear's first model."""
        return self.inner.select(queued, since, now, take, None)

    def ran(self, replica: int, rows: int, seconds: float, escalated: int = 0) -> None:
        """Measured against another plan's replicas: not read."""

    def gear(self, current: int) -> None:
        """Another plan's gear: not read."""


@dataclass(frozen=True)
class DeadlineMetrics:
    """What a run with end-to-end deadlines did: answers within their deadline per second of
    the trace (goodput), the shares dropped and answered late, the device seconds spent on
    requests dropped later or answered late (wasted) out of all, and the drops per stage."""

    requests: int
    on_time: int
    dropped: int
    late: int
    duration_s: float
    goodput_qps: float
    drop_rate: float
    late_rate: float
    wasted_device_s: float
    device_s: float
    drops_by_stage: tuple[tuple[str, int], ...]

    @property
    def wasted_share(self) -> float:
        return self.wasted_device_s / self.device_s if self.device_s > 0 else 0.0


def deadline_metrics(arrival_s: Sequence[float], completion_s: Sequence[float],
                     deadline_s: Sequence[float], drops: Sequence[Drop],
                     device_s: Sequence[float], stage_names: Sequence[str]
                     ) -> DeadlineMetrics:
    """``completion_s[i]``: NaN for a dropped request; ``device_s[i]``: the device seconds
    charged to request ``i`` (its share of each batch it ran in)."""
    n = len(arrival_s)
    dropped = {d.request_id for d in drops}
    on_time = late = 0
    wasted = 0.0
    for i in range(n):
        if i in dropped:
            wasted += device_s[i]
        elif completion_s[i] <= deadline_s[i]:
            on_time += 1
        else:
            late += 1
            wasted += device_s[i]
    span = (max(arrival_s) - min(arrival_s)) if n else 0.0
    by_stage = {name: 0 for name in stage_names}
    for d in drops:
        by_stage[d.stage_name] = by_stage.get(d.stage_name, 0) + 1
    return DeadlineMetrics(
        requests=n, on_time=on_time, dropped=len(dropped), late=late, duration_s=span,
        goodput_qps=on_time / span if span > 0 else float(on_time),
        drop_rate=len(dropped) / n if n else 0.0, late_rate=late / n if n else 0.0,
        wasted_device_s=wasted, device_s=math.fsum(device_s),
        drops_by_stage=tuple(by_stage.items()))
