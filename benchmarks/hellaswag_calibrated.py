"""HellaSwag with calibrated scoring (issue 34): does subtracting each ending's score after a
content-free context (``ContinuationModel(calibrate=True)``, as ``sem_choice`` does) help?

Accuracy (``acc_norm``: per-byte log-likelihood of the ending) with its standard error, raw
and calibrated, for SmolLM2-135M on the first ``--items`` validation items and for
Qwen2.5-Coder-0.5B on the first ``--qwen-items``. Writes ``hellaswag_calibrated.json`` to
``--out``.

    python benchmarks/hellaswag_calibrated.py     # about 15 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from ken.models.llm import ContinuationModel
from ken.models.model import DeviceConfig
from ken.models.resources import Resources
from ken.ops.sem_complete import load_hellaswag

RESULTS = Path(__file__).parent / "results" / "hellaswag_calibrated"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--qwen-items", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    contexts, endings, gold = load_hellaswag(limit=max(args.items, args.qwen_items))
    resources = Resources(DeviceConfig(threads=args.threads))
    out: dict = {}
    for lm_name, n in (("smollm2-135m", args.items), ("qwen2.5-coder-0.5b", args.qwen_items)):
        lm = resources.causal_lm(lm_name)
        rows = [(c, "\n".join(e)) for c, e in zip(contexts[:n], endings[:n], strict=True)]
        for calibrate in (False, True):
            model = ContinuationModel(lm, f"hs-{lm_name}", "hellaswag", calibrate=calibrate)
            started = time.perf_counter()
            values = model.predict(rows, batch_size=8).values
            seconds = time.perf_counter() - started
            right = np.array([v == g for v, g in zip(values, gold[:n], strict=True)], float)
            acc = float(right.mean())
            key = f"{lm_name} {'calibrated' if calibrate else 'raw'}"
            out[key] = {"items": n, "accuracy": acc,
                        "stderr": math.sqrt(acc * (1 - acc) / n), "s_per_item": seconds / n}
            print(f"{key:32s} {100 * acc:.1f}% ± {100 * out[key]['stderr']:.1f} on {n} items, "
                  f"{seconds / n:.2f} s/item", flush=True)
    (args.out / "hellaswag_calibrated.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
