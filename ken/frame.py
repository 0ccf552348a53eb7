"""DataFrame-style API: each method returns a new ``Frame`` holding a SQL query (sqlglot AST)
that goes through exactly the same planner as ``session.sql`` — one logical plan, two front ends.

>>> import ken
>>> s = ken.connect()
>>> s.sql("CREATE TABLE t AS SELECT * FROM (VALUES (1, 'en', 'ok')) v(id, lang, text)")
>>> s.table("t").filter("lang = 'en'").select("id").to_arrow().num_rows
1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from sqlglot import exp

from ken.errors import KenError
from ken.ops.base import SQL_TYPES
from ken.sql.rewrite import parse

if TYPE_CHECKING:
    from ken.session import Result, Session


@dataclass(frozen=True)
class Call:
    """A semantic (or any SQL) function call on columns, e.g. ``call("sentiment", "text")``."""

    function: str
    args: tuple[str, ...]

    def sql(self) -> str:
        return f"{self.function}({', '.join(self.args)})"


def call(function: str, *args: str) -> Call:
    """``call("sentiment", "text")`` → the expression ``sentiment(text)``."""
    return Call(function, tuple(args))


def literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _expr(value: str | Call) -> exp.Expression:
    text = value.sql() if isinstance(value, Call) else str(value)
    try:
        return exp.maybe_parse(text, dialect="duckdb")
    except Exception as error:  # sqlglot raises several error types
        raise KenError(f"cannot parse expression {text!r}: {error}") from None


class Frame:
    """An immutable query under construction; nothing runs until ``to_arrow``/``explain``."""

    def __init__(self, session: Session, query: exp.Select) -> None:
        self.session = session
        self.query = query
        self._alias = 0

    @classmethod
    def from_table(cls, session: Session, name: str) -> Frame:
        return cls(session, exp.select("*").from_(exp.to_table(name)))

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

    def filter(self, condition: str | Call) -> Frame:
        """Keep rows where the SQL ``condition`` holds (may contain semantic calls)."""
        base = self.query.copy() if self._simple() else self._wrapped()
        return self._with(base.where(_expr(condition), copy=False))

    where = filter

    def select(self, *columns: str | Call) -> Frame:
        base = self._wrapped() if self.query.args.get("limit") else self.query.copy()
        if not base.expressions or not all(isinstance(e, exp.Star) for e in base.expressions):
            base = self._wrapped()
        base.set("expressions", [_expr(c) for c in columns])
        return self._with(base)

    def with_column(self, name: str, value: str | Call) -> Frame:
        """Add (or replace) column ``name`` computed by ``value``."""
        base = self._wrapped()
        column = exp.alias_(_expr(value), name)
        if name in self.columns():  # keep the column's position, like pandas assignment
            base.set("expressions", [exp.Star(replace=[column])])
        else:
            base.set("expressions", [exp.Star(), column])
        return self._with(base)

    def order_by(self, *keys: str) -> Frame:
        base = self.query.copy() if not self.query.args.get("limit") else self._wrapped()
        return self._with(base.order_by(*[_expr(k) for k in keys], copy=False))

    def limit(self, n: int) -> Frame:
        if n < 0:
            raise KenError(f"limit must be non-negative, got {n}")
        return self._with(self.query.copy().limit(n, copy=False))

    def join(self, other: Frame, on: str, how: str = "inner") -> Frame:
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
        return self.filter(f"{function}({column}, {literal(predicate)})")

    def sem_map(self, column: str, function: str = "sentiment", name: str | None = None
                ) -> Frame:
        """Add column ``name`` (default: the function's name) = ``function(column)``."""
        return self.with_column(name or function, call(function, column))

    def sem_join(self, other: Frame, left: str, right: str, function: str = "sem_match",
                 how: str = "inner") -> Frame:
        """Join rows whose ``l.left`` and ``r.right`` match by a semantic function."""
        return self.join(other, f"{function}(l.{left}, r.{right})", how)

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
            kind = SQL_TYPES[operators[name].output_type]
            node.replace(exp.cast(exp.null(), kind))
    return query.sql(dialect="duckdb")


__all__ = ["Call", "Frame", "call"]
