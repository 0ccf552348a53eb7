"""sem_filter's LLM stages (issue 34): how well each separates true from false rows.

Each stage of ``LLM_STAGES`` (``ken/ops/filter_models.py``) predicts ``P(true)`` alone, on
(1) "expresses a negative opinion" over the first ``--rows`` held-out rows of the default
family (label negative = true), and (2) 11 obvious rows over four predicates (an animal, a
negative review, a flight delay, a city). Reports ROC AUC (rank sum), balanced accuracy at
``P = 0.5`` and ms/row, and writes ``filter_stages.json`` to ``--out``.

    python benchmarks/filter_stages.py --rows 100     # about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from ken.models import family
from ken.models.model import DeviceConfig
from ken.models.quality import balanced_accuracy, roc_auc
from ken.models.resources import Resources
from ken.ops.filter_models import LLM_STAGES

RESULTS = Path(__file__).parent / "results" / "filter_stages"
OBVIOUS = {
    "the text is about an animal": [
        ("The dog barked at the mailman all morning.", True),
        ("The stock market closed higher today.", False),
        ("My cat sleeps on the sofa.", True), ("The cow eats grass in the field.", True),
        ("I paid my taxes yesterday.", False)],
    "the review is negative": [
        ("The food was awful and the service was slow.", True),
        ("Amazing food and friendly staff, we will come back!", False)],
    "the text complains about a flight delay": [
        ("My flight to Chicago was delayed by four hours.", True),
        ("I baked a chocolate cake for my sister's birthday.", False)],
    "the text mentions a city": [
        ("Paris is the capital of France.", True), ("I like to eat apples and bananas.", False)],
}



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--stages", default="channel,choice-qwen",
                    help=f"comma-separated, of {', '.join(LLM_STAGES)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sample = family.heldout_sample(family.default_data())
    texts = list(sample.texts[: args.rows])
    negative = sample.label_names.index("negative")
    truth = np.array([int(label) == negative for label in sample.labels[: args.rows]])
    resources = Resources(DeviceConfig(threads=args.threads))
    out: dict = {"rows": len(texts), "negative_share": float(truth.mean()), "stages": {}}
    for stage in args.stages.split(","):
        kind, lm_name = LLM_STAGES[stage]
        lm = resources.causal_lm(lm_name)
        model = kind(lm, "the text expresses a negative opinion", lm_name=lm_name)
        started = time.perf_counter()
        p = np.asarray(model.predict(texts).probabilities)[:, 1]
        ms = 1000 * (time.perf_counter() - started) / len(texts)
        right, total = 0, 0
        for predicate, rows in OBVIOUS.items():
            m = kind(lm, predicate, lm_name=lm_name)
            q = np.asarray(m.predict([t for t, _ in rows]).probabilities)[:, 1]
            right += int(sum((qi > 0.5) == y for qi, (_, y) in zip(q, rows, strict=True)))
            total += len(rows)
        out["stages"][stage] = {
            "auc": roc_auc(p, truth), "ms_per_row": ms,
            "balanced_accuracy": float(np.mean(balanced_accuracy((p > 0.5).tolist(),
                                                                 truth.tolist()))),
            "obvious_right": right, "obvious_rows": total}
        print(f"{stage:12s} AUC {out['stages'][stage]['auc']:.2f}  balanced acc "
              f"{out['stages'][stage]['balanced_accuracy']:.2f}  {ms:.0f} ms/row  obvious "
              f"{right}/{total}", flush=True)
    (args.out / "filter_stages.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
