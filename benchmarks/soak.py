"""Soak: serve a plan for an hour and watch what grows (issue 38, item 4).

The packaged sentiment family, planned for 2 CPU workers x 1 thread on Poisson arrivals (as
``benchmarks/reliability.py``) with runtimes calibrated as ``ken plan`` does by default
(``--calibration-s``, 0 plans on the profiles as before session 34): the middle plan of the
frontier and the fastest are served in worker processes (the online engine, default
admission), swapped every ``--replan-every-s``
(the plan-swap path a re-plan takes); a generating function beside it in this process
(SmolLM2-135M on a continuous-batching decode server, a short answer every
``--gen-every-s``; at background CPU priority by default, ``--decode-priority``). Arrivals
are Poisson at ``--load`` (0.8) x the plan's peak on the cores
the decode server leaves (its share measured for 20 s before the clock starts; the plan was
made for every core, and two servers share one machine), with a burst at ``--burst`` (1.5)
x that peak for ``--burst-s`` every ``--burst-every-s``; a worker is
SIGKILLed every ``--kill-every-s`` (the devices in turn; a model a plan places on one worker
has a standby copy on the other by default, ``--standby``). Before the clock starts the decode
server runs every shape it will meet (``warm_up_decoding``; ``--gen-warmup 0`` skips it): its
memory grows with the shapes it has seen, then levels off.

Every ``--sample-s`` it records the resident memory, threads and open files of this process
and its workers (``ken.machine.tree_usage``), the classifier's p99 over the window (answered
requests), outcomes so far, and what the machine did meanwhile: other programs' cores and the
hypervisor's steal (``ken.machine.other_cores``), how late the load generator's own sleeps
woke, and the longest pause of Python's garbage collector in this process. At the end every
request must have exactly one outcome. Goals (docs/reliability.md): RSS growth < 50 MB after
warm-up (the first ``--warmup-s``), no growth in open files or threads, p99 within 2x the
plan's latency target in the windows outside bursts and kills (the target of the plan serving
then), 0 lost.

    python benchmarks/soak.py                       # an hour, ~62 min with setup
    python benchmarks/soak.py --minutes 5 --out DIR  # the short version (tests/test_soak.py)

Writes DIR/soak.json and DIR/soak.png.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ken.engine.calibrate import Calibration, CalibrationCalls, calibration_calls  # noqa: E402
from ken.engine.decode import DecodeServer  # noqa: E402
from ken.engine.serving import Engine  # noqa: E402
from ken.machine import cpu_reading, other_cores, steal_cores, tree_usage  # noqa: E402
from ken.models import family  # noqa: E402
from ken.models.model import DeviceConfig  # noqa: E402
from ken.ops.base import shared_resources  # noqa: E402
from ken.optimizer.perf import Catalog  # noqa: E402
from ken.optimizer.planner import PlannerSettings, plan_frontier  # noqa: E402
from ken.optimizer.planning import (  # noqa: E402
    default_peak_qps,
    family_profiles,
    planning_inputs,
    planning_trace,
)
from ken.optimizer.tokens import random_prompts  # noqa: E402
from ken.optimizer.workload import Hardware  # noqa: E402
from ken.policy.plan import GearPlan  # noqa: E402
from ken.progress import Reporter  # noqa: E402
from ken.session import connect  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "soak"
GOALS = {"rss_growth_mb": 50.0, "p99_over_target": 2.0, "lost": 0}
#: how long after a worker kill its cost is looked for (``after_kill``)
KILL_COST_S = 30.0
#: the classifier plan's CPU workers (one thread each)
PLAN_CORES = 2


class ToServe(NamedTuple):
    """What ``plans_to_serve`` returns."""

    main: GearPlan
    fast: GearPlan
    loaders: dict  # for every model either plan places
    sample: Any
    calibration: Calibration | None
    profiles: Catalog  # the profiles' runtimes (the calibration not applied)


def soak_setup(reporter: Reporter) -> tuple[Catalog, list, Hardware, dict, Any]:
    """The packaged family's profiles as a catalog, its Pareto cascades, the soak's two CPU
    workers, a loader per model (one thread each) and the sample."""
    data, cards, sample, profiles = family_profiles(reporter)
    device = DeviceConfig(threads=1)
    catalog, cascades = planning_inputs(profiles)
    loaders = {c.name: functools.partial(family.load_model, c, device, None, data)
               for c in cards}
    return catalog, cascades, Hardware.cpu_workers(PLAN_CORES, 4 * 2**30), loaders, sample


def family_calibration(reporter: Reporter, seed: int, seconds: float,
                       rate: float | None = None, setup: tuple | None = None) -> Calibration:
    """The runtimes of every model of the family's cascades calibrated as ``ken plan`` does
    (``measure_calibration``; with ``rate``, at that serving rate too), on ``setup``
    (``soak_setup``'s, made here when not given)."""
    calibration = family_calibration_calls(reporter, seed, seconds, rate, setup).moved(
        reporter=reporter)
    reporter.note(f"runtimes calibrated: {calibration.describe()}")
    return calibration


def family_calibration_calls(reporter: Reporter, seed: int, seconds: float,
                             rate: float | None = None,
                             setup: tuple | None = None) -> CalibrationCalls:
    """What ``family_calibration`` measures, before it is moved to the serving rate
    (``calibration_calls``)."""
    catalog, cascades, hardware, loaders, sample = setup or soak_setup(reporter)
    models = {m for c in cascades for m in c.models}
    return calibration_calls(catalog, {m: loaders[m] for m in models}, sample, hardware,
                             seconds, seed=seed + 1, reporter=reporter, rate=rate)


def plans_to_serve(reporter: Reporter, seed: int, calibration_s: float = 0.0,
                   plan_calibrated: bool = True, setup: tuple | None = None) -> ToServe:
    """The family's frontier on Poisson arrivals; the middle plan (under 1 s) and the
    fastest, with loaders for every model either places. With ``calibration_s`` > 0 the
    runtimes are calibrated first, as ``ken plan`` does by default (``measure_calibration``:
    every model of the cascades served for that long), and planned on unless
    ``plan_calibrated`` is False; else the profiles' are planned on. ``setup``: what
    ``soak_setup`` returned, if the caller has it."""
    setup = setup or soak_setup(reporter)
    catalog, cascades, hardware, loaders, sample = setup
    calibration, planned = None, catalog
    if calibration_s > 0:
        calibration = family_calibration(reporter, seed, calibration_s, setup=setup)
        if plan_calibrated:
            planned = calibration.apply(catalog)
    peak = default_peak_qps(planned, cascades, PLAN_CORES)
    trace = planning_trace("poisson", peak, 60.0, seed=seed)
    frontier, _ = plan_frontier("sentiment", cascades, planned, hardware, trace,
                                settings=PlannerSettings(num_ranges=4, seed=seed),
                                reporter=reporter)
    usable = [p for p in frontier.plans if p.predicted.p95_ms < 1000.0]
    main, fast = usable[len(usable) // 2], usable[0]
    used = {r.model for p in (main, fast) for r in p.placement}
    return ToServe(main, fast, {m: f for m, f in loaders.items() if m in used}, sample,
                   calibration, catalog)


class Window:
    """Outcomes since the last sample (the futures' callbacks add, the sampler takes), and
    every outcome's count. Only the requests in flight are held (``pending``): a soak that
    kept every future would measure its own bookkeeping as growth."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latency_ms: list[float] = []
        self.gen_ms: list[float] = []
        self.status: dict[str, int] = {}
        self.total: dict[str, int] = {}
        self.pending: set[Future] = set()
        self.submitted = 0

    def track(self, kind: str, future: Future) -> None:
        with self.lock:
            self.pending.add(future)
            self.submitted += 1
        future.add_done_callback(functools.partial(self.add, kind))

    def add(self, kind: str, future: Future) -> None:
        o = future.result()
        with self.lock:
            self.pending.discard(future)
            key = f"{kind}:{o.status}"
            self.status[key] = self.status.get(key, 0) + 1
            self.total[key] = self.total.get(key, 0) + 1
            if o.status == "ok":
                (self.latency_ms if kind == "classify" else self.gen_ms).append(
                    1000 * o.latency_s)

    def take(self) -> tuple[list[float], list[float], dict[str, int]]:
        with self.lock:
            out = self.latency_ms, self.gen_ms, self.status
            self.latency_ms, self.gen_ms, self.status = [], [], {}
        return out


class Collections:
    """The pauses of Python's cyclic garbage collector in this process (``gc.callbacks``; a
    collection holds the GIL, so every thread of ken's process waits for it): the longest in
    the window and how many were full (generation 2). Registered while it is entered."""

    def __init__(self) -> None:
        self.longest_s, self.full = 0.0, 0
        self._started: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.longest_s = max(self.longest_s, time.perf_counter() - self._started)
            self.full += info.get("generation") == 2
            self._started = None

    def take(self) -> tuple[float, int]:
        out = self.longest_s, self.full
        self.longest_s, self.full = 0.0, 0
        return out

    def __enter__(self) -> Collections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def run(args: argparse.Namespace, reporter: Reporter) -> dict:
    main, other, loaders, sample, calibration, _ = plans_to_serve(reporter, args.seed,
                                                                  args.calibration_s)
    placement = [[f"{r.model}@{'+'.join(r.devices)}" for r in p.placement] for p in (main, other)]
    target_s = main.latency_target_s()
    assert target_s is not None
    with connect(device=DeviceConfig(threads=1)) as session:
        lm = shared_resources(session.ctx).causal_lm("smollm2-135m")
    texts = list(sample.texts)
    rng = np.random.default_rng(args.seed)
    prompts = [random_prompts(lm, 1, int(k), rng)[0] for k in rng.integers(16, 64, 32)]
    peak = main.qps_max
    duration = 60.0 * args.minutes
    window = Window()
    samples, events = [], []
    reporter.note(f"soak: {args.minutes:g} min at {args.load:g}x the plan's peak "
                  f"({peak:g} qps), bursts {args.burst:g}x for {args.burst_s:g} s every "
                  f"{args.burst_every_s:g} s, a worker killed every {args.kill_every_s:g} s, "
                  f"the plan swapped every {args.replan_every_s:g} s, a generation every "
                  f"{args.gen_every_s:g} s; target p99 {1000 * target_s:.0f} ms")
    server = DecodeServer(lm, 4, ignore_eos=True, cpu_priority=args.decode_priority).start()
    warm_up_decoding(server, lm, range(16, 64), 4 if args.gen_warmup else 0, 12, rng,
                     reporter)
    share = decode_share(server, prompts, args, rng) if args.account_decode else 0.0
    classify_peak = peak * (1.0 - share)
    reporter.note(f"the decode server takes {share:.1%} of the plan's cores at one "
                  f"generation every {args.gen_every_s:g} s: the classifier's load is "
                  f"{args.load:g}x the {classify_peak:.1f} qps the plan can serve on the rest")
    with Engine(main, loaders, workers="process", standby=bool(args.standby)) as engine, \
            Collections() as collections:
        devices = sorted(engine.pids())
        plans = [main, other]
        serving = main
        t0 = time.monotonic()
        next_at = {"sample": args.sample_s, "kill": args.kill_every_s,
                   "replan": args.replan_every_s, "gen": 0.0}
        kills = swaps = 0
        arrival = 0.0
        cpu, late = cpu_reading(), 0.0  # the machine at the window's start; oversleep (s)
        while (now := time.monotonic() - t0) < duration:
            if now >= next_at["sample"]:
                lat, gen, status = window.take()
                use = tree_usage()
                host = tree_usage(os.getpid(), alone=True)
                cpu_now = cpu_reading()
                gc_s, gc_full = collections.take()
                machine = None if cpu is None or cpu_now is None else {
                    "other_cores": other_cores(cpu, cpu_now),
                    "steal_cores": steal_cores(cpu, cpu_now)}
                samples.append({
                    "t_s": round(now, 1), "rss_mb": use.rss_bytes / 2**20 if use else None,
                    "host_rss_mb": host.rss_bytes / 2**20 if host else None,
                    "threads": use.threads if use else None,
                    "open_files": use.open_files if use else None,
                    "processes": use.processes if use else None,
                    "answered": len(lat),
                    "p99_ms": float(np.percentile(lat, 99)) if lat else None,
                    "gen_max_ms": max(gen) if gen else None,
                    "status": status, "in_burst": in_burst(now - args.sample_s, now, args),
                    "target_ms": 1000 * (serving.latency_target_s() or target_s),
                    **(machine or {}), "late_ms": 1000 * late,
                    "gc_max_ms": 1000 * gc_s, "gc_full": gc_full})
                cpu, late = cpu_now, 0.0
                next_at["sample"] += args.sample_s
            if now >= next_at["kill"]:
                device = devices[kills % len(devices)]
                pid = engine.pids().get(device)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    events.append({"t_s": round(now, 1), "event": f"SIGKILL {device}",
                                   "plan": plans.index(serving)})
                kills += 1
                next_at["kill"] += args.kill_every_s
            if now >= next_at["replan"]:
                swaps += 1
                serving = plans[swaps % 2]
                moved = engine.swap_plan(serving)
                events.append({"t_s": round(now, 1),
                               "event": f"plan swap ({moved} queued rows moved)"})
                next_at["replan"] += args.replan_every_s
            if now >= next_at["gen"]:
                prompt = prompts[int(rng.integers(len(prompts)))]
                window.track("generate", server.submit(prompt, int(rng.integers(4, 12))))
                next_at["gen"] += args.gen_every_s
            if now >= arrival:
                window.track("classify", engine.submit(texts[int(rng.integers(len(texts)))]))
                rate = classify_peak * (args.burst if in_burst(now, now, args) else args.load)
                arrival += rng.exponential(1.0 / rate)
            # how long a sleep overran (not how far the loop is behind its schedule)
            wake = max(min(arrival, *next_at.values()), time.monotonic() - t0)
            time.sleep(max(0.0, wake - (time.monotonic() - t0)))
            late = max(late, time.monotonic() - t0 - wake)
        done_by = time.monotonic() + 120.0
        while window.pending and time.monotonic() < done_by:
            time.sleep(0.1)
        restarts = engine.worker_restarts
        moved = engine.moved_batches
    server.shutdown()
    with window.lock:
        lost = len(window.pending)
        outcomes = dict(window.total)
    result = summarise(args, samples, events, window.submitted, outcomes, lost, restarts,
                       target_s, main, other)
    result["moved_batches"] = moved
    result["placement"] = placement
    result["calibration"] = None if calibration is None else calibration.describe()
    result["decode_share"] = share
    result["decode_priority"] = args.decode_priority
    result["classify_peak_qps"] = classify_peak
    return result


def decode_share(server: DecodeServer, prompts: list, args: argparse.Namespace,
                 rng: np.random.Generator, seconds: float = 20.0) -> float:
    """The share of the classifier plan's cores (``PLAN_CORES``) the decode server takes at
    the soak's rate of generations, measured alone for ``seconds``: its pass time per second
    times its threads, less the cores the plan leaves free on this machine, over the plan's
    cores. The plan was made for its cores alone; the soak serves it at ``--load`` of what
    the decode server leaves it, so that the cores are at the load the soak names and not
    past it (two servers on one machine share it)."""
    threads = server.lm.device.threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    spare = max(0, (cores or PLAN_CORES) - PLAN_CORES)
    busy0, t0 = server.busy_s, time.monotonic()
    while time.monotonic() - t0 < seconds:
        started = time.monotonic()
        server.submit(prompts[int(rng.integers(len(prompts)))],
                      int(rng.integers(4, 12))).result()
        time.sleep(max(0.0, args.gen_every_s - (time.monotonic() - started)))
    busy = (server.busy_s - busy0) / (time.monotonic() - t0)
    return min(0.9, max(0.0, busy * threads - spare) / PLAN_CORES)


def warm_up_decoding(server: DecodeServer, lm: object, lengths: range, batches: int,
                     max_new: int, rng: np.random.Generator, reporter: Reporter) -> None:
    """Before the clock starts, have the decode server run every shape it will meet: for
    each batch size up to ``batches`` and each prompt length in ``lengths``, that many
    prompts of that length at once, each generating ``max_new`` tokens (so every decode width
    from the prompt up to prompt + ``max_new`` at that batch size). The memory a decode server
    holds grows with the shapes it has seen (per-shape kernel caches, docs/reliability.md)
    and levels off once it has seen them: that is warm-up, not a leak; random generations
    took about 700 to see them all."""
    if batches <= 0:
        return
    started = time.perf_counter()
    groups = 0
    for b in range(1, batches + 1):
        for length in lengths:
            group = [server.submit(random_prompts(lm, 1, length, rng)[0], max_new)
                     for _ in range(b)]
            for f in group:
                f.result()
            groups += 1
    reporter.note(f"decode server warmed up on every shape: {groups} groups in "
                  f"{time.perf_counter() - started:.0f} s")


def in_burst(start: float, end: float, args: argparse.Namespace) -> bool:
    """Whether ``[start, end]`` meets a burst (each starts at a multiple of the period)."""
    period = args.burst_every_s
    first = np.floor(max(start, 0.0) / period) * period
    return any(b < end + 1e-9 and b + args.burst_s > start
               for b in (first, first + period) if b > 0)


def summarise(args, samples, events, submitted, outcomes, lost, restarts, target_s,  # noqa: ANN001
              main, other) -> dict:
    warm = [s for s in samples if s["t_s"] >= args.warmup_s and s["rss_mb"] is not None]

    def growth(key: str) -> float | None:
        if len(warm) < 6:
            return None
        return float(np.median([s[key] for s in warm[-3:]]) -
                     np.median([s[key] for s in warm[:3]]))

    kill_events = [e for e in events if e["event"].startswith("SIGKILL")]
    kill_times = [e["t_s"] for e in kill_events]
    calm = [s for s in warm if not s["in_burst"] and s["p99_ms"] is not None and
            not any(0 <= s["t_s"] - k <= 2 * args.sample_s for k in kill_times)]
    within = [s["p99_ms"] <= GOALS["p99_over_target"] * s["target_ms"] for s in calm]
    # each kill's cost: the worst window p99 of the 30 s after it (rows that wait for a
    # reload are answered when it ends, which can be after the 10 s the goal leaves out)
    after_kill = [{"t_s": e["t_s"], "device": e["event"].split()[1],
                   "plan": ("main", "fast")[e["plan"]], "worst_p99_ms": max(
        (s["p99_ms"] for s in samples if s["p99_ms"] is not None
         and 0 < s["t_s"] - e["t_s"] <= KILL_COST_S), default=None)} for e in kill_events]
    out = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "plans": [main.headline(), other.headline()], "peak_qps": main.qps_max,
        "latency_target_ms": 1000 * target_s, "requests": submitted, "lost": lost,
        "outcomes": sum(outcomes.values()), "status": outcomes, "worker_restarts": restarts,
        "events": events,
        "rss_growth_mb": growth("rss_mb"), "host_rss_growth_mb": growth("host_rss_mb"),
        "open_files_growth": growth("open_files"),
        "threads_growth": growth("threads"),
        "calm_windows": len(calm), "calm_windows_p99_within_2x": int(sum(within)),
        "generation_max_ms": generation_max_ms(samples),
        "calm_p99_ms_max": max((s["p99_ms"] for s in calm), default=None),
        "after_kill": after_kill,
        "kills_over_1s": sum(1 for a in after_kill
                             if a["worst_p99_ms"] is not None and a["worst_p99_ms"] > 1000),
        "calm_missed_vs_held": missed_vs_held(calm, within),
        "samples": samples}
    out["goals"] = {
        "rss_growth_under_50mb": out["rss_growth_mb"] is not None and
        out["rss_growth_mb"] < GOALS["rss_growth_mb"],
        "no_growth_in_open_files": out["open_files_growth"] is not None and
        out["open_files_growth"] <= 0,
        "no_growth_in_threads": out["threads_growth"] is not None and
        out["threads_growth"] <= 0,
        "calm_p99_within_2x": bool(calm) and all(within), "none_lost": lost == 0}
    return out


def missed_vs_held(calm: list[dict], within: list[bool]) -> dict:
    """The calm windows that missed 2x of the target against those that held: the median of
    other programs' cores (``other_cores``, the hypervisor's ``steal_cores`` among them), the
    load generator's worst oversleep in the window (``late_ms``: this process waiting for a
    core or the GIL), the longest pause of the garbage collector in this process
    (``gc_max_ms``), the share of classifier requests turned away and the window's slowest
    generation."""
    def medians(windows: list[dict]) -> dict:
        def median(values: list) -> float | None:
            values = [v for v in values if v is not None]
            return float(np.median(values)) if values else None

        def turned_away(s: dict) -> float | None:
            n = sum(v for k, v in s["status"].items() if k.startswith("classify:"))
            return s["status"].get("classify:rejected", 0) / n if n else None

        return {"windows": len(windows),
                **{key: median([s.get(key) for s in windows])
                   for key in ("other_cores", "steal_cores", "late_ms", "gc_max_ms",
                               "gen_max_ms")},
                "turned_away": median([turned_away(s) for s in windows])}

    return {"missed": medians([s for s, ok in zip(calm, within, strict=True) if not ok]),
            "held": medians([s for s, ok in zip(calm, within, strict=True) if ok])}


def generation_max_ms(samples: list[dict]) -> dict | None:
    """The generations' latency (arrival to last token): the median, p99 and largest over the
    run of each window's slowest generation."""
    gens = [s["gen_max_ms"] for s in samples if s.get("gen_max_ms") is not None]
    if not gens:
        return None
    return {"p50": float(np.median(gens)), "p99": float(np.percentile(gens, 99)),
            "max": float(max(gens))}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = [x["t_s"] / 60 for x in s]
    fig, ax = plt.subplots(1, 4, figsize=(18, 3.6))
    ax[0].plot(t, [x["rss_mb"] for x in s], ".-", label="ken and its workers")
    ax[0].plot(t, [x["host_rss_mb"] for x in s], ".-", label="ken's process")
    ax[0].set_ylabel("RSS (MB)")
    ax[0].legend(fontsize=8)
    ax[1].plot(t, [x["threads"] for x in s], ".-", label="threads")
    ax[1].plot(t, [x["open_files"] for x in s], ".-", label="open files")
    ax[1].legend(fontsize=8)
    ax[2].plot(t, [x["p99_ms"] for x in s], ".-", label="p99 of the window")
    ax[2].plot(t, [x["target_ms"] for x in s], color="k", lw=0.8,
               label="the serving plan's target")
    ax[2].plot(t, [2 * x["target_ms"] for x in s], color="r", lw=0.8, ls="--", label="2x")
    ax[2].plot(t, [x.get("gen_max_ms") for x in s], ".", ms=2, color="0.6",
               label="the window's slowest generation")
    ax[2].set_yscale("log")
    ax[2].set_ylabel("ms")
    ax[2].legend(fontsize=8)
    ax[3].plot(t, [x.get("other_cores") for x in s], ".-", label="other programs' cores")
    ax[3].plot(t, [x.get("steal_cores") for x in s], ".-", label="stolen by the hypervisor")
    ax[3].plot(t, [None if x.get("late_ms") is None else x["late_ms"] / 1000 for x in s],
               ".", ms=2, color="0.6", label="load generator's worst oversleep (s)")
    ax[3].set_ylabel("cores (or s)")
    ax[3].legend(fontsize=8)
    for a in ax:
        a.set_xlabel("minutes")
        a.grid(alpha=0.3)
        for e in result["events"]:
            a.axvline(e["t_s"] / 60, color="0.8", lw=0.6, zorder=0)
    fig.suptitle(f"soak: {result['requests']:,} requests, {result['lost']} lost "
                 "(grey lines: worker kills and plan swaps)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--burst", type=float, default=1.5)
    ap.add_argument("--burst-s", type=float, default=5.0)
    ap.add_argument("--burst-every-s", type=float, default=60.0)
    ap.add_argument("--kill-every-s", type=float, default=120.0)
    ap.add_argument("--replan-every-s", type=float, default=300.0)
    ap.add_argument("--gen-every-s", type=float, default=2.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--warmup-s", type=float, default=60.0)
    ap.add_argument("--gen-warmup", type=int, default=1, choices=(0, 1),
                    help="1 (default): the decode server runs every shape it will meet "
                         "before the clock starts; 0: no warm-up")
    ap.add_argument("--account-decode", type=int, default=1, choices=(0, 1),
                    help="1 (default): the classifier's load is --load x the peak of what "
                         "the decode server leaves of the plan's cores (measured for 20 s "
                         "first); 0: x the plan's peak, as if the plan had its cores alone")
    ap.add_argument("--decode-priority", choices=("background", "normal"),
                    default="background",
                    help="the decode server's CPU priority (default background: its passes "
                         "on the cores the classifier leaves, benchmarks/decode_priority.py; "
                         "normal: they share the cores, as before session 32)")
    ap.add_argument("--standby", type=int, default=1, choices=(0, 1),
                    help="1 (default): a model a plan places on one worker has a standby "
                         "copy on the other (Engine(standby=True)); 0: only what the plans "
                         "place, as before session 33")
    ap.add_argument("--calibration-s", type=float, default=10.0,
                    help="seconds of serving that calibrate the runtimes the plans are made "
                         "on, as `ken plan` does by default (10); 0: plan on the profiles "
                         "alone, as before session 34")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.load <= 0 or args.sample_s <= 0:
        ap.error("--minutes, --load and --sample-s must be > 0")
    if args.calibration_s < 0:
        ap.error("--calibration-s must be >= 0")
    reporter = Reporter(args.quiet)
    started = time.perf_counter()
    result = run(args, reporter)
    result["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "soak.png")
    print(json.dumps({k: result[k] for k in ("requests", "lost", "status", "worker_restarts",
                                              "moved_batches", "kills_over_1s",
                                              "rss_growth_mb", "host_rss_growth_mb",
                                              "open_files_growth",
                                              "threads_growth", "calm_windows",
                                              "generation_max_ms",
                                              "calm_windows_p99_within_2x",
                                              "calm_missed_vs_held", "goals")}))
    print(f"wrote {args.out}/soak.json and soak.png in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
