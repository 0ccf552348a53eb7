"""Deadlines through a pipeline on the online engine (issue 37, item 1): two served operators
(``a`` then ``b``) as the stages of one ``PipelineDropper`` on the engine's wall clock; a dropped
request gets exactly one outcome with its reason, nothing is dropped on idle stages when the
deadline can be made, and without a dropping policy nothing changes."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
from fakes import FakeModel, SlowModel

from ken.engine.serving import Engine, EngineError
from ken.engine.supervision import BatchDeadline
from ken.models.cascade import Cascade
from ken.models.model import Prediction
from ken.policy.plan import GearPlan, RangeSchedule, Replica

PROFILE_S = 0.05  # profiled seconds of a batch of one, each stage
NO_DEADLINE = BatchDeadline(floor_s=60.0)  # a blocked test batch is not a hung worker


def stage(op: str, model: str, device: str, max_batch: int = 4,
          profile_s: float = PROFILE_S) -> GearPlan:
    return GearPlan(op, (0.0, 1e6), (Cascade((model,)),), (Replica(model, (device,)),),
                    (RangeSchedule(0, (1.0,), (1,)),), (max_batch,), max_wait_s=0.005,
                    batch_runtime_s=((tuple(profile_s * (1 + 0.2 * b)
                                            for b in range(max_batch))),))


PLANS = (stage("a", "ma", "cpu0"), stage("b", "mb", "cpu1"))


class BlockingModel(FakeModel):
    """Holds any batch with the text ``block`` until ``release`` is set (``started`` says it
    is running)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.started = threading.Event()
        self.release = threading.Event()

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        if "block" in texts:
            self.started.set()
            assert self.release.wait(30)
        return super().predict(texts, batch_size)


def wait_past(engine: Engine, t: float) -> None:
    """Until the engine's clock is past ``t`` (the deadline passing is the event)."""
    tick = threading.Event()
    while engine.clock.now() <= t:
        tick.wait(0.01)


def test_a_request_that_cannot_make_it_is_dropped_at_once_with_its_reason() -> None:
    models = {"ma": FakeModel("ma"), "mb": FakeModel("mb")}
    with Engine(PLANS, models, dropping="proactive", deadline=NO_DEADLINE) as engine:
        # predicted on idle stages: one batch of one at a, then at b (2 x PROFILE_S)
        future = engine.submit("too tight", "a", deadline_s=engine.clock.now() + PROFILE_S,
                               route=("b",))
        out = future.result(timeout=10)
        assert engine.in_flight == 0
        metrics = engine.deadline_metrics()
    assert out.status == "dropped" and out.value is None
    assert out.error is not None and out.error.startswith("at a: predicted finish")
    assert "too tight" not in models["ma"].rows_seen  # no model time spent on it
    assert (metrics.requests, metrics.dropped, metrics.on_time) == (1, 1, 0)
    assert dict(metrics.drops_by_stage) == {"a": 1, "b": 0}


@pytest.mark.parametrize("policy", ["reactive", "proactive"])
def test_a_queued_request_past_its_deadline_is_dropped_when_its_stage_forms_a_batch(
        policy: str) -> None:
    mb = BlockingModel("mb")
    models = {"ma": FakeModel("ma"), "mb": mb}
    with Engine(PLANS, models, dropping=policy, deadline=NO_DEADLINE) as engine:
        blocker = engine.submit("block", "b")  # no deadline: never dropped
        assert mb.started.wait(10)
        deadline = engine.clock.now() + 10 * PROFILE_S
        hop_a = engine.submit("late row", "a", deadline_s=deadline, route=("b",), job="q1")
        assert hop_a.result(timeout=10).status == "ok"
        hop_b = engine.submit("late row", "b", deadline_s=deadline, job="q1")
        wait_past(engine, deadline)  # it waits behind the blocked batch
        assert not hop_b.done()
        mb.release.set()
        out = hop_b.result(timeout=10)
        assert blocker.result(timeout=10).status == "ok"
        assert engine.in_flight == 0
        metrics = engine.deadline_metrics()
    assert out.status == "dropped"
    assert out.error is not None and out.error.startswith(
        "late at b" if policy == "reactive" else "at b: predicted finish")
    assert "late row" in models["ma"].rows_seen and "late row" not in mb.rows_seen
    # one job (both hops), dropped at b: its model time at a was wasted
    assert (metrics.requests, metrics.dropped, metrics.on_time) == (1, 1, 0)
    assert metrics.wasted_device_s == metrics.device_s > 0


@pytest.mark.parametrize("policy", ["none", "reactive", "proactive"])
def test_requests_that_can_make_their_deadline_on_idle_stages_are_never_dropped(
        policy: str) -> None:
    models = {"ma": FakeModel("ma"), "mb": FakeModel("mb")}
    with Engine(PLANS, models, dropping=policy, deadline=NO_DEADLINE) as engine:
        for i in range(20):  # one at a time: the stages are idle when each arrives
            deadline = engine.clock.now() + 6 * PROFILE_S  # predicted: 2 x PROFILE_S
            a = engine.submit(f"q{i}", "a", deadline_s=deadline, route=("b",), job=i)
            assert a.result(timeout=10).status == "ok"
            b = engine.submit(f"q{i}", "b", deadline_s=deadline, job=i)
            assert b.result(timeout=10).status == "ok"
        metrics = engine.deadline_metrics()
    assert (metrics.requests, metrics.dropped) == (20, 0)
    assert metrics.on_time + metrics.late == 20 and metrics.device_s > 0


@pytest.mark.parametrize("policy", ["proactive", "proactive-profiled"])
def test_a_stage_slower_than_its_profile_drops_what_it_would_answer_late(policy: str) -> None:
    """A model profiled at 5 ms a call that takes 200 ms: after a few calls the forecast
    reads the measured speed, so a request with 100 ms to go is dropped at once instead of
    answered late; on the profiles alone it is run, and late. After a swap to a plan whose
    profile is right (200 ms) the forecast reads that profile, not the old one nor the speed
    measured against it: 100 ms to go is dropped, 1 s served on time (a speed not forgotten
    would predict 8 s)."""
    fast, slow = 0.005, 0.2
    plan = stage("a", "ma", "cpu0", profile_s=fast)
    with Engine(plan, {"ma": SlowModel("ma", slow)}, dropping=policy,
                deadline=NO_DEADLINE) as engine:
        for i in range(3):  # no deadline: measured, never dropped
            assert engine.submit(f"warm {i}", "a").result(timeout=10).status == "ok"
        out = engine.submit("tight", "a", deadline_s=engine.clock.now() + 0.1).result(
            timeout=10)
        if policy == "proactive":
            assert out.status == "dropped" and out.error.startswith("at a: predicted finish")
        else:
            assert out.status == "ok"
        engine.swap_plan(stage("a", "ma", "cpu0", profile_s=slow))
        # the new plan's profile, and no speed measured against the old one
        out = engine.submit("tight again", "a", deadline_s=engine.clock.now() + 0.1).result(
            timeout=10)
        assert out.status == "dropped"
        out = engine.submit("roomy", "a", deadline_s=engine.clock.now() + 1.0).result(
            timeout=10)
        assert out.status == "ok"
        metrics = engine.deadline_metrics()
    assert metrics.late == (0 if policy == "proactive" else 1)
    assert metrics.dropped == (2 if policy == "proactive" else 1)


class RaisesOn(FakeModel):
    """A model whose calls raise when a row is ``bad``."""

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        if "bad" in texts:
            raise ValueError("bad row")
        return super().predict(texts, batch_size)


def test_only_batches_that_ran_once_and_answered_tell_the_forecast_its_speed() -> None:
    """A batch that failed (run again in place, then ended in error) says nothing of how fast
    the model runs; nor does a batch of a plan swapped out that finishes after the swap (it is
    read against the new plan's replicas). Neither moves the measured speed."""
    ma = BlockingModel("ma")
    models = {"ma": ma, "mb": RaisesOn("mb")}
    with Engine(PLANS, models, dropping="proactive", deadline=NO_DEADLINE) as engine:
        assert engine.deadlines is not None
        forecast = engine.deadlines.dropper.forecast
        out = engine.submit("bad", "b").result(timeout=10)
        assert out.status == "error" and "bad row" in (out.error or "")
        assert forecast.speed(1) == 1.0  # nothing measured
        assert engine.submit("good", "b").result(timeout=10).status == "ok"
        assert len(forecast._speed[1]) == 1
        blocked = engine.submit("block", "a")
        assert ma.started.wait(10)
        # the new plan's profile is 200x the old: the old batch read against it would give
        # a speed near 0
        engine.swap_plan(stage("a", "ma", "cpu0", profile_s=200 * PROFILE_S))
        ma.release.set()
        assert blocked.result(timeout=10).status == "ok"
        assert forecast.speed(0) == 1.0 and len(forecast._speed[0]) == 0
        with pytest.raises(EngineError, match="profiled batch runtimes"):
            engine.swap_plan(GearPlan("a", (0.0, 1e6), (Cascade(("ma",)),),
                                      (Replica("ma", ("cpu0",)),),
                                      (RangeSchedule(0, (1.0,), (1,)),), (4,)))


def test_without_a_dropping_policy_outcomes_are_unchanged() -> None:
    rows = [f"row {i}" for i in range(30)]

    def serve(**kwargs: object) -> list[tuple]:
        models = {"ma": FakeModel("ma"), "mb": FakeModel("mb")}
        with Engine(PLANS, models, deadline=NO_DEADLINE, **kwargs) as engine:  # type: ignore[arg-type]
            past = engine.clock.now() - 1.0  # a deadline already missed: ignored
            futures = [engine.submit(t, "a", deadline_s=past) if "dropping" not in kwargs
                       else engine.submit(t, "a") for t in rows]
            return [(o.status, o.value, o.stage, o.certainty)
                    for o in (f.result(timeout=10) for f in futures)]

    plain = serve()
    assert all(s == "ok" for s, *_ in plain)
    assert serve(dropping="none") == plain
    with pytest.raises(EngineError, match="without a dropping policy"):
        Engine(PLANS, {"ma": FakeModel("ma"), "mb": FakeModel("mb")}).deadline_metrics()


def test_routes_and_plans_are_checked() -> None:
    models = {"ma": FakeModel("ma"), "mb": FakeModel("mb")}
    with Engine(PLANS, models, dropping="proactive", deadline=NO_DEADLINE) as engine:
        with pytest.raises(EngineError, match="does not serve"):
            engine.submit("x", "a", deadline_s=1e9, route=("c",))
        with pytest.raises(EngineError, match="each operator once"):
            engine.submit("x", "a", deadline_s=1e9, route=("b", "a"))
    unprofiled = GearPlan("a", (0.0, 1e6), (Cascade(("ma",)),), (Replica("ma", ("cpu0",)),),
                          (RangeSchedule(0, (1.0,), (1,)),), (4,))
    with pytest.raises(EngineError, match="profiled batch runtimes"):
        Engine(unprofiled, models, dropping="proactive")


def test_a_job_whose_next_hop_is_turned_away_ends_unanswered() -> None:
    mb = BlockingModel("mb")
    models = {"ma": FakeModel("ma"), "mb": mb}
    with Engine(PLANS, models, dropping="proactive", deadline=NO_DEADLINE,
                max_in_flight=1) as engine:
        deadline = engine.clock.now() + 100.0
        hop_a = engine.submit("row", "a", deadline_s=deadline, route=("b",), job="q")
        assert hop_a.result(timeout=10).status == "ok"
        blocker = engine.submit("block", "b")
        assert mb.started.wait(10)
        hop_b = engine.submit("row", "b", deadline_s=deadline, job="q").result(timeout=10)
        mb.release.set()
        assert blocker.result(timeout=10).status == "ok"
        metrics = engine.deadline_metrics()
    assert hop_b.status == "rejected"
    assert (metrics.requests, metrics.on_time, metrics.late, metrics.dropped) == (1, 0, 1, 0)
    assert metrics.wasted_device_s == metrics.device_s > 0


def test_session_serve_passes_the_dropping_policy() -> None:
    import ken
    from ken.errors import KenError

    with ken.connect(builtins=False) as s:
        s.register("mood", Cascade(("ma",)), models={"ma": FakeModel("ma")})
        s.use_plan(stage("mood", "ma", "cpu0"))
        with pytest.raises(KenError, match="dropping must be"):
            s.serve(workers="thread", dropping="sometimes")
        s.serve(workers="thread", dropping="proactive")
        engine = s.engines["mood"]
        out = engine.submit("x", deadline_s=engine.clock.now()).result(timeout=10)
        assert out.status == "dropped" and out.error.startswith("at mood")
        assert s.sql("SELECT mood('fine')").fetchall()[0][0] in ("negative", "neutral",
                                                                 "positive")
