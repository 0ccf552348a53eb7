"""Figure 10 of the KEN paper on our models: the MultiModalQA pipeline planned as a whole.

Every system answers the same stream of MultiModalQA questions (the answerable text/table
questions of ``../shared/data/mmqa``, drawn in a seeded order) arriving on the Azure LLM trace,
on ``--devices`` one-thread CPU workers. A question runs ``question_type`` (MiniLM-L6 head)
and then its route's reading hops, ``text_qa`` and/or ``table_qa`` (``ken.multihop``). What each
LM answers for each question, and how long its batches take, is measured once
(``ken.multihop_plan.measure``, cached); the stream is then simulated with the engine's own
scheduling policies (``ken.optimizer.query.evaluate_pipeline``), and a question's F1 is the
measured F1 of the answers the LMs that resolved its hops gave.

Systems (the paper's baselines, built from our models):

- **ken**: each reading operator gets a frontier of gear plans (``smol``, ``qwen`` and
  ``smol -> qwen`` cascades at several thresholds, cascades switched by load); the query
  optimizer simulates the combinations together (``choose_pipeline``);
- **small models + LLMs**: each operator picks one LM (no cascades, no load adaptation);
- **simple cascade**: ``smol -> qwen`` at one fixed threshold for both operators (the same
  threshold for all loads), one point per threshold;
- **LLM-only** (qwen for both) and **small-only** (smol for both).

Placement and batching are ken's planner's for every system (so the comparison isolates
cascades and load adaptation). Writes ``benchmarks/results/mmqa_plan/mmqa_plan.json`` (every
point: F1, EM-free F1 only, end-to-end and per-operator p95, plans) and ``mmqa_plan.png`` (p95
per operator and end to end against F1), and prints the table of ratios at matched F1.

    python benchmarks/mmqa_plan.py      # first run ~25 min (answers + timings), then ~1-2 min
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "mmqa_plan"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--memory-gb", type=float, default=8.0)
    ap.add_argument("--duration", type=float, default=600.0,
                    help="seconds of the Azure trace around its busiest second")
    ap.add_argument("--load", type=float, default=1.5,
                    help="peak rate as a multiple of what LLM-only sustains")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--cache", type=Path, default=RESULTS / "cache",
                    help="folder of the measured answers and timings (reused across runs)")
    ap.add_argument("--force", action="store_true", help="measure the answers again")
    args = ap.parse_args(argv)

    import ken
    from ken.models.cascade import Cascade
    from ken.models.model import DeviceConfig
    from ken.models.qa_data import read_mmqa
    from ken.multihop_plan import (
        LLMS,
        OPERATORS,
        READING,
        SHORT,
        THRESHOLDS,
        PipelinePlanner,
        load_or_measure,
        model_name,
    )
    from ken.optimizer.query import Target
    from ken.paths import shared_data_dir
    from ken.progress import Reporter

    reporter = Reporter()
    started = time.perf_counter()
    data = read_mmqa(args.data_dir or shared_data_dir() / "mmqa")
    with ken.connect(device=DeviceConfig(threads=2), reporter=reporter, cache=False) as session:
        outcomes = load_or_measure(session, data, args.cache, LLMS, reporter,
                                   args.force)
    planner = PipelinePlanner(outcomes, args.devices, args.memory_gb, args.duration,
                              args.load)
    llms = outcomes.llms
    small, large = llms[0], llms[-1]
    trace = planner.trace
    reporter.note(f"{len(trace)} questions in {args.duration:g} s of the Azure trace, busiest "
                  f"minute {trace.qps_max(60.0) * 60:.0f} questions ({args.load:g}x what "
                  f"LLM-only sustains: {60 * planner.llm_only_qps:.1f}/min)")
    fixed_type = planner.type_plan()

    def point_json(system: str, point, label: str = "") -> dict:  # noqa: ANN001
        return {"system": system, "label": label, "f1": 100 * point.quality,
                "p95_ms": point.metrics.p95_ms, "p50_ms": point.metrics.p50_ms,
                "operator_p95_ms": dict(zip(OPERATORS, point.operator_p95_ms, strict=True)),
                "plans": {p.operator: p.describe() for p in point.plans},
                # cascades a plan switches between by load (1: a static plan)
                "gears": {p.operator: len({r.cascade for r in p.ranges}) for p in point.plans}}

    points: list[dict] = []
    with reporter.task("plan and simulate the systems", 5) as advance:
        ken_plan = planner.choose(Target(max_p95_ms=1e12))
        points += [point_json("ken", p) for p in ken_plan.points]
        advance(1)
        for text_lm in llms:
            for table_lm in llms:
                plans = [fixed_type,
                         planner.static(READING[0], Cascade((model_name(READING[0], text_lm),))),
                         planner.static(READING[1], Cascade((model_name(READING[1], table_lm),)))]
                point = planner.evaluate(plans)
                label = f"{SHORT[text_lm]}/{SHORT[table_lm]}"
                points.append(point_json("small models + LLMs", point, label))
                if text_lm == table_lm == large:
                    points.append(point_json("LLM-only", point, label))
                if text_lm == table_lm == small:
                    points.append(point_json("small-only", point, label))
        advance(3)
        for t in THRESHOLDS:
            plans = [fixed_type] + [
                planner.static(op, Cascade((model_name(op, small), model_name(op, large)), (t,)))
                for op in READING]
            points.append(point_json("simple cascade", planner.evaluate(plans),
                                     f"threshold {t:g}"))
        advance(1)

    ratios = matched_ratios(points)
    result = {
        "setup": {"questions": planner.sample.num_rows, "stream": len(trace),
                  "duration_s": args.duration, "devices": args.devices,
                  "memory_gb": args.memory_gb, "llms": list(llms),
                  "type_model": outcomes.type_model,
                  "type_accuracy": outcomes.type_accuracy,
                  "f1_by_assignment": {k: 100 * float(np.mean([r[0] for r in v]))
                                       for k, v in outcomes.runs.items()},
                  "perf": outcomes.perf, "measure_seconds": outcomes.seconds,
                  "llm_only_qps": planner.llm_only_qps, "peak_qps": planner.peak_qps},
        "points": points, "ratios": ratios,
        "seconds": time.perf_counter() - started}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mmqa_plan.json").write_text(json.dumps(result, indent=1))
    plot(points, args.out / "mmqa_plan.png")
    print(table(ratios))
    print(f"wrote {args.out / 'mmqa_plan.json'} and mmqa_plan.png "
          f"({result['seconds']:.0f} s)")
    return 0


def pareto(points: list[dict]) -> list[dict]:
    """Points no other point beats on both F1 (higher) and p95 (lower), by F1."""
    out = [p for p in points if not any(
        q["f1"] >= p["f1"] and q["p95_ms"] <= p["p95_ms"]
        and (q["f1"], q["p95_ms"]) != (p["f1"], p["p95_ms"]) for q in points)]
    unique = {(p["f1"], p["p95_ms"]): p for p in out}  # one of equal points
    return sorted(unique.values(), key=lambda p: p["f1"])


def matched_ratios(points: list[dict]) -> list[dict]:
    """For each baseline point: ken's fastest point with at least its F1, and the ratios."""
    ken = [p for p in points if p["system"] == "ken"]
    rows = []
    for p in points:
        if p["system"] == "ken":
            continue
        match = [k for k in ken if k["f1"] >= p["f1"] - 1e-9]
        row = {"system": p["system"], "label": p["label"], "f1": p["f1"],
               "p95_ms": p["p95_ms"], "operator_p95_ms": p["operator_p95_ms"]}
        if match:
            k = min(match, key=lambda q: q["p95_ms"])
            row.update(ken_f1=k["f1"], ken_p95_ms=k["p95_ms"],
                       ken_operator_p95_ms=k["operator_p95_ms"],
                       speedup=p["p95_ms"] / k["p95_ms"])
        rows.append(row)
    return rows


def table(ratios: list[dict]) -> str:
    lines = ["| baseline | F1 | p95 (s) | ken F1 | ken p95 (s) | baseline p95 / ken p95 |",
             "|---|---|---|---|---|---|"]
    for r in ratios:
        name = r["system"] + (f" ({r['label']})" if r["label"] else "")
        if "speedup" in r:
            lines.append(f"| {name} | {r['f1']:.1f} | {r['p95_ms'] / 1000:.2f} | "
                         f"{r['ken_f1']:.1f} | {r['ken_p95_ms'] / 1000:.2f} | "
                         f"{r['speedup']:.2f}x |")
        else:
            lines.append(f"| {name} | {r['f1']:.1f} | {r['p95_ms'] / 1000:.2f} | no ken plan "
                         "this accurate | | |")
    return "\n".join(lines)


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("end to end", lambda p: p["p95_ms"])] + [
        (op, lambda p, op=op: p["operator_p95_ms"][op])
        for op in next(iter(points))["operator_p95_ms"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    styles = {"ken": ("C0", "o-"), "small models + LLMs": ("C1", "s"),
              "simple cascade": ("C2", "^-"), "LLM-only": ("C3", "D"),
              "small-only": ("C4", "v")}
    for ax, (title, get) in zip(axes, panels, strict=True):
        for system, (colour, marker) in styles.items():
            pts = [p for p in points if p["system"] == system]
            if system == "ken":
                pts = pareto(pts)
            pts = sorted(pts, key=lambda p: p["f1"])
            ax.plot([p["f1"] for p in pts], [max(get(p), 1e-3) / 1000 for p in pts], marker,
                    color=colour, label=system, markersize=5)
        ax.set_yscale("log")
        ax.set_title(f"p95: {title}")
        ax.set_xlabel("F1 (%)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("p95 latency (s)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
