"""Robustness: the workload is not the one the plan was made for (the paper's section 5.5;
issue 33, item 4), measured on the engine with the real models.

ken plans the sentiment function on a Poisson window at ``--rate`` qps for a latency target
(``--target-ms``: the most accurate plan whose simulated p95 is within it). Then two traces
are served, each first ``--phase-s`` seconds as planned and then ``--phase-s`` seconds of:

- ``rate``: the arrival rate multiplied by ``--step`` (default 2: doubled), past the planned
  peak;
- ``harder``: the same rate, but every request a hard row (one the first model of ken's most
  accurate cascade is unsure of, so it escalates).

Three systems (one more each with ``--in-thread``, ``--no-stopgap``, ``--modelled``,
``--window-only`` and ``--no-runtimes``) serve each trace, one after the other, on the same
arrivals and rows:

- ``ken, re-planning``: ken's plan with the ``Replanner`` watching it (``ken.engine.replanning``:
  rate, escalation, latency and, since 2026-11-27, the model calls' runtimes);
- ``ken, re-planning in this process`` (with ``--in-thread``): the same, but each re-plan runs
  in the watching thread of the engine's process (``Replanner(isolate=False)``, how ken
  re-planned before 2026-11-27) rather than in its niced planner process: the A/B of where
  planning runs;
- ``ken, re-planning without the stop-gap`` (with ``--no-stopgap``): the same, but a rate or
  latency drift waits for the re-plan instead of first swapping in a one-gear plan of the
  frontier that sustains the load (``GearReplan.stopgap``): how ken re-planned before
  2026-11-28;
- ``ken, re-planning on modelled capacity`` (with ``--modelled``): the same, but where serving
  fell behind the arrivals, the stop-gap and the re-plan still judge capacity by the planner's
  model rather than by what the plan answered (``GearReplan(measured=False)``): how ken
  re-planned before 2026-11-29;
- ``ken, re-planning on the window's counts`` (with ``--window-only``): the same, but serving
  is judged behind by the watch window's counts alone, not its backlog, and nothing is watched
  while a re-plan runs (``Replanner(early=False)``): how ken re-planned before 2026-11-29's
  second change;
- ``ken, re-planning without the runtime watch`` (with ``--no-runtimes``): the same, but the
  watch does not compare the model calls' runtimes with the plan's (``Replanner(runtimes=
  None)``): the A/B of whether that watch pays on its own;
- ``ken, fixed plan``: the same plan, never re-planned;
- ``static cascade``: the most accurate static cascade (one cascade at every load, ken's
  placement and scheduling) whose simulated p95 on the planning window is within the target:
  what a user would pick on the same data.

Every request is served (``admission="max_in_flight"``), so overload shows as latency, not as
rejections. Per system: p95 and accuracy (rows answered correctly) in ``--bin-s`` windows, and
the time to recover: from the change until the start of the first window after which every
window's p95 is within the target ("never" if the last window is over it). ken's re-plans
(when, why, the plans) are listed.

Writes benchmarks/results/robustness/robustness.json and robustness.png (p95 and accuracy over
time, one column per trace).

    python benchmarks/robustness.py            # ~8 minutes on 2 cores, models cached
    python benchmarks/robustness.py --quick    # shorter phases: ~5 minutes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from ken.engine.calibrate import measure_calibration, recent_ratio
from ken.engine.replanning import Replanner
from ken.engine.replay import replay
from ken.engine.serving import Engine
from ken.models import family
from ken.models.model import DeviceConfig
from ken.optimizer.baselines import static_plans
from ken.optimizer.cascades import pareto_cascades
from ken.optimizer.perf import Catalog
from ken.optimizer.plan_context import one_cascade_context
from ken.optimizer.planner import PlannerSettings, plan_frontier, planning_context
from ken.optimizer.planning import sustained_qps
from ken.optimizer.query import Target, choose_plans
from ken.optimizer.replan import GearReplan
from ken.optimizer.simulator import sample_rows
from ken.optimizer.workload import Hardware, Trace, poisson_trace
from ken.policy.plan import GearPlan
from ken.progress import Reporter

sys.path.insert(0, str(Path(__file__).parent))
from e2e import family_setup  # noqa: E402 - the e2e benchmark's setup

RESULTS = Path(__file__).parent / "results" / "robustness"
OPERATOR = "sentiment"


def windows(arrival: np.ndarray, latency_ms: np.ndarray, correct: np.ndarray, bin_s: float,
            end_s: float) -> list[dict]:
    """p95 latency and accuracy of the requests arriving in each ``bin_s`` window."""
    out = []
    for start in np.arange(0.0, end_s, bin_s):
        m = (arrival >= start) & (arrival < start + bin_s)
        if m.any():
            out.append({"start_s": float(start), "requests": int(m.sum()),
                        "p95_ms": float(np.percentile(latency_ms[m], 95)),
                        "accuracy": float(correct[m].mean())})
    return out


def recovery_s(bins: list[dict], change_s: float, target_ms: float) -> float | None:
    """Seconds from ``change_s`` to the start of the first window after which every window
    is within the target; None when the last window is over it."""
    after = [b for b in bins if b["start_s"] >= change_s]
    if not after or after[-1]["p95_ms"] > target_ms:
        return None
    k = len(after)
    while k > 0 and after[k - 1]["p95_ms"] <= target_ms:
        k -= 1
    return max(0.0, after[k]["start_s"] - change_s) if k < len(after) else 0.0


def serve(plan: GearPlan, loaders: dict, trace: Trace, sample, rows: np.ndarray,
          replanner: GearReplan | None, reporter: Reporter, args: argparse.Namespace,
          isolate: bool = True, watch_runtimes: bool = True, early: bool = True
          ) -> tuple[dict, list]:
    with Engine(plan, loaders, workers="process", admission="max_in_flight") as engine:
        runtimes = ((lambda log, since: recent_ratio(log, replanner.catalog, since))
                    if replanner and watch_runtimes else None)
        watcher = (Replanner(engine, OPERATOR, replanner, replanner.expected,
                             reporter=reporter, window_s=args.watch_s,
                             history_s=args.history_s,
                             latency_limit_ms=replanner.latency_limit_ms,
                             runtimes=runtimes, isolate=isolate, early=early)
                   if replanner else None)
        if watcher:
            watcher.start()
        try:
            rep = replay(engine, trace, sample, rows=rows, reporter=reporter)
        finally:
            if watcher:
                watcher.stop()
    r = rep.result
    arrival = r.arrival_s - r.arrival_s.min()
    latency = (r.completion_s - r.arrival_s) * 1000.0
    bins = windows(arrival, latency, r.quality[0], args.bin_s, trace.duration_s + args.bin_s)
    t0 = float(r.arrival_s.min())  # engine clock of the first arrival: trace time 0
    events = [] if watcher is None else [
        {"at_s": e.at_s - t0, "swapped_at_s": e.swapped_at_s - t0, "kind": e.drift.kind,
         "stopgap": e.stopgap, "why": e.drift.detail, "rate_qps": e.drift.rate_qps,
         "served_qps": e.drift.served_qps, "saturated": e.drift.saturated,
         "backlog": e.drift.backlog, "behind_s": e.drift.behind_s,
         "behind_qps": e.drift.behind_qps,
         "planning_s": e.planning_s, "moved": e.moved, "old": e.old, "new": e.new,
         "error": e.error} for e in watcher.events]
    return {"bins": bins, "status": rep.status_counts(),
            "p95_ms": float(np.percentile(latency, 95)),
            "accuracy": float(r.quality[0].mean())}, events


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=None,
                    help="planned arrival rate (default: 0.5x what the most accurate cascade "
                    "sustains on the 2 devices)")
    ap.add_argument("--step", type=float, default=2.0,
                    help="the rate trace's second phase arrives at this many times the "
                    "planned rate (default 2: doubled)")
    ap.add_argument("--target-ms", type=float, default=300.0)
    ap.add_argument("--phase-s", type=float, default=45.0)
    ap.add_argument("--bin-s", type=float, default=5.0)
    ap.add_argument("--watch-s", type=float, default=5.0)
    ap.add_argument("--history-s", type=float, default=15.0)
    ap.add_argument("--calibration-s", type=float, default=20.0)
    ap.add_argument("--traces", default="rate,harder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quick", action="store_true", help="30-s phases")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--in-thread", action="store_true",
                    help="also serve ken re-planning in the engine's process (the A/B of "
                    "the planner process)")
    ap.add_argument("--no-stopgap", action="store_true",
                    help="also serve ken re-planning without first falling back at once to a "
                    "one-gear plan that sustains the load (GearReplan.stopgap; how ken "
                    "re-planned before 2026-11-28)")
    ap.add_argument("--modelled", action="store_true",
                    help="also serve ken re-planning judging capacity by the planner's model "
                    "even where serving fell behind (GearReplan(measured=False); how ken "
                    "re-planned before 2026-11-29)")
    ap.add_argument("--window-only", action="store_true",
                    help="also serve ken re-planning that judges serving behind by the "
                    "window's counts alone and does not watch while a re-plan runs "
                    "(Replanner(early=False); how ken re-planned before 2026-11-29's second "
                    "change)")
    ap.add_argument("--no-runtimes", action="store_true",
                    help="also serve ken re-planning without the runtime watch (the A/B of "
                    "whether that watch pays on its own)")
    args = ap.parse_args()
    if args.quick:
        args.phase_s = 30.0
    args.operator, args.workers = OPERATOR, "process"
    reporter = Reporter(args.quiet)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    device = DeviceConfig(threads=1)
    sample, models, loaders, profiles = family_setup(family.FamilyData("mixed", 6000, 1500),
                                                     device, "process", reporter)
    del models  # the engine's workers load their own
    catalog = Catalog.from_profiles(profiles)
    cascades = [m.cascade for m in pareto_cascades(profiles)]
    hardware = Hardware.cpu_workers(2, 4 * 10**9)
    used = {m for c in cascades for m in c.models}
    calibration = measure_calibration(catalog, {m: f for m, f in loaders.items() if m in used},
                                      sample, hardware, args.calibration_s,
                                      seed=args.seed + 1, reporter=reporter, workers="process")
    reporter.note(f"runtimes calibrated: {calibration.describe()} ({calibration.source})")
    cal = calibration.apply(catalog)
    top = max(cascades, key=cal.accuracy)
    rate = args.rate or 0.5 * sustained_qps(cal, top, 2)
    planning = poisson_trace(rate, 60.0, seed=args.seed + 30)
    target = Target(max_p95_ms=args.target_ms)
    settings = PlannerSettings(num_ranges=8, seed=args.seed)
    frontier, _ = plan_frontier(OPERATOR, cascades, cal, hardware, planning, settings=settings,
                                reporter=reporter)
    plan = choose_plans({OPERATOR: frontier}, {OPERATOR: cal}, planning, target).plans[0]
    ctx = planning_context(OPERATOR, cascades, cal, hardware, planning, settings=settings)
    # every candidate cascade alone at all loads, none thinned out
    statics = static_plans(one_cascade_context(ctx, cascades))
    within = [p for p in statics if p.predicted.p95_ms <= args.target_ms] or statics[:1]
    static = max(within, key=lambda p: p.predicted.accuracy)
    reporter.note(f"planned at {rate:.0f} qps for p95 <= {args.target_ms:g} ms: ken "
                  f"{plan.headline()} (predicted {plan.predicted.accuracy:.1%}, p95 "
                  f"{plan.predicted.p95_ms:.0f} ms); static {static.cascades[0].describe()} "
                  f"({static.predicted.accuracy:.1%}, {static.predicted.p95_ms:.0f} ms)")

    # hard rows: the ones the first model of the most accurate cascade passes on
    hard = np.flatnonzero(top.escalates(0, cal.certainty(top.models[0], top.certainty)))
    results: dict = {"setup": {"rate_qps": rate, "target_ms": args.target_ms,
                               "phase_s": args.phase_s, "step": args.step,
                               "plan": plan.describe(),
                               "static": static.cascades[0].describe(),
                               "hard_rows": len(hard), "sample_rows": len(sample),
                               "hard_share": len(hard) / len(sample)},
                     "traces": {}}
    for kind in [t.strip() for t in args.traces.split(",") if t.strip()]:
        first = poisson_trace(rate, args.phase_s, seed=args.seed + 40)
        factor = args.step if kind == "rate" else 1.0
        second = poisson_trace(rate * factor, args.phase_s, seed=args.seed + 41)
        arrivals = np.concatenate([first.arrival_s, second.arrival_s + args.phase_s])
        trace = Trace(arrivals, f"poisson {rate:.0f} qps then {rate * factor:.0f} qps")
        rows = sample_rows(len(trace), len(sample), args.seed)
        if kind == "harder":
            n2 = len(second)
            rng = np.random.default_rng(args.seed + 5)
            rows = np.concatenate([rows[: len(first)], rng.choice(hard, size=n2)])
        out: dict = {"change_s": args.phase_s, "requests": len(trace), "systems": {}}
        def recipe(stopgap: bool = True, measured: bool = True) -> GearReplan:
            return GearReplan(OPERATOR, cal, cascades, hardware, target, seed=args.seed,
                              fallbacks=frontier.one_gear if stopgap else (),
                              measured=measured)

        # (name, plan, re-planner, how the engine serves it: ``serve``'s options)
        systems = [("ken, re-planning", plan, recipe(), {}),
                   *([("ken, re-planning in this process", plan, recipe(), {"isolate": False})]
                     if args.in_thread else []),
                   *([("ken, re-planning without the runtime watch", plan, recipe(),
                       {"watch_runtimes": False})] if args.no_runtimes else []),
                   *([("ken, re-planning without the stop-gap", plan, recipe(False), {})]
                     if args.no_stopgap else []),
                   *([("ken, re-planning on modelled capacity", plan, recipe(measured=False),
                       {})] if args.modelled else []),
                   *([("ken, re-planning on the window's counts", plan, recipe(),
                       {"early": False})] if args.window_only else []),
                   ("ken, fixed plan", plan, None, {}),
                   ("static cascade", static, None, {})]
        for name, p, replanner, options in systems:
            reporter.note(f"{kind}: serving {name}")
            got, events = serve(p, loaders, trace, sample, rows, replanner, reporter, args,
                                **options)
            got["recovery_s"] = recovery_s(got["bins"], args.phase_s, args.target_ms)
            got["replans"] = events
            out["systems"][name] = got
            rec = got["recovery_s"]
            reporter.note(f"{kind}: {name}: p95 {got['p95_ms']:.0f} ms, accuracy "
                          f"{got['accuracy']:.1%}, recovered "
                          f"{'never' if rec is None else f'after {rec:.0f} s'}; "
                          f"{sum(not e['stopgap'] for e in events)} re-plans, "
                          f"{sum(e['stopgap'] for e in events)} stop-gaps")
        results["traces"][kind] = out
        (args.out / "robustness.json").write_text(json.dumps(results, indent=1))
    results["wall_s"] = time.perf_counter() - started
    (args.out / "robustness.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "robustness.png", args.target_ms)
    reporter.note(f"wrote {args.out}/robustness.json and robustness.png in "
                  f"{results['wall_s'] / 60:.1f} min")
    return 0


def plot(results: dict, path: Path, target_ms: float) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    traces = results["traces"]
    fig = Figure(figsize=(5 * len(traces), 6), dpi=110)
    FigureCanvasAgg(fig)
    for col, (kind, tr) in enumerate(traces.items()):
        ax = fig.add_subplot(2, len(traces), col + 1)
        ax2 = fig.add_subplot(2, len(traces), len(traces) + col + 1, sharex=ax)
        for name, s in tr["systems"].items():
            xs = [b["start_s"] for b in s["bins"]]
            ax.plot(xs, [b["p95_ms"] for b in s["bins"]], "-o", ms=3, label=name)
            ax2.plot(xs, [100 * b["accuracy"] for b in s["bins"]], "-o", ms=3, label=name)
            for e in s["replans"]:
                ax.axvline(e["swapped_at_s"], color="orange" if e.get("stopgap") else "red",
                           lw=0.6, alpha=0.5, ls=":" if e.get("stopgap") else "-")
        ax.axhline(target_ms, color="gray", ls="--", lw=0.8)
        ax.axvline(tr["change_s"], color="black", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("p95 latency (ms) per window")
        ax.set_title(f"{kind}: change at {tr['change_s']:.0f} s (black); re-plans (red), "
                     "stop-gaps (orange)",
                     fontsize=8)
        ax2.set_ylabel("accuracy (%)")
        ax2.set_xlabel("time (s)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
