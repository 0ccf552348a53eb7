"""Session: a DuckDB connection plus semantic functions, their models and cascades.

>>> import ken
>>> s = ken.connect()
>>> s.sql("CREATE TABLE t AS SELECT * FROM (VALUES ('loved it'), ('awful')) v(text)")
>>> s.sql("SELECT text, sentiment(text) AS mood FROM t").fetchall()   # doctest: +SKIP
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
from sqlglot import exp

from ken.errors import KenError
from ken.operators.cascade import Cascade
from ken.operators.model import DeviceConfig, Model
from ken.progress import QUIET, Reporter
from ken.sql.execute import SiteRunner, register_sites, translate_error, unregister_sites
from ken.sql.explain import build, conjuncts, has_site, render, site_lines
from ken.sql.functions import Bound, ClassifierBinding, SemanticFunction
from ken.sql.rewrite import CallSite, Rewritten, SqlError, parse, rewrite

_EXPLAIN = re.compile(r"^\s*EXPLAIN(\s+ANALYZE)?\s+", re.IGNORECASE)


class Result:
    """A query result; converts like a DuckDB relation: ``arrow()``, ``df()``, ``fetchall()``."""

    def __init__(self, con: duckdb.DuckDBPyConnection, table: pa.Table | None = None,
                 relation: Any = None, stats: dict | None = None) -> None:
        self._con = con
        self._table = table
        self._relation = relation
        self.stats = stats or {}  # call-site label -> SiteStats, for semantic queries

    def arrow(self) -> pa.Table:
        if self._table is None:
            self._table = (self._relation.to_arrow_table() if self._relation is not None
                           else pa.table({}))
        return self._table

    to_arrow = arrow

    def df(self):  # noqa: ANN201 - pandas is optional
        return self.arrow().to_pandas()

    def fetchall(self) -> list[tuple]:
        table = self.arrow()
        if table.num_columns == 0:
            return []
        return self._con.from_arrow(table).fetchall()

    @property
    def columns(self) -> list[str]:
        return self.arrow().column_names

    def __len__(self) -> int:
        return self.arrow().num_rows

    def __repr__(self) -> str:
        return str(self._con.from_arrow(self.arrow())) if self.arrow().num_columns else "<empty>"

    def __str__(self) -> str:
        table = self.arrow()
        if table.column_names == ["explain"]:
            return "\n".join(table.column("explain").to_pylist())
        return self.__repr__()


class Session:
    """A DuckDB connection with semantic SQL functions served by model cascades."""

    def __init__(self, path: str | Path | None = None, device: DeviceConfig | None = None,
                 data: Any = None, home: Path | None = None, batch_size: int = 32,
                 reporter: Reporter = QUIET, builtins: bool = True) -> None:
        try:
            self.con = duckdb.connect(str(path) if path else ":memory:")
        except duckdb.Error as error:
            raise KenError(f"cannot open database {path}: {error}") from None
        self.device = device or DeviceConfig(threads=2)
        self.data = data
        self.home = home
        self.batch_size = batch_size
        self.reporter = reporter
        self.functions: dict[str, SemanticFunction] = {}
        self._bound: dict[tuple[str, tuple[str, ...]], Bound] = {}
        self._lock = threading.Lock()
        self._resources: dict[str, Any] = {}
        self._known: frozenset[str] | None = None
        self.sentiment_cascade: Cascade | None = None
        if builtins:
            from ken.sql.builtins import register_builtins

            register_builtins(self)

    # -- registry ----------------------------------------------------------------------------

    def register(self, name: str, operator: SemanticFunction | Model | Callable | Any,
                 models: Mapping[str, Model] | None = None) -> None:
        """Make ``operator`` callable from SQL as ``name(...)``.

        ``operator`` is a ``SemanticFunction``, a single ``Model`` (one text argument, its
        labels are the values), or a ``Cascade`` together with ``models``.
        """
        name = name.lower()
        if isinstance(operator, SemanticFunction):
            fn = operator
            if fn.name != name:
                fn = SemanticFunction(name, fn.num_columns, fn.constants, fn.output_type,
                                      fn.bind, fn.doc)
        elif isinstance(operator, Model):
            binding = ClassifierBinding(name, Cascade((operator.name,)),
                                        {operator.name: operator})
            fn = SemanticFunction(name, operator.spec.num_inputs, (), "varchar",
                                  lambda _c, b=binding: b, f"model {operator.name}")
        elif isinstance(operator, Cascade):
            if models is None:
                raise KenError("registering a Cascade needs models=... with its models")
            binding = ClassifierBinding(name, operator, dict(models))
            arity = models[operator.models[0]].spec.num_inputs
            fn = SemanticFunction(name, arity, (), "varchar", lambda _c, b=binding: b,
                                  f"cascade {operator.describe()}")
        else:
            raise KenError(f"cannot register {type(operator).__name__} as {name}(); pass a "
                           "SemanticFunction, a Model, or a Cascade with models=...")
        if name in self._duckdb_functions():
            raise KenError(f"{name}() is a DuckDB function; choose another name")
        self.functions[name] = fn
        self._bound = {k: v for k, v in self._bound.items() if k[0] != name}

    def resource(self, key: str, make: Callable[[], Any]) -> Any:
        """Heavy objects (loaded models) shared by all functions of this session."""
        if key not in self._resources:
            self._resources[key] = make()
        return self._resources[key]

    def bind(self, function: str, constants: tuple[str, ...]) -> Bound:
        key = (function, constants)
        if key not in self._bound:
            self._bound[key] = self.functions[function].bind(constants)
        return self._bound[key]

    def _duckdb_functions(self) -> frozenset[str]:
        if self._known is None:
            rows = self.con.execute("SELECT DISTINCT lower(function_name) FROM duckdb_functions()"
                                    ).fetchall()
            self._known = frozenset(r[0] for r in rows)
        return self._known

    # -- tables ------------------------------------------------------------------------------

    def register_table(self, name: str, data: Any) -> None:
        """Expose an Arrow table or pandas frame as a view ``name``."""
        self.con.register(name, data)

    def table(self, name: str):  # noqa: ANN201 - Frame
        from ken.frame import Frame

        return Frame.from_table(self, name)

    def from_arrow(self, table: pa.Table, name: str | None = None):  # noqa: ANN201
        from ken.frame import Frame

        name = name or f"__ken_arrow_{id(table):x}"
        self.register_table(name, table)
        return Frame.from_table(self, name)

    # -- queries -----------------------------------------------------------------------------

    def _rewrite(self, query: str) -> list[Rewritten]:
        out: list[Rewritten] = []
        next_site = 0  # site ids restart per query so that EXPLAIN output is deterministic
        for statement in parse(query):
            rw = rewrite(statement, self.functions, self._duckdb_functions(), next_site)
            next_site += len(rw.sites)
            out.append(rw)
        return out

    def sql(self, query: str, params: Any = None) -> Result:
        """Run DuckDB SQL with semantic functions. ``EXPLAIN [ANALYZE]`` prefixes explain it."""
        match = _EXPLAIN.match(query)
        if match:
            text = self.explain(query[match.end():], analyze=bool(match.group(1)), params=params)
            return Result(self.con, pa.table({"explain": text.splitlines()}))
        statements = self._rewrite(query)
        if not any(rw.is_semantic for rw in statements):
            try:  # no semantic calls: DuckDB runs the user's text unchanged
                return Result(self.con, relation=self.con.sql(query, params=params))
            except duckdb.Error as error:
                raise KenError(str(error)) from None
        result = Result(self.con)
        for rw in statements:
            result = self._run(rw, params if rw is statements[-1] else None)
        return result

    def _runners(self, rw: Rewritten) -> list[SiteRunner]:
        """One runner per site; sites of one bound operator (e.g. ``f(t.x)`` and ``f(x)``)
        share a memo, so an input value is evaluated once per query."""
        memos: dict[tuple, dict] = {}
        return [SiteRunner(site, self.bind(site.function, site.constants), self.batch_size,
                           self._lock, memos.setdefault((site.function, site.constants), {}))
                for site in rw.sites]

    def _run(self, rw: Rewritten, params: Any) -> Result:
        runners = self._runners(rw)
        register_sites(self.con, runners)
        try:
            relation = self.con.sql(rw.sql, params=params)
            table = relation.to_arrow_table() if relation is not None else pa.table({})
        except duckdb.Error as error:
            raise translate_error(error, list(rw.sites)) from None
        finally:
            unregister_sites(self.con, runners)
        return Result(self.con, table=table,
                      stats={r.site.label: r.stats for r in runners})

    # -- EXPLAIN -----------------------------------------------------------------------------

    def explain(self, query: str, analyze: bool = False, params: Any = None) -> str:
        """The plan of ``query``: DuckDB parts, semantic operators, estimates (and actuals)."""
        statements = self._rewrite(query)
        if len(statements) != 1:
            raise SqlError("EXPLAIN takes exactly one statement")
        rw = statements[0]
        lines = render(build(rw.statement))
        describe = {s.id: self.bind(s.function, s.constants).describe() for s in rw.sites}
        estimates = {s.id: self._estimate(rw, s) for s in rw.sites}
        if not analyze:
            return "\n".join(lines + site_lines(rw.sites, describe, estimates))
        started = time.perf_counter()
        runners = self._runners(rw)
        register_sites(self.con, runners)
        try:
            relation = self.con.sql("EXPLAIN ANALYZE " + rw.sql, params=params)
            physical = relation.fetchall()[0][1] if relation is not None else ""
        except duckdb.Error as error:
            raise translate_error(error, list(rw.sites)) from None
        finally:
            unregister_sites(self.con, runners)
        seconds = time.perf_counter() - started
        actual = {r.site.id: _actual_lines(r) for r in runners}
        out = lines + site_lines(rw.sites, describe, estimates, actual)
        out += ["", f"Total time: {seconds:.3f} s", "",
                "DuckDB physical plan (actual rows and time per operator):", physical]
        return "\n".join(out)

    def _estimate(self, rw: Rewritten, site: CallSite) -> str:
        """Rows and distinct inputs reaching a site, from a COUNT over its relational part."""
        bound = self.bind(site.function, site.constants)
        call = next((a for a in rw.statement.find_all(exp.Anonymous)
                     if str(a.this) == site.udf_name), None)
        scope = call.find_ancestor(exp.Select) if call is not None else None
        if scope is None:
            return "input rows unknown"
        probe = scope.copy()
        for key in ("group", "having", "order", "limit", "distinct", "offset"):
            probe.set(key, None)
        where = probe.args.get("where")
        kept = [c for c in conjuncts(where.this if where is not None else None)
                if not has_site(c)]
        probe.set("where", exp.Where(this=exp.and_(*kept)) if kept else None)
        for join in probe.args.get("joins") or []:
            on = [c for c in conjuncts(join.args.get("on")) if not has_site(c)]
            join.set("on", exp.and_(*on) if on else exp.true())
        args = [exp.maybe_parse(a, dialect="duckdb") for a in site.args]
        distinct_arg = args[0] if len(args) == 1 else exp.Array(expressions=args)
        probe.set("expressions", [exp.Count(this=exp.Star()),
                                  exp.Count(this=exp.Distinct(expressions=[distinct_arg]))])
        root_with = rw.statement.args.get("with_")
        if root_with is not None and probe.args.get("with_") is None:
            probe.set("with_", root_with.copy())
        runners = self._runners(rw)
        register_sites(self.con, runners)  # nested calls may remain inside FROM subqueries
        try:
            rows, distinct = self.con.sql(probe.sql(dialect="duckdb")).fetchall()[0]
        except duckdb.Error:
            return "input rows unknown (correlated or nested scope)"
        finally:
            unregister_sites(self.con, runners)
        upper = "≤ " if site.clauses != ("WHERE",) or len(kept) != len(conjuncts(
            where.this if where is not None else None)) else ""
        text = f"{upper}{rows:,} input rows, {upper}{distinct:,} distinct non-NULL inputs"
        fractions = getattr(bound, "stage_fractions", None)
        if fractions:
            calls = ", ".join(f"{m} {distinct * f:,.0f}"
                              for m, f in zip(bound.cascade.models, fractions, strict=True))
            text += f"; model calls ≈ {calls}"
        else:
            text += f"; model calls ≤ {distinct:,} per stage"
        return text

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _actual_lines(runner: SiteRunner) -> list[str]:
    st = runner.stats
    repeats = st.rows_in - st.null_rows - st.distinct_evaluated
    lines = [f"{st.rows_in:,} rows in = {st.null_rows:,} NULL + {st.distinct_evaluated:,} "
             f"distinct evaluated + {repeats:,} repeats served by dedup; {st.chunks} chunks, "
             f"{st.seconds:.3f} s"]
    for stage in st.stages:
        lines.append(f"stage {stage.model}: {stage.input_rows:,} in, {stage.resolved_rows:,} "
                     f"resolved, {stage.num_batches} batches, {stage.seconds:.3f} s")
    return lines


def connect(path: str | Path | None = None, **options: Any) -> Session:
    """Open a session on an in-memory DuckDB database, or a persistent one at ``path``.

    >>> session = connect()
    >>> session.sql("SELECT 42 AS answer").fetchall()
    [(42,)]
    """
    return Session(path, **options)
