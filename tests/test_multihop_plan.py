"""Planning the MultiModalQA pipeline as a whole (``ken.multihop_plan``) on the hand-made
fixture with stand-in models: every LM assignment is answered, the catalogs and the
end-to-end quality table agree with those answers, and a simulated stream scores each
question by the LMs that resolved its hops."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_multihop import GoldType, Overlap, Reader

import ken
from ken import multihop_plan
from ken.engine.supervision import BatchRecord
from ken.models.cascade import Cascade
from ken.models.model import Output
from ken.models.qa_data import read_mmqa
from ken.multihop import READERS, route_of, run_pipeline
from ken.multihop_plan import (
    LLMS,
    OPERATORS,
    READING,
    Outcomes,
    PipelinePlanner,
    densest,
    load_or_measure,
    model_name,
    pipeline_inputs,
    run_planned,
)
from ken.optimizer.planner import PlannerSettings, plan_frontier
from ken.optimizer.query import Target, evaluate_pipeline
from ken.optimizer.simulator import sample_rows
from ken.optimizer.workload import Hardware, poisson_trace

FIXTURES = Path(__file__).parent / "fixtures"
LMS = LLMS  # the stand-ins: the first is weak, the last strong
WEAK, STRONG = LMS[0], LMS[-1]
WW, WS, SW, SS = (f"{a},{b}" for a in (WEAK, STRONG) for b in (WEAK, STRONG))


def weakened(out: Output) -> Output:
    """A reader's answers as the weak LM gives them: only "Turin" (where someone was born)
    is kept, and it is unsure of everything."""
    values = [v if v == "Turin" else "no idea" for v in out.values]
    return Output(values, np.full(len(values), 0.2))


class Weak(Reader):
    """Answers only questions about where someone was born, and is unsure of everything."""

    def predict(self, texts: Sequence, batch_size: int = 32) -> Output:
        return weakened(super().predict(texts, batch_size))


@pytest.fixture
def measured(tmp_path):  # noqa: ANN001
    data = read_mmqa(FIXTURES / "mmqa")
    routes = {q.question: route_of(q.qtype) for q in data.questions}
    stages = {LMS[0]: Weak(), LMS[-1]: Reader()}
    with ken.connect(home=tmp_path / "home") as s:
        s.register("sem_similarity", Overlap(), output_type="double")
        table_qa = s.operators["sem_qa"].renamed(READERS["table"])
        s.operators[READERS["table"]] = table_qa
        outcomes = load_or_measure(
            s, data, tmp_path / "cache", LMS,
            measure_options={"stage": lambda lm, _resources: stages[lm],
                             "type_model": GoldType(routes)})
        # the memoising stand-ins are gone: the session's operators are as they were (a
        # stand-in left behind made the serving that follows fall back to threads and fail)
        assert READERS["text"] not in s.operators
        assert s.operators[READERS["table"]] is table_qa
    with ken.connect(home=tmp_path / "home") as s:  # the same questions, one plain run
        s.register("sem_similarity", Overlap(), output_type="double")
        s.register("sem_qa", Reader())
        plain = run_pipeline(s, data, type_model=GoldType(routes))
    return data, outcomes, plain, tmp_path


def test_every_assignment_is_answered_and_cached(measured) -> None:  # noqa: ANN001
    data, outcomes, plain, tmp_path = measured
    ok = [a for a in plain.answers if a.status == "ok"]
    assert outcomes.qids == tuple(a.qid for a in ok)
    assert outcomes.routes == tuple(a.route for a in ok)
    assert set(outcomes.runs) == {f"{a},{b}" for a in LMS for b in LMS}
    strong = outcomes.runs[SS]
    assert [r[0] for r in strong] == [a.f1 for a in ok]
    assert [r[2] for r in strong] == [a.predicted for a in ok]
    weak = outcomes.runs[WW]
    assert [r[0] for r in weak] == [1.0 if a.predicted == "Turin" else 0.0 for a in ok]
    # a table-only question does not care which LM reads text, and the reverse
    for i, route in enumerate(outcomes.routes):
        if route == "TableQ":
            assert outcomes.runs[WS][i][0] == strong[i][0]
        if route == "TextQ":
            assert outcomes.runs[SW][i][0] == strong[i][0]
            assert set(strong[i][3]) == {READERS["text"]}
    assert outcomes.perf[model_name("text_qa", WEAK)]["runtime_s"][0][0] > 0
    # cached: a second call reads the file (the stand-ins are not needed)
    again = load_or_measure(None, data, tmp_path / "cache", LMS)  # type: ignore[arg-type]
    assert again == Outcomes.from_json(outcomes.to_json())


def test_a_simulated_stream_scores_questions_by_the_lms_that_answered(measured) -> None:  # noqa: ANN001
    _data, outcomes, _plain, _tmp = measured
    catalogs, sample = pipeline_inputs(outcomes)
    assert sample.operators == OPERATORS
    n = len(outcomes.qids)
    for op in OPERATORS[1:]:
        strong = catalogs[op].quality[model_name(op, STRONG)]
        assert strong.tolist() == [r[0] for r in outcomes.runs[SS]]
    hardware = Hardware.cpu_workers(2, 2**30)
    trace = poisson_trace(20.0, 2.0, seed=1)
    # each operator served by the one model named (no single-model alternatives beside it)
    settings = PlannerSettings(num_ranges=1, max_rounds=1, include_static=False)

    def plans(lm_text: str, lm_table: str) -> list:
        out = []
        for op, lm in zip(OPERATORS, ("", lm_text, lm_table), strict=True):
            name = "question_type" if op == "question_type" else model_name(op, lm)
            out.append(plan_frontier(op, [Cascade((name,))], catalogs[op], hardware, trace,
                                     settings=settings)[0].plans[-1])
        return out

    rows = sample_rows(len(trace), n, 7)
    cats = [catalogs[op] for op in OPERATORS]
    for text_lm, table_lm in ((STRONG, STRONG), (WEAK, STRONG), (WEAK, WEAK)):
        point = evaluate_pipeline(plans(text_lm, table_lm), cats, trace, sample, seed=7)
        f1 = [r[0] for r in outcomes.runs[f"{text_lm},{table_lm}"]]
        assert point.quality == pytest.approx(np.mean([f1[q] for q in rows]))
        visits = [sum(k in sample.routes[q] for q in rows) for k in range(3)]
        assert visits[0] == len(trace)  # every question is typed
        assert [p > 0 for p in point.operator_p95_ms] == [v > 0 for v in visits]


class Named(Reader):
    def __init__(self, name: str, weak: bool) -> None:
        super().__init__()
        self.spec = replace(self.spec, name=name, fingerprint=name)
        self.weak = weak

    def predict(self, texts: Sequence, batch_size: int = 32) -> Output:
        out = super().predict(texts, batch_size)
        return weakened(out) if self.weak else out


def served_run(data, tmp_path: Path, **options: float):  # noqa: ANN001, ANN201
    """``run_planned`` on the fixture with the named stand-in LMs on thread workers; every
    engine it started (the calibration's, the stream's) is stopped when it returns."""
    routes = {q.question: route_of(q.qtype) for q in data.questions}
    with ken.connect(home=tmp_path / "home") as s:
        s.register("sem_similarity", Overlap(), output_type="double")
        for op in (READERS["text"], READERS["table"]):
            names = [model_name(op, lm) for lm in LLMS]
            s.register(op, Cascade(tuple(names), (0.5,)),
                       models={n: Named(n, weak=i == 0) for i, n in enumerate(names)})
        run = run_planned(s, data, Target(min_accuracy=0.0), folder=tmp_path / "cache",
                          workers="thread", type_model=GoldType(routes),
                          trace=poisson_trace(4.0, 3.0, seed=2), **options)
        assert not s.engines
    return run


def test_planned_stream_is_served_with_the_chosen_gear_plans(measured) -> None:  # noqa: ANN001
    data, outcomes, _plain, tmp_path = measured
    run = served_run(data, tmp_path, stream=5)
    assert run.explain.count("gear plan") >= 2  # EXPLAIN shows each reading operator's plan
    chosen = {p.operator: p for p in run.plan.plans}
    assert set(chosen) == set(OPERATORS)
    assert len(run.report.answers) == len(run.arrival_s) == 5
    by_qid = dict(zip(outcomes.qids, range(len(outcomes.qids)), strict=True))
    for a in run.report.answers:
        # each served answer is one the LMs gave for that question when measured
        i = by_qid[a.qid]
        assert a.predicted in {rows[i][2] for rows in outcomes.runs.values()}
        assert a.latency_s >= 0
    assert 0.0 <= run.predicted.quality <= 1.0
    assert run.calibration == {}  # not asked for


def test_a_calibration_stream_plans_again_on_the_served_runtimes(measured, monkeypatch
                                                                 ) -> None:  # noqa: ANN001
    data, _outcomes, _plain, tmp_path = measured
    monkeypatch.setattr(multihop_plan, "CALIBRATION_MAX_QUESTIONS", 30)  # the stand-ins' rate
    choices = []
    choose = PipelinePlanner.choose

    def counted(self, target, *args, **kwargs):  # noqa: ANN001, ANN202
        choices.append({op: dict(c.perf) for op, c in self.catalogs.items()})
        return choose(self, target, *args, **kwargs)

    monkeypatch.setattr(PipelinePlanner, "choose", counted)
    run = served_run(data, tmp_path, stream=3, calibration_s=1.0)
    assert run.calibration  # the served LMs got a fit (the stand-ins: far off their timing)
    for op, cal in run.calibration.items():
        assert op in READING
        assert set(cal.fits) <= {model_name(op, lm) for lm in LLMS}
    # chosen twice: on the runtimes measured alone, then on the fitted ones
    assert len(choices) == 2
    for op, cal in run.calibration.items():
        for m in cal.fits:
            assert choices[1][op][m] != choices[0][op][m]
    assert len(run.report.answers) == 3
    with pytest.raises(ken.KenError, match="calibration seconds"):
        run_planned(None, data, Target(min_accuracy=0.0), calibration_s=-1)  # type: ignore[arg-type]


def test_densest_arrivals_match_brute_force() -> None:
    rng = np.random.default_rng(3)
    arrivals = np.sort(rng.exponential(1.0, 40).cumsum())
    for count in (1, 5, 17, 40, 60):
        start, part = densest(arrivals, count)
        k = min(count, len(arrivals))
        spans = [arrivals[i + k - 1] - arrivals[i] for i in range(len(arrivals) - k + 1)]
        assert start == int(np.argmin(spans)) and len(part) == k
        assert part[0] == 0.0 and part[-1] == pytest.approx(min(spans))


def test_calibrating_on_served_calls_scales_the_lms_that_were_served(measured) -> None:  # noqa: ANN001
    """``PipelinePlanner.calibrate``: an LM whose served calls took twice its measured runtime
    is planned at twice it from then on; an LM with too few calls, and a model no operator
    has, change nothing."""
    _data, outcomes, _plain, _tmp = measured
    planner = PipelinePlanner(outcomes, 2, 1.0, 60.0, 1.0, trace=poisson_trace(2.0, 20.0, seed=3))
    text, table = READING
    slow, few = model_name(text, STRONG), model_name(table, WEAK)
    before = {op: planner.catalogs[op] for op in OPERATORS}
    planned = planner.static(text, Cascade((slow,))).predicted.p95_ms  # cached per cascade
    one = before[text].perf[slow].batch_runtime(1)
    log = [BatchRecord("cpu0", slow, 1, 10.0 * i, 10.0 * i + 2 * one, 0.0) for i in range(12)]
    log += [BatchRecord("cpu1", few, 1, 10.0 * i, 10.0 * i + 5.0, 0.0) for i in range(3)]
    log += [BatchRecord("cpu1", "question_type", 1, 0.0, 1.0, 0.0)]
    fitted = planner.calibrate(log, min_calls=5)
    assert set(fitted) == {text}
    after = planner.catalogs[text].perf[slow]
    for b in after.batch_sizes:
        assert after.batch_runtime(b) == pytest.approx(2 * before[text].perf[slow].batch_runtime(b))
    assert planner.catalogs[table] is before[table]
    assert planner.catalogs["question_type"] is before["question_type"]
    # the static plans cached before are planned again, on the slower runtimes
    assert planner.static(text, Cascade((slow,))).predicted.p95_ms > planned
    # the plans it chooses now are simulated on the served runtimes
    plan = planner.choose(Target(min_accuracy=0.0))
    assert [p.operator for p in plan.plans] == list(OPERATORS)


def test_ken_mmqa_target_refuses_a_calibration_of_no_seconds(capsys) -> None:  # noqa: ANN001
    from ken.cli import main

    assert main(["mmqa", "--target", "f1 >= 0.2", "--calibration-seconds", "0"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--calibration-seconds must be a number above 0" in err
    assert "--no-calibration" in err
    assert main(["mmqa", "--target", "f1 >= 0.2", "--calibration-seconds", "inf"]) == 2
