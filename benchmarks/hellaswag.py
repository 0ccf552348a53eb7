"""HellaSwag with LLM cascades (issue 15; the paper's §5.1 workload): accuracy of SmolLM2-135M
and Qwen2.5-Coder-0.5B alone and of their Pareto cascades, through ken's own profiling and
cascade search (``sem_complete``'s models on the first ``--items`` validation items).

Both LMs score each ending's log-likelihood per byte given the context (the harnesses'
``acc_norm``); the certainty is the chosen ending's probability among the four. Profiles
(batch runtimes at 1/8/32 items on this machine's CPU, 1 thread per model as the planner's
workers run them) are cached under KEN_HOME like every profile. Reports accuracy with its
standard error, the cost per item, and for the best cascades the cost ratio against the most
accurate single model at matched accuracy. Qwen is fetched on first use (478 MB).

Writes benchmarks/results/hellaswag/hellaswag.json and hellaswag.png (accuracy vs ms/item).

    python benchmarks/hellaswag.py --items 300      # ~25 min on 2 cores (first run)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "hellaswag"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=300, help="validation items (first N)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per model")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    import ken
    from ken.models.model import DeviceConfig
    from ken.ops.base import OpContext
    from ken.ops.sem_complete import SemComplete
    from ken.optimizer.cascades import pareto_cascades
    from ken.optimizer.planning import operator_profiles
    from ken.progress import Reporter

    reporter = Reporter()
    op = SemComplete()
    op.eval_items = args.items
    ctx = OpContext(DeviceConfig(threads=args.threads), reporter=reporter)
    sample = op.eval_sample(ctx)
    started = time.perf_counter()
    profiles = operator_profiles(op, ctx, args.threads)
    seconds = time.perf_counter() - started
    n = len(sample)
    singles = {}
    for name, p in profiles.items():
        acc = p.accuracy
        perf_ms = min(t / b for t, b in zip(p.batch_runtime_s, p.batch_sizes, strict=True))
        singles[name] = {"accuracy": acc, "stderr": math.sqrt(acc * (1 - acc) / n),
                         "ms_per_item": 1000 * perf_ms, "params": p.num_params}
    front = pareto_cascades(profiles, batch_size=None)
    best_single = max(singles, key=lambda m: singles[m]["accuracy"])
    best_acc, best_ms = singles[best_single]["accuracy"], singles[best_single]["ms_per_item"]
    cascades = []
    for m in front:
        entry = {"cascade": m.cascade.describe(), "models": list(m.cascade.models),
                 "thresholds": list(m.cascade.thresholds), "accuracy": m.accuracy,
                 "ms_per_item": m.cost_ms_per_row,
                 "stage_fractions": list(m.stage_fractions)}
        if m.accuracy >= best_acc - 0.005:
            entry["speedup_vs_best_single"] = best_ms / m.cost_ms_per_row
        cascades.append(entry)
    result = {"items": n, "sample": sample.name, "threads": args.threads,
              "ken_version": ken.__version__, "profile_seconds": seconds,
              "single_models": singles, "pareto_cascades": cascades,
              "best_single": best_single}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hellaswag.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "hellaswag.png")
    print(f"HellaSwag, first {n} validation items ({args.threads} thread per model):")
    for name, s in singles.items():
        print(f"  {name:28s} accuracy {s['accuracy']:.1%} ± {s['stderr']:.1%}   "
              f"{s['ms_per_item']:7.1f} ms/item")
    print("  Pareto cascades:")
    for c in cascades:
        extra = (f"  {c['speedup_vs_best_single']:.2f}x cheaper than {best_single}"
                 if "speedup_vs_best_single" in c else "")
        print(f"    {c['cascade']:60s} {c['accuracy']:.1%}  {c['ms_per_item']:7.1f} ms/item"
              f"{extra}")
    print(f"wrote {args.out / 'hellaswag.json'} and hellaswag.png")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, s in result["single_models"].items():
        ax.errorbar(s["ms_per_item"], 100 * s["accuracy"], yerr=100 * s["stderr"], fmt="s",
                    label=f"{name} alone", capsize=3)
    xs = [c["ms_per_item"] for c in result["pareto_cascades"]]
    ys = [100 * c["accuracy"] for c in result["pareto_cascades"]]
    ax.plot(xs, ys, "o-", color="black", label="Pareto cascades", zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel("compute per item, ms (profiled, best batch size)")
    ax.set_ylabel("accuracy, %")
    ax.set_title(f"HellaSwag, first {result['items']} validation items")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
