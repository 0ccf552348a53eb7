"""Online engine on fake models: exactly-once outcomes, batching triggers, concurrency,
worker failure, overload and shutdown."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fakes import FakeModel

from ken.engine.serving import Engine, EngineError
from ken.operators.cascade import Cascade
from ken.operators.certainty import certainty_fn
from ken.optimizer.plan import GearPlan, RangeSchedule, Replica

CASCADE = Cascade(("a", "b"), (0.6,))


def plan(min_queue: int = 1, max_wait_s: float = 0.02, max_batch: int = 16) -> GearPlan:
    placement = (Replica("a", ("cpu0",)), Replica("b", ("cpu1",)))
    return GearPlan("op", (0.0, 1e6), (CASCADE,), placement,
                    (RangeSchedule(0, (1.0, 1.0), (min_queue, min_queue)),),
                    (max_batch, max_batch), max_wait_s=max_wait_s)


def expected(models: dict[str, FakeModel], text: str) -> tuple[int, int]:
    """(label index, stage) of the cascade for one text, by hand."""
    cert = certainty_fn("max_prob")
    for stage, name in enumerate(CASCADE.models):
        p = models[name].probabilities(text)
        last = stage == len(CASCADE.models) - 1
        if last or cert(p[None, :])[0] >= CASCADE.thresholds[stage]:
            return int(p.argmax()), stage
    raise AssertionError


def texts(n: int) -> list[str]:
    return [f"tweet number {i}" for i in range(n)]


class SlowModel(FakeModel):
    def __init__(self, name: str, seconds: float) -> None:
        super().__init__(name)
        self.seconds = seconds

    def predict(self, texts, batch_size=32):  # noqa: ANN001, ANN201
        time.sleep(self.seconds)
        return super().predict(texts, batch_size)


class FlakyModel(FakeModel):
    """Raises on its first ``failures`` calls (a worker dying mid-batch)."""

    def __init__(self, name: str, failures: int) -> None:
        super().__init__(name)
        self.failures = failures

    def predict(self, texts, batch_size=32):  # noqa: ANN001, ANN201
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("worker died")
        return super().predict(texts, batch_size)


def test_concurrent_clients_get_the_serial_answers_exactly_once() -> None:
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    rows = texts(400)
    with Engine(plan(), models) as engine:
        def client(chunk: list[str]) -> list:
            return [f.result(timeout=10) for f in [engine.submit(t) for t in chunk]]

        with ThreadPoolExecutor(32) as pool:
            results = [o for part in pool.map(client, [rows[i::32] for i in range(32)])
                       for o in part]
    assert len(results) == 400 and len({o.request_id for o in results}) == 400
    ordered = [o for part in [rows[i::32] for i in range(32)] for o in part]
    for text, outcome in zip(ordered, results, strict=True):
        assert outcome.status == "ok"
        label, stage = expected(models, text)
        assert (outcome.label_index, outcome.stage) == (label, stage), text
        assert outcome.completion_s >= outcome.arrival_s
    # every row ran stage a once; escalated rows ran b once
    assert len(models["a"].rows_seen) == 400
    assert len(models["b"].rows_seen) == sum(o.stage == 1 for o in results)


def test_null_input_and_type_errors() -> None:
    with Engine(plan(), {"a": FakeModel("a"), "b": FakeModel("b")}) as engine:
        assert engine.submit(None).result(timeout=5).status == "null"
        with pytest.raises(EngineError, match="text"):
            engine.submit(42)  # type: ignore[arg-type]
    with pytest.raises(EngineError, match="no model was given"):
        Engine(plan(), {"a": FakeModel("a")})


def test_queue_trigger_waits_for_min_queue_or_max_wait() -> None:
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    with Engine(plan(min_queue=8, max_wait_s=0.3), models) as engine:
        futures = [engine.submit(t) for t in texts(8)]
        [f.result(timeout=5) for f in futures]
        assert models["a"].calls[0][0] == 8  # the first batch waited for 8 rows
        t0 = time.monotonic()
        lone = engine.submit("a lonely tweet").result(timeout=5)
        waited = time.monotonic() - t0
    assert lone.status == "ok"
    assert waited >= 0.3  # below min queue: it ran when the max wait passed
    assert all(rows <= 16 for rows, _ in models["a"].calls)


def test_a_failing_worker_is_restarted_and_its_batch_rerun() -> None:
    models = {"a": FlakyModel("a", failures=1), "b": FakeModel("b")}
    with Engine(plan(), models) as engine:
        outcomes = [f.result(timeout=5) for f in [engine.submit(t) for t in texts(20)]]
    assert [o.status for o in outcomes] == ["ok"] * 20
    assert engine.worker_restarts == 1
    assert len(models["a"].rows_seen) == 20  # the failed call recorded nothing; no duplicates


def test_a_batch_that_keeps_failing_ends_in_error_not_silence() -> None:
    models = {"a": FlakyModel("a", failures=10**6), "b": FakeModel("b")}
    with Engine(plan(), models, max_retries=2) as engine:
        outcomes = [f.result(timeout=5) for f in [engine.submit(t) for t in texts(5)]]
    assert {o.status for o in outcomes} == {"error"}
    assert all("worker died" in o.error for o in outcomes)


def test_overload_rejects_explicitly_and_every_request_ends() -> None:
    models = {"a": SlowModel("a", 0.02), "b": FakeModel("b")}
    with Engine(plan(max_batch=4), models, max_in_flight=20) as engine:
        futures = [engine.submit(t) for t in texts(300)]
        outcomes = [f.result(timeout=30) for f in futures]
        assert engine.in_flight == 0
    statuses = {o.status for o in outcomes}
    assert statuses <= {"ok", "rejected"} and "rejected" in statuses
    assert sum(o.status == "ok" for o in outcomes) >= 20


def test_shutdown_without_drain_cancels_what_is_left() -> None:
    models = {"a": SlowModel("a", 0.05), "b": FakeModel("b")}
    engine = Engine(plan(max_batch=2), models)
    engine.start()
    futures = [engine.submit(t) for t in texts(40)]
    cancelled = engine.shutdown(drain=False)
    outcomes = [f.result(timeout=5) for f in futures]
    assert cancelled >= 1
    assert sum(o.status == "cancelled" for o in outcomes) == cancelled
    assert {o.status for o in outcomes} <= {"ok", "cancelled"}
    late = engine.submit("after shutdown").result(timeout=1)
    assert late.status == "cancelled"
    assert threading.active_count() < 50


def test_replay_accuracy_equals_the_simulated_accuracy_of_the_same_plan(tmp_path) -> None:  # noqa: ANN001
    from ken.engine.replay import plot_replay, replay
    from ken.optimizer.perf import Catalog, ModelPerf
    from ken.optimizer.simulator import simulate
    from ken.optimizer.workload import poisson_trace

    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    rows = texts(120)
    labels = [i % 3 for i in range(120)]
    probs = {m: np.array([models[m].probabilities(t) for t in rows]) for m in models}
    catalog = Catalog({m: ModelPerf(m, (1, 16), ((0.001, 0.002),), (1,)) for m in models},
                      {m: probs[m].argmax(axis=1) == np.array(labels) for m in models}, probs)
    trace = poisson_trace(150, 1.5, seed=3)
    p = plan()
    with Engine(p, models) as engine:
        rep = replay(engine, trace, rows, labels, seed=5)
    assert rep.status_counts() == {"ok": len(trace)}
    simulated = simulate(p, catalog, trace, seed=5).metrics(0, p)
    measured = rep.result.metrics(0, p)
    assert measured.accuracy == simulated.accuracy
    assert measured.num_requests == simulated.num_requests == len(trace)
    assert np.array_equal(rep.result.stage[0], simulate(p, catalog, trace, seed=5).stage[0])
    import json
    assert json.loads(rep.to_json(p))["status"] == {"ok": len(trace)}
    png = plot_replay(rep, p, tmp_path / "replay.png")
    assert png.stat().st_size > 1000


def test_ken_replay_needs_a_frontier_file(tmp_path, capsys) -> None:  # noqa: ANN001
    from ken.cli import main

    assert main(["replay", "--quiet", "--frontier", str(tmp_path / "none.json")]) == 2
    assert "ken plan" in capsys.readouterr().err
