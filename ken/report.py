"""The tables that `ken` and `ken demo` print (rich), kept apart from the command logic, and
the console they print to."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from ken.optimizer.planning import sustained_qps

# a fixed width when not a terminal keeps wide tables readable in logs and CI
console = Console(width=None if sys.stdout.isatty() else 160)


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




def print_gear_plans(frontier, chosen=None, catalog=None) -> None:  # noqa: ANN001
    """``gear_plan_table`` and its legend, on the console."""
    table, legend = gear_plan_table(frontier, chosen, catalog)
    console.print(table)
    for line in legend:
        console.print(f"  {line}", highlight=False, markup=False)


def latency_table(title: str, rows: Sequence[tuple], first: str = "",  # noqa: ANN001
                  accuracies: Sequence[float] | None = None) -> Table:
    """Accuracy and latency percentiles of served (or simulated) runs, one row per ``(name,
    metrics)``; ``first`` heads the names. With ``accuracies`` (the held-out accuracy of the
    cascades that served each run) the table shows them beside the rows answered correctly
    (``metrics.accuracy``), else the latter alone as "accuracy"."""
    table = Table(title=title)
    correct = "accuracy" if accuracies is None else "rows correct"
    for col in (first, *(() if accuracies is None else ("accuracy",)), correct, "p50 ms",
                "p95 ms", "p99 ms", "gear switches"):
        table.add_column(col, justify="left" if first and col == first else "right")
    for i, (name, m) in enumerate(rows):
        served = () if accuracies is None else (f"{accuracies[i]:.1%}",)
        table.add_row(name, *served, f"{m.accuracy:.1%}", f"{m.p50_ms:.1f}", f"{m.p95_ms:.1f}",
                      f"{m.p99_ms:.1f}", str(m.gear_switches))
    return table


def qa_table(data, summary) -> Table:  # noqa: ANN001 - QA data and a multihop summary
    """EM and F1 by question type, and over all questions (with standard errors)."""
    table = Table(title=f"{data.dataset} ({data.variant}, {', '.join(data.files)}): "
                        f"{summary.scored} questions answered")
    for col in ("question type", "questions", "EM %", "F1 %"):
        table.add_column(col, justify="left" if col == "question type" else "right")
    for qtype, t in sorted(summary.by_type.items(), key=lambda kv: -kv[1].count):
        table.add_row(qtype, str(t.count), f"{t.em:.1f}", f"{t.f1:.1f}")
    em_se, f1_se = summary.standard_errors()
    table.add_row("all", str(summary.scored), f"{summary.em:.1f} ± {em_se:.1f}",
                  f"{summary.f1:.1f} ± {f1_se:.1f}", style="bold")
    return table


def batching_table(title: str, rows: Sequence[tuple]) -> Table:  # noqa: ANN001
    """Continuous against static batching, simulated beside measured: one row per
    ``(mode, simulated metrics, measured metrics)``."""
    table = Table(title=title)
    for col in ("batching", "TTFT p50 ms (sim / engine)", "TTFT p95 ms (sim / engine)",
                "TGT p95 ms (sim / engine)", "passes (sim / engine)"):
        table.add_column(col, justify="left" if col == "batching" else "right")
    for mode, sim, got in rows:
        table.add_row(mode, f"{sim.ttft_p50_ms:.0f} / {got.ttft_p50_ms:.0f}",
                      f"{sim.ttft_p95_ms:.0f} / {got.ttft_p95_ms:.0f}",
                      f"{sim.tgt_p95_ms:.0f} / {got.tgt_p95_ms:.0f}",
                      f"{sim.passes} / {got.passes}")
    return table
