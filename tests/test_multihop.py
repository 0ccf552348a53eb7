"""The multi-hop QA pipeline (``ken mmqa`` / ``ken hybridqa``) on the hand-made fixtures, with
fake models: retrieval, routes, the hop that feeds the first answer into the second question,
statuses, scores and the per-question JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

import ken
from ken.cli import main
from ken.errors import DataError
from ken.models.model import DeviceConfig, Model, ModelSpec, Output, Prediction
from ken.models.qa_data import read_hybridqa, read_mmqa
from ken.multihop import (
    ROUTE_LABELS,
    contains_answer,
    retrieval_summary,
    route_of,
    run_pipeline,
    write_report,
)
from ken.ops.sem_similarity import SimilarityPairModel

FIXTURES = Path(__file__).parent / "fixtures"


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


class Overlap(Model):
    """Stand-in for sem_similarity: Jaccard overlap of the two texts' words."""

    def __init__(self) -> None:
        self.spec = ModelSpec("overlap", "fake", "fake", "", 0, 0, 0, (), "overlap",
                              num_inputs=2)
        self.device = DeviceConfig()

    def predict(self, texts: Sequence, batch_size: int = 32) -> Output:
        values = [len(words(a) & words(b)) / max(1, len(words(a) | words(b)))
                  for a, b in texts]
        return Output(values, np.ones(len(values)))


class Reader(Model):
    """Stand-in for sem_qa: ``(asked, needed in the question, answer)`` rules; the first rule
    whose words are asked, whose needed bridge is in the question and whose answer is in the
    context answers (so a right answer needs the right context and the right hop)."""

    RULES = (("Who directed", "", "Tomas Berg"),
             ("Tomas Berg", "The Quiet Harbour", "Anna"), ("Tomas Berg", "", "The Quiet Harbour"),
             ("played Anna", "The Quiet Harbour", "Genoa"),
             ("played Anna", "", "The Quiet Harbour"),
             ("born", "", "Turin"), ("Claire", "", "Night Train to Lyon"),
             ("Mrs. Hale", "", "1972"))

    def __init__(self) -> None:
        self.spec = ModelSpec("reader", "fake", "fake", "", 0, 0, 0, (), "reader", num_inputs=2)
        self.device = DeviceConfig()
        self.seen: list[tuple[str, str]] = []

    def predict(self, texts: Sequence, batch_size: int = 32) -> Output:
        out = []
        for q, ctx in texts:
            self.seen.append((q, ctx))
            bridge = ctx.split("\n", 1)[0]  # a compose route puts the bridge first
            out.append(next((a for asked, need, a in self.RULES
                             if asked in q and (need in q or need in bridge) and a in ctx),
                            None))
        return Output(out, np.ones(len(out)))


class GoldType(Model):
    """Stand-in for the question-type classifier: the gold route of each question."""

    def __init__(self, routes: dict[str, str]) -> None:
        self.routes = routes
        self.spec = ModelSpec("gold-type", "fake", "fake", "", 0, 0, 0, ROUTE_LABELS,
                              "gold-type")
        self.device = DeviceConfig()

    def predict(self, texts: Sequence, batch_size: int = 32) -> Prediction:
        labels = np.array([ROUTE_LABELS.index(self.routes[t]) for t in texts], dtype=np.int64)
        return Prediction(labels, np.eye(len(ROUTE_LABELS), dtype=np.float32)[labels],
                          ROUTE_LABELS)


@pytest.fixture
def session(tmp_path):  # noqa: ANN001
    s = ken.connect(home=tmp_path / "home")
    s.register("sem_similarity", Overlap(), output_type="double")
    reader = Reader()
    s.register("sem_qa", reader)
    s.reader = reader
    yield s
    s.close()


def test_mmqa_fixture_routes_retrieves_and_hops(session, tmp_path) -> None:  # noqa: ANN001
    data = read_mmqa(FIXTURES / "mmqa")
    routes = {q.question: route_of(q.qtype) for q in data.questions}
    report = run_pipeline(session, data, type_model=GoldType(routes))
    by = {a.qid: a for a in report.answers}
    assert by["q_text"].predicted == "Turin" and by["q_text"].em == 1.0
    assert by["q_text"].context.startswith("Maria Rossi. Maria Rossi (born 1938)")
    assert by["q_table"].predicted == "Night Train to Lyon"
    assert by["q_table_year"].predicted == "1972" and by["q_table_year"].f1 == 1.0
    # Compose(TableQ,TextQ): the passage first (its title is the bridge), then the table
    # ranked by the question and the bridge; the reader reads once, the question itself
    hop = by["q_compose_table_text"]
    assert hop.route == "Compose(TableQ,TextQ)" and hop.hops == ("The Quiet Harbour",)
    assert hop.predicted == "Anna" and hop.em == 1.0
    asked = [(q, ctx) for q, ctx in session.reader.seen if q == hop.question]
    assert len(asked) == 1 and asked[0][1].startswith("The Quiet Harbour\n")
    # Compose(TextQ,TableQ): the table first (its best row is the bridge), then a passage
    hop = by["q_compose_text_table"]
    assert "The Quiet Harbour" in hop.hops[0] and "Anna" in hop.hops[0] and hop.em == 1.0
    assert hop.context.startswith(hop.hops[0] + "\n")
    # comparisons and intersections take the single hop of their first part (here the
    # reader has no rule for them); images and missing context are not run
    assert by["q_compare"].route == "TableQ" and by["q_compare"].predicted is None
    assert by["q_intersect"].route == "TableQ" and by["q_intersect"].status == "ok"
    assert by["q_image"].status == "image" and by["q_image"].latency_s == 0.0
    assert by["q_missing"].status == "missing context"
    s = report.summary
    assert s.scored == 7 and s.em == pytest.approx(100 * 5 / 7)
    assert s.statuses["image"] == 1 and s.statuses["missing context"] == 1
    assert report.type_accuracy == 1.0
    assert report.models == ("gold-type", "overlap", "reader")
    path = write_report(report, tmp_path / "out")
    saved = json.loads(path.read_text())
    assert len(saved["questions"]) == 9 and saved["summary"]["scored"] == 7
    first = saved["questions"][0]
    assert {"qid", "question", "qtype", "route", "predicted", "gold", "em", "f1",
            "latency_s"} <= set(first)


def test_hybridqa_fixture_reads_the_best_row_and_its_passages(session) -> None:  # noqa: ANN001
    data = read_hybridqa(FIXTURES / "hybridqa")
    report = run_pipeline(session, data)
    assert report.type_accuracy is None
    ok = [a for a in report.answers if a.status == "ok"]
    assert ok and all(a.route == "row+passages" and a.latency_s > 0 for a in ok)
    missing = [a for a in report.answers if a.status == "missing context"]
    assert len(missing) == 1 and missing[0].predicted is None
    by = {a.qid: a for a in report.answers}
    assert by["h_table"].predicted == "Night Train to Lyon"  # in the best row
    assert by["h_passage"].predicted == "Tomas Berg"  # in a passage the best row links to
    assert "Anna" in by["h_passage"].context and "Tomas Berg" in by["h_passage"].context
    assert by["h_other"].predicted is None  # a count: not in any context
    assert report.summary.scored == 3 and report.summary.em == pytest.approx(200 / 3)
    # retrieval's recall, apart from the reader: the gold answer is in the context of the
    # two questions the reader got right, not in that of the count
    assert [by[q].answer_in_context for q in ("h_table", "h_passage", "h_other")] == [
        True, True, False]
    assert retrieval_summary(report.answers) == (pytest.approx(2 / 3), pytest.approx(100.0))
    assert contains_answer("Born in  TURIN, Italy", ["turin"])
    assert not contains_answer("Born in Turin", ["", "Genoa"])


def test_mmqa_needs_questions_to_train_the_type_classifier(session) -> None:  # noqa: ANN001
    data = read_mmqa(FIXTURES / "mmqa")  # the official files, without a train split
    with pytest.raises(DataError, match="MMQA_train.jsonl.gz"):
        run_pipeline(session, data)


def test_routes_of_question_types() -> None:
    assert route_of("Compose(TextQ,TableQ)") == "Compose(TextQ,TableQ)"
    assert route_of("Compare(TableQ,Compose(TableQ,TextQ))") == "TableQ"
    assert route_of("Intersect(TextQ,TableQ)") == "TextQ"
    assert route_of("Compose(ImageQ,TableQ)") == "other" and route_of("ImageListQ") == "other"


def test_cli_rejects_bad_arguments(capsys) -> None:  # noqa: ANN001
    assert main(["hybridqa", "--limit", "0"]) == 2
    assert "--limit must be at least 1" in capsys.readouterr().err
    assert main(["mmqa", "--data-dir", "/nonexistent/mmqa"]) == 1  # missing data: a failure
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.models
def test_sem_similarity_ranks_by_meaning(home) -> None:  # noqa: ANN001
    from conftest import FAMILY_DEVICE

    from ken.models.resources import Resources

    model = SimilarityPairModel(Resources(FAMILY_DEVICE, home=home).encoder("minilm-l6"))
    q = "Where was the actress born?"
    out = model.predict([(q, "She was born in Turin, Italy."),
                         (q, "The film won a prize at a festival."), (q, ""), (q, q)])
    assert out.values[0] > out.values[1] and out.values[2] is None
    assert out.values[3] == pytest.approx(1.0, abs=1e-5)
    with ken.connect(device=FAMILY_DEVICE, home=home) as s:
        got = s.sql("SELECT sem_similarity('Where was the actress born?', "
                    "'She was born in Turin, Italy.') AS s").fetchall()[0][0]
    assert got == pytest.approx(out.values[0], abs=1e-5)


def test_a_stream_with_a_budget_ends_a_question_whose_hop_is_dropped(session) -> None:  # noqa: ANN001
    from ken.models.cascade import Cascade
    from ken.multihop import Pipeline, answer_stream
    from ken.policy.plan import GearPlan, RangeSchedule, Replica
    from ken.progress import Reporter

    data = read_hybridqa(FIXTURES / "hybridqa")
    pipeline = Pipeline(session, data, Reporter(quiet=True))
    session.use_plan(GearPlan("sem_qa", (0.0, 1e6), (Cascade(("reader",)),),
                              (Replica("reader", ("cpu0",)),), (RangeSchedule(0, (1.0,), (1,)),),
                              (4,), max_wait_s=0.005,
                              batch_runtime_s=((0.05, 0.06, 0.07, 0.08),)))
    session.serve(workers="thread", dropping="proactive", replan=False)
    questions = list(data.questions)
    at = [0.0] * len(questions)
    # tight first: answers are cached, so a later run would not ask the engine again
    tight = {a.qid: a for a in answer_stream(pipeline, questions, at, budget_s=0.01)}
    roomy = {a.qid: a for a in answer_stream(pipeline, questions, at, budget_s=60.0)}
    for qid, a in roomy.items():  # the reader's profile (50 ms) fits 60 s: nothing dropped
        assert a.status in ("ok", "missing context")
        if a.status == "ok":  # ... but not 10 ms: dropped on arrival at the reader
            assert tight[qid].status == "dropped" and tight[qid].predicted is None
            assert "at sem_qa: predicted finish" in tight[qid].reason
        else:
            assert tight[qid].status == a.status
    assert any(a.status == "ok" for a in roomy.values())


def test_a_question_whose_model_call_fails_ends_in_error_and_the_stream_goes_on(session
                                                                                ) -> None:  # noqa: ANN001
    """One question's reader call fails on the engine: that question ends ``error`` with
    the model's error; the others are answered (before: the exception ended the stream and
    every answer was lost)."""
    from ken.models.cascade import Cascade
    from ken.multihop import Pipeline, answer_stream
    from ken.policy.plan import GearPlan, RangeSchedule, Replica
    from ken.progress import Reporter

    data = read_hybridqa(FIXTURES / "hybridqa")
    pipeline = Pipeline(session, data, Reporter(quiet=True))
    reads = session.reader.predict

    def predict(texts, batch_size=32):  # noqa: ANN001, ANN202
        if any("Claire" in q for q, _ in texts):
            raise ValueError("the reader broke")
        return reads(texts, batch_size)

    session.reader.predict = predict
    session.use_plan(GearPlan("sem_qa", (0.0, 1e6), (Cascade(("reader",)),),
                              (Replica("reader", ("cpu0",)),), (RangeSchedule(0, (1.0,), (1,)),),
                              (1,), max_wait_s=0.001,
                              batch_runtime_s=((0.05,),)))
    session.serve(workers="thread", replan=False)
    questions = list(data.questions)
    got = answer_stream(pipeline, questions, [0.0] * len(questions))
    broken = [a for a in got if "Claire" in a.question]
    assert broken and all(a.status == "error" and "the reader broke" in a.reason
                          for a in broken)
    assert any(a.status == "ok" for a in got)
