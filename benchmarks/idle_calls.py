"""How much slower a model call is after its device idled (issue 5, simulator fidelity).

Profiles time calls back to back; a serving device at low load idles between calls. This times
single-row calls of each packaged model on one CPU thread after idle gaps of 0, 5, 20, 100 and
300 ms (the same held-out tweets for every gap) and writes benchmarks/results/idle_calls.json.

    python benchmarks/idle_calls.py                  # ~1 minute with cached models
    python benchmarks/idle_calls.py --models minilm-l3 --calls 60
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from ken.models import family
from ken.models.model import DeviceConfig
from ken.progress import Reporter

RESULTS = Path(__file__).parent / "results"
GAPS_S = (0.0, 0.005, 0.02, 0.1, 0.3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["minilm-l3", "minilm-l6"])
    ap.add_argument("--calls", type=int, default=60, help="timed calls per gap")
    args = ap.parse_args()
    reporter = Reporter(False)
    data = family.default_data()
    device = DeviceConfig(threads=1)
    cards = {c.name: c for c in family.prepare(data, device, reporter=reporter)}
    texts = list(family.heldout_sample(data).texts[: args.calls])
    out = {}
    for name in args.models:
        model = family.load_model(cards[name], device, data=data)
        model.predict(texts[:8], 8)  # warm-up
        row = {}
        for gap in GAPS_S:
            times = []
            for text in texts:
                time.sleep(gap)
                t0 = time.perf_counter()
                model.predict([text], 1)
                times.append(time.perf_counter() - t0)
            row[f"{gap * 1000:g} ms"] = {"median_ms": 1000 * float(np.median(times)),
                                         "p95_ms": 1000 * float(np.percentile(times, 95))}
        out[name] = row
        reporter.note(f"{name}, one row after an idle gap: " + ", ".join(
            f"{g} {v['median_ms']:.1f} ms" for g, v in row.items()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "idle_calls.json").write_text(json.dumps(out, indent=1))
    reporter.note(f"wrote {RESULTS / 'idle_calls.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
