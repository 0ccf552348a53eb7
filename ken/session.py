"""Session: a DuckDB connection plus semantic functions, their models and cascades.

The session holds state: the database (``ken.sql.database``), the operator registry and the
operators bound to constants, the frontiers and plans, and the serving manager. Statements go
from text to result through its ``QueryRunner`` (``ken.sql.runner``).

>>> import ken
>>> s = ken.connect()
>>> s.sql("CREATE TABLE t AS SELECT * FROM (VALUES ('loved it'), ('awful')) v(text)")
>>> s.sql("SELECT text, sentiment(text) AS mood FROM t").fetchall()   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ken.cache import CacheError, ResultCache, cache_setting
from ken.cache import default_path as default_cache_path
from ken.engine.manager import ServingManager
from ken.engine.ray_runner import RayCluster, stop_local_ray
from ken.errors import KenError
from ken.frame import Frame
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig, Model
from ken.models.quality import EvalSample
from ken.ops import builtin_operators
from ken.ops.base import Bound, ModelOperator, OpContext, Operator
from ken.ops.training import Trained
from ken.optimizer.planning import choose_cascade, plan_functions
from ken.optimizer.query import QueryPlan, Target
from ken.optimizer.replan import GearReplan
from ken.paths import ken_home
from ken.policy.decoding import ServiceTargets
from ken.policy.plan import Frontier, Plan
from ken.progress import Reporter
from ken.sql.database import Database
from ken.sql.guarantee import Targets
from ken.sql.result import Result
from ken.sql.runner import QueryRunner

if TYPE_CHECKING:
    from ken.engine.server import Server
    from ken.engine.supervision import BatchDeadline, LoadReport
    from ken.optimizer.plan_context import PlannerSettings
    from ken.optimizer.workload import Trace


class Session:
    """A DuckDB connection with semantic SQL functions served by model cascades."""

    def __init__(self, path: str | Path | None = None, device: DeviceConfig | None = None,
                 data: Any = None, home: Path | None = None, batch_size: int = 32,
                 reporter: Reporter | None = None, builtins: bool = True,
                 cache: bool | str | Path | ResultCache | None = None) -> None:
        """``reporter``: where progress goes. By default the session is silent except for
        long work (preparing the model family on first use, profiling): that says what it
        is about to do and roughly how long it takes, then shows its progress on stderr;
        ``reporter=ken.progress.QUIET`` silences that too.

        ``cache``: where answers persist across queries and sessions (``ken.cache``): True for
        ``KEN_HOME/cache/results.sqlite``, a path for another file, False for none. The
        default is on, unless the environment sets ``KEN_CACHE=off`` (or a path)."""
        self.db = Database(path)
        self.con = self.db.con  # the connection of the thread that opened the session
        if reporter is None:
            reporter = Reporter(long_work_only=True)
        self.ctx = OpContext(device, home, data, reporter, batch_size, chooser=choose_cascade)
        # the operator registry: SQL name -> Operator (see ken.ops)
        self.operators: dict[str, Operator] = builtin_operators() if builtins else {}
        self._bound: dict[tuple[str, tuple[str, ...]], Bound] = {}
        self.frontiers: dict[str, Frontier] = {}
        # how to re-plan each function session.plan planned, while it is served
        self.replans: dict[str, GearReplan] = {}
        # gear plans and the one online engine serving them on the session's devices
        self.serving = ServingManager(self.operators, self.ctx, self.bind, self.db)
        self.ray_actors = 2  # actors of sql(..., engine="ray"), each of device.threads CPUs
        # sql(..., engine="ray") fails with an EngineError when its stream makes no progress
        # for this many seconds (None: ten times a block's profiled time, at least 5 minutes;
        # without a profile Ray Data's own, 30 minutes; ken.engine.ray_data.stall_limit_s)
        self.ray_stall_s: float | None = None
        # sql(..., engine="auto") runs a query's semantic step on Ray Data when it reads one
        # Parquet dataset of at least this many rows (None: never; ken.sql.ray_query)
        self.ray_min_rows: int | None = 10_000_000
        # ORDER BY <score> LIMIT k sends few rows to a cascade's expensive stages (ken.sql.topk;
        # False, or SET ken_topk = off: every row through the whole cascade)
        self.topk = True
        # escalated rows whose expensive scores measure its margin (a pruned row exceeds the
        # margin with probability <= 1 / (topk_sample + 1) if exchangeable with them)
        self.topk_sample = 19
        # the result cache (opened on first use); cache_enabled = False (SET ken_cache = off)
        # runs every query without it
        self._cache_spec = cache_setting(cache)
        self.cache_enabled = self._cache_spec is not False
        self._cache: ResultCache | None = cache if isinstance(cache, ResultCache) else None
        self._owns_cache = self._cache is None  # a ResultCache given is the caller's to close
        # a query estimated to make more model calls, or take more model time (seconds), is
        # refused before it runs (ken.sql.cost; SET ken_max_model_calls / _seconds); None: no
        # limit
        self.max_model_calls: int | None = None
        self.max_model_seconds: float | None = None
        # accuracy / precision / recall targets against an oracle stage, with a guarantee
        # (ken.sql.guarantee; set_target, SET ken_recall_target = 0.9)
        self.targets = Targets()
        self._queries = QueryRunner(self)
        self._closed = False
        _OPEN[0] += 1

    @property
    def cache(self) -> ResultCache | None:
        """The result cache queries read and write, or None while it is off."""
        if not self.cache_enabled:
            return None
        if self._cache is None:
            spec = self._cache_spec
            path = spec if isinstance(spec, Path) else default_cache_path(self.home)
            try:
                self._cache = ResultCache(path, warn=self.reporter.warn)
            except CacheError as exc:  # costs the cache's answers, not the session's queries
                self.reporter.warn(f"{exc}; this session runs without the result cache")
                self.cache_enabled = False
                return None
        return self._cache

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
        self._unbind("sentiment")

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
        if name in self.db.functions():
            raise KenError(f"{name}() is a DuckDB function; choose another name")
        self.operators[name] = op
        self.forget(name)

    def bind(self, function: str, constants: tuple[str, ...]) -> Bound:
        """The operator ``function`` bound to ``constants`` (made once per session, and again
        when the operator's settings change, e.g. its ``llms``)."""
        operator = self.operators[function]
        key = (function, constants, operator.binding_key())
        with self.ctx.lock:
            if key not in self._bound:
                # a binding made under the operator's earlier settings is not used again
                self._bound = {k: v for k, v in self._bound.items() if k[:2] != key[:2]}
                self._bound[key] = operator.bind(self.ctx, constants)
            return self._bound[key]

    def forget(self, function: str) -> None:
        """Drop what the session derived from ``function``'s operator (its bound forms, its
        frontier and plan): the operator was replaced or trained."""
        self._unbind(function)
        # plans were for the operator as it was
        self.frontiers.pop(function, None)
        self.serving.forget(function)

    def _unbind(self, function: str) -> None:
        with self.ctx.lock:
            self._bound = {k: v for k, v in self._bound.items() if k[0] != function}

    # -- plans (offline phase) ---------------------------------------------------------------

    @property
    def plans(self) -> Mapping[str, Plan]:
        """The plan of each planned semantic function, of either kind (read-only view)."""
        return self.serving.plans

    @property
    def bulk_threshold(self) -> int:
        """Chunks of at least this many distinct new inputs enter a served function's engine
        as bulk rows (fewer: as online requests)."""
        return self.serving.bulk_threshold

    @bulk_threshold.setter
    def bulk_threshold(self, value: int) -> None:
        self.serving.bulk_threshold = value

    def use_plan(self, plan: Plan) -> None:
        """Set the plan of ``plan.operator`` by hand: a gear plan picked from a frontier file
        written by ``ken plan`` (``Frontier.load(path).pick(min_accuracy=0.7)``), or any plan
        file (``ken.Plan.load(path)``: a gear plan, or a generating function's generation
        plan). A served function swaps to it."""
        if not isinstance(plan, Plan):
            raise KenError(f"use_plan() takes a plan (ken.Plan), not {type(plan).__name__}; "
                           "load one with ken.Plan.load(path) or "
                           "ken.Frontier.load(path).pick(...)")
        name = plan.operator.lower()
        if name not in self.operators:
            raise KenError(f"the plan is for {plan.operator}(), which is not a semantic "
                           f"function of this session; registered: "
                           f"{', '.join(sorted(self.operators)) or '(none)'}")
        self.replans.pop(name, None)  # a plan given by hand is not re-planned
        self.serving.set_plan(name, plan)

    def plan(self, target: Target | str, functions: Sequence[str] = ("sentiment",),
             trace: Trace | str | None = None, devices: int | None = None,
             memory_gb: float = 4.0, threads_per_device: int = 1,
             peak_qps: float | None = None, duration_s: float = 120.0, num_ranges: int = 8,
             settings: PlannerSettings | None = None, force: bool = False,
             cluster: str | None = None, gpus: int | None = None,
             gpu_memory_gb: float | None = None, qps: float | None = None,
             rows: int = 64, requests: int = 120) -> QueryPlan:
        """Plan ``functions`` offline and pick one plan each for ``target``: a quality floor
        (``"accuracy >= 0.75"``) or a latency bound (``"p95 <= 200ms"``; for generating
        functions also ``"ttft_p95 <= 2s"``, ``"tgt_p95 <= 15s"``).

        Profiles the functions' models (cached), searches their Pareto cascades, builds each
        function's frontier of gear plans for this machine's devices: its GPUs when torch sees
        any (``gpus``: how many, 0 for none; each with ``gpu_memory_gb``, by default 90% of its
        memory, for weights, activations and KV cache; models are profiled on the first), else
        ``devices`` CPU workers (2 by default; asking for them plans without the GPUs) of
        ``threads_per_device`` threads and ``memory_gb`` each, on ``trace`` ("azure" — the
        default, from the shared
        data folder —, "poisson", "gamma", or a ``Trace``), and chooses plans with the query
        optimizer. Without ``peak_qps`` the load planned for is 1.5x what the slowest
        function's most accurate cascade sustains (at most 2000 qps). Frontiers are cached
        under ``KEN_HOME/plans``; the chosen plans are kept on the session
        (``session.plans``, shown by EXPLAIN). ``cluster`` plans for the devices of a
        Ray cluster instead ("auto": the running cluster, "ray://host:port", or "local": a
        Ray started here): each node's CPUs in devices of ``threads_per_device`` threads with
        ``memory_gb`` each (``pip install 'ken[ray]'``).

        A generating function (``sem_qa``, ``sem_map``, ``sem_extract``) gets a generation
        plan (cascades of its LMs chosen by the requests in the system, served by a decode
        server) for online requests arriving at ``qps`` per second on average: its LMs answer
        ``rows`` rows of its evaluation sample first (minutes, once per session), and the
        plans are simulated on windows of ``requests`` arrivals of the Azure trace (or
        ``trace``). ``PlanningError`` says how close the closest plan came when none meets
        the target.

        A classifier function with an accuracy, precision or recall target
        (``set_target``, or ``SET ken_<metric>_target`` for every function) is planned from
        cascades certified against it on its profile sample (``ken.optimizer.certified``):
        every gear of its plans, and of the plans re-planning swaps in while it is served,
        keeps the target, so a served query with that target runs (EXPLAIN says so).

        >>> qp = session.plan("accuracy >= 0.7")              # doctest: +SKIP
        >>> qp.plan_for("sentiment").describe()               # doctest: +SKIP
        >>> session.plan("tgt_p95 <= 20s", functions=["sem_qa"], qps=0.3)  # doctest: +SKIP
        """
        if isinstance(target, str):
            target = Target.parse(target)
        hardware = None
        if cluster is not None and (gpus or gpu_memory_gb):
            raise KenError("plan(cluster=...) plans the cluster's CPU workers; gpus= and "
                           "gpu_memory_gb= are for this machine's GPUs")
        if cluster is not None:
            hardware = RayCluster.connect(cluster).hardware(
                threads_per_device, memory_bytes=int(memory_gb * 2**30))
        names = [f.lower() for f in functions]
        guarantees = {n: t for n in names if (t := self.targets.for_function(n)) is not None}
        chosen, frontiers, replans, certified = plan_functions(
            self.operators, self.ctx, names, target, trace, devices,
            memory_gb, threads_per_device, peak_qps, duration_s, num_ranges, settings, force,
            cache_dir=(self.home or ken_home()) / "plans", hardware=hardware, gpus=gpus,
            gpu_memory_gb=gpu_memory_gb, qps=qps, rows=rows, requests=requests,
            guarantees=guarantees)
        self.frontiers.update(frontiers)
        self.replans.update(replans)
        for n in names:  # what the new plans were certified for (nothing, without a target)
            self.targets.certified.pop(n, None)
        self.targets.certified.update(certified)
        for p in chosen.plans:
            self.serving.set_plan(p.operator, p)
        return chosen

    # -- online serving (issue 5) -------------------------------------------------------------

    @property
    def engines(self) -> Mapping[str, Server]:
        """The server of each served function (read-only view): one online engine serves
        every function with a gear plan on the session's devices, a decode server each
        function with a generation plan."""
        return self.serving.engines()

    def serve(self, functions: Sequence[str] | None = None,
              workers: str = "auto", threads_per_device: int = 1,
              max_in_flight: int = 10_000, bulk_threshold: int | None = None,
              memory_gb: float | None = None, admission: str = "plan",
              latency_target_s: float | None = None, cluster: str | None = None,
              replan: bool = True, decode_targets: ServiceTargets | None = None,
              dropping: str | None = None, deadline: BatchDeadline | None = None,
              decode_priority: str = "normal", standby: bool = True
              ) -> dict[str, LoadReport]:
        """Serve the functions with a gear plan (all of them by default) on one online engine.

        From then on every query's calls of a served function go through its engine, from any
        number of threads (``sql``) or tasks (``asql``) at once: a chunk of fewer than
        ``bulk_threshold`` distinct new inputs enters as online requests (metered, batched with
        other queries' rows by the gear plan), a larger one as bulk rows (the plan's most
        accurate gear in throughput-sized batches). One engine serves every function on the
        same devices, as the query optimizer planned them together; serving more functions
        later adds them to it. ``workers="auto"`` runs each device in its own process when
        every function's models can be loaded there (the packaged ones can), else as threads;
        ``memory_gb`` is a budget per process worker. ``admission="plan"`` (the default)
        admits an online request only while the gear plan can answer it within
        ``latency_target_s`` (default: the p99 the plan's simulation predicted) and rejects the
        rest at once with a retry hint; ``"max_in_flight"`` bounds only the number of requests
        in flight. A generating function's decode server admits the same way, by the queue
        its passes still have to run (``ken.engine.decode_admission``); ``"max_in_flight"``
        queues every request there. ``workers="ray"`` or a ``cluster`` ("auto",
        "ray://host:port", "local") runs each device as a Ray actor, on the node the plan
        placed it when the plan was made for that cluster (``plan(..., cluster=...)``). With
        ``replan`` (the default) a function planned by ``session.plan`` is re-planned in the
        background when its workload leaves what its plan covers (arrivals well above its
        last gear's range, escalation rates off what the plan assumed: the inputs got harder,
        answers slower than a latency target), for the same target; the new plan is swapped
        in without dropping a request, and the serving log and EXPLAIN say
        when and why (``ken.engine.replanning``). A plan set with ``use_plan`` is kept as
        given. Returns the model load times (and worker memory) per function.

        A generating function with a generation plan gets a decode server; with
        ``decode_targets`` (``ken.ServiceTargets(ttft_s, tbt_s)``: the first token within
        ``ttft_s`` of arrival, then one every ``tbt_s``) its prefills take the waiting requests
        by deadline and pending time (Apt-Serve's rule, ``ken.policy.decoding``) rather than in
        arrival order, with each model's passes estimated by its measured token cost.
        ``decode_priority="background"`` runs a decode server's passes on a CPU in Linux's
        idle scheduling class (a classifier worker that wakes takes the core at once), so that
        classifier functions served on the same cores keep their tail latency beside it
        (``benchmarks/decode_priority.py``); its generations then get what the cores leave and
        slow down while the classifiers saturate them. Default ``"normal"``: they share.

        ``dropping`` (``"none"``, ``"reactive"``, ``"proactive"``, ``"proactive-profiled"``:
        proactive on the profiled runtimes alone, not scaled by how fast batches ran, or
        ``"proactive-first-model"``: a cascade charged its first model alone; see
        ``ken.policy.dropping``): the served functions are
        the stages of a pipeline whose requests carry end-to-end deadlines
        (``session.engines[function].submit(..., deadline_s=, route=)``, or the calls of the
        queries run inside ``with ken.engine.deadlines.within(deadline):``, e.g.
        ``ken.multihop.answer_stream(..., budget_s=)``); the engine drops, at once and with
        the reason, a request that can no longer make its deadline (``ken.engine.deadlines``;
        PARD's proactive dropping; a query whose row is dropped raises
        ``ken.errors.RequestDropped``). Default: never drop.

        SIGTERM drains what is served, then exits with status 143: from the signal on, new
        statements raise ``ken.errors.ShuttingDown``; a query waiting on a server gets its rows,
        or ``ken.errors.ServingStopped`` for rows sent after the drain began; a statement still
        running 5 s after the drain is interrupted (``ShuttingDown``).

        ``standby`` (default True): with worker processes or Ray actors, a model a plan places
        on one CPU worker is loaded on another one too, with no share of the rows, and
        serves the rows that would wait for its own worker while that worker reloads after a
        crash or a kill (``ken.engine.standby``; EXPLAIN names the copies); a worker holds its
        standby copies beside its own models, counted against ``memory_gb``. Not on GPUs, nor
        with ``dropping``. False: only what the plans place.

        ``deadline`` (``ken.engine.supervision.BatchDeadline``) bounds each model call: 10x
        its profiled runtime (at least 2 s); for a plan without runtimes (``use_plan`` of a
        plan written by hand), 10x what the model's calls took while serving, and
        ``first_call_s`` (20 s) until one returned. A call past it is retried once on a fresh
        worker, then its query raises ``ken.errors.ModelCallFailed`` saying the model did not
        return within the deadline.

        >>> session.plan("p95 <= 50")                   # doctest: +SKIP
        >>> session.serve()                             # doctest: +SKIP
        >>> session.sql("SELECT sentiment(?)", ["great game!"]).fetchall()   # doctest: +SKIP
        """
        reports = self.serving.serve(functions, workers, threads_per_device, max_in_flight,
                                     bulk_threshold, memory_gb, admission, latency_target_s,
                                     cluster, decode_targets, dropping, deadline,
                                     decode_priority, standby)
        if replan:
            for name in reports:
                recipe = self.replans.get(name)
                if recipe is not None and self.serving.plans[name].kind == "gear":
                    self.serving.watch(name, recipe)
        return reports

    def stop_serving(self, drain: bool = True) -> int:
        """Shut the engine down (draining admitted requests first, by default); returns how
        many requests it cancelled."""
        return self.serving.stop(drain)


    def set_target(self, function: str, metric: str = "accuracy", target: float = 0.9,
                   delta: float = 0.05, oracle: str | None = None) -> None:
        """Queries calling ``function`` meet ``metric`` >= ``target`` against ``oracle`` (a
        model of its cascade; None: the last) with probability >= 1 - ``delta``: thresholds
        chosen on a sample the oracle labels, sized by the bound (``ken.sql.guarantee``).
        ``metric``: accuracy, or precision / recall of true for a boolean function.
        ``clear_target`` removes it. A function an online engine serves keeps its target
        only when it was planned under it: set the target before ``plan``.

        >>> session.set_target("sem_filter", "recall", 0.9)  # doctest: +SKIP
        """
        self.targets.set(self.operators, function, metric, target, delta, oracle)

    def clear_target(self, function: str | None = None) -> None:
        """Remove ``function``'s target (None: every target, the SQL one too)."""
        if function is None:  # the plans stay what they were certified for
            self.targets = Targets(certified=self.targets.certified)
        else:
            self.targets.by_function.pop(function.lower(), None)

    # -- statements (ken.sql.runner) ---------------------------------------------------------

    def sql(self, query: str, params: Any = None, engine: str = "auto") -> Result:
        """Run one statement of DuckDB SQL with semantic functions. ``EXPLAIN [ANALYZE]``
        prefixes explain it; ``TRAIN ...`` trains a semantic function (``ken.sql.train``).

        Text with more than one statement is an error and nothing runs (so a value formatted
        into a query cannot append a statement); ``sql_script`` runs several in order.

        ``engine="ray"`` runs the semantic calls of a query over one big Parquet dataset on
        Ray Data (``ken.sql.ray_query``: streamed through ``ray_actors`` actors of
        ``threads`` CPUs, models loaded once per actor), then the rest of the query on
        DuckDB; the rows equal those of DuckDB's run. ``engine="auto"`` (the default) does so
        when the dataset holds at least ``session.ray_min_rows`` rows (10 million; None:
        never), Ray is installed, and no WHERE test outside the semantic calls would let
        DuckDB skip rows first; it says which engine it chose. ``engine="duckdb"``: never.

        >>> session.sql("SELECT sentiment(text) AS mood, count(*) FROM 'tweets/*.parquet' "
        ...             "GROUP BY mood", engine="ray")          # doctest: +SKIP
        """
        return self._queries.sql(query, params, engine)

    def sql_script(self, script: str) -> Result:
        """Run the statements of ``script`` one after another (``TRAIN ...; SELECT ...``),
        each as ``sql`` would; the result of the last one. A failing statement stops the
        script: the error names it, and the statements before it have run."""
        return self._queries.script(script)

    async def asql(self, query: str, params: Any = None) -> Result:
        """``sql`` for asyncio code: runs the query on a session worker thread, so many
        ``await session.asql(...)`` run at once and a served function batches their rows."""
        return await self._queries.asql(query, params)

    def explain(self, query: str, analyze: bool = False, params: Any = None) -> str:
        """The plan of ``query``: DuckDB parts, semantic operators, estimates (and actuals)."""
        return self._queries.explain(query, analyze, params)

    def train(self, function: str, table: str | Path | pa.Table | Any, label: str,
              columns: Sequence[str] | None = None, **options: Any) -> Trained:
        """Train (or calibrate) ``function`` on labelled rows; its SQL calls then use it.

        ``table`` is a table or view of this session (its name), a file DuckDB reads (a
        ``Path``: CSV, Parquet, JSON), an Arrow table or a pandas frame. ``label`` names the
        label column; ``columns`` the inputs (default: every text column but the label). The
        same rows train once (cached by their content hash). Options: ``predicate=`` for
        ``sem_filter`` and ``sem_join``; ``models=`` (member names) for ``sentiment``.

        >>> # session.train("sem_match", "my_pairs", label="is_match")
        >>> # session.train("sem_filter", "reviews", "liked", predicate="is positive")
        """
        return self._queries.train(function, table, label, columns, **options)

    # -- tables ------------------------------------------------------------------------------

    def register_table(self, name: str, data: Any) -> None:
        """Expose an Arrow table or pandas frame as a view ``name`` (in every thread)."""
        self.db.register(name, data)

    def table(self, name: str) -> Frame:
        return Frame.from_table(self, name)

    def from_arrow(self, table: pa.Table, name: str | None = None) -> Frame:
        name = name or f"__ken_arrow_{id(table):x}"
        self.register_table(name, table)
        return Frame.from_table(self, name)

    def close(self) -> None:
        """Stop serving (draining), close worker threads, cursors and the connection; the
        last open session to close also stops a local Ray that ken started for it (serving
        on Ray, ``engine="ray"``)."""
        if self._closed:
            return
        self._closed = True
        self.stop_serving()
        self._queries.close()
        self.db.close()
        if self._cache is not None and self._owns_cache:
            self._cache.close()
        _OPEN[0] -= 1
        if _OPEN[0] == 0:
            stop_local_ray()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: sessions open in this process (the last to close stops a local Ray ken started)
_OPEN = [0]


def connect(path: str | Path | None = None, **options: Any) -> Session:
    """Open a session on an in-memory DuckDB database, or a persistent one at ``path``.

    >>> session = connect()
    >>> session.sql("SELECT 42 AS answer").fetchall()
    [(42,)]
    """
    return Session(path, **options)
