"""The tables that `ken` and `ken demo` print (rich), kept apart from the command logic."""

from __future__ import annotations

from rich.table import Table


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f} MB"


def models_table(cards, profiles=None) -> Table:  # noqa: ANN001
    """Model cards as a table, with profiled ms/row per thread count when profiles are given."""
    table = Table(title="minilm-sentiment models")
    for col in ("model", "training", "params", "memory", "held-out acc.",
                "ms/row (b32, prepare)"):
        table.add_column(col, justify="right" if col not in ("model", "training") else "left")
    profiled = sorted({p.hardware for p in (profiles or [])})
    for hw in profiled:
        table.add_column(f"ms/row b1 {hw}", justify="right")
        table.add_column(f"ms/row b32 {hw}", justify="right")
    for card in cards:
        row = [card.name, card.training, f"{card.num_params / 1e6:.1f}M", _mb(card.memory_bytes),
               f"{card.heldout_accuracy:.1%}", f"{card.ms_per_row:.1f} ({card.threads}t)"]
        for hw in profiled:
            match = [p for p in profiles if p.model == card.name and p.hardware == hw]
            row += ([f"{match[0].ms_per_row(1):.1f}", f"{match[0].ms_per_row(32):.1f}"]
                    if match else ["-", "-"])
        table.add_row(*row)
    return table


def frontier_table(points, title: str = "Pareto cascades", limit: int = 14) -> Table:  # noqa: ANN001
    """The frontier as a table; long frontiers are thinned to ``limit`` evenly spaced rows."""
    shown = list(range(len(points)))
    if len(points) > limit:
        shown = sorted({round(i * (len(points) - 1) / (limit - 1)) for i in range(limit)})
        title += f" — {len(shown)} of {len(points)} points shown"
    table = Table(title=title)
    for col in ("#", "cascade", "accuracy", "ms/row", "rows reaching each stage"):
        table.add_column(col, justify="left" if col == "cascade" else "right")
    for i in shown:
        m = points[i]
        reach = " / ".join(f"{f:.0%}" for f in m.stage_fractions)
        table.add_row(str(i), m.cascade.describe(), f"{m.accuracy:.1%}",
                      f"{m.cost_ms_per_row:.2f}", reach)
    return table


def cascade_names(frontier, catalog=None) -> dict:  # noqa: ANN001
    """Short names ``C0, C1, ...`` for the cascades a frontier uses: by expected compute per
    row when ``catalog`` is given (C0 cheapest), else by number of stages."""
    from ken.optimizer.planning import sustained_qps

    used = list(dict.fromkeys(c for plan in frontier.plans for c in plan.cascades))
    if catalog is not None:
        used.sort(key=lambda c: -sustained_qps(catalog, c, 1))
    else:
        used.sort(key=lambda c: (c.num_stages, c.models, c.thresholds))
    return {c: f"C{i}" for i, c in enumerate(used)}


def gear_plan_table(frontier, chosen=None, catalog=None) -> tuple[Table, list[str]]:  # noqa: ANN001
    """The frontier of gear plans, fastest first (``chosen`` marked with *), and a legend of
    the cascades its "cascade per QPS range" column names."""
    names = cascade_names(frontier, catalog)
    table = Table(title=f"Gear-plan frontier of {frontier.operator} ({len(frontier)} plans)")
    for col in ("#", "p95 ms", "p50 ms", "accuracy", "gears", "replicas",
                "cascade per QPS range (low to high load)"):
        table.add_column(col, justify="left" if col.startswith("cascade") else "right")
    for i, plan in enumerate(frontier.plans):
        p = plan.predicted
        gears = ", ".join(f"{names[plan.cascades[c]]} to {hi:g}" for _lo, hi, c in plan.gears())
        mark = " *" if plan is chosen else ""
        table.add_row(f"{i}{mark}", f"{p.p95_ms:,.1f}", f"{p.p50_ms:,.1f}", f"{p.accuracy:.1%}",
                      str(len(plan.gears())), str(len(plan.placement)), gears)
    legend = []
    for cascade, name in names.items():
        acc = "" if catalog is None else f" ({catalog.accuracy(cascade):.1%} on the sample)"
        legend.append(f"{name} = {cascade.describe()}{acc}")
    return table, legend


