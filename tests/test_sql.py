"""Semantic SQL against brute force, with deterministic stand-in models (fast)."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pytest
from fakes import FakeModel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ken
from ken.models.cascade import Cascade
from ken.models.certainty import certainty_fn
from ken.ops.base import ClassifierBinding, SemanticFunction
from ken.sql.rewrite import SqlError

BOOL = ("false", "true")


class BoolBinding(ClassifierBinding):
    def to_sql_values(self, labels):  # noqa: ANN001, ANN201
        return [None if v is None else v == "true" for v in labels]


def make_session() -> tuple[ken.Session, dict[str, FakeModel]]:
    s = ken.connect(builtins=False)
    models = {"a": FakeModel("a"), "b": FakeModel("b"), "c": FakeModel("c")}
    s.register("mood", Cascade(("a", "b", "c"), (0.5, 0.45)), models=models)
    filters: dict[str, FakeModel] = {}

    def bind_filter(constants: tuple[str, ...]) -> BoolBinding:
        name = f"f[{constants[0]}]"
        filters[name] = FakeModel(name, BOOL)
        return BoolBinding("fsem", Cascade((name,)), {name: filters[name]}, "boolean")

    s.register("fsem", SemanticFunction("fsem", 1, ("predicate",), "boolean", bind_filter))
    pair = FakeModel("pair", BOOL, num_inputs=2)
    s.register("fmatch", SemanticFunction(
        "fmatch", 2, (), "boolean",
        lambda _c: BoolBinding("fmatch", Cascade(("pair",)), {"pair": pair}, "boolean")))
    models.update(filters)
    models["pair"] = pair
    s._fakes_filters = filters  # type: ignore[attr-defined]
    return s, models


TEXTS = ["great flight", "delayed again", None, "great flight", "", "lost my bag", "meh",
         "delayed again", "thanks!", None, "so so", "great flight"]


def setup_tables(s: ken.Session) -> None:
    rows = [(i, t, "en" if i % 3 else "fr", i % 4) for i, t in enumerate(TEXTS)]
    s.register_table("tweets", pa.table({
        "id": [r[0] for r in rows], "text": [r[1] for r in rows],
        "lang": [r[2] for r in rows], "grp": [r[3] for r in rows]}))
    s.register_table("products", pa.table({
        "pid": [1, 2, 3, 4], "title": ["great flight", "meh", None, "thanks!"]}))


def brute_mood(text: str | None) -> str | None:
    """Row by row, stage by stage, thresholds by hand."""
    if text is None:
        return None
    score = certainty_fn("max_prob")
    for i, name in enumerate("abc"):
        pred = FakeModel(name).predict([text], 1)
        if i == 2 or score(pred.probabilities)[0] >= (0.5, 0.45)[i]:
            return pred.label_strings()[0]
    raise AssertionError


def brute_bool(name: str, *args: str | None) -> bool | None:
    if any(a is None for a in args):
        return None
    text = args[0] if len(args) == 1 else tuple(args)
    return FakeModel(name, BOOL, num_inputs=len(args)).predict([text], 1).label_strings()[0] \
        == "true"


def brute_connection() -> duckdb.DuckDBPyConnection:
    """DuckDB with the semantic outputs precomputed per row by the brute-force loop."""
    con = duckdb.connect()
    rows = [(i, t, "en" if i % 3 else "fr", i % 4) for i, t in enumerate(TEXTS)]
    con.register("tweets", pa.table({
        "id": [r[0] for r in rows], "text": [r[1] for r in rows],
        "lang": [r[2] for r in rows], "grp": [r[3] for r in rows],
        "mood": [brute_mood(t) for t in TEXTS],
        "delay": [brute_bool("f[delay]", t) for t in TEXTS],
        "happy": [brute_bool("f[happy]", t) for t in TEXTS]}))
    titles = ["great flight", "meh", None, "thanks!"]
    con.register("products", pa.table({"pid": [1, 2, 3, 4], "title": titles}))
    pairs = [(t, p, brute_bool("pair", t, p)) for t in set(TEXTS) for p in set(titles)]
    con.register("pairs", pa.table({"t": [x[0] for x in pairs], "p": [x[1] for x in pairs],
                                    "m": [x[2] for x in pairs]}))
    return con


CASES = [
    ("SELECT id, mood(text) AS m FROM tweets ORDER BY id",
     "SELECT id, mood AS m FROM tweets ORDER BY id"),
    ("SELECT id FROM tweets WHERE fsem(text, 'delay') ORDER BY id",
     "SELECT id FROM tweets WHERE delay ORDER BY id"),
    ("SELECT id FROM tweets WHERE lang = 'en' AND NOT fsem(text, 'delay') ORDER BY id",
     "SELECT id FROM tweets WHERE lang = 'en' AND NOT delay ORDER BY id"),
    ("SELECT id FROM tweets WHERE fsem(text, 'delay') OR fsem(text, 'happy') OR id = 2 "
     "ORDER BY id", "SELECT id FROM tweets WHERE delay OR happy OR id = 2 ORDER BY id"),
    ("SELECT mood(text) AS m, count(*) AS n FROM tweets GROUP BY mood(text) ORDER BY m",
     "SELECT mood AS m, count(*) AS n FROM tweets GROUP BY mood ORDER BY m"),
    ("SELECT mood(text) AS m, count(*) AS n FROM tweets GROUP BY 1 HAVING count(*) > 1 "
     "ORDER BY 1", "SELECT mood AS m, count(*) AS n FROM tweets GROUP BY 1 "
     "HAVING count(*) > 1 ORDER BY 1"),
    ("WITH e AS (SELECT * FROM tweets WHERE lang = 'en') SELECT id, mood(text) FROM e "
     "WHERE fsem(text, 'happy') ORDER BY id",
     "WITH e AS (SELECT * FROM tweets WHERE lang = 'en') SELECT id, mood FROM e "
     "WHERE happy ORDER BY id"),
    ("SELECT id FROM (SELECT id, mood(text) AS m FROM tweets) s WHERE m = 'positive' "
     "ORDER BY id", "SELECT id FROM (SELECT id, mood AS m FROM tweets) s "
     "WHERE m = 'positive' ORDER BY id"),
    ("SELECT id FROM tweets WHERE id IN (SELECT id FROM tweets WHERE fsem(text, 'delay')) "
     "ORDER BY id", "SELECT id FROM tweets WHERE id IN (SELECT id FROM tweets WHERE delay) "
     "ORDER BY id"),
    ("SELECT id, text FROM tweets ORDER BY mood(text), id",
     "SELECT id, text FROM tweets ORDER BY mood, id"),
    ("SELECT t.id, p.pid FROM tweets t JOIN products p ON fmatch(t.text, p.title) "
     "ORDER BY 1, 2",
     "SELECT t.id, p.pid FROM tweets t JOIN products p ON true JOIN pairs x ON "
     "x.t IS NOT DISTINCT FROM t.text AND x.p IS NOT DISTINCT FROM p.title WHERE x.m "
     "ORDER BY 1, 2"),
    ("SELECT t.id, p.pid FROM tweets t JOIN products p ON t.id % 4 = p.pid AND "
     "fmatch(t.text, p.title) ORDER BY 1, 2",
     "SELECT t.id, p.pid FROM tweets t JOIN products p ON t.id % 4 = p.pid JOIN pairs x ON "
     "x.t IS NOT DISTINCT FROM t.text AND x.p IS NOT DISTINCT FROM p.title WHERE x.m "
     "ORDER BY 1, 2"),
    ("SELECT count(*) FILTER (WHERE fsem(text, 'happy')) AS h, count(mood(text)) FROM tweets",
     "SELECT count(*) FILTER (WHERE happy) AS h, count(mood) FROM tweets"),
    ("SELECT DISTINCT mood(text) FROM tweets WHERE text IS NOT NULL ORDER BY 1",
     "SELECT DISTINCT mood FROM tweets WHERE text IS NOT NULL ORDER BY 1"),
]


@pytest.mark.parametrize(("query", "brute"), CASES)
def test_semantic_queries_equal_brute_force(query: str, brute: str) -> None:
    s, _ = make_session()
    setup_tables(s)
    assert s.sql(query).fetchall() == brute_connection().sql(brute).fetchall()


def test_relational_predicates_run_first() -> None:
    s, models = make_session()
    setup_tables(s)
    s.sql("SELECT id FROM tweets WHERE lang = 'fr' AND fsem(text, 'delay')").fetchall()
    fr = {t for i, t in enumerate(TEXTS) if i % 3 == 0 and t is not None}
    seen = s._fakes_filters["f[delay]"].rows_seen  # type: ignore[attr-defined]
    assert sorted(seen) == sorted(fr)  # only rows passing lang = 'fr', each once
    s.sql("SELECT id FROM tweets WHERE fsem(text, 'happy') AND id > 8").fetchall()
    seen = s._fakes_filters["f[happy]"].rows_seen  # type: ignore[attr-defined]
    assert sorted(seen) == sorted({t for t in TEXTS[9:] if t is not None})


def test_duplicates_cause_one_model_call_each() -> None:
    s, models = make_session()
    s.register_table("many", pa.table({"t": ["x", "y", None, "x"] * 500}))
    result = s.sql("SELECT mood(t) AS m, count(*) FROM many GROUP BY 1 ORDER BY 1")
    assert sorted(models["a"].rows_seen) == ["x", "y"]
    stats = result.stats["s0"]
    assert stats.rows_in == 2000 and stats.null_rows == 500 and stats.distinct_evaluated == 2
    # the same call in two clauses is one site; qualified and bare columns share the memo
    s.sql("SELECT mood(many.t) FROM many WHERE mood(t) <> 'zzz'").fetchall()
    assert models["a"].rows_seen.count("x") == 2  # once per query, not per row or per site


def test_model_calls_are_batched() -> None:
    s, models = make_session()
    s.register_table("big", pa.table({"t": [f"tweet {i}" for i in range(5000)]}))
    s.sql("SELECT mood(t) FROM big").fetchall()
    assert sum(rows for rows, _ in models["a"].calls) == 5000
    assert len(models["a"].calls) <= 10  # DuckDB chunks of ~2048 rows, each one batched call
    assert all(batch == s.batch_size for _, batch in models["a"].calls)


def test_explain_and_analyze_add_up() -> None:
    s, _ = make_session()
    setup_tables(s)
    query = ("SELECT lang, mood(text) AS m FROM tweets WHERE lang = 'en' AND "
             "fsem(text, 'delay') ORDER BY 1")
    text = s.explain(query)
    assert "[ken]    Semantic filter s1:fsem(text)" in text
    assert "[duckdb] Filter lang = 'en'" in text
    assert "s0: mood(text)" in text and "cascade a -(0.500)-> b -(0.450)-> c" in text
    analyzed = str(s.sql("EXPLAIN ANALYZE " + query))
    assert "DuckDB physical plan" in analyzed
    result = s.sql("EXPLAIN " + query)
    assert result.columns == ["explain"]
    s2, _ = make_session()
    setup_tables(s2)
    out = s2.sql(query)
    for stats in out.stats.values():
        assert stats.rows_in == stats.null_rows + stats.distinct_evaluated + (
            stats.rows_in - stats.null_rows - stats.distinct_evaluated)
        assert sum(st.resolved_rows for st in stats.stages) == stats.distinct_evaluated
        assert stats.stages[0].input_rows == stats.distinct_evaluated


@pytest.mark.parametrize(("query", "match"), [
    ("SELECT moood(text) FROM tweets", "unknown function moood.*Did you mean 'mood'"),
    ("SELECT mood(text, text) FROM tweets", r"takes 1 argument"),
    ("SELECT fsem(text) FROM tweets", r"takes 2 argument"),
    ("SELECT fsem(text, lang) FROM tweets", "must be a string literal"),
    ("SELECT mood(id) FROM tweets", r"needs text arguments.*CAST\(id AS VARCHAR\)"),
    ("SELECT mood(text) FROM tweets WHERE (", "line 1, column"),
    ("SELECT id\nFROM tweets\nWHERE id >", "line 3"),
    ("SELECT nosuchcol FROM tweets", "nosuchcol"),
])
def test_errors_say_what_to_do(query: str, match: str) -> None:
    s, _ = make_session()
    setup_tables(s)
    with pytest.raises(ken.KenError, match=match):
        s.sql(query)


def test_result_conversions_and_sources(tmp_path) -> None:
    s, _ = make_session()
    setup_tables(s)
    r = s.sql("SELECT id, mood(text) AS m FROM tweets WHERE id < 3 ORDER BY id")
    assert r.arrow().num_rows == 3 and list(r.df().columns) == ["id", "m"]
    assert [row[0] for row in r.fetchall()] == [0, 1, 2]
    pa_path = tmp_path / "t.parquet"
    s.sql(f"COPY (SELECT * FROM tweets) TO '{pa_path}' (FORMAT parquet)")
    csv_path = tmp_path / "t.csv"
    # CSV reads an empty string back as NULL, so leave that row out of the comparison
    s.sql(f"COPY (SELECT id, text FROM tweets WHERE text <> '') TO '{csv_path}' (HEADER)")
    a = s.sql(f"SELECT mood(text) FROM '{pa_path}' WHERE text <> '' ORDER BY id").fetchall()
    b = s.sql(f"SELECT mood(text) FROM read_csv('{csv_path}') ORDER BY id").fetchall()
    assert a == b == s.sql("SELECT mood(text) FROM tweets WHERE text <> '' ORDER BY id"
                           ).fetchall()
    import pandas as pd

    s.register_table("pdf", pd.DataFrame({"t": ["great flight", None]}))
    assert s.sql("SELECT mood(t) FROM pdf").fetchall() == [(brute_mood("great flight"),),
                                                           (None,)]


def test_persistent_database(tmp_path) -> None:
    path = tmp_path / "db.duckdb"
    with ken.connect(path, builtins=False) as s:
        s.sql("CREATE TABLE t AS SELECT 1 AS x")
    with ken.connect(path, builtins=False) as s:
        assert s.sql("SELECT x FROM t").fetchall() == [(1,)]


def test_create_table_as_with_semantic_call() -> None:
    s, _ = make_session()
    setup_tables(s)
    s.sql("CREATE TABLE moods AS SELECT id, mood(text) AS m FROM tweets")
    assert s.sql("SELECT m FROM moods ORDER BY id").fetchall() == [
        (brute_mood(t),) for t in TEXTS]


@pytest.mark.parametrize("query", [
    "SELECT 1; DROP TABLE tweets",
    "SELECT mood(text) FROM tweets; DROP TABLE tweets",
    "SELECT 1 /* ; */; DROP TABLE tweets -- and a comment",
    "TRAIN mood ON tweets LABEL lang; DROP TABLE tweets",
])
def test_one_statement_per_call_nothing_runs(query: str) -> None:
    s, models = make_session()
    setup_tables(s)
    with pytest.raises(SqlError, match="one statement per call; this text holds 2"):
        s.sql(query)
    assert s.sql("SELECT count(*) FROM tweets").fetchall() == [(len(TEXTS),)]
    assert all(not m.calls for m in models.values())  # not even the first statement ran


def test_semicolons_inside_values_and_a_trailing_one_are_one_statement() -> None:
    s, _ = make_session()
    assert s.sql("SELECT ';' AS a, 'x; DROP TABLE t' AS b;").fetchall() == [
        (";", "x; DROP TABLE t")]
    assert s.sql('SELECT 1 AS "a;b" -- ; trailing\n').fetchall() == [(1,)]
    with pytest.raises(SqlError, match="empty query"):
        s.sql(" ; -- nothing\n")


def test_scripts_run_in_order_and_name_the_failing_statement() -> None:
    s, _ = make_session()
    setup_tables(s)
    out = s.sql_script("CREATE TABLE u AS SELECT 1 AS x; INSERT INTO u VALUES (2);\n"
                       "SELECT sum(x) AS total, count(mood(text)) AS n FROM u, tweets")
    assert out.fetchall() == [(3 * len(TEXTS), 2 * sum(t is not None for t in TEXTS))]
    with pytest.raises(SqlError, match=r"statement 2 of 3 failed .*the 1 before it ran"):
        s.sql_script("INSERT INTO u VALUES (3); SELECT nope(x) FROM u; DROP TABLE u")
    assert s.sql("SELECT sum(x) FROM u").fetchall() == [(6,)]  # the first ran, not the third


# -- relational queries: ken equals DuckDB ------------------------------------------------

COLS = ["id", "grp", "lang", "text"]
num = st.sampled_from(["id", "grp"])
preds = st.one_of(
    st.builds(lambda c, op, v: f"{c} {op} {v}", num, st.sampled_from(["<", ">=", "=", "<>"]),
              st.integers(-1, 12)),
    st.sampled_from(["lang = 'en'", "text IS NULL", "text LIKE '%a%'", "length(text) > 5"]),
)


def combine(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(st.builds(lambda a, b: f"({a} AND {b})", children, children),
                     st.builds(lambda a, b: f"({a} OR {b})", children, children),
                     st.builds(lambda a: f"NOT ({a})", children))


where = st.recursive(preds, combine, max_leaves=4)


@st.composite
def relational_query(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        key = draw(st.sampled_from(["grp", "lang", "grp, lang"]))
        agg = draw(st.sampled_from(["count(*)", "sum(id)", "max(text)", "count(text)"]))
        q = f"SELECT {key}, {agg} AS v FROM tweets WHERE {draw(where)} GROUP BY {key}"
        if draw(st.booleans()):
            q += " HAVING count(*) > 1"
        return q + f" ORDER BY {key}"
    cols = draw(st.lists(st.sampled_from(COLS), min_size=1, max_size=4, unique=True))
    q = f"SELECT {', '.join(cols)} FROM tweets WHERE {draw(where)} ORDER BY id"
    if draw(st.booleans()):
        q = f"WITH w AS ({q}) SELECT * FROM w"
    if draw(st.booleans()):
        q += f" LIMIT {draw(st.integers(0, 8))}"
    return q


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(relational_query())
def test_relational_queries_equal_duckdb(query: str) -> None:
    s, _ = make_session()
    setup_tables(s)
    expected = brute_connection().sql(query).fetchall()
    assert s.sql(query).fetchall() == expected
    # and the regenerated SQL that semantic queries go through means the same thing
    from ken.sql.rewrite import parse, rewrite

    rw = rewrite(parse(query)[0], s.operators, s.db.functions())
    assert brute_connection().sql(rw.sql).fetchall() == expected


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=where, extra=st.sampled_from(["", " AND fsem(text, 'delay')",
                                       " OR fsem(text, 'happy')"]))
def test_semantic_filters_under_random_predicates(w: str, extra: str) -> None:
    s, _ = make_session()
    setup_tables(s)
    query = f"SELECT id, mood(text) FROM tweets WHERE ({w}){extra} ORDER BY id"
    brute = query.replace("mood(text)", "mood").replace("fsem(text, 'delay')", "delay")
    brute = brute.replace("fsem(text, 'happy')", "happy")
    assert s.sql(query).fetchall() == brute_connection().sql(brute).fetchall()


def test_register_validation() -> None:
    s, models = make_session()
    with pytest.raises(ken.KenError, match="DuckDB function"):
        s.register("lower", models["a"])
    with pytest.raises(ken.KenError, match="models="):
        s.register("x", Cascade(("a",)))
    with pytest.raises(SqlError, match="empty"):
        s.sql("   ")


def test_explain_quotes_constants_as_sql() -> None:
    s, _ = make_session()
    setup_tables(s)
    text = s.explain("SELECT id FROM tweets WHERE fsem(text, 'it''s late')")
    assert "s0: fsem(text, 'it''s late')" in text
    assert [r[0] for r in s.sql("SELECT fsem('x', 'it''s late')").fetchall()] in ([True],
                                                                                  [False])


@pytest.mark.parametrize("text", [None, 123, b"SELECT 1"])
def test_sql_that_is_not_text_is_an_error(text) -> None:  # noqa: ANN001
    s, _ = make_session()
    for run in (s.sql, s.sql_script, s.explain):
        with pytest.raises(SqlError, match="SQL must be given as a str"):
            run(text)
