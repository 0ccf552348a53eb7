"""The LLM operators: SQL results equal a row-by-row evaluation (NULLs, blanks, duplicates),
prompts cut over-long columns from the side they say, and the evaluation samples load.

The SQL tests run the packaged SmolLM2-135M alone (``op.llms = ("smollm2-135m",)``); the
cascade to Qwen2.5-Coder-0.5B is measured in ``benchmarks/hellaswag.py``."""

from __future__ import annotations

import os
import threading

import pyarrow as pa
import pytest
from conftest import REFERENCE_DEVICE, SMALL_FAMILY

import ken
from ken.engine import manager
from ken.errors import DataError, KenError
from ken.machine import runqueue_wait_s
from ken.models.resources import Resources
from ken.ops.prompts import SEM_QA, extracted_value
from ken.ops.sem_choice import parse_options
from ken.ops.sem_complete import hellaswag_path, hellaswag_sample, load_hellaswag
from ken.ops.sem_qa import hybridqa_dir, hybridqa_passage_sample
from ken.optimizer.tokens import TokenCost

LLM_OPS = ("sem_choice", "sem_complete", "sem_qa", "sem_extract", "sem_map")

TEXTS = ["The new phone from Nokia has a great camera, I love it.",
         None,
         "My flight from Boston was delayed by five hours.",
         "",
         "The new phone from Nokia has a great camera, I love it.",
         "   "]
QUESTIONS = ["Which company made the phone?", "What?", "Where did the flight leave from?",
             "Why?", "Which company made the phone?", "Who?"]
ENDINGS = ["is broken.\nhas a great camera.", "a\nb",
           "arrived on time.\nwas delayed.\nwas cancelled.", "x\ny", "is broken.\nhas a great "
           "camera.", ""]


@pytest.fixture(scope="module")
def session(home):  # noqa: ANN001 - conftest's KEN_HOME (SmolLM2 converted there)
    # fp32: the tests hold SQL's batched answers to row-by-row ones
    s = ken.connect(device=REFERENCE_DEVICE, data=SMALL_FAMILY, home=home)
    for name in LLM_OPS:
        s.operators[name].llms = ("smollm2-135m",)
    s.register_table("t", pa.table({"id": list(range(len(TEXTS))), "x": TEXTS,
                                    "q": QUESTIONS, "e": ENDINGS}))
    yield s
    s.close()


def one_by_one(session, function: str, constants: tuple[str, ...], rows: list) -> list:  # noqa: ANN001
    bound = session.bind(function, constants)
    model = bound.models[bound.cascade.models[0]]
    out = []
    for row in rows:
        blank = any(v is None for v in (row if isinstance(row, tuple) else (row,)))
        out.append(None if blank else bound.to_sql_values(model.predict([row]).values)[0])
    return out


@pytest.mark.models
def test_sql_equals_row_by_row_with_nulls_and_duplicates(session) -> None:  # noqa: ANN001
    s = session
    query = ("SELECT id, sem_choice(x, 'phones|travel|food') AS topic, "
             "sem_extract(x, 'the company name') AS company, sem_qa(q, x) AS answer, "
             "sem_complete(x, e) AS ending FROM t ORDER BY id")
    result = s.sql(query)
    rows = result.fetchall()
    assert [r[0] for r in rows] == list(range(len(TEXTS)))
    cols = list(zip(*rows, strict=True))
    assert list(cols[1]) == one_by_one(s, "sem_choice", ("phones|travel|food",), TEXTS)
    assert list(cols[2]) == one_by_one(s, "sem_extract", ("the company name",), TEXTS)
    assert list(cols[3]) == one_by_one(s, "sem_qa", (), list(zip(QUESTIONS, TEXTS,
                                                                  strict=True)))
    assert list(cols[4]) == one_by_one(s, "sem_complete", (), list(zip(TEXTS, ENDINGS,
                                                                        strict=True)))
    # NULL, empty and blank inputs (and a row without endings) are NULL, never an error
    for i in (1, 3, 5):
        assert rows[i][1:] == (None, None, None, None)
    assert rows[0][1:] == rows[4][1:]  # duplicates get one answer
    assert rows[0][1] in ("phones", "travel", "food")
    assert isinstance(rows[0][4], int) and 0 <= rows[0][4] <= 1
    # each distinct non-NULL input was answered once per operator (4 of the 6 rows: the
    # duplicate is not re-run, NULL never reaches a model)
    assert len(result.stats) == 4
    assert all(st.distinct_evaluated == 4 for st in result.stats.values())


@pytest.mark.models
def test_sem_map_and_explain(session) -> None:  # noqa: ANN001
    s = session
    rows = s.sql("SELECT sem_map(x, 'Answer yes or no: is this text about a phone?') "
                 "FROM t WHERE id IN (0, 1)").fetchall()
    assert len(rows) == 2 and None in [r[0] for r in rows]
    assert any(isinstance(r[0], str) and r[0] for r in rows)
    text = s.explain("SELECT sem_qa(q, x) FROM t")
    assert "prompt sem_qa/v1" in text and "context cut to 448 tokens" in text
    with pytest.raises(KenError, match="at least two distinct"):
        s.sql("SELECT sem_choice(x, 'only') FROM t")


@pytest.mark.models
def test_prompts_cut_columns_from_their_side(home) -> None:  # noqa: ANN001
    lm = Resources(REFERENCE_DEVICE, home=home).causal_lm("smollm2-135m")
    long = " ".join(f"word{i}" for i in range(2000))
    ids = SEM_QA(lm, ("a question?", long))
    text = lm.tokenizer.decode(ids)
    assert "word0 " in text and "word1999" not in text  # the passage keeps its start
    assert len(ids) < 700
    assert SEM_QA(lm, (None, "passage")) is None and SEM_QA(lm, ("q", "  ")) is None
    with pytest.raises(DataError, match="takes 2 texts"):
        SEM_QA(lm, "one text")


def test_answers_and_options() -> None:
    assert extracted_value(" None. ") is None and extracted_value("") is None
    assert extracted_value('"Nokia"') == "Nokia"
    assert parse_options(" a | b|c ") == ("a", "b", "c")
    for bad in ("a", "a||b", "a|a", None):
        with pytest.raises(DataError):
            parse_options(bad)  # type: ignore[arg-type]


@pytest.mark.skipif(not hellaswag_path().is_file(), reason=f"HellaSwag not found at "
                    f"{hellaswag_path()}")
def test_hellaswag_loads() -> None:
    contexts, endings, gold = load_hellaswag()
    assert len(contexts) == 5021 and all(len(e) == 4 for e in endings)
    assert set(gold) == {0, 1, 2, 3}
    sample = hellaswag_sample(10)
    assert len(sample) == 10 and sample.inputs[0][1].count("\n") == 3


@pytest.mark.skipif(not (hybridqa_dir() / "dev_questions.json").is_file(),
                    reason=f"HybridQA not found at {hybridqa_dir()}")
def test_hybridqa_passage_sample() -> None:
    sample = hybridqa_passage_sample(20)
    assert len(sample) == 20 and sample.metric == "token_f1"
    for (question, passage), answer in zip(sample.inputs, sample.references, strict=True):
        assert question and answer.lower() in passage.lower()


@pytest.mark.models
def test_sem_qa_served_by_a_decode_server(session, monkeypatch) -> None:  # noqa: ANN001
    """A generation plan given to the session: serve() answers sem_qa's SQL calls from a
    decode server (online chunks and bulk rows), with the values of the in-process cascade."""
    from ken.models.cascade import Cascade
    from ken.policy.plan import GenGear, GenPlan

    s = session
    stage = s.bind("sem_qa", ()).cascade.models[0]
    plan = GenPlan("sem_qa", (GenGear(Cascade((stage,)), 4), GenGear(Cascade((stage,)))),
                   max_running=2)
    expected = one_by_one(s, "sem_qa", (), list(zip(QUESTIONS, TEXTS, strict=True)))
    s.use_plan(plan)
    assert "generation plan: 2 gears by load" in s.explain("SELECT sem_qa(q, x) FROM t")
    assert "session.serve()" in s.explain("SELECT sem_qa(q, x) FROM t")
    try:
        s.serve(["sem_qa"])
        text = s.explain("SELECT sem_qa(q, x) FROM t")
        assert "served by a decode server" in text and f"load [0, 4): {stage}" in text
        for bulk_threshold in (1000, 1):  # online requests, then bulk rows (gear 1)
            s.bulk_threshold = bulk_threshold
            result = s.sql("SELECT id, sem_qa(q, x) FROM t ORDER BY id")
            assert [r[1] for r in result.fetchall()] == expected
            st = next(iter(result.stats.values()))
            assert st.distinct_evaluated == 4  # NULLs never reach the server; one duplicate
            assert (st.bulk_rows if bulk_threshold == 1 else st.online_rows) == 4
        with pytest.raises(KenError, match="stop serving"):
            s.use_plan(_a_gear_plan(stage))
        # by deadline (Apt-Serve's joiners), the token cost stood in for: the same answers
        s.stop_serving()
        measured: list[str] = []

        def cost(lm, model: str, **_kwargs) -> TokenCost:  # noqa: ANN001
            measured.append(model)
            return TokenCost(model, "hw", (), (), (0.05, 0.001, 0.0), (0.02, 0.0, 0.0), 0, 1)

        monkeypatch.setattr(manager, "load_or_measure_token_cost", cost)
        with pytest.raises(KenError, match="ServiceTargets"):
            s.serve(["sem_qa"], decode_targets=(60.0, 5.0))  # type: ignore[arg-type]
        with pytest.raises(KenError, match="decode_priority must be"):
            s.serve(["sem_qa"], decode_priority="urgent")
        s.serve(["sem_qa"], decode_targets=ken.ServiceTargets(60.0, 5.0),
                decode_priority="background")  # its passes in the idle scheduling class
        server = s.engines["sem_qa"].server
        assert measured and all(lane.scheduler.order == "deadline"
                                for lane in server._lanes.values())
        result = s.sql("SELECT id, sem_qa(q, x) FROM t ORDER BY id")
        assert [r[1] for r in result.fetchall()] == expected
        assert server.cpu_priority == "background"
        if hasattr(os, "SCHED_IDLE") and runqueue_wait_s(threading.get_native_id()) is not None:
            assert server.yielded  # Linux: the idle class
    finally:
        s.stop_serving()
        s.bulk_threshold = 64
        s.serving.forget("sem_qa")
    assert "generation plan: none" in s.explain("SELECT sem_qa(q, x) FROM t")


def _a_gear_plan(model: str):  # noqa: ANN202
    from ken.models.cascade import Cascade
    from ken.policy.plan import GearPlan, RangeSchedule, Replica

    return GearPlan("sem_qa", (0.0, 1e6), (Cascade((model,)),), (Replica(model, ("cpu0",)),),
                    (RangeSchedule(0, (1.0,), (1,)),), (8,))


@pytest.mark.models
def test_plan_a_generating_function_from_the_session(session) -> None:  # noqa: ANN001
    if not (hybridqa_dir() / "dev_questions.json").is_file():
        pytest.skip(f"sem_qa plans on HybridQA, not found at {hybridqa_dir()}")
    from ken.errors import PlanningError

    s = session
    try:
        best = s.plan("tgt_p95 <= 600s", functions=["sem_qa"], qps=0.05, rows=4,
                      requests=8).plan_for("sem_qa")
        assert s.plans["sem_qa"] == best
        assert best.predicted.tgt_p95_ms <= 600_000 and best.predicted.num_requests == 8
        assert best.models == s.bind("sem_qa", ()).cascade.models  # SmolLM2 alone here
        with pytest.raises(PlanningError, match="fastest simulated"):
            s.plan("tgt_p95 <= 1ms", functions=["sem_qa"], qps=5, rows=4, requests=8)
        with pytest.raises(KenError, match="needs the mean rate"):
            s.plan("tgt_p95 <= 10s", functions=["sem_qa"])
        with pytest.raises(KenError, match="generating functions"):  # a gear-kind function
            s.plan("ttft_p95 <= 10s", functions=["sem_choice", "sem_qa"], qps=1, rows=4)
    finally:
        s.serving.forget("sem_qa")
