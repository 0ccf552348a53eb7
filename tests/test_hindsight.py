"""The simulator fed a replay's own batch times (``ken.engine.hindsight``, and the simulator's
``runtimes`` and ``rows``): by hand on the simulator's own batches, and on an engine serving
a two-stage cascade of fake models."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import LABELS, SlowModel
from test_engine import plan, texts

from ken.engine.hindsight import hindsight
from ken.engine.outcome import Outcome
from ken.engine.replay import replay
from ken.engine.request_path import BatchPath, PathLog
from ken.engine.serving import Engine
from ken.engine.supervision import BatchRecord
from ken.errors import KenError, SimulationError
from ken.models.datasets import LabelledSample
from ken.optimizer.perf import Catalog, ModelPerf
from ken.optimizer.simulator import sample_rows, simulate
from ken.optimizer.workload import Trace, poisson_trace
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
    given = simulate(p, cat, trace, seed=0, rows=rows)
    assert np.array_equal(given.stage, plain.stage)
    assert np.array_equal(given.completion_s, plain.completion_s)
    with pytest.raises(SimulationError, match="rows gives 3 sample rows for 40"):
        simulate(p, cat, trace, rows=[0, 1, 2])


def test_hindsight_of_the_simulators_own_batches_reproduces_it() -> None:
    """A replay built by hand from a simulation (its batches as the engine's log, admitted
    when they arrived, submitted 0.5 ms before; every batch's time drawn from 5-25 ms):
    fed those times, the simulation forms every batch again and answers each request when
    the log says; requests rejected or missing from the log are left out."""
    cat, p = _catalog(), plan(max_batch=4, max_wait_s=0.004)
    trace = poisson_trace(120.0, 1.0, seed=4)
    rng = np.random.default_rng(1)
    runs: list[tuple[Batch, float, float]] = []

    def drawn(k: int, batch: Batch, now: float) -> float:
        dt = float(rng.uniform(0.005, 0.025))
        runs.append((batch, now, dt))
        return dt

    rows = sample_rows(len(trace), cat.num_rows, 0)
    sim = simulate(p, cat, trace, rows=rows, runtimes=drawn)
    log = PathLog()
    rid = [100 + i for i in range(len(trace))]  # the engine's ids are not trace indices
    for i, t in enumerate(trace.arrival_s):
        log.admit(rid[i], 5.0 + t)  # the engine's clock has another origin
    for batch, now, dt in runs:
        record = BatchRecord(batch.devices[0], batch.model, len(batch.request_ids),
                             5.0 + now, 5.0 + now + dt, 0.0)
        log.batch(BatchPath(record, tuple(rid[j] for j in batch.request_ids)))
    outcomes = [Outcome(rid[i], "ok", 5.0 + t - 0.0005, 5.0 + sim.completion_s[i], "x",
                        stage=int(sim.stage[0][i]), gear=int(sim.range_index[0][i]))
                for i, t in enumerate(trace.arrival_s)]
    outcomes.append(Outcome(999, "rejected", 6.0, 6.0))
    h = hindsight(p, cat, [*outcomes], [*rows, 0], log)
    assert h.requests == len(trace) and h.left_out == 1
    assert h.own_batches == h.batches == len(runs)
    assert h.other_gear == h.other_stage == 0
    assert h.median_abs_ms == pytest.approx(0.0, abs=1e-6)
    assert h.p95_abs_ms == pytest.approx(0.0, abs=1e-6)
    measured = np.percentile(sim.latency_s + 0.0005, 95) * 1000
    assert h.measured_p95_ms == pytest.approx(measured)
    assert h.own_times_p95_ms == pytest.approx(measured)
    assert h.own_calibration_p95_ms is None  # no calls given
    assert h.to_dict()["own_times_error"] == pytest.approx(0.0, abs=1e-9)
    assert f"({h.batches:,} of {h.batches:,} batches)" in h.describe() and "+0%" in h.describe()
    with pytest.raises(KenError, match="sample rows for"):
        hindsight(p, cat, outcomes, rows, log)
    with pytest.raises(KenError, match="no answered request"):
        hindsight(p, cat, outcomes[-1:], [0], log)


def test_fed_the_engines_own_batch_times_the_simulator_answers_when_the_engine_did() -> None:
    """A 5-ms and a 10-ms model in a cascade on thread workers, 1.5 s of Poisson arrivals at
    150 requests/s: fed the engine's batch times, the simulation escalates the same rows,
    forms nearly every batch the engine formed (a row admitted within the engine's own
    fraction of a millisecond between a call's answer and the next batch may fall into
    another batch) and answers the median request within a millisecond of the engine."""
    n = 120
    models = {"a": SlowModel("a", 0.005), "b": SlowModel("b", 0.010)}
    rows, labels = texts(n), [i % 3 for i in range(n)]
    cat = _fake_catalog(models, rows, labels)
    sample = LabelledSample("tweets", tuple(rows), np.array(labels), LABELS)
    p = plan(max_batch=8, max_wait_s=0.002)
    trace = poisson_trace(150.0, 1.5, seed=3)
    with Engine(p, models, workers="thread") as engine:
        rep = replay(engine, trace, sample, seed=5)
        h = hindsight(p, cat, rep.outcomes, rep.rows, engine.path_log,
                      [r for r in engine.batch_log])
    assert rep.status_counts() == {"ok": len(trace)}
    assert h.requests == len(trace) and h.left_out == 0
    assert h.other_stage == 0 and h.other_gear == 0
    assert h.own_batches >= 0.9 * h.batches
    assert h.median_abs_ms <= 1.0
    assert h.own_calibration_p95_ms is not None and h.own_calibration_p95_ms > 0
    assert "in hindsight" in h.describe() and "own calibration" in h.describe()
