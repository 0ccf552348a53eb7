"""One statement from text to its result, or to its EXPLAIN, in one pass.

The session holds the state (the database, the operators and their bound forms, the plans and
the serving manager); a ``QueryRunner`` takes each statement through the front end
(``rewrite``), binds its call sites once, and runs them: a ``TRAIN`` statement trains
(``ken.sql.train``), ``EXPLAIN [ANALYZE]`` renders the bound plan (``ken.sql.explain``), a query
without semantic calls is DuckDB's text unchanged, and a semantic one runs its sites as DuckDB
functions (``ken.sql.execute``) or its semantic step on Ray Data (``ken.sql.ray_query``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import duckdb
import pyarrow as pa

from ken.cache import ResultCache
from ken.engine.manager import ServingManager
from ken.errors import KenError, ShuttingDown
from ken.models.model import DeviceConfig
from ken.ops.base import Bound, OpContext, Operator, suggest
from ken.ops.llm_operator import LLMOperator
from ken.ops.sem_join import SemJoin
from ken.ops.training import Trained, TrainingData
from ken.sql.cache_key import namespace
from ken.sql.cost import check_limits, estimate
from ken.sql.database import Database
from ken.sql.execute import SiteRunner, query_error, registered
from ken.sql.explain import actual_lines, build, plan_lines, render, site_lines
from ken.sql.guarantee import SETTING as _SET_TARGET
from ken.sql.guarantee import TargetRun, Targets, apply_targets, finished
from ken.sql.guarantee import plan_lines as target_lines
from ken.sql.join import JoinPlanner, JoinRun, distinct_values, explain_lines, join_sides
from ken.sql.limit import EarlyLimit, LimitRun, early_limit, run_early_limit
from ken.sql.ray_query import ray_choice, run_on_ray
from ken.sql.result import Result
from ken.sql.rewrite import Rewritten, SqlError, parse, rewrite, split_statements
from ken.sql.topk import TopK, TopkRun, cascade_reason, run_topk, topk_shape
from ken.sql.train import is_train, parse_train, training_table

_EXPLAIN = re.compile(r"^\s*EXPLAIN(\s+ANALYZE)?\s+", re.IGNORECASE)
#: ``SET sem_qa_llms = 'smollm2-135m, my-lm'`` / ``RESET sem_qa_llms``: an LLM operator's LMs
_SET_LLMS = re.compile(r"^\s*(SET|RESET)\s+(?:SESSION\s+)?(\w+?)_llms\s*"
                       r"(?:(?:=|TO)\s*'((?:[^']|'')*)')?\s*$", re.IGNORECASE)
#: ``SET sem_join_plan = 'blocking'`` / ``RESET sem_join_plan``: sem_join's plan settings
_SET_JOIN = re.compile(r"^\s*(SET|RESET)\s+(?:SESSION\s+)?sem_join_(\w+)\s*"
                       r"(?:(?:=|TO)\s*(?:'((?:[^']|'')*)'|([\w.]+)))?\s*$", re.IGNORECASE)
#: ``SET ken_topk = off`` / ``on`` / ``RESET ken_topk``: the top-k plan (``ken.sql.topk``);
#: ``SET ken_cache = off``: the result cache (``ken.cache``)
_SET_SWITCH = re.compile(r"^\s*(SET|RESET)\s+(?:SESSION\s+)?ken_(topk|cache)\s*"
                         r"(?:(?:=|TO)\s*'?(\w+)'?)?\s*$", re.IGNORECASE)
#: what each switch does when off (for the error on a bad value)
_SWITCH_OFF = {"topk": "runs ORDER BY <score> LIMIT k on every row",
               "cache": "answers every query with the models, neither reading nor writing "
                        "the result cache"}
#: ``SET ken_max_model_calls = 5000`` / ``ken_max_model_seconds = 60`` / ``RESET ...``: the
#: session's limits on what one query may cost (``ken.sql.cost``)
_SET_LIMIT = re.compile(r"^\s*(SET|RESET)\s+(?:SESSION\s+)?ken_max_model_(calls|seconds)\s*"
                        r"(?:(?:=|TO)\s*'?([^'\s]*)'?)?\s*$", re.IGNORECASE)
ENGINES = ("auto", "duckdb", "ray")


class QueryHost(Protocol):
    """What a statement needs of the session it runs in (``ken.session.Session``)."""

    db: Database
    operators: Mapping[str, Operator]
    ctx: OpContext
    serving: ServingManager
    ray_actors: int  # actors of engine="ray", each of ctx.device.threads CPUs
    ray_stall_s: float | None  # engine="ray" fails after this long without progress (None:
    #                            from the cascades' profiles, ken.engine.ray_data)
    ray_min_rows: int | None  # engine="auto" goes to Ray Data from this many rows (None: never)
    topk: bool  # ORDER BY <score> LIMIT k by the top-k plan (ken.sql.topk)
    topk_sample: int  # escalated rows that measure the top-k plan's margin
    cache_enabled: bool  # SET ken_cache = off turns the result cache off
    max_model_calls: int | None  # a query estimated to make more is refused (ken.sql.cost)
    max_model_seconds: float | None  # ... or to take more model time
    targets: Targets  # accuracy / precision / recall targets with a guarantee

    @property
    def cache(self) -> ResultCache | None:
        """The result cache answers persist in (``ken.cache``); None when off."""

    def bind(self, function: str, constants: tuple[str, ...]) -> Bound: ...

    def forget(self, function: str) -> None:
        """Drop what was derived from ``function``'s operator (after it trained)."""


def statement_runner(con: Any, params: Any, runners: Sequence[SiteRunner]
                     ) -> Callable[..., pa.Table]:
    """``sql(text, with_params=True)``: one statement on ``con`` (with the query's ``params``,
    or without), as an Arrow table; a DuckDB error becomes the error a call site raised, or
    DuckDB's in the user's terms."""
    def sql(text: str, with_params: bool = True) -> pa.Table:
        try:
            relation = con.sql(text, params=params if with_params else None)
            return relation.to_arrow_table() if relation is not None else pa.table({})
        except duckdb.Error as error:
            raise query_error(error, list(runners)) from None

    return sql


def finished_joins(joins: list[JoinRun], runners: Sequence[SiteRunner]) -> list[JoinRun]:
    """The join plans' records with what their sites did once the statement ran."""
    by_label = {r.site.label: r for r in runners}
    for run in joins:
        stats = by_label[run.site].stats
        run.pair_questions = stats.model_calls or stats.distinct_evaluated
        run.shortcut_pairs = stats.shortcut_rows
    return joins


class QueryRunner:
    """Runs the statements of one session (see the module docstring)."""

    def __init__(self, host: QueryHost) -> None:
        self.host = host
        self._models_lock = threading.Lock()  # in-process models are not thread-safe
        self._pool: ThreadPoolExecutor | None = None

    def _result(self, table: pa.Table | None = None, relation: Any = None,
                stats: dict | None = None) -> Result:
        return Result(self.host.db.connection, table, relation, stats,
                      reading=self.host.db.reading)

    def sql(self, query: str, params: Any = None, engine: str = "auto") -> Result:
        """One statement's result (``Session.sql``); ``ShuttingDown`` once the session is
        shutting down (``Database.statement``)."""
        with self.host.db.statement():
            return self._statement(query, params, engine)

    def _statement(self, query: str, params: Any, engine: str) -> Result:
        if engine not in ENGINES:
            raise KenError(f"engine must be 'auto', 'duckdb' or 'ray' (got {engine!r})")
        statements = split_statements(query)
        if len(statements) > 1:
            raise SqlError(
                f"session.sql runs one statement per call; this text holds {len(statements)} "
                f"(the second: {statements[1][:80]!r}), and none of them ran. Pass values as "
                "parameters (params=[...] with ? placeholders), or run a script of several "
                "statements with session.sql_script(...) or `ken sql`")
        if not statements:
            raise SqlError("empty query: no SQL statement to run")
        query = statements[0]
        setting = _SET_LLMS.match(query)
        if setting:
            return self._set_llms(*setting.groups())
        setting = _SET_JOIN.match(query)
        if setting and isinstance(self.host.operators.get("sem_join"), SemJoin):
            return self._set_join(*setting.groups())
        setting = _SET_SWITCH.match(query)
        if setting:
            return self._set_switch(*setting.groups())
        setting = _SET_LIMIT.match(query)
        if setting:
            return self._set_limit(*setting.groups())
        setting = _SET_TARGET.match(query)
        if setting:
            return self._result(self.host.targets.statement(*setting.groups()))
        if is_train(query):
            return self._train_statement(query)
        match = _EXPLAIN.match(query)
        if match:
            text = self.explain(query[match.end():], analyze=bool(match.group(1)), params=params)
            return self._result(pa.table({"explain": text.splitlines()}))
        rewritten = self._rewrite(query)
        if not any(rw.is_semantic for rw in rewritten):
            return self._run_unchanged(query, params)
        rw = rewritten[0]
        self._check_cost(rw)
        if self.host.targets.applies(rw):  # the target's sample needs every input listed
            if engine == "ray":
                raise KenError("a query with an accuracy/precision/recall target runs on "
                               "DuckDB (engine='duckdb' or 'auto'), not on Ray")
            return self._run(rw, params)
        limit = early_limit(rw)[0] if engine != "ray" else None
        if limit is not None:
            return self._run(rw, params, limit)  # it stops early, so it evaluates few rows
        topk = self._topk(rw)[0] if engine != "ray" else None
        if topk is not None:
            return self._run(rw, params, topk)  # few rows reach the expensive stages
        if engine != "auto":
            return self._run_on_ray(rw, params) if engine == "ray" else self._run(rw, params)
        on_ray, why = ray_choice(rw, self.host.ray_min_rows)
        run = self._run_on_ray if on_ray else self._run
        if not why:
            return run(rw, params)
        with self.host.ctx.reporter.long_work(f"engine='auto': {why}"):  # a big dataset
            return run(rw, params)

    def script(self, script: str) -> Result:
        """The statements of ``script`` run in order; the last one's result
        (``Session.sql_script``)."""
        statements = split_statements(script)
        if not statements:
            raise SqlError("empty script: no SQL statement to run")
        result = None
        for number, statement in enumerate(statements, 1):
            try:
                result = self.sql(statement)
            except KenError as error:
                if len(statements) == 1:
                    raise
                raise type(error)(f"statement {number} of {len(statements)} failed "
                                  f"({statement[:60]!r}; the {number - 1} before it ran): "
                                  f"{error}") from None
        assert result is not None
        return result

    async def asql(self, query: str, params: Any = None) -> Result:
        """``sql`` on a worker thread of the runner (``Session.asql``)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(32, thread_name_prefix="ken-query")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.sql, query, params)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _set_llms(self, verb: str, function: str, value: str | None) -> Result:
        """``SET <function>_llms = 'a, b'``: the LMs of an LLM operator, smallest first, as
        ``session.operators[function].llms = ("a", "b")``; ``RESET`` restores the default."""
        function = function.lower()
        op = self.host.operators.get(function)
        if not isinstance(op, LLMOperator):
            llm_ops = sorted(n for n, o in self.host.operators.items()
                             if isinstance(o, LLMOperator))
            raise SqlError(f"{function}_llms is not a setting: the LLM operators are "
                           f"{', '.join(llm_ops)} (SET sem_qa_llms = 'smollm2-135m, ...')")
        if verb.upper() == "RESET":
            op.__dict__.pop("llms", None)  # the class default
        else:
            if value is None:
                raise SqlError(f"SET {function}_llms needs a value: SET {function}_llms = "
                               "'smollm2-135m, qwen2.5-coder-0.5b' (smallest first)")
            names = tuple(n.strip() for n in value.replace("''", "'").split(",") if n.strip())
            op.check_llms(self.host.ctx, names)  # a bad list changes nothing
            op.llms = names
        return self._result(pa.table({"setting": [f"{function}_llms"],
                                      "value": [", ".join(op.llms)]}))

    def _set_join(self, verb: str, name: str, quoted: str | None, bare: str | None) -> Result:
        """``SET sem_join_<setting> = value`` / ``RESET sem_join_<setting>``."""
        value = quoted.replace("''", "'") if quoted is not None else bare
        if verb.upper() == "SET" and value is None:
            raise SqlError(f"SET sem_join_{name} needs a value, e.g. SET sem_join_plan = "
                           "'blocking'")
        op = self.host.operators["sem_join"]
        try:
            now = op.set_option(name.lower(), value if verb.upper() == "SET" else None)
        except KenError as exc:
            raise SqlError(str(exc)) from None
        return self._result(pa.table({"setting": [f"sem_join_{name.lower()}"],
                                      "value": [str(now)]}))

    def _set_switch(self, verb: str, name: str, value: str | None) -> Result:
        """``SET ken_topk = off``: ``ORDER BY <score> LIMIT k`` scores every row with the
        whole cascade (the naive plan); ``SET ken_cache = off``: no result cache. ``on`` or
        ``RESET`` turns either back on."""
        name = name.lower()
        attribute = {"topk": "topk", "cache": "cache_enabled"}[name]
        if verb.upper() == "RESET":
            on = True
        else:
            word = (value or "").lower()
            if word not in ("on", "off", "true", "false"):
                raise SqlError(f"SET ken_{name} takes on or off (got {value!r}): SET "
                               f"ken_{name} = off {_SWITCH_OFF[name]}")
            on = word in ("on", "true")
        setattr(self.host, attribute, on)
        return self._result(pa.table({"setting": [f"ken_{name}"],
                                      "value": ["on" if on else "off"]}))

    def _set_limit(self, verb: str, kind: str, value: str | None) -> Result:
        """``SET ken_max_model_calls = N`` / ``ken_max_model_seconds = S``: refuse a query
        estimated to cost more; ``RESET`` (or ``SET ... = none``) removes the limit."""
        kind = kind.lower()
        attribute = f"max_model_{kind}"
        limit: float | None = None
        text = (value or "").strip().lower()
        if verb.upper() == "SET" and text not in ("none", "off"):
            try:
                limit = int(text) if kind == "calls" else float(text)
            except ValueError:
                limit = None
            if limit is None or not limit > 0:
                raise SqlError(f"SET ken_max_model_{kind} takes a number above 0 (or none), not "
                               f"{value!r}: a query estimated to need more model "
                               f"{kind} is refused before it runs")
        setattr(self.host, attribute, limit)
        return self._result(pa.table({"setting": [f"ken_max_model_{kind}"],
                                      "value": ["none" if limit is None else f"{limit:g}"]}))

    # -- the front end and the bound sites -----------------------------------------------------

    def _rewrite(self, query: str) -> list[Rewritten]:
        out: list[Rewritten] = []
        next_site = 0  # site ids restart per query so that EXPLAIN output is deterministic
        namespace = self.host.db.namespace()
        for statement in parse(query):
            rw = rewrite(statement, self.host.operators, self.host.db.functions(), next_site,
                         namespace)
            next_site += len(rw.sites)
            out.append(rw)
        return out

    def _site_runners(self, rw: Rewritten) -> list[SiteRunner]:
        """One runner per site, of its bound operator and the online engine serving it (if
        any); sites of one bound operator (e.g. ``f(t.x)`` and ``f(x)``) share a memo, so an
        input value is evaluated once per query."""
        host = self.host
        memos: dict[tuple, dict] = {}
        query_lock = threading.Lock()  # engines are thread-safe; in-process models are not
        out = []
        for site in rw.sites:
            engine = host.serving.engine_for(site.function, site.constants)
            if engine is None and host.db.refusing is not None:
                # the servers have stopped: a model is not started in-process as the
                # process exits
                raise ShuttingDown(f"{site.call_sql()} was not run: the session is shutting "
                                   f"down ({host.db.refusing})")
            bound = host.bind(site.function, site.constants)
            space = None
            # a targeted site's answers depend on its sample (ken.sql.guarantee): not cached
            if host.cache is not None and host.targets.for_function(site.function) is None:
                plan = host.serving.plans.get(site.function) if engine is not None else None
                space = namespace(site.function, site.constants, bound,
                                  plan.to_json() if plan is not None else None)
            out.append(SiteRunner(site, bound, host.ctx.batch_size,
                                  query_lock if engine else self._models_lock,
                                  memos.setdefault((site.function, site.constants), {}),
                                  engine=engine, bulk_threshold=host.serving.bulk_threshold,
                                  cache=host.cache, namespace=space))
        return out

    def _topk(self, rw: Rewritten) -> tuple[TopK | None, str]:
        """The top-k plan of ``rw``, or None and why not ("" where the question does not
        arise: no ORDER BY with a LIMIT)."""
        plan, why = topk_shape(rw)
        if plan is None:
            return None, why
        site = next(s for s in rw.sites if s.id == plan.site_id)
        served = self.host.serving.engine_for(site.function, site.constants) is not None
        why = cascade_reason(site, self.host.bind(site.function, site.constants), served)
        if not why and not self.host.topk:
            why = "the top-k plan is off (SET ken_topk = on)"
        if why:
            return None, why
        return dataclasses.replace(plan, sample_rows=self.host.topk_sample), ""

    # -- running -----------------------------------------------------------------------------

    def _run_unchanged(self, query: str, params: Any) -> Result:
        """A statement without semantic calls: DuckDB runs the user's text unchanged."""
        con = self.host.db.connection()
        try:
            relation = con.sql(query, params=params)
            if con is not self.host.db.con and relation is not None:  # a cursor of this thread
                return self._result(relation.to_arrow_table())
        except duckdb.Error as error:
            raise KenError(str(error)) from None
        return self._result(relation=relation)

    def _run(self, rw: Rewritten, params: Any, plan: EarlyLimit | TopK | None = None
             ) -> Result:
        """``rw`` on DuckDB; in slices by ``plan`` when its LIMIT stops early, or by the top-k
        plan."""
        runners = self._site_runners(rw)
        con = self.host.db.connection()
        with registered(con, runners):
            targets = self._targets(con, rw, runners)
            joins = self._plan_joins(con, rw, runners)
            table, run = self._execute(con, rw, params, runners, plan)
        stats: dict[str, Any] = {r.site.label: r.stats for r in runners}
        if targets:
            stats["targets"] = finished(targets, runners)
        if isinstance(run, LimitRun):
            stats["limit"] = run
        elif isinstance(run, TopkRun):
            stats["topk"] = run
        if joins:
            stats["join"] = finished_joins(joins, runners)
        return self._result(table, stats=stats)

    def _targets(self, con: Any, rw: Rewritten, runners: Sequence[SiteRunner]
                 ) -> list[TargetRun]:
        """Choose the targeted sites' thresholds on their samples (``ken.sql.guarantee``)."""
        return apply_targets(con, rw, runners, self.host.targets, self.host.operators,
                             self.host.ctx)

    def _join_sides(self, con: Any, rw: Rewritten, runners: Sequence[SiteRunner]
                    ) -> list[tuple[SiteRunner, Any, str]]:
        """Each sem_join site's runner with its sides (``ken.sql.join``), or None and why it
        runs as written."""
        def columns_of(source: str) -> set[str]:
            return {c.lower() for c in con.sql(f"SELECT * FROM {source} LIMIT 0").columns}

        return [(r, *join_sides(rw, r.site, columns_of)) for r in runners
                if isinstance(self.host.operators.get(r.site.function), SemJoin)]

    def _plan_joins(self, con: Any, rw: Rewritten, runners: Sequence[SiteRunner]
                    ) -> list[JoinRun]:
        """Choose and prepare each sem_join site's plan before the statement runs."""
        statement = statement_runner(con, None, runners)

        def sql(text: str) -> pa.Table:
            return statement(text, False)

        out = []
        for runner, sides, _ in self._join_sides(con, rw, runners):
            if sides is not None:
                op = self.host.operators[runner.site.function]
                out.append(JoinPlanner(op, self.host.ctx, runner, sides,
                                       distinct_values(sql, sides.left_sql),
                                       distinct_values(sql, sides.right_sql)).plan())
        return out

    def _execute(self, con: Any, rw: Rewritten, params: Any, runners: Sequence[SiteRunner],
                 plan: EarlyLimit | TopK | None = None, prefix: str = ""
                 ) -> tuple[pa.Table, LimitRun | TopkRun | None]:
        """``rw`` on ``con`` (its sites registered): the statement as DuckDB runs it with
        ``prefix`` before it (``EXPLAIN ANALYZE ``), or in slices by an early LIMIT
        (``ken.sql.limit``), or by the top-k plan (``ken.sql.topk``)."""
        sql = statement_runner(con, params, runners)
        if plan is None:
            return sql(prefix + rw.sql), None
        table = f"__ken_{self.host.db.namespace()}"
        if isinstance(plan, TopK):
            runner = next(r for r in runners if r.site.id == plan.site_id)
            return run_topk(lambda text: sql(text, False), rw, plan, runner, table + "topk")
        return run_early_limit(sql, rw, plan, table + "limit")

    def _run_on_ray(self, rw: Rewritten, params: Any) -> Result:
        host = self.host
        threads = host.ctx.device.threads

        def duckdb_sql(text: str) -> pa.Table:
            try:
                relation = host.db.connection().sql(text, params=params)
            except duckdb.Error as error:
                raise KenError(str(error)) from None
            return relation.to_arrow_table() if relation is not None else pa.table({})

        cpu = DeviceConfig(threads=threads)
        table = run_on_ray(rw, host.bind, lambda f: host.operators[f].loaders(host.ctx, cpu),
                           duckdb_sql, actors=host.ray_actors, threads=threads,
                           stall_s=host.ray_stall_s)
        return self._result(table)

    def _check_cost(self, rw: Rewritten) -> None:
        """Refuse ``rw`` before it runs when its estimate exceeds the session's limits
        (``ken.sql.cost``)."""
        host = self.host
        if host.max_model_calls is None and host.max_model_seconds is None:
            return
        runners = self._site_runners(rw)
        con = host.db.connection()
        with registered(con, runners):
            estimates = [estimate(con, rw, r.site, r.bound, r.cache, r.namespace)
                         for r in runners]
        check_limits(estimates, host.max_model_calls, host.max_model_seconds)

    # -- EXPLAIN -----------------------------------------------------------------------------

    def explain(self, query: str, analyze: bool = False, params: Any = None) -> str:
        """The plan of ``query`` (``Session.explain``): its bound sites rendered, with
        estimates; with ``analyze`` it runs them too and adds what they did."""
        with self.host.db.statement():
            return self._explain(query, analyze, params)

    def _explain(self, query: str, analyze: bool, params: Any) -> str:
        statements = self._rewrite(query)
        if len(statements) != 1:
            raise SqlError("EXPLAIN takes exactly one statement")
        rw = statements[0]
        lines = render(build(rw.statement))
        runners = self._site_runners(rw)
        describe = {r.site.id: r.bound.describe() for r in runners}
        con = self.host.db.connection()
        with registered(con, runners):  # nested calls may remain inside FROM subqueries
            estimates = {r.site.id: estimate(con, rw, r.site, r.bound, r.cache,
                                             r.namespace).text() for r in runners}
            plans = {s.id: plan_lines(self.host.serving, s.function, s.constants)
                     + target_lines(con, rw, s, self.host.targets, r.engine)
                     for s, r in zip(rw.sites, runners, strict=True)}
        targeted = self.host.targets.applies(rw)
        limit, why_not = early_limit(rw) if not targeted else (None, "")
        limit_lines = ([limit.describe()] if limit is not None else
                       [f"LIMIT does not stop early: {why_not}"] if why_not else [])
        join_lines = self._explain_joins(con, rw, runners)
        topk, why_not = self._topk(rw) if not targeted else (None, "")
        if topk is not None:
            site = next(r for r in runners if r.site.id == topk.site_id)
            limit_lines.append(topk.describe(site.bound.cascade.models))
        elif why_not:
            limit_lines.append(f"top-k plan does not apply: {why_not}")
        plan: EarlyLimit | TopK | None = limit if limit is not None else topk
        if not analyze:
            return "\n".join(lines + site_lines(rw.sites, describe, estimates, plans=plans)
                             + limit_lines + join_lines)
        started = time.perf_counter()
        runners = self._site_runners(rw)  # fresh memos and counts: the estimates ran some
        with registered(con, runners):
            targets = self._targets(con, rw, runners)
            joins = self._plan_joins(con, rw, runners)
            if plan is not None:
                _, run = self._execute(con, rw, params, runners, plan)
                assert run is not None
                limit_lines = [run.line()]
                physical = ("(not shown: the statement ran on "
                            + (f"{run.chunks} slice(s) of its source, each a DuckDB query of "
                               "its own)" if isinstance(run, LimitRun) else
                               "the rows the top-k plan chose, a DuckDB query of its "
                               "own)"))
            else:
                table, _ = self._execute(con, rw, params, runners, prefix="EXPLAIN ANALYZE ")
                physical = table.column(1)[0].as_py() if table.num_rows else ""
        seconds = time.perf_counter() - started
        limit_lines += [run.line() for run in finished_joins(joins, runners)]
        limit_lines += [run.line() for run in finished(targets, runners)]
        describe = {r.site.id: r.bound.describe() for r in runners}  # a target's cascade
        actual = {r.site.id: actual_lines(r) for r in runners}
        out = lines + site_lines(rw.sites, describe, estimates, actual, plans) + limit_lines
        out += ["", f"Total time: {seconds:.3f} s", "",
                "DuckDB physical plan (actual rows and time per operator):", physical]
        return "\n".join(out)

    def _explain_joins(self, con: Any, rw: Rewritten, runners: Sequence[SiteRunner]
                       ) -> list[str]:
        """EXPLAIN's lines for the sem_join sites: the plans with the questions each asks."""
        out = []
        for runner, sides, why in self._join_sides(con, rw, runners):
            if sides is None:
                out.append(f"sem_join {runner.site.label}: runs on every pair DuckDB hands it "
                           f"({why})")
                continue
            n, m = (int(con.sql(f"SELECT count(v) FROM ({q})").fetchall()[0][0])
                    for q in (sides.left_sql, sides.right_sql))
            out += explain_lines(self.host.operators[runner.site.function], sides, n, m)
        return out

    # -- TRAIN -------------------------------------------------------------------------------

    def train(self, function: str, table: str | Path | pa.Table | Any, label: str,
              columns: Sequence[str] | None = None, **options: Any) -> Trained:
        """Train ``function`` on labelled rows (``Session.train``)."""
        with self.host.db.statement():
            return self._train(function, table, label, columns, **options)

    def _train(self, function: str, table: str | Path | pa.Table | Any, label: str,
               columns: Sequence[str] | None, **options: Any) -> Trained:
        name = function.lower()
        if name not in self.host.operators:
            raise KenError(f"no semantic function {function}() to train."
                           f"{suggest(name, self.host.operators)}")
        arrow, source = training_table(self.host.db.connection(), table)
        data = TrainingData.from_arrow(arrow, label, columns, source)
        trained = self.host.operators[name].train(self.host.ctx, data, **options)
        self.host.forget(name)
        return trained

    def _train_statement(self, query: str) -> Result:
        statement, _ = parse_train(query)
        options = {"predicate": statement.predicate} if statement.predicate else {}
        source = Path(statement.source) if statement.is_file else statement.source
        trained = self.train(statement.function, source, statement.label, statement.columns,
                             **options)
        return self._result(pa.table({
            "function": [trained.function], "trained_on": [trained.data],
            "quality": [trained.quality], "cache": [trained.where]}))
