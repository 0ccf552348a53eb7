"""Planning helpers shared by ``Session.plan``, ``ken plan`` and the demo: profiles of an
operator's candidate models on its evaluation sample, the default cascade of a bound operator,
planning arguments, the planning trace, and frontiers cached on disk.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from ken import store
from ken.errors import DeviceProfileError, KenError, PlanError, StoreError, UsageError
from ken.models import family
from ken.models.cascade import Cascade
from ken.models.datasets import LabelledSample
from ken.models.family import ModelCard
from ken.models.gpus import Gpu, choose_gpus, gpu_budget_bytes, visible_gpus
from ken.models.model import DeviceConfig, Model
from ken.models.quality import EvalSample
from ken.ops.base import ChosenCascade, OpContext, Operator
from ken.optimizer.cascades import evaluate, pareto_cascades
from ken.optimizer.certified import CertifiedCandidates, certify_candidates
from ken.optimizer.gen_planner import plan_generating
from ken.optimizer.guarantee import GuaranteeTarget
from ken.optimizer.perf import Catalog, ModelPerf, sustained_qps
from ken.optimizer.planner import PlannerSettings, PlannerStats, plan_frontier
from ken.optimizer.profile import (
    DEFAULT_BATCH_SIZES,
    MIN_TIMED_ROWS,
    Profile,
    cached_profile,
    is_cached,
    load_or_run_profile,
)
from ken.optimizer.query import QueryPlan, Target, choose_plans
from ken.optimizer.replan import GearReplan
from ken.optimizer.workload import (
    Hardware,
    Trace,
    WorkloadError,
    fit_peak,
    fit_peak_scale,
    gamma_trace,
    load_azure_trace,
    poisson_trace,
)
from ken.paths import ken_home
from ken.policy.plan import Frontier
from ken.progress import QUIET, Reporter

#: batch sizes of a short profile, when `ken profile` has not measured every size here
SHORT_BATCH_SIZES = (1, 8, 32)


def operator_profiles(op: Operator, ctx: OpContext, threads: int | None = None,
                      batch_sizes: Sequence[int] | None = None,
                      device: DeviceConfig | None = None) -> dict[str, Profile]:
    """Profiles of ``op``'s candidate models on its evaluation sample (cached on disk).

    On the session's device by default, on a CPU device of ``threads`` threads (what the
    planner's CPU workers run on), or on ``device`` (a GPU, for GPU plans). Every batch size
    when `ken profile` already measured them here, else a short profile (or exactly
    ``batch_sizes``). Before measuring anything the reporter says which models it profiles
    and roughly how long that takes.
    """
    given = op.profiles(ctx, ctx.device.threads if threads is None else threads)
    if given is not None:
        if device is not None and device.kind == "cuda":
            raise DeviceProfileError(f"{op.name}() brings profiles measured elsewhere, not on "
                                     f"{device.label}: plan it for CPU workers (gpus=0)")
        return dict(given)
    sample = op.eval_sample(ctx)
    if sample is None:
        raise KenError(f"{op.name}() cannot be planned: it has no evaluation sample "
                       f"({op.eval_description()}); gear plans are built from model profiles "
                       "on a labelled sample. A plan made elsewhere can be set with "
                       "session.use_plan(...)")
    if device is None:
        device = ctx.device
        if threads is not None and (device.kind != "cpu" or device.threads != threads):
            device = DeviceConfig(threads=threads)
    models = op.candidates(ctx, device)
    elsewhere = sorted(n for n, m in models.items() if m.device.kind != device.kind)
    if elsewhere:
        raise DeviceProfileError(
            f"{op.name}() cannot be profiled on {device.label}: its candidate models "
            f"{', '.join(elsewhere)} load on {models[elsewhere[0]].device.label} (the "
            "operator's candidates(ctx, device) ignores the device it is given); plan it for "
            "CPU workers (gpus=0)")
    sizes: dict[str, tuple[int, ...]] = {}
    profiles: dict[str, Profile] = {}
    for name, model in models.items():
        sizes[name] = tuple(batch_sizes or DEFAULT_BATCH_SIZES)
        # a short profile on a CPU, where large batches take long; a GPU runs every size in
        # moments, and its plans want the large batches
        if batch_sizes is None and device.kind == "cpu" \
                and not is_cached(model, sample, sizes[name], ctx.home):
            sizes[name] = SHORT_BATCH_SIZES
        cached = cached_profile(model, sample, sizes[name], ctx.home)
        if cached is not None:
            profiles[name] = cached
    todo = [name for name in models if name not in profiles]
    if not todo:
        return profiles
    notice = profiling_notice(f"{op.name}()", {n: models[n] for n in todo}, sample,
                              {n: sizes[n] for n in todo}, device.label, ctx.home)
    with ctx.reporter.long_work(notice):
        for name in todo:
            with ctx.reporter.task(f"profile {name} on {device.label}",
                                   len(sizes[name]) + 1) as advance:
                profiles[name] = load_or_run_profile(models[name], sample, sizes[name],
                                                     ctx.home, on_step=lambda _s: advance(1),
                                                     reporter=ctx.reporter)
    return {name: profiles[name] for name in models}


def profiling_notice(what: str, models: Mapping[str, Model], sample: EvalSample,
                     sizes: Mapping[str, Sequence[int]], device: str,
                     home: Path | None = None) -> str:
    """What profiling ``models`` does and roughly how long it takes: each model is timed on a
    few rows first and its cost per row extrapolated to the rows profiling runs."""
    inputs = list(sample.inputs)
    seconds = 0.0
    for name, model in models.items():
        probe = inputs[:8]
        started = time.perf_counter()
        model.predict(probe, batch_size=len(probe))
        per_row = (time.perf_counter() - started) / max(1, len(probe))
        seconds += per_row * profiled_rows(len(inputs), sizes[name]) * 1.3  # small batches
    where = home or ken_home()
    return (f"profiling {len(models)} model(s) of {what} for the first time "
            f"({', '.join(models)}) on {len(inputs):,} rows of its evaluation sample, batch "
            f"sizes {', '.join(map(str, sorted({b for s in sizes.values() for b in s})))} on "
            f"{device}: {_duration(seconds)}, once: the profiles are kept in "
            f"{where / 'profiles'}. Progress below.")


def profiled_rows(sample_rows: int, batch_sizes: Sequence[int], repeats: int = 3) -> int:
    """Rows a profile runs: the timed batches (see ``measure_batch_runtimes``) and the
    sample rows they did not cover."""
    timed = sum(max(repeats, -(-MIN_TIMED_ROWS // b)) * b for b in batch_sizes)
    return timed + max(0, sample_rows - timed) + 8  # + the warm-up batch


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"about {max(10, round(seconds, -1)):.0f} seconds"
    return f"about {round(seconds / 60):.0f} minutes"


def choose_cascade(op: Operator, ctx: OpContext, cascade: Cascade | None = None
                   ) -> ChosenCascade:
    """The cascade a bound operator runs when no gear plan serves it: ``cascade`` (scored on
    the profiles), else the cheapest Pareto cascade at least as accurate as the best single
    model, at the session's batch size."""
    profiles = operator_profiles(op, ctx)
    if cascade is not None:
        chosen = evaluate(cascade, profiles, ctx.batch_size)
    else:
        front = pareto_cascades(profiles, batch_size=ctx.batch_size)
        best_single = max(p.accuracy for p in profiles.values())
        good = [m for m in front if m.accuracy >= best_single]
        chosen = good[0] if good else front[-1]
    return ChosenCascade(chosen.cascade, chosen.stage_fractions, chosen.accuracy,
                         chosen.cost_ms_per_row)


TRACE_KINDS = ("azure", "poisson", "gamma")


def check_planning_args(devices: int | None, memory_gb: float, threads_per_device: int,
                        peak_qps: float | None, duration_s: float, num_ranges: int,
                        gpus: int | None = None) -> None:
    """Reject impossible planning arguments before any model is profiled. ``devices``: CPU
    workers (None: the default); 0 is a plan for the GPUs alone when ``gpus`` asks for some."""
    problems = []
    if devices is not None and devices < 1 and not (devices == 0 and gpus):
        problems.append(f"devices must be >= 1 (got {devices})")
    if not memory_gb > 0 or not math.isfinite(memory_gb):
        problems.append(f"memory per device must be > 0 GB (got {memory_gb})")
    if threads_per_device < 1:
        problems.append(f"threads per device must be >= 1 (got {threads_per_device})")
    if peak_qps is not None and (not peak_qps > 0 or not math.isfinite(peak_qps)):
        problems.append(f"peak QPS must be > 0 (got {peak_qps})")
    if not duration_s > 0 or not math.isfinite(duration_s):
        problems.append(f"the trace duration must be > 0 s (got {duration_s})")
    if num_ranges < 1:
        problems.append(f"the number of QPS ranges must be >= 1 (got {num_ranges})")
    if problems:
        raise UsageError("cannot plan: " + "; ".join(problems))


def family_profiles(reporter: Reporter = QUIET, threads: int = 1
                    ) -> tuple[family.FamilyData, list[ModelCard], LabelledSample,
                               dict[str, Profile]]:
    """The packaged sentiment family on its default data, prepared (on first use), its
    held-out sample, and each member profiled on ``threads`` threads (one of the engine's
    CPU devices): what the benchmarks that serve the family plan from."""
    data = family.default_data()
    device = DeviceConfig(threads=threads)
    cards = family.prepare(data, device, reporter=reporter)
    sample = family.heldout_sample(data)
    profiles = {c.name: load_or_run_profile(family.load_model(c, device, data=data), sample,
                                            DEFAULT_BATCH_SIZES) for c in cards}
    return data, cards, sample, profiles


def planning_inputs(profiles: Mapping[str, Profile], max_stages: int = 3,
                    grid_size: int = 16, gpu_profiles: Mapping[str, Profile] | None = None
                    ) -> tuple[Catalog, tuple[Cascade, ...]]:
    """The catalog and the candidate cascades (the Pareto set, cost at each model's best
    batch size) that a frontier is planned from. On a machine with CPU workers and GPUs,
    ``profiles`` are the CPU workers' and ``gpu_profiles`` each model's on a GPU
    (``Catalog.gpu_perf``)."""
    front = pareto_cascades(profiles, max_stages=max_stages, grid_size=grid_size,
                            batch_size=None)
    catalog = Catalog.from_profiles(profiles)
    if gpu_profiles:
        catalog = catalog.with_perf(dict(catalog.perf), {
            m: ModelPerf.from_profile(p) for m, p in gpu_profiles.items()})
    return catalog, tuple(m.cascade for m in front)


def keyed_profiles(profiles: Mapping[str, Profile],
                   gpu_profiles: Mapping[str, Profile] | None = None) -> dict[str, Profile]:
    """The profiles a cached frontier is keyed by: both kinds on a mixed machine (the GPU's
    as ``model@gpu``)."""
    return {**profiles, **{f"{m}@gpu": p for m, p in (gpu_profiles or {}).items()}}


def default_peak_qps(catalog: Catalog, cascades: Sequence[Cascade], devices: int | Hardware
                     ) -> float:
    """1.5x the rate the most accurate candidate cascade sustains on all devices (rounded):
    the top QPS ranges then need cheaper cascades, so the frontier has something to trade."""
    best = max(cascades, key=catalog.accuracy)
    return float(max(1, round(1.5 * sustained_qps(catalog, best, devices))))


def planning_trace(kind: str | Trace, peak_qps: float, duration_s: float, seed: int = 0,
                   cv: float = 4.0) -> Trace:
    """The sample trace a frontier is planned on, with a 1-s peak of (about) ``peak_qps``.

    ``"azure"``: the Azure LLM inference trace (code) from the shared data folder, rate-scaled
    so that its busiest second has ``peak_qps`` arrivals, cut to the ``duration_s`` window
    around that second. ``"poisson"`` / ``"gamma"`` (bursty, CV ``cv``): ``duration_s`` of
    synthetic arrivals whose mean rate is set so that the busiest second has ``peak_qps``.
    A ``Trace`` is rate-scaled to the peak and used whole.
    """
    if isinstance(kind, Trace):
        return fit_peak(kind.rate_scaled, peak_qps / kind.qps_max(), peak_qps)
    if kind == "azure":
        try:
            full = load_azure_trace()
        except WorkloadError as exc:
            raise WorkloadError(f"{exc}; or plan on a synthetic trace: --trace poisson / "
                                "gamma (trace='poisson' in session.plan)") from None
        return fit_peak(lambda f: full.rate_scaled(f).around_peak(duration_s),
                         peak_qps / full.qps_max(), peak_qps)
    if kind in ("poisson", "gamma"):
        return _synthetic(kind, peak_qps, duration_s, seed, cv)[1]
    raise WorkloadError(f"unknown trace {kind!r}; use one of {', '.join(TRACE_KINDS)} or pass "
                        "a ken.optimizer.workload.Trace")


def _synthetic(kind: str, peak_qps: float, duration_s: float, seed: int, cv: float
               ) -> tuple[float, Trace]:
    """The mean rate of the synthetic ``kind`` trace whose 1-s peak is ``peak_qps``, and the
    trace."""
    if kind == "poisson":
        return fit_peak_scale(lambda r: poisson_trace(r, duration_s, seed), peak_qps * 0.8,
                              peak_qps)
    return fit_peak_scale(lambda r: gamma_trace(r, duration_s, cv, seed), peak_qps / 4,
                          peak_qps)


def held_out_window(kind: str, peak_qps: float, duration_s: float, window_s: float,
                    seed: int = 0, window_seed: int = 1, cv: float = 4.0) -> Trace:
    """Another draw of the arrival process ``planning_trace(kind, peak_qps, duration_s,
    seed)`` came from: ``window_s`` seconds at the same mean rate (and CV), seeded with
    ``window_seed``. Its own 1-s peak is whatever the draw gives; fitting it to the planning
    trace's peak instead would raise the mean rate of a shorter window (fewer seconds to
    reach the peak), a heavier workload than the one planned for."""
    if kind not in ("poisson", "gamma"):
        raise WorkloadError(f"a held-out window of {kind!r}: only the synthetic traces "
                            "(poisson, gamma) are a process to draw again; for a recorded "
                            "trace take another window of it (Trace.window)")
    if window_seed == seed:
        raise WorkloadError("the held-out window needs another seed than the planning trace")
    rate, _ = _synthetic(kind, peak_qps, duration_s, seed, cv)
    if kind == "poisson":
        return poisson_trace(rate, window_s, window_seed)
    return gamma_trace(rate, window_s, cv, window_seed)


def _planner_code_hash() -> str:
    """A hash of the planner's code, so cached frontiers are re-planned when it changes."""
    from ken.models import cascade
    from ken.optimizer import cascades, perf, planner, scheduler, simulator
    from ken.policy import plan, scheduling

    digest = hashlib.sha256()
    for module in (cascade, cascades, perf, plan, planner, scheduling, scheduler, simulator):
        digest.update(inspect.getsource(module).encode())
    return digest.hexdigest()[:16]


def frontier_cache_key(operator: str, profiles: Mapping[str, Profile],
                       cascades: Sequence[Cascade], hardware: Hardware, trace: Trace,
                       qps_max: float, settings: PlannerSettings,
                       calibration: Mapping[str, tuple[float, ...]] | None = None) -> str:
    """What a frontier depends on: profiles, candidates, devices, trace, settings, code, and
    the runtime calibration if any."""
    digest = hashlib.sha256()
    parts = [operator, _planner_code_hash(), hardware.to_json(), f"{qps_max!r}",
             repr(settings.provenance()), trace.name, str(len(trace)),
             repr(sorted((calibration or {}).items()))]
    for name in sorted(profiles):
        p = profiles[name]
        parts += [name, p.model_fingerprint, p.hardware, p.sample_hash, repr(p.batch_sizes),
                  repr(p.batch_runtime_s), str(p.memory_bytes)]
    parts += [c.to_json() for c in cascades]
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    digest.update(trace.arrival_s.tobytes())
    return digest.hexdigest()[:16]


def plan_operator(operator: str, profiles: Mapping[str, Profile], catalog: Catalog,
                  cascades: Sequence[Cascade], hardware: Hardware, trace: Trace,
                  qps_max: float, settings: PlannerSettings, cache_dir: Path | None = None,
                  reporter: Reporter = QUIET, force: bool = False,
                  calibration: Mapping[str, tuple[float, ...]] | None = None,
                  ) -> tuple[Frontier, PlannerStats | None]:
    """``plan_frontier`` with an on-disk cache in ``cache_dir`` (stats are None on a hit).
    ``calibration``: the runtime spreads ``catalog`` was calibrated with (part of the key)."""
    largest = max(d.memory_bytes for d in hardware.devices)
    too_big = sorted(m for m in {m for c in cascades for m in c.models}
                     if all(catalog.perf_on(m, d.id).memory(1) > d.memory_bytes
                            for d in hardware.devices))
    if too_big:
        needs = ", ".join(f"{m} {catalog.perf[m].memory(1) / 2**20:,.0f} MB" for m in too_big)
        raise KenError(f"cannot plan {operator}: a replica needs its model's weights on one "
                       f"device ({needs}), but the largest device has "
                       f"{largest / 2**20:,.0f} MB; give the devices more memory "
                       "(--memory-gb, memory_gb=...; a GPU's: --gpu-memory-gb, "
                       "gpu_memory_gb=...)")
    if cache_dir is None:
        return plan_frontier(operator, cascades, catalog, hardware, trace, qps_max=qps_max,
                             settings=settings, reporter=reporter)
    key = frontier_cache_key(operator, profiles, cascades, hardware, trace, qps_max,
                             settings, calibration)
    entry = plan_entry(cache_dir / f"{operator}-{key}.json")
    if not force:
        cached = _cached_frontier(entry, reporter)
        if cached is not None:
            return cached, None
    with store.store_lock(cache_dir.parent, f"planning {operator}", reporter.note):
        if not force:  # planned by another process while this one waited?
            cached = _cached_frontier(entry, QUIET)
            if cached is not None:
                return cached, None
        frontier, stats = plan_frontier(operator, cascades, catalog, hardware, trace,
                                        qps_max=qps_max, settings=settings, reporter=reporter)
        store.write_text(entry.main, frontier.to_json())
        store.seal(entry)
    return frontier, stats


def plan_entry(path: Path) -> store.Entry:
    """The store entry of a cached frontier (one JSON file in ``KEN_HOME/plans``)."""
    return store.Entry(path.parent, f"the cached frontier {path.name}",
                       "it is planned again on next use", files=(path.name,),
                       legacy=_adopt_frontier)


def _adopt_frontier(entry: store.Entry) -> None:
    try:
        Frontier.load(entry.main)
    except (PlanError, OSError, ValueError) as exc:
        raise StoreError(f"model store: {entry.main} is not a frontier of this ken ({exc}). To "
                         f"fix it: {entry.fix}.") from None


def _cached_frontier(entry: store.Entry, reporter: Reporter) -> Frontier | None:
    if not entry.main.is_file():
        return None
    try:
        store.ensure(entry)
        frontier = Frontier.load(entry.main)
    except (StoreError, PlanError, OSError) as exc:
        reporter.note(f"{exc}\n  -> planning it again")
        return None
    reporter.note(f"{frontier.operator}: frontier from cache {entry.main}")
    return frontier


def store_entries(home: Path) -> list[store.Entry]:
    """Every cached frontier in ``home``."""
    return [plan_entry(path) for path in sorted((home / "plans").glob("*.json"))
            if not path.name.startswith(".")]


#: the default peak load is capped here: models of a few microseconds per row would
#: otherwise ask for traces of millions of arrivals (pass peak_qps to plan for more)
MAX_DEFAULT_PEAK_QPS = 2000.0


def local_hardware(devices: int | None, memory_gb: float, gpus: int | None = None,
                   gpu_memory_gb: float | None = None, visible: tuple[Gpu, ...] | None = None,
                   ) -> Hardware:
    """The devices a plan of this machine uses (see ``Session.plan``): ``gpus`` GPUs (None: every
    GPU torch sees, unless ``devices`` CPU workers were asked for) and ``devices`` CPU workers
    of ``memory_gb`` each (2 when neither is given or no GPU is used; both given: a mixed
    machine). ``visible`` stands in for the GPUs torch sees (tests)."""
    if gpus == 0 or (gpus is None and devices is not None):
        chosen: tuple[Gpu, ...] = ()
    else:
        chosen = choose_gpus(gpus, visible_gpus() if visible is None else visible)
    if not chosen:
        devices = 2 if devices is None else devices
        check_planning_args(devices, memory_gb, 1, None, 1.0, 1)
        return Hardware.cpu_workers(devices, int(memory_gb * 2**30))
    return Hardware.local(devices or 0, int(memory_gb * 2**30),
                          [gpu_budget_bytes(g, gpu_memory_gb) for g in chosen])


def gpu_device(hardware: Hardware, threads: int) -> DeviceConfig | None:
    """Where GPU profiles of a plan for ``hardware`` are measured: the first GPU of this
    machine's plan (``cuda{j}``); a cluster's GPUs: this process's first. None without GPUs."""
    gpus = [d for d in hardware.devices if d.kind == "cuda"]
    if not gpus:
        return None
    local = re.fullmatch(r"cuda(\d+)", gpus[0].id)
    return DeviceConfig("cuda", int(local.group(1)) if local else 0, threads)


def device_profiles(op: Operator, ctx: OpContext, threads: int, gpu: DeviceConfig | None,
                    cpu_workers: bool, batch_sizes: Sequence[int] | None = None,
                    ) -> tuple[dict[str, Profile], dict[str, Profile] | None]:
    """Profiles of ``op``'s candidates for a plan's workers (see ``operator_profiles``): on
    ``gpu`` for GPUs alone, else on a CPU device of ``threads`` threads; on a mixed machine
    (``gpu`` and ``cpu_workers``) the GPU's as well, beside (None otherwise). These are what
    ``planning_inputs`` and ``keyed_profiles`` take. GPU memory the profiling left cached is
    handed back after."""
    mixed = gpu is not None and cpu_workers
    profiles = operator_profiles(op, ctx, threads, batch_sizes, device=None if mixed else gpu)
    on_gpu = operator_profiles(op, ctx, threads, batch_sizes, device=gpu) if mixed else None
    if gpu is not None:
        import torch  # only here: importing it costs seconds, and CPU planning never needs it

        torch.cuda.empty_cache()  # the serving workers need the GPU's memory
    return profiles, on_gpu


def _profiled(operators: Mapping[str, Operator], ctx: OpContext, names: Sequence[str],
              hardware: Hardware, threads: int,
              guarantees: Mapping[str, GuaranteeTarget] | None = None,
              ) -> tuple[dict[str, dict[str, Profile]],
                         dict[str, tuple[Catalog, tuple[Cascade, ...]]],
                         dict[str, CertifiedCandidates]]:
    """Profiles per function (they key the cached frontiers) and each function's catalog and
    candidate cascades, for ``hardware``: one profile per model and kind of device, the CPU
    workers' (outcomes, cascades) and, on a mixed machine, the GPU's runtimes and memory beside
    (``Catalog.gpu_perf``). A function with a target in ``guarantees`` gets the cascades
    certified against it (``certified.certify_candidates``, returned too) as candidates."""
    gpu = gpu_device(hardware, threads)
    if gpu is not None:
        mixed = "cpu" in hardware.kinds
        ctx.reporter.note(f"planning for {', '.join(hardware.ids)}; models are profiled on "
                          f"{gpu.torch_device}" + (" and on a CPU worker" if mixed else ""))
    found = {n: device_profiles(operators[n], ctx, threads, gpu, "cpu" in hardware.kinds)
             for n in names}
    prepared = {n: planning_inputs(found[n][0], gpu_profiles=found[n][1]) for n in names}
    certified = {n: certify_candidates(found[n][0], t)
                 for n, t in (guarantees or {}).items() if n in names}
    for n, c in certified.items():
        prepared[n] = (prepared[n][0], c.cascades)
        ctx.reporter.note(f"{n}: {c.describe()}")
    return {n: keyed_profiles(*found[n]) for n in names}, prepared, certified


def _check_plannable(operators: Mapping[str, Operator], names: Sequence[str]) -> None:
    if not names:
        raise KenError("plan() needs at least one semantic function, e.g. "
                       "functions=('sentiment',)")
    for name in names:
        if name not in operators:
            raise KenError(f"unknown function {name}(); semantic functions registered on "
                           f"this session: {', '.join(sorted(operators)) or '(none)'}")
        if not operators[name].plannable():
            plannable = ", ".join(sorted(n for n, op in operators.items()
                                         if op.plannable())) or "none"
            raise KenError(
                f"{name}() cannot be planned: plans are made from its models' answers on "
                f"a labelled evaluation sample, and {name}() has none "
                f"({operators[name].eval_description()}); functions this session "
                f"can plan: {plannable}. Register it with sample=ken.EvalSample(...), or "
                "set a plan made elsewhere with session.use_plan(...)")


def plan_functions(operators: Mapping[str, Operator], ctx: OpContext, names: Sequence[str],
                   target: Target, trace: Trace | str | None = None,
                   devices: int | None = None, memory_gb: float = 4.0,
                   threads_per_device: int = 1,
                   peak_qps: float | None = None, duration_s: float = 120.0,
                   num_ranges: int = 8, settings: PlannerSettings | None = None,
                   force: bool = False, cache_dir: Path | None = None,
                   hardware: Hardware | None = None, gpus: int | None = None,
                   gpu_memory_gb: float | None = None, qps: float | None = None,
                   rows: int = 64, requests: int = 120,
                   guarantees: Mapping[str, GuaranteeTarget] | None = None,
                   ) -> tuple[QueryPlan, dict[str, Frontier], dict[str, GearReplan],
                              dict[str, CertifiedCandidates]]:
    """The one planning entry (``Session.plan``): a plan for each function of ``names`` that
    meets ``target``, by the kind of plan its operator declares (``Operator.plan_kind``).

    Classifier functions ("gear") are planned together: profiles, Pareto cascades, a frontier
    of gear plans each on a shared planning trace, and the query optimizer's choice; their
    devices are ``local_hardware(devices, memory_gb, gpus, gpu_memory_gb)``, or ``hardware``
    (e.g. a Ray cluster's), and models are profiled on the kind of device planned for.
    Generating functions ("generation") get a generation plan each for online requests at a
    mean rate of ``qps`` (``gen_planner.plan_generating``: ``rows`` evaluation rows answered,
    ``requests`` arrivals per planning window of ``trace``, the Azure trace by default).
    Returns the chosen plans, the classifier functions' frontiers, for each of them how
    to re-plan it while it is served (``GearReplan``: its catalog, cascades, devices and the
    target), and the certified candidates of those with a target in ``guarantees`` (an
    accuracy, precision or recall target against an oracle model, ``ken.optimizer.certified``):
    their frontiers and re-plans serve nothing else, so every gear keeps the target."""
    _check_plannable(operators, names)
    generating = [n for n in names if operators[n].plan_kind == "generation"]
    names = [n for n in names if n not in generating]  # classifier functions, together
    if generating and not (qps is not None and qps > 0):
        raise KenError(f"planning {', '.join(generating)}() needs the mean rate of its "
                       "requests, > 0: plan(target, functions=[...], qps=0.3) (requests per "
                       f"second; `ken plan --qps`); got {qps}")
    if generating and not (trace is None or trace == "azure" or isinstance(trace, Trace)):
        raise KenError(f"generating functions are planned on the Azure trace or a Trace you "
                       f"pass, not {trace!r}")
    if names:  # what the classifier functions cannot take fails before any model runs
        target.for_classifiers()
        check_planning_args(devices, memory_gb, threads_per_device, peak_qps, duration_s,
                            num_ranges, gpus)
    arrivals = trace.arrival_s if isinstance(trace, Trace) else None
    made = [plan_generating(operators[n], ctx, target, qps, rows, requests, arrivals).plan
            for n in generating]
    made_accuracy = [p.predicted.accuracy for p in made]
    if not names:
        return QueryPlan(target, tuple(made), tuple(made_accuracy), None), {}, {}, {}
    chose_gpus = hardware is None and gpus is None and devices is None  # found by itself
    hardware = hardware or local_hardware(devices, memory_gb, gpus, gpu_memory_gb)
    try:
        profiles, prepared, certified = _profiled(operators, ctx, names, hardware,
                                                  threads_per_device, guarantees)
    except DeviceProfileError as exc:
        if not chose_gpus:
            raise
        # GPUs the user did not ask for: plan the CPU workers a machine without them gets
        ctx.reporter.note(f"{exc}; planning for 2 CPU workers instead of the GPUs")
        hardware = local_hardware(None, memory_gb, gpus=0)
        profiles, prepared, certified = _profiled(operators, ctx, names, hardware,
                                                  threads_per_device, guarantees)
    settings = settings or PlannerSettings(num_ranges=num_ranges)
    catalogs = {n: prepared[n][0] for n in names}
    if peak_qps is None:  # the slowest operator sets the load the query can be planned for
        peak_qps = min(default_peak_qps(cat, cascades, hardware)
                       for cat, cascades in prepared.values())
        if peak_qps > MAX_DEFAULT_PEAK_QPS:
            ctx.reporter.note(f"planning up to {MAX_DEFAULT_PEAK_QPS:g} qps (the models "
                              f"sustain about {peak_qps:g}); pass peak_qps= to plan for more")
            peak_qps = MAX_DEFAULT_PEAK_QPS
    plan_trace = planning_trace("azure" if trace is None else trace, peak_qps, duration_s)
    frontiers = {}
    for n in names:
        catalog, cascades = prepared[n]
        frontiers[n], _stats = plan_operator(
            n, profiles[n], catalog, cascades, hardware, plan_trace, peak_qps,
            replace(settings, only_candidates=True) if n in certified else settings,
            cache_dir=cache_dir, reporter=ctx.reporter, force=force)
    # the query optimizer simulates with the runtimes the frontiers were planned with
    charged = {n: c.with_overhead(hardware.dispatch_s) for n, c in catalogs.items()}
    replans = {n: GearReplan(n, catalogs[n], prepared[n][1], hardware, target,
                             fallbacks=frontiers[n].one_gear)
               for n in names}
    for n in certified:  # re-planning online serves the certified cascades only, too
        replans[n] = replace(replans[n], settings=replace(replans[n].settings,
                                                          only_candidates=True))
    return (choose_plans(frontiers, charged, plan_trace, target).with_plans(made, made_accuracy),
            frontiers, replans, certified)
