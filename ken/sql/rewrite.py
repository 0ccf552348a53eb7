"""Front-end: parse SQL with sqlglot (DuckDB dialect), find semantic calls, rewrite them.

Every semantic call becomes a *call site*: identical calls (same function, same argument
expressions, same constants) share one site, so they are evaluated once per distinct input.
The rewritten statement calls one vectorised DuckDB function per site (``__ken_s0_sentiment``);
relational work stays in DuckDB, whose optimizer evaluates cheap predicates before them (see
``tests/test_sql.py`` for the call-count checks that hold it to that).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError
from sqlglot.tokens import TokenType

from ken.errors import SqlError
from ken.ops.base import Operator, suggest


@dataclass(frozen=True)
class CallSite:
    """One distinct semantic call in a query."""

    id: int
    function: str
    args: tuple[str, ...]  # SQL of the column arguments
    constants: tuple[str, ...]  # bound string-literal arguments
    clauses: tuple[str, ...]  # where it appears: SELECT, WHERE, JOIN ON, GROUP BY, ...
    # DuckDB functions are global to a database: queries running at the same time on other
    # connections (threads) use another namespace
    namespace: str = ""

    @property
    def udf_name(self) -> str:
        return f"__ken_{self.namespace}s{self.id}_{self.function}"

    @property
    def label(self) -> str:
        return f"s{self.id}"

    def call_sql(self) -> str:
        consts = ["'" + c.replace("'", "''") + "'" for c in self.constants]
        return f"{self.function}({', '.join([*self.args, *consts])})"


@dataclass(frozen=True)
class Rewritten:
    original: exp.Expression
    statement: exp.Expression
    sites: tuple[CallSite, ...]

    @property
    def sql(self) -> str:
        return self.statement.sql(dialect="duckdb")

    @property
    def is_semantic(self) -> bool:
        return bool(self.sites)


def check_text(text: object) -> None:
    if not isinstance(text, str):
        raise SqlError(f"SQL must be given as a str, not {type(text).__name__}")


def split_statements(text: str) -> list[str]:
    """The statements of ``text`` (``TRAIN`` statements too), split at semicolons outside
    strings, quoted names and comments; each runs from its first token to its last, so
    comments between statements and blank statements are dropped."""
    check_text(text)
    try:
        tokens = sqlglot.Dialect.get_or_raise("duckdb").tokenize(text)
    except TokenError as error:
        raise SqlError(f"cannot read the SQL text: {error}") from None
    out: list[str] = []
    first = last = None
    for token in [*tokens, None]:
        if token is None or token.token_type == TokenType.SEMICOLON:
            if first is not None:
                out.append(text[first:last + 1])
            first = last = None
        else:
            first = token.start if first is None else first
            last = token.end
    return out


def merge_returns(query: str) -> str:
    """``'instruction' RETURNS INTEGER`` (a string literal, then ``RETURNS`` and a type name, or
    ``STRUCT(...)``) as one string literal ``'instruction RETURNS INTEGER'``, which the
    operator reads and checks
    (typed ``sem_map``); SQL has no other place where a string literal is followed by
    ``RETURNS``. Everything else is left as written."""
    try:
        tokens = sqlglot.Dialect.get_or_raise("duckdb").tokenize(query)
    except TokenError:
        return query  # parse() reports it
    out, at = [], 0
    for i in range(len(tokens) - 2):
        string, word, kind = tokens[i], tokens[i + 1], tokens[i + 2]
        if (string.token_type == TokenType.STRING and word.text.upper() == "RETURNS"
                and kind.text.isalpha() and string.start >= at):
            end, spelled = kind.end, kind.text.upper()
            if spelled == "STRUCT" and i + 3 < len(tokens) \
                    and tokens[i + 3].token_type == TokenType.L_PAREN:
                close = _matching_paren(tokens, i + 3)
                if close is None:
                    raise SqlError("RETURNS STRUCT( has no closing parenthesis")
                end = tokens[close].end
                spelled = "STRUCT" + query[tokens[i + 3].start:end + 1]
            merged = f"{string.text} RETURNS {spelled}"
            out += [query[at:string.start], "'" + merged.replace("'", "''") + "'"]
            at = end + 1
    return "".join([*out, query[at:]])


def _matching_paren(tokens: list, opening: int) -> int | None:
    """The index of the token that closes the parenthesis at ``opening`` (None: unclosed)."""
    depth = 0
    for j in range(opening, len(tokens)):
        depth += {TokenType.L_PAREN: 1, TokenType.R_PAREN: -1}.get(tokens[j].token_type, 0)
        if depth == 0:
            return j
    return None


def parse(query: str) -> list[exp.Expression]:
    """Parse one or more statements; syntax errors name the line and column."""
    check_text(query)
    query = merge_returns(query)
    try:
        statements = [s for s in sqlglot.parse(query, read="duckdb") if s is not None]
    except ParseError as error:
        first = error.errors[0] if error.errors else {}
        line, col = first.get("line"), first.get("col")
        lines = query.splitlines() or [""]
        pointer = ""
        if line and 1 <= line <= len(lines):
            pointer = f"\n  {lines[line - 1]}\n  {' ' * max(0, (col or 1) - 1)}^"
        what = first.get("description", str(error)).split("\n")[0]
        raise SqlError(f"SQL syntax error at line {line}, column {col}: {what}{pointer}") from None
    if not statements:
        raise SqlError("empty query")
    return statements


def _clause(node: exp.Expression) -> str:
    child, parent = node, node.parent
    while parent is not None:
        if isinstance(parent, exp.Where):
            return "WHERE"
        if isinstance(parent, exp.Join) and child.arg_key == "on":
            return "JOIN ON"
        if isinstance(parent, exp.Group):
            return "GROUP BY"
        if isinstance(parent, exp.Having):
            return "HAVING"
        if isinstance(parent, exp.Order):
            return "ORDER BY"
        if isinstance(parent, exp.Select) and child.arg_key == "expressions":
            return "SELECT"
        child, parent = parent, parent.parent
    return "EXPRESSION"


def conjuncts(node: exp.Expression | None) -> list[exp.Expression]:
    """The terms of ``node``'s top-level ANDs (through parentheses around an AND)."""
    if node is None:
        return []
    if isinstance(node, exp.And):
        return conjuncts(node.left) + conjuncts(node.right)
    if isinstance(node, exp.Paren):
        return conjuncts(node.this) if isinstance(node.this, exp.And) else [node]
    return [node]


def rewrite(statement: exp.Expression, functions: Mapping[str, Operator],
            known: frozenset[str], first_id: int = 0, namespace: str = "") -> Rewritten:
    """Validate semantic calls and replace each by a call of its site's DuckDB function.

    ``known`` holds the names of the functions DuckDB itself has (lower case), so that unknown
    names are reported here with a suggestion instead of as a DuckDB binder error.
    """
    rewritten = statement.copy()
    sites: dict[tuple, CallSite] = {}
    clauses: dict[tuple, list[str]] = {}
    for node in list(rewritten.find_all(exp.Anonymous)):
        name = str(node.this).lower()
        if name not in functions:
            if name not in known and not name.startswith("__ken_"):
                registered = ", ".join(sorted(functions)) or "none"
                hint = suggest(name, [*functions, *known])
                raise SqlError(f"unknown function {name}(); semantic functions registered on "
                               f"this session: {registered}.{hint}")
            continue
        fn = functions[name]
        args = list(node.expressions)
        if len(args) != fn.arity:
            raise SqlError(f"{name}() takes {fn.arity} argument(s) — {fn.signature()} — but "
                           f"got {len(args)}: {node.sql(dialect='duckdb')}")
        constants = []
        for arg, const_name in zip(args[fn.num_columns:], fn.constants, strict=True):
            if not (isinstance(arg, exp.Literal) and arg.is_string):
                raise SqlError(f"the {const_name} argument of {name}() must be a string literal, "
                               f"got {arg.sql(dialect='duckdb')}: {fn.signature()}")
            constants.append(arg.this)
        columns = args[: fn.num_columns]
        key = (name, tuple(a.sql(dialect="duckdb") for a in columns), tuple(constants))
        if key not in sites:
            sites[key] = CallSite(first_id + len(sites), name, key[1], key[2], (), namespace)
            clauses[key] = []
        clause = _clause(node)
        if clause not in clauses[key]:
            clauses[key].append(clause)
        if getattr(fn, "aggregate", False):  # a group's values, sorted: one list per group
            if clause in ("WHERE", "JOIN ON", "GROUP BY"):
                raise SqlError(f"{name}() is an aggregate: one answer per group, so it belongs "
                               f"in SELECT, HAVING or ORDER BY (with GROUP BY for one answer "
                               f"per group), not in {clause}: {node.sql(dialect='duckdb')}")
            columns = [exp.Anonymous(this="list_sort", expressions=[
                exp.Anonymous(this="list", expressions=[c.copy()])]) for c in columns]
        if getattr(fn, "record_columns", False):  # structs and rows travel as JSON objects
            columns = [exp.cast(exp.Anonymous(this="to_json", expressions=[c.copy()]), "VARCHAR")
                       for c in columns]
        node.replace(exp.Anonymous(this=sites[key].udf_name, expressions=columns))
    final = tuple(
        CallSite(s.id, s.function, s.args, s.constants, tuple(clauses[k]), namespace)
        for k, s in sites.items()
    )
    return Rewritten(statement, rewritten, final)
