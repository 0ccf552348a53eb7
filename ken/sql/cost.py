"""What a query will cost before it runs: model calls and model time per call site, from the
rows and distinct inputs that reach it (a COUNT over its relational part), the answers the
result cache already holds (``ken.cache``) and the profiles of its cascade; and the session's
limits (``max_model_calls``, ``max_model_seconds``), which refuse a query whose estimate
exceeds them before any model is called.

Estimates are what EXPLAIN prints. Calls per stage are *expected* where the bound cascade
carries its profile's stage fractions (``sentiment``, trained ``sem_classify``, a registered
cascade with a sample), else an *upper bound* (every distinct input at every stage); time is
known only with a profile (its expected model time per row, all stages). A call site whose
inputs are counted under WHERE terms that are not all relational, or that sits outside WHERE,
gets an upper bound too ("≤").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
from sqlglot import exp

from ken.cache import ResultCache
from ken.errors import KenError
from ken.ops.base import Bound
from ken.sql.cache_key import Namespace
from ken.sql.execute import row_keys
from ken.sql.explain import has_site
from ken.sql.rewrite import CallSite, Rewritten, conjuncts


class CostLimitExceeded(KenError):
    """A query's estimated model calls or time exceed the session's limit."""


@dataclass(frozen=True)
class SiteEstimate:
    """One call site's expected work (see the module docstring)."""

    site: str  # the site's label and call, e.g. "s0 sentiment(text)"
    rows: int | None  # rows reaching the site (None: unknown)
    distinct: int | None  # distinct non-NULL inputs among them
    bounded: bool  # rows and distinct are upper bounds
    cached: int  # distinct inputs the result cache answers
    stage_calls: tuple[tuple[str, float], ...]  # (model, calls) per stage
    expected: bool  # stage_calls from profiles (else upper bounds)
    seconds: float | None  # expected model time (None: no profile)
    why_unknown: str = ""

    @property
    def calls(self) -> float:
        return sum(c for _, c in self.stage_calls)

    def text(self) -> str:
        if self.rows is None or self.distinct is None:
            return self.why_unknown
        upper = "≤ " if self.bounded else ""
        text = (f"{upper}{self.rows:,} input rows, {upper}{self.distinct:,} distinct non-NULL "
                "inputs")
        if self.cached:
            text += f" ({self.cached:,} answered by the result cache)"
        per = ", ".join(f"{m} {c:,.0f}" for m, c in self.stage_calls)
        text += f"; model calls {'≈' if self.expected else '≤'} {per}"
        if self.seconds is not None:
            text += f"; model time ≈ {self.seconds:,.1f} s"
        return text


def site_scope(rw: Rewritten, site: CallSite) -> tuple[exp.Select, bool] | None:
    """The SELECT that lists what reaches ``site`` with its semantic conditions dropped (its
    relational WHERE and ON terms kept; ordering, grouping and limits removed), and whether
    that over-counts (a semantic term dropped, or the site outside WHERE); None when the call
    has no SELECT scope."""
    call = next((a for a in rw.statement.find_all(exp.Anonymous)
                 if str(a.this) == site.udf_name), None)
    scope = call.find_ancestor(exp.Select) if call is not None else None
    if scope is None:
        return None
    probe = scope.copy()
    for key in ("group", "having", "order", "limit", "distinct", "offset"):
        probe.set(key, None)
    where = probe.args.get("where")
    every = conjuncts(where.this if where is not None else None)
    kept = [c for c in every if not has_site(c)]
    probe.set("where", exp.Where(this=exp.and_(*kept)) if kept else None)
    for join in probe.args.get("joins") or []:
        on = [c for c in conjuncts(join.args.get("on")) if not has_site(c)]
        join.set("on", exp.and_(*on) if on else exp.true())
    root_with = rw.statement.args.get("with_")
    if root_with is not None and probe.args.get("with_") is None:
        probe.set("with_", root_with.copy())
    return probe, site.clauses != ("WHERE",) or len(kept) != len(every)


def distinct_inputs(con: Any, probe: exp.Select, site: CallSite) -> list:
    """The distinct non-NULL inputs (memo keys) that ``probe`` (:func:`site_scope`) lists;
    ``duckdb.Error`` when it cannot run (parameters, a correlated scope)."""
    values = probe.copy()
    values.set("expressions", [exp.cast(exp.maybe_parse(a, dialect="duckdb"), "VARCHAR")
                               for a in site.args])
    values.set("distinct", exp.Distinct())
    table = con.sql(values.sql(dialect="duckdb")).to_arrow_table()
    return [k for k in row_keys([c.to_pylist() for c in table.columns]) if k is not None]


def estimate(con: Any, rw: Rewritten, site: CallSite, bound: Bound,
             cache: ResultCache | None = None, namespace: Namespace | None = None
             ) -> SiteEstimate:
    """The estimate of one call site of ``rw`` (run on ``con`` with the site functions
    registered: nested calls may remain inside FROM subqueries)."""
    label = f"{site.label} {site.call_sql()}"
    unknown = SiteEstimate(label, None, None, True, 0, (), False, None)
    scoped = site_scope(rw, site)
    if scoped is None:
        return _unknown(unknown, "input rows unknown")
    probe, bounded = scoped
    args = [exp.maybe_parse(a, dialect="duckdb") for a in site.args]
    distinct_arg = args[0] if len(args) == 1 else exp.Array(expressions=args)
    counts = probe.copy()
    counts.set("expressions", [exp.Count(this=exp.Star()),
                               exp.Count(this=exp.Distinct(expressions=[distinct_arg]))])
    try:
        rows, distinct = con.sql(counts.sql(dialect="duckdb")).fetchall()[0]
        cached = 0
        if cache is not None and namespace is not None and distinct:
            cached = cache.count(namespace.id, distinct_inputs(con, probe, site))
    except duckdb.Error:
        return _unknown(unknown, "input rows unknown (correlated or nested scope)")
    todo = distinct - cached
    fractions = getattr(bound, "stage_fractions", None)
    models = bound.cascade.models
    if fractions:
        stage_calls = tuple((m, todo * f) for m, f in zip(models, fractions, strict=True))
    else:
        stage_calls = tuple((m, float(todo)) for m in models)
    per_row = getattr(bound, "cost_ms_per_row", None)
    seconds = todo * per_row / 1000.0 if per_row is not None else None
    return SiteEstimate(label, rows, distinct, bounded, cached, stage_calls, bool(fractions),
                        seconds)


def _unknown(base: SiteEstimate, why: str) -> SiteEstimate:
    return SiteEstimate(base.site, None, None, True, 0, (), False, None, why)


def check_limits(estimates: Sequence[SiteEstimate], max_calls: int | None,
                 max_seconds: float | None) -> None:
    """Refuse (CostLimitExceeded, with the estimate) a query whose estimated model calls or
    model time exceed the session's limits; a limit the estimate cannot be checked against
    (rows or time unknown) refuses too, and says why."""
    if max_calls is None and max_seconds is None:
        return
    detail = "; ".join(f"{e.site}: {e.text()}" for e in estimates)
    how = ("Raise the limit (SET ken_max_model_calls = N, SET ken_max_model_seconds = S, or "
           "the session attributes of the same names), RESET it, or narrow the query")
    unknown = [e for e in estimates if e.rows is None]
    if unknown:
        raise CostLimitExceeded(
            f"this query's model calls cannot be estimated ({detail}), so the session's "
            f"limit cannot be checked before it runs. {how}")
    calls = sum(e.calls for e in estimates)
    if max_calls is not None and calls > max_calls:
        kind = "about" if all(e.expected for e in estimates) else "up to"
        raise CostLimitExceeded(
            f"this query would make {kind} {calls:,.0f} model calls, more than the session's "
            f"max_model_calls = {max_calls:,} ({detail}). {how}")
    if max_seconds is not None:
        untimed = [e.site for e in estimates if e.seconds is None and e.calls > 0]
        if untimed:
            raise CostLimitExceeded(
                f"max_model_seconds is set, but {', '.join(untimed)} has no profile to "
                f"estimate its model time from ({detail}). Plan the function first "
                "(session.plan or `ken plan`), limit model calls instead "
                f"(max_model_calls), or RESET ken_max_model_seconds")
        seconds = sum(e.seconds or 0.0 for e in estimates)
        if seconds > max_seconds:
            raise CostLimitExceeded(
                f"this query would take about {seconds:,.1f} s of model time, more than the "
                f"session's max_model_seconds = {max_seconds:,g} ({detail}). {how}")
