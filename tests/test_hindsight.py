"""The simulator fed a replay's own batch times (``ken.engine.hindsight``, and the simulator's
``runtimes`` and ``rows``): by hand on the simulator's own batches, and on an engine serving
a two-stage cascade of fake models."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import LABELS, SlowModel
from test_engine import plan, texts

from ken.engine.calibrate import fit_calibration
from ken.engine.hindsight import hindsight
from ken.engine.outcome import Outcome
from ken.engine.replay import replay
from ken.engine.request_path import BatchPath, PathLog
from ken.engine.serving import Engine
from ken.engine.supervision import BatchRecord
from ken.errors import KenError, SimulationError
from ken.models.cascade import Cascade
from ken.models.datasets import LabelledSample
from ken.optimizer.perf import Catalog, ModelPerf
from ken.optimizer.simulator import sample_rows, simulate, simulate_many
from ken.optimizer.workload import Trace, poisson_trace
from ken.policy.plan import GearPlan, RangeSchedule, Replica
from ken.policy.scheduling import Batch


def _fake_catalog(models: dict, rows: list[str], labels: list[int]) -> Catalog:
    """The fake models' own probabilities per row (so the simulator escalates the rows the
    engine escalates), 5 and 10 ms a batch."""
    probs = {m: np.array([models[m].probabilities(t) for t in rows]) for m in models}
    return Catalog({m: ModelPerf(m, (1, 16), ((t, 2 * t),), (1,))
                    for m, t in (("a", 0.005), ("b", 0.010))},
                   {m: (probs[m].argmax(axis=1) == np.array(labels)).astype(float)
                    for m in models}, probs)


def _catalog(n: int = 80) -> Catalog:
    models = {"a": SlowModel("a", 0.0), "b": SlowModel("b", 0.0)}
    return _fake_catalog(models, texts(n), [i % 3 for i in range(n)])


def test_a_runtime_given_per_batch_replaces_the_catalogs() -> None:
    """None everywhere is the plain simulation; a constant is every batch's runtime (one-row
    batches far apart: each stage's latency is that constant); ``rows`` given are the
    requests' sample rows, as the seeded permutation's would be."""
    cat, p = _catalog(), plan(max_batch=1)
    trace = Trace(np.arange(40) * 0.1)
    plain = simulate(p, cat, trace, seed=2)
    seen: list[tuple[int, Batch, float]] = []

    def none(k: int, batch: Batch, now: float) -> None:
        seen.append((k, batch, now))

    same = simulate(p, cat, trace, seed=2, runtimes=none)
    assert np.array_equal(same.completion_s, plain.completion_s)
    assert len(seen) == plain.batches and {k for k, _, _ in seen} == {0}
    fixed = simulate(p, cat, trace, seed=2, runtimes=lambda k, b, now: 0.03)
    stages = fixed.stage[0] + 1
    assert np.allclose(fixed.latency_s, 0.03 * stages)
    rows = sample_rows(len(trace), cat.num_rows, 2)
    two = two_gears()
    others = simulate_many([two], [cat], trace, runtimes=lambda k, b, now: 0.001,
                           replicas=[1] * len(trace))
    assert others.device_busy_s == (("cpu1", pytest.approx(0.001 * others.batches)),)
    with pytest.raises(SimulationError, match="one first-stage replica"):
        simulate_many([two], [cat], trace, replicas=[1])
    # a replica of another model than the gear's first is not where admission queues: the
    # router's pick stands
    assert np.array_equal(simulate_many([two], [cat], trace, replicas=[2] * len(trace)
                                        ).completion_s, simulate(two, cat, trace).completion_s)
    given = simulate(p, cat, trace, seed=0, rows=rows)
    assert np.array_equal(given.stage, plain.stage)
    assert np.array_equal(given.completion_s, plain.completion_s)
    with pytest.raises(SimulationError, match="rows gives 3 sample rows for 40"):
        simulate(p, cat, trace, rows=[0, 1, 2])


def two_gears() -> GearPlan:
    """Model a on two devices, then b; a second gear (above 60 requests/s) escalates less;
    batches of up to 4 rows, a 4-ms wait."""
    placement = (Replica("a", ("cpu0",)), Replica("a", ("cpu1",)), Replica("b", ("cpu1",)))
    cascades = (Cascade(("a", "b"), (0.7,)), Cascade(("a", "b"), (0.4,)))
    return GearPlan("op", (0.0, 60.0, 1e6), cascades, placement,
                    tuple(RangeSchedule(k, (0.5, 0.5, 1.0), (1, 1, 1)) for k in (0, 1)),
                    (4, 4, 4), max_wait_s=0.004)


def test_hindsight_of_the_simulators_own_batches_reproduces_it() -> None:
    """A replay built by hand from a simulation of a two-gear plan (its batches as the
    engine's log, admitted when they arrived, submitted 0.5 ms before; every batch's time
    drawn from 5-25 ms; a tenth of the requests queued at the other replica of a, as
    admission may; every third turned away, metered all the same): fed those times, the
    simulation forms every batch again, switches gear when the engine did and answers each
    request when the log says."""
    cat, p = _catalog(), two_gears()
    arrivals = poisson_trace(75.0, 2.0, seed=4).arrival_s
    turned = set(range(2, len(arrivals), 3))  # offered 75/s, admitted 50/s: gear 0 or 1
    served = [i for i in range(len(arrivals)) if i not in turned]
    trace = Trace(arrivals[served] - arrivals[served[0]])
    rng = np.random.default_rng(1)
    runs: list[tuple[Batch, float, float]] = []

    def drawn(k: int, batch: Batch, now: float) -> float:
        dt = float(rng.uniform(0.005, 0.025))
        runs.append((batch, now, dt))
        return dt

    def meter(loop: object, now: float) -> None:  # rejected by admission: metered, routed
        loop.runners[0].dispatcher.arrival(now)  # type: ignore[attr-defined]
        loop.runners[0].dispatcher.route()  # type: ignore[attr-defined]

    rows = sample_rows(len(trace), cat.num_rows, 0)
    moved = [1 if j % 10 == 3 else None for j in range(len(trace))]  # the router's is 0, 1, ..
    sim = simulate_many([p], [cat], trace, rows=rows, runtimes=drawn, replicas=moved,
                        timers=[(arrivals[i] - arrivals[served[0]], meter) for i in turned])
    assert len(set(sim.range_index[0])) == 2 and sim.stage[0].max() == 1  # both gears, stages
    log = PathLog()
    rid = [100 + i for i in range(len(trace))]  # the engine's ids are not trace indices
    for j, t in enumerate(trace.arrival_s):
        log.admit(rid[j], 5.0 + t)  # the engine's clock has another origin
    for batch, now, dt in runs:
        record = BatchRecord(batch.devices[0], batch.model, len(batch.request_ids),
                             5.0 + now, 5.0 + now + dt, 0.0)
        log.batch(BatchPath(record, tuple(rid[j] for j in batch.request_ids)))
    outcomes = [Outcome(rid[j], "ok", 5.0 + t - 0.0005, 5.0 + sim.completion_s[j], "x",
                        stage=int(sim.stage[0][j]), gear=int(sim.range_index[0][j]))
                for j, t in enumerate(trace.arrival_s)]
    for i in sorted(turned):
        at = 5.0 + arrivals[i] - arrivals[served[0]]
        log.turn(900 + i, at, True)
        outcomes.append(Outcome(900 + i, "rejected", at, at + 0.0002, gear=0))
    rows = [*rows, *[0] * len(turned)]
    h = hindsight(p, cat, outcomes, rows, log)
    assert h.requests == len(trace) and h.left_out == len(turned)
    assert h.own_batches == h.batches == len(runs)
    assert h.other_gear == h.other_stage == 0
    assert h.median_abs_ms == pytest.approx(0.0, abs=1e-6)
    assert h.p95_abs_ms == pytest.approx(0.0, abs=1e-6)
    measured = np.percentile(sim.latency_s + 0.0005, 95) * 1000
    assert h.measured_p95_ms == pytest.approx(measured)
    assert h.own_times_p95_ms == pytest.approx(measured)
    assert h.own_calibration_p95_ms is None  # no own calibration given
    assert h.to_dict()["own_times_error"] == pytest.approx(0.0, abs=1e-9)
    assert f"({h.batches:,} of {h.batches:,} batches)" in h.describe()
    assert "in another gear" not in h.describe()
    with pytest.raises(KenError, match="sample rows for"):
        hindsight(p, cat, outcomes, rows[1:], log)
    with pytest.raises(KenError, match="no answered request"):
        hindsight(p, cat, outcomes[-1:], [0], log)
    # without the turned-away requests' metering the gears are no longer the engine's
    assert hindsight(p, cat, outcomes[:len(trace)], rows[:len(trace)], log).other_gear > 0


def test_fed_the_engines_own_batch_times_the_simulator_answers_when_the_engine_did() -> None:
    """A 5-ms and a 10-ms model in a cascade on thread workers, 1.5 s of Poisson arrivals at
    150 requests/s: fed the engine's batch times, the simulation escalates the same rows,
    forms most batches the engine formed (94-100% on an idle machine: a row admitted within
    the engine's own fraction of a millisecond between a call's answer and the next batch may
    fall into another batch) and answers the median request within 2 ms of the engine."""
    n = 120
    models = {"a": SlowModel("a", 0.005), "b": SlowModel("b", 0.010)}
    rows, labels = texts(n), [i % 3 for i in range(n)]
    cat = _fake_catalog(models, rows, labels)
    sample = LabelledSample("tweets", tuple(rows), np.array(labels), LABELS)
    p = plan(max_batch=8, max_wait_s=0.002)
    trace = poisson_trace(150.0, 1.5, seed=3)
    with Engine(p, models, workers="thread") as engine:
        rep = replay(engine, trace, sample, seed=5)
        own = fit_calibration(engine.batch_log, cat)
        h = hindsight(p, cat, rep.outcomes, rep.rows, engine.path_log, own.apply(cat))
    assert rep.status_counts() == {"ok": len(trace)}
    assert h.requests == len(trace) and h.left_out == 0
    assert h.other_stage == 0 and h.other_gear == 0
    assert h.own_batches >= 0.75 * h.batches
    assert h.median_abs_ms <= 2.0
    assert h.own_calibration_p95_ms is not None and h.own_calibration_p95_ms > 0
    assert "in hindsight" in h.describe() and "own calibration" in h.describe()


def _replay_by_hand(p: GearPlan, cat: Catalog, trace: Trace, factor) -> tuple:
    """A replay of ``trace`` built from a simulation in which each batch took
    ``factor(batch, now)`` times what ``cat`` charges it: (outcomes, rows, path log, the
    simulation)."""
    def runtime(k: int, batch: Batch, now: float) -> float:
        dt = factor(batch, now) * cat.perf_on(batch.model, batch.devices[0]).batch_runtime(
            len(batch.request_ids))
        runs.append((batch, now, dt))
        return dt

    runs: list[tuple[Batch, float, float]] = []
    rows = sample_rows(len(trace), cat.num_rows, 0)
    sim = simulate_many([p], [cat], trace, rows=rows, runtimes=runtime)
    log = PathLog()
    for j, t in enumerate(trace.arrival_s):
        log.admit(j, t)
    for batch, now, dt in runs:
        log.batch(BatchPath(BatchRecord(batch.devices[0], batch.model,
                                        len(batch.request_ids), now, now + dt, 0.0),
                            tuple(batch.request_ids)))
    outcomes = [Outcome(j, "ok", t, sim.completion_s[j], "x", stage=int(sim.stage[0][j]),
                        gear=0) for j, t in enumerate(trace.arrival_s)]
    return outcomes, rows, log, sim


def test_shuffled_own_factors_tell_which_batch_got_which_time() -> None:
    """Every batch of a model at twice its charge, of the other at its charge: the own
    factors shuffled (per model) are the own times. The slow batches all in a burst:
    shuffled among all batches, the burst's share of them is spread over the calm, and the
    p95 falls well below the replay's own."""
    cat, p = _catalog(), plan(max_batch=4, max_wait_s=0.002)
    calm = poisson_trace(40.0, 3.0, seed=6).arrival_s
    burst = 1.3 + poisson_trace(250.0, 0.4, seed=7).arrival_s
    trace = Trace(np.sort(np.concatenate([calm, burst])))
    outcomes, rows, log, _ = _replay_by_hand(p, cat, trace,
                                             lambda b, now: 2.0 if b.model == "a" else 1.0)
    h = hindsight(p, cat, outcomes, rows, log, cat)
    assert h.own_batches == h.batches
    assert h.shuffled_p95_ms == pytest.approx(h.own_times_p95_ms)
    assert h.to_dict()["shuffled_p95_ms"] == h.shuffled_p95_ms
    assert "shuffled among them" in h.describe() and h.shuffled_error == pytest.approx(0.0)
    outcomes, rows, log, _ = _replay_by_hand(
        p, cat, trace, lambda b, now: 4.0 if 1.3 <= now <= 1.9 else 1.0)
    h = hindsight(p, cat, outcomes, rows, log, cat)
    assert h.own_times_p95_ms == pytest.approx(h.measured_p95_ms)
    assert h.shuffled_p95_ms < 0.8 * h.own_times_p95_ms
    assert hindsight(p, cat, outcomes, rows, log).shuffled_p95_ms is None  # no calibration
