"""The simulator fed a replay's own call times (issue 33, item 3).

When a replay's p95 misses its simulation, the miss is either in the simulator's structure
(queues, batching triggers, routing, gears, escalations: the ``Dispatcher`` the engine shares)
or in the runtimes it charges each batch: their level (the machine ran slower or faster than
the calibration said) or how they fall (which batches ran slow, and when). ``hindsight``
tells them apart after the fact:

- **own times**: the replay's admitted requests are simulated at the times the engine admitted
  them, on the sample rows they asked, and each batch is charged the time the engine's batch
  of the same model and rows held its device (``BatchRecord.held_s``); a batch the engine did
  not form (the two diverged) is charged as on the own calibration below where one is given,
  else the catalog's. If the structure is the engine's, the simulation forms the engine's
  batches and answers each request when the engine did.
- **own calibration** (``drawn``): the same requests simulated on a catalog calibrated on the
  replay's own calls (the caller's ``fit_calibration(calls, profiles).apply(profiles)``: a
  factor per batch size and the spread of the rest, drawn per batch), the median p95 over a
  few seeds: the level is the replay's, each batch's draw is the simulator's.
- **shuffled** (with ``drawn``): each of the engine's batches' held time over what ``drawn``
  charges it without the spread (its size's factor, its longest row; a wake-up counts in
  its factor), those factors permuted among the batches of each model and charged again in
  that order (the median p95 over the seeds' permutations): the replay's own factors, but
  not which batch got which.

Measured against own times is the structure's error; own times against own calibration is what
drawing each batch's time independently misses, split by the shuffled times into which batch
got which time (own times against shuffled) and the fitted form of the times (shuffled against
own calibration); the planned calibration against own calibration is the level's.
Admission (submit to the scheduler taking a request in), which the simulator does not model,
is added to each simulated latency as measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ken.engine.charge import predicted_s
from ken.engine.outcome import Outcome
from ken.engine.request_path import BatchPath, PathLog
from ken.engine.supervision import BatchRecord
from ken.errors import KenError
from ken.optimizer.perf import Catalog
from ken.optimizer.sim_core import EventLoop
from ken.optimizer.simulator import Runtimes, SimResult, simulate_many
from ken.optimizer.workload import Trace, is_gpu_id
from ken.policy.plan import GearPlan
from ken.policy.scheduling import Batch

#: seeds the own-calibration simulation takes the median p95 of (and the shuffled form:
#: permutations)
SEEDS = 3


@dataclass(frozen=True)
class Hindsight:
    """A replay against the simulator fed its own batch times, on its own calibration and
    on its own batches' factors shuffled (milliseconds; errors as measured / simulated - 1)."""

    requests: int  # compared: the answered requests in the engine's path log
    left_out: int  # the replay's other requests (turned away, failed, older than the log)
    batches: int  # batches the own-times simulation ran
    own_batches: int  # of them, charged the time of the engine's batch of the same rows
    measured_p95_ms: float
    own_times_p95_ms: float
    own_calibration_p95_ms: float | None  # None: no own calibration given
    median_abs_ms: float  # per request, |own-times latency - measured|: median and 95th pct
    p95_abs_ms: float
    other_gear: int  # requests the own-times simulation admitted in another gear
    other_stage: int  # ... answered at another stage of the cascade than the engine did
    shuffled_p95_ms: float | None = None  # the own factors permuted (None: no own calibration)

    @property
    def own_times_error(self) -> float:
        return self.measured_p95_ms / self.own_times_p95_ms - 1.0

    @property
    def own_calibration_error(self) -> float | None:
        if self.own_calibration_p95_ms is None:
            return None
        return self.measured_p95_ms / self.own_calibration_p95_ms - 1.0

    @property
    def shuffled_error(self) -> float | None:
        if self.shuffled_p95_ms is None:
            return None
        return self.measured_p95_ms / self.shuffled_p95_ms - 1.0

    def describe(self) -> str:
        """One sentence: the own-times simulation, then (where given) the own calibration's
        and the shuffled factors'."""
        out = (f"in hindsight, fed this replay's own batch times ({self.own_batches:,} of "
               f"{self.batches:,} batches), the simulator puts the p95 of the "
               f"{self.requests:,} answered requests at {self.own_times_p95_ms:.1f} ms "
               f"against {self.measured_p95_ms:.1f} measured "
               f"({self.own_times_error:+.0%}), each request within {self.median_abs_ms:.1f} "
               f"ms at the median ({self.p95_abs_ms:.1f} at the 95th percentile)")
        if self.other_gear or self.other_stage:
            out += (f"; {self.other_gear:,} requests admitted in another gear and "
                    f"{self.other_stage:,} answered at another stage than the engine's")
        if self.own_calibration_p95_ms is not None:
            out += (f"; on this replay's own calibration, each batch's time drawn, "
                    f"{self.own_calibration_p95_ms:.1f} ms ({self.own_calibration_error:+.0%})")
        if self.shuffled_p95_ms is not None:
            out += (f"; its own batches' factors shuffled among them, "
                    f"{self.shuffled_p95_ms:.1f} ms ({self.shuffled_error:+.0%})")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "left_out": self.left_out,
                "batches": self.batches, "own_batches": self.own_batches,
                "measured_p95_ms": self.measured_p95_ms,
                "own_times_p95_ms": self.own_times_p95_ms,
                "own_times_error": self.own_times_error,
                "own_calibration_p95_ms": self.own_calibration_p95_ms,
                "own_calibration_error": self.own_calibration_error,
                "median_abs_ms": self.median_abs_ms, "p95_abs_ms": self.p95_abs_ms,
                "other_gear": self.other_gear, "other_stage": self.other_stage,
                "shuffled_p95_ms": self.shuffled_p95_ms,
                "shuffled_error": self.shuffled_error}


def hindsight(plan: GearPlan, catalog: Catalog, outcomes: Sequence[Outcome],
              rows: Sequence[int], log: PathLog, drawn: Catalog | None = None,
              seeds: int = SEEDS) -> Hindsight:
    """``outcomes`` of a replay through an engine serving ``plan`` (one plan: no swap), in
    trace order, ``rows`` the sample row of each, ``log`` the engine's path log; ``catalog``
    the profiles (certainties decide the simulated escalations; without ``drawn`` its runtimes
    charge the batches the engine did not form); ``drawn``: a catalog calibrated on the
    replay's own calls, to simulate the same requests on too (the median p95 of ``seeds``
    seeds), and to charge those batches. See the module docstring.

    Simulated: every admitted request the log has a batch of; compared: the answered ones.
    A request the scheduler turned away (``PathLog.turned``: its model failed, its deadline
    could not be met, admission rejected it) is metered when the scheduler metered it, with
    the router's turn where it took one, and so is an admitted request none of whose batches
    the log has (each failed): the gears see the offered load in both. Requests the engine
    turned away before its scheduler saw them (``max_in_flight``) are not metered there
    either."""
    if len(rows) != len(outcomes):
        raise KenError(f"{len(rows)} sample rows for {len(outcomes)} outcomes")
    admitted = log.admitted()
    batches = log.batches()
    held: dict[tuple[str, frozenset[int]], float] = {}
    in_batch: set[int] = set()
    for b in batches:
        held[(b.record.model, frozenset(b.request_ids))] = b.record.held_s
        in_batch.update(b.request_ids)
    keep = sorted((i for i, o in enumerate(outcomes)
                   if o.request_id in admitted and o.request_id in in_batch),
                  key=lambda i: admitted[outcomes[i].request_id])
    ok = np.array([outcomes[i].status == "ok" for i in keep], dtype=bool)
    if not ok.any():
        raise KenError("no answered request of the replay is in the engine's path log")
    rid = [outcomes[i].request_id for i in keep]
    at = np.array([admitted[r] for r in rid])
    trace = Trace(at - at[0], name="admissions")
    sim_rows = [int(rows[i]) for i in keep]
    # metered and not queued: turned away by the scheduler, or admitted with no logged batch;
    # not those from before the log's oldest admission (a replay longer than the log)
    asked = {o.request_id for o in outcomes}
    turned = [(t - at[0], _routed if routed else _metered) for r, t, routed in log.turned()
              if r in asked and t >= at[0]]
    turned += [(t - at[0], _routed) for r, t in admitted.items()
               if r in asked and r not in in_batch and t >= at[0]]
    # the replica admission queued each request at (it may route around the router's pick):
    # the replica its first logged batch ran on (a batch record names its replica's first
    # device); the simulator takes it only where it is a replica of the first model of the
    # gear it admits the request in (``simulate_many(replicas=)``), else the router's pick
    where = {(x.model, x.devices[0]): k for k, x in enumerate(plan.placement)}
    first: dict[int, int] = {}
    for b in sorted(batches, key=lambda b: b.formed_s):
        k = where.get((b.record.model, b.record.device))
        if k is not None:
            for r in b.request_ids:
                first.setdefault(r, k)
    queued_at = [first.get(r) for r in rid]
    counts = {"batches": 0, "own": 0}

    def own(_: int, batch: Batch, now: float) -> float | None:
        counts["batches"] += 1
        seconds = held.get((batch.model, frozenset(rid[j] for j in batch.request_ids)))
        counts["own"] += seconds is not None
        return seconds

    def run(cat: Catalog, seed: int = 0, runtimes: Runtimes | None = None) -> SimResult:
        return simulate_many([plan], [cat], trace, seed, rows=sim_rows, timers=turned,
                             runtimes=runtimes, replicas=queued_at)

    answered = [outcomes[i] for i, good in zip(keep, ok, strict=True) if good]
    admit = (at - np.array([outcomes[i].arrival_s for i in keep]))[ok]
    measured = np.array([o.latency_s for o in answered])
    # a batch the engine did not form: the replay's own calibration where given (in an
    # overloaded replay a sub-millisecond difference re-forms every later batch, and the
    # profiles' runtimes are far from serving's), else the profiles'
    res = run(catalog if drawn is None else drawn, runtimes=own)
    lat = res.latency_s[ok] + admit
    stage = np.array([-1 if o.stage is None else o.stage for o in answered])
    gear = np.array([-1 if o.gear is None else o.gear for o in answered])
    own_cal = shuffled = None
    if drawn is not None:
        own_cal = float(np.median([np.percentile(run(drawn, s).latency_s[ok] + admit, 95)
                                   for s in range(seeds)])) * 1000.0
        # the batches of the requests simulated (not those of a log longer than the replay)
        simulated = set(rid)
        factors = own_factors([b for b in batches if simulated.issuperset(b.request_ids)],
                              drawn)
        shuffled = float(np.median([np.percentile(run(drawn, s, permuted(
            factors, drawn, sim_rows, s)).latency_s[ok] + admit, 95)
            for s in range(seeds)])) * 1000.0
    diff = np.abs(lat - measured) * 1000.0
    return Hindsight(len(answered), len(outcomes) - len(answered), counts["batches"],
                     counts["own"], float(np.percentile(measured, 95)) * 1000.0,
                     float(np.percentile(lat, 95)) * 1000.0, own_cal,
                     float(np.median(diff)), float(np.percentile(diff, 95)),
                     int((res.range_index[0][ok] != gear).sum()),
                     int((res.stage[0][ok] != stage).sum()), shuffled)


def own_factors(batches: Sequence[BatchPath], catalog: Catalog
                ) -> dict[tuple[str, bool], np.ndarray]:
    """Per model and kind of device (GPU or not: a calibration scales CPU runtimes only),
    each logged batch's held time over what ``catalog`` charges it without the spread and as
    if its device had not idled (``predicted_s``; a wake-up stays in its factor), in the
    log's order."""
    out: dict[tuple[str, bool], list[float]] = {}
    for b in batches:
        r = b.record
        out.setdefault((r.model, is_gpu_id(r.device)), []).append(
            r.held_s / predicted_s(replace(r, idle_before_s=0.0), catalog))
    return {k: np.array(v) for k, v in out.items()}


def permuted(factors: dict[tuple[str, bool], np.ndarray], catalog: Catalog,
             rows: Sequence[int], seed: int) -> Runtimes:
    """Batch runtimes for ``simulate_many``: each batch charged as ``own_factors`` does (the
    simulated request ``j`` asks sample row ``rows[j]``) times the next of its model's and
    device kind's ``factors`` in a seeded permutation (cycling); the catalog's own charge
    where there are none. Runtimes per degree of a replica across devices are not
    distinguished (``predicted_s`` charges degree 1; the factor, a ratio, carries it)."""
    rng = np.random.default_rng(seed)
    order = {k: rng.permutation(v) for k, v in factors.items()}
    taken = dict.fromkeys(order, 0)

    def runtime(_: int, batch: Batch, now: float) -> float | None:
        key = (batch.model, is_gpu_id(batch.devices[0]))
        mine = order.get(key)
        if mine is None or not mine.size:
            return None
        k = taken[key]
        taken[key] = k + 1
        sizes = catalog.sizes_of(batch.model)
        largest = 0 if sizes is None else int(max(sizes[rows[j]] for j in batch.request_ids))
        record = BatchRecord(batch.devices[0], batch.model, len(batch.request_ids), 0.0, 0.0,
                             0.0, largest=largest)
        return predicted_s(record, catalog) * float(mine[k % mine.size])

    return runtime


def _metered(loop: EventLoop, now: float) -> None:
    """A request the scheduler metered and turned away before routing it: its plan's
    dispatcher meters it, queues nothing."""
    loop.runners[0].dispatcher.arrival(now)  # type: ignore[attr-defined]


def _routed(loop: EventLoop, now: float) -> None:
    """A request metered and routed, then turned away (or admitted, its batches lost): the
    dispatcher meters it and the router's turn is taken."""
    dispatcher = loop.runners[0].dispatcher  # type: ignore[attr-defined]
    dispatcher.arrival(now)
    dispatcher.route()
