"""Overhead of ken's cascade batch execution over calling a model directly.

For each packaged model, classify the same unseen tweets (a) by calling ``model.predict`` on a
Python list at batch size B and (b) through ``run_cascade`` with a single-model cascade over an
Arrow column at the same B. Runs alternate (a, b, a, b, ...) so drift hits both equally; the
ratio of medians is reported. Writes JSON + PNG to ``benchmarks/results/``.

    python benchmarks/cascade_overhead.py [--rows 512] [--batch-sizes 1 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pyarrow as pa

from ken.engine.batch import run_cascade
from ken.models import family
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig
from ken.progress import Reporter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(family.MEMBER_NAMES))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    data = family.default_data()
    device = DeviceConfig(threads=args.threads)
    reporter = Reporter()
    cards = family.prepare(data, device, reporter=reporter)
    texts = list(data.unseen(args.rows).texts)
    column = pa.array(texts, pa.string())
    points = []
    for card in cards:
        if card.name not in args.models:
            continue
        model = family.load_model(card, device, data=data)
        models = {card.name: model}
        cascade = Cascade((card.name,))
        for batch in args.batch_sizes:
            rows = texts if batch > 1 else texts[: max(64, args.rows // 8)]
            col = column if batch > 1 else column.slice(0, len(rows))
            model.predict(rows[:16], batch)  # warm-up
            direct, ken = [], []
            with reporter.task(f"{card.name} batch {batch}", args.repeats) as advance:
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    model.predict(rows, batch)
                    direct.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    run_cascade(cascade, models, col, batch)
                    ken.append(time.perf_counter() - t0)
                    advance(1)
            point = {
                "model": card.name, "batch_size": batch, "rows": len(rows),
                "threads": args.threads, "direct_s": direct, "ken_s": ken,
                "direct_ms_per_row": statistics.median(direct) / len(rows) * 1000,
                "ken_ms_per_row": statistics.median(ken) / len(rows) * 1000,
                "overhead_ratio": statistics.median(ken) / statistics.median(direct),
            }
            points.append(point)
            reporter.note(f"{card.name} b{batch}: direct {point['direct_ms_per_row']:.2f} "
                          f"ms/row, ken {point['ken_ms_per_row']:.2f} ms/row, "
                          f"ratio {point['overhead_ratio']:.3f}")
        del model, models
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cascade_overhead.json").write_text(json.dumps(points, indent=2))
    plot(points, args.out / "cascade_overhead.png")
    print(f"wrote {args.out / 'cascade_overhead.json'} and .png")


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{p['model']}\nb{p['batch_size']}" for p in points]
    ax.bar(range(len(points)), [p["overhead_ratio"] for p in points], color="tab:blue")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.1, color="tab:red", ls="--", lw=0.8, label="10% overhead goal")
    ax.set_xticks(range(len(points)), labels, fontsize=8)
    ax.set_ylabel("ken time / direct model call")
    ax.set_ylim(0.8, max(1.2, max(p["overhead_ratio"] for p in points) + 0.05))
    ax.legend(fontsize=8)
    ax.set_title("single-model cascade over Arrow vs direct predict()")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
