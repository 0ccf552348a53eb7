"""Where a request's time goes in the engine, against what the simulator charges (issue 33,
item 3).

The soak's two plans (``benchmarks/soak.py``: the packaged family planned on its profiles for
2 CPU workers; the fastest plan of the frontier, MiniLM-L3 alone, and the middle one, a
MiniLM-L3 -> MiniLM-L6 cascade) serve ``--seconds`` of Poisson arrivals at each ``--rates``,
``--replays`` times each, interleaved, every request admitted. Each answered request's latency
is split (``ken.engine.request_path``) into the scheduler admitting it, its queue waits, the
hand-offs of its batches to their devices' threads, its model calls, and the reports of their
answers back to the scheduler. Per rate, the runtimes are calibrated first as ``ken plan``
does (``calibration_calls`` at that rate: the cascade 10 s, each model alone at the rate 5 s),
and fitted in two forms on the same calls: on the time each batch held its device (hand-off,
call and report; what the calibration fits since session 37) and on the calls alone (before).
Each replay is simulated on both, on the same arrivals and rows (three simulator seeds,
median), and the simulated p95 is set against the measured. And in hindsight, a diagnosis
rather than a prediction: each replay simulated on the held form with every model moved to
the level its own batches ran at in that replay (``at_own_level``: the mean ratio of its
batches' held time to the charge), which separates what the calibration's level missed (the
machine ran faster or slower than a minute before) from what the simulator's structure
misses (queues, batching, escalation).

Writes DIR/request_path.json and DIR/request_path.png (median parts per plan and rate).

    python benchmarks/request_path.py --out DIR      # about 8 minutes with cached models
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak import family_calibration_calls, plans_to_serve, soak_setup  # noqa: E402

from ken.engine.calibrate import (  # noqa: E402
    CalibrationCalls,
    at_levels,
    fit_calibration,
    model_levels,
    recent_ratio,
)
from ken.engine.replay import serve_trace  # noqa: E402
from ken.engine.supervision import BatchRecord  # noqa: E402
from ken.optimizer.perf import Catalog  # noqa: E402
from ken.optimizer.simulator import simulate  # noqa: E402
from ken.optimizer.workload import Trace, poisson_trace  # noqa: E402
from ken.policy.plan import GearPlan  # noqa: E402
from ken.progress import Reporter  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "request_path"
PARTS = ("admit", "wait", "handoff", "call", "report")
#: the two calibration forms, fitted on the same calls
FORMS = ("held", "calls_only")


def calls_only(log: tuple[BatchRecord, ...]) -> tuple[BatchRecord, ...]:
    """The calls as the calibration saw them before session 37: the call alone."""
    return tuple(replace(r, handoff_s=0.0, report_s=0.0) for r in log)


def sim_p95(plan: GearPlan, catalog: Catalog, trace: Trace) -> float:
    """The simulated p95 (ms) of ``plan`` on ``trace``: the median over three seeds."""
    return float(np.median([simulate(plan, catalog, trace, seed=s).metrics(0, plan).p95_ms
                            for s in range(3)]))


def both_forms(calls: CalibrationCalls) -> dict:
    """The calibration at the rate fitted on the batches' held times, and on the calls
    alone, from the same calls."""
    before = CalibrationCalls(
        fit_calibration(calls_only(calls.cascade_calls), calls.catalog,
                        calls.cascade.source + " (calls alone)"),
        {m: calls_only(log) for m, log in calls.at_rate.items()}, calls.served,
        calls.catalog, calls_only(calls.cascade_calls))
    return {"held": calls.moved(), "calls_only": before.moved()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[31.6, 60.0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.replays < 1 or args.seconds <= 0 or any(r <= 0 for r in args.rates):
        ap.error("--replays >= 1, --seconds > 0 and every rate > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    reporter = Reporter()
    started = time.perf_counter()
    setup = soak_setup(reporter)
    to_serve = plans_to_serve(reporter, args.seed, setup=setup)
    plans = {"fast": to_serve.fast, "main": to_serve.main}
    out: dict = {"plans": {k: p.describe() for k, p in plans.items()}, "rates": {}}
    for rate in args.rates:
        calls = family_calibration_calls(reporter, args.seed, 10.0, rate=rate, setup=setup)
        forms = both_forms(calls)
        cats = {k: c.apply(to_serve.profiles) for k, c in forms.items()}
        trace = poisson_trace(rate, args.seconds, seed=args.seed + 1)
        sims = {k: {name: sim_p95(p, cat, trace) for name, p in plans.items()}
                for k, cat in cats.items()}
        entry: dict = {"calibration": {k: c.describe() for k, c in forms.items()},
                       "simulated_p95_ms": sims, "replays": {name: [] for name in plans}}
        for r in range(args.replays):
            for name, plan in plans.items():
                reporter.note(f"{rate:g} qps, replay {r + 1}/{args.replays}, {name} plan")
                served = serve_trace(plan, to_serve.loaders, trace, to_serve.sample,
                                     reporter=reporter, admission="max_in_flight")
                assert served.paths is not None
                p95 = served.replay.result.metrics(0, plan).p95_ms
                level = model_levels(served.batch_log, cats["held"])
                hindsight = sim_p95(plan, at_levels(cats["held"], level), trace)
                entry["replays"][name].append({
                    "measured_p95_ms": p95,
                    "error": {k: p95 / sims[k][name] - 1.0 for k in FORMS},
                    "own_level": level, "simulated_p95_ms_at_own_level": hindsight,
                    "error_at_own_level": p95 / hindsight - 1.0,
                    # how long the batches held their devices against each form's charge
                    "held_x_charge": {k: recent_ratio(served.batch_log, cat, -np.inf)[0]
                                      for k, cat in cats.items()},
                    "paths": served.paths.to_dict()})
        out["rates"][f"{rate:g}"] = entry
        for name in plans:
            reps = entry["replays"][name]
            reporter.note(
                f"{rate:g} qps {name}: measured p95 "
                + ", ".join(f"{x['measured_p95_ms']:.1f}" for x in reps) + " ms; simulated "
                + ", ".join(f"{k} {sims[k][name]:.1f}" for k in FORMS) + "; at each replay's "
                "own level " + ", ".join(f"{x['simulated_p95_ms_at_own_level']:.1f}"
                                         for x in reps) + "; host per request "
                + ", ".join(f"{x['paths']['median_ms']['host']:.2f}/"
                            f"{x['paths']['p95_ms']['host']:.2f}" for x in reps) + " ms p50/p95")
    out["wall_s"] = time.perf_counter() - started
    (args.out / "request_path.json").write_text(json.dumps(out, indent=1))
    plot(out, args.out / "request_path.png")
    reporter.note(f"wrote {args.out}/request_path.json and request_path.png in "
                  f"{out['wall_s'] / 60:.1f} min")
    return 0


def plot(out: dict, path: Path) -> None:
    """Median of each part per plan and rate (first replay's summary, stacked), and the
    simulated p95 on both forms against the measured replays."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    labels, x = [], 0
    for rate, entry in out["rates"].items():
        for name, reps in entry["replays"].items():
            bottom = 0.0
            for k, part in enumerate(PARTS):
                v = float(np.median([r["paths"]["median_ms"][part] for r in reps]))
                ax.bar(x, v, bottom=bottom, color=f"C{k}", label=part if x == 0 else None)
                bottom += v
            measured = [r["measured_p95_ms"] for r in reps]
            bx.plot([x] * len(measured), measured, "k.", label="measured" if x == 0 else None)
            bx.plot([x - 0.15] * len(reps), [r["simulated_p95_ms_at_own_level"] for r in reps],
                    "x", color="C9", label="at each replay's own level" if x == 0 else None)
            for k, form in enumerate(FORMS):
                bx.plot([x + 0.15 * (k + 1)], [entry["simulated_p95_ms"][form][name]],
                        "^v"[k], color=f"C{k + 5}", label=form if x == 0 else None)
            labels.append(f"{name}\n{rate} qps")
            x += 1
    for a in (ax, bx):
        a.set_xticks(range(len(labels)), labels, fontsize=7)
        a.legend(fontsize=6)
    ax.set_ylabel("median ms per request")
    ax.set_title("a request's latency in parts (median of replays)", fontsize=8)
    bx.set_ylabel("p95 ms")
    bx.set_title("p95: measured replays, simulated on each calibration form\n"
                 "and in hindsight at each replay's own level", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
