"""LIMIT that stops early (issue 35, item 2): against evaluating every row, with stand-in models."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pytest
from fakes import FakeModel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ken
from ken.models.cascade import Cascade
from ken.models.model import Prediction
from ken.ops.base import ClassifierBinding, SemanticFunction
from ken.sql.limit import FIRST_CHUNK, next_chunk

BOOL = ("false", "true")
ROWS = 2000


class BoolBinding(ClassifierBinding):
    def to_sql_values(self, labels):  # noqa: ANN001, ANN201
        return [None if v is None else v == "true" for v in labels]


class NeverModel(FakeModel):
    """Says false to every row."""

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        self.rows_seen.extend(texts)
        probs = np.tile(np.array([[0.9, 0.1]], np.float32), (len(texts), 1))
        return Prediction(np.zeros(len(texts), np.int64), probs, BOOL)


def make_session(rows: int = ROWS) -> tuple[ken.Session, dict[str, FakeModel]]:
    s = ken.connect(builtins=False)
    models: dict[str, FakeModel] = {}

    def bind(constants: tuple[str, ...]) -> BoolBinding:
        name = f"f[{constants[0]}]"
        if name not in models:
            models[name] = (NeverModel(name, BOOL) if constants[0] == "never"
                            else FakeModel(name, BOOL))
        return BoolBinding("fsem", Cascade((name,)), {name: models[name]}, "boolean")

    s.register("fsem", SemanticFunction("fsem", 1, ("predicate",), "boolean", bind))
    s.register_table("t", pa.table({"id": list(range(rows)),
                                    "txt": [f"review number {i}" for i in range(rows)]}))
    return s, models


def passing(model: FakeModel, texts: Sequence[str]) -> set[str]:
    """The texts the stand-in model says true to (every row evaluated)."""
    return {t for t in texts if BOOL[int(np.argmax(model.probabilities(t)))] == "true"}


def test_limit_5_over_2000_rows_evaluates_under_5_percent() -> None:
    s, models = make_session()
    out = s.sql("SELECT id, txt FROM t WHERE fsem(txt, 'good') LIMIT 5").arrow()
    model = models["f[good]"]
    assert out.num_rows == 5
    every = passing(model, [f"review number {i}" for i in range(ROWS)])
    assert 0.4 < len(every) / ROWS < 0.6  # about half the rows pass
    assert set(out.column("txt").to_pylist()) <= every
    assert len(model.rows_seen) < 0.05 * ROWS
    assert len(set(model.rows_seen)) == len(model.rows_seen)  # no row evaluated twice


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(0, 300), k=st.integers(0, 200), offset=st.integers(0, 40),
       modulus=st.sampled_from([1, 2, 7]), select=st.sampled_from(["id, txt", "*",
                                                                    "txt AS x, id + 1 AS y"]))
def test_early_limit_returns_rows_that_pass_as_many_as_asked(rows: int, k: int, offset: int,
                                                             modulus: int, select: str) -> None:
    s, models = make_session(rows)
    query = (f"SELECT {select} FROM t WHERE id % {modulus} = 0 AND fsem(txt, 'good') "
             f"LIMIT {k} OFFSET {offset}")
    out = s.sql(query).arrow()
    # every row evaluated, by DuckDB alone on the stand-in's answers
    model = models["f[good]"]
    texts = [f"review number {i}" for i in range(rows) if i % modulus == 0]
    every = passing(model, texts)
    assert out.num_rows == min(k, max(len(every) - offset, 0))
    if out.num_rows:
        got = out.column("x" if "x" in out.column_names else "txt").to_pylist()
        assert set(got) <= every and len(set(got)) == len(got)
    assert set(model.rows_seen) <= set(texts)  # relational conjuncts run first
    assert out.column_names == [c.strip().split(" AS ")[-1] for c in select.split(",")] \
        if select != "*" else out.column_names == ["id", "txt"]


def test_order_by_evaluates_every_row_and_explain_says_why() -> None:
    s, models = make_session(300)
    out = s.sql("SELECT id FROM t WHERE fsem(txt, 'good') ORDER BY id DESC LIMIT 3").arrow()
    assert out.num_rows == 3
    assert len(models["f[good]"].rows_seen) == 300
    text = s.explain("SELECT id FROM t WHERE fsem(txt, 'good') ORDER BY id LIMIT 3")
    assert "LIMIT does not stop early: ORDER BY needs every row" in text
    text = s.explain("SELECT grp, count(*) FROM (SELECT id % 3 AS grp, txt FROM t) "
                     "WHERE fsem(txt, 'good') GROUP BY grp LIMIT 2")
    assert "GROUP BY needs every row" in text


def test_explain_says_it_stops_early_and_analyze_counts_rows() -> None:
    s, models = make_session()
    query = "SELECT id FROM t WHERE fsem(txt, 'good') LIMIT 5"
    assert "LIMIT 5 stops early" in s.explain(query)
    text = s.explain(query, analyze=True)
    line = next(x for x in text.splitlines() if x.startswith("early-stopping LIMIT 5"))
    scanned = int(line.split(": ")[1].split(" of ")[0].replace(",", ""))
    assert f"of {ROWS:,} rows of the source" in line
    assert scanned == len(models["f[good]"].rows_seen) < ROWS


def test_no_row_passes_gives_the_columns_and_scans_everything() -> None:
    s, models = make_session(100)
    out = s.sql("SELECT id, txt FROM t WHERE fsem(txt, 'never') LIMIT 5").arrow()
    assert out.num_rows == 0 and out.column_names == ["id", "txt"]
    assert len(models["f[never]"].rows_seen) == 100
    out = s.sql("SELECT id FROM t WHERE id < 0 AND fsem(txt, 'good') LIMIT 5").arrow()
    assert out.num_rows == 0 and out.column_names == ["id"]


def test_parameters_and_a_semantic_select_list() -> None:
    s, models = make_session(400)
    out = s.sql("SELECT id, fsem(txt, 'other') AS o FROM t WHERE id >= ? AND "
                "fsem(txt, 'good') LIMIT 4", params=[100]).arrow()
    assert out.num_rows == 4 and min(out.column("id").to_pylist()) >= 100
    # the select-list call ran only on the rows returned by some slice, not on the table
    assert len(models["f[other]"].rows_seen) < 100
    assert len(models["f[good]"].rows_seen) < 100


def test_frames_stop_early_too() -> None:
    s, models = make_session()
    out = s.table("t").sem_filter("txt", "good", function="fsem").limit(5).to_arrow()
    assert out.num_rows == 5
    assert len(models["f[good]"].rows_seen) < 0.05 * ROWS


def test_next_chunk_grows_at_most_geometrically() -> None:
    assert next_chunk(0, 5, 32) == 0
    assert next_chunk(5, 0, 0) == FIRST_CHUNK
    assert next_chunk(100, 1, 32) == 32  # few passed: at most the rows scanned so far
    assert next_chunk(1, 30, 32) == FIRST_CHUNK
    for missing, found, scanned in [(3, 2, 50), (50, 10, 1000), (1, 0, 5000)]:
        assert FIRST_CHUNK <= next_chunk(missing, found, scanned) <= max(scanned, FIRST_CHUNK)


@pytest.mark.parametrize("query", [
    "SELECT id FROM t WHERE fsem(txt, 'good') LIMIT 0",
    "SELECT t.id FROM t AS t WHERE fsem(t.txt, 'good') LIMIT 3",
    "SELECT a.id FROM t AS a WHERE a.id > 10 AND fsem(a.txt, 'good') LIMIT 3",
    "SELECT id FROM (SELECT * FROM t WHERE id % 2 = 1) AS sub WHERE fsem(txt, 'good') LIMIT 3",
    "SELECT id FROM t WHERE fsem(txt, 'good') OR id = 3 LIMIT 6",
    # a conjunct naming a SELECT alias stays in the statement (not in the numbering)
    "SELECT id, id * 2 AS twice FROM t WHERE twice > 10 AND fsem(txt, 'good') LIMIT 3",
])
def test_shapes_that_stop_early(query: str) -> None:
    s, models = make_session(500)
    assert "stops early" in s.explain(query)
    out = s.sql(query).arrow()
    limit = int(query.rsplit("LIMIT", 1)[1])
    assert out.num_rows == limit
    assert len(models["f[good]"].rows_seen) < 500
