"""``ORDER BY <score> LIMIT k`` by the top-k plan (issue 35, item 4), with stand-in two-stage
DOUBLE cascades: against DuckDB running the same query with the plan off (every row through
the whole cascade), the calls each stage gets, and what EXPLAIN says."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pytest
from fakes import FakeModel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ken
from ken.errors import KenError, SqlError
from ken.models.cascade import Cascade
from ken.models.model import Output
from ken.ops.base import ClassifierBinding, SemanticFunction
from ken.sql.topk import SAMPLE_ROWS

THRESHOLD = 0.5


class ScoreFake(FakeModel):
    """A score model reading its answers from ``table``: text -> (value, certainty)."""

    def __init__(self, name: str, table: dict[str, tuple[float, float]]) -> None:
        super().__init__(name)
        self.table = table

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Output:
        self.rows_seen.extend(texts)
        return Output([self.table[t][0] for t in texts],
                      np.array([self.table[t][1] for t in texts]))


def make_session(texts: list[str | None], cheap: dict[str, tuple[float, float]],
                 expensive: dict[str, float], stages: int = 2
                 ) -> tuple[ken.Session, dict[str, ScoreFake]]:
    """Table ``t(id, txt)`` and ``fscore(txt, 'rubric') -> DOUBLE``: the cascade cheap ->
    expensive (or cheap alone) at threshold 0.5."""
    s = ken.connect(builtins=False)
    models = {"cheap": ScoreFake("cheap", cheap),
              "expensive": ScoreFake("expensive", {t: (v, 1.0) for t, v in expensive.items()})}
    cascade = (Cascade(("cheap", "expensive"), (THRESHOLD,)) if stages == 2
               else Cascade(("cheap",)))
    s.register("fscore", SemanticFunction(
        "fscore", 1, ("rubric",), "double",
        lambda _c: ClassifierBinding("fscore", cascade, models, "double")))
    s.register_table("t", pa.table({"id": list(range(len(texts))),
                                    "txt": pa.array(texts, pa.string())}))
    return s, models


def answers(rng: np.random.Generator, texts: list[str | None], delta: float,
            grid: bool, sure: float) -> tuple[dict, dict]:
    """Cheap (value, certainty) and expensive values per distinct text: every escalated
    expensive value is ``delta`` away from the cheap one (so the sample's margin is
    ``delta`` and no delta exceeds it)."""
    cheap, expensive = {}, {}
    for t in dict.fromkeys(x for x in texts if x is not None):
        value = float(rng.integers(1, 6)) if grid else float(rng.uniform(1, 5))
        cheap[t] = (value, float(rng.uniform(0, 1) < sure))
        expensive[t] = value + delta * (1 if rng.uniform() < 0.5 else -1)
    return cheap, expensive


def cascade_value(cheap: dict, expensive: dict, t: str | None) -> float | None:
    if t is None:
        return None
    value, certainty = cheap[t]
    return value if certainty >= THRESHOLD else expensive[t]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), rows=st.integers(0, 150), k=st.integers(0, 25),
       offset=st.integers(0, 8), desc=st.booleans(), delta=st.sampled_from([0.0, 0.3, 2.0]),
       grid=st.booleans(), sure=st.sampled_from([0.0, 0.5]), modulus=st.sampled_from([1, 3]),
       form=st.sampled_from([
           "SELECT id, fscore(txt, 'r') AS s FROM t{where} ORDER BY s {dir}",
           "SELECT * FROM t{where} ORDER BY fscore(txt, 'r') {dir}",
           "SELECT txt, id + 1 AS y FROM t AS a{where} ORDER BY fscore(a.txt, 'r') {dir}"]))
def test_top_k_equals_the_top_k_of_every_row(seed: int, rows: int, k: int, offset: int,
                                             desc: bool, delta: float, grid: bool,
                                             sure: float, modulus: int, form: str) -> None:
    rng = np.random.default_rng(seed)
    texts = [None if rng.uniform() < 0.05 else f"r{rng.integers(0, max(rows, 1))}"
             for _ in range(rows)]  # repeats and NULLs
    cheap, expensive = answers(rng, texts, delta, grid, sure)
    s, models = make_session(texts, cheap, expensive)
    where = f" WHERE id % {modulus} = 0" if modulus > 1 else ""
    query = (form.format(where=where, dir="DESC" if desc else "ASC")
             + f" LIMIT {k} OFFSET {offset}")
    got = s.sql(query)
    run = got.stats["topk"]
    got_rows = got.arrow()
    models["expensive"].rows_seen.clear()
    s.sql("SET ken_topk = off")
    naive = s.sql(query).arrow()
    assert "topk" not in s.sql(query).stats
    assert got_rows.column_names == naive.column_names
    # the values in order are the same; the rows too where the k-th place is not tied
    ids = [i for i in range(rows) if i % modulus == 0]
    values = {i: cascade_value(cheap, expensive, texts[i]) for i in ids}
    ranked = sorted((v for v in values.values() if v is not None), reverse=desc)
    ranked += [None] * (len(ids) - len(ranked))
    assert [values[_id(r)] for r in got_rows.to_pylist()] == ranked[offset:offset + k]
    assert [values[_id(r)] for r in naive.to_pylist()] == ranked[offset:offset + k]
    edge = offset + k
    if 0 < edge < len(ranked) and ranked[edge - 1] != ranked[edge] and (
            offset == 0 or ranked[offset - 1] != ranked[offset]):
        assert sorted(map(_id, got_rows.to_pylist())) == sorted(map(_id, naive.to_pylist()))
    assert run.returned == got_rows.num_rows and run.source_rows == len(ids)
    escalated = [t for t in cheap if cheap[t][1] < THRESHOLD]
    assert run.expensive_rows + run.pruned == len({texts[i] for i in ids} & set(escalated))
    if run.margin is not None:
        assert run.margin == pytest.approx(delta)


def _id(row: dict) -> int:
    return row["id"] if "id" in row else row["y"] - 1


def test_top_10_of_400_sends_few_rows_to_the_expensive_stage() -> None:
    rng = np.random.default_rng(7)
    texts = [f"review {i}" for i in range(400)]
    cheap = {t: (float(rng.uniform(1, 5)), 0.0) for t in texts}  # every row escalates
    expensive = {t: cheap[t][0] + float(rng.uniform(-0.1, 0.1)) for t in texts}
    s, models = make_session(texts, cheap, expensive)
    query = "SELECT id, fscore(txt, 'r') AS s FROM t ORDER BY s DESC LIMIT 10"
    result = s.sql(query)
    run = result.stats["topk"]
    assert len(models["cheap"].rows_seen) == 400
    assert len(models["expensive"].rows_seen) == run.expensive_rows < 0.2 * 400
    assert run.sampled == SAMPLE_ROWS and run.pruned == 400 - run.expensive_rows
    assert result.stats["s0"].stages[1].input_rows == run.expensive_rows
    best = sorted(texts, key=lambda t: -expensive[t])[:10]
    assert result.arrow().column("id").to_pylist() == [texts.index(t) for t in best]
    s.topk_sample = 39
    assert "only a sample of 39 escalated rows" in s.explain(query)
    wider = s.sql(query).stats["topk"]
    assert wider.sampled == 39 and wider.expensive_rows >= 39
    s.topk_sample = 0
    with pytest.raises(KenError, match="topk_sample"):
        s.sql(query)
    s.topk_sample = SAMPLE_ROWS
    text = s.explain(query, analyze=True)
    assert "top-k DESC LIMIT 10: 400 rows" in text and f"{run.pruned:,} pruned" in text
    assert "top-k: ORDER BY s DESC LIMIT 10: cheap scores every row" in s.explain(query)


def test_a_delta_beyond_the_margin_is_reported() -> None:
    """One row's expensive value is far from its cheap one, the sample does not hold it, so
    the plan prunes a row of the true top 3: the result differs, and the run says by how
    much it trusted the margin."""
    texts = [f"review {i}" for i in range(200)]
    cheap = {t: (1.0 + 3.0 * i / 200, 0.0) for i, t in enumerate(texts)}
    expensive = {t: v for t, (v, _) in cheap.items()}
    hidden = "review 0"  # cheap 1.0, expensive 5.0: the best row
    expensive[hidden] = 5.0
    s, models = make_session(texts, cheap, expensive)
    result = s.sql("SELECT id FROM t ORDER BY fscore(txt, 'r') DESC LIMIT 3")
    run = result.stats["topk"]
    assert hidden not in models["expensive"].rows_seen[:run.sampled]
    assert run.margin == 0.0 and run.pruned > 150
    assert result.arrow().column("id").to_pylist() == [199, 198, 197]
    s.sql("SET ken_topk = off")
    assert s.sql("SELECT id FROM t ORDER BY fscore(txt, 'r') DESC LIMIT 3").arrow() \
        .column("id").to_pylist() == [0, 199, 198]
    assert "margin 0, the largest |expensive - cheap| of 19 sampled" in run.line()


def test_one_stage_and_other_shapes_say_why_not() -> None:
    texts = [f"review {i}" for i in range(30)]
    rng = np.random.default_rng(1)
    cheap, expensive = answers(rng, texts, 0.5, False, 0.5)
    s, models = make_session(texts, cheap, expensive, stages=1)
    query = "SELECT id FROM t ORDER BY fscore(txt, 'r') DESC LIMIT 3"
    assert "no cheap stage to prune with" in s.explain(query)
    result = s.sql(query)
    assert "topk" not in result.stats and len(models["cheap"].rows_seen) == 30
    best = sorted(range(30), key=lambda i: -cheap[texts[i]][0])[:3]
    assert result.arrow().column("id").to_pylist() == best
    s, _ = make_session(texts, cheap, expensive)
    for q, why in [
        ("SELECT id FROM t WHERE fscore(txt, 'r') > 2 ORDER BY id LIMIT 3",
         "its ORDER BY key id is not one semantic function's value"),
        ("SELECT id FROM t ORDER BY fscore(txt, 'r') DESC NULLS FIRST LIMIT 3", "NULLS FIRST"),
        ("SELECT id FROM t WHERE fscore(txt, 'r') > 2 ORDER BY fscore(txt, 'r') LIMIT 3",
         "also in WHERE"),
        ("SELECT id % 2 AS g, max(id) FROM t GROUP BY g ORDER BY max(fscore(txt, 'r')) "
         "LIMIT 1", "not one semantic function's value"),
        ("SELECT id FROM t ORDER BY fscore(txt, 'r'), id LIMIT 3", "several keys"),
        ("SELECT id, fscore(txt, 'r') AS s FROM t WHERE s > 2 ORDER BY s LIMIT 3",
         "refers to a SELECT alias"),
        ("SELECT DISTINCT txt FROM t ORDER BY fscore(txt, 'r') LIMIT 3", "DISTINCT"),
    ]:
        assert "top-k plan does not apply: " in s.explain(q) and why in s.explain(q), q
    s.sql("SET ken_topk = off")
    assert "the top-k plan is off" in s.explain(query)
    s.sql("RESET ken_topk")
    assert "cheap scores every row" in s.explain(query)
    with pytest.raises(SqlError, match="on or off"):
        s.sql("SET ken_topk = maybe")


def test_a_registered_double_cascade_takes_the_plan_too() -> None:
    """``session.register(name, Cascade, models=..., output_type="double")``: a user's DOUBLE
    cascade of two stages (no constant argument) gets the plan; a VARCHAR one does not."""
    rng = np.random.default_rng(3)
    texts = [f"doc {i}" for i in range(120)]
    cheap = {t: (float(rng.uniform(0, 1)), float(rng.uniform() < 0.3)) for t in texts}
    expensive = {t: cheap[t][0] + 0.05 for t in texts}
    s, models = make_session(texts, cheap, expensive)
    s.register("relevance", Cascade(("cheap", "expensive"), (THRESHOLD,)), models=models,
               output_type="double")
    query = "SELECT id FROM t ORDER BY relevance(txt) ASC LIMIT 4"
    result = s.sql(query)
    assert result.stats["topk"].pruned > 0
    final = {t: cheap[t][0] if cheap[t][1] >= THRESHOLD else expensive[t] for t in texts}
    assert result.arrow().column("id").to_pylist() == sorted(
        range(120), key=lambda i: final[texts[i]])[:4]
    s.register("label", Cascade(("cheap", "expensive"), (THRESHOLD,)), models=models)
    assert "label() returns VARCHAR, not a DOUBLE score" in s.explain(
        "SELECT id FROM t ORDER BY label(txt) LIMIT 4")
