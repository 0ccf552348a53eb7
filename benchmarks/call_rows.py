"""Which batch runs slow: its rows or its moment? (issue 33, item 3, session 40)

The simulator charges a batch its size's calibrated runtime, scaled by its longest row's
size (characters until session 41, the tokens the model runs since), times a factor drawn
independently per batch (``Calibration.spread``). Fed a
replay's own batch times it reproduces the replay; on a calibration of the replay's own calls
(the same factors' distribution, drawn independently) it under-predicts bursty tails by up to
15%. So what a batch's deviation from its charge follows matters: its moment of the trace
(the load then, what else runs) or its rows. Replays run minutes apart, so what they share
is the trace's and the rows', not a slow spell of the machine's (which no pairing here
repeats).

``--model`` alone on the two CPU workers (batches of up to 4 rows, 5-ms wait) serves one Gamma
trace ``--replays`` times, the sample rows alternating between two draws (row seeds 0 and 1:
the same arrivals with other rows). Per online batch: the log of the time it held its device
over what a calibration fitted on all the replays' calls charges it (its residual). Then:

- ``same_rows``: replays with the same row seed form many batches of the same rows at the
  same moment; the correlation of their residuals (rows and moment together);
- ``same_moment``: replays with different row seeds; each batch against the batch of the same
  size the other replay formed on the same device within ``MOMENT_S`` (other rows, the same
  moment of the same arrivals);
- ``same_row``: one-row batches of the same row in replays with different row seeds, over 1 s
  apart (the row, another moment);
- ``tokens``: where the model has a tokenizer, per batch size, the share of the residuals'
  variance (R^2) that the log of the longest row's tokens explains, beside its characters'
  (the simulator's size model read characters until session 41 and tokens since, so with it
  the tokens should explain little of what is left).

Writes DIR/call_rows.json and DIR/call_rows.png.

    python benchmarks/call_rows.py --out DIR     # about 3 minutes with cached models
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak import soak_setup  # noqa: E402

from ken.engine.calibrate import fit_calibration, predicted_s  # noqa: E402
from ken.engine.replay import Served, serve_trace  # noqa: E402
from ken.optimizer.baselines import dynamic_batching_plan  # noqa: E402
from ken.optimizer.perf import Catalog  # noqa: E402
from ken.optimizer.workload import gamma_trace  # noqa: E402
from ken.progress import Reporter  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "call_rows"
#: two batches on one device formed this near in time are at "the same moment"
MOMENT_S = 0.004
#: one-row batches of the same row this far apart are at "another moment"
APART_S = 1.0


class Residual(NamedTuple):
    """One online batch of a replay: log(held / charged), its sample rows (sorted), when the
    dispatcher formed it (seconds after the replay's first admission), its device, its size."""

    value: float
    rows: tuple[int, ...]
    formed_s: float
    device: str
    size: int


def residuals(served: Served, charged: Catalog) -> list[Residual]:
    """Every online batch of ``served`` against what ``charged`` charges it."""
    log, outcomes, rows = served.path_log, served.replay.outcomes, served.replay.rows
    assert log is not None and rows is not None
    index = {o.request_id: i for i, o in enumerate(outcomes)}
    t0 = min(log.admitted().values())
    return [Residual(float(np.log(b.record.held_s / predicted_s(b.record, charged))),
                     tuple(sorted(int(rows[index[r]]) for r in b.request_ids)),
                     b.formed_s - t0, b.record.device, b.record.rows)
            for b in log.batches()]


def _corr(pairs: Sequence[tuple[float, float]]) -> dict:
    x = np.array([p[0] for p in pairs])
    y = np.array([p[1] for p in pairs])
    ok = len(pairs) > 3 and x.std() > 0 and y.std() > 0
    return {"pairs": len(pairs), "correlation": float(np.corrcoef(x, y)[0, 1]) if ok else None}


def same_rows(a: list[Residual], b: list[Residual]) -> dict:
    """Batches of the same rows in both replays (where ``b`` has several, the one formed
    nearest in time). Between replays with the same row draw these are also at the same
    moment of the trace: the rows and the moment together."""
    by_rows: dict[tuple[int, ...], list[Residual]] = {}
    for y in b:
        by_rows.setdefault(y.rows, []).append(y)
    return _corr([(x.value, min(by_rows[x.rows], key=lambda y: abs(y.formed_s - x.formed_s)).value)
                  for x in a if x.rows in by_rows])


def same_moment(a: list[Residual], b: list[Residual], within_s: float = MOMENT_S) -> dict:
    """Each batch of ``a`` against ``b``'s batch on the same device formed nearest in time,
    where that is within ``within_s``, of the same size and of other rows."""
    pairs = []
    for device in sorted({x.device for x in a}):
        other = sorted((x for x in b if x.device == device), key=lambda x: x.formed_s)
        if not other:
            continue
        t = np.array([x.formed_s for x in other])
        for x in a:
            if x.device != device:
                continue
            j = int(np.clip(np.searchsorted(t, x.formed_s), 1, len(t) - 1)) if len(t) > 1 else 0
            if j > 0 and abs(t[j - 1] - x.formed_s) <= abs(t[j] - x.formed_s):
                j -= 1
            y = other[j]
            if abs(y.formed_s - x.formed_s) <= within_s and y.size == x.size and y.rows != x.rows:
                pairs.append((x.value, y.value))
    return _corr(pairs)


def same_row(a: list[Residual], b: list[Residual], apart_s: float = APART_S) -> dict:
    """One-row batches of the same row in both replays, ``apart_s`` or more apart."""
    singles: dict[tuple[int, ...], list[Residual]] = {}
    for y in b:
        if y.size == 1:
            singles.setdefault(y.rows, []).append(y)
    return _corr([(x.value, y.value) for x in a if x.size == 1
                  for y in singles.get(x.rows, ()) if abs(y.formed_s - x.formed_s) >= apart_s])


def size_r2(res: list[Residual], sizes: np.ndarray) -> dict[int, float | None]:
    """Per batch size: R^2 of the residuals on the log of the batch's largest row size."""
    out: dict[int, float | None] = {}
    for n in sorted({x.size for x in res}):
        mine = [x for x in res if x.size == n]
        v = np.array([x.value for x in mine])
        s = np.log(np.array([max(sizes[list(x.rows)].max(), 1) for x in mine], dtype=float))
        out[n] = (float(np.corrcoef(v, s)[0, 1] ** 2)
                  if len(mine) > 3 and v.std() > 0 and s.std() > 0 else None)
    return out


def token_counts(model: object, texts: Sequence[str]) -> np.ndarray | None:
    """Each text's tokens as ``model`` runs them (its prefix and special tokens, truncated to
    its limit: ``TransformersBody.tokenize``), or None for a model without a transformers
    body."""
    tokenize = getattr(getattr(model, "body", None), "tokenize", None)
    if tokenize is None:
        return None
    return np.array([len(ids) for ids in tokenize(list(texts))], dtype=float)


def summarise(runs: list[dict]) -> dict:
    """Each pair of replays' correlations, grouped by whether their row seeds agree."""
    out: dict = {"same_rows": [], "same_moment": [], "same_row": []}
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            a, b = runs[i]["residuals"], runs[j]["residuals"]
            if runs[i]["row_seed"] == runs[j]["row_seed"]:
                out["same_rows"].append(same_rows(a, b))
            else:
                out["same_moment"].append(same_moment(a, b))
                out["same_row"].append(same_row(a, b))
    for k in list(out):
        values = [p["correlation"] for p in out[k] if p["correlation"] is not None]
        out[f"{k}_median"] = float(np.median(values)) if values else None
    return out


def plot(summary: dict, r2: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    kinds = ["same_rows", "same_moment", "same_row"]
    for k, kind in enumerate(kinds):
        values = [p["correlation"] for p in summary[kind] if p["correlation"] is not None]
        ax.scatter([k] * len(values), values, color="C0")
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xticks(range(len(kinds)), ["same rows,\nsame moment", "other rows,\nsame moment",
                                      "same row,\nother moment"])
    ax.set_ylabel("residual correlation (pairs of replays)")
    for k, (name, per) in enumerate(r2.items()):
        sizes = sorted(per)
        ax2.bar(np.array(sizes) + 0.35 * k - 0.175, [per[n] or 0.0 for n in sizes], 0.35,
                label=f"longest row's {name}")
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("R^2 of the residual")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minilm-l6")
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--cv", type=float, default=3.0)
    ap.add_argument("--replays", type=int, default=6)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.replays < 3 or args.seconds <= 0 or args.rate <= 0 or args.cv <= 0:
        ap.error("--replays >= 3 (two row draws, one of them twice), --seconds, --rate and "
                 "--cv > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    reporter = Reporter()
    started = time.perf_counter()
    profiles, _, hardware, loaders, sample = soak_setup(reporter)
    if args.model not in loaders:
        ap.error(f"--model: one of {', '.join(sorted(loaders))}")
    plan = dynamic_batching_plan("sentiment", args.model, profiles, hardware, 200.0, 4, 0.005)
    trace = gamma_trace(args.rate, args.seconds, args.cv, seed=1)
    served = []
    for k in range(args.replays):
        reporter.note(f"replay {k + 1}/{args.replays} (row seed {k % 2})")
        served.append(serve_trace(plan, {args.model: loaders[args.model]}, trace, sample,
                                  seed=k % 2, reporter=reporter, admission="max_in_flight"))
    charged = fit_calibration([c for s in served for c in s.batch_log], profiles).apply(profiles)
    runs = [{"row_seed": k % 2, "p95_ms": s.replay.result.metrics(0, plan).p95_ms,
             "residuals": residuals(s, charged)} for k, s in enumerate(served)]
    summary = summarise(runs)
    everything = [x for r in runs for x in r["residuals"]]
    texts = list(sample.texts)
    r2 = {"characters": size_r2(everything, np.array([len(t) for t in texts], dtype=float))}
    tokens = token_counts(loaders[args.model](), texts)
    if tokens is not None:
        r2["tokens"] = size_r2(everything, tokens)
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "plan": plan.describe(),
           "p95_ms": [r["p95_ms"] for r in runs], "row_seeds": [r["row_seed"] for r in runs],
           "batches": [len(r["residuals"]) for r in runs],
           "residual_sd": float(np.std([x.value for x in everything])) if everything else None,
           "correlations": summary, "r2_by_batch_size": r2,
           "wall_s": time.perf_counter() - started}
    (args.out / "call_rows.json").write_text(json.dumps(out, indent=1))
    plot(summary, r2, args.out / "call_rows.png")
    reporter.note(
        "residual correlation, median over pairs of replays: same rows "
        f"{summary['same_rows_median']}, other rows at the same moment "
        f"{summary['same_moment_median']}, the same row at another moment "
        f"{summary['same_row_median']}; R^2 by batch size {r2}")
    reporter.note(f"wrote {args.out}/call_rows.json and call_rows.png in "
                  f"{out['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
