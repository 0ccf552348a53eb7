"""The calls' own spread (issue 33, item 3): does drawing each call's residual spread
(``Calibration.spread``) bring the simulated tail of a plan nearer the engine's?

The soak's two plans as sessions 32-33 served them (``benchmarks/soak.py`` with
``--calibration-s 0``: the packaged family planned on its profiles for 2 CPU workers on Poisson
arrivals; the fastest plan of the frontier and the middle one) serve ``--seconds`` of Poisson
arrivals at ``--rate`` on worker processes, ``--replays`` times each, interleaved, every
request admitted (``admission="max_in_flight"``, as the simulator serves them). Before that the
runtimes are calibrated as ``ken plan`` does by default (every model of the cascades served for
``--calibration-s``). Each plan is simulated on the same arrivals and rows with the profiles'
runtimes, with the calibration's factors alone (every call charged its mean, as before session
34) and with the factors and the spread, over three simulator seeds; and on a second
calibration made at ``--rate`` (``measure_calibration(rate=...)``, as `ken plan` calibrates
since session 35: after the cascade, each model alone at that rate for half as long again,
and each model fitted on its calls there; session 35 served the cheapest model alone and moved
every model to the level its calls ran at). The serving calls are also
compared with the calibrated charge: their mean ratio (how far the calibration's level is from
serving) and what is left after it (the spread serving shows against the one the calibration
fitted), split by whether the other worker was computing at the same time. Then each replay is
compared with simulations on runtimes fitted on serving calls, out of sample (``served_fits``):
the same plan's other replays, and the other plan's replays (what `ken replay` writes as
calibration.json, for `ken plan --calibration`).

Writes DIR/call_spread.json and DIR/call_spread.png (latency CDFs per plan).

    python benchmarks/call_spread.py --out DIR      # about 9 minutes with cached models
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak import family_calibration_calls, plans_to_serve  # noqa: E402 - the soak's plans

from ken.engine.calibrate import (  # noqa: E402
    Calibration,
    cheapest_only,
    fit_calibration,
    predicted_s,
)
from ken.engine.replay import serve_trace  # noqa: E402
from ken.engine.supervision import BatchRecord  # noqa: E402
from ken.optimizer.perf import Catalog, woke  # noqa: E402
from ken.optimizer.simulator import sample_rows, simulate_many  # noqa: E402
from ken.optimizer.workload import Trace, poisson_trace  # noqa: E402
from ken.policy.plan import GearPlan  # noqa: E402
from ken.progress import Reporter  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "call_spread"
QUANTILES = (50, 95, 99)


#: session 35's calibration at the serving rate: the cheapest model's calls there moved every model
AT_CHEAPEST = "at the serving rate, the cheapest model's shift"


def percentiles(ms: np.ndarray) -> dict[str, float]:
    return {f"p{q}_ms": float(np.percentile(ms, q)) for q in QUANTILES}


def serving_calls(log: list[BatchRecord], catalog: Catalog) -> dict[str, dict]:
    """Per model: the online calls' ratio to the calibrated charge (``predicted_s`` on the
    calibrated catalog, wake-up included; the time each held its device, ``held_s``, as the
    calibration fits it): mean and quantiles, and the ratio's median for
    calls that overlapped the other workers' calls by under 1% and by half or more."""
    calls = [r for r in log if not r.bulk]
    out = {}
    for model in sorted({r.model for r in calls}):
        own = [r for r in calls if r.model == model]
        ratio = np.array([r.held_s / predicted_s(r, catalog) for r in own])
        overlap = np.array([sum(max(0.0, min(r.end_s, o.end_s) - max(r.start_s, o.start_s))
                                for o in calls if o.device != r.device) / r.seconds
                            for r in own])
        rest = ratio / ratio.mean()
        out[model] = {
            "calls": len(own), "mean_ratio": float(ratio.mean()),
            "residual_p95": float(np.percentile(rest, 95)),
            "residual_p99": float(np.percentile(rest, 99)),
            "alone_median_ratio": float(np.median(ratio[overlap < 0.01]))
            if (overlap < 0.01).any() else None,
            "overlapped_median_ratio": float(np.median(ratio[overlap >= 0.5]))
            if (overlap >= 0.5).any() else None,
            "after_idle_share": float(np.mean([woke(r.idle_before_s) for r in own]))}
    return out


def run(args: argparse.Namespace, reporter: Reporter) -> dict:
    # the plans of sessions 32-33 (on the profiles), and the calibration `ken plan` makes
    main, fast, used, sample, calibration, catalog = plans_to_serve(
        reporter, args.seed, args.calibration_s, plan_calibrated=False)
    # the calibration at the serving rate (``measure_calibration(rate=...)``): each model
    # fitted on its own calls there, and (session 35's form) every model moved by the
    # cheapest one's calls, on the same calls
    at_calls = family_calibration_calls(reporter, args.seed, args.calibration_s, args.rate)
    at_rate = at_calls.moved(reporter=reporter)
    at_cheapest = cheapest_only(at_calls)
    reporter.note(f"runtimes calibrated at the serving rate: {at_rate.describe()}")
    spread = calibration.apply(catalog)
    level = catalog.with_perf({m: replace(p, spread=()) for m, p in spread.perf.items()})
    catalogs = {"profiles": catalog, "calibrated, no spread": level,
                "calibrated with spread": spread,
                "calibrated at the serving rate": at_rate.apply(catalog),
                AT_CHEAPEST: at_cheapest.apply(catalog)}
    trace = poisson_trace(args.rate, args.seconds, seed=args.seed + 5)
    plans = {"fast": fast, "main": main}
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()},
                 "calibration": calibration.describe(), "requests": len(trace),
                 "calibration_at_rate": f"{at_rate.describe()} ({at_rate.source})",
                 "calibration_at_rate_cheapest":
                     f"{at_cheapest.describe()} ({at_cheapest.source})",
                 "calibration_spread": {m: {"p95": float(np.percentile(v, 95)),
                                            "p99": float(np.percentile(v, 99))}
                                        for m, v in calibration.spread.items()},
                 "plans": {}}
    # the replays' sample rows (``replay``'s ``sample_rows``), so the simulator's seeds vary
    # only its spread draws
    rows = sample_rows(len(trace), catalog.num_rows, args.seed)
    routes = [(0,)] * catalog.num_rows
    for name, plan in plans.items():
        entry: dict = {"plan": plan.headline(), "simulated": {}, "replays": [], "calls": []}
        for label, cat in catalogs.items():
            runs = [percentiles(1000 * simulate_many([plan], [cat], trace, seed=s, rows=rows,
                                                     routes=routes).latency_s)
                    for s in range(3)]
            entry["simulated"][label] = {k: float(np.median([r[k] for r in runs]))
                                         for k in runs[0]}
        out["plans"][name] = entry
    logs: dict[str, list[list[BatchRecord]]] = {name: [] for name in plans}
    for r in range(args.replays):
        for name, plan in plans.items():
            reporter.note(f"replay {r + 1}/{args.replays} of the {name} plan")
            # every request admitted, as the simulator serves them (the default admission
            # turns away what would miss the plan's target, and the tail with it)
            served = serve_trace(plan, used, trace, sample, seed=args.seed, reporter=reporter,
                                 workers="process", admission="max_in_flight")
            outcomes = served.replay.outcomes
            ms = np.array([1000 * o.latency_s for o in outcomes if o.status == "ok"])
            entry = out["plans"][name]
            entry["replays"].append({**percentiles(ms), "answered": int(ms.size),
                                     "turned_away": sum(o.status == "rejected"
                                                        for o in outcomes),
                                     "latency_ms": ms.tolist()})
            entry["calls"].append(serving_calls(list(served.batch_log), spread))
            logs[name].append(list(served.batch_log))
    if args.replays > 1:
        served_fits(out, plans, logs, calibration, catalog, trace, rows, routes)
    for entry in out["plans"].values():
        measured = {k: float(np.median([r[k] for r in entry["replays"]]))
                    for k in ("p50_ms", "p95_ms", "p99_ms")}
        entry["measured_median"] = measured
        entry["error"] = {label: {k: sim[k] / measured[k] - 1 for k in measured}
                          for label, sim in entry["simulated"].items()}
    return out


def served_fits(out: dict, plans: dict, logs: dict[str, list[list[BatchRecord]]],
                calibration: Calibration, catalog: Catalog, trace: Trace,
                rows: np.ndarray, routes: list) -> None:
    """Each replay against simulations on runtimes fitted on *serving* calls, out of sample:
    the same plan's other replays (another minute of the same load), and every replay of the
    other plan (a plan the fit never saw served: what a planner needs); the calibration's
    fits kept for the models those calls did not run (``Calibration.updated``). Beside them,
    the same replay against the calibrations' simulations (``ken plan``'s, and the one at the
    serving rate), so every error is per replay."""
    def simulated(plan: GearPlan, fit: Calibration) -> dict[str, float]:
        sims = [percentiles(1000 * simulate_many([plan], [fit.apply(catalog)], trace, seed=s,
                                                 rows=rows, routes=routes).latency_s)
                for s in range(3)]
        return {k: float(np.median([x[k] for x in sims])) for k in sims[0]}

    for name, plan in plans.items():
        entry = out["plans"][name]
        # the same for every replay: the calibrations' simulations (made in ``run``, on the
        # same arrivals, rows and seeds) and the fit on the other plan's calls
        other = calibration.updated(fit_calibration(
            [x for n, ls in logs.items() if n != name for log in ls for x in log], catalog,
            "served: the other plan"))
        fixed = {"calibrated with spread": entry["simulated"]["calibrated with spread"],
                 "calibrated at the serving rate":
                     entry["simulated"]["calibrated at the serving rate"],
                 AT_CHEAPEST: entry["simulated"][AT_CHEAPEST],
                 "served: the other plan": simulated(plan, other)}
        fits: dict[str, list] = {"served: same plan, other replays": [],
                                 "served: the other plan": []}
        per_replay = []
        for r, measured in enumerate(entry["replays"]):
            same = calibration.updated(fit_calibration(
                [x for k, log in enumerate(logs[name]) if k != r for x in log], catalog,
                "served: same plan, other replays"))
            fits["served: same plan, other replays"].append(same.describe())
            fits["served: the other plan"].append(other.describe())
            sims = {**fixed, "served: same plan, other replays": simulated(plan, same)}
            per_replay.append({label: {"simulated": sims[label], "error": {
                k: sims[label][k] / measured[k] - 1 for k in ("p50_ms", "p95_ms", "p99_ms")}}
                for label in ("calibrated with spread", "calibrated at the serving rate",
                              AT_CHEAPEST, "served: same plan, other replays",
                              "served: the other plan")})
        entry["per_replay"] = per_replay
        entry["served_fits"] = fits
        entry["per_replay_abs_error_median"] = {
            label: {k: float(np.median([abs(e[label]["error"][k]) for e in per_replay]))
                    for k in ("p50_ms", "p95_ms", "p99_ms")}
            for label in per_replay[0]}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["plans"]), figsize=(6 * len(result["plans"]), 4))
    for ax, (name, entry) in zip(np.atleast_1d(axes), result["plans"].items(), strict=True):
        for k, rep in enumerate(entry["replays"]):
            ms = np.sort(rep["latency_ms"])
            ax.plot(ms, np.arange(1, ms.size + 1) / ms.size, color="black", alpha=0.6,
                    label="measured" if k == 0 else None)
        for label, sim in entry["simulated"].items():
            ax.scatter([sim[f"p{q}_ms"] for q in QUANTILES], [q / 100 for q in QUANTILES],
                       label=f"simulated: {label}", marker="x")
        ax.set_title(f"{name}: {entry['plan']}", fontsize=9)
        ax.set_xscale("log")
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("fraction of answered requests")
        ax.set_ylim(0.4, 1.0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=31.6,
                    help="Poisson arrivals per second (31.6: what the soak offers the fast "
                         "plan beside its decode server)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--calibration-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0 or args.replays < 1 or args.calibration_s <= 0:
        ap.error("--rate, --seconds and --calibration-s must be > 0, --replays >= 1")
    reporter = Reporter(args.quiet)
    result = run(args, reporter)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "call_spread.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "call_spread.png")
    for name, entry in result["plans"].items():
        m = entry["measured_median"]
        print(f"{name} ({entry['plan']}): measured p50/p95/p99 {m['p50_ms']:.1f} / "
              f"{m['p95_ms']:.1f} / {m['p99_ms']:.1f} ms")
        for label, sim in entry["simulated"].items():
            err = entry["error"][label]
            print(f"  simulated, {label}: {sim['p50_ms']:.1f} / {sim['p95_ms']:.1f} / "
                  f"{sim['p99_ms']:.1f} ms (p99 {err['p99_ms']:+.0%})")
        for label, err in entry.get("per_replay_abs_error_median", {}).items():
            print(f"  per replay, {label}: median |error| p50 {err['p50_ms']:.0%}, "
                  f"p95 {err['p95_ms']:.0%}, p99 {err['p99_ms']:.0%}")
    print(f"wrote {args.out / 'call_spread.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
