"""Deadlines through a pipeline (issue 37 item 1): ``ken.policy.dropping`` and the simulator's
use of it (``simulate_many(deadline_s=..., dropping=...)``, ``evaluate_pipeline``)."""

from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ken.errors import PolicyError, SimulationError
from ken.models.cascade import Cascade
from ken.optimizer.perf import Catalog, ModelPerf
from ken.optimizer.query import PipelineSample, evaluate_pipeline
from ken.optimizer.simulator import simulate_many
from ken.optimizer.workload import Trace, gamma_trace, poisson_trace
from ken.policy.dropping import (
    AdaptivePriority,
    DropPolicy,
    PipelineDropper,
    StageProfile,
    priority_order,
    should_drop,
    stage_profile,
)
from ken.policy.plan import GearPlan, RangeSchedule, Replica
from ken.policy.scheduling import Dispatcher, VirtualClock


def catalog(runtimes: dict[str, tuple[float, ...]], sizes: tuple[int, ...] = (1, 8, 32),
            rows: int = 30, seed: int = 7) -> Catalog:
    rng = np.random.default_rng(seed)
    perf, quality, scores = {}, {}, {}
    for k, (m, r) in enumerate(sorted(runtimes.items())):
        perf[m] = ModelPerf(m, sizes, (r,), (100,), (1,))
        scores[m] = rng.dirichlet(np.full(3, 0.6), size=rows)
        quality[m] = (rng.random(rows) < 0.6 + 0.15 * k).astype(np.float64)
    return Catalog(perf, quality, scores, "synthetic")


CAT = catalog({"a": (0.002, 0.006, 0.016), "b": (0.005, 0.02, 0.06),
               "c": (0.01, 0.05, 0.15)})


def plan(name: str, models: tuple[str, ...], device: str, thresholds: tuple[float, ...] = (),
         max_batch: int = 8, min_queue: int = 2, max_wait_s: float = 0.01) -> GearPlan:
    reps = tuple(Replica(m, (device,)) for m in models)
    n = len(reps)
    return GearPlan(name, (0.0, 1e6), (Cascade(models, thresholds),), reps,
                    (RangeSchedule(0, (1.0,) * n, (min_queue,) * n),), (max_batch,) * n,
                    max_wait_s=max_wait_s)


def three_stage() -> tuple[list[GearPlan], list[tuple[int, ...]], Trace, np.ndarray]:
    """Three operators (one with an escalating cascade, two sharing a device), per-request
    routes, a bursty trace."""
    plans = [plan("s0", ("a", "b"), "d0", (0.6,)), plan("s1", ("b",), "d1"),
             plan("s2", ("c",), "d0", max_batch=4)]
    routes = [(0, 1, 2), (0, 2), (1,), (0, 1)]
    trace = gamma_trace(150.0, 4.0, 2.0, seed=3)
    rows = np.random.default_rng(1).integers(0, 4, len(trace))
    return plans, routes, trace, rows


# -- no deadline: the simulation is what it was ------------------------------------------------

#: digest of this run's completion, resolution times, qualities and stages, computed with the
#: simulator of commit 892ca59 (before deadlines existed)
BEFORE_DEADLINES = "76052f81ffc8d671"


def _digest(res) -> str:  # noqa: ANN001
    h = hashlib.sha256()
    for a in (res.completion_s, res.resolved_s, res.quality, res.stage):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def test_no_deadline_run_is_identical_to_before() -> None:
    plans, routes, trace, rows = three_stage()
    res = simulate_many(plans, [CAT] * 3, trace, seed=5, routes=routes, rows=rows)
    assert len(trace) == 590 and res.batches == 550
    assert _digest(res) == BEFORE_DEADLINES
    assert res.deadline_s is None and res.drops == ()
    with pytest.raises(SimulationError, match="no deadlines"):
        res.deadline_metrics()
    # deadlines with the policy that never drops do not change the schedule either
    kept = simulate_many(plans, [CAT] * 3, trace, seed=5, routes=routes, rows=rows,
                         deadline_s=0.05, dropping=DropPolicy.named("none"))
    assert _digest(kept) == BEFORE_DEADLINES and kept.drops == ()


# -- every request resolved exactly once, drops with their reason -------------------------------


@pytest.mark.parametrize("name", ["reactive", "proactive"])
def test_a_dropped_request_gets_exactly_one_outcome_with_its_reason(name: str) -> None:
    plans, routes, trace, rows = three_stage()
    res = simulate_many(plans, [CAT] * 3, trace, seed=5, routes=routes, rows=rows,
                        deadline_s=0.03, dropping=DropPolicy.named(name))
    drops = {d.request_id: d for d in res.drops}
    assert len(drops) == len(res.drops) > 0  # overloaded: something is dropped, once each
    for i, q in enumerate(rows):
        route = routes[q]
        d = drops.get(i)
        answered = not math.isnan(res.completion_s[i])
        assert answered != (d is not None)  # exactly one outcome: an answer or a drop
        if d is None:
            assert np.all(np.isfinite(res.resolved_s[list(route), i]))
            continue
        assert d.stage in route and d.stage_name == plans[d.stage].operator
        assert d.deadline_s == pytest.approx(trace.arrival_s[i] + 0.03)
        assert d.stage_name in d.reason
        if name == "reactive":
            assert d.at_s > d.deadline_s and "late" in d.reason
        else:
            assert d.predicted_finish_s > d.deadline_s and "predicted finish" in d.reason
        at = route.index(d.stage)  # resolved by the operators before, by none from there on
        assert np.all(np.isfinite(res.resolved_s[list(route[:at]), i]))
        assert np.all(np.isnan(res.resolved_s[list(route[at:]), i]))
    m = res.deadline_metrics()
    assert m.on_time + m.dropped + m.late == m.requests == len(trace)
    # every batch's device time is charged to its rows: the per-request shares add up
    assert m.device_s == pytest.approx(sum(b for _, b in res.device_busy_s))
    assert 0 <= m.wasted_device_s <= m.device_s
    assert sum(n for _, n in m.drops_by_stage) == m.dropped


def test_dropper_refuses_a_second_drop_and_bad_policies() -> None:
    dropper = PipelineDropper(DropPolicy("reactive"), [StageProfile("s", (0.01,))])
    dropper.register(0, 1.0, (0,))
    assert dropper.enter(0, 0, 0.5) is None
    assert dropper.enter(0, 0, 1.5) is not None
    with pytest.raises(PolicyError, match="already dropped"):
        dropper.enter(0, 0, 2.0)
    with pytest.raises(PolicyError):
        DropPolicy("sometimes")  # type: ignore[arg-type]
    with pytest.raises(PolicyError):
        DropPolicy.named("eager")
    with pytest.raises(SimulationError, match="needs deadlines"):
        simulate_many([plan("s", ("a",), "d")], [CAT], poisson_trace(10, 1),
                      dropping=DropPolicy.named("proactive"))


# -- idle stages never drop a request that can make it ------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0.001, 0.05), min_size=1, max_size=3),
       st.integers(1, 3), st.floats(1.0 + 1e-9, 3.0), st.integers(2, 6))
def test_idle_stages_never_drop_a_request_that_can_make_it(
        runtimes: list[float], route_len: int, slack: float, n: int) -> None:
    k = len(runtimes)
    cat = catalog({f"m{j}": (t,) for j, t in enumerate(runtimes)}, sizes=(1,))
    plans = [plan(f"s{j}", (f"m{j}",), f"d{j}", max_batch=1, min_queue=1) for j in range(k)]
    route = tuple(range(min(route_len, k)))
    idle = math.fsum(runtimes[j] for j in route)  # alone on idle stages: its exact latency
    policy = DropPolicy.named("proactive", window_s=0.5)
    gap = 1.0 + idle  # each request finds every stage idle and the windows empty
    trace = Trace(np.arange(n) * gap)
    res = simulate_many(plans, [cat] * k, trace, routes=[route], rows=[0] * n,
                        deadline_s=idle * slack, dropping=policy)
    assert res.drops == ()
    assert np.allclose(res.latency_s, idle)
    assert res.deadline_metrics().on_time == n
    # one that cannot make it even alone is dropped at once, at its first stage
    short = simulate_many(plans, [cat] * k, trace, routes=[route], rows=[0] * n,
                          deadline_s=idle * 0.99, dropping=policy)
    assert len(short.drops) == n and all(d.stage == route[0] for d in short.drops)
    assert short.deadline_metrics().wasted_device_s == 0.0


# -- proactive against none and the best schedule, by brute force -------------------------------


def _on_time(order: tuple[int, ...], s1: float, s2: float, deadline: list[float]) -> int:
    """Requests served in ``order`` through two stages of one row at a time (all arrive at
    0): how many finish by their deadline."""
    f1 = f2 = 0.0
    ok = 0
    for i in order:
        f1 += s1
        f2 = max(f1, f2) + s2
        ok += f2 <= deadline[i] + 1e-12
    return ok


def test_proactive_goodput_is_never_below_none_on_a_brute_forced_case() -> None:
    # two stages of 10 ms a row, four requests at t=0 with deadlines 25, 20, 45, 30 ms.
    # No dropping serves them in arrival order: r0 at 20 ms (on time), r1 at 30 (late),
    # r2 at 40 (on time), r3 at 50 (late): 2. The best schedule drops one of r0/r1: 3.
    # Proactive serves r0 (alone in the queue at t=0), drops r1 at 10 ms (predicted 30 > 20),
    # takes r3 before r2 (least budget first): r3 at 30, r2 at 40, both on time: 3.
    deadline = [0.025, 0.02, 0.045, 0.03]
    cat = catalog({"a": (0.01,), "b": (0.01,)}, sizes=(1,))
    plans = [plan("s0", ("a",), "d0", max_batch=1, min_queue=1),
             plan("s1", ("b",), "d1", max_batch=1, min_queue=1)]
    trace = Trace(np.zeros(4))
    best = max(_on_time(order, 0.01, 0.01, deadline)
               for r in range(5) for subset in itertools.combinations(range(4), r)
               for order in itertools.permutations(subset))
    fifo = _on_time((0, 1, 2, 3), 0.01, 0.01, deadline)
    assert (fifo, best) == (2, 3)
    got = {}
    for name in ("none", "reactive", "proactive"):
        res = simulate_many(plans, [cat] * 2, trace, deadline_s=np.array(deadline),
                            dropping=DropPolicy.named(name))
        got[name] = res.deadline_metrics().on_time
    assert got["none"] == fifo
    assert got["none"] <= got["proactive"] <= best
    assert got["proactive"] == 3 and got["reactive"] == 2


# -- the adaptive priority ----------------------------------------------------------------------


def test_priority_order_by_hand() -> None:
    budgets = [0.3, 0.1, 0.2, 0.1]
    assert priority_order(budgets, "fcfs") == [0, 1, 2, 3]
    assert priority_order(budgets, "lbf") == [1, 3, 2, 0]  # ties: arrival order
    assert priority_order(budgets, "hbf") == [0, 2, 1, 3]


def test_adaptive_priority_switches_with_a_delay() -> None:
    prio = AdaptivePriority()
    seen = [prio.update(rho, 0.1) for rho in (0.5, 1.05, 1.1, 1.05, 0.95, 0.9, 1.0)]
    # HBF only once rho >= 1.1, LBF again only once rho <= 0.9; unchanged in between
    assert seen == ["lbf", "lbf", "hbf", "hbf", "hbf", "lbf", "lbf"]
    assert prio.switches == 2
    wide = AdaptivePriority()
    assert wide.update(1.3, 0.5) == "lbf"  # a wide band (bursty load): no switch yet


def test_load_factor_moves_the_dropper_to_high_budget_first() -> None:
    stage = StageProfile("s", (0.01, 0.02), replicas=1)  # 100 rows/s
    dropper = PipelineDropper(DropPolicy("proactive", "adaptive", window_s=1.0,
                                         delta_min=0.1), [stage])
    for i in range(300):  # 300 rows/s for a second: rho = 3
        dropper.register(i, 100.0, (0,))
        dropper.enter(i, 0, i / 300)
    assert dropper.mode(0, 1.0) == "hbf"
    # a steady second at half the capacity: back to LBF
    for i in range(300, 350):
        dropper.register(i, 100.0, (0,))
        dropper.enter(i, 0, 2.0 + (i - 300) / 50)
    assert dropper.mode(0, 3.0) == "lbf"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.01, 0.2), min_size=1, max_size=6))
def test_least_budget_first_meets_every_deadline_when_some_order_does(
        deadlines: list[float]) -> None:
    """One stage, one row per batch of 10 ms, every request queued at 0: the order the
    dropper's LBF serves them (one ``select`` per batch) meets every deadline whenever some
    order does (brute force over the orders), as earliest-deadline-first must."""
    dt = 0.01
    dropper = PipelineDropper(DropPolicy("none", "lbf"), [StageProfile("s", (dt,))])
    for i, d in enumerate(deadlines):
        dropper.register(i, d, (0,))
    queue, now, order = list(range(len(deadlines))), 0.0, []
    while queue:
        kept, drops = dropper.select(0, queue, [0.0] * len(queue), now, 1)
        assert drops == [] and len(kept) == 1
        order.append(kept[0])
        queue.remove(kept[0])
        now += dt

    def all_met(o: list[int] | tuple[int, ...]) -> bool:
        return all((j + 1) * dt <= deadlines[i] + 1e-12 for j, i in enumerate(o))

    if any(all_met(p) for p in itertools.permutations(range(len(deadlines)))):
        assert all_met(order)
    assert should_drop("proactive", 1.0, 0.5, 0.6) and not should_drop("reactive", 1.0,
                                                                          0.5, 0.6)


# -- the forecast reads how fast batches ran ----------------------------------------------------


def _learned(policy: DropPolicy, seconds: float, batches: int = 16) -> PipelineDropper:
    """Two stages profiled at 10 ms and 20 ms a batch of one, whose last ``batches``
    batches of one row each took ``seconds`` (stage 0) and twice that (stage 1)."""
    dropper = PipelineDropper(policy, [StageProfile("a", (0.01, 0.015)),
                                       StageProfile("b", (0.02, 0.03))])
    gate_a, gate_b = dropper.gate(0), dropper.gate(1)
    for _ in range(batches):
        gate_a.ran(0, 1, seconds)
        gate_b.ran(0, 1, 2 * seconds)
    return dropper


@pytest.mark.parametrize(("seconds", "dropped"), [(0.03, True), (0.005, False)])
def test_the_forecast_scales_the_profiles_by_the_measured_speed(seconds: float,
                                                                dropped: bool) -> None:
    """Batches that ran 3x their profile (a machine busier than when it was profiled): a
    request that makes its deadline on the profiles (30 ms of 40) is dropped at once, as it
    needs 90 ms; batches that ran at half: one that misses on the profiles (30 ms of 20) is
    kept, as it needs 15 ms. The profiles alone (``proactive-profiled``) decide the other way
    round in both cases."""
    deadline = 0.04 if dropped else 0.02
    for name, expect in (("proactive", dropped), ("proactive-profiled", not dropped)):
        dropper = _learned(DropPolicy.named(name), seconds)
        dropper.register(0, deadline, (0, 1))
        drop = dropper.enter(0, 0, now=0.0)
        assert (drop is not None) == expect, name
        if drop is not None and name == "proactive":
            assert drop.predicted_finish_s == pytest.approx(seconds + 2 * seconds)
    speed = _learned(DropPolicy.named("proactive"), seconds).forecast
    assert speed.speed(0) == pytest.approx(seconds / 0.01)
    assert speed.speed(1) == pytest.approx(seconds / 0.01)


def test_the_measured_speed_is_the_median_of_the_last_batches_against_their_replica() -> None:
    """A stage of two replicas with different profiles: each batch is read against the
    replica that ran it and its size; one hung batch among many does not move the median;
    only the last ``runtime_batches`` count; a re-plan (``restage``) forgets them."""
    stage = StageProfile("s", (0.01, 0.02), replicas=1,
                         replica_runtime_s=((0.01, 0.02), (0.1, 0.2, 0.3)))
    dropper = PipelineDropper(DropPolicy("proactive", "adaptive", runtime_batches=4), [stage])
    f, gate = dropper.forecast, dropper.gate(0)
    assert f.speed(0) == 1.0  # nothing measured yet: the profile
    gate.ran(0, 2, 0.04)   # 2x its replica's 2-row profile
    gate.ran(1, 3, 0.6)    # 2x replica 1's 3-row profile
    gate.ran(1, 9, 60.0)   # a hung batch (more rows than profiled: the largest batch)
    assert f.speed(0) == pytest.approx(2.0)
    for _ in range(4):
        gate.ran(0, 1, 0.005)  # faster now: the last 4 batches only
    assert f.speed(0) == pytest.approx(0.5)
    assert f.exec_at(0, 2) == pytest.approx(0.01)
    gate.ran(5, 1, 0.02)  # a replica the profile does not know (an old plan's): read
    assert f.speed(0) == pytest.approx(0.5)  # against the stage's own profile: 2x
    f.restage(0, StageProfile("s", (0.04,)))
    assert f.speed(0) == 1.0 and f.exec_at(0, 1) == pytest.approx(0.04)
    with pytest.raises(PolicyError, match="runtime_batches"):
        DropPolicy("proactive", runtime_batches=-1)
    with pytest.raises(PolicyError, match="every replica"):
        StageProfile("s", (0.01,), replica_runtime_s=((0.01,), ()))


def test_the_forecast_reads_the_profile_of_the_gear_the_stage_serves_in() -> None:
    """A plan that serves a slow model below 10 requests/s and a fast one above (the QA
    stream's reading operators shift so): once the dispatcher switches gear, the forecast
    charges the fast model's profile and its capacity, not the first gear's."""
    plan = GearPlan("op", (0.0, 10.0, 1e6), (Cascade(("slow",)), Cascade(("fast",))),
                    (Replica("slow", ("d0",)), Replica("fast", ("d1",)), Replica("fast", ("d2",))),
                    (RangeSchedule(0, (1.0, 0.0, 0.0), (1, 1, 1)),
                     RangeSchedule(1, (0.0, 1.0, 1.0), (1, 1, 1))),
                    (2, 2, 2), rate_window_s=0.25)
    table = {0: (0.2, 0.3), 1: (0.02, 0.03), 2: (0.02, 0.03)}
    dropper = PipelineDropper(DropPolicy.named("proactive"),
                              [stage_profile(plan, table.__getitem__)])
    clock = VirtualClock()
    dispatcher = Dispatcher(plan, clock, gate=dropper.gate(0))
    profile = dropper.forecast.stages[0]
    assert profile.gear_replicas == ((0,), (1, 2))
    assert profile.capacity(0) == pytest.approx(2 / 0.3)
    assert profile.capacity(1) == pytest.approx(2 * 2 / 0.03)
    dropper.register(0, 0.1, (0,))
    assert dropper.enter(0, 0, 0.0) is not None  # the slow gear: 200 ms > 100 ms
    for rid, t in enumerate([0.01, 0.02, 0.03, 0.04, 0.3], start=1):  # 16 requests/s
        dropper.register(rid, 1e9, (0,))
        clock.t = t
        dispatcher.admit(rid)
    assert dispatcher.current_range == 1
    dropper.register(6, 0.3 + 0.1, (0,))
    assert dropper.enter(6, 0, 0.3) is None  # the fast gear: 20 ms < 100 ms
    assert dropper.forecast.exec_at(0, 1) == pytest.approx(0.02)
    with pytest.raises(PolicyError, match="each gear"):
        StageProfile("s", (0.1,), replica_runtime_s=((0.1,),), gear_cascades=(((0,),), ((1,),)))


def _cascade_stage(policy: str = "proactive") -> tuple[PipelineDropper, Dispatcher,
                                                          VirtualClock]:
    """One stage served by a two-model cascade on two devices: ``cheap`` (10 ms a row)
    resolves rows whose certainty reaches 0.5, the rest go to ``big`` (200 ms a row)."""
    plan = GearPlan("op", (0.0, 1e6), (Cascade(("cheap", "big"), (0.5,)),),
                    (Replica("cheap", ("d0",)), Replica("big", ("d1",))),
                    (RangeSchedule(0, (1.0, 1.0), (1, 1)),), (1, 1), max_wait_s=1e-3)
    table = {0: (0.01,), 1: (0.2,)}
    dropper = PipelineDropper(DropPolicy.named(policy),
                              [stage_profile(plan, table.__getitem__)])
    clock = VirtualClock()
    return dropper, Dispatcher(plan, clock, gate=dropper.gate(0)), clock


@pytest.mark.parametrize("policy", ["proactive", "proactive-first-model"])
def test_a_batch_at_a_cascades_later_model_is_charged_that_models_profile(policy: str) -> None:
    """A row escalated to the cascade's big model (200 ms) with 100 ms of budget left is
    dropped when the big model's batch forms; charged the cascade's first model (10 ms), as
    the forecast did before (``proactive-first-model``), it is kept and answered late."""
    dropper, dispatcher, clock = _cascade_stage(policy)
    profile = dropper.forecast.stages[0]
    assert profile.gear_cascades == (((0,), (1,)),) and profile.gear_replicas == ((0,),)
    dropper.register(1, 0.1 + 0.01, (0,))
    (batch,) = dispatcher.admit(1)
    assert batch.replica == 0
    clock.t = 0.01
    done = dispatcher.finish(batch, [0.1])  # unsure: escalated to big, whose device is free
    assert done.escalated == (1,)
    if policy == "proactive-first-model":
        assert [b.replica for b in done.started] == [1] and not dropper.drops
        return
    assert done.started == ()  # dropped as its batch formed
    (drop,) = dropper.gate(0).dropper.drops.values()
    assert drop.request_id == 1 and drop.predicted_finish_s == pytest.approx(0.01 + 0.2)
    assert dispatcher.in_flight == 0


def test_the_forecast_charges_the_escalations_it_measured() -> None:
    """Once half of the cheap model's rows escalated (told by ``Dispatcher.finish``), a
    request entering the stage is predicted 10 ms + 0.5 x 200 ms: with 100 ms of budget it is
    dropped at once; before any escalation (or when every row resolved at the cheap model)
    the prediction is the cheap model's 10 ms and it is kept, as it is under
    ``proactive-first-model``, which charges the cheap model alone."""
    for certainties, dropped, policy in (([0.9, 0.9], False, "proactive"),
                                         ([0.1, 0.9], True, "proactive"),
                                         ([0.1, 0.9], False, "proactive-first-model")):
        dropper, dispatcher, clock = _cascade_stage(policy)
        dropper.register(99, 0.1, (0,))
        assert dropper.enter(99, 0, 0.0) is None  # nothing measured: the cheap model alone
        rid = 0
        for _ in range(8):
            for c in certainties:
                dropper.register(rid, 1e9, (0,))
                (batch,) = [b for b in dispatcher.admit(rid) if b.replica == 0]
                clock.t += 0.01
                dispatcher.finish(batch, [c])
                for b in dispatcher.poll(["d1"]):
                    clock.t += 0.2
                    dispatcher.finish(b, [1.0])
                rid += 1
        assert dropper.forecast.escalation(0, (0,)) == pytest.approx(
            0.0 if certainties[0] > 0.5 else 0.5)
        now = clock.t + 10.0  # past the 1-s windows: the profiled times, no queueing
        dropper.register(100, now + 0.1, (0,))
        drop = dropper.enter(100, 0, now)
        assert (drop is not None) == dropped
        if drop is not None:
            assert drop.predicted_finish_s == pytest.approx(now + 0.01 + 0.5 * 0.2)


@pytest.mark.parametrize("policy", ["proactive", "proactive-first-model"])
def test_the_measured_wait_counts_with_or_without_following_the_cascade(policy: str) -> None:
    """Rows that waited 0.5 s at the cheap model's queue (its batch formed through the
    dispatcher's replica): a request entering now is forecast that wait plus 10 ms under both
    forecasts, and dropped with 0.3 s of budget; after a quiet second it is forecast 10 ms
    and kept."""
    dropper, _, _ = _cascade_stage(policy)
    for rid in range(4):
        dropper.register(rid, 1e9, (0,))
    kept, drops = dropper.select(0, [0, 1, 2, 3], [0.0] * 4, 0.5, 1, replica=0)
    assert kept == [0] and drops == []
    assert dropper.forecast.stage_s(0, 0.5) == pytest.approx(0.5 + 0.01)
    dropper.register(9, 0.5 + 0.3, (0,))
    assert dropper.enter(9, 0, 0.5) is not None
    assert dropper.forecast.stage_s(0, 2.0) == pytest.approx(0.01)


# -- through evaluate_pipeline ------------------------------------------------------------------


def test_evaluate_pipeline_reports_deadline_metrics() -> None:
    plans, routes, trace, rows = three_stage()
    quality = {}
    for q, route in enumerate(routes):
        options = [plans[k].cascades[0].models for k in route]
        for models in itertools.product(*options):
            quality[(q, models)] = 1.0
    sample = PipelineSample(("s0", "s1", "s2"), tuple(routes), quality)
    plain = evaluate_pipeline(plans, [CAT] * 3, trace, sample, seed=5, rows=rows)
    assert plain.deadline is None and plain.quality == 1.0
    point = evaluate_pipeline(plans, [CAT] * 3, trace, sample, seed=5, rows=rows,
                              deadline_s=0.03, dropping=DropPolicy.named("proactive"))
    m = point.deadline
    assert m is not None and m.dropped > 0
    # a dropped request has no answer: quality 0
    assert point.quality == pytest.approx(1.0 - m.drop_rate)
    assert point.metrics.num_requests == m.requests - m.dropped


@settings(max_examples=15, deadline=None)
@given(st.lists(st.floats(0.002, 0.2), min_size=1, max_size=8),
       st.sampled_from(["reactive", "proactive"]), st.sampled_from(["fcfs", "lbf", "hbf",
                                                                     "adaptive"]))
def test_every_request_is_answered_or_dropped_once_whatever_the_policy(
        budgets: list[float], rule: str, priority: str) -> None:
    """Per-request deadlines (cycled over the trace), every rule and order: the event loop's
    own check (each request resolved once per operator before its drop) passes, and the
    outcomes partition the requests."""
    plans, routes, trace, rows = three_stage()
    deadline = np.resize(np.asarray(budgets), len(trace))
    res = simulate_many(plans, [CAT] * 3, trace, seed=5, routes=routes, rows=rows,
                        deadline_s=deadline,
                        dropping=DropPolicy(rule, priority))  # type: ignore[arg-type]
    m = res.deadline_metrics()
    dropped = {d.request_id for d in res.drops}
    assert len(dropped) == len(res.drops) == m.dropped
    assert np.all(np.isnan(res.completion_s[list(dropped)]))
    assert m.on_time + m.dropped + m.late == len(trace)
    if rule == "reactive":  # a reactive drop is always of a request already late
        assert all(d.at_s > d.deadline_s for d in res.drops)
