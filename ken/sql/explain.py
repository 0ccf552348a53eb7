"""EXPLAIN: a logical plan tree of a (rewritten) statement, with semantic operators marked.

Nodes are printed in execution order from the leaves up: scans and joins, relational filters
(DuckDB), semantic filters (ken), aggregation, projection, order, limit. Semantic call sites
are named ``s0``, ``s1``, ... so the output is deterministic.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlglot import exp

from ken.sql.rewrite import CallSite, conjuncts

if TYPE_CHECKING:
    from ken.engine.manager import ServingManager
    from ken.sql.execute import SiteRunner

_SITE = re.compile(r"__ken_s(\d+)_(\w+?)\(", re.IGNORECASE)


@dataclass(frozen=True)
class PlanNode:
    kind: str
    detail: str
    engine: str  # "duckdb" | "ken"
    children: tuple[PlanNode, ...] = ()


def has_site(node: exp.Expression) -> bool:
    return any(str(a.this).lower().startswith("__ken_s") for a in node.find_all(exp.Anonymous))


def _as_written(arg: exp.Expression) -> exp.Expression:
    """A site argument without the ``CAST(to_json(x) AS VARCHAR)`` the rewrite wraps record
    arguments in (``Operator.record_columns``), and an aggregate's ``list_sort(list(x))``."""
    inner = arg.this if isinstance(arg, exp.Cast) else None
    if isinstance(inner, exp.Anonymous) and str(inner.this).lower() == "to_json":
        arg = inner.expressions[0]
    # an aggregate's column (``Operator.aggregate``): list_sort(list(x)) -> x
    if isinstance(arg, exp.Anonymous) and str(arg.this).lower() == "list_sort":
        listed = arg.expressions[0]
        if isinstance(listed, exp.Anonymous) and str(listed.this).lower() == "list":
            return listed.expressions[0]
    return arg


def show(node: exp.Expression) -> str:
    """SQL of an expression with site functions shown as ``s0:sentiment(...)``, their
    arguments as the user wrote them."""
    node = node.copy()
    for call in list(node.find_all(exp.Anonymous)):
        if str(call.this).lower().startswith("__ken_s"):
            call.set("expressions", [_as_written(a) for a in call.expressions])
    return _SITE.sub(lambda m: f"s{m.group(1)}:{m.group(2).lower()}(", node.sql(dialect="duckdb"))


def _filters(conds: list[exp.Expression], child: PlanNode, label: str) -> PlanNode:
    relational = [c for c in conds if not has_site(c)]
    semantic = [c for c in conds if has_site(c)]
    if relational:
        child = PlanNode(label, " AND ".join(show(c) for c in relational), "duckdb", (child,))
    if semantic:
        child = PlanNode(f"Semantic {label.lower()}", " AND ".join(show(c) for c in semantic),
                         "ken", (child,))
    return child


def _source(node: exp.Expression) -> PlanNode:
    if isinstance(node, exp.Table):
        alias = f" AS {node.alias}" if node.alias else ""
        return PlanNode("Scan", f"{node.sql(dialect='duckdb').split(' AS ')[0]}{alias}", "duckdb")
    if isinstance(node, exp.Subquery):
        return PlanNode("Subquery", node.alias or "", "duckdb", (build(node.this),))
    return PlanNode("Source", show(node), "duckdb")


def _select(s: exp.Select) -> PlanNode:
    from_ = s.args.get("from_")
    node = _source(from_.this) if from_ is not None else PlanNode("Values", "(no FROM)", "duckdb")
    for join in s.args.get("joins") or []:
        kind = " ".join(p for p in (join.side, join.kind) if p) or "INNER"
        right = _source(join.this)
        on = join.args.get("on")
        conds = conjuncts(on)
        rel = [c for c in conds if not has_site(c)]
        sem = [c for c in conds if has_site(c)]
        detail = " AND ".join(show(c) for c in rel) or "(no relational condition)"
        node = PlanNode(f"Join {kind}", detail, "duckdb", (node, right))
        if sem:
            node = PlanNode("Semantic join condition", " AND ".join(show(c) for c in sem),
                            "ken", (node,))
    node = _filters(conjuncts(s.args.get("where") and s.args["where"].this), node, "Filter")
    group = s.args.get("group")
    if group is not None:
        keys = ", ".join(show(k) for k in group.expressions) or ("ALL" if group.args.get("all")
                                                                else "")
        node = PlanNode("Aggregate", f"GROUP BY {keys}", "ken" if has_site(group) else "duckdb",
                        (node,))
    having = s.args.get("having")
    if having is not None:
        node = _filters(conjuncts(having.this), node, "Having")
    items = ", ".join(show(e) for e in s.expressions)
    node = PlanNode("Project", items, "ken" if any(has_site(e) for e in s.expressions)
                    else "duckdb", (node,))
    if s.args.get("distinct"):
        node = PlanNode("Distinct", "", "duckdb", (node,))
    order = s.args.get("order")
    if order is not None:
        node = PlanNode("Order", ", ".join(show(o) for o in order.expressions),
                        "ken" if has_site(order) else "duckdb", (node,))
    if s.args.get("limit") is not None:
        node = PlanNode("Limit", show(s.args["limit"].expression), "duckdb", (node,))
    return node


def build(node: exp.Expression) -> PlanNode:
    """The plan tree of a statement (SELECT, set operations, CTEs, DDL/DML around a query)."""
    if isinstance(node, exp.Subquery):
        return build(node.this)
    ctes = []
    with_ = node.args.get("with_")
    if with_ is not None:
        ctes = [PlanNode("CTE", cte.alias, "duckdb", (build(cte.this),))
                for cte in with_.expressions]
    if isinstance(node, exp.Select):
        root = _select(node)
    elif isinstance(node, exp.SetOperation):
        kind = type(node).__name__.upper() + (" ALL" if not node.args.get("distinct") else "")
        root = PlanNode(kind, "", "duckdb", (build(node.left), build(node.right)))
    else:
        inner = node.find(exp.Select)
        label = type(node).__name__.upper()
        target = node.this.sql(dialect="duckdb") if isinstance(node.this, exp.Expression) else ""
        root = PlanNode(label, target, "duckdb", (build(inner),) if inner is not None else ())
    if ctes:
        root = PlanNode("With", ", ".join(c.detail for c in ctes), "duckdb", (*ctes, root))
    return root


def render(node: PlanNode, prefix: str = "", last: bool = True, top: bool = True) -> list[str]:
    tag = "[ken]   " if node.engine == "ken" else "[duckdb]"
    head = "" if top else prefix + ("└─ " if last else "├─ ")
    detail = f" {node.detail}" if node.detail else ""
    lines = [f"{head}{tag} {node.kind}{detail}"]
    child_prefix = prefix if top else prefix + ("   " if last else "│  ")
    for i, child in enumerate(node.children):
        lines += render(child, child_prefix, i == len(node.children) - 1, False)
    return lines


def site_lines(sites: Sequence[CallSite], describe: Mapping[int, str],
               estimates: Mapping[int, str], actual: Mapping[int, list[str]] | None = None,
               plans: Mapping[int, list[str]] | None = None) -> list[str]:
    """Per call site: the call, its implementation, estimates, the gear plan (``plans``:
    lines per site, continuation lines indented further) and actual counts."""
    lines = ["", "Semantic operators:"]
    for site in sites:
        lines.append(f"  {site.label}: {site.call_sql()}  (in {', '.join(site.clauses)})")
        lines.append(f"      implementation: {describe[site.id]}")
        if site.id in estimates:
            lines.append(f"      estimated: {estimates[site.id]}")
        for line in (plans or {}).get(site.id, []):
            lines.append(f"      {line}")
        for line in (actual or {}).get(site.id, []):
            lines.append(f"      actual: {line}")
    return lines


def actual_lines(runner: SiteRunner) -> list[str]:
    """EXPLAIN ANALYZE lines of what one call site did."""
    st = runner.stats
    repeats = (st.rows_in - st.null_rows - st.distinct_evaluated - st.shortcut_rows
               - st.pruned - st.cache_hits)
    planned = (f" + {st.shortcut_rows:,} answered by the join plan without the model"
               if st.shortcut_rows else "")
    pruned = f" + {st.pruned:,} pruned by the top-k plan" if st.pruned else ""
    cached = (f" + {st.cache_hits:,} from the result cache" if st.cache_hits else "")
    lines = [f"{st.rows_in:,} rows in = {st.null_rows:,} NULL + {st.distinct_evaluated:,} "
             f"distinct evaluated{cached}{planned}{pruned} + {repeats:,} repeats served by "
             f"dedup; {st.chunks} chunks, {st.seconds:.3f} s"]
    if runner.cache is not None or st.cache_error:
        failed = f" (then not used: {st.cache_error})" if st.cache_error else ""
        lines.append(f"result cache: {st.cache_hits:,} hits, {st.cache_misses:,} misses{failed}")
    if st.online_rows or st.bulk_rows:
        answered = ", ".join(f"{k} {v:,}" for k, v in st.resolved_by.items())
        retried = (f"; {st.rejected_retries:,} sent again after admission turned them away"
                   if st.rejected_retries else "")
        return lines + [f"online engine: {st.online_rows:,} rows as requests, {st.bulk_rows:,} "
                        f"as bulk rows; answered by {answered}{retried}"]
    for stage in st.stages:
        calls = f", {stage.lm_calls:,} LM calls" if stage.lm_calls else ""
        lines.append(f"stage {stage.model}: {stage.input_rows:,} in, {stage.resolved_rows:,} "
                     f"resolved, {stage.num_batches} batches{calls}, {stage.seconds:.3f} s")
    return lines


def plan_lines(serving: ServingManager, function: str, constants: tuple[str, ...] = ()
               ) -> list[str]:
    """EXPLAIN lines on how a call runs: its function's plan (either kind, shown the same
    way), whether a server serves it, or why it runs in-process."""
    op = serving.operators[function]
    plan = serving.plans.get(function)
    if plan is None:
        if op.plannable():
            return [f"{op.plan_kind} plan: none (run session.plan(...) or `ken plan`)"]
        return [f"{op.plan_kind} plan: none ({function}() has no profiles to plan with; "
                "session.use_plan(...) sets one)"]
    if serving.planned_for_other_constants(function, constants):
        planned_for = op.eval_constants
        return [f"{plan.kind} plan: planned for "
                f"{function}({', '.join(map(repr, planned_for))}); "
                "this call has other constants, so it runs the implementation above "
                "in-process"]
    server = serving.engine_for(function, constants)
    how = (server.describe_serving(serving.bulk_threshold, function) if server is not None else
           "for online serving, session.serve(); until then queries run the "
           "implementation above")
    events = serving.replan_log.get(function, [])
    replans = [f"  {e.line()}" for e in events]
    stopgaps = sum(e.stopgap for e in events)
    count = f"{len(events) - stopgaps}" + (f", and {stopgaps} stop-gap(s)" if stopgaps else "")
    return [f"{plan.kind} plan: {plan.headline()} ({how})",
            *("  " + line for line in plan.describe()),
            *([f"re-plans while serving ({count}):", *replans] if replans else [])]
