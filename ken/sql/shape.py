"""The query shape the slicing plans share (``ken.sql.limit``, ``ken.sql.topk``).

Both plans run a statement of the shape ``SELECT ... FROM <one table, view, file or subquery>
[WHERE ...]`` on a numbered subset of its source's rows, so both need the same facts about it:
no GROUP BY, HAVING, DISTINCT, QUALIFY, join, WITH clause, window or aggregate function;
semantic calls only in its own SELECT, WHERE and ORDER BY (not in the source, not in a
subquery); and the WHERE clause split into the conjuncts without semantic calls (evaluated
once, when the source's rows are numbered) and the others (kept in the statement).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlglot import exp

from ken.sql.rewrite import Rewritten, conjuncts

ROW_NUMBER = "__ken_rn"

#: clauses that need every row of the source (or of a group) before any row can be returned
BLOCKERS = {"order": "ORDER BY needs every row", "group": "GROUP BY needs every row",
            "having": "HAVING needs every group", "distinct": "DISTINCT needs every row",
            "qualify": "QUALIFY needs every row", "joins": "joins are evaluated whole",
            "with_": "a WITH clause is evaluated whole"}


@dataclass(frozen=True)
class OneSource:
    """A statement over one source: ``source`` (named ``alias`` in the statement), whose rows
    first pass ``relational`` (the WHERE clause's conjuncts without semantic calls); the
    statement keeps the other conjuncts, ``kept``."""

    source: exp.Expression
    alias: str
    relational: tuple[exp.Expression, ...]
    kept: tuple[exp.Expression, ...]


def int_literal(node: exp.Expression | None) -> int | None:
    """The value of a LIMIT / OFFSET (or a literal) that is a plain non-negative integer."""
    if node is None:
        return None
    value = node.args.get("expression") if isinstance(node, exp.Limit | exp.Offset) else node
    if isinstance(value, exp.Literal) and not value.is_string and value.this.isdigit():
        return int(value.this)
    return None


def limit_offset(s: exp.Select) -> tuple[int, int] | None:
    """A statement's LIMIT and OFFSET (0 when absent) if both are plain numbers."""
    limit = int_literal(s.args.get("limit"))
    offset = int_literal(s.args.get("offset")) if s.args.get("offset") is not None else 0
    return None if limit is None or offset is None else (limit, offset)


def site_calls(node: exp.Expression, rw: Rewritten) -> list[exp.Anonymous]:
    """The calls of ``rw``'s sites inside ``node``."""
    names = {s.udf_name for s in rw.sites}
    return [a for a in node.find_all(exp.Anonymous) if str(a.this) in names]


def one_source(rw: Rewritten, allow_order: bool = False) -> tuple[OneSource | None, str]:
    """``rw``'s statement as a statement over one source, or None and why not (``allow_order``:
    an ORDER BY is no obstacle)."""
    s = rw.statement
    assert isinstance(s, exp.Select)
    blockers = [text for key, text in BLOCKERS.items()
                if s.args.get(key) and not (allow_order and key == "order")]
    if blockers:
        return None, blockers[0]
    if any(isinstance(e, exp.AggFunc | exp.Window) for sel in s.expressions
           for e in sel.find_all(exp.AggFunc, exp.Window)):
        return None, "an aggregate or window function needs every row"
    source_from = s.args.get("from_")
    if source_from is None or not isinstance(source_from.this, exp.Table | exp.Subquery):
        return None, "its FROM is not one table, view, file or subquery"
    source = source_from.this
    if site_calls(source, rw) or source.find(exp.Placeholder):
        return None, "its FROM source has semantic calls or parameters of its own"
    outside = [c for c in site_calls(s, rw) if c.find_ancestor(exp.Select) is not s]
    if outside:
        return None, "a semantic call sits in a subquery"
    alias = source.alias_or_name
    if not alias:
        return None, "its FROM source has no name to refer to it by"
    # relational conjuncts move into the numbering, so every slice holds rows that reach the
    # semantic calls; not with parameters, whose order must stay the statement's, nor those
    # that name a SELECT alias (DuckDB resolves one in WHERE; the numbering has no select list)
    where = s.args.get("where")
    terms = conjuncts(where.this if where is not None else None)
    pushable = not s.find(exp.Placeholder)
    relational = [c for c in terms if pushable and not site_calls(c, rw)
                  and not names_alias(c, s)]
    kept = [c for c in terms if not any(c is r for r in relational)]
    return OneSource(source.copy(), alias, tuple(c.copy() for c in relational),
                     tuple(c.copy() for c in kept)), ""


def names_alias(node: exp.Expression, s: exp.Select) -> bool:
    """Whether ``node`` has an unqualified column named like one of ``s``'s SELECT aliases."""
    aliases = {sel.alias for sel in s.expressions if isinstance(sel, exp.Alias)}
    return any(not c.table and c.name in aliases for c in node.find_all(exp.Column))


def numbering_sql(shape: OneSource, quoted: str) -> str:
    """The statement that numbers the source's rows that pass the relational conjuncts
    (``ROW_NUMBER``, from 0 in the source's order) into the temporary table ``quoted``."""
    numbered = exp.select("*", f"(row_number() OVER ()) - 1 AS {ROW_NUMBER}",
                          dialect="duckdb").from_(shape.source.copy())
    if shape.relational:
        numbered = numbered.where(exp.and_(*[c.copy() for c in shape.relational]))
    return f"CREATE OR REPLACE TEMPORARY TABLE {quoted} AS {numbered.sql(dialect='duckdb')}"


def on_rows(s: exp.Select, shape: OneSource, rows_sql: str) -> exp.Select:
    """A copy of ``s`` whose FROM source is the rows of ``rows_sql`` under the source's name
    and whose WHERE is reduced to ``shape.kept``."""
    out = s.copy()
    out.set("from_", exp.From(this=exp.alias_(
        exp.Subquery(this=exp.maybe_parse(rows_sql, dialect="duckdb")), shape.alias,
        table=True)))
    out.set("where", exp.Where(this=exp.and_(*[c.copy() for c in shape.kept]))
            if shape.kept else None)
    return out
