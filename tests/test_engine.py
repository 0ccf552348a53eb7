"""Online engine on fake models: exactly-once outcomes, batching triggers, concurrency,
worker failure, overload and shutdown."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fakes import FakeModel, SlowModel

from ken.engine.serving import Engine, EngineError
from ken.models.cascade import Cascade
from ken.models.certainty import certainty_fn
from ken.models.model import WARM_UP_TEXT
from ken.policy.plan import GearPlan, RangeSchedule, Replica

CASCADE = Cascade(("a", "b"), (0.6,))


def plan(min_queue: int = 1, max_wait_s: float = 0.02, max_batch: int = 16) -> GearPlan:
    placement = (Replica("a", ("cpu0",)), Replica("b", ("cpu1",)))
    return GearPlan("op", (0.0, 1e6), (CASCADE,), placement,
                    (RangeSchedule(0, (1.0, 1.0), (min_queue, min_queue)),),
                    (max_batch, max_batch), max_wait_s=max_wait_s)


def expected(models: dict[str, FakeModel], text: str) -> tuple[str, int]:
    """(label, stage) of the cascade for one text, by hand."""
    cert = certainty_fn("max_prob")
    for stage, name in enumerate(CASCADE.models):
        p = models[name].probabilities(text)
        last = stage == len(CASCADE.models) - 1
        if last or cert(p[None, :])[0] >= CASCADE.thresholds[stage]:
            return models[name].spec.labels[int(p.argmax())], stage
    raise AssertionError


def texts(n: int) -> list[str]:
    return [f"tweet number {i}" for i in range(n)]


class FlakyModel(FakeModel):
    """Raises on its first ``failures`` calls (a worker dying mid-batch)."""

    def __init__(self, name: str, failures: int) -> None:
        super().__init__(name)
        self.failures = failures

    def predict(self, texts, batch_size=32):  # noqa: ANN001, ANN201
        if self.failures > 0 and WARM_UP_TEXT not in texts:
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
        assert (outcome.value, outcome.stage) == (label, stage), text
        p = models[CASCADE.models[stage]].probabilities(text)
        assert outcome.certainty == pytest.approx(float(p.max()))
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
    assert engine.failed_attempts == 1 and engine.worker_restarts == 0  # threads: no restart
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
    from fakes import LABELS

    from ken.engine.replay import plot_replay, replay
    from ken.models.datasets import LabelledSample
    from ken.optimizer.perf import Catalog, ModelPerf
    from ken.optimizer.simulator import simulate
    from ken.optimizer.workload import poisson_trace

    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    rows = texts(120)
    labels = [i % 3 for i in range(120)]
    probs = {m: np.array([models[m].probabilities(t) for t in rows]) for m in models}
    catalog = Catalog({m: ModelPerf(m, (1, 16), ((0.001, 0.002),), (1,)) for m in models},
                      {m: (probs[m].argmax(axis=1) == np.array(labels)).astype(float)
                       for m in models}, probs)
    sample = LabelledSample("tweets", tuple(rows), np.array(labels), LABELS)
    trace = poisson_trace(150, 1.5, seed=3)
    p = plan()
    with Engine(p, models) as engine:
        rep = replay(engine, trace, sample, seed=5)
        # an evaluation sample (label strings as references) scores the same answers alike
        again = replay(engine, trace, sample.as_eval(), seed=5)
    assert again.result.quality.tolist() == rep.result.quality.tolist()
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

    assert main(["replay", "--quiet", "--frontier", str(tmp_path / "none.json")]) == 1
    assert "ken plan" in capsys.readouterr().err


def test_process_workers_survive_a_worker_killed_mid_batch() -> None:
    import functools
    import os
    import signal

    import fakes

    sources = {"a": functools.partial(fakes.SlowModel, "a", 0.6),
               "b": functools.partial(fakes.FakeModel, "b")}
    reference = {"a": FakeModel("a"), "b": FakeModel("b")}
    rows = texts(12)
    with Engine(plan(max_batch=4), sources) as engine:
        assert engine.workers == "process" and engine.load_report.workers == "process"
        pids = engine.pids()
        assert all(pids.values()) and len(set(pids.values())) == 2
        futures = [engine.submit(t) for t in rows]
        time.sleep(0.3)  # the first batch of 4 is inside the 0.6 s model call now
        os.kill(pids["cpu0"], signal.SIGKILL)
        outcomes = [f.result(timeout=60) for f in futures]
        assert engine.pids()["cpu0"] != pids["cpu0"]  # a fresh process serves cpu0
    assert engine.worker_restarts == 1 and engine.failed_attempts == 1
    assert [o.status for o in outcomes] == ["ok"] * len(rows)
    assert len({o.request_id for o in outcomes}) == len(rows)
    for text, o in zip(rows, outcomes, strict=True):
        assert (o.value, o.stage) == expected(reference, text)


def test_a_worker_that_cannot_load_its_model_fails_start_clearly() -> None:
    import functools

    import fakes

    sources = {"a": functools.partial(fakes.broken_loader, "a"),
               "b": functools.partial(fakes.FakeModel, "b")}
    engine = Engine(plan(), sources, workers="process")
    with pytest.raises(Exception, match="could not load its models: FileNotFoundError"):
        engine.start()
    with pytest.raises(EngineError, match="loaders"):
        Engine(plan(), {"a": FakeModel("a"), "b": FakeModel("b")}, workers="process")


def two_gear_plan(edge: float = 100.0, max_batch: int = 1) -> GearPlan:
    """Below ``edge`` qps: cascade a -> b; above it: a alone."""
    placement = (Replica("a", ("cpu0",)), Replica("b", ("cpu1",)))
    fast = Cascade(("a",))
    return GearPlan("op", (0.0, edge, 1e6), (CASCADE, fast), placement,
                    (RangeSchedule(0, (1.0, 1.0), (1, 1)), RangeSchedule(1, (1.0, 0.0), (1, 1))),
                    (max_batch, max_batch), max_wait_s=0.01)


def send(engine: Engine, qps: float, seconds: float, start: int = 0) -> list:
    """Open-loop arrivals at ``qps`` for ``seconds``; returns (submit time, future) pairs."""
    out = []
    t0 = time.monotonic()
    n = int(qps * seconds)
    for i in range(n):
        delay = t0 + i / qps - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        out.append((engine.clock.now(), engine.submit(f"row {start + i}")))
    return out


def test_gear_switches_follow_the_measured_rate_with_hysteresis() -> None:
    models = {"a": SlowModel("a", 0.01), "b": FakeModel("b")}  # a: ~100 rows/s at batch 1
    with Engine(two_gear_plan(edge=100.0), models) as engine:
        calm = send(engine, 20, 0.6)
        burst_start = engine.clock.now()
        burst = send(engine, 300, 0.5, start=1000)  # 150 rows: a backlog builds on a
        burst_end = engine.clock.now()
        after = send(engine, 20, 2.0, start=2000)
        # the move down waits for the burst's backlog: on a busy machine serving it takes
        # longer, so the calm traffic goes on (up to 20 s more) until the gear has come down
        give_up = time.monotonic() + 20.0
        while len(engine.gear_switches) < 2 and time.monotonic() < give_up:
            after += send(engine, 20, 0.5, start=3000 + len(after))
        outcomes = {f.result(timeout=30).request_id: (t, f.result()) for t, f in
                    calm + burst + after}
        held = engine.dispatcher().gears.held
    switches = engine.gear_switches
    assert [(a, b) for _, a, b in switches][:2] == [(0, 1), (1, 0)], switches
    (t_up, _, _), (t_down, _, _) = switches[:2]
    assert burst_start <= t_up <= burst_start + 0.3  # up at once: within a few rate windows
    assert t_down > burst_end  # down only after the burst ...
    assert held > 0  # ... and later than the rate alone says: hysteresis held the gear
    # when it moved down, the burst's backlog on the first stage was (nearly) served:
    # at most rate/alpha rows (20/8) plus the batch in flight were still unanswered
    left = sum(o.completion_s > t_down for t, o in outcomes.values()
               if o.gear == 1 and t <= burst_end)
    assert left <= 20 / 8 + 1, left
    # every request carries the gear active when the scheduler admitted it (a few ms after
    # its submit time)
    for t, o in outcomes.values():
        assert o.status == "ok"
        if t_up < t < t_down - 0.05:
            assert o.gear == 1 and o.stage == 0
        if t < t_up - 0.05:
            assert o.gear == 0


def test_plan_swap_moves_queued_requests_and_loses_nothing() -> None:
    models = {"a": SlowModel("a", 0.3), "b": FakeModel("b")}
    old = plan(min_queue=1, max_batch=2)
    b_only = GearPlan("op", (0.0, 1e6), (Cascade(("b",)),),
                      (Replica("b", ("cpu1",)), Replica("c", ("cpu2",))),
                      (RangeSchedule(0, (0.5, 0.5), (1, 1)),), (8, 8), max_wait_s=0.01)
    with Engine(old, models) as engine:
        futures = [engine.submit(t) for t in texts(10)]
        time.sleep(0.1)  # row 0 runs on a alone (min queue 1); rows 1-9 wait for a
        moved = engine.swap_plan(b_only, {"c": FakeModel("c")})
        outcomes = [f.result(timeout=10) for f in futures]
        late = engine.submit("after the swap").result(timeout=5)
        assert engine.pids().keys() == {"cpu0", "cpu1", "cpu2"}
    assert moved == 9
    assert [o.status for o in outcomes] == ["ok"] * 10 and late.status == "ok"
    assert len({o.request_id for o in outcomes}) == 10
    # the row already running finished under the old plan (a, maybe escalated to b)
    assert (outcomes[0].value, outcomes[0].stage) == expected(models, texts(1)[0])
    # the moved rows and later ones ran the new plan: b alone, stage 0
    assert all(o.model == "b" and o.stage == 0 for o in outcomes[1:] + [late])
    assert len(models["a"].rows_seen) == 1
    assert engine.plan is b_only and engine.plan_swaps[0][1] == 9


def test_swap_needs_a_running_engine_and_known_models() -> None:
    engine = Engine(plan(), {"a": FakeModel("a"), "b": FakeModel("b")})
    with pytest.raises(EngineError, match="not running"):
        engine.swap_plan(plan())
    other = GearPlan("op", (0.0, 1e6), (Cascade(("z",)),), (Replica("z", ("cpu0",)),),
                     (RangeSchedule(0, (1.0,), (1,)),), (4,))
    with engine:
        with pytest.raises(EngineError, match="no model was given"):
            engine.swap_plan(other)
        assert engine.submit("still serving").result(timeout=5).status == "ok"


def test_a_swap_the_engine_shut_down_under_fails_instead_of_waiting_for_ever() -> None:
    """A shutdown (a SIGTERM drain) while a swap loads its models: the scheduler never reads
    the swap, so ``swap_plan`` says the engine shut down rather than wait for it."""
    engine = Engine(plan(), {"a": FakeModel("a"), "b": FakeModel("b")})
    engine.start()
    loading = engine.pool.add

    def add_while_shutting_down(replicas):  # noqa: ANN001, ANN202
        loading(replicas)
        engine.shutdown()  # the stop is queued before the swap

    engine.pool.add = add_while_shutting_down  # type: ignore[method-assign]
    with pytest.raises(EngineError, match="shut down before op's new plan took over"):
        engine.swap_plan(plan(max_batch=4))


def test_bulk_rows_run_the_most_accurate_gear_in_throughput_batches() -> None:
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    rows = texts(300)
    with Engine(two_gear_plan(), models, bulk_batch_size=64) as engine:
        online = [engine.submit(f"online {i}") for i in range(20)]
        outcomes = [f.result(timeout=10) for f in engine.submit_many(rows, bulk=True)]
        assert all(f.result(timeout=10).status == "ok" for f in online)
        assert engine.gear_switches == []  # bulk rows are not metered
        assert engine.in_flight == 0
    for text, o in zip(rows, outcomes, strict=True):  # range 0's cascade: a -> b
        assert o.status == "ok" and o.gear is None
        assert (o.value, o.stage) == expected(models, text)
    bulk_calls = [n for n, _ in models["a"].calls if n > 1]
    assert max(bulk_calls) == 64 and sum(n == 64 for n in bulk_calls) >= 4


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_ten_times_overload_stays_up_bounded_and_answers_everything() -> None:
    # capacity: a takes 10 ms per batch of <= 4 rows -> ~400 rows/s; send ~4,000 rows/s
    models = {"a": SlowModel("a", 0.01), "b": FakeModel("b")}
    with Engine(plan(max_batch=4), models, max_in_flight=200) as engine:
        send(engine, 200, 0.2)  # warm up
        before = _rss_mb()
        peak = 0
        futures = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0:
            futures += [engine.submit(f"flood {len(futures) + i}") for i in range(40)]
            peak = max(peak, engine.in_flight)
            time.sleep(0.01)
        outcomes = [f.result(timeout=60) for f in futures]
        grown = _rss_mb() - before
        assert engine.submit("after the flood").result(timeout=5).status == "ok"
    statuses = {o.status for o in outcomes}
    assert statuses <= {"ok", "rejected"}, statuses
    assert len(futures) > 5000 and peak <= 200
    ok = sum(o.status == "ok" for o in outcomes)
    assert 0 < ok < len(futures) / 3  # served what it could, rejected the rest explicitly
    assert grown < 100, f"RSS grew {grown:.0f} MB"


def test_process_workers_report_memory_and_respect_a_budget() -> None:
    import functools

    import fakes

    sources = {"a": functools.partial(fakes.FakeModel, "a"),
               "b": functools.partial(fakes.FakeModel, "b")}
    with Engine(plan(), sources, memory_budget_bytes=8 * 2**30) as engine:
        rss = engine.load_report.rss_bytes
        assert set(rss) == {"cpu0", "cpu1"} and all(b > 1_000_000 for b in rss.values())
        assert engine.submit("fits").result(timeout=10).status == "ok"
    # each worker also holds the other's model, as a standby (ken/engine/standby.py)
    tight = Engine(plan(), sources, memory_budget_bytes=1_000_000)
    with pytest.raises(EngineError,
                       match="cpu0 holds .* MB with a, b, over the memory budget of 1 MB per "
                             r"device.*\(the standby copies a@cpu1, b@cpu0 count too: "
                             r"Engine\(standby=False\)"):
        tight.start()
    assert all(p is None for p in tight.pids().values()) or tight.pids() == {}
    alone = Engine(plan(), sources, memory_budget_bytes=1_000_000, standby=False)
    with pytest.raises(EngineError, match="cpu0 holds .* MB with a, over the memory budget of "
                                          r"1 MB per device; .*plan with less$"):
        alone.start()


def test_a_worker_that_cannot_restart_ends_its_requests_in_error(tmp_path) -> None:  # noqa: ANN001
    import functools
    import os
    import signal

    import fakes

    sources = {"a": functools.partial(fakes.load_once, "a", str(tmp_path / "flag"), 0.5),
               "b": functools.partial(fakes.FakeModel, "b")}
    # a, loadable once, on its one worker (a standby copy would be a second load)
    with Engine(plan(max_batch=4), sources, max_retries=1, standby=False) as engine:
        futures = [engine.submit(t) for t in texts(6)]
        time.sleep(0.25)
        os.kill(engine.pids()["cpu0"], signal.SIGKILL)
        outcomes = [f.result(timeout=60) for f in futures]
        assert engine.in_flight == 0
    assert {o.status for o in outcomes} == {"error"}
    assert all("restarting it failed" in o.error or "weights gone" in o.error
               for o in outcomes)
