"""Could a better proxy make the top-k plan's expensive stage rarer? (issue 35, item 4)

The top-k plan (``ken.sql.topk``) sends an escalated row to the expensive stage while its
cheap score plus the margin (the largest ``|expensive - cheap|`` of a sample of escalated rows)
can still reach the k-th best value known. With SmolLM2-135M -> Qwen2.5-Coder-0.5B on
``sem_score`` it sent 63% of 320 rows to Qwen (goal: under 20%). This benchmark asks whether a
proxy fitted per query on the same sample would do better, offline:

- ``cheap`` (the plan as built): the cheap score, margin = the sample's largest
  ``|expensive - cheap|``;
- ``affine``: ``a + b * cheap`` fitted on the sample, margin = the largest leave-one-out
  residual (a jackknife margin);
- ``embedding``: ridge regression of the expensive score on MiniLM-L6 sentence features
  (the packaged encoder), its penalty chosen by the smallest leave-one-out margin;
- ``embedding+cheap``: the same with the cheap score as a feature too.

Two more kinds of cheap stage replace the first stage outright (every row escalated, its
value the expensive stage's score):

- ``first-L-layers`` (``--early-exit L,...``): the expensive LM cut after its first ``L``
  decoder layers, its final norm and head reading that layer (an early exit; calibrated
  afresh), margin as ``cheap``; it costs about ``L / layers`` of the whole LM;
- ``int8`` (``--int8``): the expensive LM with every linear layer quantised to int8 (torch's
  dynamic quantisation of a copy; calibrated afresh), margin as ``cheap``;
- ``synthetic r=...`` (``--synthetic``): the expensive score plus Gaussian noise scaled to that
  correlation, margin as ``cheap``: how closely a cheap stage must track the expensive one
  for the plan to send few rows on.

Every row of the first ``--rows`` SST-2 dev sentences is scored by both stages and encoded
once; then, for each proxy and sample size, ``--seeds`` samples of escalated rows replay the
plan's steps 2-3 on those numbers (most promising first, in batches, until no row can reach the
k-th best). Reported per proxy: the expensive stage's share of the rows (mean, min, max) and the
recall of the exact top k (the top k of every row's cascade value).

    python benchmarks/topk_proxies.py --out DIR    # 2 min on 2 cores with bf16, 9 in fp32
    python benchmarks/topk_proxies.py --early-exit 8,12 --out DIR   # 16 min in fp32
    python benchmarks/topk_proxies.py --rows 200 --int8 --synthetic '' --out DIR

Writes DIR/topk_proxies.json and topk_proxies.png (cheap against expensive scores; each
proxy's expensive share).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import ken
from ken.models.datasets import load_sst2
from ken.models.model import DeviceConfig
from ken.models.resources import Resources, normalise_rows
from ken.progress import Reporter

sys.path.insert(0, str(Path(__file__).parent))
from query_shapes import RUBRIC, TOPK_LLMS  # noqa: E402 - the top-k shape's rubric and LMs

RESULTS = Path(__file__).parent / "results" / "topk_proxies"
PENALTIES = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)

#: a proxy: (the sampled rows, their expensive values) -> (every row's estimate of its
#: expensive value, the margin)
Proxy = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, float]]


def ridge_loo(x: np.ndarray, y: np.ndarray, penalty: np.ndarray) -> tuple[np.ndarray,
                                                                          np.ndarray]:
    """Ridge weights (``penalty`` per column) and the leave-one-out residuals (closed form)."""
    inv = np.linalg.pinv(x.T @ x + np.diag(penalty))
    w = inv @ x.T @ y
    hat = np.einsum("ij,jk,ik->i", x, inv, x)
    return w, (y - x @ w) / np.maximum(1.0 - hat, 1e-9)


def fitted(x: np.ndarray, free: int) -> Proxy:
    """A ridge proxy on the columns ``x`` (one row per row): the first ``free`` columns
    unpenalised, the others at the penalty whose leave-one-out margin is smallest."""
    def proxy(sample: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
        best = None
        for lam in PENALTIES if x.shape[1] > free else (0.0,):
            pen = np.r_[np.zeros(free), np.full(x.shape[1] - free, lam)]
            w, loo = ridge_loo(x[sample], y, pen)
            if best is None or np.max(np.abs(loo)) < best[0]:
                best = (float(np.max(np.abs(loo))), w)
        assert best is not None
        return x @ best[1], best[0]
    return proxy


def proxies(cheap: np.ndarray, emb: np.ndarray) -> dict[str, Proxy]:
    ones = np.ones((len(cheap), 1))
    return {
        "cheap": max_gap(cheap),
        "affine": fitted(np.c_[ones, cheap], 2),
        "embedding": fitted(np.c_[ones, emb], 1),
        "embedding+cheap": fitted(np.c_[ones, cheap, emb], 2),
    }


def max_gap(estimate: np.ndarray) -> Proxy:
    """A fixed estimate of every row, margin = the sample's largest ``|expensive - estimate|``
    (the rule the plan applies to its cheap stage)."""
    return lambda s, y: (estimate, float(np.max(np.abs(y - estimate[s]))))


def cut_layers(model, layers: int):  # noqa: ANN001, ANN201 - a score stage, torch modules
    """The decoder layer list of ``model``'s LM, after checking that it can be cut after
    ``layers`` of them."""
    import torch

    stack = getattr(getattr(model.lm.net, "model", None), "layers", None)
    if not isinstance(stack, torch.nn.ModuleList):
        raise SystemExit(f"--early-exit: {model.name}'s LM has no decoder layer list to cut")
    if not 0 < layers < len(stack):
        raise SystemExit(f"--early-exit {layers}: {model.name}'s LM has {len(stack)} layers; "
                         f"give 1 to {len(stack) - 1}")
    return stack


def early_exit(model, texts: list[str], layers: int) -> tuple[np.ndarray, float]:  # noqa: ANN001
    """``model`` (a score stage over a decoder-only transformers LM) with its LM cut after its
    first ``layers`` decoder layers, scoring ``texts`` (calibrated afresh on the cut LM); the
    scores and the seconds they took. The LM is whole again afterwards."""
    import torch

    net = model.lm.net
    stack = cut_layers(model, layers)
    net.model.layers = torch.nn.ModuleList(list(stack)[:layers])
    try:
        cut = type(model)(model.lm, model.scale, model.prompter,
                          f"{model.name}-first-{layers}-layers", "sem-score", "early-exit")
        t0 = time.perf_counter()
        values = np.array(cut.predict(texts).values, dtype=np.float64)
        return values, time.perf_counter() - t0
    finally:
        net.model.layers = stack


def quantised(model, texts: list[str]) -> tuple[np.ndarray, float]:  # noqa: ANN001
    """``model`` (a score stage over a transformers LM) with an int8 copy of its LM (every
    linear layer, torch's dynamic quantisation), scoring ``texts`` (calibrated afresh); the
    scores and the seconds they took. The LM is the original again afterwards."""
    import torch

    net = model.lm.net
    model.lm.net = torch.ao.quantization.quantize_dynamic(net, {torch.nn.Linear},
                                                           dtype=torch.qint8)
    try:
        copy = type(model)(model.lm, model.scale, model.prompter, f"{model.name}-int8",
                           "sem-score", "int8")
        t0 = time.perf_counter()
        values = np.array(copy.predict(texts).values, dtype=np.float64)
        return values, time.perf_counter() - t0
    finally:
        model.lm.net = net


def synthetic(expensive: np.ndarray, correlation: float, seed: int) -> np.ndarray:
    """The expensive scores plus Gaussian noise whose size gives ``correlation`` with them
    (in expectation)."""
    sd = float(np.std(expensive)) * np.sqrt(1.0 / correlation ** 2 - 1.0)
    return expensive + np.random.default_rng(seed).normal(0.0, sd, len(expensive))


def replay(final: np.ndarray, escalated: np.ndarray, proxy: Proxy, sample_rows: int, k: int,
           seed: int, batch: int) -> tuple[float, float]:
    """The top-k plan's steps 2-3 (descending) with ``proxy``: the expensive stage's share of
    the rows and the recall of the exact top k (of ``final``: every row's cascade value)."""
    n = len(final)
    pool = np.flatnonzero(escalated)
    sample = np.sort(np.random.default_rng(seed).choice(pool, min(sample_rows, len(pool)),
                                                        replace=False))
    known = {int(i): final[i] for i in np.flatnonzero(~escalated)}
    known.update({int(i): final[i] for i in sample})
    est, margin = proxy(sample, final[sample])
    order = sorted((int(i) for i in pool if int(i) not in known), key=lambda i: -est[i])
    while order:
        bar = np.sort(list(known.values()))[-k] if len(known) >= k else -np.inf
        if est[order[0]] + margin < bar:
            break
        take = []
        while order and len(take) < batch and est[order[0]] + margin >= bar:
            take.append(order.pop(0))
        known.update({i: final[i] for i in take})
    top = set(np.argsort(-final, kind="stable")[:k].tolist())
    got = set(sorted(known, key=lambda i: (-known[i], i))[:k])
    return (len(pool) - len(order)) / n, len(got & top) / k


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=320)
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="the shared data folder (default: ../shared/data or $KEN_DATA)")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--samples", default="19,38", help="sample sizes, comma-separated")
    ap.add_argument("--seeds", type=int, default=20, help="samples drawn per size")
    ap.add_argument("--early-exit", default="",
                    help="also the expensive LM cut after these many layers, comma-separated")
    ap.add_argument("--int8", action="store_true",
                    help="also an int8 copy of the expensive LM as the cheap stage")
    ap.add_argument("--synthetic", default="0.9,0.95,0.98,0.99",
                    help="correlations of synthetic cheap stages, comma-separated ('' for none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    try:
        layers = [int(x) for x in args.early_exit.split(",") if x.strip()]
        correlations = [float(x) for x in args.synthetic.split(",") if x.strip()]
    except ValueError as e:
        ap.error(f"--early-exit takes layer counts and --synthetic correlations, "
                 f"comma-separated: {e}")
    if any(not 0.0 < r < 1.0 for r in correlations):
        ap.error(f"--synthetic {args.synthetic}: correlations lie strictly between 0 and 1")
    reporter = Reporter(args.quiet)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    data = load_sst2("dev", args.data_dir)
    texts = list(data.texts[: args.rows])
    session = ken.connect(cache=False)
    op = session.operators["sem_score"]
    op.llms = TOPK_LLMS
    bound = session.bind("sem_score", (RUBRIC,))
    first, second = bound.cascade.models[:2]
    for n_layers in layers:
        cut_layers(bound.models[second], n_layers)  # fails now, not after the scoring
    values, timings = {}, {}
    certainty = None
    for name in (first, second):
        t0 = time.perf_counter()
        out = bound.models[name].predict(texts)
        timings[name] = time.perf_counter() - t0
        values[name] = np.array(bound.to_sql_values(out.values), dtype=np.float64)
        if name == first:
            certainty = np.asarray(out.certainty(bound.cascade.certainty), dtype=np.float64)
        reporter.note(f"{name} scored {len(texts)} rows in {timings[name]:.1f} s")
    assert certainty is not None
    replacements: dict[str, np.ndarray] = {}
    for n_layers in layers:
        name = f"first-{n_layers}-layers"
        replacements[name], timings[name] = early_exit(bound.models[second], texts, n_layers)
        reporter.note(f"{second} cut after {n_layers} layers scored {len(texts)} rows in "
                      f"{timings[name]:.1f} s")
    if args.int8:
        replacements["int8"], timings["int8"] = quantised(bound.models[second], texts)
        reporter.note(f"an int8 copy of {second} scored {len(texts)} rows in "
                      f"{timings['int8']:.1f} s")
    emb = normalise_rows(Resources(DeviceConfig(threads=args.threads)).encoder("minilm-l6")
                         .features(texts))
    cheap, expensive = values[first], values[second]
    escalated = bound.cascade.escalates(0, certainty)
    final = np.where(escalated, expensive, cheap)
    batch = max(8, min(args.k, 32))
    result: dict = {"rows": len(texts), "k": args.k, "escalated": int(escalated.sum()),
                    "stages": [first, second], "seconds": timings,
                    "correlation": float(np.corrcoef(cheap, expensive)[0, 1]),
                    "top_k_range": [float(np.sort(final)[-args.k]), float(final.max())],
                    "proxies": []}
    reporter.note(f"{result['escalated']} of {len(texts)} rows escalated; correlation of the "
                  f"two stages' scores {result['correlation']:.3f}")
    for i, r in enumerate(correlations):
        replacements[f"synthetic r={r:g}"] = synthetic(expensive, r, seed=i)
    result["replacements"] = {
        name: {"correlation": float(np.corrcoef(v, expensive)[0, 1]),
               "seconds": timings.get(name)} for name, v in replacements.items()}
    for name, info in result["replacements"].items():
        reporter.note(f"{name}: correlation with {second}'s scores {info['correlation']:.3f}")
    every = np.ones(len(texts), dtype=bool)
    for size in (int(x) for x in args.samples.split(",")):
        cases = [(name, proxy, final, escalated)
                 for name, proxy in proxies(cheap, emb).items()]
        cases += [(name, max_gap(v), expensive, every) for name, v in replacements.items()]
        for name, proxy, truth, escalates in cases:
            runs = np.array([replay(truth, escalates, proxy, size, args.k, seed, batch)
                             for seed in range(args.seeds)])
            row = {"proxy": name, "sample": size, "expensive_share": float(runs[:, 0].mean()),
                   "expensive_share_min": float(runs[:, 0].min()),
                   "expensive_share_max": float(runs[:, 0].max()),
                   "recall": float(runs[:, 1].mean()), "recall_min": float(runs[:, 1].min())}
            result["proxies"].append(row)
            reporter.note(f"sample {size:>3} {name:>16}: expensive share "
                          f"{row['expensive_share']:.1%} ({row['expensive_share_min']:.1%}-"
                          f"{row['expensive_share_max']:.1%}), recall {row['recall']:.2f} "
                          f"(min {row['recall_min']:.2f})")
    result["wall_s"] = time.perf_counter() - started
    (args.out / "topk_proxies.json").write_text(json.dumps(result, indent=1))
    plot(cheap, expensive, result, args.out / "topk_proxies.png")
    reporter.note(f"wrote {args.out}/topk_proxies.json and topk_proxies.png in "
                  f"{result['wall_s']:.0f} s")
    return 0


def plot(cheap: np.ndarray, expensive: np.ndarray, result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.scatter(cheap, expensive, s=8, alpha=0.6)
    a.set_xlabel(f"{result['stages'][0]} score")
    a.set_ylabel(f"{result['stages'][1]} score")
    a.set_title(f"{result['rows']} rows, correlation {result['correlation']:.2f}")
    rows = result["proxies"]
    labels = [f"{r['proxy']}\nn={r['sample']}" for r in rows]
    b.bar(range(len(rows)), [100 * r["expensive_share"] for r in rows])
    b.axhline(20, color="red", lw=0.8, ls="--", label="goal: under 20%")
    b.set_xticks(range(len(rows)), labels, fontsize=7, rotation=45, ha="right")
    b.set_ylabel("rows sent to the expensive stage (%)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
