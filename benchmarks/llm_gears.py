"""Load-gear plans of a generating operator (``sem_qa``) on the Azure trace: ken's plan against
single models and the best static cascade, simulated and measured (issue 15, token-level
cost in the offline and online phase).

1. **Rows**: ``sem_qa(question, passage)`` on the first ``--rows`` HybridQA passage questions
   (the operator's evaluation sample), answered by SmolLM2-135M and Qwen2.5-Coder-0.5B: each
   answer's prompt and generated tokens (passes it needs: an end-of-sequence costs one),
   certainty (geometric-mean token probability) and token F1. Cached in ``--out``.
2. **Token cost**: each model's prefill and decode passes timed on this machine and fitted
   (``ken.optimizer.tokens``, cached under KEN_HOME).
3. **Trace**: windows of the Azure LLM code trace (``--plan-minutes``: minutes 0–20 and
   40–57 to plan on, a plan must meet its target in both; ``--eval-minutes``: 20–40 to
   evaluate), each thinned at random to ``--requests`` arrivals and stretched to
   ``--span-s`` seconds, so that the evaluation window's mean rate is ``--load``
   x what Qwen alone sustains (its bursts keep the trace's shape). Even rows serve the planning
   window and pick the cascades' thresholds; odd rows serve the evaluation window.
4. **Plans**: for each TGT p95 target, ken's plan (``plan_generation``: up to 3 gears chosen by
   load in requests running + queued, planned on the planning window); baselines on the
   evaluation window itself: each model alone, and the best static cascade (one gear; every
   candidate cascade tried on the evaluation window, the most accurate that meets the target:
   a generous baseline); MS+ (the same planner with single models only: model switching by
   load, planned on the planning window). Ratios of TGT p95 at matched quality.
5. **Engine**: ken's plan for ``--replay-target`` and the baselines of the same quality
   replayed through ``CascadeServer`` (one decode server, a lane per model, wall clock, real
   passes): TTFT p50/p95, TGT p95 and F1 measured against simulated.

Writes benchmarks/results/llm_gears/llm_gears.json and llm_gears.png.

    python benchmarks/llm_gears.py             # ~25 min on 2 cores the first time
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ken.policy.metrics import PlanMetrics

RESULTS = Path(__file__).parent / "results" / "llm_gears"
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the device")
    ap.add_argument("--requests", type=int, default=60, help="arrivals per window")
    ap.add_argument("--span-s", type=float, default=0.0,
                    help="window length in seconds (default: from --load)")
    ap.add_argument("--load", type=float, default=1.0,
                    help="evaluation window's mean rate / Qwen alone's sustained rate")
    ap.add_argument("--plan-minutes", default="0,20;40,57",
                    help="planning windows (minutes), ';'-separated; a plan meets the target "
                    "in each")
    ap.add_argument("--eval-minutes", default="20,40")
    ap.add_argument("--targets", default="", help="TGT p95 targets in s (default: a sweep)")
    ap.add_argument("--replay-target", type=float, default=0.0,
                    help="TGT p95 target (s) of the replayed plan (default: the middle one)")
    ap.add_argument("--no-replay", action="store_true")
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.rows < 4 or args.requests < 2 or args.threads < 1 or not args.load > 0:
        ap.error("--rows >= 4, --requests >= 2, --threads >= 1 and --load > 0")

    from ken.models.cascade import Cascade
    from ken.models.model import DeviceConfig
    from ken.ops.base import OpContext
    from ken.ops.sem_qa import SemQA
    from ken.optimizer.decode_sim import StageRows, simulate_gen_plan
    from ken.optimizer.gen_planner import (
        answer_sample,
        cascade_candidates,
        frontier,
        plan_generation,
        trace_window,
    )
    from ken.optimizer.tokens import load_or_measure_token_cost
    from ken.optimizer.workload import load_azure_trace
    from ken.policy.plan import single_gear
    from ken.progress import Reporter

    reporter = Reporter()
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    device = DeviceConfig(threads=args.threads)
    op = SemQA()
    ctx = OpContext(device, reporter=reporter)
    sample = op.eval_sample(ctx)
    if sample is None:
        raise SystemExit("HybridQA is not in the shared data folder")
    sample = sample.subset(range(min(args.rows, len(sample))))
    n = len(sample)
    from ken.models.resources import Resources

    res = Resources(device)
    models, stages, values, costs = {}, {}, {}, {}
    for lm_name in MODELS:
        model = op.stage(res, lm_name, ())
        name = model.name
        models[name] = model
        cache = args.out / f"rows-{name}-{n}.json"
        if cache.is_file():
            d = json.loads(cache.read_text())
            stages[name] = StageRows(*(np.array(d[k]) for k in
                                       ("prompt_tokens", "output_tokens", "certainty",
                                        "quality")))
            values[name] = d["values"]
        else:
            reporter.note(f"answering {n} rows with {name}...")
            t0 = time.perf_counter()
            stages[name], values[name] = answer_sample(model, sample, args.max_running)
            st = stages[name]
            cache.write_text(json.dumps({
                "prompt_tokens": st.prompt_tokens.tolist(),
                "output_tokens": st.output_tokens.tolist(),
                "certainty": st.certainty.tolist(), "quality": st.quality.tolist(),
                "values": values[name], "seconds": time.perf_counter() - t0}))
        costs[name] = load_or_measure_token_cost(model.lm, lm_name, reporter=reporter)
    small, large = list(models)
    even, odd = np.arange(0, n, 2), np.arange(1, n, 2)

    def on(rows: np.ndarray) -> dict:
        return {m: StageRows(s.prompt_tokens[rows], s.output_tokens[rows],
                             s.certainty[rows], s.quality[rows]) for m, s in stages.items()}

    plan_stages, eval_stages = on(even), on(odd)
    singles = {m: {"f1": float(s.quality.mean()),
                   "f1_se": float(s.quality.std(ddof=1) / np.sqrt(n)),
                   "mean_output_tokens": float(s.output_tokens.mean()),
                   "mean_prompt_tokens": float(s.prompt_tokens.mean()),
                   "certainty_f1_corr": float(np.corrcoef(s.certainty, s.quality)[0, 1])}
               for m, s in stages.items()}
    for m, s in singles.items():
        reporter.note(f"{m}: token F1 {s['f1']:.3f} ± {s['f1_se']:.3f} on {n} rows; "
                      f"{s['mean_output_tokens']:.1f} passes per answer")

    # the trace: Qwen alone's sustained rate sets the scale
    rng = np.random.default_rng(args.seed)
    trace = load_azure_trace().arrival_s
    burst = np.zeros(4 * args.requests)
    qwen_alone = simulate_gen_plan(single_gear("f", Cascade((large,)), args.max_running),
                                   costs, eval_stages, burst,
                                   np.arange(burst.size) % len(odd))
    sustained = burst.size / float(qwen_alone.completion_s.max())
    span = args.span_s or args.requests / (args.load * sustained)
    pms = [tuple(float(x) for x in w.split(",")) for w in args.plan_minutes.split(";")]
    em = tuple(float(x) for x in args.eval_minutes.split(","))
    plan_t = trace_window(trace, pms[0][0] * 60, (pms[0][1] - pms[0][0]) * 60, args.requests,
                          span, rng)
    eval_t = trace_window(trace, em[0] * 60, (em[1] - em[0]) * 60, args.requests, span, rng)
    plan_rows = rng.integers(0, len(even), args.requests)
    eval_rows = rng.integers(0, len(odd), args.requests)
    more = [(trace_window(trace, a * 60, (b - a) * 60, args.requests, span, rng),
             rng.integers(0, len(even), args.requests)) for a, b in pms[1:]]
    reporter.note(f"{large} alone sustains {sustained:.3f} req/s; windows of {args.requests} "
                  f"requests over {span:.0f} s ({args.requests / span:.3f} req/s mean)")

    candidates = cascade_candidates(list(models), plan_stages, costs, args.max_running)
    # each model alone and every candidate cascade on the evaluation window
    statics = {}
    for cascade in [Cascade((m,)) for m in models] + [
            c.cascade for c in cascade_candidates(list(models), eval_stages, costs,
                                                  args.max_running) + candidates]:
        if cascade.describe() not in statics:
            plan = single_gear(op.name, cascade, args.max_running)
            statics[cascade.describe()] = results_row(simulate_gen_plan(
                plan, costs, eval_stages, eval_t, eval_rows).metrics()) | {"plan": plan.to_json()}
    if args.targets:
        targets = [float(x) for x in args.targets.split(",")]
    else:
        lo = statics[small]["tgt_p95_ms"] / 1000
        hi = statics[large]["tgt_p95_ms"] / 1000
        targets = sorted({round(float(x), 1) for x in np.geomspace(lo * 1.2, hi, 6)})
    # MS+: the same planner with single models only (model switching by load, no cascades)
    ms_plus = {}
    single_candidates = [c for c in candidates if len(c.cascade.models) == 1]
    for target in targets:
        best, _ = plan_generation(op.name, single_candidates, costs, plan_stages, plan_t,
                                  plan_rows, target * 1000, max_running=args.max_running,
                                  more_traces=more)
        if best is not None and best.plan.summary() not in ms_plus:
            ms_plus[best.plan.summary()] = results_row(simulate_gen_plan(
                best.plan, costs, eval_stages, eval_t, eval_rows).metrics()) | {
                "plan": best.plan.to_json(), "target_s": target}
    points = []
    all_tried = []
    for target in targets:
        best, tried = plan_generation(op.name, candidates, costs, plan_stages, plan_t,
                                      plan_rows, target * 1000, max_running=args.max_running,
                                      more_traces=more)
        all_tried.extend(tried)
        point: dict = {"target_s": target}
        if best is not None:
            ev = results_row(simulate_gen_plan(best.plan, costs, eval_stages, eval_t,
                                               eval_rows).metrics())
            point["ken"] = ev | {"plan": best.plan.to_json(), "describe": best.plan.summary(),
                                 "planned": results_row(best.metrics)}
        feasible = {k: v for k, v in statics.items() if v["tgt_p95_ms"] <= target * 1000}
        if feasible:
            key = max(feasible, key=lambda k: (feasible[k]["quality"], -feasible[k]["tgt_p95_ms"]))
            point["static"] = {"cascade": key, **feasible[key]}
        if "ken" in point:
            for label, name, baselines in (("matched_static", "cascade", statics),
                                           ("matched_ms_plus", "plan", ms_plus)):
                found = matched(baselines, point["ken"])
                if found:
                    point[label] = {name: found[0], **found[1]}
            point["ratio_vs_top_single"] = (statics[large]["tgt_p95_ms"]
                                            / point["ken"]["tgt_p95_ms"])
        points.append(point)
        k = point.get("ken")
        reporter.note(f"target TGT p95 <= {target:g} s: ken "
                      + (f"F1 {k['quality']:.3f}, TGT p95 {k['tgt_p95_ms'] / 1000:.1f} s "
                         f"({k['describe']})" if k else "no plan")
                      + (f"; matched static {point['matched_static']['cascade']} "
                         f"x{point['matched_static']['ratio_p95']:.2f}"
                         if "matched_static" in point else ""))
    result = {"setup": {k: str(v) for k, v in vars(args).items()}, "rows": n,
              "sample": sample.name, "models": singles, "sustained_qps_top": sustained,
              "span_s": span, "mean_qps": args.requests / span,
              "token_costs": {m: json.loads(c.to_json()) for m, c in costs.items()},
              "candidates": [{"cascade": c.cascade.describe(), "f1_plan_rows": c.quality,
                              "work_ms_per_row": c.work_s * 1000, "escalated": c.escalated}
                             for c in candidates],
              "statics": statics, "ms_plus": ms_plus, "points": points,
              "frontier_plan_window": [{"describe": c.plan.summary(), **results_row(c.metrics)}
                                       for c in frontier(all_tried)]}
    if not args.no_replay:
        result["replay"] = replay_all(args, result, models, eval_t, eval_rows, odd, sample,
                                      reporter, costs, eval_stages)
    result["wall_s"] = time.perf_counter() - started
    (args.out / "llm_gears.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "llm_gears.png")
    reporter.note(f"wrote {args.out}/llm_gears.json and llm_gears.png in "
                  f"{result['wall_s'] / 60:.1f} min")
    return 0


def results_row(m: PlanMetrics) -> dict[str, float]:
    """A generating run's metrics under the names this benchmark's results use (TGT for the
    request latency, quality for the mean F1)."""
    return {"ttft_p50_ms": m.ttft_p50_ms, "ttft_p95_ms": m.ttft_p95_ms,
            "ttft_p99_ms": m.ttft_p99_ms, "tgt_p50_ms": m.tgt_p50_ms, "tgt_p95_ms": m.tgt_p95_ms,
            "tgt_p99_ms": m.tgt_p99_ms, "requests": m.num_requests, "quality": m.accuracy,
            "quality_se": m.accuracy_se, "escalated": m.escalated, "tokens_per_s": m.tokens_per_s,
            "passes": m.passes, "utilisation": m.utilisation[0][1], "switches": m.gear_switches}


def matched(baselines: dict, ken: dict) -> tuple[str, dict] | None:
    """The fastest baseline at least as accurate as ken's plan, with its TGT p95 ratio."""
    match = {k: v for k, v in baselines.items() if v["quality"] >= ken["quality"] - 1e-9}
    if not match:
        return None
    key = min(match, key=lambda k: match[k]["tgt_p95_ms"])
    return key, {**match[key], "ratio_p95": match[key]["tgt_p95_ms"] / ken["tgt_p95_ms"]}


def replay_all(args, result, models, eval_t, eval_rows, odd, sample, reporter,  # noqa: ANN001, ANN201, PLR0913
               costs, eval_stages):  # noqa: ANN001
    """ken's plan for the replay target and the baselines of its quality, through the
    engine's decode server; simulated beside measured."""
    from ken.engine.decode import CascadeServer, as_gen_run, replay_rows
    from ken.optimizer.decode_sim import simulate_gen_plan
    from ken.policy.plan import GenPlan

    with_ken = [p for p in result["points"] if "ken" in p]
    if not with_ken:
        return {"skipped": "no ken plan met any target"}
    target = args.replay_target or with_ken[len(with_ken) // 2]["target_s"]
    point = min(with_ken, key=lambda p: abs(p["target_s"] - target))
    runs = {"ken": point["ken"]["plan"]}
    if "matched_static" in point:
        runs["static (matched quality)"] = point["matched_static"]["plan"]
    large = list(models)[-1]
    runs[f"{large} alone"] = result["statics"][large]["plan"]
    asked = sample.subset([int(odd[r]) for r in eval_rows])  # request i asks for row i
    rows = list(asked.texts)
    out = {"target_s": point["target_s"]}
    for label, plan_json in runs.items():
        plan = GenPlan.from_json(plan_json)
        sim = results_row(simulate_gen_plan(plan, costs, eval_stages, eval_t, eval_rows).metrics())
        reporter.note(f"replaying {label} ({plan.summary()}) through the decode server...")
        with CascadeServer({m: models[m] for m in plan.models}, plan) as server:
            outcomes = replay_rows(server, eval_t, rows)
        quality = asked.quality([o.value for o in outcomes])
        got = results_row(as_gen_run(outcomes, quality, server).metrics())
        failed = sum(o.status != "ok" for o in outcomes)
        out[label] = {"plan": plan.summary(), "simulated": sim, "measured": got,
                      "failed": failed}
        reporter.note(f"  {label}: TTFT p50/p95 simulated {sim['ttft_p50_ms'] / 1000:.1f} / "
                      f"{sim['ttft_p95_ms'] / 1000:.1f} s, measured "
                      f"{got['ttft_p50_ms'] / 1000:.1f} / {got['ttft_p95_ms'] / 1000:.1f} s; "
                      f"TGT p95 {sim['tgt_p95_ms'] / 1000:.1f} vs "
                      f"{got['tgt_p95_ms'] / 1000:.1f} s; F1 {sim['quality']:.3f} vs "
                      f"{got['quality']:.3f}; {failed} failed")
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    st = result["statics"]
    ax.scatter([v["tgt_p95_ms"] / 1000 for v in st.values()], [v["quality"] for v in st.values()],
               marker="x", color="tab:red", label="static cascades and single models")
    for m in result["models"]:
        ax.annotate(m.split("[")[0], (st[m]["tgt_p95_ms"] / 1000, st[m]["quality"]), fontsize=7)
    ms = list(result.get("ms_plus", {}).values())
    ax.scatter([v["tgt_p95_ms"] / 1000 for v in ms], [v["quality"] for v in ms], marker="^",
               color="tab:green", label="MS+ (single models switched by load)")
    ken = [p["ken"] for p in result["points"] if "ken" in p]
    ax.plot([k["tgt_p95_ms"] / 1000 for k in ken], [k["quality"] for k in ken], "o-",
            color="tab:blue", label="ken load-gear plans (simulated)")
    for label, r in (result.get("replay") or {}).items():
        if isinstance(r, dict) and "measured" in r:
            ax.plot([r["measured"]["tgt_p95_ms"] / 1000], [r["measured"]["quality"]], "s",
                    mfc="none", label=f"{label}: engine")
    ax.set_xscale("log")
    ax.set_xlabel("TGT p95 on the evaluation window (s)")
    ax.set_ylabel("token F1")
    ax.set_title(f"sem_qa on HybridQA ({result['rows']} rows), Azure code trace")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
