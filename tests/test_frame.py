"""The DataFrame API builds the same plans as SQL and returns the same results."""

from __future__ import annotations

import pyarrow as pa
import pytest
from test_sql import brute_bool, brute_connection, brute_mood, make_session, setup_tables

import ken


@pytest.fixture()
def session() -> ken.Session:
    s, _ = make_session()
    setup_tables(s)
    return s


def test_frame_equals_sql(session) -> None:
    frame = (session.table("tweets").filter("lang = 'en'")
             .sem_filter("text", "delay", function="fsem")
             .with_column("m", ken.call("mood", "text")).select("id", "m").order_by("id"))
    expected = brute_connection().sql(
        "SELECT id, mood AS m FROM tweets WHERE lang = 'en' AND delay ORDER BY id").fetchall()
    assert [tuple(r.values()) for r in frame.to_arrow().to_pylist()] == expected
    assert list(frame.to_pandas().columns) == ["id", "m"]


def test_frame_plan_is_the_sql_plan(session) -> None:
    frame = session.table("tweets").filter("lang = 'en'").sem_filter("text", "delay",
                                                                      function="fsem")
    sql = "SELECT * FROM tweets WHERE lang = 'en' AND fsem(text, 'delay')"
    assert frame.explain() == session.explain(sql)
    assert "Semantic filter s0:fsem(text)" in frame.explain()


def test_sem_map_sem_join_limit(session) -> None:
    mapped = session.table("tweets").sem_map("text", "mood").order_by("id").limit(4)
    assert mapped.columns() == ["id", "text", "lang", "grp", "mood"]
    assert mapped.to_arrow().column("mood").to_pylist() == [
        r[0] for r in brute_connection().sql("SELECT mood FROM tweets ORDER BY id LIMIT 4")
        .fetchall()]
    joined = (session.table("tweets")
              .sem_join(session.table("products"), "text", "title", function="fmatch")
              .select("l.id", "r.pid").order_by("1", "2"))
    expected = brute_connection().sql(
        "SELECT DISTINCT t.id, p.pid FROM tweets t, products p, pairs x WHERE "
        "x.t IS NOT DISTINCT FROM t.text AND x.p IS NOT DISTINCT FROM p.title AND x.m "
        "ORDER BY 1, 2").fetchall()
    assert joined.collect().fetchall() == expected
    replaced = session.table("tweets").with_column("text", "upper(text)").order_by("id")
    assert replaced.columns() == ["id", "text", "lang", "grp"]


def test_frame_errors(session) -> None:
    with pytest.raises(ken.KenError, match="join type"):
        session.table("tweets").join(session.table("products"), "true", how="sideways")
    with pytest.raises(ken.KenError, match="non-negative"):
        session.table("tweets").limit(-1)
    with pytest.raises(ken.KenError, match="unknown function"):
        session.table("tweets").sem_map("text", "moood").to_arrow()
    arrow = session.table("tweets").to_arrow()
    assert session.from_arrow(arrow).filter("id < 2").to_arrow().num_rows == 2


ODD = ["my text", "select", 'we"ird', "x'); DROP TABLE tweets; --"]


def test_any_name_is_an_identifier_never_sql(session) -> None:
    texts = ["great flight", None, "meh", "lost my bag"]
    session.register_table("my tweets", pa.table({
        "id": [0, 1, 2, 3], **{name: texts for name in ODD}}))
    base = session.table("my tweets")
    for name in ODD:
        frame = (base.sem_filter(name, "it's a delay", function="fsem")
                 .sem_map(name, "mood", name=f"{name} mood")
                 .with_column(f"{name}!", ken.call("mood", name))
                 .select("id", f"{name} mood", f"{name}!").order_by("id"))
        expected = [(i, brute_mood(t), brute_mood(t)) for i, t in enumerate(texts)
                    if brute_bool("f[it's a delay]", t)]
        assert frame.collect().fetchall() == expected, frame.sql()
        pairs = base.sem_join(base, name, name, function="fmatch").select(
            ken.col("id", "l"), ken.col("id", "r")).order_by("1", "2")
        assert pairs.collect().fetchall() == [
            (i, j) for i, a in enumerate(texts) for j, b in enumerate(texts)
            if brute_bool("pair", a, b)]
    assert session.sql("SELECT count(*) FROM tweets").fetchall() == [(12,)]
    with pytest.raises(ken.KenError, match="not a function name"):
        base.sem_map(ODD[0], "mood(x); --")
    with pytest.raises(ken.KenError, match="ken.col"):
        base.select("no such column + ")
