"""Does the simulator predict the engine near saturation? (issue 33, item 3)

Two plans placed by ken on the 2 worker processes (the cascade MiniLM-L3 -> L6 -> SmolLM2,
and MiniLM-L6 alone) serve 15-s windows of Poisson arrivals at 60%, 80%, 95% and 120% of the
rate each sustains in simulation, every window replayed ``--replays`` times (interleaved). Each
window is also simulated three ways:

- ``profiles``: every batch charged the profiled runtime of its size (what ken did before);
- ``sized``: scaled by the size of the batch's largest row (``Catalog.size_factors``): rows
  that escalate to a cascade's later stages are longer than the average profiled row;
- ``calibrated``: sized, plus the per-model, per-batch-size factors that ``ken plan`` now
  measures by default (``ken.engine.calibrate.measure_calibration``, 10 s of serving before the
  runs; the fit is not made on the windows it is judged on).

Writes ``saturation.json`` and ``saturation.png`` (p95 against the offered load) to ``--out``.

    python benchmarks/saturation.py               # about 10 minutes, models cached
    python benchmarks/saturation.py --replays 1   # about 4 minutes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ken.engine.calibrate import measure_calibration
from ken.engine.replay import replay_rounds
from ken.models import family
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig
from ken.optimizer.baselines import static_plans
from ken.optimizer.perf import Catalog
from ken.optimizer.planner import PlannerSettings, planning_context
from ken.optimizer.simulator import simulate
from ken.optimizer.workload import Hardware, poisson_trace
from ken.progress import Reporter

sys.path.insert(0, str(Path(__file__).parent))
from e2e import family_setup  # noqa: E402 - the e2e benchmark's setup

RESULTS = Path(__file__).parent / "results" / "saturation"
LOADS = (0.6, 0.8, 0.95, 1.2)
WINDOW_S = 15.0


def capacity(plan, catalog: Catalog) -> float:  # noqa: ANN001
    """Requests per second ``plan`` completes in simulation when far more are offered."""
    flood = poisson_trace(1000.0, 10.0, seed=3)
    sim = simulate(plan, catalog, flood)
    return len(flood) / float(sim.completion_s.max() - flood.arrival_s.min())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.replays < 1:
        raise SystemExit("--replays must be >= 1")
    reporter = Reporter()
    sample, models, loaders, profiles = family_setup(family.FamilyData("mixed", 6000, 1500),
                                                     DeviceConfig(threads=1), "process",
                                                     reporter)
    del models
    sized = Catalog.from_profiles(profiles)
    unsized = Catalog(sized.perf, dict(sized.quality), dict(sized.scores), sized.sample_hash)
    hardware = Hardware.cpu_workers(2, 4 * 10**9)
    calibration = measure_calibration(sized, loaders, sample, hardware, reporter=reporter,
                                      workers="process")
    reporter.note(f"calibration: {calibration.describe()} ({calibration.source})")
    calibrated = calibration.apply(sized)
    cascades = {"L3 -> L6 -> SmolLM2": Cascade(("minilm-l3", "minilm-l6", "smollm2-135m"),
                                               (0.757, 0.564)),
                "L6 alone": Cascade(("minilm-l6",))}
    out = {"calibration": {"fits": {m: list(f) for m, f in calibration.fits.items()},
                           "spread": {m: list(v) for m, v in calibration.spread.items()},
                           "source": calibration.source},
           "size_share": {m: p.size_share for m, p in sized.perf.items()},
           "window_s": WINDOW_S, "replays": args.replays, "plans": {}}
    for name, cascade in cascades.items():
        ctx = planning_context("sentiment", [cascade], sized, hardware,
                               poisson_trace(50.0, 30.0, seed=1),
                               settings=PlannerSettings(num_ranges=4))
        plan = static_plans(ctx)[0]
        cap = capacity(plan, sized)
        traces = [poisson_trace(f * cap, WINDOW_S, seed=11) for f in LOADS]
        rows = []
        for load, trace in zip(LOADS, traces, strict=True):
            reporter.note(f"{name}: {load:.0%} of {cap:.1f} qps, {len(trace)} requests")
            served = replay_rounds([plan], loaders, trace, sample, args.replays,
                                   reporter=reporter, workers="process",
                                   admission="max_in_flight")[0]
            measured = [s.replay.result.metrics(0, plan).p95_ms for s in served]
            sims = {k: simulate(plan, c, trace).metrics(0, plan).p95_ms
                    for k, c in (("profiles", unsized), ("sized", sized),
                                 ("calibrated", calibrated))}
            med = float(np.median(measured))
            row = {"load": load, "qps": load * cap, "requests": len(trace),
                   "measured_p95_ms": measured, "measured_median_ms": med,
                   "simulated_p95_ms": sims,
                   "error": {k: med / v - 1.0 for k, v in sims.items()},
                   "statuses": [s.replay.status_counts() for s in served]}
            rows.append(row)
            print(f"{name} at {load:.0%} ({load * cap:.1f} qps): measured p95 "
                  + " / ".join(f"{m:.0f}" for m in measured) + " ms; simulated "
                  + ", ".join(f"{k} {v:.0f} ({row['error'][k]:+.0%})" for k, v in sims.items()),
                  flush=True)
        out["plans"][name] = {"capacity_qps": cap, "plan": plan.describe(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "saturation.json").write_text(json.dumps(out, indent=1))
    plot(out, args.out / "saturation.png")
    print(f"wrote {args.out}/saturation.json and saturation.png")
    return 0


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(out["plans"]), figsize=(5 * len(out["plans"]), 4))
    for ax, (name, res) in zip(np.atleast_1d(axes), out["plans"].items(), strict=True):
        loads = [r["load"] for r in res["rows"]]
        for r in res["rows"]:
            ax.scatter([r["load"]] * len(r["measured_p95_ms"]), r["measured_p95_ms"],
                       color="black", s=12)
        ax.plot(loads, [r["measured_median_ms"] for r in res["rows"]], color="black",
                label="measured (median of replays)")
        for k, style in (("profiles", ":"), ("sized", "--"), ("calibrated", "-")):
            ax.plot(loads, [r["simulated_p95_ms"][k] for r in res["rows"]], style,
                    label=f"simulated: {k}")
        ax.set_yscale("log")
        ax.set_xlabel("offered load / simulated capacity")
        ax.set_ylabel("p95 latency (ms)")
        ax.set_title(f"{name} ({res['capacity_qps']:.0f} qps)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
