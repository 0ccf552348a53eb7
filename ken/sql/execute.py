"""Runs the semantic call sites of a query as vectorised DuckDB functions over Arrow.

DuckDB hands each site Arrow chunks of the rows that reach it (after the relational predicates
it evaluates first). A site looks up inputs it has already answered (deduplication within the
query), sends the distinct new inputs through the cascade engine in batches, and returns one
value per row. NULL input gives NULL output without reaching a model.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa
from duckdb.sqltypes import BIGINT, BOOLEAN, DOUBLE, VARCHAR

from ken.cache import CacheError, ResultCache
from ken.engine.batch import CascadeResult, run_cascade
from ken.engine.deadlines import call_deadline
from ken.engine.serving import Engine
from ken.errors import (
    EngineBusy,
    KenError,
    ModelCallFailed,
    RequestDropped,
    ServingStopped,
)
from ken.models.cascade import Cascade
from ken.ops.base import Bound, struct_fields
from ken.sql.cache_key import Namespace
from ken.sql.rewrite import CallSite

#: how long a query keeps sending rows that the engine's admission turns away (seconds)
REJECTED_RETRY_S = 60.0

ARROW_TYPES = {"varchar": pa.string(), "boolean": pa.bool_(), "double": pa.float64(),
               "bigint": pa.int64()}
SQL_TYPES = {"varchar": VARCHAR, "boolean": BOOLEAN, "double": DOUBLE, "bigint": BIGINT}


def arrow_type(output_type: str) -> pa.DataType:
    """The Arrow type of an operator's output type (a scalar, or a STRUCT of scalars)."""
    fields = struct_fields(output_type)
    if fields is None:
        return ARROW_TYPES[output_type]
    return pa.struct([(name, ARROW_TYPES[kind]) for name, kind in fields])


def duckdb_type(output_type: str) -> Any:
    """The DuckDB type of an operator's output type."""
    fields = struct_fields(output_type)
    if fields is None:
        return SQL_TYPES[output_type]
    return duckdb.struct_type({name: SQL_TYPES[kind] for name, kind in fields})


@dataclass
class StageCounter:
    model: str
    input_rows: int = 0
    resolved_rows: int = 0
    num_batches: int = 0
    seconds: float = 0.0
    lm_calls: int = 0  # prompts a model answered that are not rows (sem_agg's reduction)


@dataclass
class SiteStats:
    """What one call site did while a query ran (for EXPLAIN ANALYZE and the tests)."""

    rows_in: int = 0  # rows DuckDB passed in (incl. NULLs and repeats)
    null_rows: int = 0
    distinct_evaluated: int = 0  # inputs sent to the models
    chunks: int = 0
    seconds: float = 0.0
    stages: list[StageCounter] = field(default_factory=list)
    online_rows: int = 0  # rows sent to an online engine as requests
    bulk_rows: int = 0  # ... and as bulk rows
    resolved_by: dict[str, int] = field(default_factory=dict)  # engine rows per answering stage
    rejected_retries: int = 0  # online rows sent again after admission turned them away
    shortcut_rows: int = 0  # distinct inputs a query plan answered without the models
    pruned: int = 0  # distinct inputs the top-k plan left after the first stage (ken.sql.topk)
    cache_hits: int = 0  # distinct inputs answered by the result cache (ken.cache)
    cache_misses: int = 0  # distinct inputs looked up in the result cache and not found
    cache_error: str = ""  # why the site stopped using the result cache (it answers anyway)

    @property
    def model_calls(self) -> int:
        return sum(s.input_rows for s in self.stages)


def row_keys(columns: list[list]) -> list:
    """Each row's input as the memo keys it: the value of one column, or the tuple of several
    (None when any of them is NULL: a pair with a NULL side is NULL)."""
    if len(columns) == 1:
        return columns[0]
    return [None if any(v is None for v in k) else k for k in zip(*columns, strict=True)]


class SiteRunner:
    """The Python function DuckDB calls for one call site; keeps the per-query memo."""

    def __init__(self, site: CallSite, bound: Bound, batch_size: int, lock: threading.Lock,
                 memo: dict[Any, Any] | None = None, engine: Engine | None = None,
                 bulk_threshold: int = 64, cache: ResultCache | None = None,
                 namespace: Namespace | None = None) -> None:
        """``cache`` and ``namespace``: where answers persist across queries (``ken.cache``;
        both or neither)."""
        self.site = site
        self.bound = bound
        self.batch_size = batch_size
        self.lock = lock  # models are shared; DuckDB may call from several threads
        # the memo maps input values to outputs; sites of the same bound operator share it
        self.memo: dict[Any, Any] = {} if memo is None else memo
        self.stats = SiteStats(stages=[StageCounter(m) for m in bound.cascade.models])
        self.arrow_type = arrow_type(bound.output_type)
        # with an online engine the site's rows go to it instead of running the cascade here
        self.engine = engine
        self.bulk_threshold = bulk_threshold
        self.error: KenError | None = None  # what failed inside a DuckDB call, if anything
        # the end-to-end deadline the query's online calls carry (``deadlines.within`` around
        # the query; read here, in the querying thread: DuckDB may call from its own threads)
        self.deadline = call_deadline()
        # a query plan that answers some inputs without the models (sem_join's per-side
        # rewrite and blocking, ``ken.sql.join``): ``shortcut.answer(keys) -> {key: value}``
        self.shortcut: Any = None
        self.cache = cache if namespace is not None else None
        self.namespace = namespace

    def __call__(self, *arrays: pa.Array) -> pa.Array:
        with self.lock:
            if isinstance(self.error, ModelCallFailed):
                # DuckDB calls a function of constants again after it raised (once to fold
                # it, then to run it): a model that failed through the engine's retries
                # would be run, and waited for, once more per call
                raise self.error
            started = time.perf_counter()
            keys = row_keys([a.to_pylist() for a in arrays])
            new = self.unanswered(keys)
            if new and self.shortcut is not None:
                try:
                    answered = self.shortcut.answer(new)
                except KenError as exc:
                    self.error = exc
                    raise
                self.memo.update(answered)
                self.stats.shortcut_rows += len(answered)
                new = [k for k in new if k not in answered]
            if new:
                try:
                    self._evaluate(new)
                except KenError as exc:  # DuckDB wraps it; the runner re-raises the original
                    self.error = exc
                    raise
            self.stats.rows_in += len(keys)
            self.stats.null_rows += sum(k is None for k in keys)
            self.stats.chunks += 1
            self.stats.seconds += time.perf_counter() - started
            return pa.array([None if k is None else self.memo[k] for k in keys], self.arrow_type)

    def unanswered(self, keys: list) -> list:
        """The distinct non-NULL inputs among ``keys`` that neither the memo nor the result
        cache has an answer for; the cache's answers join the memo."""
        new = list(dict.fromkeys(k for k in keys if k is not None and k not in self.memo))
        if new and self.cache is not None and self.namespace is not None:
            try:
                hits = self.cache.get_many(self.namespace.id, new)
            except CacheError as exc:
                self._cache_failed(exc)
                return new
            self.memo.update(hits)
            self.stats.cache_hits += len(hits)
            new = [k for k in new if k not in hits]
            self.stats.cache_misses += len(new)
        return new

    def keep(self, answers: dict[Any, Any]) -> None:
        """Put the models' answers (input -> SQL value) in the memo and the result cache; only
        answers of calls that returned reach here."""
        self.memo.update(answers)
        if answers and self.cache is not None and self.namespace is not None:
            try:
                self.cache.put_many(self.namespace.id, self.namespace.operator,
                                    self.namespace.description, answers)
            except CacheError as exc:
                self._cache_failed(exc)

    def _cache_failed(self, exc: CacheError) -> None:
        """A cache that cannot be used (locked by another process past its timeout, a disk
        that is full) costs its answers, not the query: the site goes on without it."""
        self.cache = None
        self.stats.cache_error = str(exc)

    def ensure(self, keys: list) -> None:
        """Answer the inputs ``keys`` not in the memo yet (before the statement runs: a plan's
        samples), counted in the site's statistics like the statement's own."""
        with self.lock:
            new = self.unanswered(keys)
            if new:
                started = time.perf_counter()
                self._evaluate(new)
                self.stats.seconds += time.perf_counter() - started

    def _evaluate(self, inputs: list) -> None:
        if self.engine is not None:
            self._evaluate_online(inputs)
            return
        models = [self.bound.models[m] for m in self.bound.cascade.models]
        calls = [getattr(m, "calls", None) for m in models]  # models that count their calls
        values, _ = self.run_stages(self.bound.cascade, inputs)
        for counter, model, before in zip(self.stats.stages, models, calls, strict=True):
            if isinstance(before, int):
                counter.lm_calls += model.calls - before
        self.keep(dict(zip(inputs, values, strict=True)))
        self.stats.distinct_evaluated += len(inputs)

    def run_stages(self, cascade: Cascade, inputs: list, first_stage: int = 0
                   ) -> tuple[list, CascadeResult]:
        """The SQL values of ``cascade`` on ``inputs`` (distinct, not NULL) and its run, in
        process; ``cascade`` is the site's cascade or a run of its stages from
        ``first_stage`` (the top-k plan, ``ken.sql.topk``), counted in the site's stage
        counters from there. The memo is left as it was; the caller holds ``lock``."""
        if len(self.site.args) == 1:
            column: Any = pa.array(inputs, pa.string())
        else:
            column = [pa.array([k[i] for k in inputs], pa.string())
                      for i in range(len(self.site.args))]
        result = run_cascade(cascade, self.bound.models, column, self.batch_size,
                             name=self.site.call_sql())
        counters = self.stats.stages[first_stage:first_stage + cascade.num_stages]
        for counter, stage in zip(counters, result.stages, strict=True):
            counter.input_rows += stage.input_rows
            counter.resolved_rows += stage.resolved_rows
            counter.num_batches += stage.num_batches
            counter.seconds += stage.seconds
        return self.bound.to_sql_values(result.values), result

    def _evaluate_online(self, inputs: list) -> None:
        """Send the inputs to the engine and wait: fewer than ``bulk_threshold`` as online
        requests, more as bulk rows. Rows that admission turns away are sent again after the
        engine's retry hint (a query under load gets slower, it does not fail), for up to
        ``REJECTED_RETRY_S``; a row that ends in error, or is still turned away then, fails
        the query."""
        assert self.engine is not None
        bulk = len(inputs) >= self.bulk_threshold
        answered: dict[int, Any] = {}  # index in inputs -> ok outcome
        pending = list(range(len(inputs)))
        give_up = time.monotonic() + REJECTED_RETRY_S
        carried = self.deadline
        while pending:
            rows = [inputs[i] for i in pending]
            if carried is not None and isinstance(self.engine, Engine):
                futures = self.engine.submit_many(
                    rows, bulk=bulk, operator=self.site.function,
                    deadline_s=carried.engine_deadline_s(self.engine.clock.now()))
            else:
                futures = self.engine.submit_many(rows, bulk=bulk, operator=self.site.function)
            outcomes = [f.result() for f in futures]
            dropped = [o for o in outcomes if o.status == "dropped"]
            if dropped:
                raise RequestDropped(f"{self.site.call_sql()}: {len(dropped)} of {len(inputs)} "
                                     f"rows were dropped ({dropped[0].error})")
            errors = [o for o in outcomes if o.status == "error"]
            if errors:  # the model's fault: retrying or a looser target would not help
                raise ModelCallFailed(
                    f"{self.site.call_sql()}: the served model failed on {len(errors)} of "
                    f"{len(inputs)} rows ({errors[0].error}); this is the model, not the "
                    "load: fix the model or its loader and serve again")
            failed = [o for o in outcomes if o.status not in ("ok", "rejected")]
            rejected = [o for o in outcomes if o.status == "rejected"]
            if failed:  # cancelled: the engine stopped before they ran
                raise ServingStopped(
                    f"{self.site.call_sql()}: {len(failed)} of {len(inputs)} rows were not "
                    "run: the online engine shut down before they ran (stop_serving, the "
                    f"session's close, or SIGTERM; {failed[0].status}: "
                    f"{failed[0].error or 'the engine stopped'})")
            if rejected and time.monotonic() >= give_up:
                raise EngineBusy(
                    f"{self.site.call_sql()}: {len(rejected)} of {len(inputs)} rows were "
                    f"turned away by the online engine for {REJECTED_RETRY_S:g} s (rejected: "
                    f"{rejected[0].error}); retry later, or serve with a larger "
                    "latency_target_s or a lower bulk_threshold (bulk rows are not turned "
                    "away)")
            answered.update((i, o) for i, o in zip(pending, outcomes, strict=True)
                            if o.status == "ok")
            pending = [i for i, o in zip(pending, outcomes, strict=True)
                       if o.status == "rejected"]
            self.stats.rejected_retries += len(pending)
            if pending:
                time.sleep(min(max(o.retry_after_s or 0.01 for o in rejected), 1.0))
        outcomes = [answered[i] for i in range(len(inputs))]
        values = self.bound.to_sql_values([o.value for o in outcomes])
        self.keep(dict(zip(inputs, values, strict=True)))
        self.stats.distinct_evaluated += len(inputs)
        for o in outcomes:  # the gear plan's cascades may use other models than the site's
            key = f"{o.model} (stage {o.stage + 1})"
            self.stats.resolved_by[key] = self.stats.resolved_by.get(key, 0) + 1
        self.stats.online_rows += 0 if bulk else len(inputs)
        self.stats.bulk_rows += len(inputs) if bulk else 0


@contextmanager
def registered(con: duckdb.DuckDBPyConnection, runners: list[SiteRunner]) -> Iterator[None]:
    """The site functions of ``runners`` defined on ``con`` while the block runs."""
    for r in runners:
        # DuckDB reads the arity from the callable's signature, so give it an exact one
        fn = _exact_arity(r, len(r.site.args))
        con.create_function(r.site.udf_name, fn, [VARCHAR] * len(r.site.args),
                            duckdb_type(r.bound.output_type), type="arrow",
                            null_handling="special", side_effects=False)
    try:
        yield
    finally:
        for r in runners:
            try:
                con.remove_function(r.site.udf_name)
            except duckdb.Error:
                pass


def _exact_arity(runner: SiteRunner, arity: int) -> Callable[..., pa.Array]:
    if arity == 1:
        return lambda a: runner(a)
    if arity == 2:
        return lambda a, b: runner(a, b)
    raise KenError(f"semantic functions take 1 or 2 text columns, not {arity}")


def query_error(error: Exception, runners: list[SiteRunner]) -> KenError:
    """The error to show for a failed query: what a call site raised, else DuckDB's error in
    the user's terms."""
    for r in runners:
        if r.error is not None:
            return r.error
    return translate_error(error, [r.site for r in runners])


def translate_error(error: Exception, sites: list[CallSite]) -> KenError:
    """A DuckDB error about a rewritten query, in the user's terms."""
    message = str(error)
    for site in sites:
        if site.udf_name in message and "No function matches" in message:
            got = re.search(re.escape(site.udf_name) + r"\(([^)]*)\)", message)
            types = got.group(1) if got else "non-text"
            return KenError(
                f"{site.function}() needs text arguments, but {site.call_sql()} passes "
                f"{types}; cast the argument, e.g. {site.function}(CAST({site.args[0]} AS "
                "VARCHAR))"
            )
    for site in sites:
        message = message.replace(site.udf_name, site.function)
    return KenError(message)
