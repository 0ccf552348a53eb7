"""Re-planning online (issue 33, item 4): the drift rules on made-up counts, the resampled
catalog against brute force, a re-plan on the synthetic catalog, and the engine's replanner
swapping plans while requests flow, each answered exactly once."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from dataclasses import replace

import numpy as np
import pytest
from fakes import FakeModel, SlowModel

from ken.engine.calibrate import recent_ratio
from ken.engine.dispatch import Requests
from ken.engine.replanning import ReplanEvent, Replanner, describe
from ken.engine.serving import Engine
from ken.engine.supervision import BatchRecord
from ken.models.cascade import Cascade
from ken.optimizer.perf import sustained_qps
from ken.optimizer.planner import PlannerSettings, plan_frontier
from ken.optimizer.query import Target
from ken.optimizer.replan import (
    MIN_MARGIN,
    GearReplan,
    plan_escalation,
    resampled_catalog,
    scaled_catalog,
)
from ken.optimizer.workload import poisson_trace
from ken.policy.drift import Drift, DriftWatch, expected_escalation
from ken.policy.plan import GearPlan, RangeSchedule, Replica
from ken.policy.scheduling import WallClock
from tests.test_planner import CASCADES, catalog, hardware

CASCADE = Cascade(("a", "b"), (0.6,))


def small_plan(top_qps: float, cascade: Cascade = CASCADE) -> GearPlan:
    placement = (Replica("a", ("cpu0",)), Replica("b", ("cpu1",)))
    return GearPlan("op", (0.0, top_qps), (cascade,), placement,
                    (RangeSchedule(0, (1.0, 1.0), (1, 1)),), (8, 8), max_wait_s=0.005)


def test_drift_watch_sees_a_rate_above_the_top_gear_and_a_shifted_escalation_rate() -> None:
    plan = small_plan(100.0)
    watch = DriftWatch(plan, {CASCADE: (0.3,)}, window_s=5.0, rate_factor=1.25,
                       escalation_shift=0.1, min_rows=100)
    # 120 qps is within 1.25x of 100: no drift; 130 qps is not
    assert watch.check(1.0, 600, {}) is None
    drift = watch.check(2.0, 650, {})
    assert drift is not None and drift.kind == "rate" and drift.rate_qps == 130.0
    assert "1.30x" in drift.detail
    # escalation: counted over the last 5 s; 35% of rows escalating is within 10 points
    watch.rebase(plan, {CASCADE: (0.3,)})
    assert watch.check(10.0, 100, {(CASCADE, 0): (1000, 300)}) is None
    assert watch.check(12.0, 100, {(CASCADE, 0): (1200, 370)}) is None  # 200 rows at 35%
    assert watch.check(13.0, 100, {(CASCADE, 0): (1250, 380)}) is None  # 50 new rows: too few
    # counted since the latest snapshot at least 5 s old (t=10): 500 rows at 52%
    drift = watch.check(16.0, 100, {(CASCADE, 0): (1500, 560)})
    assert drift is not None and drift.kind == "escalation"
    assert (drift.cascade, drift.stage) == (CASCADE, 0)
    assert drift.escalation == pytest.approx(260 / 500)
    # the last stage passes nothing on, and other plans' cascades are not judged
    other = Cascade(("b",))
    assert watch.check(30.0, 100, {(other, 0): (10_000, 9_000)}) is None
    # latency: the p95 of the last answers against the limit the plan is held to
    held = DriftWatch(plan, {}, min_rows=100, latency_limit_ms=200.0)
    assert held.check(1.0, 10, {}, [150.0] * 99 + [5_000.0]) is None  # 100 answers, p95 150
    assert held.check(2.0, 10, {}, [150.0] * 50) is None  # too few answers to judge
    drift = held.check(3.0, 10, {}, [150.0] * 90 + [900.0] * 10)
    assert drift is not None and drift.kind == "latency" and "200 ms" in drift.detail
    assert DriftWatch(plan, {}).check(4.0, 10, {}, [9e9] * 500) is None  # no limit given
    # runtime: the calls of the window against the plan's runtimes
    timed = DriftWatch(plan, {}, runtime_shift=0.25, min_calls=20)
    assert timed.check(1.0, 10, {}, runtime=(1.2, 500)) is None  # within 25%
    assert timed.check(2.0, 10, {}, runtime=(2.0, 19)) is None  # too few calls to judge
    drift = timed.check(3.0, 10, {}, runtime=(1.6, 40))
    assert drift is not None and drift.kind == "runtime" and drift.runtime_factor == 1.6
    assert "40 model calls took 1.60x" in drift.detail
    faster = timed.check(4.0, 10, {}, runtime=(0.5, 40))
    assert faster is not None and faster.kind == "runtime"
    # what serving kept up with: answering under 90% of the arrivals is falling behind
    kept = timed.check(5.0, 650, {}, answered=600)
    assert kept is not None and kept.served_qps == 120.0 and not kept.saturated
    assert kept.plan is plan and "falling behind" not in kept.detail
    behind = timed.check(6.0, 650, {}, answered=500)
    assert behind is not None and behind.kind == "rate" and behind.saturated
    assert "100 qps answered: falling behind" in behind.detail
    assert not timed.check(7.0, 650, {}).saturated  # not counted: nothing said
    assert expected_escalation((1.0, 0.4, 0.1)) == pytest.approx((0.4, 0.25))
    with pytest.raises(Exception, match="must be > 0"):
        DriftWatch(plan, {}, window_s=0)


def test_serving_is_behind_when_its_backlog_grows_over_the_limit_for_a_second() -> None:
    """The backlog rule (``DriftWatch.behind``) against a brute-force reading of the checks:
    behind where every check of the last second or more held more requests than the arrival
    rate times the latency limit, and the last more than the first; then the rate answered is
    what was answered in that time, and the load what arrived."""
    rng = np.random.default_rng(3)
    branches = {True: 0, False: 0}
    for case in range(200):
        plan = small_plan(10.0)  # every check at 100 qps is a rate drift
        watch = DriftWatch(plan, {}, window_s=5.0, latency_limit_ms=200.0)
        polls = np.round(np.arange(10.0, 13.01, 0.25), 2)
        backlogs = np.maximum(0, np.cumsum(rng.integers(-12, 16, polls.size)) + 25)
        step = float(rng.uniform(10.0, 13.0))  # the rate steps from 100 to 250 qps here
        times = np.sort(np.concatenate([np.arange(5.0, step, 0.01),
                                        np.arange(step, 13.0, 0.004)]))
        done = np.sort(rng.uniform(5.0, 13.0, 640))  # answers at 80 qps
        for i, (now, queued) in enumerate(zip(polls, backlogs, strict=True)):
            arrived = times[(times > now - 5.0) & (times <= now)]
            answered = done[(done > now - 5.0) & (done <= now)]
            drift = watch.check(float(now), arrived, {}, answered=answered, backlog=int(queued))
            assert drift is not None and drift.kind == "rate"
            limit = arrived.size / 5.0 * 0.2
            j = i  # brute force: the first check of the run over the limit ending now
            while j > 0 and backlogs[j - 1] > limit and polls[j - 1] >= now - 5.0:
                j -= 1
            span = now - polls[j]
            behind = queued > limit and span >= 1.0 and queued > backlogs[j]
            assert (drift.behind_s > 0) == behind, (case, i)
            branches[behind] += 1
            if behind:
                came = np.count_nonzero(arrived > polls[j])
                assert drift.behind_s == pytest.approx(span)
                assert drift.behind_qps == pytest.approx(came / span)
                assert drift.served_qps == pytest.approx(
                    np.count_nonzero(answered > polls[j]) / span)
                assert drift.saturated and drift.load_qps >= drift.rate_qps
                assert "in flight, over the limit" in drift.detail
            else:
                assert drift.served_qps == answered.size / 5.0 and drift.behind_qps is None
                assert drift.load_qps == drift.rate_qps
    assert min(branches.values()) > 100  # both exercised
    # within the plan's rates, the backlog alone is a latency drift (the answers' p95 lags)
    for limit_ms in (200.0, None):
        watch = DriftWatch(small_plan(1_000.0), {}, latency_limit_ms=limit_ms)
        times = np.arange(15.0, 20.0, 0.01)  # 100 qps: 20 requests within 200 ms
        seen = [watch.check(20.0 + k / 4, times + k / 4, {}, answered=times[::2] + k / 4,
                            backlog=30 + 10 * k) for k in range(6)]
        if limit_ms is None:
            assert seen == [None] * 6  # no limit to hold: nothing to re-plan for
            continue
        assert seen[:4] == [None] * 4  # over the limit, but for under a second
        drift = seen[4]
        assert drift is not None and drift.kind == "latency" and drift.behind_s == 1.0
        assert "70 requests in flight, over the 20 a plan within 200 ms holds" in drift.detail
        assert drift.saturated and "falling behind" in drift.detail
        assert drift.detail.count("in flight") == 1
    # counts alone (no times): only the window's share answered says it
    watch = DriftWatch(small_plan(10.0), {}, latency_limit_ms=200.0)
    for k in range(9):
        drift = watch.check(20.0 + k / 4, np.int64(500), {}, answered=480,
                            backlog=100 + 20 * k)
    assert drift is not None and drift.behind_s == 0 and not drift.saturated
    assert drift.rate_qps == 100.0 and drift.served_qps == 96.0
    # a watch of a window shorter than BEHIND_S judges over its whole window
    short = DriftWatch(small_plan(1_000.0), {}, window_s=0.5, latency_limit_ms=200.0)
    times = np.arange(0.0, 0.5, 0.01)  # 100 qps
    polls = (0.5, 0.751, 1.003)  # a wall clock's checks are never on the window's edge
    seen = [short.check(t, times + t - 0.5, {}, answered=times + t - 0.5, backlog=30 + 10 * k)
            for k, t in enumerate(polls)]
    assert seen[:2] == [None, None] and seen[2] is not None
    assert seen[2].behind_s == pytest.approx(0.5) and seen[2].behind_since_s == 0.5


def test_a_backlog_over_its_limit_for_longer_than_the_window_keeps_when_it_began() -> None:
    """The checks' log keeps one window; a run over the limit that outlasts it still began
    when the checks first went over (a re-plan started on it must not take it for a new
    one), and a check within the limit ends the run."""
    watch = DriftWatch(small_plan(1_000.0), {}, window_s=5.0, latency_limit_ms=200.0)
    times = np.arange(0.0, 5.0, 0.01)  # 100 qps: 20 requests within 200 ms

    def check(now: float, queued: int) -> Drift | None:
        return watch.check(now, times + now - 5.0, {}, answered=times[::2] + now - 5.0,
                           backlog=queued)

    since = []
    for k in range(41):  # 10 s of checks, every one over the limit and growing
        drift = check(20.0 + k / 4, 30 + 10 * k)
        if drift is not None:
            since.append(drift.behind_since_s)
    assert len(since) == 37 and set(since) == {20.0}  # behind from 21 s on, since 20 s
    assert check(30.25, 5) is None  # within the limit: the run ends
    drifts = [check(30.5 + k / 4, 40 + 10 * k) for k in range(5)]
    assert drifts[:4] == [None] * 4 and drifts[4] is not None
    assert drifts[4].behind_since_s == 30.5


def test_the_backlog_counts_an_operators_online_requests_in_flight() -> None:
    requests = Requests(WallClock())
    with requests.lock:
        for rid, online in enumerate(("op", "op", "", "other", "op")):
            requests.add(rid, "x", Future(), 0.0, online)
    assert (requests.waiting("op"), requests.waiting("other"), requests.waiting("no")) == (3, 1, 0)
    requests.resolve(0, "ok")
    assert requests.waiting("op") == 2 and len(requests) == 4


def test_resampled_catalog_escalates_at_the_asked_rate() -> None:
    cat = catalog()
    cascade = Cascade(("s", "l"), (0.75,))
    base = float(np.mean(cascade.escalates(0, cat.certainty("s"))))
    for goal in (0.2, base, 0.8):
        harder = resampled_catalog(cat, cascade, goal, seed=1)
        assert harder.num_rows == cat.num_rows
        share = harder.stage_fractions(cascade)[1]
        assert share == pytest.approx(goal, abs=0.06)  # a sample of 400 rows
    # every model keeps its own answer to each drawn row
    harder = resampled_catalog(cat, cascade, 0.8, seed=1)
    rows = [int(np.flatnonzero((cat.scores["s"] == r).all(axis=1))[0])
            for r in harder.scores["s"][:20]]
    assert [harder.quality["l"][i] for i in range(20)] == [cat.quality["l"][r] for r in rows]
    with pytest.raises(Exception, match="one stage"):
        resampled_catalog(cat, Cascade(("s",)), 0.5)


def test_gear_replan_covers_the_new_peak_and_meets_the_target() -> None:
    cat = catalog()
    replan = GearReplan("op", cat, CASCADES, hardware(), Target(max_p95_ms=200.0),
                        settings=PlannerSettings(num_ranges=3, max_rounds=2))
    trace = poisson_trace(400.0, 3.0, seed=2)
    watch = DriftWatch(small_plan(150.0), {}, window_s=1.0)
    drift = watch.check(3.0, 400, {})
    assert drift is not None
    plan = replan(trace, drift)
    assert plan.qps_edges[-1] >= trace.qps_max()  # its gears cover what was seen
    assert plan.predicted.p95_ms <= 100.0  # half the target: a re-plan drains a backlog
    assert dict(plan.provenance)["replanned"] == drift.detail
    assert replan.latency_limit_ms == 200.0
    # a latency drift (the plan missed its target serving) tightens the bound each time
    late = DriftWatch(plan, {}, window_s=1.0, min_rows=1, latency_limit_ms=200.0)
    tighter = replan(trace, late.check(4.0, 10, {}, [1_000.0]))
    assert replan.margin == 0.25
    # not where the backlog found serving behind (the share served corrects that), and
    # never below MIN_MARGIN
    behind = Drift(5.0, "latency", "behind", 400.0, served_qps=200.0, behind_s=1.5,
                   behind_qps=400.0, behind_since_s=3.5)
    replan(trace, behind)
    assert replan.margin == 0.25
    for k in range(4):
        replan(trace, late.check(6.0 + k, 10, {}, [1_000.0]))
    assert replan.margin == MIN_MARGIN
    # within 50 ms, or (none that fast) the fastest plan: never slower than the first pick
    assert tighter.predicted.p95_ms <= 50.0 or \
        tighter.predicted.p95_ms <= plan.predicted.p95_ms
    assert set(replan.expected(plan)) == set(plan.cascades)
    assert plan_escalation(cat, plan) == replan.expected(plan)


def test_a_replan_after_serving_fell_behind_plans_for_the_load_as_the_machine_served_it(
        ) -> None:
    """A drift whose plan answered under 90% of the arrivals: the re-plan plans with every
    runtime divided by the share it served of its modelled capacity, so its fastest gear
    sustains rate / share in the model, and its edges and predictions are in the machine's
    rates and time."""
    cat, hw = catalog(), hardware()
    settings = PlannerSettings(num_ranges=3, max_rounds=2)
    trace = poisson_trace(100.0, 3.0, seed=1)
    frontier, _ = plan_frontier("op", CASCADES, cat, hw, trace, settings=settings)
    probe = GearReplan("op", cat, CASCADES, hw, Target(max_p95_ms=200.0), settings=settings)
    drifted = max(frontier.one_gear, key=lambda p: cat.accuracy(p.cascades[0]))
    modelled = probe.capacity(drifted)
    rate = 0.6 * modelled  # the model says the plan sustains it, with room
    load = poisson_trace(rate, 3.0, seed=3)
    kept = Drift(3.0, "rate", "kept up", rate, served_qps=rate, plan=drifted)
    behind = Drift(3.0, "rate", "fell behind", rate, served_qps=0.5 * rate, plan=drifted)
    share = probe.served_share(behind)
    assert share == pytest.approx(0.3)
    plain = GearReplan("op", cat, CASCADES, hw, Target(max_p95_ms=200.0),
                       settings=settings)(load, kept)
    dense = GearReplan("op", cat, CASCADES, hw, Target(max_p95_ms=200.0),
                       settings=settings)(load, behind)
    assert "planned with" not in dict(plain.provenance)["replanned"]
    assert "planned with every runtime 3.33x" in dict(dense.provenance)["replanned"]
    # planned with the runtimes as served: its gears cover the peak seen, in the rates
    # serving measures, and its predictions are in the machine's time
    for plan in (plain, dense):
        assert plan.qps_edges[-1] >= load.qps_max()
        assert plan.predicted.p95_ms <= 100.0  # half the target, as any re-plan
    slow = scaled_catalog(cat, 1 / share, gpus=True)
    assert dense.batch_runtime_s[0][0] == pytest.approx(
        slow.perf_on(dense.placement[0].model, dense.placement[0].devices[0])
        .batch_runtime(1))
    # in the model, its fastest gear sustains the load as served: the rate over the share
    assert probe.capacity(dense) >= rate / share
    assert probe.capacity(dense) > probe.capacity(plain)
    assert cat.accuracy(dense.cascades[-1]) <= cat.accuracy(plain.cascades[-1])
    assert GearReplan("op", cat, CASCADES, hw, Target(max_p95_ms=200.0),
                      measured=False).served_share(behind) == 1.0


def test_recent_ratio_reads_the_calls_of_the_window_and_a_runtime_drift_rescales_the_plan(
        ) -> None:
    """The engine's log against the catalog: calls twice as long as the catalog says, those
    before the window left out; GearReplan then plans with runtimes twice as long."""
    cat = catalog()
    rt = cat.perf["s"].batch_runtime(1)
    log = [BatchRecord("cpu0", "s", 1, t, t + (0.5 if t < 10 else 2.0) * rt, 0.0)
           for t in np.arange(0.0, 20.0, 0.5)]
    factor, calls = recent_ratio(log, cat, 10.0)
    assert factor == pytest.approx(2.0) and calls == 20
    assert recent_ratio(log, cat, 100.0) is None
    replan = GearReplan("op", cat, CASCADES, hardware(), Target(max_p95_ms=200.0),
                        settings=PlannerSettings(num_ranges=2, max_rounds=1))
    drift = DriftWatch(small_plan(1_000.0), {}, min_calls=10).check(
        20.0, 100, {}, runtime=(factor, calls))
    assert drift is not None and drift.kind == "runtime"
    plan = replan(poisson_trace(50.0, 3.0, seed=2), drift)
    assert replan.catalog.perf["s"].batch_runtime(1) == pytest.approx(2.0 * rt)
    assert replan.catalog.perf["l"].batch_runtime(8) == \
        pytest.approx(2.0 * cat.perf["l"].batch_runtime(8))
    assert dict(plan.provenance)["replanned"] == drift.detail
    assert recent_ratio(log, replan.catalog, 10.0)[0] == pytest.approx(1.0)  # quiet again

    class Trimmed(list):
        """The engine's log, trimmed in place by a device thread while it is read."""

        def __getitem__(self, i):  # noqa: ANN001, ANN204
            if len(self) > 20:
                del self[:len(self) // 2]
            return super().__getitem__(i)

    assert recent_ratio(Trimmed(log), cat, 10.0) == (pytest.approx(2.0), 20)


def flood_until(engine: Engine, swapped: threading.Event) -> tuple[list, list]:
    """About 400 requests per second, far above the small plans' 50 qps, until ``swapped``
    is set (and at least 50 were sent), then 20 more; the futures and their outcomes."""
    futures = []
    for i in range(4000):
        futures.append(engine.submit(f"row {i}"))
        if swapped.is_set() and len(futures) > 50:
            break
        threading.Event().wait(0.0025)
    assert swapped.wait(10)
    futures += [engine.submit(f"after {i}") for i in range(20)]
    return futures, [f.result(timeout=10) for f in futures]


def test_replanner_swaps_the_plan_when_the_rate_passes_the_top_gear_and_loses_nothing() -> None:
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    first = small_plan(50.0)
    second = small_plan(5_000.0, Cascade(("a",)))
    swapped = threading.Event()
    seen = []

    def replan(trace, drift):  # noqa: ANN001, ANN202
        seen.append((len(trace), drift.kind))
        return second

    with Engine(first, models) as engine:
        replanner = Replanner(engine, "op", replan, lambda p: {c: (0.5,) for c in p.cascades},
                              window_s=0.5, history_s=1.0, poll_s=0.05, settle_s=0.0,
                              on_event=lambda e: swapped.set())
        with replanner:
            futures, outcomes = flood_until(engine, swapped)
        assert engine.plans["op"] is second
    event = replanner.events[0]
    assert event.drift.kind == "rate" and not event.error and seen[0][1] == "rate"
    assert "qps" in event.line() and "re-planned" in event.line()
    # the drift says what the window answered (every answer in it, whenever it arrived)
    # and which plan drifted
    assert event.drift.served_qps is not None and event.drift.served_qps > 0
    assert event.drift.plan is first
    # and how many of the operator's requests were in flight
    assert event.drift.backlog is not None and 0 <= event.drift.backlog <= len(futures)
    assert len({o.request_id for o in outcomes}) == len(futures)
    assert {o.status for o in outcomes} == {"ok"}
    # the rows after the swap ran the new plan: model a alone, never escalated
    assert all(o.model == "a" and o.stage == 0 for o in outcomes[-20:])


def test_a_picklable_replan_runs_in_a_niced_planner_process_and_keeps_its_state() -> None:
    """A re-plan that pickles (``GearReplan`` does) runs in the planner process, at a lower
    CPU priority than the engine's, and what it changed in itself comes back; the swap loses
    no request. A planner process that dies is started again by the next call; an exception
    there comes back as a ``KenError`` naming it."""
    import os

    from fakes import FixedReplan, failing_plan

    from ken.engine.planner_process import NICE, PlannerProcess
    from ken.errors import KenError

    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    second = small_plan(5_000.0, Cascade(("a",)))
    replan = FixedReplan(second)
    swapped = threading.Event()
    with Engine(small_plan(50.0), models) as engine:
        replanner = Replanner(engine, "op", replan, lambda p: {c: (0.5,) for c in p.cascades},
                              window_s=0.5, history_s=1.0, poll_s=0.05, settle_s=0.0,
                              on_event=lambda e: swapped.set())
        assert replanner.planner is not None
        with replanner:
            futures = []
            for i in range(4000):  # about 400 a second, far above the plan's 50 qps
                futures.append(engine.submit(f"row {i}"))
                if swapped.is_set() and len(futures) > 50:
                    break
                threading.Event().wait(0.0025)
            assert swapped.wait(20)
            outcomes = [f.result(timeout=10) for f in futures]
        assert engine.plans["op"] == second
        assert replanner.planner.pid is None  # stopped with the watch
    assert not replanner.events[0].error
    assert replan.calls == 1 and replan.pid not in (None, os.getpid())
    assert replan.nice == min(os.getpriority(os.PRIO_PROCESS, 0) + NICE, 19)
    assert len({o.request_id for o in outcomes}) == len(futures)
    assert {o.status for o in outcomes} == {"ok"}
    with PlannerProcess() as planner:
        first = planner.pid
        assert first is not None
        os.kill(first, 9)
        with pytest.raises(KenError, match="planner process ended"):
            planner.call(replan, None, None)
        plan, after = planner.call(replan, None, None)  # a fresh process
        assert plan == second and after.calls == 2 and planner.starts == 2
        with pytest.raises(KenError, match="ValueError: no plan fits"):
            planner.call(failing_plan, None, None)
        assert planner.call(replan, None, None)[1].calls == 2  # its state is the caller's
    # watches can share one planner process; it outlives them, its owner closes it
    with PlannerProcess() as shared:
        one = Replanner(engine, "op", replan, lambda p: {}, planner=shared)
        two = Replanner(engine, "op", replan, lambda p: {}, planner=shared)
        assert one.planner is two.planner is shared
        one.stop()
        assert shared.pid is not None and shared.call(replan, None, None)[0] == second
    assert shared.pid is None
    # a closure cannot be pickled: it is planned in the watching thread
    assert Replanner(engine, "op", lambda t, d: second, lambda p: {}).planner is None
    assert Replanner(engine, "op", replan, lambda p: {}, isolate=False).planner is None


def test_replanner_sees_calls_slower_than_the_plan_and_replans_with_their_runtimes() -> None:
    """Model calls taking about 10 ms where the catalog the plan was made with says 2 ms: the
    replanner's runtime watch (``recent_ratio`` against that catalog) sees a runtime drift,
    the re-plan gets its factor, and every request is answered once."""
    from ken.optimizer.perf import Catalog, ModelPerf

    perf = {m: ModelPerf(m, (1, 8), ((0.002, 0.016),), (100,)) for m in ("a", "b")}
    cat = Catalog(perf, {m: np.ones(4) for m in perf}, {m: np.full((4, 2), 0.5) for m in perf})
    models = {"a": SlowModel("a", 0.010), "b": SlowModel("b", 0.010)}
    first = small_plan(5_000.0, Cascade(("a",)))
    second = small_plan(5_000.0, Cascade(("b",)))
    swapped = threading.Event()
    seen = []

    def replan(trace, drift):  # noqa: ANN001, ANN202
        seen.append(drift)
        return second

    with Engine(first, models) as engine:
        replanner = Replanner(engine, "op", replan, lambda p: {}, window_s=0.5, history_s=1.0,
                              poll_s=0.05, settle_s=0.0, on_event=lambda e: swapped.set(),
                              runtimes=lambda log, since: recent_ratio(log, cat, since))
        with replanner:
            futures = []
            for i in range(400):  # about 50 a second, until the swap
                futures.append(engine.submit(f"row {i}"))
                if swapped.is_set():
                    break
                threading.Event().wait(0.02)
            assert swapped.wait(10)
            outcomes = [f.result(timeout=10) for f in futures]
        assert engine.plans["op"] is second
    drift = replanner.events[0].drift
    assert drift.kind == "runtime" and drift.runtime_factor is not None
    assert 3.0 < drift.runtime_factor < 10.0  # 10 ms calls and their round trip over 2 ms
    assert seen[0] is drift
    assert len({o.request_id for o in outcomes}) == len(futures)
    assert {o.status for o in outcomes} == {"ok"}


def test_stopgap_falls_back_to_the_most_accurate_one_gear_plan_that_sustains_the_load(
        ) -> None:
    """``GearReplan.stopgap`` against the rule by brute force, on the frontier's one-gear
    plans: rate drifts the plan covers, latency drifts well below its capacity and other
    drifts give nothing; otherwise the most accurate fallback that sustains the load (those
    with their models already on their devices first), or where none does, the one that
    sustains most."""
    cat, hw = catalog(), hardware()
    frontier, _ = plan_frontier("op", CASCADES, cat, hw, poisson_trace(100.0, 3.0, seed=1),
                                settings=PlannerSettings(num_ranges=3, max_rounds=2))
    fallbacks = frontier.one_gear
    assert len(fallbacks) >= 2 and all(len(set(p.cascades)) == 1 for p in fallbacks)
    assert set(fallbacks) <= set(frontier.all_plans)
    replan = GearReplan("op", cat, CASCADES, hw, Target(max_p95_ms=200.0),
                        fallbacks=fallbacks)
    accuracy = {p: cat.accuracy(p.cascades[0]) for p in fallbacks}
    cap = {p: replan.capacity(p) for p in fallbacks}

    def expected(current: GearPlan, need: float) -> GearPlan | None:
        loaded = {(r.model, d) for r in current.placement for d in r.devices}
        ok = [p for p in fallbacks if cap[p] >= need]
        if not ok:
            best = max(fallbacks, key=lambda p: cap[p])
            return best if cap[best] > replan.capacity(current) else None
        on_devices = [p for p in ok if all((r.model, d) in loaded for r in p.placement
                                           for d in r.devices)]
        for group in (on_devices, ok):
            if group:
                top = max(accuracy[p] for p in group)
                return max((p for p in group if accuracy[p] == top), key=lambda p: cap[p])
        return None

    fired = {True: 0, False: 0}
    for current in fallbacks:
        modelled = replan.capacity(current)
        assert replan.stopgap(Drift(1.0, "rate", "", modelled / 2), current) is None
        assert replan.stopgap(Drift(1.0, "escalation", "", modelled * 10), current) is None
        for kind, rate, answered in itertools.product(
                ("rate", "latency"), (modelled * 0.5, modelled * 1.5, modelled * 4,
                                      modelled * 1e4), (None, 0.95, 0.5, 0.01)):
            # ``answered``: the share of the arrivals served; under 90%, what was served is
            # what ``current`` sustains, and every capacity counts at that share of the model
            served = None if answered is None else rate * answered
            share = (1.0 if served is None or served >= 0.9 * rate
                     else min(1.0, max(0.2, served / modelled)))
            drift = Drift(1.0, kind, "", rate, served_qps=served, plan=current)
            assert replan.served_share(drift) == pytest.approx(share)
            got = replan.stopgap(drift, current)
            have = modelled * share
            need = max(rate, 1.0) * replan.headroom
            if need < have or (kind == "rate" and have >= need):
                assert got is None, (kind, rate, answered)  # not an overload
                continue
            if kind == "latency":
                need = max(need, have * replan.headroom)
            want = expected(current, need / share)
            assert got == want, (kind, rate, answered)
            fired[share < 1.0] += got is not None
            if got is not None:
                assert cap[got] * share >= need or cap[got] == max(cap.values())
    assert fired[True] and fired[False]  # both rules were exercised
    # escalation and runtime drifts re-plan by their own measure: no share
    current = fallbacks[0]
    hard = Drift(1.0, "escalation", "", 100.0, served_qps=1.0, plan=current)
    assert hard.saturated and replan.served_share(hard) == 1.0
    # a plan of two gears: the share is of the gear serving the rate measured, not the fastest
    slow, fast = Cascade(("s", "l"), (0.75,)), Cascade(("s",))
    two = GearPlan("op", (0.0, 50.0, 500.0), (slow, fast),
                   (Replica("s", ("d0",)), Replica("l", ("d1",))),
                   (RangeSchedule(0, (1.0, 1.0), (1, 1)), RangeSchedule(1, (1.0, 0.0), (1, 1))),
                   (8, 8))
    low = Drift(1.0, "latency", "", 40.0, served_qps=10.0, plan=two)
    gear = sustained_qps(cat, slow, hw)
    assert replan.capacity(two, 40.0) == pytest.approx(gear)
    assert gear < replan.capacity(two) == pytest.approx(replan.capacity(two, 80.0))
    assert replan.served_share(low) == pytest.approx(max(0.2, min(1.0, 10.0 / gear)))
    # behind for a while at a higher load than the window's: the gear serving that load
    rushed = Drift(1.0, "latency", "", 40.0, served_qps=10.0, plan=two, behind_s=1.5,
                   behind_qps=80.0)
    assert rushed.saturated and rushed.load_qps == 80.0
    assert replan.served_share(rushed) == pytest.approx(
        max(0.2, min(1.0, 10.0 / replan.capacity(two, 80.0))))
    no_fallbacks = GearReplan("op", cat, CASCADES, hw, Target(max_p95_ms=200.0))
    assert no_fallbacks.stopgap(Drift(1.0, "rate", "", 1e6), fallbacks[0]) is None


def test_replanner_swaps_the_stopgap_in_at_once_and_the_replan_after_it() -> None:
    """A rate drift: the stop-gap is swapped in before the re-plan runs and serves while it
    does, then the re-plan's plan; both swaps logged (EXPLAIN-style count apart), every
    request answered once."""
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    first, quick = small_plan(50.0), small_plan(5_000.0, Cascade(("a",)))
    final = small_plan(5_000.0, Cascade(("a", "b"), (0.9,)))
    done = threading.Event()

    class Staged:
        def __init__(self) -> None:
            self.serving_while_planning: GearPlan | None = None
            self.asked: list[str] = []

        def stopgap(self, drift, plan):  # noqa: ANN001, ANN202
            self.asked.append(drift.kind)
            return quick

        def __call__(self, trace, drift):  # noqa: ANN001, ANN202
            self.serving_while_planning = engine.plans["op"]
            return final

    staged = Staged()
    with Engine(first, models) as engine:
        replanner = Replanner(engine, "op", staged, lambda p: {c: (0.5,) for c in p.cascades},
                              window_s=0.5, history_s=1.0, poll_s=0.05, settle_s=0.0,
                              isolate=False,
                              on_event=lambda e: done.set() if not e.stopgap else None)
        with replanner:
            futures, outcomes = flood_until(engine, done)
        assert engine.plans["op"] == final
    assert staged.asked[0] == "rate" and staged.serving_while_planning == quick
    stop, replanned = replanner.events[0], replanner.events[1]
    assert stop.stopgap and not stop.error and "fell back" in stop.line()
    assert not replanned.stopgap and "re-planned" in replanned.line()
    assert stop.swapped_at_s <= replanned.swapped_at_s
    assert len({o.request_id for o in outcomes}) == len(futures)
    assert {o.status for o in outcomes} == {"ok"}


@pytest.mark.parametrize("case", ["watched", "behind before", "early off"])
def test_serving_falling_behind_while_a_replan_runs_swaps_the_stopgap_and_plans_again(
        case: str) -> None:
    """A rate drift that serving keeps up with starts a re-plan on the model's capacity; when
    serving falls behind while it runs, the stop-gap for that drift is swapped in at once, and
    the re-plan's plan, made for a capacity serving disproved, is dropped for one planned on
    the drift that fell behind (what the dropped re-plan changed in itself undone). Every
    request is answered once; that holds for a backlog whose run over its limit began before
    the drift, if the drift did not find serving behind. If it did, that backlog is what the
    re-plan is for: no stop-gap. ``early=False`` (the A/B): the backlog is not read and
    nothing is watched while the re-plan runs."""
    early, watched = case != "early off", case == "watched"
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    first, quick = small_plan(50.0), small_plan(5_000.0, Cascade(("a",)))
    stale, final = small_plan(777.0), small_plan(5_000.0, Cascade(("a", "b"), (0.9,)))
    planning, fell_back, done = threading.Event(), threading.Event(), threading.Event()
    returned = threading.Event()  # the first re-plan returned
    looked = threading.Event()  # the watch was asked while the first re-plan ran

    class Watch:  # the rate drift first; while the re-plan runs, serving behind
        window_s, plan = 0.5, first
        # the first drift found serving keeping up, or (behind before) behind already
        kept_up = Drift(0.0, "rate", "kept up", 100.0,
                        served_qps=40.0 if case == "behind before" else 100.0)
        # behind by a backlog whose run over its limit began before the first drift
        behind = Drift(0.0, "rate", "behind", 100.0, served_qps=40.0, behind_s=1.5,
                       behind_qps=120.0, behind_since_s=-1.0)
        backlogs: list = []
        looked_while_planning = 0

        def check(self, now, *args):  # noqa: ANN001, ANN002, ANN202
            self.backlogs.append(args[-1])
            if not planning.is_set():
                return replace(self.kept_up, at_s=now)
            if returned.is_set() or fell_back.is_set():
                return None
            self.looked_while_planning += 1
            looked.set()
            return replace(self.behind, at_s=now)

        def rebase(self, plan, expected):  # noqa: ANN001, ANN202
            self.plan = plan

    class Staged:
        def __init__(self) -> None:
            self.asked: list[bool] = []  # stopgap: was the drift behind
            self.planned: list[bool] = []  # re-plan: was the drift behind
            self.margin = 1.0  # state a re-plan changes in itself

        def stopgap(self, drift, plan):  # noqa: ANN001, ANN202
            self.asked.append(drift.saturated)
            if len(self.asked) == 1:
                return None  # the model says the plan serving sustains the load
            fell_back.set()
            return quick

        def __call__(self, trace, drift):  # noqa: ANN001, ANN202
            self.planned.append(drift.saturated)
            if len(self.planned) == 1:
                planning.set()
                self.margin /= 2
                if watched:
                    assert fell_back.wait(10)  # the stop-gap is swapped in while this plans
                elif early:
                    assert looked.wait(10)  # the watch saw the old backlog while this planned
                returned.set()
                return stale
            assert self.margin == 1.0  # the dropped re-plan's change was undone
            return final

    staged = Staged()
    with Engine(first, models) as engine:
        replanner = Replanner(engine, "op", staged, lambda p: {c: (0.5,) for c in p.cascades},
                              window_s=0.5, history_s=1.0, poll_s=0.05, settle_s=0.0,
                              isolate=False, early=early,
                              on_event=lambda e: done.set() if not e.stopgap else None)
        replanner.watch = watch = Watch()
        with replanner:
            futures, outcomes = flood_until(engine, done)
        assert engine.plans["op"] == (final if watched else stale)
    assert all((b is not None) == early for b in watch.backlogs)
    assert len({o.request_id for o in outcomes}) == len(futures)
    assert {o.status for o in outcomes} == {"ok"}
    assert (watch.looked_while_planning > 0) == early
    if not watched:
        assert staged.asked == [case == "behind before"]
        assert staged.planned == [case == "behind before"]
        assert [e.new for e in replanner.events] == [describe(stale)]
        return
    assert staged.asked == [False, True] and staged.planned == [False, True]
    stop, replanned = replanner.events[:2]
    assert stop.stopgap and stop.drift.saturated and stop.new == describe(quick)
    assert not replanned.stopgap and replanned.drift.saturated
    assert replanned.old == describe(quick) and replanned.new == describe(final)
    assert all(describe(stale) not in (e.old, e.new) for e in replanner.events)


def test_the_watch_goes_on_after_its_own_errors() -> None:
    """A check that raises (the engine's logs read while they change) and an ``on_event``
    that raises are recorded in ``watch_errors``, the first of a run of the same error in
    the serving log once, and the watch goes on: the next drift is re-planned."""
    from fakes import FixedReplan

    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    second = small_plan(5_000.0, Cascade(("a",)))
    checks, swapped, notes = [], threading.Event(), []

    class Watch:
        window_s, plan = 0.5, small_plan(50.0)

        def check(self, now, *args):  # noqa: ANN001, ANN002, ANN202
            checks.append(now)
            if len(checks) <= 3:
                raise IndexError("list index out of range")
            return Drift(now, "rate", "more load", 100.0)

        def rebase(self, plan, expected):  # noqa: ANN001, ANN202
            self.plan = plan

    def on_event(event: ReplanEvent) -> None:
        swapped.set()
        raise ValueError("the log is full")

    class Notes:
        def note(self, line: str) -> None:
            notes.append(line)

    with Engine(small_plan(50.0), models) as engine:
        replanner = Replanner(engine, "op", FixedReplan(second),
                              lambda p: {c: (0.5,) for c in p.cascades}, window_s=0.5,
                              history_s=1.0, poll_s=0.05, settle_s=0.0, isolate=False,
                              on_event=on_event, reporter=Notes())  # type: ignore[arg-type]
        replanner.watch = Watch()
        with replanner:
            futures, outcomes = flood_until(engine, swapped)
        assert engine.plans["op"] == second
    assert len({o.request_id for o in outcomes}) == len(futures)
    messages = [m for _, m in replanner.watch_errors]
    assert messages[:3] == ["IndexError: list index out of range"] * 3
    assert "ValueError: the log is full" in messages
    # an error said once, until another: the on_event error repeats at each re-plan
    assert sum("IndexError" in n for n in notes) == 1
    assert sum("ValueError" in n for n in notes) == 1
    assert all("goes on watching" in n for n in notes)


@pytest.mark.parametrize("case", ["watch raises", "stopped"])
def test_a_watched_replan_ends_before_its_error_and_is_not_redone_while_stopping(
        case: str) -> None:
    """An error from the watch while a re-plan runs is recorded (``watch_errors``) and costs
    the re-plan nothing: its plan is swapped in once it has ended; stopped while a re-plan
    that saw serving fall behind runs, the watch swaps that re-plan's plan in and plans no
    second time."""
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    first, quick, stale = small_plan(50.0), small_plan(5_000.0, Cascade(("a",))), small_plan(777.0)
    planning, looked, recorded = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    class Watch:
        window_s, plan = 0.5, first

        def check(self, now, *args):  # noqa: ANN001, ANN002, ANN202
            if not planning.is_set():
                return Drift(now, "rate", "kept up", 100.0, served_qps=100.0)
            if looked.is_set():
                return None
            looked.set()
            if case == "watch raises":
                raise RuntimeError("the watch broke")
            return Drift(now, "rate", "behind", 100.0, served_qps=40.0, behind_s=1.5,
                         behind_qps=120.0, behind_since_s=now - 1.5)

        def rebase(self, plan, expected):  # noqa: ANN001, ANN202
            self.plan = plan

    class Staged:
        def __init__(self) -> None:
            self.planned = 0

        def stopgap(self, drift, plan):  # noqa: ANN001, ANN202
            return quick if drift.behind_s else None

        def __call__(self, trace, drift):  # noqa: ANN001, ANN202
            self.planned += 1
            planning.set()
            assert looked.wait(10)
            if case == "watch raises":  # the error is kept, the re-plan goes on
                assert not recorded.wait(0.5)
                assert [m for _, m in replanner.watch_errors] == [
                    "RuntimeError: the watch broke"]
            else:
                stopping = threading.Thread(target=replanner.stop)
                stopping.start()
                assert replanner._stop.wait(10)
            order.append("returned")
            return stale

    def on_event(event: ReplanEvent) -> None:
        if not event.stopgap:
            order.append("event")
            recorded.set()

    staged = Staged()
    with Engine(first, models) as engine:
        replanner = Replanner(engine, "op", staged, lambda p: {c: (0.5,) for c in p.cascades},
                              window_s=0.5, history_s=1.0, poll_s=0.05, settle_s=0.0,
                              isolate=False, on_event=on_event)
        replanner.watch = Watch()
        replanner.start()
        futures, outcomes = flood_until(engine, recorded)
        replanner.stop()
        serving = engine.plans["op"]
    assert order[:2] == ["returned", "event"] and staged.planned == 1
    assert len({o.request_id for o in outcomes}) == len(futures)
    event = [e for e in replanner.events if not e.stopgap][0]
    assert not event.error and serving == stale


def test_a_stopgap_that_fails_or_has_nothing_to_offer_leaves_the_replan_to_follow() -> None:
    """``stopgap`` raising: an error event that says the old plan serves, then the re-plan;
    ``stopgap`` returning None or the plan serving: no stop-gap event at all."""
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    first, final = small_plan(50.0), small_plan(5_000.0, Cascade(("a",)))

    class Picky:
        def __init__(self, answer) -> None:  # noqa: ANN001
            self.answer = answer

        def stopgap(self, drift, plan):  # noqa: ANN001, ANN202
            if self.answer == "raise":
                raise RuntimeError("no fallback today")
            return plan if self.answer == "same" else None

        def __call__(self, trace, drift):  # noqa: ANN001, ANN202
            return final

    for answer in ("raise", "same", None):
        done = threading.Event()
        with Engine(first, models) as engine:
            replanner = Replanner(
                engine, "op", Picky(answer), lambda p: {c: (0.5,) for c in p.cascades},
                window_s=0.5, history_s=1.0, poll_s=0.05, settle_s=0.0, isolate=False,
                on_event=lambda e, done=done: done.set() if not e.stopgap else None)
            with replanner:
                futures, outcomes = flood_until(engine, done)
            assert engine.plans["op"] == final
        assert len({o.request_id for o in outcomes}) == len(futures)
        events = replanner.events
        if answer == "raise":
            assert events[0].stopgap and "no fallback today" in events[0].error
            assert "stop-gap at" in events[0].line() and "failed" in events[0].line()
            assert not events[1].stopgap and not events[1].error
        else:
            assert not any(e.stopgap for e in events) and not events[0].error
