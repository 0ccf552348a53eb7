"""Planner benchmark (issue 4): plan quality on a restricted space, planning time at full scale,
and simulator speed.

(a) restricted space of the paper's section 5.6: every model on every device, batch size 1,
    an 8-second trace. KEN's frontier vs exhaustive search over all |C|^|Q| cascade-to-range
    assignments vs uniform random sampling with 2x KEN's wall time; reports the hypervolume
    ratio (goal: KEN >= 95% of exhaustive) and runtimes.
(b) full search with the measured V100 BERT profiles of the KEN artifact (5 models, ~100
    candidate cascades, |Q| = 50, 16 devices on 2 nodes, the Azure code trace rate-scaled to a
    7,600 QPS peak): wall time (goal <= 60 s on 2 cores) and the frontier plot.
(c) simulator speed: 20 minutes of the Azure arrival pattern at a 7,600 QPS peak.

Per-sample outcomes of the artifact models are synthetic (see ken.optimizer.artifact); runtimes
and memory are the measured ones. Writes benchmarks/results/planner.json and PNGs.

    python benchmarks/planner.py            # all parts, ~3-4 minutes
    python benchmarks/planner.py --part b   # one part
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ken.optimizer.artifact import bert_profiles, v100_hardware  # noqa: E402
from ken.optimizer.cascades import pareto_cascades  # noqa: E402
from ken.optimizer.perf import Catalog  # noqa: E402
from ken.optimizer.placement import full_placement  # noqa: E402
from ken.optimizer.plan_eval import evaluate_plan  # noqa: E402
from ken.optimizer.planner import PlannerSettings, plan_frontier, planning_context  # noqa: E402
from ken.optimizer.plotting import plot_frontier  # noqa: E402
from ken.optimizer.simulator import simulate  # noqa: E402
from ken.optimizer.workload import Trace, load_azure_trace  # noqa: E402
from ken.policy.plan import GearPlan  # noqa: E402
from ken.progress import Reporter  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def hypervolume(points: list[tuple[float, float]], ref: tuple[float, float]) -> float:
    """Area dominated by ``(latency, accuracy)`` points (lower latency, higher accuracy better)
    and bounded by ``ref = (worst latency, worst accuracy)``: the integral over latency ``x``
    of the best accuracy reachable at latency <= x, above ``ref``'s accuracy."""
    front = pareto([(lat, acc) for lat, acc in points if lat < ref[0] and acc > ref[1]])
    xs = [lat for lat, _ in front] + [ref[0]]
    return sum((xs[i + 1] - xs[i]) * (acc - ref[1]) for i, (_, acc) in enumerate(front))


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lat, acc in sorted(points, key=lambda p: (p[0], -p[1])):
        if not out or acc > out[-1][1]:
            out.append((lat, acc))
    return out


def azure_at_peak(peak_qps: float) -> Trace:
    trace = load_azure_trace()
    return trace.rate_scaled(peak_qps / trace.qps_max())


def busiest_window(trace: Trace, seconds: float) -> Trace:
    starts = np.arange(0.0, max(trace.duration_s - seconds, 0.0) + 1e-9, 0.5)
    counts = [np.searchsorted(trace.arrival_s, s + seconds) - np.searchsorted(trace.arrival_s, s)
              for s in starts]
    return trace.window(float(starts[int(np.argmax(counts))]), seconds)


def pick_spread(cascades: list, k: int) -> list:
    idx = np.unique(np.linspace(0, len(cascades) - 1, k).round().astype(int))
    return [cascades[i] for i in idx]


# -- (a) ----------------------------------------------------------------------------------------


def part_a(reporter: Reporter, num_cascades: int, num_ranges: int, devices: int,
           peak_qps: float, seed: int, score: str = "ratio") -> dict:
    profiles = bert_profiles(num_rows=2000, seed=seed)
    catalog = Catalog.from_profiles(profiles)
    front = pareto_cascades(profiles, grid_size=16, batch_size=1)
    cascades = [m.cascade for m in pick_spread(front, num_cascades)]
    hardware = v100_hardware(devices, per_node=devices)
    trace = busiest_window(azure_at_peak(peak_qps), 8.0)
    # the paper's adapter alone (no static plans added): what the exhaustive search is
    # compared with and what the README's timings measure
    settings = PlannerSettings(num_ranges=num_ranges, full_replication=True, max_batch=1,
                               screen=0, seed=seed, score=score, include_static=False)
    reporter.note(f"(a) {len(cascades)} cascades, |Q|={num_ranges}, {devices} devices, "
                  f"8 s trace with {len(trace)} requests (1-s peak {trace.qps_max():.0f} QPS)")

    t0 = time.perf_counter()
    frontier, stats = plan_frontier("bert", cascades, catalog, hardware, trace,
                                    settings=settings)
    ken_s = time.perf_counter() - t0
    ken_pts = frontier.points()

    ctx = planning_context("bert", cascades, catalog, hardware, trace, settings=settings)
    all_assignments = list(itertools.product(range(len(cascades)), repeat=num_ranges))
    t0 = time.perf_counter()
    exhaustive_pts = []
    with reporter.task("(a) exhaustive search", len(all_assignments)) as advance:
        for a in all_assignments:
            _, m = evaluate_plan(ctx, a, full_placement(ctx, a))
            exhaustive_pts.append((m.p95_ms, m.accuracy))
            advance(1)
    exhaustive_s = time.perf_counter() - t0

    rng = random.Random(seed)
    ctx_r = planning_context("bert", cascades, catalog, hardware, trace, settings=settings)
    random_pts = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2 * ken_s:
        a = tuple(rng.randrange(len(cascades)) for _ in range(num_ranges))
        _, m = evaluate_plan(ctx_r, a, full_placement(ctx_r, a))
        random_pts.append((m.p95_ms, m.accuracy))
    random_s = time.perf_counter() - t0

    everything = ken_pts + exhaustive_pts + random_pts
    ref = (max(p[0] for p in everything) * 1.05, min(p[1] for p in everything))
    named = (("ken", ken_pts), ("exhaustive", exhaustive_pts), ("random", random_pts))
    hv = {name: hypervolume(pts, ref) for name, pts in named}
    # the same on log10(latency): latencies span orders of magnitude, and a linear axis lets
    # the slowest plans dominate the area
    log_ref = (float(np.log10(ref[0])), ref[1])
    hv_log = {name: hypervolume([(float(np.log10(lat)), acc) for lat, acc in pts], log_ref)
              for name, pts in named}
    out = {
        "cascades": [c.describe() for c in cascades], "num_ranges": num_ranges,
        "devices": devices, "trace_requests": len(trace), "trace_peak_qps": trace.qps_max(),
        "ken": {"seconds": ken_s, "simulations": stats.simulations, "plans": len(ken_pts),
                "points": ken_pts},
        "exhaustive": {"seconds": exhaustive_s, "assignments": len(all_assignments),
                       "frontier": pareto(exhaustive_pts)},
        "random": {"seconds": random_s, "assignments": len(random_pts),
                   "frontier": pareto(random_pts)},
        "hypervolume": hv, "reference_point": ref,
        "hypervolume_ratio_ken": hv["ken"] / hv["exhaustive"],
        "hypervolume_ratio_random": hv["random"] / hv["exhaustive"],
        "hypervolume_log_latency": hv_log,
        "hypervolume_log_ratio_ken": hv_log["ken"] / hv_log["exhaustive"],
        "hypervolume_log_ratio_random": hv_log["random"] / hv_log["exhaustive"],
    }
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts, style in (("exhaustive (all)", exhaustive_pts, "."),):
        ax.scatter(*zip(*pts, strict=True), s=4, c="lightgray", label=name, marker=style)
    for name, pts, style in (("exhaustive frontier", pareto(exhaustive_pts), "k-"),
                             ("random (2x time)", pareto(random_pts), "b--"),
                             ("KEN", pareto(ken_pts), "ro-")):
        ax.plot(*zip(*pts, strict=True), style, label=name, markersize=4)
    ax.set_xscale("log")
    ax.set_xlabel("simulated p95 latency (ms)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"(a) restricted space, hypervolume vs exhaustive: KEN "
                 f"{out['hypervolume_ratio_ken']:.1%} (log-latency "
                 f"{out['hypervolume_log_ratio_ken']:.1%}), random 2x time "
                 f"{out['hypervolume_ratio_random']:.1%} "
                 f"({out['hypervolume_log_ratio_random']:.1%})", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "planner_restricted.png", dpi=120)
    plt.close(fig)
    reporter.note(f"(a) KEN {ken_s:.2f} s ({stats.simulations} simulations), exhaustive "
                  f"{exhaustive_s:.1f} s ({len(all_assignments)}), random {random_s:.2f} s "
                  f"({len(random_pts)}); hypervolume ratio KEN "
                  f"{out['hypervolume_ratio_ken']:.1%} (log latency "
                  f"{out['hypervolume_log_ratio_ken']:.1%}), random "
                  f"{out['hypervolume_ratio_random']:.1%} "
                  f"({out['hypervolume_log_ratio_random']:.1%})")
    return out


# -- (b) ----------------------------------------------------------------------------------------


def part_b(reporter: Reporter, grid: int, num_ranges: int, seed: int,
           settings_kw: dict) -> tuple[dict, GearPlan]:
    profiles = bert_profiles(num_rows=4000, seed=seed)
    catalog = Catalog.from_profiles(profiles)
    t0 = time.perf_counter()
    front = pareto_cascades(profiles, grid_size=grid, batch_size=1)
    cascade_s = time.perf_counter() - t0
    hardware = v100_hardware(16, per_node=8)
    trace = azure_at_peak(7600.0)
    settings = PlannerSettings(num_ranges=num_ranges, seed=seed, include_static=False,
                               **settings_kw)
    reporter.note(f"(b) {len(front)} candidate cascades, |Q|={num_ranges}, 16 V100s, "
                  f"trace {len(trace)} requests over {trace.duration_s:.0f} s, peak "
                  f"{trace.qps_max():.0f} QPS; settings {settings_kw}")
    t0 = time.perf_counter()
    frontier, stats = plan_frontier("bert", [m.cascade for m in front], catalog, hardware,
                                    trace, settings=settings, reporter=reporter)
    wall = time.perf_counter() - t0
    pts = frontier.points()
    out = {
        "candidate_cascades": len(front), "cascade_search_seconds": cascade_s,
        "num_ranges": num_ranges, "devices": 16, "trace_requests": len(trace),
        "trace_peak_qps": trace.qps_max(), "settings": settings_kw,
        "planning_seconds": wall, "stats": vars(stats), "frontier_plans": len(frontier),
        "frontier": [{"p95_ms": lat, "accuracy": acc, "gears": len(p.gears()),
                      "replicas": len(p.placement)}
                     for (lat, acc), p in zip(pts, frontier.plans, strict=True)],
        "single_model_accuracy": {m: p.accuracy for m, p in profiles.items()},
    }
    plot_frontier(frontier, RESULTS / "planner_full_frontier.png",
                  title=f"(b) V100 BERT frontier (synthetic accuracies): {len(frontier)} plans "
                        f"in {wall:.0f} s")
    reporter.note(f"(b) planned in {wall:.1f} s: {stats.iterations} iterations, "
                  f"{stats.simulations} simulations ({stats.simulate_s:.1f} s), "
                  f"{stats.lp_solves} LPs; {len(frontier)} plans on the frontier")
    return out, frontier.plans[-1]


# -- (c) ----------------------------------------------------------------------------------------


def part_c(reporter: Reporter, plan: GearPlan | None, seed: int) -> dict:
    profiles = bert_profiles(num_rows=4000, seed=seed)
    catalog = Catalog.from_profiles(profiles)
    one_hour = azure_at_peak(7600.0)
    copies = int(np.ceil(1200.0 / one_hour.duration_s))
    gap = one_hour.duration_s + float(np.diff(one_hour.arrival_s).mean())
    arrivals = np.concatenate([one_hour.arrival_s + i * gap for i in range(copies)])
    trace = Trace(arrivals[arrivals < 1200.0], "azure@7600qps-20min")
    if plan is None:  # a fixed plan: the most accurate cascade on every device
        front = pareto_cascades(profiles, grid_size=16, batch_size=1)
        ctx = planning_context("bert", [front[-1].cascade], catalog, v100_hardware(16, 8),
                               trace, settings=PlannerSettings(num_ranges=10))
        plan, _ = evaluate_plan(ctx, (0,) * 10, full_placement(ctx, (0,) * 10))
    t0 = time.perf_counter()
    result = simulate(plan, catalog, trace, seed)
    seconds = time.perf_counter() - t0
    m = result.metrics(0, plan)
    out = {"requests": len(trace), "simulated_seconds": trace.duration_s,
           "wall_seconds": seconds, "us_per_request": seconds / len(trace) * 1e6,
           "batches": result.batches, "p95_ms": m.p95_ms, "accuracy": m.accuracy,
           "gear_switches": m.gear_switches}
    reporter.note(f"(c) simulated {len(trace)} requests ({trace.duration_s / 60:.0f} min at a "
                  f"7,600 QPS peak) in {seconds:.1f} s = {out['us_per_request']:.1f} us/request")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("a", "b", "c", "all"), default="all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--a-cascades", type=int, default=4)
    ap.add_argument("--a-ranges", type=int, default=5)
    ap.add_argument("--a-devices", type=int, default=4)
    ap.add_argument("--a-peak", type=float, default=3000.0)
    ap.add_argument("--b-grid", type=int, default=48, help="thresholds per stage (~100 cascades)")
    ap.add_argument("--b-ranges", type=int, default=50)
    ap.add_argument("--b-screen", type=int, default=2)
    ap.add_argument("--b-scoring", choices=("estimate", "simulate"), default="estimate")
    ap.add_argument("--workers", type=int, default=2, help="simulation processes (default 2)")
    ap.add_argument("--b-step", type=float, default=0.003,
                    help="min_accuracy_step: thin candidate cascades to this accuracy step")
    ap.add_argument("--score", choices=("ratio", "tradeoff"), default="ratio",
                    help="the adapter's per-iteration choice in (a) (default: the paper's)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    reporter = Reporter(args.quiet)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_path = RESULTS / "planner.json"
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    plan = None
    if args.part in ("a", "all"):
        results["a_restricted"] = part_a(reporter, args.a_cascades, args.a_ranges,
                                         args.a_devices, args.a_peak, args.seed, args.score)
    if args.part in ("b", "all"):
        results["b_full"], plan = part_b(reporter, args.b_grid, args.b_ranges, args.seed,
                                         {"screen": args.b_screen,
                                          "placement_scoring": args.b_scoring,
                                          "workers": args.workers,
                                          "min_accuracy_step": args.b_step})
    if args.part in ("c", "all"):
        results["c_simulator"] = part_c(reporter, plan, args.seed)
    out_path.write_text(json.dumps(results, indent=1, default=float))
    reporter.note(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
