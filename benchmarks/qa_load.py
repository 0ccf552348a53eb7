"""The MultiModalQA question stream under load on the online engine: no dropping, reactive and
proactive dropping, measured beside the simulator's prediction (issue 37, item 1: the QA
stream that ``benchmarks/pipeline_load.py`` could only simulate with stand-ins).

- **Pipeline**: ``ken mmqa --target``'s (``ken.multihop_plan``): the query optimizer plans the
  reading operators ``text_qa`` and ``table_qa`` (SmolLM2-135M and Qwen2.5-Coder-0.5B, gear
  plans) for ``--target`` from the cached measurement of the n100 slice's 62 answerable
  questions; the question type and retrieval run in each question's own thread, the readers on
  two worker processes (one torch thread each), as ``ken mmqa --target`` serves them.
- **Stream**: questions drawn (with repeats) from those 62; arrivals the Azure LLM code trace's
  gaps in order, scaled to ``load`` x 1x for ``--duration-s`` seconds; every question's
  end-to-end deadline ``--budget-s`` after its arrival, carried by each of its reading calls
  (``answer_stream(budget_s=)``). 1x is what the simulator says the planned pipeline sustains:
  the highest rate at which it answers 95% of the questions within the budget without
  dropping (bisection; the simulation leaves out retrieval and the question type's own
  thread, about 0.3 s per question on an idle machine: ``docs/results.md``, Figure 10).
- **Calibration** (``--calibrate-s``, default 60): the LMs' runtimes were timed one at a time
  on an idle machine; served, two workers and the questions' retrieval share the cores. So
  first a stream of that many seconds at the uncalibrated 1x is served without dropping, its
  reading calls are fitted against those runtimes (``PipelinePlanner.calibrate``, the fit
  ``ken plan`` uses), and the pipeline is planned again, 1x found again and every point
  simulated on the served runtimes. Each point also records its simulation with the runtimes
  timed alone (``simulated_alone``).
- **Policies**: ``session.serve(dropping=...)``: ``none``, ``reactive`` (drop a call once its
  question is past its deadline) and ``proactive`` (PARD: once the call's predicted finish is
  past it). A question whose call is dropped ends ``dropped`` at once. Admission is
  ``max_in_flight`` (no latency-target rejections), so the policies alone decide what is not
  answered, as in ``pipeline_load.py --cases engine``.
- **Per point**, measured (and simulated, ``evaluate_pipeline`` with the same deadline and
  policy, on the same rows and arrivals): goodput (questions answered within the budget per
  second of the stream), drop rate, late rate, F1 over every question (dropped or late: 0)
  and over the answered ones, the reading calls' model seconds and those wasted (the calls of
  hops dropped later or answered late: each call is its own job, since a SQL call does not say
  which hops follow, so a first hop's time is not counted when the second hop is dropped).

``--replays N`` serves every point N times, the policies in alternating order from one replay
to the next (the same arrivals and questions in each), and adds ``summary``: per load and
policy the median goodput and wasted model time with their range, and per replay each
policy's goodput over reactive dropping's.

Writes ``--out``/qa_load.json.

    python benchmarks/qa_load.py --out DIR    # about 25 minutes with the measurement cached
    python benchmarks/qa_load.py --duration-s 45 --out DIR    # about 20 minutes
    python benchmarks/qa_load.py --loads 2 --policies reactive,proactive --replays 3 \
        --duration-s 360 --out DIR    # about 50 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def sustained(planner, plans, gaps: np.ndarray, duration_s: float, budget_s: float,  # noqa: ANN001
              seed: int) -> float:
    """The highest rate the simulated pipeline answers 95% of within the budget, no
    dropping (bisection between 0.01 and 10 questions/s), with the planner's runtimes."""
    from pipeline_load import arrivals

    from ken.multihop_plan import OPERATORS
    from ken.optimizer.query import evaluate_pipeline
    from ken.policy.dropping import DropPolicy

    catalogs = [planner.catalogs[op] for op in OPERATORS]
    lo, hi = 0.01, 10.0
    for _ in range(14):
        mid = (lo * hi) ** 0.5
        trace = arrivals(gaps, duration_s, mid)
        point = evaluate_pipeline(plans, catalogs, trace, planner.sample, seed,
                                  deadline_s=budget_s, dropping=DropPolicy.named("none"))
        d = point.deadline
        on_time = 1.0 - d.late_rate - d.drop_rate
        lo, hi = (mid, hi) if on_time >= 0.95 else (lo, mid)
    return lo


def calibrate(session, planner, pipeline, outcomes, by_qid, gaps: np.ndarray,  # noqa: ANN001
              rate: float, args: argparse.Namespace) -> dict:
    """Serve ``--calibrate-s`` seconds of the stream at ``rate`` (no dropping, every question
    answered) and calibrate the planner on its reading calls (``calibrate_on_stream``); the
    questions are drawn apart from the points' (another seed)."""
    from pipeline_load import arrivals

    from ken.multihop_plan import calibrate_on_stream

    trace = arrivals(gaps, args.calibrate_s, rate)
    rows = np.random.default_rng(args.seed + 1).integers(0, len(outcomes.qids), len(trace))
    questions = [by_qid[outcomes.qids[r]] for r in rows]
    t0 = time.perf_counter()
    fitted = calibrate_on_stream(session, planner, pipeline, questions,
                                 trace.arrival_s.tolist())
    for op, cal in fitted.items():
        print(f"calibrated {op}: {cal.describe()} ({cal.source})", flush=True)
    return {"seconds": time.perf_counter() - t0, "questions": len(trace), "rate_qps": rate,
            "calls": {op: dict(cal.calls) for op, cal in fitted.items()},
            "fits": {op: cal.describe() for op, cal in fitted.items()}}


def summarise(points: list[dict]) -> dict:
    """Per load and policy, the median and range over replays of goodput and wasted model
    seconds; per load and replay, each policy's goodput over reactive dropping's."""
    from decode_deadlines import spread

    out: dict = {"points": [], "against_reactive": []}
    keys = sorted({(p["load"], p["policy"]) for p in points})
    for load, policy in keys:
        mine = [p for p in points if p["load"] == load and p["policy"] == policy]
        out["points"].append({
            "load": load, "policy": policy, "replays": len(mine),
            "questions": [p["questions"] for p in mine],
            "goodput_qps": spread([p["goodput_qps"] for p in mine]),
            "wasted_model_s": spread([p["wasted_model_s"] for p in mine])})
    by = {(p["load"], p["policy"], p["replay"]): p for p in points}
    for (load, policy, replay), p in sorted(by.items()):
        base = by.get((load, "reactive", replay))
        if policy == "reactive" or base is None:
            continue
        out["against_reactive"].append({
            "load": load, "policy": policy, "replay": replay,
            "goodput_ratio": (p["goodput_qps"] / base["goodput_qps"]
                              if base["goodput_qps"] > 0 else None),
            "wasted_ratio": (p["wasted_model_s"] / base["wasted_model_s"]
                             if base["wasted_model_s"] > 0 else None)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="the MultiModalQA folder (default ../shared/data/mmqa)")
    ap.add_argument("--target", default="f1 >= 0.2")
    ap.add_argument("--loads", default="1,1.5,2,3")
    ap.add_argument("--policies", default="none,reactive,proactive")
    ap.add_argument("--duration-s", type=float, default=60.0,
                    help="seconds of arrivals per point")
    ap.add_argument("--budget-s", type=float, default=20.0,
                    help="each question's end-to-end deadline after its arrival")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replays", type=int, default=1,
                    help="serve every point this many times (policies in alternating order)")
    ap.add_argument("--calibrate-s", type=float, default=60.0,
                    help="seconds of a served stream (at the uncalibrated 1x, no dropping) "
                         "whose reading calls calibrate the LMs' runtimes before anything "
                         "else is planned or simulated; 0 plans on the runtimes measured "
                         "alone (before session 23)")
    args = ap.parse_args(argv)
    if not all(np.isfinite([args.duration_s, args.budget_s, args.calibrate_s])) or \
            args.duration_s <= 0 or args.budget_s <= 0 or args.calibrate_s < 0:
        ap.error("--duration-s and --budget-s must be positive numbers, --calibrate-s a "
                 "number at least 0")
    if args.replays < 1:
        ap.error("--replays must be at least 1")
    loads = [float(x) for x in args.loads.split(",")]
    policies = args.policies.split(",")

    from pipeline_load import arrivals

    from ken.models.model import DeviceConfig
    from ken.models.qa_data import read_mmqa
    from ken.multihop import Pipeline, run_pipeline
    from ken.multihop_plan import (
        LLMS,
        OPERATORS,
        READING,
        PipelinePlanner,
        load_or_measure,
        use_reading_plans,
    )
    from ken.optimizer.query import Target, evaluate_pipeline
    from ken.optimizer.workload import load_azure_trace
    from ken.paths import ken_home, shared_data_dir
    from ken.policy.dropping import DropPolicy
    from ken.progress import Reporter
    from ken.session import connect

    started = time.perf_counter()
    folder = args.data_dir or shared_data_dir() / "mmqa"
    if not folder.is_dir():
        raise SystemExit(f"MultiModalQA not found at {folder} (give --data-dir)")
    data = read_mmqa(folder)
    reporter = Reporter(quiet=False)
    gaps = np.diff(load_azure_trace().arrival_s)
    result: dict = {"command": "python benchmarks/qa_load.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "target": args.target,
        "budget_s": args.budget_s, "duration_s": args.duration_s, "points": []}
    with connect(device=DeviceConfig(threads=1), reporter=Reporter(quiet=True),
                 cache=False) as session:
        session.operators["sem_qa"].llms = LLMS  # type: ignore[attr-defined]
        outcomes = load_or_measure(session, data, (session.home or ken_home()) / "qa-plans",
                                   LLMS, reporter)
        planner = PipelinePlanner(outcomes, 2, 8.0, 600.0, 1.5)
        target = Target.parse(args.target)
        plan = planner.choose(target)
        pipeline = Pipeline(session, data, reporter)
        use_reading_plans(session, plan)
        by_qid = {q.qid: q for q in data.questions}
        alone = [planner.catalogs[op] for op in OPERATORS]  # the LMs timed alone
        one_x = sustained(planner, list(plan.plans), gaps, args.duration_s, args.budget_s,
                          args.seed)
        result["one_x_qps_uncalibrated"] = one_x
        if args.calibrate_s > 0:
            result["calibration"] = calibrate(session, planner, pipeline, outcomes, by_qid,
                                              gaps, one_x, args)
            plan = planner.choose(target)  # planned again, on the served runtimes
            use_reading_plans(session, plan)
            one_x = sustained(planner, list(plan.plans), gaps, args.duration_s,
                              args.budget_s, args.seed)
        result["plans"] = {p.operator: p.describe() for p in plan.plans}
        result["one_x_qps"] = one_x
        print(f"1x = {one_x:.3f} questions/s (simulated, 95% within {args.budget_s:g} s"
              f"{', calibrated' if args.calibrate_s > 0 else ''}; "
              f"{result['one_x_qps_uncalibrated']:.3f} with the LMs timed alone)", flush=True)
        catalogs = [planner.catalogs[op] for op in OPERATORS]
        rng = np.random.default_rng(args.seed)
        streams = {}
        for load in loads:
            trace = arrivals(gaps, args.duration_s, load * one_x)
            rows = rng.integers(0, len(outcomes.qids), len(trace))
            streams[load] = (trace, rows)
        for replay in range(args.replays):
            # alternate the order so that a drift of the machine's speed is shared
            order = policies if replay % 2 == 0 else policies[::-1]
            for policy in order:
                # admission by max_in_flight: the policies alone decide what is not answered
                session.serve(list(READING), workers="auto", threads_per_device=1, memory_gb=8.0,
                              dropping=policy, admission="max_in_flight", replan=False)
                engine = session.engines[READING[0]]
                try:
                    for load in loads:
                        trace, rows = streams[load]
                        questions = [by_qid[outcomes.qids[r]] for r in rows]
                        t0 = engine.clock.now()
                        t_wall = time.perf_counter()
                        report = run_pipeline(session, data, reporter=Reporter(quiet=True),
                                              pipeline=pipeline,
                                              stream=(questions, trace.arrival_s.tolist()),
                                              budget_s=args.budget_s)
                        wall = time.perf_counter() - t_wall
                        m = engine.deadline_metrics(since_s=t0)
                        answers = report.answers
                        ok = np.array([a.status == "ok" for a in answers])
                        latency = np.array([a.latency_s for a in answers])
                        on_time = ok & (latency <= args.budget_s)
                        f1 = np.array([a.f1 for a in answers])
                        sim = evaluate_pipeline(list(plan.plans), catalogs, trace, planner.sample,
                                                args.seed, rows=rows.tolist(),
                                                deadline_s=args.budget_s,
                                                dropping=DropPolicy.named(policy))
                        sd = sim.deadline
                        raw = evaluate_pipeline(list(plan.plans), alone, trace, planner.sample,
                                                args.seed, rows=rows.tolist(),
                                                deadline_s=args.budget_s,
                                                dropping=DropPolicy.named(policy)).deadline
                        point = {
                            "load": load, "policy": policy, "replay": replay,
                        "questions": len(answers),
                            "offered_qps": len(answers) / args.duration_s,
                            "goodput_qps": float(on_time.sum()) / args.duration_s,
                            "drop_rate": float(np.mean([a.status == "dropped" for a in answers])),
                            "late_rate": float(np.mean(ok & ~on_time)),
                            "other_statuses": {s: int(sum(a.status == s for a in answers))
                                               for s in {a.status for a in answers}
                                               if s not in ("ok", "dropped")},
                            "f1_all": float(np.where(on_time, f1, 0.0).mean()) * 100,
                            "f1_answered": float(f1[ok].mean()) * 100 if ok.any() else None,
                            "p50_s": float(np.percentile(latency[ok], 50)) if ok.any() else None,
                            "model_s": m.device_s, "wasted_model_s": m.wasted_device_s,
                            "wall_s": wall, "loadavg_1min": os.getloadavg()[0],
                            "simulated": {"goodput_qps": sd.goodput_qps, "drop_rate": sd.drop_rate,
                                          "late_rate": sd.late_rate,
                                          "wasted_model_s": sd.wasted_device_s,
                                          "model_s": sd.device_s,
                                          "f1_all": 100 * float(sim.quality)},
                            "simulated_alone": {"goodput_qps": raw.goodput_qps,
                                                "drop_rate": raw.drop_rate,
                                                "late_rate": raw.late_rate,
                                                "model_s": raw.device_s},
                        }
                        result["points"].append(point)
                        print(f"[{replay}] {load:>4}x {policy:>9}: goodput "
                              f"{point['goodput_qps']:.3f}/s (sim "
                              f"{sd.goodput_qps:.3f}, alone {raw.goodput_qps:.3f}), drop "
                              f"{point['drop_rate']:.0%} "
                              f"({sd.drop_rate:.0%}), late {point['late_rate']:.0%} "
                              f"({sd.late_rate:.0%}), F1 all {point['f1_all']:.1f}, answered "
                              f"{point['f1_answered'] or 0:.1f}, wasted {m.wasted_device_s:.1f} of "
                              f"{m.device_s:.1f} model s ({sd.wasted_device_s:.1f} of "
                              f"{sd.device_s:.1f})  [{len(answers)} questions, {wall:.0f} s]",
                              flush=True)
                        result["summary"] = summarise(result["points"])
                        args.out.mkdir(parents=True, exist_ok=True)  # keep what is measured
                        (args.out / "qa_load.json").write_text(json.dumps(result, indent=1))
                        time.sleep(1.2)  # the forecast's 1-s windows forget this load
                finally:
                    session.stop_serving()
        result["summary"] = summarise(result["points"])
    result["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "qa_load.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}/qa_load.json in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
