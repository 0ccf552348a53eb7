"""Where the simulator's miss is: its structure, how the calls' times fall, or their level
(issue 33, item 3).

Three plans serve Poisson and Gamma (CV 3) arrivals at ``--rate`` for ``--seconds``,
``--replays`` times each, interleaved, every request admitted: the soak's two plans
(``benchmarks/soak.py``, planned on the family's profiles for 2 CPU workers: ``fast``,
MiniLM-L3 alone on both workers, and ``main``, a MiniLM-L3 -> MiniLM-L6 gear plan) and
``l6``, MiniLM-L6 alone on both workers (batches of up to 4 rows, 5-ms wait). Per trace the
runtimes are first calibrated at the rate as ``ken plan`` does (``calibration_calls``).
Each replay's p95 is set against five simulations of it:

- ``planned``: on that calibration (the median of three seeds, on the replayed rows): what
  a plan made before serving predicts; its error is the level's, the draw's and the
  structure's together;
- ``own_level``: on that calibration with every model moved to the level its own batches ran
  at in the replay (``at_levels``; session 37's diagnosis);
- ``own_calibration``: on a calibration fitted on the replay's own calls (``fit_calibration``:
  a factor per batch size and the spread of the rest, drawn per batch; three seeds): the
  level and each size's factor are the replay's, which batch ran slow is the simulator's draw;
- ``shuffled``: each of the replay's batches' own factor over that own calibration's charge,
  permuted among the batches of its model (``Hindsight.shuffled_p95_ms``, the median of
  three permutations): the replay's own factors, not which batch got which;
- ``own_times``: fed the replay's own batch times (``ken.engine.hindsight``): the structure
  alone (queues, batching, gears, escalations).

Beside them, ``engine_self``: each replay's p95 against the median of the same plan's other
replays (``e2e.self_errors``), how near another replay of the engine comes: the yardstick (a
simulation that knew the engine's mean p95 exactly would still miss each replay by the
replays' own spread).

And how alike batches of the same rows deviate from their charge: replays of one plan and
trace send the same sample rows at the same times, so many batches hold the same rows, at
the same moment of the trace, in two replays; ``rows_share`` is the correlation between two
replays of the log of such a batch's held time over its own calibration's charge (0: what
the simulator draws per batch as independent noise is; above: the rows', or the moment's,
which this cannot tell apart).

Writes DIR/fidelity_parts.json and DIR/fidelity_parts.png.

    python benchmarks/fidelity_parts.py --out DIR     # about 12 minutes with cached models
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import seed_p95s, self_errors  # noqa: E402
from soak import PLAN_CORES, family_calibration_calls, plans_to_serve, soak_setup  # noqa: E402

from ken.engine.calibrate import (  # noqa: E402
    at_levels,
    fit_calibration,
    model_levels,
    predicted_s,
)
from ken.engine.hindsight import SEEDS, hindsight  # noqa: E402
from ken.engine.replay import Served, replay_rounds  # noqa: E402
from ken.optimizer.baselines import dynamic_batching_plan  # noqa: E402
from ken.optimizer.perf import Catalog  # noqa: E402
from ken.optimizer.workload import gamma_trace, poisson_trace  # noqa: E402
from ken.progress import Reporter  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "fidelity_parts"
#: the simulations each replay is set against, from the most to the least hindsight
FORMS = ("own_times", "shuffled", "own_calibration", "own_level", "planned")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.replays < 1 or args.seconds <= 0 or args.rate <= 0:
        ap.error("--replays >= 1, --seconds > 0 and --rate > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    reporter = Reporter()
    started = time.perf_counter()
    setup = soak_setup(reporter)
    profiles, _, hardware, _, _ = setup
    to_serve = plans_to_serve(reporter, args.seed, setup=setup)
    plans = {"fast": to_serve.fast, "main": to_serve.main,
             "l6": dynamic_batching_plan("sentiment", "minilm-l6", profiles, hardware,
                                         200.0, 4, 0.005)}
    assert len(hardware.devices) == PLAN_CORES
    traces = {"poisson": poisson_trace(args.rate, args.seconds, seed=args.seed + 1),
              "gamma": gamma_trace(args.rate, args.seconds, 3.0, seed=args.seed + 1)}
    out: dict = {"plans": {k: p.describe() for k, p in plans.items()},
                 "args": {k: str(v) for k, v in vars(args).items()}, "traces": {}}
    for tname, trace in traces.items():
        calls = family_calibration_calls(reporter, args.seed, 10.0, rate=trace.request_qps(),
                                         setup=setup)
        calibration = calls.moved(reporter=reporter)
        reporter.note(f"{tname}: runtimes calibrated at {trace.request_qps():.1f} requests/s: "
                      f"{calibration.describe()}")
        planned = calibration.apply(profiles)
        runs = replay_rounds(list(plans.values()), to_serve.loaders, trace, to_serve.sample,
                             args.replays, seed=args.seed, reporter=reporter,
                             admission="max_in_flight")
        entry: dict = {"trace": trace.name, "requests": len(trace), "plans": {},
                       "calibration": calibration.describe(),
                       "calibration_other_cores": calibration.other_cores}
        for (name, plan), served in zip(plans.items(), runs, strict=True):
            # every seed on the rows the replays asked (a seed also picks a simulation's rows;
            # every round replays the same ones)
            rows = served[0].replay.rows
            sim = float(np.median(seed_p95s(plan, planned, trace, args.seed, rows, SEEDS)))
            reps, residuals = [], []
            for r in served:
                assert r.path_log is not None and r.replay.rows is not None
                own = fit_calibration(r.batch_log, profiles).apply(profiles)
                seen = hindsight(plan, profiles, r.replay.outcomes, r.replay.rows, r.path_log,
                                 own)
                level = model_levels(r.batch_log, planned)
                at_own = float(np.median(seed_p95s(plan, at_levels(planned, level), trace,
                                                   args.seed, r.replay.rows, SEEDS)))
                measured = r.replay.result.metrics(0, plan).p95_ms
                p95 = {"own_times": seen.own_times_p95_ms,
                       "shuffled": seen.shuffled_p95_ms,
                       "own_calibration": seen.own_calibration_p95_ms,
                       "own_level": at_own, "planned": sim}
                residuals.append(by_rows(r, own))
                reps.append({"measured_p95_ms": measured, "simulated_p95_ms": p95,
                             # the hindsight compares the answered requests (all, here)
                             "error": {k: measured / v - 1.0 for k, v in p95.items()},
                             "own_level": level, "hindsight": seen.to_dict()})
            entry["plans"][name] = reps
            entry.setdefault("rows_share", {})[name] = rows_share(residuals)
            reporter.note(f"{tname} {name}: measured p95 "
                          + ", ".join(f"{x['measured_p95_ms']:.1f}" for x in reps) + " ms; "
                          + "; ".join(f"{k} " + ", ".join(f"{x['error'][k]:+.0%}" for x in reps)
                                      for k in FORMS))
        out["traces"][tname] = entry
        (args.out / "fidelity_parts.json").write_text(json.dumps(summarise(out), indent=1))
    out["wall_s"] = time.perf_counter() - started
    (args.out / "fidelity_parts.json").write_text(json.dumps(summarise(out), indent=1))
    plot(out, args.out / "fidelity_parts.png")
    reporter.note(f"wrote {args.out}/fidelity_parts.json and fidelity_parts.png in "
                  f"{out['wall_s'] / 60:.1f} min")
    return 0


def by_rows(served: Served, charged: Catalog) -> dict[tuple[str, frozenset[int]], float]:
    """Each online batch of a replay, keyed by its model and the trace indices of its rows:
    the log of its held time over what ``charged`` charges it."""
    assert served.path_log is not None
    index = {o.request_id: i for i, o in enumerate(served.replay.outcomes)}
    return {(b.record.model, frozenset(index[r] for r in b.request_ids)):
            float(np.log(b.record.held_s / predicted_s(b.record, charged)))
            for b in served.path_log.batches()}


def rows_share(residuals: list[dict]) -> dict:
    """Per pair of replays: the batches both formed of the same rows, and the correlation of
    their residuals (``by_rows``)."""
    pairs = []
    for a in range(len(residuals)):
        for b in range(a + 1, len(residuals)):
            both = sorted(set(residuals[a]) & set(residuals[b]), key=str)
            x = np.array([residuals[a][k] for k in both])
            y = np.array([residuals[b][k] for k in both])
            if len(both) > 2 and x.std() > 0 and y.std() > 0:
                pairs.append({"batches": len(both), "correlation": float(np.corrcoef(x, y)[0, 1])})
    return {"pairs": pairs, "median": float(np.median([p["correlation"] for p in pairs]))
            if pairs else None}


def summarise(out: dict) -> dict:
    """``out`` with, per form, the replays within 10% and the mean of log(measured /
    simulated) with its standard error, per trace and plan and over all; and the same of
    ``engine_self``, each replay against the plan's other replays (``self_errors``)."""
    def stats(errors: list[float]) -> dict:
        e = np.log1p(np.array(errors))
        se = float(e.std(ddof=1) / np.sqrt(e.size)) if e.size > 1 else None
        return {"replays": int(e.size),
                "within_10pct": int((np.abs(np.array(errors)) <= 0.10).sum()),
                "mean_log_error": float(e.mean()), "se": se}

    summary: dict = {}
    every: dict[str, list[float]] = {k: [] for k in (*FORMS, "engine_self")}
    for tname, entry in out["traces"].items():
        for name, reps in entry["plans"].items():
            # a run written before a form was added has none of it (e.g. ``shuffled``)
            errors = {k: [x["error"][k] for x in reps if k in x["error"]] for k in FORMS}
            # the yardstick: each replay against the same plan's other replays
            errors["engine_self"] = self_errors([x["measured_p95_ms"] for x in reps])
            summary[f"{tname}/{name}"] = {k: stats(v) for k, v in errors.items() if v}
            for k, v in errors.items():
                every[k] += v
    summary["all"] = {k: stats(v) for k, v in every.items() if v}
    return {**out, "summary": summary}


def plot(out: dict, path: Path) -> None:
    """Per trace and plan: each replay's error against each simulation."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    labels, x = [], 0
    for tname, entry in out["traces"].items():
        for name, reps in entry["plans"].items():
            for k, form in enumerate(FORMS):
                ys = [100 * r["error"][form] for r in reps if form in r["error"]]
                ax.plot([x + 0.15 * (k - 2)] * len(ys), ys, "ovsD^"[k], color=f"C{k}",
                        label=form.replace("_", " ") if x == 0 else None, ms=4)
            labels.append(f"{name}\n{tname}")
            x += 1
    ax.axhspan(-10, 10, color="0.9", zorder=0)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("measured / simulated p95 - 1 (%)")
    ax.set_title("each replay against the simulator: fed its own batch times, its own "
                 "factors shuffled, on its own\ncalibration, at its own level, and on the "
                 "calibration made before serving",
                 fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
