"""Gear plans and frontiers: JSON round trips, validation, picking a plan, gears, describe()."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from typing import Any

import pytest

from ken.errors import KenError
from ken.models.cascade import Cascade
from ken.policy.metrics import PlanMetrics, RangeMetrics
from ken.policy.plan import (
    PLAN_SCHEMA_VERSION,
    Frontier,
    GearPlan,
    PlanError,
    RangeSchedule,
    Replica,
)

CHEAP = Cascade(("a",))
TWO_STAGE = Cascade(("a", "b"), (0.8,))


def _metrics(accuracy: float, p95_ms: float, edges: tuple[float, ...] = ()) -> PlanMetrics:
    per_range = tuple(RangeMetrics(lo, hi, 10 + i, accuracy - 0.01 * i, p95_ms / 2, p95_ms,
                                   p95_ms * 1.5)
                      for i, (lo, hi) in enumerate(itertools.pairwise(edges)))
    return PlanMetrics(accuracy=accuracy, p50_ms=p95_ms / 2, p95_ms=p95_ms, p99_ms=p95_ms * 1.5,
                       mean_ms=p95_ms * 0.6, num_requests=sum(r.num_requests for r in per_range),
                       gear_switches=3, duration_s=12.5,
                       utilisation=(("cpu0", 0.5), ("cpu1", 0.25), ("cpu2", 0.125)),
                       per_range=per_range)


def make_plan(operator: str = "sentiment", predicted: PlanMetrics | None = None,
              **changes: Any) -> GearPlan:
    """2 cascades, 3 replicas (one tensor-parallel over 2 devices), 4 QPS ranges."""
    edges = (0.0, 10.0, 20.0, 30.0, 40.0)
    placement = (Replica("a", ("cpu0",)), Replica("a", ("cpu1",)), Replica("b", ("cpu1", "cpu2")))
    ranges = (RangeSchedule(1, (0.5, 0.5, 1.0), (1, 1, 1)),
              RangeSchedule(1, (0.25, 0.75, 1.0), (1, 2, 4)),
              RangeSchedule(0, (0.5, 0.5, 0.0), (4, 4, 1)),
              RangeSchedule(0, (0.5, 0.5, 0.0), (8, 8, 1), feasible=False))
    kwargs: dict[str, Any] = dict(
        operator=operator, qps_edges=edges, cascades=(CHEAP, TWO_STAGE), placement=placement,
        ranges=ranges, max_batch=(8, 16, 32), max_wait_s=0.02, alpha=4.0, rate_window_s=0.25,
        predicted=predicted if predicted is not None else _metrics(0.9, 40.0, edges),
        provenance=(("planner", "test"), ("catalog", "synthetic")))
    kwargs.update(changes)
    return GearPlan(**kwargs)


def make_frontier() -> Frontier:
    base = make_plan()
    plans = (base.with_predicted(_metrics(0.80, 10.0, base.qps_edges)),
             base.with_predicted(_metrics(0.85, 20.0, base.qps_edges)),
             base.with_predicted(_metrics(0.92, 35.0, base.qps_edges)))
    return Frontier("sentiment", plans, provenance=(("seed", "0"),))


# -- JSON -------------------------------------------------------------------------------------


def test_gear_plan_json_round_trip() -> None:
    plan = make_plan()
    assert len(plan.predicted.per_range) == 4  # type: ignore[union-attr]
    again = GearPlan.from_json(plan.to_json())
    assert again == plan
    assert again.placement[2].devices == ("cpu1", "cpu2") and again.placement[2].degree == 2
    assert again.predicted == plan.predicted
    assert again.predicted.per_range == plan.predicted.per_range  # type: ignore[union-attr]
    assert dict(again.provenance) == dict(plan.provenance)
    # a second round trip reproduces the JSON text exactly (loading sorts the provenance)
    assert GearPlan.from_json(again.to_json()).to_json() == again.to_json()


def test_plans_that_serve_alike_whatever_they_predicted() -> None:
    """Two planning paths can reach one plan with different predictions (the demo's static
    cascade and ken's one-gear plan of it): they serve alike; another trigger does not."""
    a = make_plan(predicted=_metrics(0.8, 100.0))
    b = replace(make_plan(predicted=_metrics(0.79, 120.0)), provenance=(("from", "elsewhere"),))
    assert a.to_json() != b.to_json() and a.serves_like(b) and b.serves_like(a)
    assert not a.serves_like(replace(a, max_wait_s=a.max_wait_s * 2))


def test_gear_plan_round_trip_without_prediction() -> None:
    plan = make_plan().with_predicted(None)  # type: ignore[arg-type]
    again = GearPlan.from_json(plan.to_json())
    assert again == plan and again.predicted is None


def test_frontier_json_round_trip_and_files(tmp_path) -> None:
    frontier = make_frontier()
    again = Frontier.from_json(frontier.to_json())
    assert again == frontier
    assert dict(again.provenance) == {"seed": "0"}
    path = frontier.save(tmp_path / "sub" / "frontier.json")
    assert path.is_file()
    loaded = Frontier.load(path)
    assert loaded == frontier and len(loaded) == 3
    assert loaded.points() == frontier.points()


def test_frontier_load_errors(tmp_path) -> None:
    with pytest.raises(PlanError, match="no frontier file"):
        Frontier.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not a frontier JSON"):
        Frontier.load(bad)


def test_wrong_schema_version() -> None:
    data = make_plan().to_dict()
    data["schema_version"] = PLAN_SCHEMA_VERSION + 1
    with pytest.raises(PlanError, match="schema version") as err:
        GearPlan.from_dict(data)
    assert "re-run `ken plan`" in str(err.value)
    frontier = json.loads(make_frontier().to_json())
    frontier["schema_version"] = 0
    with pytest.raises(PlanError, match="unsupported frontier schema version 0"):
        Frontier.from_json(json.dumps(frontier))
    del frontier["schema_version"]
    with pytest.raises(PlanError, match="schema version None"):
        Frontier.from_json(json.dumps(frontier))


def test_malformed_plan_json_is_a_plan_error() -> None:
    data = make_plan().to_dict()
    del data["max_batch"]
    with pytest.raises(PlanError, match="malformed gear plan JSON.*max_batch"):
        GearPlan.from_dict(data)
    data = make_plan().to_dict()
    data["ranges"][0]["shares"] = None
    with pytest.raises(PlanError, match="malformed"):
        GearPlan.from_dict(data)
    assert issubclass(PlanError, KenError)


# -- validation -------------------------------------------------------------------------------


def test_edges_must_start_at_zero_and_increase() -> None:
    with pytest.raises(PlanError, match=r"QPS edges must start at 0.*\(5\.0, 10\.0"):
        make_plan(qps_edges=(5.0, 10.0, 20.0, 30.0, 40.0))
    with pytest.raises(PlanError, match="start at 0 and increase"):
        make_plan(qps_edges=(0.0, 10.0, 10.0, 30.0, 40.0))
    with pytest.raises(PlanError, match="start at 0 and increase"):
        make_plan(qps_edges=(0.0,), ranges=())


def test_range_count_mismatch() -> None:
    plan = make_plan()
    with pytest.raises(PlanError, match="'sentiment'.*4 QPS ranges but 3 range schedules"):
        make_plan(ranges=plan.ranges[:3])


def test_range_using_a_model_without_replica() -> None:
    placement = (Replica("a", ("cpu0",)), Replica("a", ("cpu1",)), Replica("c", ("cpu2",)))
    with pytest.raises(PlanError, match=r"range 0 uses \['b'\] with no replica"):
        make_plan(placement=placement)


def test_mixed_certainty_kinds() -> None:
    with pytest.raises(PlanError, match="one certainty function.*margin.*max_prob"):
        make_plan(cascades=(Cascade(("a",), certainty="margin"), TWO_STAGE))


def test_other_validation_errors() -> None:
    plan = make_plan()
    with pytest.raises(PlanError, match="range 0 names cascade 5"):
        make_plan(ranges=(replace(plan.ranges[0], cascade=5), *plan.ranges[1:]))
    with pytest.raises(PlanError, match="range 1 has 2 shares for 3 replicas"):
        make_plan(ranges=(plan.ranges[0], RangeSchedule(0, (1.0, 0.0), (1, 1)),
                          *plan.ranges[2:]))
    with pytest.raises(PlanError, match="max batch"):
        make_plan(max_batch=(8, 16))
    with pytest.raises(PlanError, match="max batch"):
        make_plan(max_batch=(8, 0, 1))
    with pytest.raises(PlanError, match="no cascades"):
        make_plan(cascades=())
    with pytest.raises(PlanError, match="must be finite and > 0"):
        make_plan(max_wait_s=0.0)
    with pytest.raises(PlanError, match="distinct devices"):
        Replica("a", ("cpu0", "cpu0"))
    with pytest.raises(PlanError, match="distinct devices"):
        Replica("a", ())
    with pytest.raises(PlanError, match="one share and one queue length"):
        RangeSchedule(0, (1.0,), (1, 1))
    with pytest.raises(PlanError, match=">= 1"):
        RangeSchedule(0, (1.0,), (0,))
    with pytest.raises(PlanError, match="shares finite and >= 0"):
        RangeSchedule(0, (-0.5,), (1,))


def test_frontier_validation() -> None:
    frontier = make_frontier()
    with pytest.raises(PlanError, match="empty"):
        Frontier("sentiment", ())
    with pytest.raises(PlanError, match="sorted by predicted p95"):
        Frontier("sentiment", frontier.plans[::-1])
    with pytest.raises(PlanError, match="predicted metrics"):
        Frontier("sentiment", (make_plan().with_predicted(None),))  # type: ignore[arg-type]


# -- lookups ----------------------------------------------------------------------------------


def test_lookups() -> None:
    plan = make_plan()
    assert plan.qps_max == 40.0 and plan.num_ranges == 4
    assert plan.certainty == "max_prob"
    assert plan.cascade_of(0) == TWO_STAGE and plan.cascade_of(3) == CHEAP
    assert plan.replicas_of("a") == [0, 1] and plan.replicas_of("b") == [2]
    assert plan.replicas_of("zzz") == []
    assert plan.devices == ("cpu0", "cpu1", "cpu2")
    assert not plan.feasible
    assert replace(plan, ranges=plan.ranges[:3] + (replace(plan.ranges[3], feasible=True),)
                   ).feasible


def test_pick() -> None:
    frontier = make_frontier()
    p95 = [p.predicted.p95_ms for p in frontier.plans]  # type: ignore[union-attr]
    assert p95 == [10.0, 20.0, 35.0]
    assert frontier.pick(min_accuracy=0.84) is frontier.plans[1]  # fastest with >= 0.84
    assert frontier.pick(min_accuracy=0.80) is frontier.plans[0]
    assert frontier.pick(min_accuracy=0.92) is frontier.plans[2]
    assert frontier.pick(max_p95_ms=25.0) is frontier.plans[1]  # most accurate within 25 ms
    assert frontier.pick(max_p95_ms=35.0) is frontier.plans[2]
    assert frontier.pick(max_p95_ms=10.0) is frontier.plans[0]
    with pytest.raises(PlanError, match=r"no plan reaches accuracy 95\.0%.*reaches 92\.0%"):
        frontier.pick(min_accuracy=0.95)
    with pytest.raises(PlanError, match=r"no plan has p95 <= 5 ms.*fastest.*10\.0 ms"):
        frontier.pick(max_p95_ms=5.0)
    with pytest.raises(PlanError, match="exactly one target"):
        frontier.pick()
    with pytest.raises(PlanError, match="exactly one target"):
        frontier.pick(min_accuracy=0.5, max_p95_ms=100.0)


def test_pick_ties_prefer_faster_plan() -> None:
    base = make_plan()
    plans = (base.with_predicted(_metrics(0.9, 10.0)), base.with_predicted(_metrics(0.9, 20.0)))
    frontier = Frontier("x", plans)
    assert frontier.pick(max_p95_ms=30.0) is plans[0]
    assert frontier.pick(min_accuracy=0.9) is plans[0]


def test_gears_merge_consecutive_equal_cascades() -> None:
    plan = make_plan()
    assert plan.gears() == [(0.0, 20.0, 1), (20.0, 40.0, 0)]
    # equal cascades that are not consecutive stay separate gears
    alternating = make_plan(ranges=tuple(replace(r, cascade=c)
                                         for r, c in zip(plan.ranges, (1, 0, 1, 1), strict=True)))
    assert alternating.gears() == [(0.0, 10.0, 1), (10.0, 20.0, 0), (20.0, 40.0, 1)]
    single = make_plan(ranges=tuple(replace(r, cascade=0) for r in plan.ranges))
    assert single.gears() == [(0.0, 40.0, 0)]


def test_describe() -> None:
    plan = make_plan()
    lines = plan.describe()
    text = "\n".join(lines)
    assert lines[0].startswith("predicted: accuracy 90.0%")
    assert "0-20 qps: a -(0.800)-> b" in lines
    assert "20-40 qps: a" in lines
    assert "placement: a@cpu0, a@cpu1, b@cpu1+cpu2" in lines
    # triggers only list used replicas with a queue length above 1
    assert "max wait 20 ms" in text
    assert "10-20 qps: a@cpu0 q>=1" not in text
    assert "10-20 qps: a@cpu1 q>=2, b@cpu1+cpu2 q>=4" in text
    assert "30-40 qps: a@cpu0 q>=8, a@cpu1 q>=8" in text
    assert "b@cpu1+cpu2 q>=1" not in text
    assert lines[-1].startswith("overloaded at: 30-40 qps")
    quiet = make_plan(ranges=tuple(replace(r, min_queue=(1, 1, 1), feasible=True)
                                   for r in plan.ranges)).with_predicted(None)  # type: ignore
    quiet_lines = quiet.describe()
    assert not quiet_lines[0].startswith("predicted")
    assert quiet_lines[-1] == "batch triggers (max wait 20 ms): queue >= 1 everywhere"


# -- gaps found by these tests, now fixed -------------------------------------------------------


def test_loading_a_gear_plan_file_as_a_frontier_is_a_plan_error(tmp_path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(make_plan().to_json())  # a gear plan, not a frontier
    with pytest.raises(PlanError):
        Frontier.load(path)


def test_json_that_is_not_an_object_is_a_plan_error() -> None:
    with pytest.raises(PlanError):
        Frontier.from_json("[]")


def test_nan_qps_edge_is_rejected() -> None:
    with pytest.raises(PlanError, match="QPS edges"):
        make_plan(qps_edges=(0.0, 10.0, 20.0, 30.0, float("nan")))


@pytest.mark.parametrize("max_wait_s", [float("inf"), float("nan")])
def test_non_finite_max_wait_is_rejected(max_wait_s: float) -> None:
    with pytest.raises(PlanError, match="max_wait_s"):
        make_plan(max_wait_s=max_wait_s)


def test_nan_share_is_rejected() -> None:
    with pytest.raises(PlanError, match="shares"):
        RangeSchedule(0, (float("nan"), 1.0), (1, 1))
