"""The DataFrame API builds the same plans as SQL and returns the same results."""

from __future__ import annotations

import pytest
from test_sql import brute_connection, make_session, setup_tables

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
