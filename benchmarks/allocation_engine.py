"""A pipeline's joint allocation (Loki) served on the online engine and re-solved online,
measured on this CPU beside the simulator's prediction (issue 37, item 2).

``ken.engine.allocated.AllocatedPipeline`` against the simulation of the same allocations
(``ken.optimizer.reallocation``) on the same arrivals.

- **Pipeline**: two operators over the packaged sentiment family's held-out texts, ``detect``
  and ``classify``, each with the variants MiniLM-L3 and MiniLM-L6 (SmolLM2 is 20x slower and
  less accurate than L6 on this family: never worth a worker). Route class 0 (60% of the
  requests) passes both operators, class 1 (40%) only ``classify``. A request is right when
  every hop's label equals the row's label; a path's accuracy is that share measured on the
  sample rows (per row, not a product of single accuracies).
- **Workers**: ``cpu0`` and ``cpu1``, one worker process each (one torch thread); every
  variant loaded on both before serving. A variant's requests per second at each batch size
  on one worker come from the profiles, calibrated to serving calls first (what ``ken plan``
  does by default; ``--profiles-only`` skips it).
- **Demand**: a step, Poisson arrivals, ``--phase-s`` at 1x, then 3x, then 1x, where 1x is the
  most demand the most accurate variants serve within the SLO (``--slo-ms``) on both workers
  (Loki's step 1; bisection).
- **Systems**: the allocation fixed for 1x, fixed for 3x, Loki's controller (re-solved every
  ``--every-s`` for 1.1x an EWMA, weight 0.5, of the rate measured), the same closed over
  the requests inside the pipeline, and that read four times a period (re-solving at once
  when the backlog asks for a quarter more demand); each with no dropping and with proactive
  dropping (PARD;
  every request's deadline is the SLO). Each is served by its own engine, then simulated
  (``simulate_schedule``, ``simulate_closed_loop``) on the same arrivals.
- **Per system**, measured and simulated: quality per request (right and within the SLO: 1;
  wrong, late, dropped or turned away: 0; simulated: the path's measured accuracy when on
  time), the share on time, the share turned away, the allocations' changes, and each phase.

Writes ``--out``/allocation_engine.json and .png.

    python benchmarks/allocation_engine.py --out DIR            # about 7 minutes
    python benchmarks/allocation_engine.py --quick --out DIR    # about 2.5 minutes
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OPERATORS = ("detect", "classify")
VARIANTS = ("minilm-l3", "minilm-l6")
ROUTES = ((0, 1), (1,))
SHARES = (0.6, 0.4)
DEVICES = ("cpu0", "cpu1")
BATCHES = (1, 2, 4, 8, 16)
LOADS = (1.0, 3.0, 1.0)


def setup(calibrate: bool) -> tuple:
    """The family's held-out sample, its loaders for worker processes and the catalog (its
    profiles, calibrated to serving calls unless ``calibrate`` is false)."""
    from e2e import family_setup

    from ken.models import family
    from ken.models.model import DeviceConfig
    from ken.optimizer.perf import Catalog
    from ken.progress import Reporter

    sample, models, loaders, profiles = family_setup(
        family.FamilyData("mixed", 6000, 1500), DeviceConfig(threads=1), "process",
        Reporter(quiet=True))
    del models
    catalog = Catalog.from_profiles({m: profiles[m] for m in VARIANTS})
    described = None
    if calibrate:
        from ken.engine.calibrate import measure_calibration
        from ken.optimizer.workload import Hardware

        calibration = measure_calibration(catalog, {m: loaders[m] for m in VARIANTS}, sample,
                                          Hardware.cpu_workers(2, 4 * 10**9), seconds=8.0,
                                          workers="process")
        catalog = calibration.apply(catalog)
        described = calibration.describe()
        print(f"calibrated runtimes: {described}", flush=True)
    return sample, {m: loaders[m] for m in VARIANTS}, catalog, described


def problem_maker(catalog, slo_s: float):  # noqa: ANN001, ANN201
    """``problem_for(demand)``: the allocation problem of this pipeline."""
    from ken.optimizer.allocation import AllocationProblem, Variant

    right = {m: catalog.quality[m] for m in VARIANTS}
    variants = []
    for m in VARIANTS:
        table = catalog.perf_on(m, "cpu0").runtime_table(1, max(BATCHES))
        variants.append(Variant(m, float(right[m].mean()), {b: b / table[b] for b in BATCHES}))
    accuracy = {}
    for r, route in enumerate(ROUTES):
        for combo in itertools.product(VARIANTS, repeat=len(route)):
            accuracy[(r, combo)] = float(np.prod([right[m] for m in combo], axis=0).mean())

    def problem_for(demand: float):  # noqa: ANN202
        return AllocationProblem(OPERATORS, (tuple(variants),) * len(OPERATORS), ROUTES, SHARES,
                                 accuracy, demand, len(DEVICES), slo_s)
    return problem_for


def one_x(problem_for) -> float:  # noqa: ANN001
    """The most demand the most accurate variants serve within the SLO (Loki's step 1)."""
    from ken.optimizer.allocation import allocate

    lo, hi = 0.1, 1e5
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if allocate(problem_for(mid)).step == "hardware" else (lo, mid)
    return lo


def step_trace(base: float, phase_s: float, seed: int):  # noqa: ANN201
    from ken.optimizer.workload import Trace, poisson_trace

    parts = [poisson_trace(load * base, phase_s, seed + k).arrival_s + k * phase_s
             for k, load in enumerate(LOADS)]
    return Trace(np.concatenate(parts), "step")


def serve(control, solver, base: float, loaders, sample, trace, classes, rows,  # noqa: ANN001
          slo_s: float, dropping: str, seed: int) -> dict:
    """One system on the engine: every request at its arrival time; quality per request."""
    from ken.engine.allocated import AllocatedPipeline

    n = len(trace)
    names = sample.label_names
    with AllocatedPipeline(solver, base, DEVICES, loaders, control=control, seed=seed,
                           workers="process", threads_per_device=1,
                           dropping=None if dropping == "none" else dropping,
                           drain_on_sigterm=False) as pipe:
        # the workers warmed every variant up when they loaded it; no request before the
        # trace, so the controller's first period measures the trace alone
        clock = pipe.engine.clock
        start = clock.now() + 0.05
        futures = []
        for i in range(n):
            wait = start + trace.arrival_s[i] - clock.now()
            if wait > 0:
                time.sleep(wait)
            futures.append(pipe.submit(sample.texts[rows[i]], int(classes[i]),
                                       deadline_s=start + trace.arrival_s[i] + slo_s))
        outcomes = [f.result(timeout=120) for f in futures]
        changes = [{"time_s": c.time_s - start, "demand_qps": c.demand_qps,
                    "hosts": list(c.hosts), "swapped": list(c.swapped)} for c in pipe.changes]
        moved, errors = pipe.moved, list(pipe.control_errors)
    quality = np.zeros(n)
    on_time = np.zeros(n, dtype=bool)
    status = [o.status for o in outcomes]
    for i, o in enumerate(outcomes):
        if o.status != "ok":
            continue
        on_time[i] = o.completion_s - (start + trace.arrival_s[i]) <= slo_s
        label = names[int(sample.labels[rows[i]])]
        quality[i] = float(on_time[i] and all(v == label for v in o.values))
    return {"quality": quality, "on_time": on_time,
            "turned_away": np.array([s == "rejected" for s in status]),
            "dropped": np.array([s == "dropped" for s in status]),
            "changes": changes, "moved": moved, "control_errors": errors}


def simulate(control, solver, base: float, catalog, trace, slo_s: float, dropping: str,  # noqa: ANN001
             seed: int, duration_s: float) -> dict:
    """The same system in the simulator."""
    from ken.optimizer.reallocation import (
        ClosedLoop,
        fixed_schedule,
        online_schedule,
        periods_of,
        serve_schedule,
        simulate_closed_loop,
        simulate_schedule,
    )
    from ken.policy.dropping import DropPolicy

    policy = None if dropping == "none" else DropPolicy.named(dropping)
    if isinstance(control, ClosedLoop):
        got = simulate_closed_loop(control, solver, base, DEVICES, catalog, trace, duration_s,
                                   slo_s, seed, policy)
        schedule, run = got.schedule, got.run
    else:
        every = control.every_s if control is not None else 2.0
        periods = periods_of(trace.arrival_s, duration_s, every)
        schedule = (fixed_schedule(solver(base)[0], periods, every) if control is None else
                    online_schedule(solver.problem_for, trace, duration_s, base, control))
        run = simulate_schedule(schedule, serve_schedule(schedule, DEVICES), catalog, trace,
                                slo_s, seed, policy)
    return {"quality": run.quality, "on_time": run.on_time, "turned_away": run.path < 0,
            "changes": schedule.changes, "demands": list(schedule.demands)}


def summary(got: dict, trace, phase_s: float) -> dict:  # noqa: ANN001
    phases = []
    for k in range(len(LOADS)):
        mine = (trace.arrival_s >= k * phase_s) & (trace.arrival_s < (k + 1) * phase_s)
        phases.append({"load": LOADS[k], "quality": float(got["quality"][mine].mean()),
                       "on_time": float(got["on_time"][mine].mean())})
    return {"quality": float(got["quality"].mean()), "on_time": float(got["on_time"].mean()),
            "turned_away": float(got["turned_away"].mean()), "phases": phases}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = result["systems"]
    labels = [f"{r['system']}\n{r['dropping']}" for r in rows]
    x = np.arange(len(rows))
    for ax, key, title in ((axes[0], "quality", "quality per request"),
                           (axes[1], "on_time", "share on time")):
        ax.bar(x - 0.2, [r["measured"][key] for r in rows], 0.4, label="engine (measured)")
        ax.bar(x + 0.2, [r["simulated"][key] for r in rows], 0.4, label="simulated")
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"joint allocation on the engine: 1x -> 3x -> 1x ({result['one_x_qps']:.0f} "
                 f"req/s at 1x), SLO {result['slo_s'] * 1000:.0f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true",
                    help="5-s phases, proactive dropping only")
    ap.add_argument("--phase-s", type=float, default=None, help="seconds per phase (10)")
    ap.add_argument("--every-s", type=float, default=1.0, help="the controller's period")
    ap.add_argument("--slo-ms", type=float, default=300.0)
    ap.add_argument("--profiles-only", action="store_true",
                    help="no serving calibration of the profiles")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.slo_ms <= 0 or args.every_s <= 0 or (args.phase_s is not None and args.phase_s <= 0):
        ap.error("--slo-ms, --every-s and --phase-s must be positive")

    from ken.optimizer.reallocation import ClosedLoop, Resolving, Solver

    started = time.perf_counter()
    slo_s = args.slo_ms / 1000
    phase_s = args.phase_s or (5.0 if args.quick else 10.0)
    sample, loaders, catalog, calibration = setup(not args.profiles_only)
    problem_for = problem_maker(catalog, slo_s)
    base = one_x(problem_for)
    trace = step_trace(base, phase_s, args.seed)
    # a stream of its own: the pipeline's router draws from ``default_rng(seed)``, and the
    # same stream here would tie each request's class to its path's draw
    rng = np.random.default_rng([args.seed, 1])
    classes = rng.choice(len(ROUTES), size=len(trace), p=SHARES)
    rows = rng.integers(0, len(sample), size=len(trace))
    resolving = Resolving(every_s=args.every_s)
    systems = {"fixed for 1x": None, f"fixed for {max(LOADS):g}x": "peak",
               f"online (EWMA, every {args.every_s:g} s)": resolving,
               "online + backlog": ClosedLoop(resolving),
               f"online + backlog, read every {args.every_s / 4:g} s": ClosedLoop(resolving,
                                                                              checks=4)}
    drops = ("proactive",) if args.quick else ("none", "proactive")
    problem = problem_for(base)
    print(f"1x = {base:.1f} req/s; variants (req/s per worker at batch 1 / 8): " + ", ".join(
        f"{v.name} {v.qps[1]:.0f} / {v.qps[8]:.0f} (accuracy {v.accuracy:.3f})"
        for v in problem.variants[0]) + f"; {len(trace)} requests", flush=True)
    result = {"command": "python benchmarks/allocation_engine.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "calibration": calibration,
        "one_x_qps": base, "slo_s": slo_s, "phase_s": phase_s, "loads": list(LOADS),
        "every_s": args.every_s, "requests": len(trace),
        "variants": [{"name": v.name, "accuracy": v.accuracy,
                      "qps": {str(b): q for b, q in v.qps.items()}}
                     for v in problem.variants[0]],
        "path_accuracy": {f"{r}:{'>'.join(p)}": a for (r, p), a in problem.accuracy.items()},
        "systems": []}
    for (name, control), drop in itertools.product(systems.items(), drops):
        start_qps = max(LOADS) * base if control == "peak" else base
        control = None if control == "peak" else control
        solver = Solver(problem_for)
        t0 = time.perf_counter()
        measured = serve(control, solver, start_qps, loaders, sample, trace, classes, rows,
                         slo_s, drop, args.seed)
        serve_s = time.perf_counter() - t0
        simulated = simulate(control, Solver(problem_for), start_qps, catalog, trace, slo_s,
                             drop, args.seed, phase_s * len(LOADS))
        row = {"system": name, "dropping": drop,
               "measured": {**summary(measured, trace, phase_s),
                            "dropped": float(measured["dropped"].mean()),
                            "changes": len(measured["changes"]) - 1,
                            "allocations": measured["changes"], "moved": measured["moved"],
                            "control_errors": measured["control_errors"]},
               "simulated": {**summary(simulated, trace, phase_s),
                             "changes": simulated["changes"]},
               "serve_s": serve_s}
        result["systems"].append(row)
        m, s = row["measured"], row["simulated"]
        print(f"{name:>26} {drop:>9}: quality {m['quality']:.3f} (sim {s['quality']:.3f}), "
              f"on time {m['on_time']:.1%} ({s['on_time']:.1%}), turned away "
              f"{m['turned_away']:.1%} ({s['turned_away']:.1%}), changes {m['changes']} "
              f"({s['changes']}); by phase " + ", ".join(
                  f"{p['quality']:.3f}/{q['quality']:.3f}"
                  for p, q in zip(m["phases"], s["phases"], strict=True))
              + f"  [{serve_s:.0f} s]", flush=True)
    result["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "allocation_engine.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "allocation_engine.png")
    print(f"wrote {args.out}/allocation_engine.json and .png in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
