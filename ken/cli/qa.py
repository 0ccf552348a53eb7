"""`ken mmqa` and `ken hybridqa`: multi-hop questions answered with semantic SQL, scored by
EM/F1; with ``--target`` (mmqa) planned and served as a stream on the online engine."""

from __future__ import annotations

import argparse
import math

import numpy as np

from ken.cli import DEFAULT_QA_LLMS
from ken.errors import UsageError
from ken.models.model import DeviceConfig
from ken.models.qa_data import read_hybridqa, read_mmqa
from ken.multihop import retrieval_summary, run_pipeline, write_report
from ken.multihop_plan import PlannedRun, run_planned
from ken.optimizer.query import Target
from ken.paths import shared_data_dir
from ken.progress import Reporter
from ken.report import console, qa_table
from ken.session import connect


def cmd_qa(args: argparse.Namespace) -> int:
    """``ken mmqa`` / ``ken hybridqa``: answer, score, write the per-question JSON."""
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be at least 1, got {args.limit}")
    if args.threads < 1:
        raise UsageError(f"--threads must be at least 1, got {args.threads}")
    target = getattr(args, "target", None)
    if target is not None:
        target = Target.parse(target)
        if args.limit is not None or args.llms != DEFAULT_QA_LLMS:
            raise UsageError("--target plans the pipeline over both LMs for a stream of "
                           "--stream questions; leave out --limit and --llms")
        if args.stream < 1 or args.devices < 1 or args.load <= 0:
            raise UsageError("--stream and --devices must be at least 1, --load above 0")
        if not args.no_calibration and not (math.isfinite(args.calibration_seconds)
                                            and args.calibration_seconds > 0):
            raise UsageError("--calibration-seconds must be a number above 0 (or give "
                             "--no-calibration)")
    folder = args.data_dir or shared_data_dir() / args.command
    data = read_mmqa(folder) if args.command == "mmqa" else read_hybridqa(folder)
    reporter = Reporter(args.quiet)
    # a measurement (answers' latency, the planned pipeline's replay): no result cache
    with connect(device=DeviceConfig(threads=args.threads), reporter=reporter,
                 cache=False) as session:
        if target is None:
            session.operators["sem_qa"].llms = tuple(args.llms.split(","))
            report = run_pipeline(session, data, args.limit, reporter)
        else:
            run = run_planned(session, data, target, args.stream, args.devices,
                              load=args.load, reporter=reporter,
                              calibration_s=0.0 if args.no_calibration
                              else args.calibration_seconds)
            report = run.report
            _print_planned(run)
    path = write_report(report, args.out)
    s = report.summary
    console.print(qa_table(data, s))
    latency = [a.latency_s for a in report.answers if a.latency_s > 0]
    skipped = {k: v for k, v in s.statuses.items() if k != "ok" and v}
    held = retrieval_summary(report.answers)
    console.print(
        f"models: {', '.join(report.models)}; "
        + (f"question-type accuracy {report.type_accuracy:.1%}; "
           if report.type_accuracy is not None else "")
        + (f"gold answer in the reader's context {held[0]:.1%} (reader F1 there "
           f"{held[1]:.1f}); " if held else "")
        + (f"latency per question p50 {np.percentile(latency, 50):.2f} s, p95 "
           f"{np.percentile(latency, 95):.2f} s; " if latency else "")
        + (f"not answered: {skipped}; " if skipped else "")
        + f"per-question JSON: {path}", highlight=False, markup=False)
    return 0


def _print_planned(run: PlannedRun) -> None:
    """The query optimizer's choice per operator, EXPLAIN, and predicted against served."""
    chosen = run.plan.chosen
    console.print(f"[bold]query optimizer[/]: target {run.plan.target.describe()} (F1 of the "
                  f"final answer); {len(run.plan.points)} combinations of gear plans "
                  f"simulated together")
    for p in chosen.plans:
        console.print("\n".join([f"{p.operator}:"] + [f"  {line}" for line in p.describe()]),
                      highlight=False, markup=False)
    console.print(run.explain, highlight=False, markup=False)
    for op, cal in run.calibration.items():
        console.print(f"{op}: planned on served runtimes, {cal.describe()} ({cal.source})",
                      highlight=False, markup=False)
    served = [a.latency_s for a in run.report.answers if a.status == "ok"]
    p = chosen.metrics
    console.print(
        f"predicted for the planning stream: F1 {100 * chosen.quality:.1f}, p95 "
        f"{p.p95_ms / 1000:.1f} s; for the served stream of {len(served)} questions: F1 "
        f"{100 * run.predicted.quality:.1f}, p50 {run.predicted.metrics.p50_ms / 1000:.1f} s, "
        f"p95 {run.predicted.metrics.p95_ms / 1000:.1f} s; measured: F1 "
        f"{run.report.summary.f1:.1f}, p50 {np.percentile(served, 50):.1f} s, p95 "
        f"{np.percentile(served, 95):.1f} s", highlight=False, markup=False)
