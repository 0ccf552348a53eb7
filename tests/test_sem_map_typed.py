"""Typed ``sem_map`` (issue 34, item 2): ``'instruction' RETURNS INTEGER | DOUBLE | BOOLEAN |
STRUCT(...)`` gives a column of that type whose values parse from the model's answers (NULL
when they do not), through SQL; the rewrite that reads ``RETURNS`` leaves every other query as
written."""

from __future__ import annotations

import pyarrow as pa
import pytest
from conftest import FAMILY_DEVICE, SMALL_FAMILY
from test_easy_rows import QWEN, qwen_home  # found before ``home`` moves KEN_HOME

import ken
from ken.errors import DataError, KenError, SqlError
from ken.ops.base import is_output_type, sql_type, to_sql_value
from ken.ops.sem_map import (
    parse_number,
    split_returns,
    sql_output_type,
    struct_value,
    typed_value,
)
from ken.sql.rewrite import merge_returns

TEXTS = ["I bought three apples and two pears for 4.50 dollars.", None,
         "The meeting has 12 people and lasts an hour.", "  "]


def test_answers_parse_as_the_type_or_are_null() -> None:
    assert parse_number("There are three people.") == 3.0
    assert parse_number("About 1,250.5 dollars, not 7") == 1250.5
    assert parse_number("-2") == -2.0 and parse_number("Twelve") == 12.0
    assert parse_number("no number here") is None
    assert typed_value("integer", "4.0") == 4 and typed_value("integer", "2.5") is None
    assert typed_value("double", "It costs 4.50.") == 4.5
    assert typed_value("boolean", "Yes, it is.") is True
    assert typed_value("boolean", "false") is False and typed_value("boolean", "maybe") is None
    assert split_returns("How many? RETURNS int") == ("How many?", "integer")
    assert split_returns("a\nb returns Boolean") == ("a\nb", "boolean")
    assert split_returns("Summarise") == ("Summarise", "varchar")
    for bad in ("x RETURNS STRUCT", "x RETURNS DATE", " RETURNS INTEGER",
                "x RETURNS STRUCT(a DATE)", "x RETURNS STRUCT(a)", "x RETURNS STRUCT(a INT, A INT)",
                "x RETURNS STRUCT(a STRUCT(b INT))", "x RETURNS STRUCT(1a INT)"):
        with pytest.raises(DataError):
            split_returns(bad)


def test_returns_is_merged_into_the_string_and_nothing_else_changes() -> None:
    q = "SELECT sem_map(x, 'How many? it''s' RETURNS integer), 'a' AS b FROM t"
    assert merge_returns(q) == ("SELECT sem_map(x, 'How many? it''s RETURNS INTEGER'), "
                                "'a' AS b FROM t")
    for same in ("SELECT 'RETURNS INTEGER' FROM t", "SELECT sem_map(x, 'a') FROM t",
                 "SELECT returns FROM t", "SELECT 'a' returns, 1 FROM t",
                 "SELECT 'unclosed"):
        assert merge_returns(same) == same
    assert merge_returns("SELECT sem_map(x, 'Who?' RETURNS STRUCT(name VARCHAR, born INT)) "
                         "AS p, 1 FROM t") == ("SELECT sem_map(x, 'Who? RETURNS STRUCT(name "
                                               "VARCHAR, born INT)') AS p, 1 FROM t")
    with pytest.raises(SqlError, match="closing parenthesis"):
        merge_returns("SELECT sem_map(x, 'a' RETURNS STRUCT(a INT FROM t")


def test_struct_answers_parse_field_by_field() -> None:
    assert split_returns("Who? RETURNS STRUCT(name VARCHAR, born INT)") == (
        "Who?", "struct(name varchar, born integer)")
    out = sql_output_type("Who? RETURNS struct(name text, born bigint, ok bool, w float)")
    assert out == "struct(name varchar, born bigint, ok boolean, w double)"
    assert is_output_type(out) and not is_output_type("struct(a date)")
    assert sql_type(out) == 'STRUCT("name" VARCHAR, "born" BIGINT, "ok" BOOLEAN, "w" DOUBLE)'
    fields = (("name", "varchar"), ("born", "integer"), ("ok", "boolean"))
    assert struct_value(fields, '{"name": "Ada", "born": 1815, "ok": true}') == {
        "name": "Ada", "born": 1815, "ok": True}
    # cut at the stop string "}", in a code fence, keys in another case, values as text
    assert struct_value(fields, '```json\n{"Name": "Ada", "born": "about 1815"') == {
        "name": "Ada", "born": 1815, "ok": None}
    # not JSON: the "key": value pairs that can be read
    assert struct_value(fields, "{'x': 1, \"born\": 1900, \"ok\": no") == {
        "name": None, "born": 1900, "ok": False}
    for nothing in ("I do not know.", "{}", '{"other": 3}', '{"born": "unknown"}'):
        assert struct_value(fields, nothing) is None
    assert to_sql_value({"name": "Ada", "born": 1815.0}, "struct(name varchar, born bigint)") \
        == {"name": "Ada", "born": 1815}
    with pytest.raises(DataError, match="not a record"):
        to_sql_value("Ada", "struct(name varchar)")


@pytest.mark.models
def test_typed_sem_map_in_sql(home) -> None:  # noqa: ANN001
    s = ken.connect(device=FAMILY_DEVICE, data=SMALL_FAMILY, home=home)
    try:
        s.operators["sem_map"].llms = ("smollm2-135m",)
        s.register_table("t", pa.table({"id": list(range(len(TEXTS))), "x": TEXTS}))
        query = ("SELECT id, sem_map(x, 'How many fruits are mentioned?' RETURNS INTEGER) AS n, "
                 "sem_map(x, 'Is the text about fruit?' RETURNS BOOLEAN) AS f, "
                 "sem_map(x, 'What is the price in dollars?' RETURNS DOUBLE) AS p FROM t "
                 "ORDER BY id")
        table = s.sql(query).arrow()
        assert [str(table.schema.field(c).type) for c in ("n", "f", "p")] == [
            "int64", "bool", "double"]
        rows = list(zip(*(table[c].to_pylist() for c in ("id", "n", "f", "p")), strict=True))
        for (_, n, f, p), text in zip(rows, TEXTS, strict=True):
            assert n is None or isinstance(n, int)
            assert f is None or isinstance(f, bool)
            assert p is None or isinstance(p, float)
            if text is None or not text.strip():
                assert (n, f, p) == (None, None, None)
        # each value is the row's answer, parsed: the same as the model asked row by row
        for column, constant in ((1, "How many fruits are mentioned? RETURNS INTEGER"),
                                 (2, "Is the text about fruit? RETURNS BOOLEAN")):
            bound = s.bind("sem_map", (constant,))
            model = bound.models[bound.cascade.models[0]]
            expected = bound.to_sql_values(model.predict([TEXTS[0]]).values)[0]
            assert rows[0][column] == expected
        with pytest.raises(KenError, match="STRUCT|cannot return"):
            s.sql("SELECT sem_map(x, 'a' RETURNS DATE) FROM t")
    finally:
        s.close()


@pytest.mark.models
def test_struct_sem_map_in_sql(home, monkeypatch) -> None:  # noqa: ANN001
    """A STRUCT column through SQL: its type, fields readable with ``.name``, NULL rows kept;
    Qwen (the second stage of the default cascade) gets the obvious rows right."""
    bios = ["Ada Lovelace was born in London in 1815 and wrote the first published algorithm.",
            "Alan Turing, born in 1912 in Maida Vale, broke the Enigma code.",
            "Marie Curie (born 1867, Warsaw) won two Nobel prizes.", None]
    s = ken.connect(device=FAMILY_DEVICE, home=qwen_home(home, monkeypatch))
    try:
        s.operators["sem_map"].llms = (QWEN,)
        s.register_table("people", pa.table({"id": list(range(4)), "bio": bios}))
        table = s.sql("SELECT id, sem_map(bio, 'Who is the person and in what year were they "
                      "born?' RETURNS STRUCT(name VARCHAR, born INTEGER)) AS p FROM people "
                      "ORDER BY id").arrow()
        assert str(table.schema.field("p").type) == "struct<name: string, born: int64>"
        got = table["p"].to_pylist()
        assert [p["born"] for p in got[:3]] == [1815, 1912, 1867]
        assert [p["name"].split()[-1] for p in got[:3]] == ["Lovelace", "Turing", "Curie"]
        assert got[3] is None
        born = s.sql("SELECT (sem_map(bio, 'Who is the person and in what year were they "
                     "born?' RETURNS STRUCT(name VARCHAR, born INTEGER))).born FROM people "
                     "ORDER BY id").fetchall()
        assert [b for (b,) in born] == [1815, 1912, 1867, None]
    finally:
        s.close()
