"""``WHERE <semantic predicate> ... LIMIT k`` that stops calling models once k rows pass
(issue 35, item 2).

DuckDB hands a vectorised function up to 2,048 rows at a time, so a table of a few thousand
rows reaches the models whole before DuckDB's LIMIT can stop anything. A query of the shape

    SELECT <anything> FROM <one table, view, file or subquery> WHERE <... semantic ...>
    LIMIT k [OFFSET m]

(no ORDER BY, GROUP BY, HAVING, DISTINCT, QUALIFY, window or aggregate function, join or set
operation; semantic calls only in its own SELECT and WHERE) asks for any k rows that pass, so
it runs in chunks instead: the source's rows that pass the WHERE clause's relational conjuncts
are numbered once (a temporary table, so every chunk sees the same rows in the same order),
and the statement runs on successive slices of them until ``k + m`` rows have come back. The
first slice is small (``FIRST_CHUNK`` rows, or ``4 (k + m)`` if more); each next one is sized
from the share of rows that passed so far (1.5 times the rows expected to give the rows still
missing), at most doubling the rows scanned. The call sites keep their memos across chunks, so
a repeated input is still evaluated once. ``EXPLAIN`` says whether a LIMIT stops early and,
when it cannot, why; ``EXPLAIN ANALYZE`` shows the rows evaluated against the rows of the
source.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
from sqlglot import exp

from ken.sql.rewrite import Rewritten
from ken.sql.shape import (
    BLOCKERS,
    ROW_NUMBER,
    OneSource,
    limit_offset,
    numbering_sql,
    on_rows,
    one_source,
    site_calls,
)

#: rows of the first slice (at least; ``4 (k + m)`` when that is more)
FIRST_CHUNK = 32
#: the next slice is ``SAFETY`` times the rows expected to give the rows still missing
SAFETY = 1.5


@dataclass(frozen=True)
class EarlyLimit:
    """How a query's LIMIT stops early: ``limit`` rows after ``offset`` from the query on
    slices of its one source (``shape``: the source, its name in the statement, the WHERE
    clause's conjuncts moved into the numbering and those the slices keep)."""

    limit: int
    offset: int
    shape: OneSource

    @property
    def wanted(self) -> int:
        return self.limit + self.offset

    def describe(self) -> str:
        skip = f" after {self.offset:,} skipped" if self.offset else ""
        return (f"LIMIT {self.limit:,}{skip} stops early: the WHERE clause's semantic "
                f"predicate runs on chunks of the rows (first {self.first_chunk():,}), "
                f"until {self.wanted:,} rows pass")

    def first_chunk(self) -> int:
        return max(FIRST_CHUNK, 4 * self.wanted)


@dataclass(frozen=True)
class LimitRun:
    """What an early-stopping LIMIT did (for EXPLAIN ANALYZE and the tests)."""

    limit: int
    source_rows: int  # rows of the source that pass the relational conjuncts
    scanned_rows: int  # of them, the rows the statement ran on
    chunks: int
    returned: int

    def line(self) -> str:
        share = self.scanned_rows / self.source_rows if self.source_rows else 0.0
        return (f"early-stopping LIMIT {self.limit:,}: {self.scanned_rows:,} of "
                f"{self.source_rows:,} rows of the source reached the semantic predicate "
                f"({share:.1%}) in {self.chunks} chunk(s); {self.returned:,} rows returned")


def early_limit(rw: Rewritten) -> tuple[EarlyLimit | None, str]:
    """The early-stopping plan of ``rw``'s LIMIT, or None and why not (an empty reason when
    the statement has no LIMIT over a semantic WHERE, where the question does not arise)."""
    s = rw.statement
    if not isinstance(s, exp.Select) or s.args.get("limit") is None:
        return None, ""
    where = s.args.get("where")
    if where is None or not site_calls(where, rw):
        return None, ""
    numbers = limit_offset(s)
    if numbers is None:
        return None, "LIMIT and OFFSET are not plain numbers, so every row is evaluated"
    shape, why = one_source(rw)
    if shape is None:
        if why in BLOCKERS.values():
            why += ", so every row is evaluated before the LIMIT"
        return None, why
    return EarlyLimit(numbers[0], numbers[1], shape), ""


def run_early_limit(sql: Callable[[str, bool], pa.Table], rw: Rewritten, plan: EarlyLimit,
                    table_name: str) -> tuple[pa.Table, LimitRun]:
    """Run ``rw`` by ``plan``: number the source's rows once into the temporary table
    ``table_name``, then run the statement on slices of them until ``plan.wanted`` rows
    passed; the rows after ``plan.offset``, at most ``plan.limit`` of them. ``sql(text,
    with_params)`` runs a statement on the connection the call sites are registered on (with
    the query's parameters for the statement's slices)."""
    s = rw.statement
    quoted = exp.to_identifier(table_name, quoted=True).sql(dialect="duckdb")
    sql(numbering_sql(plan.shape, quoted), False)
    try:
        total = int(sql(f"SELECT count(*) AS n FROM {quoted}", False).column(0)[0].as_py())
        parts: list[pa.Table] = []
        found = scanned = chunks = 0
        size = plan.first_chunk()
        while found < plan.wanted and scanned < total:
            size = min(size, total - scanned)
            table = sql(_slice(s, plan, quoted, scanned, scanned + size, plan.wanted - found),
                        True)
            scanned += size
            chunks += 1
            if table.num_rows:
                parts.append(table)
                found += table.num_rows
            size = next_chunk(plan.wanted - found, found, scanned)
        if not parts:  # no row passed: the statement's columns, from an empty slice
            parts.append(sql(_slice(s, plan, quoted, 0, 0, 1), True))
    finally:
        sql(f"DROP TABLE IF EXISTS {quoted}", False)
    rows = pa.concat_tables(parts).slice(plan.offset, plan.limit)
    return rows, LimitRun(plan.limit, total, scanned, chunks, rows.num_rows)


def _slice(s: exp.Select, plan: EarlyLimit, quoted: str, lo: int, hi: int, limit: int) -> str:
    """The statement on the numbered rows ``[lo, hi)``: its FROM source replaced by them under
    the source's name, its WHERE reduced to ``plan.shape.kept``, returning at most ``limit``
    rows."""
    rows = (f"SELECT * EXCLUDE ({ROW_NUMBER}) FROM {quoted} "
            f"WHERE {ROW_NUMBER} >= {lo} AND {ROW_NUMBER} < {hi}")
    chunk = on_rows(s, plan.shape, rows)
    chunk.set("offset", None)
    chunk.set("limit", exp.Limit(expression=exp.Literal.number(limit)))
    return chunk.sql(dialect="duckdb")


def next_chunk(missing: int, found: int, scanned: int) -> int:
    """Rows of the next slice: ``SAFETY`` times the rows expected to give ``missing`` more at
    the share passed so far (Laplace-smoothed), at least ``FIRST_CHUNK``, at most ``scanned``
    (the rows scanned at most double each time)."""
    if missing <= 0:
        return 0
    share = (found + 1) / (scanned + 2)
    return int(min(max(math.ceil(SAFETY * missing / share), FIRST_CHUNK), max(scanned,
                                                                              FIRST_CHUNK)))
