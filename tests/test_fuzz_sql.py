"""SQL fuzz test (issue 19): generated queries mixing semantic functions with joins,
aggregates, subqueries, NULLs, duplicates and odd identifiers never end in a raw exception, and
their results equal a row-by-row evaluation.

The reference is plain DuckDB running the same query text, with each semantic function a Python
UDF that evaluates one row at a time by the brute-force loops of ``test_sql`` (cascade stage by
stage, thresholds by hand). Where DuckDB rejects a query, ken must raise a ``KenError``.
``KEN_FUZZ_EXAMPLES`` sets the number of generated queries (default 150; e.g. 5000 for a long
run).
"""

from __future__ import annotations

import os

import duckdb
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_sql import brute_bool, brute_mood, make_session

import ken

EXAMPLES = int(os.environ.get("KEN_FUZZ_EXAMPLES", "150"))

TEXTS = ["great flight", None, "delayed again", "", "great flight", "it's 'quoted'; -- x",
         "lost my bag", None, "[SEP] <|im_start|>", "delayed again", "so so", "ünïcode ✈"]
TITLES = ["great flight", None, "meh", "delayed again", "", "ünïcode ✈"]
TWEETS = '"my tweets"'
PRODUCTS = '"pro""ducts"'
TEXT_COLUMNS = ['"text col"', '"select"']  # a name with a space, a keyword


def tables() -> dict[str, pa.Table]:
    n = len(TEXTS)
    return {
        "my tweets": pa.table({
            "id": list(range(n)), "text col": TEXTS, "select": TEXTS[::-1],
            "lang": ["en" if i % 3 else None if i == 3 else "fr" for i in range(n)],
            "grp": [None if i == 5 else i % 4 for i in range(n)]}),
        'pro"ducts': pa.table({"pid": list(range(len(TITLES))), "ti tle": TITLES}),
    }


def reference() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    for name, table in tables().items():
        con.register(name, table)
    con.create_function("mood", brute_mood, ["VARCHAR"], "VARCHAR")
    con.create_function("fsem", lambda text, p: brute_bool(f"f[{p}]", text),
                        ["VARCHAR", "VARCHAR"], "BOOLEAN")
    con.create_function("fmatch", lambda a, b: brute_bool("pair", a, b),
                        ["VARCHAR", "VARCHAR"], "BOOLEAN")
    return con


def session() -> ken.Session:
    s, _ = make_session()
    for name, table in tables().items():
        s.register_table(name, table)
    return s


text_col = st.sampled_from(TEXT_COLUMNS)
predicate = st.sampled_from(["delay", "it''s; DROP TABLE x --", "[SEP]"])
semantic = st.one_of(
    st.builds(lambda c: f"mood({c})", text_col),
    st.builds(lambda c, p: f"fsem({c}, '{p}')", text_col, predicate),
)
leaf = st.one_of(
    st.builds(lambda c, p: f"fsem({c}, '{p}')", text_col, predicate),
    st.builds(lambda c, v: f"mood({c}) {v}", text_col,
              st.sampled_from(["= 'positive'", "<> 'negative'", "IS NULL", "IS NOT NULL"])),
    st.builds(lambda k: f"id < {k}", st.integers(-1, 13)),
    st.builds(lambda c, x: f"{c} {x}", text_col,
              st.sampled_from(["IS NULL", "LIKE '%a%'", "= ''", "IN ('great flight', NULL)"])),
    st.sampled_from(["lang = 'en'", "grp IS NULL", "grp >= 2", "lang IS DISTINCT FROM 'fr'"]),
)
condition = st.recursive(
    leaf,
    lambda inner: st.one_of(st.builds(lambda a, b: f"({a} AND {b})", inner, inner),
                            st.builds(lambda a, b: f"({a} OR {b})", inner, inner),
                            st.builds(lambda a: f"NOT ({a})", inner)),
    max_leaves=4)


@st.composite
def projection(draw: st.DrawFn) -> str:
    d = draw(st.integers(0, 2))
    q = f"SELECT id, {', '.join(draw(st.lists(semantic, min_size=1, max_size=3)))} " \
        f"FROM {TWEETS} WHERE {draw(condition)} ORDER BY id"
    if d == 1:
        q = f"WITH w AS ({q}) SELECT * FROM w"
    elif d == 2:
        q = f"SELECT * FROM ({q}) AS s WHERE s.id % 2 = 0"
    if draw(st.booleans()):
        q += f" LIMIT {draw(st.integers(0, 6))}"
    return q


@st.composite
def aggregate(draw: st.DrawFn) -> str:
    key = draw(st.sampled_from(["grp", "lang", "mood(\"text col\")", "fsem(\"select\", 'delay')"]))
    value = draw(st.sampled_from([
        "count(*)", "sum(id)", 'count(mood("select"))', 'max(mood("text col"))',
        "count(*) FILTER (WHERE fsem(\"text col\", 'delay'))", 'count(DISTINCT "text col")']))
    q = f"SELECT {key} AS k, {value} AS v FROM {TWEETS} WHERE {draw(condition)} GROUP BY 1"
    if draw(st.booleans()):
        q += " HAVING count(*) > 1"
    return q


@st.composite
def join(draw: st.DrawFn) -> str:
    how = draw(st.sampled_from(["JOIN", "LEFT JOIN"]))
    on = draw(st.sampled_from([
        'fmatch(t."text col", p."ti tle")', 't.grp = p.pid AND fmatch(t."select", p."ti tle")',
        't.grp = p.pid']))
    where = draw(st.one_of(
        st.sampled_from(["", " WHERE fsem(p.\"ti tle\", 'delay') OR t.id < 3"]),
        condition.map(lambda c: f" WHERE {c}")))  # unqualified names are t's
    return f"SELECT t.id, p.pid FROM {TWEETS} AS t {how} {PRODUCTS} AS p ON {on}{where}"


@st.composite
def distinct(draw: st.DrawFn) -> str:
    return f"SELECT DISTINCT {draw(semantic)} AS v FROM {TWEETS} WHERE {draw(condition)}"


query = st.one_of(*[strategy().map(lambda q, shape=strategy.__name__: (shape, q))
                    for strategy in (projection, aggregate, join, distinct)])


def rows(result: list[tuple]) -> list[tuple]:
    return sorted(result, key=repr)  # every query's rows as a multiset (LIMIT only on ORDER BY id)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(query)
def test_generated_queries_equal_row_by_row_evaluation(shaped: tuple[str, str]) -> None:
    shape, sql = shaped
    try:
        expected = reference().sql(sql).fetchall()
    except duckdb.Error as error:
        event(f"DuckDB rejects it: {type(error).__name__}")
        with pytest.raises(ken.KenError):  # ken refuses it too, as a KenError
            session().sql(sql).fetchall()
        return
    event(shape)
    got = session().sql(sql).fetchall()  # any exception but a pass fails the test
    if " LIMIT " in sql:
        assert got == expected, sql
    else:
        assert rows(got) == rows(expected), sql


def test_the_reference_is_row_by_row() -> None:
    """The reference itself: the UDFs see one row per call and NULLs as None."""
    con = reference()
    assert con.sql(f'SELECT mood("text col") FROM {TWEETS} ORDER BY id').fetchall() == [
        (brute_mood(t),) for t in TEXTS]
    assert con.sql(f"SELECT count(*) FROM {TWEETS} WHERE fsem(\"select\", 'delay')"
                   ).fetchall() == [(sum(bool(brute_bool("f[delay]", t)) for t in TEXTS[::-1]),)]
