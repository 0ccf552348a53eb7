"""EXPLAIN: a logical plan tree of a (rewritten) statement, with semantic operators marked.

Nodes are printed in execution order from the leaves up: scans and joins, relational filters
(DuckDB), semantic filters (ken), aggregation, projection, order, limit. Semantic call sites
are named ``s0``, ``s1``, ... so the output is deterministic.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sqlglot import exp

from ken.sql.rewrite import CallSite

_SITE = re.compile(r"__ken_s(\d+)_(\w+?)\(", re.IGNORECASE)


@dataclass(frozen=True)
class PlanNode:
    kind: str
    detail: str
    engine: str  # "duckdb" | "ken"
    children: tuple[PlanNode, ...] = ()


def has_site(node: exp.Expression) -> bool:
    return any(str(a.this).lower().startswith("__ken_s") for a in node.find_all(exp.Anonymous))


def show(node: exp.Expression) -> str:
    """SQL of an expression with site functions shown as ``s0:sentiment(...)``."""
    return _SITE.sub(lambda m: f"s{m.group(1)}:{m.group(2).lower()}(", node.sql(dialect="duckdb"))


def conjuncts(node: exp.Expression | None) -> list[exp.Expression]:
    if node is None:
        return []
    if isinstance(node, exp.And):
        return conjuncts(node.left) + conjuncts(node.right)
    if isinstance(node, exp.Paren):
        return conjuncts(node.this) if isinstance(node.this, exp.And) else [node]
    return [node]


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
