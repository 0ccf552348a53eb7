"""Typed ``sem_map`` (issue 34, item 2): ``'instruction' RETURNS INTEGER | DOUBLE | BOOLEAN``
gives a column of that type whose values parse from the model's answers (NULL when they do
not), through SQL; the rewrite that reads ``RETURNS`` leaves every other query as written."""

from __future__ import annotations

import pyarrow as pa
import pytest
from conftest import FAMILY_DEVICE, SMALL_FAMILY

import ken
from ken.errors import DataError, KenError, SqlError
from ken.ops.sem_map import parse_number, split_returns, typed_value
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
    for bad in ("x RETURNS STRUCT", "x RETURNS DATE", " RETURNS INTEGER"):
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
    with pytest.raises(SqlError, match="STRUCT"):
        merge_returns("SELECT sem_map(x, 'a' RETURNS STRUCT(a INT)) FROM t")


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
