"""A pipeline served on the online engine by a joint allocation, re-solved online (issue 37,
item 2: ``ken.engine.allocated``). Stand-in models in thread workers: no weights."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
from fakes import FakeModel

from ken.engine.allocated import AllocatedPipeline
from ken.errors import EngineError
from ken.models.model import WARM_UP_TEXT, Prediction
from ken.optimizer.allocation import AllocationProblem, Variant, allocate
from ken.optimizer.reallocation import Resolving, Solver

DETECT = (Variant("small", 0.6, {1: 400.0, 8: 2000.0}), Variant("large", 0.8, {1: 100.0, 8: 300.0}))
READ = (Variant("r-small", 0.65, {1: 400.0, 8: 2000.0}),
        Variant("r-large", 0.7, {1: 100.0, 8: 300.0}))
DEVICES = ("cpu0", "cpu1")
#: class 0 passes both operators, class 1 only the reader
ROUTES = ((0, 1), (1,))


def problem_for(demand: float) -> AllocationProblem:
    accuracy = {(0, (a.name, b.name)): a.accuracy * b.accuracy for a in DETECT for b in READ}
    accuracy.update({(1, (b.name,)): b.accuracy for b in READ})
    return AllocationProblem(("detect", "read"), (DETECT, READ), ROUTES, (0.6, 0.4), accuracy,
                             demand, len(DEVICES), 1.0)


def label(name: str, row: str) -> str:
    model = FakeModel(name)
    return model.spec.labels[int(model.probabilities(row).argmax())]


class Gated(FakeModel):
    """A stand-in whose calls wait for ``gate`` (the warm-up excepted)."""

    def __init__(self, name: str, gate: threading.Event) -> None:
        super().__init__(name)
        self.gate = gate

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        if WARM_UP_TEXT not in texts:
            assert self.gate.wait(timeout=60)
        return super().predict(texts, batch_size)


def models(gate: threading.Event | None = None) -> dict:
    out: dict = {v.name: FakeModel(v.name) for v in DETECT + READ}
    if gate is not None:
        out["large"] = Gated("large", gate)
    return out


def wait_until(condition, timeout_s: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the pipeline never got there"
        time.sleep(0.01)


def test_every_request_follows_a_hosted_path_and_gets_one_outcome() -> None:
    rows = [f"row {i}" for i in range(60)]
    with AllocatedPipeline(Solver(problem_for), 40.0, DEVICES, models(),
                           workers="thread") as pipe:
        hosts = dict(pipe.allocation.hosts)
        futures = [pipe.submit(r, route_class=i % 2) for i, r in enumerate(rows)]
        outcomes = [f.result(timeout=20) for f in futures]
        plans = {op: [r.devices for r in p.placement]
                 for op, p in pipe._placed.items()}
    # 40 req/s fits the most accurate variants: one worker each (Loki's step 1)
    assert hosts == dict(allocate(problem_for(40.0)).hosts)
    assert {(k, n, w) for (k, n), (w, _) in hosts.items()} == {(0, "large", 1),
                                                               (1, "r-large", 1)}
    assert plans["detect:large"] != plans["read:r-large"]  # each on its own worker
    assert [o.status for o in outcomes] == ["ok"] * 60
    for i, (row, o) in enumerate(zip(rows, outcomes, strict=True)):
        want = ("large", "r-large") if i % 2 == 0 else ("r-large",)
        assert o.variants == want and o.route_class == i % 2 and not o.moved
        assert list(o.values) == [label(v, row) for v in want]
        assert o.latency_s >= 0


def test_a_demand_beyond_the_workers_turns_part_of_a_class_away_with_the_reason() -> None:
    solver = Solver(problem_for)
    problem, allocation = solver(3_000.0)
    assert allocation.served < 1  # the two workers carry only part of it
    with AllocatedPipeline(solver, 3_000.0, DEVICES, models(), workers="thread") as pipe:
        outcomes = [pipe.submit(f"row {i}", route_class=0).result(timeout=20)
                    for i in range(200)]
        turned_away = pipe.turned_away
    statuses = {o.status for o in outcomes}
    assert statuses == {"ok", "rejected"}
    rejected = [o for o in outcomes if o.status == "rejected"]
    assert turned_away == len(rejected)
    assert all("turned away" in o.error and "detect -> read" in o.error for o in rejected)
    assert all(o.variants == () and o.values == () for o in rejected)


def test_the_controller_moves_to_the_allocation_of_the_measured_demand_and_moves_requests_inside(
        ) -> None:
    """A burst far above the planned 40 req/s: at the period's end the controller solves for
    the measured rate and swaps in cheaper variants; a request held at its first hop during
    the change takes its second hop on the new allocation's path (moved); nothing is lost."""
    gate = threading.Event()
    control = Resolving(every_s=0.3, alpha=1.0, step=0.0, headroom=0.0)
    with AllocatedPipeline(Solver(problem_for), 40.0, DEVICES, models(gate), workers="thread",
                           control=control) as pipe:
        first = dict(pipe.allocation.hosts)
        held = pipe.submit("held at its first hop", route_class=0)
        burst = [pipe.submit(f"row {i}", route_class=i % 2) for i in range(120)]
        wait_until(lambda: len(pipe.changes) >= 2)  # the first period's end re-solved
        second = dict(pipe.allocation.hosts)
        change = pipe.changes[1]
        after = [pipe.submit(f"after {i}", route_class=0) for i in range(20)]
        gate.set()
        outcome = held.result(timeout=20)
        rest = [f.result(timeout=20) for f in burst + after]
        moved = pipe.moved
    assert {n for _, n in first} == {"large", "r-large"}
    # alpha 1: the rate measured (arrivals over the seconds since the period began)
    assert change.demand_qps == pytest.approx(121 / 0.3, rel=0.05)
    again = allocate(problem_for(change.demand_qps))
    assert second == dict(again.hosts) != first
    assert again.served == pytest.approx(1.0)  # every class carried (a float: 1 + 1e-14)
    assert change.swapped and all(op.split(":")[1] in {n for _, n in second}
                                  for op in change.swapped)
    assert outcome.status == "ok" and outcome.moved
    hosted_reader = next(n for (k, n) in second if k == 1)
    assert outcome.variants == ("large", hosted_reader) != ("large", "r-large")
    assert [o.status for o in rest] == ["ok"] * len(rest) and moved >= 1
    hosted = {n for _, n in second}
    assert all(set(o.variants) <= hosted for o in rest[-20:])  # routed by the new one


def test_bad_requests_and_a_stopped_pipeline_are_errors() -> None:
    pipe = AllocatedPipeline(Solver(problem_for), 40.0, DEVICES, models(), workers="thread")
    with pytest.raises(EngineError, match="not serving"):
        pipe.submit("too early")
    pipe.start()
    with pytest.raises(EngineError, match="route class 2 is not one of the pipeline's 2"):
        pipe.submit("row", route_class=2)
    assert pipe.submit("row").result(timeout=20).status == "ok"
    assert pipe.shutdown() == 0
    with pytest.raises(EngineError, match="not serving"):
        pipe.submit("too late")
    with pytest.raises(EngineError, match="has 2 workers; 1 devices given"):
        AllocatedPipeline(Solver(problem_for), 40.0, ("cpu0",), models(), workers="thread")
    with pytest.raises(EngineError, match="no model given for the variants"):
        AllocatedPipeline(Solver(problem_for), 40.0, DEVICES, {"small": FakeModel("small")},
                          workers="thread")


def test_a_variant_plan_carries_the_runtimes_its_throughput_gives() -> None:
    v = Variant("v", 0.5, {1: 10.0, 4: 20.0})
    assert v.runtimes_s(6) == pytest.approx((0.1, 0.1 + 0.1 / 3, 0.1 + 0.2 / 3, 0.2, 0.25, 0.3))


def test_hops_carry_the_deadline_so_a_dropping_engine_drops_a_late_request_with_its_reason(
        ) -> None:
    with AllocatedPipeline(Solver(problem_for), 40.0, DEVICES, models(), workers="thread",
                           dropping="reactive") as pipe:
        now = pipe.engine.clock.now()
        late = pipe.submit("too late already", route_class=0, deadline_s=now - 1.0)
        fine = pipe.submit("in time", route_class=0, deadline_s=now + 30.0)
        late, fine = late.result(timeout=20), fine.result(timeout=20)
        metrics = pipe.engine.deadline_metrics()
    assert late.status == "dropped" and late.error and late.variants == ("large",)
    assert fine.status == "ok" and len(fine.values) == 2
    assert metrics.requests == 2 and metrics.dropped == 1  # one job per pipeline request


def test_a_backlog_read_inside_the_period_re_solves_before_the_period_ends() -> None:
    """A closed loop with 10-s periods read every 0.25 s: 100 requests held inside the
    pipeline are a backlog worth 100 req/s over the 1-s drain, far above the planned 40, so
    the allocation is re-solved within a second, not at the period's end."""
    from ken.optimizer.reallocation import URGENT_RISE, ClosedLoop

    gate = threading.Event()
    control = ClosedLoop(Resolving(every_s=10.0, step=0.0, headroom=0.1), drain_s=1.0,
                         checks=40)
    with AllocatedPipeline(Solver(problem_for), 40.0, DEVICES, models(gate), workers="thread",
                           control=control) as pipe:
        started = pipe.engine.clock.now()
        held = [pipe.submit(f"row {i}", route_class=0) for i in range(100)]
        wait_until(lambda: len(pipe.changes) >= 2, timeout_s=8.0)
        change = pipe.changes[1]
        gate.set()
        outcomes = [f.result(timeout=20) for f in held]
    assert change.time_s - started < 5.0  # well inside the first 10-s period
    assert change.demand_qps >= 40.0 * 1.1 * (1 + URGENT_RISE)
    assert [o.status for o in outcomes] == ["ok"] * 100


def test_a_failing_hop_input_ends_its_request_in_error_and_the_pipeline_goes_on() -> None:
    def hop_input(operator: str, previous: object, row: object) -> object:
        if row == "bad":
            raise ValueError("no input for the reader")
        return f"{row} ({previous})"

    with AllocatedPipeline(Solver(problem_for), 40.0, DEVICES, models(), workers="thread",
                           hop_input=hop_input) as pipe:
        bad = pipe.submit("bad", route_class=0)
        assert not bad.cancel()  # a pipeline request ends with its outcome, never cancelled
        bad = bad.result(timeout=20)
        good = pipe.submit("good", route_class=0).result(timeout=20)
    assert bad.status == "error" and "ValueError: no input for the reader" in bad.error
    assert bad.variants == ("large", "r-large") and len(bad.values) == 1
    assert good.status == "ok"
    assert good.values == (label("large", "good"),
                           label("r-large", f"good ({label('large', 'good')})"))
