"""Generating operators over a table: static vs continuous batching (issue 15).

A semantic query over a table runs a generating operator on many rows at once. With static
batching (``GenerativeModel.predict``, what ``session.sql`` runs) ``B`` rows decode together
until the longest answer of the group ends, while rows that finished early leave their slots
idle. With continuous batching (``ken.engine.decode.generate_rows``) a finished row's slot goes
to the next row at the next pass. On this CPU continuous batching measured slower for these
rows (docs/results.md), which is why ``session.sql`` keeps static batches.

Workloads (HybridQA passages from ``../shared/data/hybridqa``, the first ``--rows`` questions
whose answer is in one passage):

- ``sem_qa(question, passage)``: short answers (<= 24 tokens, one line);
- ``sem_map(passage, 'Summarise the passage in one sentence.')``: longer answers (<= 48).

For each workload, model and batch size ``B`` it times both modes on the same rows (one warm-up
call first), checks that the answers are the same, and reports rows/s, generated tokens/s and
the speed-up. Writes benchmarks/results/llm_batch/llm_batch.json and llm_batch.png.

    python benchmarks/llm_batch.py                 # ~9 minutes on 2 cores (SmolLM2, 48 rows)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "llm_batch"
SUMMARY = "Summarise the passage in one sentence."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--batch-sizes", default="4,8")
    ap.add_argument("--operators", default="sem_qa,sem_map")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    from ken.engine.decode import generate_rows
    from ken.models.model import DeviceConfig
    from ken.models.resources import Resources
    from ken.ops.sem_map import SemMap
    from ken.ops.sem_qa import SemQA, hybridqa_passage_sample
    from ken.progress import Reporter

    reporter = Reporter()
    sample = hybridqa_passage_sample(args.rows)
    resources = Resources(DeviceConfig(threads=args.threads))
    workloads = {
        "sem_qa": (SemQA(), (), list(sample.inputs)),
        "sem_map": (SemMap(), (SUMMARY,), [passage for _q, passage in sample.inputs]),
    }
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    result: dict = {"rows": len(sample), "threads": args.threads, "runs": []}
    started = time.perf_counter()
    for lm in args.models.split(","):
        for name in args.operators.split(","):
            op, constants, rows = workloads[name]
            model = op.stage(resources, lm, constants)
            model.predict(rows[:2], batch_size=2)  # warm-up
            for b in sizes:
                with reporter.task(f"{name} on {lm}, B={b}", 2) as advance:
                    t0 = time.perf_counter()
                    static = model.predict(rows, batch_size=b)
                    static_s = time.perf_counter() - t0
                    advance(1)
                    t0 = time.perf_counter()
                    cont = generate_rows(model, rows, max_running=b)
                    cont_s = time.perf_counter() - t0
                    advance(1)
                tokens = int(np.sum(static.token_counts))
                same = float(np.mean([a == c for a, c in zip(static.values, cont.values,
                                                              strict=True)]))
                run = {"operator": name, "model": lm, "batch": b, "rows": len(rows),
                       "generated_tokens": tokens,
                       "tokens_per_row": {"mean": float(np.mean(static.token_counts)),
                                          "max": int(np.max(static.token_counts))},
                       "static_s": static_s, "continuous_s": cont_s,
                       "static_tokens_per_s": tokens / static_s,
                       "continuous_tokens_per_s": int(np.sum(cont.token_counts)) / cont_s,
                       "speedup": static_s / cont_s, "same_answers": same}
                if name == "sem_qa":
                    run["f1_static"] = float(sample.quality(static.values).mean())
                    run["f1_continuous"] = float(sample.quality(cont.values).mean())
                result["runs"].append(run)
                reporter.note(f"{name} {lm} B={b}: static {static_s:.1f} s, continuous "
                              f"{cont_s:.1f} s ({static_s / cont_s:.2f}x), same answers "
                              f"{same:.0%}")
    result["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_batch.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "llm_batch.png")
    reporter.note(f"wrote {args.out}/llm_batch.json and llm_batch.png")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [f"{r['operator']}\n{r['model']}\nB={r['batch']}" for r in runs]
    x = np.arange(len(runs))
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(runs)), 4))
    ax.bar(x - 0.2, [r["static_tokens_per_s"] for r in runs], 0.4, label="static batching")
    ax.bar(x + 0.2, [r["continuous_tokens_per_s"] for r in runs], 0.4,
           label="continuous batching")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"{result['rows']} HybridQA rows, {result['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
