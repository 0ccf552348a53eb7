"""PNG plots of offline-phase results (DESIGN.md section 9), shared by the CLI and benchmarks.

Figures are drawn with matplotlib's object-oriented API on an Agg canvas, never through
``pyplot``: no global figure state and no interactive backend is touched, so plotting is safe
inside a notebook, a server or a test run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ken.policy.plan import Frontier

#: ``(label, p95_ms, accuracy)``: a point to compare against the frontier (e.g. a baseline)
ExtraPoint = tuple[str, float, float]


def plot_frontier(frontier: Frontier, path: str | Path, title: str | None = None,
                  extra_points: Sequence[ExtraPoint] | None = None) -> Path:
    """Write the latency-accuracy frontier of ``frontier`` as a PNG at ``path``.

    p95 latency (ms, log scale) on x, accuracy on y, one point per gear plan annotated with its
    number of gears; ``extra_points`` are drawn as labelled crosses (baselines, single models).

    >>> plot_frontier(Frontier.load("ken-plan/frontier-sentiment.json"),
    ...               "frontier.png")  # doctest: +SKIP
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(7.0, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    points = frontier.points()
    xs = [p95 for p95, _ in points]
    ys = [acc * 100 for _, acc in points]
    # steps: the best accuracy reachable within a latency budget is that of the last plan left
    # of it, so the frontier is flat between plans
    ax.plot(xs, ys, "-o", drawstyle="steps-post", color="tab:blue", markersize=5,
            label=f"{len(points)} gear plans (Ng: N gears)")
    for plan, x, y in zip(frontier.plans, xs, ys, strict=True):
        gears = len(plan.gears())
        ax.annotate(f"{gears}g", (x, y), textcoords="offset points", xytext=(4, -11),
                    fontsize=8, color="tab:blue")
    for label, p95_ms, accuracy in extra_points or ():
        ax.plot([p95_ms], [accuracy * 100], "x", color="tab:red", markersize=7)
        ax.annotate(label, (p95_ms, accuracy * 100), textcoords="offset points",
                    xytext=(5, 4), fontsize=8, color="tab:red")
    ax.set_xscale("log")
    ax.set_xlabel("predicted p95 latency (ms, log scale)")
    ax.set_ylabel("predicted accuracy (%)")
    ax.set_title(title or f"Gear-plan frontier of {frontier.operator}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path
