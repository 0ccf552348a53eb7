"""DataFrame-style API: each method returns a new ``Frame`` holding a SQL query (sqlglot AST)
that goes through exactly the same planner as ``session.sql`` — one logical plan, two front ends.

Arguments that name something (a table, a column, a new column, a function) are identifiers:
they are built as identifier nodes and quoted wherever SQL needs it (spaces, quotes, keywords),
so any name works and none can inject SQL. Arguments that are conditions or expressions
(``filter``, ``join``'s ``on``, ``with_column``'s value) are SQL text the program writes; a
string given to ``select``/``order_by`` that is one of the frame's column names is that column,
anything else is parsed as an expression. ``col(name)`` names a column anywhere.

>>> import ken
>>> s = ken.connect()
>>> s.sql("CREATE TABLE t AS SELECT * FROM (VALUES (1, 'en', 'ok')) v(id, lang, text)")
>>> s.table("t").filter("lang = 'en'").select("id").to_arrow().num_rows
1
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import duckdb
import pyarrow as pa
from sqlglot import exp

from ken.errors import KenError
from ken.ops.base import Operator, sql_type
from ken.sql.result import Result
from ken.sql.rewrite import parse


class Session(Protocol):
    """What a frame needs of ``ken.Session`` (the frame sits below the session's layer)."""

    con: duckdb.DuckDBPyConnection
    operators: Mapping[str, Operator]

    def sql(self, query: str) -> Result: ...

    def explain(self, query: str, analyze: bool = False) -> str: ...


_FUNCTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Col:
    """A column by name (any characters), optionally of table or alias ``table``."""

    name: str
    table: str | None = None

    def expression(self) -> exp.Column:
        if not isinstance(self.name, str) or not self.name:
            raise KenError(f"a column name must be a non-empty string, got {self.name!r}")
        return exp.column(exp.to_identifier(self.name),
                          table=exp.to_identifier(self.table) if self.table else None)


def col(name: str, table: str | None = None) -> Col:
    """``col("my col")`` → the column ``"my col"``; ``col("title", "l")`` → ``l.title``."""
    return Col(name, table)


@dataclass(frozen=True)
class Call:
    """A semantic (or any SQL) function call on columns, e.g. ``call("sentiment", "text")``.

    A string argument is a column name (``"l.title"``: column ``title`` of ``l``; a name with a
    dot of its own needs ``col``)."""

    function: str
    args: tuple[str | Col, ...]

    def expression(self) -> exp.Expression:
        if not isinstance(self.function, str) or not _FUNCTION_NAME.fullmatch(self.function):
            raise KenError(f"{self.function!r} is not a function name (letters, digits and _)")
        args = [_column(a).expression() for a in self.args]
        return exp.Anonymous(this=self.function, expressions=args)

    def sql(self) -> str:
        return self.expression().sql(dialect="duckdb")


def call(function: str, *args: str | Col) -> Call:
    """``call("sentiment", "text")`` → the expression ``sentiment(text)``."""
    return Call(function, tuple(args))


def _column(value: str | Col) -> Col:
    if isinstance(value, Col):
        return value
    if not isinstance(value, str):
        raise KenError(f"a column name must be a string or col(...), got {value!r}")
    table, dot, name = value.rpartition(".")
    return Col(name, table) if dot and table and name else Col(value)


def literal(text: str) -> str:
    return exp.Literal.string(text).sql(dialect="duckdb")


Expr = str | Call | Col | exp.Expression  # an expression node as built here


def _expr(value: Expr, columns: list[str] | None = None) -> exp.Expression:
    """An expression node: calls and columns as built; a string that is one of ``columns``
    is that column, any other string is parsed as SQL."""
    if isinstance(value, exp.Expression):
        return value
    if isinstance(value, (Call, Col)):
        return value.expression()
    text = str(value)
    if columns is not None and text in columns:
        return Col(text).expression()
    try:
        return exp.maybe_parse(text, dialect="duckdb")
    except Exception as error:  # sqlglot raises several error types
        raise KenError(f"cannot parse expression {text!r}: {error}; a column whose name is "
                       "not plain SQL can be named with ken.col(...)") from None


class Frame:
    """An immutable query under construction; nothing runs until ``to_arrow``/``explain``."""

    def __init__(self, session: Session, query: exp.Select) -> None:
        self.session = session
        self.query = query
        self._alias = 0

    @classmethod
    def from_table(cls, session: Session, name: str) -> Frame:
        if not isinstance(name, str) or not name:
            raise KenError(f"a table name must be a non-empty string, got {name!r}")
        return cls(session, exp.select("*").from_(exp.Table(this=exp.to_identifier(name))))

    def _simple(self) -> bool:
        """True when new filters can go into this SELECT's WHERE instead of a wrapper."""
        q = self.query
        plain = len(q.expressions) == 1 and isinstance(q.expressions[0], exp.Star)
        clauses = ("group", "having", "order", "limit", "distinct", "offset", "joins")
        return plain and not any(q.args.get(k) for k in clauses)

    def _wrapped(self) -> exp.Select:
        alias = f"_f{id(self.query) % 10_000:04d}"
        return exp.select("*").from_(self.query.subquery(alias))

    def _with(self, query: exp.Select) -> Frame:
        return Frame(self.session, query)

    # -- relational ------------------------------------------------------------------------

    def filter(self, condition: Expr) -> Frame:
        """Keep rows where the SQL ``condition`` holds (may contain semantic calls)."""
        base = self.query.copy() if self._simple() else self._wrapped()
        return self._with(base.where(_expr(condition), copy=False))

    where = filter

    def select(self, *columns: Expr) -> Frame:
        names = self._names(columns)
        base = self._wrapped() if self.query.args.get("limit") else self.query.copy()
        if not base.expressions or not all(isinstance(e, exp.Star) for e in base.expressions):
            base = self._wrapped()
        base.set("expressions", [_expr(c, names) for c in columns])
        return self._with(base)

    def with_column(self, name: str, value: Expr) -> Frame:
        """Add (or replace) column ``name`` computed by ``value``."""
        if not isinstance(name, str) or not name:
            raise KenError(f"a column name must be a non-empty string, got {name!r}")
        base = self._wrapped()
        column = exp.alias_(_expr(value), exp.to_identifier(name))
        if name in self.columns():  # keep the column's position, like pandas assignment
            base.set("expressions", [exp.Star(replace=[column])])
        else:
            base.set("expressions", [exp.Star(), column])
        return self._with(base)

    def order_by(self, *keys: Expr) -> Frame:
        names = self._names(keys)
        base = self.query.copy() if not self.query.args.get("limit") else self._wrapped()
        return self._with(base.order_by(*[_expr(k, names) for k in keys], copy=False))

    def _names(self, values: tuple[Expr, ...]) -> list[str] | None:
        """The frame's column names, looked up only when a string argument might be one."""
        if any(isinstance(v, str) and not _FUNCTION_NAME.fullmatch(v) for v in values):
            return self.columns()
        return None

    def limit(self, n: int) -> Frame:
        if n < 0:
            raise KenError(f"limit must be non-negative, got {n}")
        return self._with(self.query.copy().limit(n, copy=False))

    def join(self, other: Frame, on: Expr, how: str = "inner") -> Frame:
        """Join with ``other``; refer to the two sides as ``l`` and ``r`` in ``on``."""
        if how.lower() not in ("inner", "left", "right", "full", "cross"):
            raise KenError(f"unknown join type {how!r}; use inner, left, right, full or cross")
        left = self.query.subquery("l")
        right = other.query.subquery("r")
        query = exp.select("*").from_(left).join(right, on=_expr(on), join_type=how)
        return self._with(query)

    # -- semantic --------------------------------------------------------------------------

    def sem_filter(self, column: str, predicate: str, function: str = "sem_filter") -> Frame:
        """Keep rows whose ``column`` satisfies the natural-language ``predicate``."""
        if not isinstance(predicate, str):
            raise KenError(f"the predicate must be a string, got {predicate!r}")
        node = call(function, column).expression()
        node.append("expressions", exp.Literal.string(predicate))
        return self.filter(node)

    def sem_map(self, column: str, function: str = "sentiment", name: str | None = None
                ) -> Frame:
        """Add column ``name`` (default: the function's name) = ``function(column)``."""
        return self.with_column(name or function, call(function, column))

    def sem_join(self, other: Frame, left: str, right: str, function: str = "sem_match",
                 how: str = "inner") -> Frame:
        """Join rows whose ``l.left`` and ``r.right`` match by a semantic function."""
        return self.join(other, call(function, col(left, "l"), col(right, "r")), how)

    # -- output ----------------------------------------------------------------------------

    def sql(self) -> str:
        return self.query.sql(dialect="duckdb")

    def collect(self) -> Result:
        return self.session.sql(self.sql())

    def to_arrow(self) -> pa.Table:
        return self.collect().arrow()

    def to_pandas(self) -> Any:
        return self.collect().df()

    def explain(self, analyze: bool = False) -> str:
        return self.session.explain(self.sql(), analyze=analyze)

    def columns(self) -> list[str]:
        rows = self.session.con.sql(f"DESCRIBE {_relational_probe(self)}").fetchall()
        return [r[0] for r in rows]

    def __repr__(self) -> str:
        return f"Frame({self.sql()})"


def _relational_probe(frame: Frame) -> str:
    """The frame's query with semantic calls replaced by NULLs of their type, for DESCRIBE."""
    query = parse(frame.sql())[0]
    operators = frame.session.operators
    for node in list(query.find_all(exp.Anonymous)):
        name = str(node.this).lower()
        if name in operators:
            kind = sql_type(operators[name].output_type)
            node.replace(exp.cast(exp.null(), kind))
    return query.sql(dialect="duckdb")


__all__ = ["Call", "Frame", "call"]
