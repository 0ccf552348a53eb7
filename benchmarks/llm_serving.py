"""Serving a generating LLM on the Azure trace: continuous vs static batching, simulated
against measured (issue 15, token-level cost).

For each model (SmolLM2-135M by default; ``--models smollm2-135m,qwen2.5-coder-0.5b``):

1. **Token cost**: real prefill and decode passes timed on a grid (batch 1/4/8 x 32/128/256
   tokens) and fitted (``ken.optimizer.tokens``); cached under KEN_HOME.
2. **Trace**: ``--requests`` consecutive requests of the Azure LLM code trace from its busiest
   minute, rate-scaled so their mean rate is ``--load`` x the rate the model sustains with
   continuous batching (found by simulation). The trace's ContextTokens and GeneratedTokens give
   each request's prompt and answer length, scaled to this CPU: prompt = ContextTokens /
   ``--context-scale`` (clipped to 8..256), answer = GeneratedTokens clipped to
   ``--max-new`` (the code trace's median answer is 13 tokens). Prompts are random token ids
   (the cost of a pass does not depend on which tokens); answers run to their length
   (end-of-sequence ignored), as serving benchmarks do.
3. **Simulated** load sweep: TTFT and TGT p50/p95 for continuous and static (request-level)
   batching from 0.2x to 2x the sustained rate, same ``DecodeScheduler`` policy, ``--max-running``
   rows per batch.
4. **Measured**: the same requests replayed through the engine's ``DecodeServer`` (wall clock,
   real passes) in both modes at ``--load``; simulated vs measured side by side.

Writes benchmarks/results/llm_serving/llm_serving.json and llm_serving.png.

    python benchmarks/llm_serving.py                  # ~8 minutes on 2 cores (SmolLM2)
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

RESULTS = Path(__file__).parent / "results" / "llm_serving"


def trace_requests(n: int, context_scale: float, max_new: int):  # noqa: ANN201
    """``n`` consecutive Azure requests starting at its busiest minute (times from 0)."""
    from ken.optimizer.workload import load_azure_trace

    trace = load_azure_trace()
    t = trace.arrival_s
    starts = np.searchsorted(t, t + 60.0) - np.arange(t.size)  # arrivals in the next minute
    first = int(np.argmax(starts[: max(1, t.size - n)]))
    sl = slice(first, first + n)
    arrivals = t[sl] - t[first]
    prompts = np.clip(np.round(trace.context_tokens[sl] / context_scale), 8, 256).astype(int)
    outputs = np.clip(trace.generated_tokens[sl], 1, max_new).astype(int)
    return arrivals, prompts, outputs


def sustained_rate(cost, prompts, outputs, max_running: int) -> float:  # noqa: ANN001
    """Requests per second the model keeps up with (continuous batching, all at once)."""
    from ken.optimizer.decode_sim import simulate_decoding

    run = simulate_decoding(cost, np.zeros(len(prompts)), prompts, outputs, max_running)
    return len(prompts) / float(run.completion_s.max())


def results_row(m: PlanMetrics) -> dict[str, float]:
    """A decoding run's metrics under the names this benchmark's results use (TGT for the
    request latency)."""
    return {"requests": m.num_requests, "ttft_p50_ms": m.ttft_p50_ms,
            "ttft_p95_ms": m.ttft_p95_ms, "ttft_p99_ms": m.ttft_p99_ms,
            "tgt_p50_ms": m.tgt_p50_ms, "tgt_p95_ms": m.tgt_p95_ms, "tgt_p99_ms": m.tgt_p99_ms,
            "time_per_token_ms": m.time_per_token_ms, "tokens_per_s": m.tokens_per_s,
            "passes": m.passes, "prefill_passes": m.prefill_passes,
            "utilisation": m.utilisation[0][1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--load", type=float, default=0.7,
                    help="mean rate of the replay as a share of the sustained rate")
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--context-scale", type=float, default=16.0)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    for name, v in (("requests", args.requests - 1), ("threads", args.threads),
                    ("max-running", args.max_running), ("max-new", args.max_new)):
        if v < 1:
            ap.error(f"--{name} must be >= {2 if name == 'requests' else 1}")
    if not args.load > 0 or not args.context_scale > 0:
        ap.error("--load and --context-scale must be > 0")

    from ken.engine.decode import DecodeServer, as_run, replay
    from ken.models.model import DeviceConfig
    from ken.models.resources import Resources
    from ken.optimizer.decode_sim import simulate_decoding
    from ken.optimizer.tokens import load_or_measure_token_cost, random_prompts
    from ken.progress import Reporter

    reporter = Reporter()
    started = time.perf_counter()
    arrivals, prompts, outputs = trace_requests(args.requests, args.context_scale, args.max_new)
    res = Resources(DeviceConfig(threads=args.threads))
    result: dict = {"setup": {k: str(v) for k, v in vars(args).items()}, "models": {}}
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        lm = res.causal_lm(model)
        cost = load_or_measure_token_cost(lm, model, reporter=reporter)
        rate = sustained_rate(cost, prompts, outputs, args.max_running)
        scale = arrivals[-1] / (args.requests / (args.load * rate)) if arrivals[-1] > 0 else 1
        times = arrivals / scale
        reporter.note(f"{model}: sustains ~{rate:.2f} req/s (simulated, continuous batching of "
                      f"{args.max_running}); replaying {args.requests} requests at "
                      f"{args.load:g}x ({args.requests / times[-1]:.2f} req/s)")
        sweep = []
        for load in (0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0):
            span = args.requests / (load * rate)
            t = arrivals * (span / arrivals[-1]) if arrivals[-1] > 0 else arrivals
            row = {"load": load, "qps": args.requests / span}
            for mode in ("continuous", "static"):
                m = simulate_decoding(cost, t, prompts, outputs, args.max_running,
                                      mode=mode).metrics()
                row[mode] = results_row(m)
            sweep.append(row)
        rng = np.random.default_rng(0)
        token_prompts = [random_prompts(lm, 1, int(k), rng)[0] for k in prompts]
        measured = {}
        for mode in ("continuous", "static"):
            sim = simulate_decoding(cost, times, prompts, outputs, args.max_running,
                                    mode=mode).metrics()
            reporter.note(f"  replaying through the engine ({mode} batching)...")
            server = DecodeServer(lm, args.max_running, mode=mode, ignore_eos=True).start()
            outcomes = replay(server, times, token_prompts, outputs)
            server.shutdown()
            bad = [o for o in outcomes if o.status != "ok"]
            run = as_run(outcomes, server.passes, server.prefill_passes, server.busy_s)
            got = run.metrics()
            measured[mode] = {"simulated": results_row(sim), "measured": results_row(got),
                              "failed_requests": len(bad),
                              "tokens_match": bool(np.array_equal(run.output_tokens, outputs))}
            reporter.note(f"  {mode:10s} TTFT p50/p95 simulated {sim.ttft_p50_ms:7.0f} / "
                          f"{sim.ttft_p95_ms:7.0f} ms, measured {got.ttft_p50_ms:7.0f} / "
                          f"{got.ttft_p95_ms:7.0f} ms; TGT p95 {sim.tgt_p95_ms:7.0f} vs "
                          f"{got.tgt_p95_ms:7.0f} ms")
        result["models"][model] = {
            "token_cost": json.loads(cost.to_json()), "sustained_qps": rate,
            "replay_qps": args.requests / times[-1],
            "prompt_tokens": {"median": float(np.median(prompts)), "max": int(prompts.max())},
            "output_tokens": {"median": float(np.median(outputs)), "max": int(outputs.max())},
            "sweep": sweep, "replay": measured}
    result["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_serving.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "llm_serving.png")
    reporter.note(f"wrote {args.out}/llm_serving.json and llm_serving.png in "
                  f"{result['wall_s'] / 60:.1f} min")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, (model, r) in zip(axes[0], models.items(), strict=True):
        for mode, colour in (("continuous", "tab:blue"), ("static", "tab:red")):
            x = [s["qps"] for s in r["sweep"]]
            ax.plot(x, [s[mode]["ttft_p95_ms"] / 1000 for s in r["sweep"]], "-", color=colour,
                    label=f"{mode}: TTFT p95 (simulated)")
            ax.plot(x, [s[mode]["tgt_p95_ms"] / 1000 for s in r["sweep"]], ":", color=colour,
                    label=f"{mode}: TGT p95 (simulated)")
            m = r["replay"][mode]["measured"]
            ax.plot([r["replay_qps"]], [m["ttft_p95_ms"] / 1000], "o", color=colour,
                    label=f"{mode}: TTFT p95 (engine)")
            ax.plot([r["replay_qps"]], [m["tgt_p95_ms"] / 1000], "s", color=colour,
                    mfc="none", label=f"{mode}: TGT p95 (engine)")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s, Azure code trace, rate-scaled)")
        ax.set_ylabel("seconds")
        ax.set_title(model)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
