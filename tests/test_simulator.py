"""The discrete-event simulator: invariants on synthetic catalogs, plans and traces.

Also covers the parts of ``ken.optimizer.perf`` it relies on (runtime interpolation, stage
fractions and cascade accuracy from per-sample certainties).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import ken.optimizer.simulator as simulator
from ken.errors import ProfileError
from ken.models.cascade import Cascade
from ken.optimizer.perf import Catalog, ModelPerf
from ken.optimizer.simulator import SimulationError, simulate, simulate_many
from ken.optimizer.workload import Trace, WorkloadError, gamma_trace, poisson_trace
from ken.policy.plan import GearPlan, RangeSchedule, Replica
from ken.policy.scheduling import Batch, Dispatcher

ROWS = 40
BATCH_SIZES = (1, 8, 32)
#: per model: batch runtimes at BATCH_SIZES for degree 1 and degree 2
RUNTIMES = {"a": ((0.002, 0.006, 0.016), (0.0015, 0.004, 0.01)),
            "b": ((0.005, 0.02, 0.06), (0.003, 0.012, 0.035)),
            "c": ((0.01, 0.05, 0.15), (0.006, 0.03, 0.09))}


def make_catalog(seed: int = 0, rows: int = ROWS) -> Catalog:
    rng = np.random.default_rng(seed)
    perf, quality, probs = {}, {}, {}
    for k, (m, rt) in enumerate(sorted(RUNTIMES.items())):
        perf[m] = ModelPerf(m, BATCH_SIZES, rt, (100, 60), (1, 2))
        probs[m] = rng.dirichlet(np.full(3, 0.6), size=rows)
        # 1/0 correctness; later models are more accurate
        quality[m] = (rng.random(rows) < 0.6 + 0.15 * k).astype(np.float64)
    return Catalog(perf, quality, probs, "synthetic")


CATALOG = make_catalog()


def make_plan(placement: list[tuple[str, tuple[str, ...]]], cascades: tuple[Cascade, ...],
              ranges: list[tuple[int, tuple[float, ...], tuple[int, ...]]] | None = None,
              edges: tuple[float, ...] = (0.0, 1e6), max_batch: tuple[int, ...] | None = None,
              operator: str = "op", **kwargs: Any) -> GearPlan:
    reps = tuple(Replica(m, d) for m, d in placement)
    n = len(reps)
    if ranges is None:
        ranges = [(0, (1.0,) * n, (1,) * n)] * (len(edges) - 1)
    return GearPlan(operator, edges, cascades, reps,
                    tuple(RangeSchedule(c, s, q) for c, s, q in ranges),
                    max_batch if max_batch is not None else (8,) * n, **kwargs)


def single(model: str = "a", max_batch: int = 8, device: str = "d0", **kwargs: Any) -> GearPlan:
    return make_plan([(model, (device,))], (Cascade((model,)),), max_batch=(max_batch,),
                     **kwargs)


# -- recording every batch the simulator runs ---------------------------------------------------


class Recorder:
    """Every batch a dispatcher started, with the virtual time it finished."""

    def __init__(self) -> None:
        self.started: list[Batch] = []
        self.finished: dict[int, float] = {}  # id(batch) -> finish time
        self.times: list[float] = []  # clock at every dispatcher call, in call order
        self.plans: dict[int, GearPlan] = {}  # id(batch) -> plan of the dispatcher


@contextmanager
def recording() -> Iterator[Recorder]:
    rec = Recorder()

    class RecordingDispatcher(Dispatcher):
        def _log(self, batches: Any) -> Any:
            for b in batches:
                rec.started.append(b)
                rec.plans[id(b)] = self.plan
            return batches

        def admit(self, request_id: int) -> Any:
            rec.times.append(self.clock.now())
            return self._log(super().admit(request_id))

        def finish(self, batch: Batch, certainties: Any) -> Any:
            rec.times.append(self.clock.now())
            assert id(batch) not in rec.finished, "a batch finished twice"
            rec.finished[id(batch)] = self.clock.now()
            done = super().finish(batch, certainties)
            self._log(done.started)
            return done

        def expire(self) -> Any:
            rec.times.append(self.clock.now())
            return self._log(super().expire())

        def poll(self, devices: Any) -> Any:
            rec.times.append(self.clock.now())
            return self._log(super().poll(devices))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(simulator, "Dispatcher", RecordingDispatcher)
        yield rec


def check_batches(rec: Recorder, trace: Trace) -> None:
    """Each batch ran for its profiled runtime, within max batch, after its rows arrived and in
    start order; one batch per device at a time."""
    per_device: dict[str, list[tuple[float, float]]] = defaultdict(list)
    starts = [b.started_s for b in rec.started]
    assert starts == sorted(starts), "a batch started before an earlier-started one"
    for b in rec.started:
        assert id(b) in rec.finished, "a started batch never finished"
        end = rec.finished[id(b)]
        plan = rec.plans[id(b)]
        rep = plan.placement[b.replica]
        assert 1 <= len(b.request_ids) <= plan.max_batch[b.replica]
        assert b.started_s >= trace.arrival_s[list(b.request_ids)].max()
        expected = CATALOG.perf[b.model].batch_runtime(len(b.request_ids), rep.degree)
        assert end - b.started_s == pytest.approx(expected, rel=1e-9, abs=1e-12)
        for d in b.devices:
            per_device[d].append((b.started_s, end))
    for spans in per_device.values():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end - 1e-12, "a device ran two batches at once"


def check_result(res: simulator.SimResult, trace: Trace, plans: list[GearPlan]) -> None:
    n = len(trace)
    assert res.num_requests == n
    assert np.array_equal(res.arrival_s, trace.arrival_s)
    assert np.all(np.isfinite(res.completion_s))
    assert np.all(res.completion_s >= res.arrival_s)
    for k, plan in enumerate(plans):
        ranges = res.range_index[k]
        assert ranges.min() >= 0 and ranges.max() < plan.num_ranges
        depth = np.array([plan.cascade_of(r).num_stages for r in ranges])
        assert np.all(res.stage[k] >= 0) and np.all(res.stage[k] < depth)
        rows = res.stage_rows[k]
        assert rows[0] == n
        assert all(x >= y for x, y in itertools.pairwise(rows))
    m = res.metrics(0, plans[0])
    duration = float(res.completion_s.max() - res.arrival_s.min())
    assert m.duration_s == duration and m.num_requests == n
    for _, util in m.utilisation:
        assert 0.0 <= util <= 1.0 + 1e-9
    for d, busy in res.device_busy_s:
        assert busy <= duration + 1e-9, d
    assert m.p50_ms <= m.p95_ms <= m.p99_ms
    assert sum(r.num_requests for r in m.per_range) == n


# -- random plans and traces --------------------------------------------------------------------


CASCADES = (Cascade(("a",)), Cascade(("b",)), Cascade(("a", "b"), (0.6,)),
            Cascade(("b", "c"), (0.5,)), Cascade(("a", "b", "c"), (0.55, 0.7)),
            Cascade(("a", "c"), (0.8,)))
DEVICE_SETS = (("d0",), ("d1",), ("d2",), ("d0", "d1"), ("d1", "d2"))


@st.composite
def random_plans(draw: st.DrawFn, one_gear: bool = False) -> GearPlan:
    chosen = draw(st.lists(st.integers(0, len(CASCADES) - 1), min_size=1,
                           max_size=1 if one_gear else 3, unique=True))
    cascades = tuple(CASCADES[i] for i in chosen)
    models = sorted({m for c in cascades for m in c.models})
    placement = [(m, devs) for m in models
                 for devs in draw(st.lists(st.sampled_from(DEVICE_SETS), min_size=1,
                                           max_size=2, unique=True))]
    n = len(placement)
    n_ranges = draw(st.integers(1, 3))
    ranges = [(draw(st.integers(0, len(cascades) - 1)),
               tuple(draw(st.lists(st.sampled_from([0.0, 0.3, 1.0]), min_size=n, max_size=n))),
               tuple(draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))))
              for _ in range(n_ranges)]
    top = draw(st.sampled_from([50.0, 200.0, 800.0]))
    edges = tuple(top * k / n_ranges for k in range(n_ranges + 1))
    max_batch = tuple(draw(st.lists(st.sampled_from([1, 4, 8, 32, 40]), min_size=n,
                                    max_size=n)))
    return make_plan(placement, cascades, ranges, edges, max_batch,
                     max_wait_s=draw(st.sampled_from([0.002, 0.02, 0.1])),
                     alpha=draw(st.sampled_from([1.0, 8.0])),
                     rate_window_s=draw(st.sampled_from([0.05, 0.1])))


@st.composite
def random_traces(draw: st.DrawFn) -> Trace:
    rate, duration = draw(st.sampled_from([(5.0, 2.0), (50.0, 0.5), (300.0, 0.3),
                                           (1000.0, 0.2)]))
    seed = draw(st.integers(0, 1000))
    try:
        if draw(st.booleans()):
            return poisson_trace(rate, duration, seed)
        return gamma_trace(rate, duration, draw(st.sampled_from([0.5, 3.0])), seed)
    except WorkloadError:  # no arrival at all (rare)
        assume(False)
        raise


# -- perf.py ------------------------------------------------------------------------------------


def test_model_perf_runtimes() -> None:
    perf = CATALOG.perf["a"]
    assert perf.max_batch == 32
    assert perf.batch_runtime(1) == 0.002 and perf.batch_runtime(8) == 0.006
    assert perf.batch_runtime(4.5) == pytest.approx(0.004)  # linear between profiled sizes
    assert perf.batch_runtime(64) == pytest.approx(0.032)  # per-row cost of the largest batch
    assert perf.batch_runtime(8, degree=2) == 0.004
    table = perf.runtime_table(2, up_to=40)
    assert table[0] == 0.0 and len(table) == 41
    assert table == pytest.approx([0.0] + [perf.batch_runtime(b, 2) for b in range(1, 41)])
    assert perf.memory(2) == 60 and perf.per_row_s(8) == pytest.approx(0.006 / 8)
    with pytest.raises(ProfileError, match="no runtimes for 4 devices"):
        perf.batch_runtime(1, degree=4)
    with pytest.raises(ProfileError, match="increasing"):
        ModelPerf("x", (8, 1), ((1.0, 2.0),), (1,))
    with pytest.raises(ProfileError, match="positive"):
        ModelPerf("x", (1, 8), ((0.0, 2.0),), (1,))


def test_catalog_stage_fractions_and_accuracy_by_hand() -> None:
    # max_prob certainties of a: 0.9, 0.4, 0.6, 0.5
    pa = np.array([[0.9, 0.1], [0.4, 0.6], [0.6, 0.4], [0.5, 0.5]])
    pb = np.array([[0.7, 0.3]] * 4)
    perf = {m: ModelPerf(m, (1,), ((0.01,),), (1,)) for m in "ab"}
    # booleans are read as 1/0 quality
    cat = Catalog(perf, {"a": [True, False, True, True], "b": [False, True, False, False]},
                  {"a": pa, "b": pb})
    assert cat.quality["a"].dtype == np.float64
    cas = Cascade(("a", "b"), (0.6,))
    assert cat.num_rows == 4 and cat.models == ("a", "b")
    assert cat.certainty("a").tolist() == [0.9, 0.6, 0.6, 0.5]
    assert cat.stage_fractions(cas) == (1.0, 0.25)  # only row 3 (0.5 < 0.6) escalates
    assert cat.quality_per_row(cas).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert cat.accuracy(cas) == 0.5
    assert cat.accuracy(Cascade(("a",))) == 0.75
    assert cat.stage_fractions(Cascade(("a", "b"), (0.95,))) == (1.0, 1.0)
    with pytest.raises(ProfileError, match="not in the catalog"):
        cat.accuracy(Cascade(("zzz",)))
    with pytest.raises(ProfileError, match="same non-empty sample"):
        Catalog(perf, {"a": [True], "b": [True, False]}, {"a": pa[:1], "b": pb[:2]})
    with pytest.raises(ProfileError, match="same non-empty sample"):
        Catalog(perf, {"a": [True] * 4, "b": [True] * 4}, {"a": pa, "b": pb[:3]})


def test_catalog_with_own_certainty_and_fractional_quality_by_hand() -> None:
    # a non-classifier: one certainty per row (used whatever the certainty function), and
    # quality in [0, 1] per row (e.g. token F1)
    perf = {m: ModelPerf(m, (1,), ((0.01,),), (1,)) for m in "ab"}
    cat = Catalog(perf, {"a": [1.0, 0.5, 0.25, 0.0], "b": [0.5, 1.0, 1.0, 1.0]},
                  {"a": np.array([0.9, 0.4, 0.6, 0.5]), "b": np.array([0.7] * 4)})
    cas = Cascade(("a", "b"), (0.6,), "margin")
    assert cat.num_rows == 4
    assert cat.certainty("a", "margin").tolist() == [0.9, 0.4, 0.6, 0.5]
    assert cat.stage_fractions(cas) == (1.0, 0.5)  # rows 1 and 3 escalate
    assert cat.quality_per_row(cas).tolist() == [1.0, 1.0, 0.25, 1.0]
    assert cat.accuracy(cas) == 0.8125
    assert cat.accuracy(Cascade(("a",))) == 0.4375


# -- the simulator ------------------------------------------------------------------------------


def test_single_model_batch_one_latency_equals_profiled_runtime() -> None:
    rt = CATALOG.perf["b"].batch_runtime(1)
    trace = Trace(np.arange(50) * rt * 1.5 + 0.25)
    for max_batch in (1, 8):
        res = simulate(single("b", max_batch=max_batch), CATALOG, trace)
        assert np.all(np.abs(res.latency_s - rt) <= 1e-9)
        assert res.batches == 50
        m = res.metrics()
        assert m.p50_ms == pytest.approx(rt * 1000) and m.p99_ms == pytest.approx(rt * 1000)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(1.01, 20.0), min_size=1, max_size=60), st.sampled_from("abc"),
       st.sampled_from([1, 2]))
def test_low_load_latency_property(gaps: list[float], model: str, degree: int) -> None:
    devices = ("d0", "d1")[:degree]
    rt = CATALOG.perf[model].batch_runtime(1, degree)
    plan = make_plan([(model, devices)], (Cascade((model,)),), max_batch=(32,))
    trace = Trace(np.cumsum(np.asarray(gaps) * rt))
    res = simulate(plan, CATALOG, trace)
    assert np.max(np.abs(res.latency_s - rt)) <= 1e-9


@settings(max_examples=40, deadline=None)
@given(random_plans(), random_traces(), st.integers(0, 100))
def test_every_request_completes_exactly_once(plan: GearPlan, trace: Trace, seed: int) -> None:
    with recording() as rec:
        res = simulate(plan, CATALOG, trace, seed=seed)
    check_result(res, trace, [plan])
    check_batches(rec, trace)
    assert res.batches == len(rec.started)
    # every row of every batch: stage-0 rows are admissions, later stages escalations
    processed = sum(len(b.request_ids) for b in rec.started)
    assert processed == sum(res.stage_rows[0])


@settings(max_examples=30, deadline=None)
@given(random_plans(one_gear=True), st.integers(1, 4), st.sampled_from([20.0, 400.0]),
       st.integers(0, 100))
def test_conservation_and_accuracy_match_catalog(plan: GearPlan, k: int, rate: float,
                                                 seed: int) -> None:
    n = k * ROWS  # each sample row is used exactly k times
    gaps = np.random.default_rng(seed).exponential(1 / rate, n)
    trace = Trace(np.cumsum(gaps))
    cascade = plan.cascades[0]
    res = simulate(plan, CATALOG, trace, seed=seed)
    check_result(res, trace, [plan])
    fractions = CATALOG.stage_fractions(cascade)
    counts = [round(f * ROWS) * k for f in fractions]
    assert list(res.stage_rows[0]) == counts
    assert [c / n for c in res.stage_rows[0]] == pytest.approx(fractions, abs=1e-12)
    assert res.metrics(0, plan).accuracy == CATALOG.accuracy(cascade)
    # the per-request outcome is the catalog's outcome for that request's sample row
    per_row = CATALOG.quality_per_row(cascade)
    assert res.quality.dtype == np.float64
    assert sorted(res.quality[0].tolist()) == sorted(np.tile(per_row, k).tolist())


def test_overloaded_plan_completes_every_request() -> None:
    rt = CATALOG.perf["c"].batch_runtime(1)
    plan = single("c", max_batch=1)
    trace = poisson_trace(10 / rt, 0.5, seed=3)  # ten times what the replica can serve
    with recording() as rec:
        res = simulate(plan, CATALOG, trace)
    check_result(res, trace, [plan])
    check_batches(rec, trace)
    m = res.metrics(0, plan)
    # the backlog never empties after the first arrival: the device works all the time
    assert dict(m.utilisation)["d0"] == pytest.approx(1.0, abs=1e-9)
    assert res.completion_s.max() == pytest.approx(trace.arrival_s[0] + len(trace) * rt)
    assert m.p99_ms > 100 * rt * 1000 / 10


def test_overloaded_cascade_with_batching_completes() -> None:
    plan = make_plan([("a", ("d0",)), ("b", ("d0",)), ("c", ("d1", "d2"))],
                     (Cascade(("a", "b", "c"), (0.7, 0.8)),), max_batch=(32, 8, 4),
                     ranges=[(0, (1.0, 1.0, 1.0), (8, 4, 2))])
    trace = gamma_trace(3000.0, 0.4, cv=3.0, seed=1)
    with recording() as rec:
        res = simulate(plan, CATALOG, trace)
    check_result(res, trace, [plan])
    check_batches(rec, trace)


def test_simulate_many_shares_devices() -> None:
    pa, pb = single("a", operator="first"), single("b", operator="second")
    rt = CATALOG.perf["a"].batch_runtime(1) + CATALOG.perf["b"].batch_runtime(1)
    for trace in (poisson_trace(100.0, 1.0, seed=5), poisson_trace(2000.0, 0.2, seed=6)):
        with recording() as rec:
            res = simulate_many([pa, pb], [CATALOG, CATALOG], trace, seed=2)
        check_result(res, trace, [pa, pb])
        check_batches(rec, trace)
        assert np.all(res.latency_s >= rt - 1e-12)
        assert [d for d, _ in res.device_busy_s] == ["d0"]
        # each request passed through both operators, first through "first"
        assert res.stage_rows == ((len(trace),), (len(trace),))
        m1 = res.metrics(1, pb)
        assert m1.accuracy == pytest.approx(res.quality[1].mean())
    # the two operators draw sample rows with different seeds
    assert simulate_many([pa, pb], [CATALOG, CATALOG], Trace(np.arange(ROWS) * 0.1)) \
        .quality[0].mean() == CATALOG.accuracy(Cascade(("a",)))


@settings(max_examples=25, deadline=None)
@given(random_plans(), random_plans(), random_traces())
def test_simulate_many_property(p1: GearPlan, p2: GearPlan, trace: Trace) -> None:
    with recording() as rec:
        res = simulate_many([p1, p2], [CATALOG, CATALOG], trace)
    check_result(res, trace, [p1, p2])
    check_batches(rec, trace)
    # a request's latency covers at least one batch-1 run of each operator's first model
    lo = [min(CATALOG.perf[p.cascade_of(r).models[0]].batch_runtime(1, 2)
              for r in range(p.num_ranges)) for p in (p1, p2)]
    assert np.all(res.latency_s >= sum(lo) - 1e-12)


def test_per_range_metrics() -> None:
    # idle, then a burst, then idle: the load crosses range edges both ways
    rng = np.random.default_rng(0)
    parts = [np.sort(rng.uniform(0, 1.0, 10)), np.sort(rng.uniform(1.0, 1.5, 400)),
             np.sort(rng.uniform(1.5, 3.0, 15))]
    trace = Trace(np.concatenate(parts))
    plan = make_plan([("a", ("d0",)), ("b", ("d1",)), ("c", ("d2",))],
                     (Cascade(("a", "b", "c"), (0.6, 0.7)), Cascade(("a", "b"), (0.6,)),
                      Cascade(("a",))),
                     ranges=[(0, (1.0,) * 3, (1,) * 3), (1, (1.0,) * 3, (2, 2, 1)),
                             (2, (1.0, 0.0, 0.0), (4, 1, 1))],
                     edges=(0.0, 50.0, 400.0, 2000.0))
    res = simulate(plan, CATALOG, trace)
    check_result(res, trace, [plan])
    m = res.metrics(0, plan)
    assert len(m.per_range) >= 2
    assert sum(r.num_requests for r in m.per_range) == len(trace)
    for r in m.per_range:
        k = plan.qps_edges.index(r.lo_qps)
        assert r.hi_qps == plan.qps_edges[k + 1]
        assert r.num_requests == int((res.range_index[0] == k).sum())
    assert sum(r.accuracy * r.num_requests for r in m.per_range) / len(trace) == \
        pytest.approx(m.accuracy)
    assert m.gear_switches == len(res.gear_switches[0]) >= 2
    assert res.metrics().per_range == ()  # per-range figures need the plan


@settings(max_examples=15, deadline=None)
@given(random_plans(), random_traces(), st.integers(0, 50))
def test_deterministic_for_fixed_seed(plan: GearPlan, trace: Trace, seed: int) -> None:
    a = simulate(plan, CATALOG, trace, seed=seed)
    b = simulate(plan, CATALOG, trace, seed=seed)
    for field in ("completion_s", "quality", "stage", "range_index"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    assert a.stage_rows == b.stage_rows and a.gear_switches == b.gear_switches
    assert a.device_busy_s == b.device_busy_s and a.batches == b.batches
    assert a.metrics(0, plan) == b.metrics(0, plan)


def test_seed_changes_sample_order() -> None:
    plan = single("a")
    trace = Trace(np.arange(ROWS) * 0.1)
    a, b = simulate(plan, CATALOG, trace, seed=0), simulate(plan, CATALOG, trace, seed=1)
    assert not np.array_equal(a.quality, b.quality)
    assert a.quality.mean() == b.quality.mean()  # the same rows, in another order


def test_simulation_errors() -> None:
    trace = Trace([0.0, 0.1])
    cat = Catalog({"a": CATALOG.perf["a"]}, {"a": CATALOG.quality["a"]},
                  {"a": CATALOG.scores["a"]})
    with pytest.raises(SimulationError, match=r"places \['b'\], which have no profile"):
        simulate(single("b"), cat, trace)
    with pytest.raises(SimulationError, match="one catalog per plan"):
        simulate_many([single("a")], [], trace)
    with pytest.raises(SimulationError, match="one catalog per plan"):
        simulate_many([], [], trace)


def test_clock_never_runs_backwards() -> None:
    """Partial batches leave rows whose deadline may already have passed; the simulator must
    not move its virtual clock back to such a deadline."""
    plan = single("a", max_batch=4, max_wait_s=0.001)
    trace = poisson_trace(5000.0, 0.05, seed=0)
    with recording() as rec:
        simulate(plan, CATALOG, trace)
    assert all(t1 <= t2 for t1, t2 in itertools.pairwise(rec.times)), \
        next((t1, t2) for t1, t2 in itertools.pairwise(rec.times) if t1 > t2)


def test_metrics_of_a_single_request() -> None:
    res = simulate(single("a"), CATALOG, Trace([0.5]))
    m = res.metrics()
    assert m.num_requests == 1 and m.duration_s == pytest.approx(0.002)
    assert math.isclose(m.mean_ms, 2.0)


def test_runtime_spread_draws_one_factor_per_batch_from_the_distribution() -> None:
    from ken.engine.calibrate import calibrated, runtime_spread
    from ken.engine.supervision import BatchRecord

    rt = CATALOG.perf["b"].batch_runtime(1)
    # a serving log: batch-1 calls of b took 1x or 3x the profile, half each
    log = [BatchRecord("d0", "b", 1, 0.0, rt * (1 if i % 2 else 3), 0.0) for i in range(200)]
    spreads = runtime_spread(log, CATALOG, points=10)
    assert spreads["b"] == pytest.approx((1.0,) * 5 + (3.0,) * 5)
    cat = calibrated(CATALOG, spreads)
    assert cat.perf["a"].spread == () and cat.perf["b"].spread == spreads["b"]
    trace = Trace(np.arange(400) * rt * 5 + 0.25)  # low load: latency = the batch's runtime
    res = simulate(single("b", max_batch=1), cat, trace, seed=3)
    factors = np.round(res.latency_s / rt, 6)
    assert set(factors) <= {round(f, 6) for f in spreads["b"]}
    assert 0.4 < np.mean(factors > 2.0) < 0.6  # about the measured share of slow calls
    again = simulate(single("b", max_batch=1), cat, trace, seed=3)
    assert np.array_equal(again.latency_s, res.latency_s)  # deterministic for a seed
    plain = simulate(single("b", max_batch=1), CATALOG, trace, seed=3)
    assert np.max(np.abs(plain.latency_s - rt)) <= 1e-9  # no spread: exactly the profile
    with pytest.raises(ProfileError, match="spread"):
        ModelPerf("x", (1,), ((0.1,),), (1,), (1,), (0.0,))


# -- requests with their own route through the operators (multi-hop pipelines) ----------------


@settings(max_examples=25, deadline=None)
@given(random_plans(), random_plans(), random_plans(), random_traces(),
       st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True),
                min_size=1, max_size=6))
def test_simulate_many_routes_conserve_requests(p1: GearPlan, p2: GearPlan, p3: GearPlan,
                                                trace: Trace, routes: list[list[int]]) -> None:
    plans = [p1, p2, p3]
    rows = simulator.sample_rows(len(trace), len(routes), 3)
    res = simulate_many(plans, [CATALOG] * 3, trace, routes=routes, rows=rows)
    n = len(trace)
    assert np.all(np.isfinite(res.completion_s)) and np.all(res.completion_s >= res.arrival_s)
    for i, r in enumerate(rows):
        route = routes[r]
        done = res.resolved_s[:, i]
        # every operator on the route resolved the request once, in route order, and the
        # last one completed it; the others never saw it
        assert np.all(np.diff(done[route]) >= 0) and done[route[0]] >= res.arrival_s[i]
        assert done[route[-1]] == res.completion_s[i]
        for k in range(3):
            on_route = k in route
            assert np.isfinite(done[k]) == on_route
            assert (res.stage[k, i] >= 0) == on_route
            assert np.isnan(res.quality[k, i]) != on_route
    visits = [sum(k in routes[r] for r in rows) for k in range(3)]
    assert [s[0] if s else 0 for s in res.stage_rows] == visits
    assert sum(visits) == sum(len(routes[r]) for r in rows) and len(rows) == n


def test_simulate_many_routes_reject_bad_input() -> None:
    trace = Trace(np.arange(4) * 0.1)
    plans, cats = [single("a"), single("b")], [CATALOG, CATALOG]
    with pytest.raises(SimulationError, match="give routes with rows"):
        simulate_many(plans, cats, trace, routes=[(0,)])
    with pytest.raises(SimulationError, match="distinct plans"):
        simulate_many(plans, cats, trace, routes=[(0, 0)], rows=[0, 0, 0, 0])
    with pytest.raises(SimulationError, match="sample rows for 4"):
        simulate_many(plans, cats, trace, routes=[(0,)], rows=[0])
    with pytest.raises(SimulationError, match="beyond"):
        simulate_many(plans, cats, trace, routes=[(0,)] * 50, rows=[45] * 4)


@settings(max_examples=30, deadline=None)
@given(random_plans(), random_traces(), st.data())
def test_cache_hits_are_free_and_leave_the_other_requests_as_without_them(
        plan: GearPlan, trace: Trace, data: st.DataObject) -> None:
    n = len(trace)
    hits = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    rows = simulator.sample_rows(n, CATALOG.num_rows, 7)
    routes = [[0]] * CATALOG.num_rows
    res = simulate_many([plan], [CATALOG], trace, routes=routes, rows=rows, hits=hits)
    hit = np.asarray(hits, bool)
    # a hit is answered at arrival, on no device, by no stage
    assert np.all(res.latency_s[hit] == 0.0)
    assert np.all(res.stage[0, hit] == -1) and np.all(np.isnan(res.quality[0, hit]))
    # the rest are served exactly as if the hits had never arrived
    misses = ~hit
    if not misses.any():
        assert res.batches == 0 and sum(res.stage_rows[0]) == 0
        return
    alone = simulate_many([plan], [CATALOG], Trace(trace.arrival_s[misses]),
                          routes=routes, rows=rows[misses])
    assert np.array_equal(res.completion_s[misses], alone.completion_s)
    assert np.array_equal(res.stage[0, misses], alone.stage[0])
    assert res.device_busy_s == alone.device_busy_s and res.batches == alone.batches
    with pytest.raises(SimulationError, match="flags"):
        simulate_many([plan], [CATALOG], trace, hits=hits + [True])
