"""`ken plan` and `ken replay`: the gear-plan frontier of an operator, and one plan served by
the online engine under a replayed trace. Profiles come from the planning functions that
``Session.plan`` uses (``ken.optimizer.planning``)."""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from ken import store
from ken.cli import family_data, op_context, pick_plan
from ken.engine.calibrate import Calibration, fit_calibration, measure_calibration
from ken.engine.hindsight import hindsight
from ken.engine.ray_runner import RayCluster
from ken.engine.replay import plot_replay, replay
from ken.engine.request_path import where_time_went
from ken.engine.serving import Engine
from ken.engine.workers import gpu_index
from ken.errors import KenError, UsageError
from ken.models import family
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig
from ken.ops import builtin_operators
from ken.ops.base import Operator
from ken.ops.sentiment import Sentiment
from ken.optimizer.gen_planner import plan_generating
from ken.optimizer.perf import Catalog
from ken.optimizer.planner import PlannerSettings
from ken.optimizer.planning import (
    check_planning_args,
    default_peak_qps,
    device_profiles,
    gpu_device,
    keyed_profiles,
    local_hardware,
    plan_operator,
    planning_inputs,
    planning_trace,
    sustained_qps,
)
from ken.optimizer.plotting import plot_frontier
from ken.optimizer.profile import DEFAULT_BATCH_SIZES
from ken.optimizer.query import Target
from ken.optimizer.simulator import simulate
from ken.optimizer.workload import AZURE_CODE_TRACE, Hardware
from ken.paths import ken_home, shared_data_dir
from ken.policy.plan import Frontier, GearPlan
from ken.progress import Reporter
from ken.report import console, latency_table, print_gear_plans


def cmd_plan(args: argparse.Namespace) -> int:
    op = builtin_operators()[args.function]
    return _PLANNERS[op.plan_kind](args, op)


def _plan_generating(args: argparse.Namespace, op: Operator) -> int:
    """The generation plan of a generating function for ``--target`` at ``--qps``."""
    if args.qps is None:
        raise UsageError(f"planning {args.function}() needs --qps, the mean rate of its "
                         "requests (e.g. --qps 0.3)")
    try:  # no target: the most accurate plan
        target = Target.parse(args.target) if args.target else Target(max_tgt_p95_ms=math.inf)
    except KenError as exc:
        raise UsageError(str(exc)) from None
    reporter = Reporter(args.quiet)
    chosen = plan_generating(op, op_context(args, reporter), target, args.qps, args.rows,
                             seed=args.seed).plan
    path = chosen.save(Path(args.out) / f"plan-{args.function}.json")
    how = f"for target {args.target}" if args.target else "the most accurate"
    console.print(f"{args.function} generation plan ({how}, {args.qps:g} requests/s):",
                  highlight=False)
    for line in chosen.describe():
        console.print(f"  {line}", highlight=False, markup=False)
    console.print(f"wrote {path} (serve it: session.use_plan(ken.Plan.load(path)))",
                  highlight=False)
    return 0


def _plan_frontier(args: argparse.Namespace, op: Operator) -> int:
    """The frontier of gear plans of a classifier function."""
    check_planning_args(args.devices, args.memory_gb, args.device_threads, args.peak_qps,
                        args.duration, args.ranges, args.gpus)
    if args.ray is not None and (args.gpus or args.gpu_memory_gb):
        raise UsageError("--ray plans the cluster's CPU workers; --gpus and --gpu-memory-gb "
                         "are for this machine's GPUs")
    if not args.calibration_seconds > 0:
        raise UsageError("--calibration-seconds must be > 0")
    if args.ray is not None:  # the cluster's devices replace --devices
        hardware = RayCluster.connect(args.ray).hardware(
            args.device_threads, memory_bytes=int(args.memory_gb * 2**30))
    else:
        hardware = local_hardware(args.devices, args.memory_gb, args.gpus, args.gpu_memory_gb)
    gpu = gpu_device(hardware, args.device_threads) if args.ray is None else None
    on = (f"{len(hardware.devices)} x cpu-{args.device_threads}t" if gpu is None
          else ", ".join(hardware.ids))
    if args.target is not None:
        try:
            Target.parse(args.target).for_classifiers()  # a typo fails now, not later
        except KenError as exc:
            raise UsageError(str(exc)) from None
    if args.trace == "azure" and not (shared_data_dir() / AZURE_CODE_TRACE).is_file():
        raise KenError(f"the Azure trace is not at {shared_data_dir() / AZURE_CODE_TRACE}; "
                       "set KEN_DATA_DIR to the folder holding traces/, or plan on a "
                       "synthetic trace with --trace poisson or --trace gamma")
    reporter = Reporter(args.quiet)
    started = time.perf_counter()
    operator = args.function
    reporter.note(f"{operator}: profiling its candidates on {op.eval_description()}")
    profiles, on_gpu = device_profiles(op, op_context(args, reporter), args.device_threads,
                                       gpu, "cpu" in hardware.kinds, DEFAULT_BATCH_SIZES)
    catalog, cascades = planning_inputs(profiles, args.max_stages, args.grid, on_gpu)
    def rate() -> float:
        """About the rate the plans' requests will arrive in (``Trace.request_qps``: near the
        busy periods' for a bursty trace; without --peak-qps the peak comes from the profiles
        here: the calibration's serving rate needs to be near it, not exact)."""
        return planning_trace(args.trace, args.peak_qps or default_peak_qps(
            catalog, cascades, hardware), args.duration, seed=args.seed,
            cv=args.cv).request_qps()

    calibration = _runtime_calibration(args, op, catalog, cascades, hardware, reporter, rate)
    if calibration is not None:
        catalog = calibration.apply(catalog)
    best = max(cascades, key=catalog.accuracy)
    sustained = sustained_qps(catalog, best, hardware)
    peak = args.peak_qps or default_peak_qps(catalog, cascades, hardware)
    reporter.note(f"{len(cascades)} Pareto cascades; the most accurate, {best.describe()} "
                  f"({catalog.accuracy(best):.1%}), sustains {sustained:.1f} rows/s on "
                  f"{on}" + ("" if args.peak_qps else f"; peak load 1.5x that = {peak:g} qps"))
    trace = planning_trace(args.trace, peak, args.duration, seed=args.seed, cv=args.cv)
    reporter.note(f"trace {trace.name}: {len(trace):,} requests over {trace.duration_s:.0f} s, "
                  f"mean {trace.mean_qps:.1f} qps, 1-s peak {trace.qps_max():g} qps")
    if args.ray is not None:
        reporter.note(f"Ray cluster {args.ray}: {len(hardware.nodes)} node(s), devices "
                      f"{', '.join(hardware.ids)}")
    settings = PlannerSettings(num_ranges=args.ranges, placement_scoring=args.placement_scoring,
                               seed=args.seed)
    frontier, stats = plan_operator(operator, keyed_profiles(profiles, on_gpu), catalog,
                                    cascades, hardware, trace, peak, settings,
                                    cache_dir=ken_home() / "plans", reporter=reporter,
                                    force=args.force,
                                    calibration=None if calibration is None
                                    else calibration.key())
    runtimes = ("profiles, uncalibrated" if calibration is None
                else f"calibrated: {calibration.describe()} ({calibration.source})")
    frontier = Frontier(frontier.operator,
                        tuple(replace(p, provenance=(*p.provenance, ("runtimes", runtimes)))
                              for p in frontier.plans),
                        (*frontier.provenance, ("runtimes", runtimes)),
                        tuple(replace(p, provenance=(*p.provenance, ("runtimes", runtimes)))
                              for p in frontier.alternatives))
    out = Path(args.out)
    if calibration is not None:
        calibration.save(out / "calibration.json")
    json_path = store.write_text(out / f"frontier-{operator}.json", frontier.to_json())
    png_path = plot_frontier(
        frontier, out / f"frontier-{operator}.png",
        title=f"{operator} gear plans: {on}, "
              f"{args.trace} trace, {args.duration:g} s, peak {peak:g} qps")
    chosen = pick_plan(frontier, args.target)
    print_gear_plans(frontier, chosen, catalog)
    how = f"for target {args.target}" if args.target else "the most accurate"
    console.print(f"plan {frontier.plans.index(chosen)} ({how}):", highlight=False)
    for line in chosen.describe():
        console.print(f"  {line}", highlight=False, markup=False)
    console.print(f"runtimes: {runtimes}", highlight=False, markup=False)
    took = time.perf_counter() - started
    planned = ("from cache" if stats is None else
               f"{stats.simulations} simulations, {stats.wall_s:.1f} s planning")
    console.print(f"wrote {json_path} and {png_path} ({planned}; {took:.1f} s in all)",
                  highlight=False)
    return 0


#: how `ken plan` plans a function, by the kind of plan its operator declares
_PLANNERS = {"gear": _plan_frontier, "generation": _plan_generating}


def _runtime_calibration(args: argparse.Namespace, op: Operator, catalog: Catalog,
                         cascades: Sequence[Cascade], hardware: Hardware, reporter: Reporter,
                         rate: Callable[[], float]) -> Calibration | None:
    """The runtime calibration `ken plan` plans with: the file ``--calibration`` names, none
    with ``--no-calibration``, else measured now by serving every candidate model on this
    machine's CPU workers for ``--calibration-seconds`` (``measure_calibration``), then each
    model alone at ``rate()``, about the rate the planning trace's requests arrive in.

    A file that covers only some candidate models (a `ken replay`'s calibration.json fits
    the models of the plan it served) is completed: the other models are measured now and the
    file's fits kept over theirs (``Calibration.updated``); with ``--no-calibration``, or
    where nothing can be measured, the others are planned on their profiles, and a note says
    so."""
    used = {m for c in cascades for m in c.models}
    given = None
    if args.calibration is not None:
        given = _load_calibration(args.calibration, reporter)
        missing = sorted(used - set(given.fits))
        if not missing:
            return given
        if args.no_calibration:
            reporter.note(f"{', '.join(missing)}: not in {args.calibration}; planned on "
                          "their profiles (--no-calibration)")
            return given
        used = set(missing)
    elif args.no_calibration:
        return None
    measured = _measure_calibration(args, op, catalog, used, hardware, reporter, rate,
                                    partial=given is not None)
    if given is None or measured is None:
        return measured if given is None else given
    reporter.note(f"runtimes: {args.calibration} for {', '.join(sorted(given.fits)) or 'none'}"
                  f", measured now for {', '.join(sorted(used))}")
    return measured.updated(given)


def _measure_calibration(args: argparse.Namespace, op: Operator, catalog: Catalog,
                         used: set[str], hardware: Hardware, reporter: Reporter,
                         rate: Callable[[], float], partial: bool = False
                         ) -> Calibration | None:
    """``measure_calibration`` of the models ``used`` on this machine's CPU workers; None
    (with a note or a message saying why) where it cannot measure."""
    if args.ray is not None or hardware.kinds != ("cpu",):
        reporter.note("runtime calibration measures this machine's CPU workers; skipped for "
                      "a plan on " + ("a Ray cluster" if args.ray is not None else "GPUs")
                      + " (give one with --calibration)")
        return None
    ctx = op_context(args, reporter)
    device = DeviceConfig(threads=args.device_threads)
    loaders, sample = op.loaders(ctx, device), op.eval_sample(ctx)
    if loaders is None or sample is None:
        reporter.note(f"{op.name}() has no models to serve in worker processes; its runtimes "
                      "are not calibrated")
        return None
    try:
        calibration = measure_calibration(
            catalog, {m: f for m, f in loaders.items() if m in used}, sample, hardware,
            args.calibration_seconds, seed=args.seed, reporter=reporter, workers="process",
            threads_per_device=args.device_threads, rate=rate())
    except KenError as exc:  # a plan from the profiles beats no plan; say what happened
        console.print(f"runtime calibration failed ({exc}); planning with the profiles' "
                      "runtimes" + (f" of {', '.join(sorted(used))}" if partial else "")
                      + " (--no-calibration skips the attempt)", highlight=False,
                      markup=False)
        return None
    reporter.note(f"runtimes calibrated: {calibration.describe()}")
    return calibration


def _load_calibration(path: Path, reporter: Reporter) -> Calibration:
    calibration = Calibration.load(path)
    reporter.note(f"runtimes calibrated by {path}: {calibration.describe()}")
    return calibration


def cmd_replay(args: argparse.Namespace) -> int:
    """Serve one gear plan with the online engine and replay a trace through it (open loop)."""
    if args.plan is not None:
        plan = GearPlan.load(args.plan)
    else:
        plan = pick_plan(Frontier.load(args.frontier), args.target)
    if args.rate_scale <= 0 or args.duration <= 0:
        raise UsageError("--rate-scale and --duration must be > 0")
    reporter = Reporter(args.quiet)
    data = family_data(args)
    device = DeviceConfig(threads=args.device_threads)
    cards = {c.name: c for c in family.prepare(data, device, reporter=reporter)}
    needed = sorted({r.model for r in plan.placement})
    unknown = [m for m in needed if m not in cards]
    if unknown:
        raise KenError(f"the plan uses {unknown}, which are not models of the packaged family "
                       f"({', '.join(cards)})")
    # a plan made for GPUs (cuda{j}) is simulated with GPU profiles and served by a process per
    # GPU that loads its models on the one GPU it sees
    on_gpu = sorted({r.model for r in plan.placement
                     if any(gpu_index(d) is not None for d in r.devices)})
    gpu = DeviceConfig("cuda", 0, args.device_threads) if on_gpu else None
    sample = family.heldout_sample(data)
    family.check_sample(list(cards.values()), sample)
    profiles, gpu_profiles = device_profiles(
        Sentiment(), op_context(args, reporter), args.device_threads, gpu,
        any(gpu_index(d) is None for d in plan.devices), DEFAULT_BATCH_SIZES)
    catalog, _ = planning_inputs(profiles, gpu_profiles=gpu_profiles)
    workers, cluster = args.workers, None
    if args.ray is not None or workers == "ray":  # --ray ADDRESS, or a Ray started here
        workers, cluster = "ray", RayCluster.connect(args.ray or "local")
        # every call pays the hop to its actor: simulate it, and measure the calibration
        # against profile + hop (as `ken plan --ray --calibration` applies it), not twice
        hop = cluster.hop_s()
        catalog = catalog.with_overhead(hop)
        reporter.note(f"Ray: the hop to an actor, {1000 * hop:.1f} ms, counted in every batch")
    profiled = catalog
    if args.calibration is not None:  # simulate with serving times
        catalog = _load_calibration(args.calibration, reporter).apply(catalog)
    peak = (args.peak_qps or plan.qps_max) * args.rate_scale
    trace = planning_trace(args.trace, peak, args.duration, seed=args.seed)
    reporter.note(f"plan: {len(plan.gears())} gears on {', '.join(plan.devices)}; trace "
                  f"{trace.name}: {len(trace):,} requests over {trace.duration_s:.0f} s, "
                  f"1-s peak {trace.qps_max():g} qps")
    engine = Engine(plan, {m: functools.partial(family.load_model, cards[m], device, None, data)
                           for m in needed}, workers=workers,
                    gpu_models={m: functools.partial(family.load_model, cards[m], gpu, None, data)
                                for m in on_gpu},
                    threads_per_device=args.device_threads,
                    memory_budget_bytes=int(args.memory_gb * 2**30), ray_cluster=cluster)
    load = engine.start()
    reporter.note(f"{len(plan.devices)} {workers} workers loaded {len(needed)} models in "
                  f"{load.total_s:.1f} s")
    try:
        rep = replay(engine, trace, sample, seed=args.seed,
                     reporter=reporter)
    finally:
        engine.shutdown()
    measured = rep.result.metrics(0, plan)
    simulated = simulate(plan, catalog, trace, args.seed).metrics(0, plan)
    label = "simulated (calibrated)" if args.calibration is not None else "simulated"
    console.print(latency_table(f"replay of {trace.name} ({len(trace):,} requests)",
                                [(label, simulated), ("measured", measured)]))
    console.print(f"outcomes: {rep.status_counts()}; worst send lag {rep.max_send_lag_s:.3f} s")
    paths = where_time_went(rep.outcomes, engine.path_log)
    own = fit_calibration(engine.batch_log, profiled,
                          f"ken replay of {trace.name}, {len(trace)} requests")
    seen = None
    if paths is not None:
        console.print(paths.describe())
        # the simulator fed this replay's own batch times (what of a miss is its structure)
        # and drawing them from this replay's calibration (what is their draw)
        assert rep.rows is not None
        try:
            seen = hindsight(plan, profiled, rep.outcomes, rep.rows, engine.path_log,
                             own.apply(profiled) if own.fits else None)
            console.print(seen.describe())
        except KenError as exc:  # a diagnosis: the replay's own results are written anyway
            reporter.note(f"no hindsight of this replay: {exc}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store.write_text(out / "replay.json", rep.to_json(plan, paths, seen))
    store.write_text(out / "plan.json", plan.to_json())
    own.save(out / "calibration.json")
    plot_replay(rep, plan, out / "replay.png")
    console.print(f"wrote {out / 'replay.json'}, {out / 'replay.png'}, {out / 'plan.json'} and "
                  f"{out / 'calibration.json'} (for `ken plan --calibration`)")
    return 0
