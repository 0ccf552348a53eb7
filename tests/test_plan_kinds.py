"""One plan interface and one target vocabulary for classifier and generating operators."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import ken
from ken.errors import PlanError, QueryPlanError
from ken.models.cascade import Cascade
from ken.optimizer.query import Target
from ken.policy.plan import GearPlan, GenGear, GenPlan, Plan, RangeSchedule, Replica

PAIR = Cascade(("s", "l"), (0.5,))


def gear_plan() -> GearPlan:
    return GearPlan("sentiment", (0.0, 10.0, 20.0), (PAIR, Cascade(("s",))),
                    (Replica("s", ("cpu0",)), Replica("l", ("cpu1",))),
                    (RangeSchedule(0, (1.0, 1.0), (1, 1)), RangeSchedule(1, (1.0, 0.0), (2, 1))),
                    (8, 8))


def gen_plan() -> GenPlan:
    return GenPlan("sem_qa", (GenGear(PAIR, 4), GenGear(Cascade(("s",)))), max_running=4)


@pytest.mark.parametrize("make", [gear_plan, gen_plan])
def test_every_kind_round_trips_through_one_load(make, tmp_path: Path) -> None:
    plan = make()
    path = plan.save(tmp_path / "plan.json")
    assert json.loads(path.read_text())["kind"] == plan.kind
    assert Plan.load(path) == plan == ken.Plan.from_json(plan.to_json())
    assert type(plan).load(path) == plan
    assert plan.models == ("s", "l")
    assert all(isinstance(line, str) for line in plan.describe())


def test_a_file_of_the_other_kind_says_what_it_holds(tmp_path: Path) -> None:
    path = gen_plan().save(tmp_path / "gen.json")
    with pytest.raises(PlanError, match="generation plan, not a gear plan.*Plan.load"):
        GearPlan.load(path)
    with pytest.raises(PlanError, match="gear plan, not a generation plan"):
        GenPlan.from_json(gear_plan().to_json())
    bad = json.loads(gen_plan().to_json()) | {"kind": "mystery"}
    with pytest.raises(PlanError, match="unknown plan kind 'mystery'"):
        Plan.from_dict(bad)
    with pytest.raises(PlanError, match="neither the QPS edges of a gear plan nor the gears"):
        GearPlan.from_dict({"schema_version": 1, "operator": "sentiment"})  # truncated
    nameless = {k: v for k, v in gen_plan().to_dict().items() if k not in ("kind", "operator")}
    with pytest.raises(PlanError, match="malformed generation plan"):
        Plan.from_dict(nameless)


def test_files_written_before_the_kind_field_still_load() -> None:
    old_gear = {k: v for k, v in gear_plan().to_dict().items() if k != "kind"}
    assert Plan.from_dict(old_gear) == gear_plan()
    old_gen = {"schema_version": 1, "function": "sem_qa", "max_running": 4,
               "kv_budget_tokens": None, "hysteresis": 0.5, "mode": "continuous",
               "gears": [{"cascade": json.loads(PAIR.to_json()), "max_load": 4},
                         {"cascade": json.loads(Cascade(("s",)).to_json()), "max_load": None}]}
    assert Plan.from_dict(old_gen) == gen_plan()
    with pytest.raises(PlanError, match="schema version"):
        Plan.from_dict(old_gen | {"schema_version": 7})


def test_generation_plans_describe_like_gear_plans() -> None:
    lines = gen_plan().describe()
    assert lines[:2] == ["load [0, 4): s -(0.500)-> l", "load [4, inf): s"]
    assert "decode server" in lines[2] and "4 rows" in lines[2]
    assert gen_plan().latency_target_s() is None
    assert math.isinf(gen_plan().gears[-1].max_load)


@pytest.mark.parametrize(("text", "target"), [
    ("accuracy >= 0.75", Target(min_accuracy=0.75)),
    ("quality >= 80%", Target(min_accuracy=0.8)),
    ("f1 >= 25", Target(min_accuracy=0.25)),
    ("p95 <= 50", Target(max_p95_ms=50)),
    ("p95 <= 200ms", Target(max_p95_ms=200)),
    ("p95 <= 0.2 s", Target(max_p95_ms=200)),
    ("ttft_p95 <= 2s", Target(max_ttft_p95_ms=2000)),
    ("TGT_P95 <= 15s", Target(max_tgt_p95_ms=15000)),
])
def test_one_target_vocabulary(text: str, target: Target) -> None:
    assert Target.parse(text) == target


def test_targets_say_what_is_wrong() -> None:
    for bad in ("p99 <= 3", "latency <= 2", "p95 <= fast", "accuracy <= 0.7"):
        with pytest.raises(QueryPlanError, match="cannot read target"):
            Target.parse(bad)
    with pytest.raises(QueryPlanError, match="exactly one"):
        Target(min_accuracy=0.7, max_ttft_p95_ms=10)
    with pytest.raises(QueryPlanError, match="> 0"):
        Target(max_tgt_p95_ms=0)
    assert Target.parse("ttft_p95 <= 2s").latency == "ttft_p95"
    assert Target.parse("tgt_p95 <= 2s").max_latency_ms == 2000
    with pytest.raises(QueryPlanError, match="generating functions"):
        Target.parse("ttft_p95 <= 2s").for_classifiers()


def _choice(quality: float, tgt_p95_ms: float, ttft_p95_ms: float, gears: int = 1):  # noqa: ANN202
    from ken.optimizer.gen_planner import GenChoice
    from ken.policy.metrics import PlanMetrics

    plan = GenPlan("sem_qa", (*(GenGear(PAIR, 2 ** k) for k in range(1, gears)),
                              GenGear(Cascade(("s",)))))
    m = PlanMetrics(quality, tgt_p95_ms / 2, tgt_p95_ms, tgt_p95_ms * 1.2, tgt_p95_ms / 2, 100,
                    0, 60.0, ttft_p95_ms=ttft_p95_ms)
    return GenChoice(plan, m)


def test_generation_plans_are_chosen_by_the_same_targets() -> None:
    from ken.errors import PlanningError
    from ken.optimizer.gen_planner import choose

    slow_good, fast_poor, mid = _choice(0.6, 20_000, 900), _choice(0.4, 5_000, 300), \
        _choice(0.5, 9_000, 2_500, gears=2)
    tried = [slow_good, fast_poor, mid]
    assert choose("sem_qa", tried, Target.parse("tgt_p95 <= 10s")) is mid
    assert choose("sem_qa", tried, Target.parse("p95 <= 10s")) is mid  # p95 of a request: TGT
    assert choose("sem_qa", tried, Target.parse("ttft_p95 <= 1s")) is slow_good
    assert choose("sem_qa", tried, Target.parse("quality >= 0.45")) is mid  # fastest that reaches
    with pytest.raises(PlanningError, match=r"fastest simulated has 5\.0 s \(load"):
        choose("sem_qa", tried, Target.parse("tgt_p95 <= 1s"))
    with pytest.raises(PlanningError, match="most accurate simulated reaches 60.0%"):
        choose("sem_qa", tried, Target.parse("accuracy >= 0.9"))


def test_a_generation_plan_keeps_its_prediction(tmp_path: Path) -> None:
    plan = _choice(0.5, 9_000, 2_500).plan
    predicted = _choice(0.5, 9_000, 2_500).metrics
    from dataclasses import replace

    planned = replace(plan, predicted=predicted)
    assert Plan.load(planned.save(tmp_path / "p.json")) == planned
    assert planned.describe()[0].startswith("predicted: quality 50.0%, TTFT p95 2.50 s, TGT")
    assert planned.latency_target_s() == pytest.approx(10.8)


def test_ken_plan_plans_a_generating_function_by_its_kind(tmp_path: Path, monkeypatch,
                                                           capsys) -> None:
    from ken.cli import main

    asked = []

    def fake_plan_generating(op, ctx, target, qps, rows, seed=0):  # noqa: ANN001, ANN202
        asked.append((op.name, target, qps, rows))
        return _choice(0.5, 9_000, 2_500, gears=2)

    monkeypatch.setattr("ken.cli.plan.plan_generating", fake_plan_generating)
    assert main(["plan", "--function", "sem_qa", "--qps", "0.3", "--rows", "8",
                 "--target", "ttft_p95 <= 3s", "--out", str(tmp_path)]) == 0
    assert asked == [("sem_qa", Target(max_ttft_p95_ms=3000), 0.3, 8)]
    written = Plan.load(tmp_path / "plan-sem_qa.json")
    assert written == _choice(0.5, 9_000, 2_500, gears=2).plan
    out = capsys.readouterr().out
    assert "sem_qa generation plan (for target ttft_p95 <= 3s, 0.3 requests/s)" in out
    assert "load [0, 2): s -(0.500)-> l" in out


def test_ken_plan_says_what_a_plan_of_each_kind_needs(capsys) -> None:
    from ken.cli import main

    assert main(["plan", "--function", "sem_qa"]) == 2
    assert "needs --qps" in capsys.readouterr().err
    assert main(["plan", "--target", "ttft_p95 <= 2s"]) == 2
    assert "latency of generating functions" in " ".join(capsys.readouterr().err.split())


def test_planning_a_generating_function_needs_its_request_rate_before_any_work() -> None:
    from ken.errors import KenError
    from ken.ops import builtin_operators
    from ken.ops.base import OpContext
    from ken.optimizer.planning import plan_functions

    ops = builtin_operators()
    if not ops["sem_qa"].plannable():
        pytest.skip(f"sem_qa has no evaluation sample here ({ops['sem_qa'].eval_description()})")
    for qps in (None, 0.0):
        with pytest.raises(KenError, match="needs the mean rate of its requests"):
            plan_functions(ops, OpContext(), ["sem_qa"], Target.parse("tgt_p95 <= 9s"), qps=qps)
    with pytest.raises(KenError, match="Azure trace or a Trace"):
        plan_functions(ops, OpContext(), ["sem_qa"], Target.parse("tgt_p95 <= 9s"),
                       trace="gamma", qps=1.0)
