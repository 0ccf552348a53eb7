"""Why the simulator charged later cascade stages too little (issue 33, item 3): a call's
runtime grows with its row's length, and the rows that escalate are longer than average.

Times one-row calls of MiniLM-L6 and SmolLM2 (1 thread, in this process) on the first 150
held-out tweets of the default family, and prints the percentiles of those times, their
correlation with the tweet's characters and with its size as the model counts it
(``Model.row_sizes``: tokens), and the size share the profile fitted (on those sizes); then the mean
length of all sample rows, of those the cascade L3 -(0.757)-> L6 -(0.564)-> SmolLM2 passes on
to L6, and of those it passes on to SmolLM2. Writes ``row_size.json`` to ``--out``.

    python benchmarks/row_size.py     # about a minute, models and profiles cached
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from ken.models import family
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig, row_size
from ken.optimizer.perf import Catalog
from ken.progress import Reporter

sys.path.insert(0, str(Path(__file__).parent))
from e2e import family_setup  # noqa: E402 - the e2e benchmark's setup

RESULTS = Path(__file__).parent / "results" / "row_size"
CASCADE = Cascade(("minilm-l3", "minilm-l6", "smollm2-135m"), (0.757, 0.564))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=150, help="tweets timed one at a time")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    sample, models, _, profiles = family_setup(family.FamilyData("mixed", 6000, 1500),
                                               DeviceConfig(threads=1), "thread", Reporter())
    texts = list(sample.as_eval().inputs)
    sizes = np.array([row_size(t) for t in texts], dtype=np.float64)
    out: dict = {"timed_rows": args.rows, "models": {}}
    for name in ("minilm-l6", "smollm2-135m"):
        model = models[name]
        model.warm_up()
        ms = []
        for t in texts[:args.rows]:
            t0 = time.perf_counter()
            model.predict([t])
            ms.append(1000 * (time.perf_counter() - t0))
        p10, p50, p90 = np.percentile(ms, [10, 50, 90])
        corr = float(np.corrcoef(ms, sizes[:args.rows])[0, 1])
        own = float(np.corrcoef(ms, model.row_sizes(texts[:args.rows]))[0, 1])
        out["models"][name] = {"ms_p10": p10, "ms_p50": p50, "ms_p90": p90,
                               "correlation_with_characters": corr,
                               "correlation_with_own_sizes": own,
                               "profile_size_share": profiles[name].size_share}
        print(f"{name}: one-row calls {p10:.1f} / {p50:.1f} / {p90:.1f} ms (p10 / p50 / p90), "
              f"correlation with characters {corr:.2f}, with its own sizes {own:.2f}, "
              f"profile's size share {profiles[name].size_share:.2f}", flush=True)
    catalog = Catalog.from_profiles(profiles)
    to_l6 = CASCADE.escalates(0, catalog.certainty(CASCADE.models[0], CASCADE.certainty))
    to_smol = to_l6 & CASCADE.escalates(1, catalog.certainty(CASCADE.models[1],
                                                              CASCADE.certainty))
    out["mean_characters"] = {"all": float(sizes.mean()), "to_l6": float(sizes[to_l6].mean()),
                              "to_smollm2": float(sizes[to_smol].mean())}
    print(f"mean characters: all rows {sizes.mean():.1f}, passed on to L6 "
          f"{sizes[to_l6].mean():.1f} ({to_l6.mean():.0%} of rows), passed on to SmolLM2 "
          f"{sizes[to_smol].mean():.1f} ({to_smol.mean():.0%})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "row_size.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}/row_size.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
