"""Session: a DuckDB connection plus semantic functions, their models and cascades.

>>> import ken
>>> s = ken.connect()
>>> s.sql("CREATE TABLE t AS SELECT * FROM (VALUES ('loved it'), ('awful')) v(text)")
>>> s.sql("SELECT text, sentiment(text) AS mood FROM t").fetchall()   # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa
from sqlglot import exp

from ken.errors import KenError
from ken.operators.cascade import Cascade
from ken.operators.model import DeviceConfig, Model
from ken.paths import ken_home
from ken.progress import QUIET, Reporter
from ken.sql.execute import SiteRunner, query_error, register_sites, unregister_sites
from ken.sql.explain import build, conjuncts, has_site, render, site_lines
from ken.sql.functions import Bound, ClassifierBinding, SemanticFunction
from ken.sql.rewrite import CallSite, Rewritten, SqlError, parse, rewrite

if TYPE_CHECKING:
    from ken.engine.serving import Engine, LoadReport
    from ken.optimizer.perf import Catalog
    from ken.optimizer.plan import Frontier, GearPlan
    from ken.optimizer.planner import PlannerSettings, PlannerStats
    from ken.optimizer.profile import Profile
    from ken.optimizer.query import QueryPlan, Target
    from ken.optimizer.workload import Hardware, Trace

#: where a plannable function gets its profiles: ``source(threads_per_device) -> {model: Profile}``
ProfileSource = Callable[[int], Mapping[str, "Profile"]]

_EXPLAIN = re.compile(r"^\s*EXPLAIN(\s+ANALYZE)?\s+", re.IGNORECASE)


class Result:
    """A query result; converts like a DuckDB relation: ``arrow()``, ``df()``, ``fetchall()``."""

    def __init__(self, con: duckdb.DuckDBPyConnection | Callable[[], duckdb.DuckDBPyConnection],
                 table: pa.Table | None = None, relation: Any = None,
                 stats: dict | None = None) -> None:
        # a connection, or (from a session) a function giving the calling thread's connection:
        # a result may be read in another thread than the one that ran the query
        self._connect = con if callable(con) else (lambda: con)
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
        return self._connect().from_arrow(table).fetchall()

    @property
    def columns(self) -> list[str]:
        return self.arrow().column_names

    def __len__(self) -> int:
        return self.arrow().num_rows

    def __repr__(self) -> str:
        return (str(self._connect().from_arrow(self.arrow())) if self.arrow().num_columns
                else "<empty>")

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
        self._make_lock = threading.RLock()  # binding may make resources, which may bind
        self._resources: dict[str, Any] = {}
        self._known: frozenset[str] | None = None
        self.sentiment_cascade: Cascade | None = None
        # functions the offline planner can plan (their models have profiles); builtins add
        # sentiment, registering a function under the same name removes it
        self.profile_sources: dict[str, ProfileSource] = {}
        self.frontiers: dict[str, Frontier] = {}
        self._gear_plans: dict[str, GearPlan] = {}
        # online serving: an engine per served function; picklable model loaders per function
        # (``source(threads_per_device) -> {model: loader}``) let its devices be processes
        self.loader_sources: dict[str, Callable[[int], Mapping[str, Callable[[], Model]]]] = {}
        self._engines: dict[str, Engine] = {}
        self.bulk_threshold = 64
        # DuckDB connections run one query at a time: other threads get cursors of ``con``
        self._owner_thread = threading.get_ident()
        self._local = threading.local()
        self._cursors: list[duckdb.DuckDBPyConnection] = []
        self._tables: dict[str, Any] = {}
        self._tables_version = 0
        self._thread_ids = itertools.count(1)
        self._pool: ThreadPoolExecutor | None = None
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
        # plans and profiles were for the function this name named before
        self.profile_sources.pop(name, None)
        self.loader_sources.pop(name, None)
        self.frontiers.pop(name, None)
        self._gear_plans.pop(name, None)
        engine = self._engines.pop(name, None)
        if engine is not None:
            engine.shutdown()

    def resource(self, key: str, make: Callable[[], Any]) -> Any:
        """Heavy objects (loaded models) shared by all functions of this session; made once
        even when queries of several threads ask at the same time."""
        with self._make_lock:
            if key not in self._resources:
                self._resources[key] = make()
            return self._resources[key]

    def bind(self, function: str, constants: tuple[str, ...]) -> Bound:
        key = (function, constants)
        with self._make_lock:
            if key not in self._bound:
                self._bound[key] = self.functions[function].bind(constants)
            return self._bound[key]

    def _duckdb_functions(self) -> frozenset[str]:
        if self._known is None:
            rows = self._connection().execute(
                "SELECT DISTINCT lower(function_name) FROM duckdb_functions()").fetchall()
            self._known = frozenset(r[0] for r in rows)
        return self._known

    # -- gear plans (offline phase) ----------------------------------------------------------

    @property
    def gear_plans(self) -> Mapping[str, GearPlan]:
        """The gear plan chosen for each semantic function (read-only view)."""
        return MappingProxyType(self._gear_plans)

    def use_plan(self, plan: GearPlan) -> None:
        """Set the gear plan of ``plan.operator`` by hand (e.g. one picked from a frontier file
        written by ``ken plan``: ``Frontier.load(path).pick(min_accuracy=0.7)``)."""
        from ken.optimizer.plan import GearPlan

        if not isinstance(plan, GearPlan):
            raise KenError(f"use_plan() takes a GearPlan, not {type(plan).__name__}; load one "
                           "with ken.Frontier.load(path).pick(...)")
        name = plan.operator.lower()
        if name not in self.functions:
            raise KenError(f"the gear plan is for {plan.operator}(), which is not a semantic "
                           f"function of this session; registered: "
                           f"{', '.join(sorted(self.functions)) or '(none)'}")
        self._set_plan(name, plan)

    def _set_plan(self, name: str, plan: GearPlan) -> None:
        """Keep ``plan`` for ``name``; a running engine of ``name`` swaps to it."""
        self._gear_plans[name] = plan
        engine = self._engines.get(name)
        if engine is not None:
            engine.swap_plan(plan, self._model_sources(name, engine.workers,
                                                       engine.threads_per_device))

    def plan(self, target: Target | str, functions: Sequence[str] = ("sentiment",),
             trace: Trace | str | None = None, devices: int = 2, memory_gb: float = 4.0,
             threads_per_device: int = 1, peak_qps: float | None = None,
             duration_s: float = 120.0, num_ranges: int = 8,
             settings: PlannerSettings | None = None, force: bool = False) -> QueryPlan:
        """Plan ``functions`` offline and pick one gear plan each for ``target``.

        Profiles the functions' models (cached), searches their Pareto cascades, builds each
        function's frontier of gear plans for ``devices`` CPU workers of ``threads_per_device``
        threads and ``memory_gb`` each on ``trace`` ("azure" — the default, from the shared
        data folder —, "poisson", "gamma", or a ``Trace``), and chooses plans with the query
        optimizer. Frontiers are cached under ``KEN_HOME/plans``; the chosen plans are kept on
        the session (``session.gear_plans``, shown by EXPLAIN).

        >>> qp = session.plan("accuracy >= 0.7")              # doctest: +SKIP
        >>> qp.plan_for("sentiment").describe()               # doctest: +SKIP
        """
        from ken.optimizer.planner import PlannerSettings
        from ken.optimizer.query import Target, choose_plans
        from ken.optimizer.workload import Hardware

        if isinstance(target, str):
            target = Target.parse(target)
        names = [f.lower() for f in functions]
        if not names:
            raise KenError("plan() needs at least one semantic function, e.g. "
                           "functions=('sentiment',)")
        for name in names:
            if name not in self.functions:
                raise KenError(f"unknown function {name}(); semantic functions registered on "
                               f"this session: {', '.join(sorted(self.functions)) or '(none)'}")
            if name not in self.profile_sources:
                plannable = ", ".join(sorted(self.profile_sources)) or "none"
                raise KenError(
                    f"{name}() cannot be planned yet: gear plans are built from model profiles "
                    f"(runtime per batch size and per-sample predictions on a labelled "
                    f"sample), and {name}() has none; functions this session can plan: "
                    f"{plannable}. A plan made elsewhere can be set with session.use_plan(...)")
        check_planning_args(devices, memory_gb, threads_per_device, peak_qps, duration_s,
                            num_ranges)
        hardware = Hardware.cpu_workers(devices, int(memory_gb * 2**30))
        settings = settings or PlannerSettings(num_ranges=num_ranges)
        profiles = {n: dict(self.profile_sources[n](threads_per_device)) for n in names}
        prepared = {n: planning_inputs(profiles[n]) for n in names}
        catalogs = {n: prepared[n][0] for n in names}
        if peak_qps is None:  # the slowest operator sets the load the query can be planned for
            peak_qps = min(default_peak_qps(cat, cascades, devices)
                           for cat, cascades in prepared.values())
        plan_trace = planning_trace("azure" if trace is None else trace, peak_qps, duration_s)
        frontiers = {}
        for n in names:
            catalog, cascades = prepared[n]
            frontiers[n], _stats = plan_operator(
                n, profiles[n], catalog, cascades, hardware, plan_trace, peak_qps, settings,
                cache_dir=(self.home or ken_home()) / "plans", reporter=self.reporter,
                force=force)
        chosen = choose_plans(frontiers, catalogs, plan_trace, target)
        self.frontiers.update(frontiers)
        for p in chosen.plans:
            self._set_plan(p.operator, p)
        return chosen

    # -- online serving (issue 5) -------------------------------------------------------------

    @property
    def engines(self) -> Mapping[str, Engine]:
        """The running online engine of each served function (read-only view)."""
        return MappingProxyType(self._engines)

    def serve(self, functions: Sequence[str] | None = None,
              workers: str = "auto", threads_per_device: int = 1,
              max_in_flight: int = 10_000, bulk_threshold: int | None = None,
              memory_gb: float | None = None) -> dict[str, LoadReport]:
        """Start an online engine for each function with a gear plan (all of them by default).

        From then on every query's calls of a served function go through its engine, from any
        number of threads (``sql``) or tasks (``asql``) at once: a chunk of fewer than
        ``bulk_threshold`` distinct new inputs enters as online requests (metered, batched with
        other queries' rows by the gear plan), a larger one as bulk rows (the plan's most
        accurate gear in throughput-sized batches). ``workers="auto"`` runs each device in its
        own process when the function's models can be loaded there (the packaged ones can),
        else as threads; ``memory_gb`` is a budget per process worker. Returns the model load
        times (and worker memory) per function.

        >>> session.plan("p95 <= 50")                   # doctest: +SKIP
        >>> session.serve()                             # doctest: +SKIP
        >>> session.sql("SELECT sentiment(?)", ["great game!"]).fetchall()   # doctest: +SKIP
        """
        from ken.engine.serving import Engine

        if bulk_threshold is not None:
            if bulk_threshold < 1:
                raise KenError("bulk_threshold must be >= 1")
            self.bulk_threshold = bulk_threshold
        names = list(self._gear_plans) if functions is None else [f.lower() for f in functions]
        if not names:
            raise KenError("nothing to serve: no function has a gear plan yet; run "
                           "session.plan(...) or session.use_plan(...) first")
        missing = [n for n in names if n not in self._gear_plans]
        if missing:
            raise KenError(f"{', '.join(f'{n}()' for n in missing)} has no gear plan; run "
                           "session.plan(...) or session.use_plan(...) first")
        reports = {}
        for name in names:
            if name in self._engines:
                continue
            kind = workers
            if kind == "auto":
                kind = "process" if name in self.loader_sources else "thread"
            engine = Engine(self._gear_plans[name],
                            self._model_sources(name, kind, threads_per_device),
                            max_in_flight=max_in_flight, workers=kind,  # type: ignore[arg-type]
                            threads_per_device=threads_per_device,
                            memory_budget_bytes=None if memory_gb is None
                            else int(memory_gb * 2**30))
            with self.reporter.task(f"start {name}() engine: {kind} workers on "
                                    f"{', '.join(engine.plan.devices)}", 1) as advance:
                reports[name] = engine.start()
                advance(1)
            self._engines[name] = engine
        return reports

    def _model_sources(self, name: str, workers: str, threads: int) -> Mapping[str, Any]:
        """What an engine of ``name`` loads: picklable loaders for process workers, the
        session's loaded models for thread workers."""
        if workers == "process":
            if name not in self.loader_sources:
                raise KenError(f"{name}() has no model loaders for worker processes; serve it "
                               "with workers='thread'")
            return self.loader_sources[name](threads)
        return self.bind(name, ()).models

    def stop_serving(self, drain: bool = True) -> dict[str, int]:
        """Shut every engine down (draining admitted requests first, by default); returns
        how many requests each cancelled."""
        out = {name: engine.shutdown(drain=drain) for name, engine in self._engines.items()}
        self._engines.clear()
        return out

    async def asql(self, query: str, params: Any = None) -> Result:
        """``sql`` for asyncio code: runs the query on a session worker thread, so many
        ``await session.asql(...)`` run at once and a served function batches their rows."""
        import asyncio

        if self._pool is None:
            self._pool = ThreadPoolExecutor(32, thread_name_prefix="ken-query")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.sql, query, params)

    def _connection(self) -> duckdb.DuckDBPyConnection:
        """``con`` in the thread that opened the session; in any other thread that thread's
        own cursor of it (same database), with the session's registered tables."""
        if threading.get_ident() == self._owner_thread:
            return self.con
        local = self._local
        cur = getattr(local, "con", None)
        if cur is None:
            with self._lock:
                cur = self.con.cursor()
                self._cursors.append(cur)
                local.namespace = f"t{next(self._thread_ids)}"
            local.con, local.version = cur, -1
        if local.version != self._tables_version:
            for table_name, data in list(self._tables.items()):
                cur.register(table_name, data)
            local.version = self._tables_version
        return cur

    def _namespace(self) -> str:
        if threading.get_ident() == self._owner_thread:
            return ""
        self._connection()
        return self._local.namespace

    def _gear_plan_lines(self, function: str) -> list[str]:
        plan = self._gear_plans.get(function)
        if plan is None:
            if function in self.profile_sources:
                return ["gear plan: none (run session.plan(...) or `ken plan`)"]
            return [f"gear plan: none ({function}() has no profiles to plan with; "
                    "session.use_plan(...) sets one)"]
        gears = len(plan.gears())
        engine = self._engines.get(function)
        serving = (f"served by the online engine ({engine.workers} workers): chunks of < "
                   f"{self.bulk_threshold} new inputs as online requests, larger ones as bulk "
                   f"rows of gear 1 in batches of {engine.bulk_batch_size}"
                   if engine is not None else
                   "for online serving, session.serve(); until then queries run the "
                   "implementation above")
        head = (f"gear plan: {gears} gear{'s' if gears != 1 else ''} over 0-{plan.qps_max:g} "
                f"qps on {', '.join(plan.devices)} ({serving})")
        return [head, *("  " + line for line in plan.describe())]

    # -- tables ------------------------------------------------------------------------------

    def register_table(self, name: str, data: Any) -> None:
        """Expose an Arrow table or pandas frame as a view ``name`` (in every thread)."""
        self._connection().register(name, data)
        with self._lock:
            self._tables[name] = data
            self._tables_version += 1

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
        namespace = self._namespace()
        for statement in parse(query):
            rw = rewrite(statement, self.functions, self._duckdb_functions(), next_site,
                         namespace)
            next_site += len(rw.sites)
            out.append(rw)
        return out

    def sql(self, query: str, params: Any = None) -> Result:
        """Run DuckDB SQL with semantic functions. ``EXPLAIN [ANALYZE]`` prefixes explain it."""
        match = _EXPLAIN.match(query)
        if match:
            text = self.explain(query[match.end():], analyze=bool(match.group(1)), params=params)
            return Result(self._connection, pa.table({"explain": text.splitlines()}))
        statements = self._rewrite(query)
        con = self._connection()
        if not any(rw.is_semantic for rw in statements):
            try:  # no semantic calls: DuckDB runs the user's text unchanged
                relation = con.sql(query, params=params)
                if con is not self.con and relation is not None:  # the cursor is this thread's
                    return Result(self._connection, relation.to_arrow_table())
                return Result(self._connection, relation=relation)
            except duckdb.Error as error:
                raise KenError(str(error)) from None
        result = Result(self._connection)
        for rw in statements:
            result = self._run(rw, params if rw is statements[-1] else None)
        return result

    def _runners(self, rw: Rewritten) -> list[SiteRunner]:
        """One runner per site; sites of one bound operator (e.g. ``f(t.x)`` and ``f(x)``)
        share a memo, so an input value is evaluated once per query."""
        memos: dict[tuple, dict] = {}
        query_lock = threading.Lock()  # engines are thread-safe; in-process models are not
        out = []
        for site in rw.sites:
            engine = self._engines.get(site.function)
            out.append(SiteRunner(site, self.bind(site.function, site.constants),
                                  self.batch_size, query_lock if engine else self._lock,
                                  memos.setdefault((site.function, site.constants), {}),
                                  engine=engine, bulk_threshold=self.bulk_threshold))
        return out

    def _run(self, rw: Rewritten, params: Any) -> Result:
        runners = self._runners(rw)
        con = self._connection()
        register_sites(con, runners)
        try:
            relation = con.sql(rw.sql, params=params)
            table = relation.to_arrow_table() if relation is not None else pa.table({})
        except duckdb.Error as error:
            raise query_error(error, runners) from None
        finally:
            unregister_sites(con, runners)
        return Result(self._connection, table=table,
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
        plans = {s.id: self._gear_plan_lines(s.function) for s in rw.sites}
        if not analyze:
            return "\n".join(lines + site_lines(rw.sites, describe, estimates, plans=plans))
        started = time.perf_counter()
        runners = self._runners(rw)
        con = self._connection()
        register_sites(con, runners)
        try:
            relation = con.sql("EXPLAIN ANALYZE " + rw.sql, params=params)
            physical = relation.fetchall()[0][1] if relation is not None else ""
        except duckdb.Error as error:
            raise query_error(error, runners) from None
        finally:
            unregister_sites(con, runners)
        seconds = time.perf_counter() - started
        actual = {r.site.id: _actual_lines(r) for r in runners}
        out = lines + site_lines(rw.sites, describe, estimates, actual, plans)
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
        con = self._connection()
        register_sites(con, runners)  # nested calls may remain inside FROM subqueries
        try:
            rows, distinct = con.sql(probe.sql(dialect="duckdb")).fetchall()[0]
        except duckdb.Error:
            return "input rows unknown (correlated or nested scope)"
        finally:
            unregister_sites(con, runners)
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
        """Stop serving (draining), close worker threads, cursors and the connection."""
        self.stop_serving()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for cur in self._cursors:
            cur.close()
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
    if st.online_rows or st.bulk_rows:
        answered = ", ".join(f"{k} {v:,}" for k, v in st.resolved_by.items())
        return lines + [f"online engine: {st.online_rows:,} rows as requests, {st.bulk_rows:,} "
                        f"as bulk rows; answered by {answered}"]
    for stage in st.stages:
        lines.append(f"stage {stage.model}: {stage.input_rows:,} in, {stage.resolved_rows:,} "
                     f"resolved, {stage.num_batches} batches, {stage.seconds:.3f} s")
    return lines


# -- offline planning helpers (used by Session.plan and `ken plan`) -------------------------------

TRACE_KINDS = ("azure", "poisson", "gamma")


def check_planning_args(devices: int, memory_gb: float, threads_per_device: int,
                        peak_qps: float | None, duration_s: float, num_ranges: int) -> None:
    """Reject impossible planning arguments before any model is profiled."""
    problems = []
    if devices < 1:
        problems.append(f"devices must be >= 1 (got {devices})")
    if not memory_gb > 0 or not math.isfinite(memory_gb):
        problems.append(f"memory per device must be > 0 GB (got {memory_gb})")
    if threads_per_device < 1:
        problems.append(f"threads per device must be >= 1 (got {threads_per_device})")
    if peak_qps is not None and (not peak_qps > 0 or not math.isfinite(peak_qps)):
        problems.append(f"peak QPS must be > 0 (got {peak_qps})")
    if not duration_s > 0 or not math.isfinite(duration_s):
        problems.append(f"the trace duration must be > 0 s (got {duration_s})")
    if num_ranges < 1:
        problems.append(f"the number of QPS ranges must be >= 1 (got {num_ranges})")
    if problems:
        raise KenError("cannot plan: " + "; ".join(problems))


def planning_inputs(profiles: Mapping[str, Profile], max_stages: int = 3,
                    grid_size: int = 16) -> tuple[Catalog, tuple[Cascade, ...]]:
    """The catalog and the candidate cascades (the Pareto set, cost at each model's best
    batch size) that a frontier is planned from."""
    from ken.optimizer.cascades import pareto_cascades
    from ken.optimizer.perf import Catalog

    front = pareto_cascades(profiles, max_stages=max_stages, grid_size=grid_size,
                            batch_size=None)
    return Catalog.from_profiles(profiles), tuple(m.cascade for m in front)


def sustained_qps(catalog: Catalog, cascade: Cascade, devices: int) -> float:
    """Rows/s that ``devices`` equal workers sustain running ``cascade`` flat out.

    ``devices / sum_i(f_i * s_i)``: ``f_i`` is the fraction of rows reaching stage ``i`` and
    ``s_i`` that model's seconds per row at its throughput-optimal (profiled) batch size.
    """
    seconds = 0.0
    for model, fraction in zip(cascade.models, catalog.stage_fractions(cascade), strict=True):
        perf = catalog.perf[model]
        seconds += fraction * min(perf.per_row_s(b) for b in perf.batch_sizes)
    return devices / seconds


def default_peak_qps(catalog: Catalog, cascades: Sequence[Cascade], devices: int) -> float:
    """1.5x the rate the most accurate candidate cascade sustains on all devices (rounded):
    the top QPS ranges then need cheaper cascades, so the frontier has something to trade."""
    best = max(cascades, key=catalog.accuracy)
    return float(max(1, round(1.5 * sustained_qps(catalog, best, devices))))


def planning_trace(kind: str | Trace, peak_qps: float, duration_s: float, seed: int = 0,
                   cv: float = 4.0) -> Trace:
    """The sample trace a frontier is planned on, with a 1-s peak of (about) ``peak_qps``.

    ``"azure"``: the Azure LLM inference trace (code) from the shared data folder, rate-scaled
    so that its busiest second has ``peak_qps`` arrivals, cut to the ``duration_s`` window
    around that second. ``"poisson"`` / ``"gamma"`` (bursty, CV ``cv``): ``duration_s`` of
    synthetic arrivals whose mean rate is set so that the busiest second has ``peak_qps``.
    A ``Trace`` is rate-scaled to the peak and used whole.
    """
    from ken.optimizer.workload import (
        Trace,
        WorkloadError,
        fit_peak,
        gamma_trace,
        load_azure_trace,
        poisson_trace,
    )

    if isinstance(kind, Trace):
        return fit_peak(kind.rate_scaled, peak_qps / kind.qps_max(), peak_qps)
    if kind == "azure":
        try:
            full = load_azure_trace()
        except WorkloadError as exc:
            raise WorkloadError(f"{exc}; or plan on a synthetic trace: --trace poisson / "
                                "gamma (trace='poisson' in session.plan)") from None
        return fit_peak(lambda f: full.rate_scaled(f).around_peak(duration_s),
                         peak_qps / full.qps_max(), peak_qps)
    if kind == "poisson":
        return fit_peak(lambda r: poisson_trace(r, duration_s, seed), peak_qps * 0.8, peak_qps)
    if kind == "gamma":
        return fit_peak(lambda r: gamma_trace(r, duration_s, cv, seed), peak_qps / 4, peak_qps)
    raise WorkloadError(f"unknown trace {kind!r}; use one of {', '.join(TRACE_KINDS)} or pass "
                        "a ken.optimizer.workload.Trace")


def _planner_code_hash() -> str:
    """A hash of the planner's code, so cached frontiers are re-planned when it changes."""
    from ken.optimizer import cascades, perf, plan, planner, policy, scheduler, simulator

    digest = hashlib.sha256()
    for module in (cascades, perf, plan, planner, policy, scheduler, simulator):
        digest.update(inspect.getsource(module).encode())
    return digest.hexdigest()[:16]


def frontier_cache_key(operator: str, profiles: Mapping[str, Profile],
                       cascades: Sequence[Cascade], hardware: Hardware, trace: Trace,
                       qps_max: float, settings: PlannerSettings,
                       calibration: Mapping[str, tuple[float, ...]] | None = None) -> str:
    """What a frontier depends on: profiles, candidates, devices, trace, settings, code, and
    the runtime calibration if any."""
    digest = hashlib.sha256()
    parts = [operator, _planner_code_hash(), hardware.to_json(), f"{qps_max!r}",
             repr(settings.provenance()), trace.name, str(len(trace)),
             repr(sorted((calibration or {}).items()))]
    for name in sorted(profiles):
        p = profiles[name]
        parts += [name, p.model_fingerprint, p.hardware, p.sample_hash, repr(p.batch_sizes),
                  repr(p.batch_runtime_s), str(p.memory_bytes)]
    parts += [c.to_json() for c in cascades]
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    digest.update(trace.arrival_s.tobytes())
    return digest.hexdigest()[:16]


def plan_operator(operator: str, profiles: Mapping[str, Profile], catalog: Catalog,
                  cascades: Sequence[Cascade], hardware: Hardware, trace: Trace,
                  qps_max: float, settings: PlannerSettings, cache_dir: Path | None = None,
                  reporter: Reporter = QUIET, force: bool = False,
                  calibration: Mapping[str, tuple[float, ...]] | None = None,
                  ) -> tuple[Frontier, PlannerStats | None]:
    """``plan_frontier`` with an on-disk cache in ``cache_dir`` (stats are None on a hit).
    ``calibration``: the runtime spreads ``catalog`` was calibrated with (part of the key)."""
    from ken.optimizer.plan import Frontier
    from ken.optimizer.planner import plan_frontier

    largest = max(d.memory_bytes for d in hardware.devices)
    too_big = sorted(m for m in {m for c in cascades for m in c.models}
                     if catalog.perf[m].memory(1) > largest)
    if too_big:
        needs = ", ".join(f"{m} {catalog.perf[m].memory(1) / 2**20:,.0f} MB" for m in too_big)
        raise KenError(f"cannot plan {operator}: a replica needs its model's weights on one "
                       f"device ({needs}), but the largest device has "
                       f"{largest / 2**20:,.0f} MB; give the devices more memory "
                       "(--memory-gb, memory_gb=...)")
    path = None
    if cache_dir is not None:
        key = frontier_cache_key(operator, profiles, cascades, hardware, trace, qps_max,
                                 settings, calibration)
        path = cache_dir / f"{operator}-{key}.json"
        if path.is_file() and not force:
            reporter.note(f"{operator}: frontier from cache {path}")
            return Frontier.load(path), None
    frontier, stats = plan_frontier(operator, cascades, catalog, hardware, trace,
                                    qps_max=qps_max, settings=settings, reporter=reporter)
    if path is not None:
        frontier.save(path)
    return frontier, stats


def connect(path: str | Path | None = None, **options: Any) -> Session:
    """Open a session on an in-memory DuckDB database, or a persistent one at ``path``.

    >>> session = connect()
    >>> session.sql("SELECT 42 AS answer").fetchall()
    [(42,)]
    """
    return Session(path, **options)
