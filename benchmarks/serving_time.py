"""Where serving time goes (issue 33, item 3): a few plans served by the engine on one Gamma
window, against their simulations with the profiles' runtimes, with the runtime spread
calibration in use (``ken.engine.calibrate``) and with an affine fit per model (a call takes
``a + b x`` its profiled runtime; residual spread kept); and the host process's CPU per request.

Plans: MiniLM-L3 alone, MiniLM-L6 alone and L3 -> L6 -> SmolLM2, each placed by ken's search,
and L6 with dynamic batching tuned on the window; 2 worker processes x 1 thread. Prints one
block per plan and writes benchmarks/results/serving_time/serving_time.json.

    python benchmarks/serving_time.py --rate 60     # about 4 minutes, models cached
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ken.engine.calibrate import calibrated, runtime_spread
from ken.engine.replay import serve_trace
from ken.models import family
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig
from ken.optimizer.baselines import static_plans, tune_dynamic_batching
from ken.optimizer.perf import Catalog, ModelPerf
from ken.optimizer.planner import PlannerSettings, planning_context
from ken.optimizer.simulator import simulate
from ken.optimizer.workload import Hardware, gamma_trace
from ken.progress import Reporter

sys.path.insert(0, str(Path(__file__).parent))
from e2e import family_setup  # noqa: E402 - the e2e benchmark's setup

RESULTS = Path(__file__).parent / "results" / "serving_time"


def affine(catalog: Catalog, log) -> tuple[Catalog, dict]:  # noqa: ANN001
    """``catalog`` with each model's runtimes replaced by ``a + b x`` the profiled ones, fitted
    on the engine's calls of it (least squares), and the residual ratios as its spread."""
    perf, fits = dict(catalog.perf), {}
    qs = (np.arange(101) + 0.5) * 100 / 101
    for m, p in catalog.perf.items():
        calls = [r for r in log if r.model == m and not r.bulk]
        if len(calls) < 20:
            continue
        x = np.array([p.batch_runtime(r.rows) for r in calls])
        y = np.array([r.held_s for r in calls])  # what the device was held for, as calibrated
        b, a = np.polyfit(x, y, 1)
        a, b = max(a, 0.0), max(b, 0.1)
        table = tuple(tuple(a + b * t for t in row) for row in p.runtime_s)
        perf[m] = ModelPerf(m, p.batch_sizes, table, p.memory_bytes, p.degrees,
                            tuple(np.percentile(y / (a + b * x), qs)))
        fits[m] = {"a_ms": 1000 * a, "b": b, "calls": len(calls)}
    return catalog.with_perf(perf, dict(catalog.gpu_perf)), fits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=60.0, help="mean arrival rate (qps)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    reporter = Reporter()
    device = DeviceConfig(threads=1)
    sample, models, loaders, profiles = family_setup(family.FamilyData("mixed", 6000, 1500),
                                                     device, "process", reporter)
    del models
    catalog = Catalog.from_profiles(profiles)
    hardware = Hardware.cpu_workers(2, 4 * 10**9)
    trace = gamma_trace(args.rate, args.seconds, 3.0, seed=7)
    top = Cascade(("minilm-l3", "minilm-l6", "smollm2-135m"), (0.757, 0.564))
    plans = {}
    for name, cascade in (("L3 alone", Cascade(("minilm-l3",))),
                          ("L6 alone", Cascade(("minilm-l6",))), ("L3 -> L6 -> SmolLM2", top)):
        ctx = planning_context("sentiment", [cascade], catalog, hardware, trace,
                               settings=PlannerSettings(num_ranges=4))
        plans[name] = static_plans(ctx)[0]
    plans["L6, dynamic batching"] = tune_dynamic_batching("sentiment", "minilm-l6", catalog,
                                                          hardware, trace).plan
    out = {"trace": {"requests": len(trace), "peak_qps": trace.qps_max(), "rate": args.rate},
           "plans": {}}
    for name, plan in plans.items():
        served = serve_trace(plan, loaders, trace, sample, workers="process")
        rep = served.replay
        lat_meas = (rep.result.completion_s - rep.result.arrival_s) * 1000
        profile_sim = simulate(plan, catalog, trace)
        lat_sim = (profile_sim.completion_s - profile_sim.arrival_s) * 1000
        fitted, fits = affine(catalog, served.batch_log)
        row = {"measured": rep.result.metrics(0, plan).to_dict(),
               "simulated_profile": profile_sim.metrics(0, plan).to_dict(),
               "simulated_spread": simulate(plan, calibrated(catalog, runtime_spread(
                   served.batch_log, catalog)), trace).metrics(0, plan).to_dict(),
               "simulated_affine": simulate(plan, fitted, trace).metrics(0, plan).to_dict(),
               "affine_fits": fits,
               "per_request_measured_minus_simulated_ms": float(np.median(lat_meas - lat_sim)),
               "host_cores": rep.host_cpu_s / trace.duration_s,
               "host_ms_per_request": 1000 * rep.host_cpu_s / len(trace)}
        out["plans"][name] = row
        print(f"{name}: p50 / p95 ms measured {row['measured']['p50_ms']:.1f} / "
              f"{row['measured']['p95_ms']:.1f}; simulated: profiles "
              f"{row['simulated_profile']['p95_ms']:.1f}, spread "
              f"{row['simulated_spread']['p95_ms']:.1f}, affine "
              f"{row['simulated_affine']['p95_ms']:.1f} (p95); host "
              f"{row['host_ms_per_request']:.2f} ms CPU per request; fits "
              + ", ".join(f"{m} a {f['a_ms']:.2f} ms b {f['b']:.3f}" for m, f in fits.items()),
              flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving_time.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}/serving_time.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
