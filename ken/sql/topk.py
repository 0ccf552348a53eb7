"""``ORDER BY <score> [ASC|DESC] LIMIT k [OFFSET m]`` that sends few rows to a cascade's
expensive stages (issue 35, item 4).

A query of the shape

    SELECT <anything> FROM <one table, view, file or subquery> [WHERE ...]
    ORDER BY <one semantic call, or a SELECT alias of one> [ASC|DESC] LIMIT k [OFFSET m]

(the other conditions of ``ken.sql.shape``; no parameters, no NULLS FIRST, the ORDER BY's call
not also in WHERE, no SELECT alias in WHERE) whose call is a DOUBLE-valued operator with an
in-process cascade of two or more stages runs as follows (``k + m`` rows are *wanted*):

1. The source's rows that pass the relational conjuncts of WHERE are numbered once (a
   temporary table), the other conjuncts run on them, and the cascade's first stage (the
   *cheap* stage) scores every distinct input. A row it is sure of (certainty at or above its
   threshold) has its final value: the cascade's answer is the cheap value.
2. The other rows *escalate*. A sample of ``SAMPLE_ROWS`` (19; ``session.topk_sample``) of
   them (fixed seed) goes through
   the rest of the cascade (the *expensive* stages); the largest ``|expensive - cheap|`` among
   them is the *margin*.
3. The remaining escalated rows go through the expensive stages in batches, most promising
   first (highest cheap score + margin for DESC, lowest cheap score - margin for ASC), while
   one could still reach the ``k + m``-th best value known so far (cheap + margin >= it for
   DESC, mirrored for ASC); the rest are *pruned*, never evaluated further.
4. The statement runs on the ``k + m`` best rows, their values already in the site's memo, so
   DuckDB does the ordering, the OFFSET and the select list. Ties are broken by the source's
   row order (the row first in the source wins), also inside the result.

What the margin guarantees, and what it does not: a pruned row is out of the top k whenever its
expensive value is within the margin of its cheap value. Nothing bounds that a priori. If the
sampled rows and a pruned row are exchangeable (the sample is uniform among the escalated rows,
so this holds for a row drawn at random from them), the pruned row's ``|expensive - cheap|``
exceeds the largest of ``n`` sampled ones with probability at most ``1 / (n + 1)``; so of ``P``
pruned rows at most ``P / (n + 1)`` are expected to exceed it. It is no bound on every row at
once, nor on a row picked by its content, and a row that exceeds the margin may enter the
true top k (the test ``test_a_delta_beyond_the_margin_is_reported`` shows one). ``EXPLAIN
ANALYZE`` and ``Result.stats["topk"]`` report the rows each stage scored, the rows pruned, the
margin and the sample size. ``SET ken_topk = off`` (``session.topk = False``) runs such a query
the naive way: every row through the whole cascade.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from sqlglot import exp

from ken.errors import KenError
from ken.models.cascade import Cascade
from ken.ops.base import Bound, sql_type
from ken.sql.execute import SiteRunner, row_keys
from ken.sql.rewrite import CallSite, Rewritten
from ken.sql.shape import (
    ROW_NUMBER,
    OneSource,
    limit_offset,
    names_alias,
    numbering_sql,
    on_rows,
    one_source,
    site_calls,
)

#: escalated rows whose expensive values measure the margin by default (1 / (n + 1) = 5%;
#: ``session.topk_sample`` sets another)
SAMPLE_ROWS = 19
#: the seed of the sample, so that a query repeats exactly
SEED = 0


@dataclass(frozen=True)
class TopK:
    """The top-k plan of a query: the ``limit`` rows after ``offset`` by the value of call site
    ``site_id`` (``key_sql`` as the user wrote it), largest first when ``descending``, of the
    statement's one source (``shape``)."""

    limit: int
    offset: int
    descending: bool
    site_id: int
    key_sql: str
    shape: OneSource
    sample_rows: int = SAMPLE_ROWS  # escalated rows that measure the margin

    def __post_init__(self) -> None:
        if isinstance(self.sample_rows, bool) or not isinstance(self.sample_rows, int) \
                or self.sample_rows < 1:
            raise KenError(f"the top-k plan's sample (session.topk_sample) must be a whole "
                           f"number of rows, at least 1; got {self.sample_rows!r}")

    @property
    def wanted(self) -> int:
        return self.limit + self.offset

    def describe(self, stages: Sequence[str]) -> str:
        order = "DESC" if self.descending else "ASC"
        near = "+" if self.descending else "-"
        skip = f" OFFSET {self.offset:,}" if self.offset else ""
        return (f"top-k: ORDER BY {self.key_sql} {order} LIMIT {self.limit:,}{skip}: "
                f"{stages[0]} scores every row; {' -> '.join(stages[1:])} only a sample of "
                f"{self.sample_rows} escalated rows (the margin: their largest |expensive - "
                f"cheap|) and the escalated rows whose cheap score {near} margin can still "
                f"enter the best {self.wanted:,}")


@dataclass(frozen=True)
class TopkRun:
    """What a top-k plan did (for EXPLAIN ANALYZE, the benchmark and the tests); rows are
    distinct inputs of the call, except ``source_rows``."""

    limit: int
    offset: int
    descending: bool
    source_rows: int  # rows of the source that pass the WHERE clause
    distinct_inputs: int  # distinct non-NULL inputs among them
    cheap_model: str
    cheap_rows: int  # inputs the cheap stage scored
    escalated: int  # of them, those it was not sure of
    sampled: int  # escalated inputs drawn to measure the margin
    expensive_rows: int  # escalated inputs sent to the expensive stages (the sample included)
    pruned: int  # escalated inputs never sent on
    margin: float | None  # largest |expensive - cheap| of the sample (None: no sample)
    batches: int  # batches of step 3
    returned: int

    @property
    def expensive_share(self) -> float:
        """Share of the distinct inputs the expensive stages scored."""
        return self.expensive_rows / self.distinct_inputs if self.distinct_inputs else 0.0

    @property
    def expected_misses(self) -> float:
        """The bound on the expected number of pruned rows whose expensive value is further
        than the margin from their cheap one, ``pruned / (sampled + 1)`` (exchangeability)."""
        return self.pruned / (self.sampled + 1) if self.sampled else 0.0

    def line(self) -> str:
        order = "DESC" if self.descending else "ASC"
        skip = f" OFFSET {self.offset:,}" if self.offset else ""
        margin = "none (no row escalated)" if self.margin is None else (
            f"{self.margin:.4g}, the largest |expensive - cheap| of {self.sampled} sampled "
            f"escalated row(s); each pruned row exceeds it with probability <= "
            f"1/{self.sampled + 1} if exchangeable with the sample, so about "
            f"{self.expected_misses:.1f} of the pruned rows may (each might belong in the "
            "result)")
        return (f"top-k {order} LIMIT {self.limit:,}{skip}: {self.source_rows:,} rows, "
                f"{self.distinct_inputs:,} distinct inputs; {self.cheap_model} scored "
                f"{self.cheap_rows:,}, escalated {self.escalated:,}; the expensive stage(s) "
                f"scored {self.expensive_rows:,} ({self.expensive_share:.1%} of the inputs) in "
                f"{self.batches} batch(es) after the sample; {self.pruned:,} pruned; margin "
                f"{margin}; {self.returned:,} rows returned")


def _order_call(s: exp.Select, key: exp.Expression, rw: Rewritten) -> exp.Anonymous | None:
    """The site call the ORDER BY key is, directly or through a SELECT alias."""
    if isinstance(key, exp.Column) and not key.table:
        for sel in s.expressions:
            if isinstance(sel, exp.Alias) and sel.alias == key.name:
                key = sel.this
                break
    calls = site_calls(key, rw)
    return calls[0] if len(calls) == 1 and calls[0] is key else None


def topk_shape(rw: Rewritten) -> tuple[TopK | None, str]:
    """The top-k plan of ``rw`` as far as its text decides, or None and why not (an empty
    reason when the statement has no ORDER BY with a LIMIT, where the question does not
    arise). :func:`cascade_reason` decides the rest, from the bound call."""
    s = rw.statement
    if not isinstance(s, exp.Select) or s.args.get("limit") is None \
            or s.args.get("order") is None:
        return None, ""
    keys = s.args["order"].expressions
    original = rw.original.args.get("order")
    key_sql = (original.expressions[0].this.sql(dialect="duckdb")
               if isinstance(original, exp.Order) else keys[0].this.sql(dialect="duckdb"))
    if len(keys) != 1:
        return None, "ORDER BY has several keys"
    ordered = keys[0]
    call = _order_call(s, ordered.this, rw)
    if call is None:
        return None, f"its ORDER BY key {key_sql} is not one semantic function's value"
    if ordered.args.get("nulls_first"):
        return None, "NULLS FIRST puts the rows without a value first"
    numbers = limit_offset(s)
    if numbers is None:
        return None, "LIMIT and OFFSET are not plain numbers"
    if s.find(exp.Placeholder):
        return None, "the statement has parameters"
    shape, why = one_source(rw, allow_order=True)
    if shape is None:
        return None, why
    name = str(call.this)
    if any(str(c.this) == name for k in shape.kept for c in site_calls(k, rw)):
        return None, f"{key_sql} is also in WHERE, so every row gets its value there"
    if any(names_alias(k, s) for k in shape.kept):
        return None, "its WHERE refers to a SELECT alias"
    site = next(x for x in rw.sites if x.udf_name == name)
    return TopK(numbers[0], numbers[1], bool(ordered.args.get("desc")), site.id, key_sql,
                shape), ""


def cascade_reason(site: CallSite, bound: Bound, served: bool) -> str:
    """Why the top-k plan cannot prune ``site``'s call (``served``: an online engine answers
    it), or "" when it can."""
    if bound.output_type != "double":
        return (f"{site.function}() returns {sql_type(bound.output_type)}, not a DOUBLE "
                "score")
    if served:
        return f"{site.function}() is served by an online engine, which answers each row whole"
    if bound.cascade.num_stages < 2:
        return (f"the cascade of {site.call_sql()} has one stage "
                f"({bound.cascade.models[0]}): no cheap stage to prune with, so every row is "
                "scored by it")
    return ""


def _rank(value: Any, descending: bool) -> float:
    """Larger is better: the value (its negation for ASC); NULL is last either way and NaN,
    which DuckDB orders above every number, is largest."""
    if value is None:
        return -math.inf
    v = math.inf if math.isnan(value) else float(value)
    return v if descending else -v


def run_topk(sql: Callable[[str], pa.Table], rw: Rewritten, plan: TopK, runner: SiteRunner,
             table_name: str) -> tuple[pa.Table, TopkRun]:
    """Run ``rw`` by ``plan`` (the module docstring); ``sql(text)`` runs a statement on the
    connection ``runner`` and the statement's other sites are registered on; the numbered rows
    live in the temporary table ``table_name`` while it runs."""
    s = rw.statement
    assert isinstance(s, exp.Select)
    quoted = exp.to_identifier(table_name, quoted=True).sql(dialect="duckdb")
    sql(numbering_sql(plan.shape, quoted))
    try:
        call = _order_call(s, s.args["order"].expressions[0].this, rw)
        assert call is not None
        inputs = on_rows(s, plan.shape, f"SELECT * FROM {quoted}")
        for key in ("order", "limit", "offset"):
            inputs.set(key, None)
        inputs.set("expressions", [exp.column(ROW_NUMBER),
                                   *[a.copy() for a in call.expressions]])
        table = sql(inputs.sql(dialect="duckdb"))
        numbers = table.column(0).to_pylist()
        keys = row_keys([table.column(i).to_pylist() for i in range(1, table.num_columns)])
        known, run = _choose(plan, runner, keys)
        # the rows with a value (NULL input: NULL), best first, ties by the source's order
        valued = [i for i in range(len(keys)) if keys[i] is None or keys[i] in known]
        valued.sort(key=lambda i: (-_rank(None if keys[i] is None else known[keys[i]],
                                          plan.descending), numbers[i]))
        chosen = [numbers[i] for i in valued[:plan.wanted]]
        rows = (f"SELECT * FROM {quoted} WHERE "
                + (f"{ROW_NUMBER} IN ({', '.join(map(str, chosen))})" if chosen else "false"))
        final = on_rows(s, plan.shape, rows)
        _hide_row_number(final)
        final.args["order"].append("expressions", exp.Ordered(this=exp.column(ROW_NUMBER)))
        out = sql(final.sql(dialect="duckdb"))
    finally:
        sql(f"DROP TABLE IF EXISTS {quoted}")
    return out, TopkRun(plan.limit, plan.offset, plan.descending, len(keys), **run,
                        returned=out.num_rows)


def _hide_row_number(s: exp.Select) -> None:
    """``*`` and ``t.*`` in the select list leave the row number out (the ORDER BY uses it to
    break ties)."""
    for sel in s.expressions:
        star = sel if isinstance(sel, exp.Star) else (
            sel.this if isinstance(sel, exp.Column) and isinstance(sel.this, exp.Star) else None)
        if star is not None:
            star.set("except_", [*(star.args.get("except_") or []), exp.column(ROW_NUMBER)])


def _choose(plan: TopK, runner: SiteRunner, keys: list) -> tuple[dict, dict]:
    """Steps 1-3 of the module docstring on the rows' inputs ``keys`` (None: NULL): the
    final values of the inputs evaluated (SQL values) and the counts of :class:`TopkRun`."""
    started = time.perf_counter()
    cascade = runner.bound.cascade
    counts: dict[Any, int] = {}
    for k in keys:
        if k is not None:
            counts[k] = counts.get(k, 0) + 1
    with runner.lock:
        new = runner.unanswered(list(counts))  # the memo and the result cache answer the rest
    known = {k: runner.memo[k] for k in counts if k in runner.memo}
    first = Cascade(cascade.models[:1], (), cascade.certainty)
    rest = Cascade(cascade.models[1:], cascade.thresholds[1:], cascade.certainty)
    with runner.lock:
        values, result = runner.run_stages(first, new, 0) if new else ([], None)
        up = (cascade.escalates(0, result.certainty) if result is not None
              else np.zeros(0, bool))
        runner.stats.stages[0].resolved_rows -= int(up.sum())  # they were passed on
        cheap: dict[Any, float] = {}
        forced: list = []  # escalated without a cheap value: no bound, so evaluated
        for k, v, escalated in zip(new, values, up.tolist(), strict=True):
            if not escalated:
                known[k] = v
            elif v is None or math.isnan(v):
                forced.append(k)
            else:
                cheap[k] = float(v)
        pool = list(cheap)  # in the source's order
        rng = np.random.default_rng(SEED)
        picked = rng.choice(len(pool), size=min(plan.sample_rows, len(pool)), replace=False)
        sample = [pool[i] for i in sorted(picked.tolist())]

        def expensive(batch: list) -> None:
            out, _ = runner.run_stages(rest, batch, 1)
            known.update(zip(batch, out, strict=True))

        if sample or forced:
            expensive(sample + forced)
        deltas = [abs(known[k] - cheap[k]) for k in sample
                  if known[k] is not None and not math.isnan(known[k])]
        margin = max(deltas) if deltas else (None if not sample else 0.0)
        slack = margin or 0.0
        order = sorted((k for k in cheap if k not in known),
                       key=lambda k: -_rank(cheap[k], plan.descending))
        batch_rows = max(8, min(plan.wanted, runner.batch_size))
        batches = 0
        while order:
            bar = _kth(known, counts, plan)
            if _rank(cheap[order[0]], plan.descending) + slack < bar:
                break  # the most promising row cannot reach it; the others neither
            # in order of promise, so a row below the bar leaves only rows below it
            batch = []
            while order and len(batch) < batch_rows \
                    and _rank(cheap[order[0]], plan.descending) + slack >= bar:
                batch.append(order.pop(0))
            expensive(batch)
            batches += 1
        runner.keep({k: known[k] for k in new if k in known})  # final values only
    stats = runner.stats  # as if the rows had reached the site: EXPLAIN ANALYZE adds up
    stats.rows_in += len(keys)
    stats.null_rows += len(keys) - sum(counts.values())
    stats.distinct_evaluated += len(new) - len(order)
    stats.pruned += len(order)
    stats.seconds += time.perf_counter() - started
    sent = len(cheap) + len(forced) - len(order)
    return known, {"distinct_inputs": len(counts), "cheap_model": cascade.models[0],
                   "cheap_rows": len(new), "escalated": int(up.sum()),
                   "sampled": len(sample), "expensive_rows": sent, "pruned": len(order),
                   "margin": margin, "batches": batches}


def _kth(known: dict, counts: dict, plan: TopK) -> float:
    """The ``plan.wanted``-th best rank among the rows whose value is known (-inf while fewer
    are known)."""
    ranks = sorted(((_rank(v, plan.descending), counts[k]) for k, v in known.items()),
                   reverse=True)
    seen = 0
    for rank, n in ranks:
        seen += n
        if seen >= plan.wanted:
            return rank
    return -math.inf
