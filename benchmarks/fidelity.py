"""Simulator fidelity (issue 5): replay gear plans through the online engine with the real
packaged models and compare measured with simulated latency and accuracy.

Plans come from the same frontier `ken plan` builds (2 CPU workers x 1 thread, the Azure code
trace rate-scaled to 1.5x what the most accurate cascade sustains, |Q| = 8). Three plans are
replayed: the fastest, one from the middle, and the most accurate one whose simulated p95 is
under a second. The replay trace is the planning trace itself (open loop, real time), and
request i is held-out sample row ``sample_rows(...)[i]`` in both the replay and the simulation.

Before that, each plan serves ``--calibration-s`` of Poisson arrivals at the trace's mean rate
(another arrival process and seed): the engine's model calls, measured against the profiles,
give each model's runtime distribution under that plan (``ken.engine.calibrate``). Every plan
is simulated twice, with the profiles' runtimes and with the calibrated ones, and the trace is
replayed twice: the second replay measures the run-to-run noise of the machine.
Writes benchmarks/results/fidelity.json and fidelity_<k>.png (latency over time).

    python benchmarks/fidelity.py            # ~12 minutes with cached models and profiles
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

from ken.engine.calibrate import calibrated, runtime_ratios, runtime_spread
from ken.engine.replay import plot_replay, serve_trace
from ken.models import family
from ken.models.model import DeviceConfig
from ken.optimizer.cascades import pareto_cascades
from ken.optimizer.perf import Catalog
from ken.optimizer.planner import PlannerSettings, plan_frontier
from ken.optimizer.planning import default_peak_qps, planning_trace
from ken.optimizer.profile import DEFAULT_BATCH_SIZES, load_or_run_profile
from ken.optimizer.simulator import simulate
from ken.optimizer.workload import Hardware, Trace, poisson_trace
from ken.policy.plan import GearPlan
from ken.progress import Reporter

RESULTS = Path(__file__).parent / "results"


def serving_runtimes(log: list, catalog: Catalog) -> dict[str, dict]:
    """Per model: how the engine's model calls compare with the profile's batch runtimes
    (ratio measured / profile per call), after an idle device and back to back."""
    out = {}
    for model, pairs in sorted(runtime_ratios(log, catalog).items()):
        calls = [r for r, _ in pairs]
        ratios = np.array([x for _, x in pairs])
        perf = catalog.perf[model]
        ones = [r.seconds for r in calls if r.rows == 1]
        idle = np.array([r.idle_before_s for r in calls])
        out[model] = {
            "calls": len(calls), "mean_rows": float(np.mean([r.rows for r in calls])),
            "ratio_median": float(np.median(ratios)),
            "ratio_p95": float(np.percentile(ratios, 95)),
            "ratio_median_after_idle_10ms": float(np.median(ratios[idle >= 0.01]))
            if (idle >= 0.01).any() else None,
            "ratio_median_back_to_back": float(np.median(ratios[idle < 0.001]))
            if (idle < 0.001).any() else None,
            "batch1_ms_measured": 1000 * float(np.median(ones)) if ones else None,
            "batch1_ms_profile": 1000 * perf.batch_runtime(1),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=90.0, help="trace window (s)")
    ap.add_argument("--ranges", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--workers", choices=("process", "thread"), default="process")
    ap.add_argument("--calibration-s", type=float, default=30.0,
                    help="seconds of Poisson arrivals per plan to calibrate runtimes on")
    args = ap.parse_args()
    reporter = Reporter(args.quiet)
    RESULTS.mkdir(parents=True, exist_ok=True)

    data = family.default_data()
    device = DeviceConfig(threads=1)
    cards = family.prepare(data, device, reporter=reporter)
    sample = family.heldout_sample(data)
    models = {c.name: family.load_model(c, device, data=data) for c in cards}
    loaders = ({c.name: functools.partial(family.load_model, c, device, None, data)
                for c in cards} if args.workers == "process" else models)
    profiles = {n: load_or_run_profile(m, sample, DEFAULT_BATCH_SIZES) for n, m in models.items()}
    catalog = Catalog.from_profiles(profiles)
    cascades = [m.cascade for m in pareto_cascades(profiles)]
    peak = default_peak_qps(catalog, cascades, 2)
    trace = planning_trace("azure", peak, args.duration, seed=args.seed)
    hardware = Hardware.cpu_workers(2, 4 * 10**9)
    reporter.note(f"trace: {len(trace)} requests over {trace.duration_s:.0f} s, 1-s peak "
                  f"{trace.qps_max():.0f} qps")
    frontier, _ = plan_frontier("sentiment", cascades, catalog, hardware, trace,
                                settings=PlannerSettings(num_ranges=args.ranges,
                                                         seed=args.seed),
                                reporter=reporter)
    usable = [p for p in frontier.plans if p.predicted.p95_ms < 1000.0]
    picks = {"fastest": usable[0], "middle": usable[len(usable) // 2],
             "most accurate (p95 < 1 s)": usable[-1]}

    # calibration: each plan on Poisson arrivals (another arrival process and seed, the same
    # mean rate) to measure its serving runtimes against the profiles
    calibration_trace = poisson_trace(len(trace) / trace.duration_s, args.calibration_s,
                                      seed=args.seed + 1)

    def serve(plan: GearPlan, on: Trace, seed: int) -> tuple:
        served = serve_trace(plan, loaders, on, sample, seed=seed,
                             reporter=reporter, workers=args.workers)
        return served.replay, list(served.batch_log), served.load

    rows = []
    for k, (name, plan) in enumerate(picks.items()):
        simulated = simulate(plan, catalog, trace, args.seed).metrics(0, plan)
        _, calibration_log, _ = serve(plan, calibration_trace, args.seed + 1)
        spreads = runtime_spread(calibration_log, catalog)
        calibrated_sim = simulate(plan, calibrated(catalog, spreads), trace,
                                  args.seed).metrics(0, plan)
        t0 = time.perf_counter()
        rep, log, load = serve(plan, trace, args.seed)
        wall = time.perf_counter() - t0
        measured = rep.result.metrics(0, plan)
        served = serving_runtimes(log, catalog)
        again = serve(plan, trace, args.seed)[0].result.metrics(0, plan)  # the noise floor
        plot_replay(rep, plan, RESULTS / f"fidelity_{k}.png", title=f"{name}: measured")
        row = {
            "plan": name, "gears": [plan.cascades[c].describe() for _, _, c in plan.gears()],
            "placement": [r.label() for r in plan.placement],
            "simulated": simulated.to_dict(), "measured": measured.to_dict(),
            "p50_error": measured.p50_ms / simulated.p50_ms - 1,
            "p95_error": measured.p95_ms / simulated.p95_ms - 1,
            "serving_runtimes": served,
            "calibrated_simulation": calibrated_sim.to_dict(),
            "calibrated_p50_error": measured.p50_ms / calibrated_sim.p50_ms - 1,
            "calibrated_p95_error": measured.p95_ms / calibrated_sim.p95_ms - 1,
            "calibration_median_factor": {m: v[len(v) // 2] for m, v in spreads.items()},
            "repeat": again.to_dict(),
            "repeat_p50_difference": again.p50_ms / measured.p50_ms - 1,
            "repeat_p95_difference": again.p95_ms / measured.p95_ms - 1,
            "accuracy_diff_points": 100 * (measured.accuracy - simulated.accuracy),
            "status": rep.status_counts(), "max_send_lag_s": rep.max_send_lag_s,
            "load_s": load.total_s, "replay_wall_s": wall, "workers": args.workers,
        }
        rows.append(row)
        reporter.note(f"{name}: p50 {simulated.p50_ms:.1f} -> {measured.p50_ms:.1f} ms, p95 "
                      f"{simulated.p95_ms:.1f} -> {measured.p95_ms:.1f} ms "
                      f"({row['p95_error']:+.1%}), accuracy {simulated.accuracy:.1%} -> "
                      f"{measured.accuracy:.1%}, gear switches {simulated.gear_switches} -> "
                      f"{measured.gear_switches}")
        reporter.note("  model calls while serving vs profile: " + ", ".join(
            f"{m}: x{v['ratio_median']:.2f} ({v['calls']} calls, batch-1 "
            f"{v['batch1_ms_measured'] or float('nan'):.1f} vs {v['batch1_ms_profile']:.1f} ms)"
            for m, v in served.items()))
        reporter.note(f"  the same replay again: p50 {again.p50_ms:.1f}, p95 {again.p95_ms:.1f} "
                      f"ms ({row['repeat_p95_difference']:+.1%} against the first)")
        reporter.note(f"  simulated with calibrated runtimes: p50 {calibrated_sim.p50_ms:.1f}, "
                      f"p95 {calibrated_sim.p95_ms:.1f} ms ({row['calibrated_p95_error']:+.1%})")
    out = {"calibration": {"trace": calibration_trace.name,
                           "requests_per_plan": len(calibration_trace)},
           "trace_requests": len(trace), "trace_peak_qps": trace.qps_max(),
           "duration_s": trace.duration_s, "plans": rows}
    (RESULTS / "fidelity.json").write_text(json.dumps(out, indent=1, default=float))
    reporter.note(f"wrote {RESULTS / 'fidelity.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
