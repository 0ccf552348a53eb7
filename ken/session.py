"""Session: a DuckDB connection plus semantic functions, their models and cascades.

>>> import ken
>>> s = ken.connect()
>>> s.sql("CREATE TABLE t AS SELECT * FROM (VALUES ('loved it'), ('awful')) v(text)")
>>> s.sql("SELECT text, sentiment(text) AS mood FROM t").fetchall()   # doctest: +SKIP
"""

from __future__ import annotations

import itertools
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

from ken.errors import KenError
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig, Model
from ken.models.quality import EvalSample
from ken.ops import builtin_operators
from ken.ops.base import Bound, ModelOperator, OpContext, Operator
from ken.paths import ken_home
from ken.progress import QUIET, Reporter
from ken.sql.execute import SiteRunner, query_error, register_sites, unregister_sites
from ken.sql.explain import actual_lines, build, estimate, render, site_lines
from ken.sql.rewrite import Rewritten, SqlError, parse, rewrite

if TYPE_CHECKING:
    from ken.engine.serving import Engine, LoadReport
    from ken.optimizer.planner import PlannerSettings
    from ken.optimizer.query import QueryPlan, Target
    from ken.optimizer.workload import Trace
    from ken.policy.plan import Frontier, GearPlan

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
        from ken.optimizer.planning import choose_cascade

        self.ctx = OpContext(device, home, data, reporter, batch_size, chooser=choose_cascade)
        # the operator registry: SQL name -> Operator (see ken.ops)
        self.operators: dict[str, Operator] = builtin_operators() if builtins else {}
        self._bound: dict[tuple[str, tuple[str, ...]], Bound] = {}
        self._lock = threading.Lock()
        self._known: frozenset[str] | None = None
        self.frontiers: dict[str, Frontier] = {}
        self._gear_plans: dict[str, GearPlan] = {}
        # online serving: one engine for the session's pool of devices, serving every
        # function in ``_served`` with its gear plan
        self._engine: Engine | None = None
        self._served: set[str] = set()
        self.bulk_threshold = 64
        # DuckDB connections run one query at a time: other threads get cursors of ``con``
        self._owner_thread = threading.get_ident()
        self._local = threading.local()
        self._cursors: list[duckdb.DuckDBPyConnection] = []
        self._tables: dict[str, Any] = {}
        self._tables_version = 0
        self._thread_ids = itertools.count(1)
        self._pool: ThreadPoolExecutor | None = None

    @property
    def device(self) -> DeviceConfig:
        return self.ctx.device

    @property
    def home(self) -> Path | None:
        return self.ctx.home

    @property
    def reporter(self) -> Reporter:
        return self.ctx.reporter

    @property
    def batch_size(self) -> int:
        return self.ctx.batch_size

    # -- registry ----------------------------------------------------------------------------

    @property
    def sentiment_cascade(self) -> Cascade | None:
        """The cascade ``sentiment()`` runs when no gear plan serves it (None: the cheapest
        Pareto cascade at least as accurate as the best single model)."""
        op = self.operators.get("sentiment")
        return getattr(op, "cascade", None)

    @sentiment_cascade.setter
    def sentiment_cascade(self, cascade: Cascade | None) -> None:
        op = self.operators.get("sentiment")
        if op is None or not hasattr(op, "cascade"):
            raise KenError("this session has no built-in sentiment() to set a cascade for")
        op.cascade = cascade
        with self.ctx.lock:
            self._bound = {k: v for k, v in self._bound.items() if k[0] != "sentiment"}

    def register(self, name: str, operator: Operator | Model | Cascade,
                 models: Mapping[str, Model] | None = None, sample: EvalSample | None = None,
                 output_type: str = "varchar") -> None:
        """Make ``operator`` callable from SQL as ``name(...)``.

        ``operator`` is an ``Operator`` (e.g. a ``SemanticFunction``), a single ``Model`` (its
        values are the SQL values), or a ``Cascade`` together with ``models``. With ``sample``
        (an ``EvalSample``) a model or cascade can be profiled and planned like a built-in.
        """
        name = name.lower()
        if isinstance(operator, Operator):
            op = operator if operator.name == name else operator.renamed(name)
        elif isinstance(operator, Model):
            op = ModelOperator(name, Cascade((operator.name,)), {operator.name: operator},
                               output_type, sample)
        elif isinstance(operator, Cascade):
            if models is None:
                raise KenError("registering a Cascade needs models=... with its models")
            op = ModelOperator(name, operator, models, output_type, sample)
        else:
            raise KenError(f"cannot register {type(operator).__name__} as {name}(); pass an "
                           "Operator (e.g. ken.SemanticFunction), a Model, or a Cascade with "
                           "models=...")
        if name in self._duckdb_functions():
            raise KenError(f"{name}() is a DuckDB function; choose another name")
        self.operators[name] = op
        self._bound = {k: v for k, v in self._bound.items() if k[0] != name}
        # plans were for the operator this name named before
        self.frontiers.pop(name, None)
        self._gear_plans.pop(name, None)
        # the engine keeps serving the other functions; calls of the new one run in-process
        self._served.discard(name)

    def bind(self, function: str, constants: tuple[str, ...]) -> Bound:
        """The operator ``function`` bound to ``constants`` (made once per session)."""
        key = (function, constants)
        with self.ctx.lock:
            if key not in self._bound:
                self._bound[key] = self.operators[function].bind(self.ctx, constants)
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
        from ken.policy.plan import GearPlan

        if not isinstance(plan, GearPlan):
            raise KenError(f"use_plan() takes a GearPlan, not {type(plan).__name__}; load one "
                           "with ken.Frontier.load(path).pick(...)")
        name = plan.operator.lower()
        if name not in self.operators:
            raise KenError(f"the gear plan is for {plan.operator}(), which is not a semantic "
                           f"function of this session; registered: "
                           f"{', '.join(sorted(self.operators)) or '(none)'}")
        self._set_plan(name, plan)

    def _set_plan(self, name: str, plan: GearPlan) -> None:
        """Keep ``plan`` for ``name``; a running engine of ``name`` swaps to it."""
        self._gear_plans[name] = plan
        if name in self._served and self._engine is not None:
            self._engine.swap_plan(plan, self._model_sources(name, self._engine.workers,
                                                             self._engine.threads_per_device))

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
        from ken.optimizer.planning import (
            check_planning_args,
            default_peak_qps,
            operator_profiles,
            plan_operator,
            planning_inputs,
            planning_trace,
        )
        from ken.optimizer.query import Target, choose_plans
        from ken.optimizer.workload import Hardware

        if isinstance(target, str):
            target = Target.parse(target)
        names = [f.lower() for f in functions]
        if not names:
            raise KenError("plan() needs at least one semantic function, e.g. "
                           "functions=('sentiment',)")
        for name in names:
            if name not in self.operators:
                raise KenError(f"unknown function {name}(); semantic functions registered on "
                               f"this session: {', '.join(sorted(self.operators)) or '(none)'}")
            if not self.operators[name].plannable():
                plannable = ", ".join(sorted(n for n, op in self.operators.items()
                                             if op.plannable())) or "none"
                raise KenError(
                    f"{name}() cannot be planned: gear plans are built from model profiles on "
                    f"a labelled evaluation sample, and {name}() has none "
                    f"({self.operators[name].eval_description()}); functions this session "
                    f"can plan: {plannable}. Register it with sample=ken.EvalSample(...), or "
                    "set a plan made elsewhere with session.use_plan(...)")
        check_planning_args(devices, memory_gb, threads_per_device, peak_qps, duration_s,
                            num_ranges)
        hardware = Hardware.cpu_workers(devices, int(memory_gb * 2**30))
        settings = settings or PlannerSettings(num_ranges=num_ranges)
        profiles = {n: operator_profiles(self.operators[n], self.ctx, threads_per_device)
                    for n in names}
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
        """The online engine serving each served function (read-only view; one engine
        serves them all on the session's devices)."""
        engine = self._engine
        return MappingProxyType({} if engine is None else dict.fromkeys(self._served, engine))

    def serve(self, functions: Sequence[str] | None = None,
              workers: str = "auto", threads_per_device: int = 1,
              max_in_flight: int = 10_000, bulk_threshold: int | None = None,
              memory_gb: float | None = None) -> dict[str, LoadReport]:
        """Serve the functions with a gear plan (all of them by default) on one online engine.

        From then on every query's calls of a served function go through its engine, from any
        number of threads (``sql``) or tasks (``asql``) at once: a chunk of fewer than
        ``bulk_threshold`` distinct new inputs enters as online requests (metered, batched with
        other queries' rows by the gear plan), a larger one as bulk rows (the plan's most
        accurate gear in throughput-sized batches). One engine serves every function on the
        same devices, as the query optimizer planned them together; serving more functions
        later adds them to it. ``workers="auto"`` runs each device in its own process when
        every function's models can be loaded there (the packaged ones can), else as threads;
        ``memory_gb`` is a budget per process worker. Returns the model load times (and
        worker memory) per function.

        >>> session.plan("p95 <= 50")                   # doctest: +SKIP
        >>> session.serve()                             # doctest: +SKIP
        >>> session.sql("SELECT sentiment(?)", ["great game!"]).fetchall()   # doctest: +SKIP
        """
        from ken.engine.serving import Engine, LoadReport

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
        names = [n for n in dict.fromkeys(names) if n not in self._served]
        reports: dict[str, LoadReport] = {}
        if not names:
            return reports
        if self._engine is not None:  # add the functions to the running engine
            engine = self._engine
            for name in names:
                started = time.perf_counter()
                engine.swap_plan(self._gear_plans[name], self._model_sources(
                    name, engine.workers, engine.threads_per_device))
                reports[name] = LoadReport({}, time.perf_counter() - started, engine.workers)
                self._served.add(name)
            return reports
        kind = workers
        per_function: dict[str, Mapping[str, Any]] = {}
        if kind in ("auto", "process"):
            loaders = {n: self._loaders(n, threads_per_device) for n in names}
            if kind == "process" or all(loaders.values()):
                kind = "process"
                per_function = {n: self._check_loaders(n, loaders[n]) for n in names}
            else:
                kind = "thread"
        if kind == "thread":
            per_function = {n: self._model_sources(n, kind, threads_per_device) for n in names}
        sources: dict[str, Any] = {}
        for models in per_function.values():
            for model, source in models.items():
                if sources.setdefault(model, source) is not source and kind == "thread":
                    raise KenError(f"two served functions name different models {model!r}; "
                                   "give the models distinct names")
        engine = Engine([self._gear_plans[n] for n in names], sources,
                        max_in_flight=max_in_flight, workers=kind,  # type: ignore[arg-type]
                        threads_per_device=threads_per_device,
                        memory_budget_bytes=None if memory_gb is None
                        else int(memory_gb * 2**30))
        devices = sorted({d for n in names for d in self._gear_plans[n].devices})
        with self.reporter.task(f"start the engine for {', '.join(f'{n}()' for n in names)}: "
                                f"{kind} workers on {', '.join(devices)}", 1) as advance:
            report = engine.start()
            advance(1)
        self._engine = engine
        self._served.update(names)
        return dict.fromkeys(names, report)

    def _model_sources(self, name: str, workers: str, threads: int) -> Mapping[str, Any]:
        """What an engine of ``name`` loads: picklable loaders for process workers, the
        session's loaded models for thread workers."""
        if workers == "process":
            return self._check_loaders(name, self._loaders(name, threads))
        op = self.operators[name]
        models = dict(self.bind(name, op.eval_constants).models)
        placed = {r.model for r in self._gear_plans[name].placement}
        if not placed <= set(models):  # a plan over candidates the binding does not use
            models.update(op.candidates(self.ctx, self.device))
        return models

    def _loaders(self, name: str, threads: int) -> Mapping[str, Callable[[], Model]] | None:
        return self.operators[name].loaders(self.ctx, threads)

    @staticmethod
    def _check_loaders(name: str, loaders: Mapping[str, Callable[[], Model]] | None
                       ) -> Mapping[str, Callable[[], Model]]:
        if not loaders:
            raise KenError(f"{name}() has no model loaders for worker processes; serve it "
                           "with workers='thread'")
        return loaders

    def stop_serving(self, drain: bool = True) -> int:
        """Shut the engine down (draining admitted requests first, by default); returns how
        many requests it cancelled."""
        engine, self._engine = self._engine, None
        self._served.clear()
        return 0 if engine is None else engine.shutdown(drain=drain)

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

    def _planned_for_other_constants(self, function: str, constants: tuple[str, ...]) -> bool:
        """A plan of an operator with constants is made on its evaluation constants: its
        models answer those, so calls with other constants cannot use it."""
        planned_for = self.operators[function].eval_constants
        return bool(planned_for) and constants != planned_for

    def _serving_engine(self, function: str, constants: tuple[str, ...]) -> Engine | None:
        """The engine that answers a call, or None when the call runs in-process."""
        if function not in self._served or self._planned_for_other_constants(function,
                                                                            constants):
            return None
        return self._engine

    def _gear_plan_lines(self, function: str, constants: tuple[str, ...] = ()) -> list[str]:
        plan = self._gear_plans.get(function)
        if plan is not None and self._planned_for_other_constants(function, constants):
            planned_for = self.operators[function].eval_constants
            return [f"gear plan: planned for {function}({', '.join(map(repr, planned_for))}); "
                    "this call has other constants, so it runs the implementation above "
                    "in-process"]
        if plan is None:
            if self.operators[function].plannable():
                return ["gear plan: none (run session.plan(...) or `ken plan`)"]
            return [f"gear plan: none ({function}() has no profiles to plan with; "
                    "session.use_plan(...) sets one)"]
        gears = len(plan.gears())
        engine = self._serving_engine(function, constants)
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
            rw = rewrite(statement, self.operators, self._duckdb_functions(), next_site,
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
            engine = self._serving_engine(site.function, site.constants)
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
        plans = {s.id: self._gear_plan_lines(s.function, s.constants) for s in rw.sites}
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
        actual = {r.site.id: actual_lines(r) for r in runners}
        out = lines + site_lines(rw.sites, describe, estimates, actual, plans)
        out += ["", f"Total time: {seconds:.3f} s", "",
                "DuckDB physical plan (actual rows and time per operator):", physical]
        return "\n".join(out)

    def _estimate(self, rw: Rewritten, site: Any) -> str:
        runners = self._runners(rw)
        con = self._connection()
        register_sites(con, runners)  # nested calls may remain inside FROM subqueries
        try:
            return estimate(con, rw, site, self.bind(site.function, site.constants))
        finally:
            unregister_sites(con, runners)

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


def connect(path: str | Path | None = None, **options: Any) -> Session:
    """Open a session on an in-memory DuckDB database, or a persistent one at ``path``.

    >>> session = connect()
    >>> session.sql("SELECT 42 AS answer").fetchall()
    [(42,)]
    """
    return Session(path, **options)
