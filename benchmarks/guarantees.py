"""Do cascade thresholds chosen with a guarantee meet their target, and what do they cost?
(issue 36, item 1; ``ken.optimizer.guarantee``)

For each operator the population is its profile: every candidate model's value and scores on
the operator's evaluation sample (``operator_profiles``; 1,500 tweets for ``sentiment`` and
``sem_filter``, 2,000 record pairs for ``sem_match``). The cascade is every candidate, cheapest
first; the oracle is the most expensive (SmolLM2-135M for ``sentiment``, the channel LLM stage
on SmolLM2 for ``sem_filter``, the MiniLM-L6 matcher for ``sem_match``). The threshold path is
built from the pool's certainties (no oracle answer). Per target (delta 0.05), 200 repetitions
each draw a fresh uniform sample of distinct rows of the size ``sample_size`` sets, choose
thresholds on it, and apply them to the whole pool:

* **missed**: the share of repetitions whose cascade's metric against the oracle on the whole
  pool is below the target (the guarantee: at most delta). ``missed (query)`` is the same when
  the sample rows keep the oracle's answers, as a query does.
* **oracle calls**: the sample plus the rows outside it that reach the oracle (the whole pool
  when it fell back), mean over the repetitions; ``escalated`` is the share of rows outside
  the sample reaching the oracle (what the calls per row tend to on a large table).

Beside it, on the same pool and sample sizes:

* **LOTUS-style** (Patel et al. 2024, following LOTUS's open-source threshold code): the first
  stage as the proxy and the oracle, a sample drawn by importance sampling (weights
  ``0.5 * sqrt(score) / sum + 0.5 / N``, with replacement), normal-approximation bounds; a
  precision target sets the accept threshold tau+ from a union bound over every sample score
  (rows below it go to the oracle); a recall target sets the reject threshold tau- from
  LOTUS's corrected recall target (rows above it are accepted, none go to the oracle). LOTUS
  has no accuracy target: there the baseline is the same path as ken's with a
  normal-approximation bound and a union bound over its steps instead of exact bounds and
  fixed-sequence testing.
* **fixed**: the thresholds ken's planner picks today without a guarantee
  (``planning.choose_cascade``: the cheapest Pareto cascade at least as accurate as the best
  single model, on the evaluation labels), applied to the pool: one number, no sampling.

Writes ``guarantees.json`` and ``guarantees.png`` to ``--out``.

    python benchmarks/guarantees.py --out benchmarks/results/guarantees   # ~1 min, profiled
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import ken
from ken.models.cascade import Cascade
from ken.models.model import BOOLEAN_LABELS
from ken.optimizer.guarantee import (
    POSITIVE,
    GuaranteeTarget,
    StageOutcomes,
    choose_thresholds,
    quantile_path,
    sample_size,
)
from ken.optimizer.planning import choose_cascade, operator_profiles

RESULTS = Path(__file__).parent / "results" / "guarantees"
DELTA = 0.05
TARGETS = {
    "sentiment": [("accuracy", 0.8), ("accuracy", 0.9), ("accuracy", 0.95)],
    "sem_filter": [("accuracy", 0.8), ("accuracy", 0.9), ("precision", 0.8),
                   ("precision", 0.9), ("recall", 0.8), ("recall", 0.9)],
    "sem_match": [("accuracy", 0.95), ("accuracy", 0.98), ("precision", 0.8),
                  ("precision", 0.9), ("recall", 0.8), ("recall", 0.9)],
}


# -- the pool ----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Pool:
    name: str
    outcomes: StageOutcomes  # every stage on every row, cheapest first; the oracle last
    proxy_true: np.ndarray  # the first stage's probability of "true" (boolean operators)
    fixed: Cascade
    fixed_fractions: tuple[float, ...]


def load_pool(session: ken.Session, name: str) -> Pool:
    op = session.operators[name]
    profiles = operator_profiles(op, session.ctx)
    order = sorted(profiles, key=lambda m: profiles[m].ms_per_row(session.ctx.batch_size))
    certainty = "max_prob"
    outcomes = StageOutcomes(
        tuple(order), [profiles[m].values for m in order],
        np.array([profiles[m].certainty(certainty) for m in order]), certainty,
        tuple(profiles[m].ms_per_row(session.ctx.batch_size) for m in order))
    first = profiles[order[0]]
    proxy = np.zeros(first.num_rows)
    if op.output_type == "boolean":
        proxy = first.scores[:, list(first.label_names).index(POSITIVE)].astype(np.float64)
    chosen = choose_cascade(op, session.ctx)
    return Pool(name, outcomes, proxy, chosen.cascade, chosen.stage_fractions or ())


def answers_of(outcomes: StageOutcomes, cascade: Cascade) -> tuple[np.ndarray, np.ndarray]:
    """The cascade's answer per row and the stage (index into ``outcomes.models``) answering."""
    n = outcomes.num_rows
    answers = np.empty(n, dtype=object)
    stage = np.full(n, -1, dtype=np.int64)
    open_ = np.ones(n, dtype=bool)
    for i, model in enumerate(cascade.models):
        s = outcomes.models.index(model)
        take = open_ & ~cascade.escalates(i, outcomes.certainties[s])
        answers[take] = np.asarray(outcomes.values[s], dtype=object)[take]
        stage[take] = s
        open_ &= ~take
    return answers, stage


def metric(name: str, answers: np.ndarray, oracle: np.ndarray) -> float:
    said, truth = answers == POSITIVE, oracle == POSITIVE
    if name == "accuracy":
        return float(np.mean(answers == oracle))
    if name == "precision":
        return float((said & truth).sum() / said.sum()) if said.any() else 1.0
    return float((said & truth).sum() / truth.sum()) if truth.any() else 1.0


# -- ken's guarantee ---------------------------------------------------------------------------


def run_guarantee(pool: Pool, metric_name: str, target: float, n: int, reps: int,
                  seed: int) -> dict:
    out = pool.outcomes
    total = out.num_rows
    oracle_values = np.asarray(out.values[-1], dtype=object)
    path = quantile_path(out.certainties[:-1])
    rng = np.random.default_rng(seed)
    misses = query_misses = fell = 0
    calls, escalated, achieved, shares = [], [], [], []
    for _ in range(reps):
        rows = rng.choice(total, n, replace=False)
        got = choose_thresholds(out.take(rows),
                                GuaranteeTarget(metric_name, target, DELTA), path)
        answers, stage = answers_of(out, got.cascade)
        value = metric(metric_name, answers, oracle_values)
        misses += value < target
        answers[rows] = oracle_values[rows]  # the query keeps the sample's oracle answers
        query_misses += metric(metric_name, answers, oracle_values) < target
        rest = np.ones(total, dtype=bool)
        rest[rows] = False
        reach = stage[rest] == len(out.models) - 1
        calls.append(n + int(reach.sum()))
        escalated.append(float(reach.mean()) if rest.any() else 0.0)
        achieved.append(value)
        fell += got.fell_back
        shares.append(got.answered_shares)
    return {"missed": misses / reps, "missed_query": query_misses / reps,
            "oracle_calls": float(np.mean(calls)), "escalated": float(np.mean(escalated)),
            "fell_back": fell / reps, "metric_mean": float(np.mean(achieved)),
            "metric_min": float(np.min(achieved)),
            "answered_shares": np.mean(np.array(shares), axis=0).tolist(),
            "path_steps": path.num_steps}


# -- LOTUS-style -------------------------------------------------------------------------------


def normal_lower(mean: float, std: float, count: int, delta: float) -> float:
    """LOTUS's bound: mean - std / sqrt(count) * sqrt(2 log(1 / delta))."""
    return mean - std / math.sqrt(count) * math.sqrt(2 * math.log(1 / delta)) if count else 0.0


def lotus_thresholds(score: np.ndarray, oracle_true: np.ndarray, weight: np.ndarray,
                     metric_name: str, target: float) -> tuple[float, float]:
    """(tau+, tau-) on an importance sample: rows scoring >= tau+ are accepted, <= tau-
    rejected, the rest go to the oracle."""
    order = np.argsort(-score, kind="stable")
    s, y, w = score[order], oracle_true[order].astype(np.float64), weight[order]
    if metric_name == "precision":  # accept the top k sample rows: their oracle-positive share
        k = np.arange(1, len(s) + 1)
        mean = np.cumsum(y) / k
        std = np.sqrt(np.maximum(np.cumsum(y * y) / k - mean**2, 0.0))
        bound = mean - std / np.sqrt(k) * math.sqrt(2 * math.log(len(s) / DELTA))
        return float(min([1.0, *s[bound > target].tolist()])), -math.inf
    # recall: the largest tau- whose (weighted) sample recall reaches the goal; rejecting the
    # rows at or below s[i] keeps those scoring above it
    first = np.searchsorted(-s, -s, side="left")
    kept = np.concatenate(([0.0], np.cumsum(y * w)))[first]
    positives = float((y * w).sum())

    def tau_for(goal: float) -> float:
        if positives <= 0:
            return 0.0
        ok = kept / positives >= goal
        return float(max(0.0, s[ok].max())) if ok.any() else 0.0

    tau = tau_for(target)
    # SUPG's correction (which LOTUS's follows): the weighted positives above and below tau,
    # as means over every sample row (zeros elsewhere). LOTUS's code takes each mean over the
    # rows on its side only, which makes the corrected target a ratio of means of different
    # counts (on sem_filter it then corrects the target down, and misses it every time); the
    # baseline follows SUPG here rather than copy that.
    z1, z2 = y * w * (s >= tau), y * w * (s < tau)
    ub1 = float(z1.mean()) + (float(z1.std()) / math.sqrt(len(s))) * math.sqrt(
        2 * math.log(2 / DELTA))
    lb2 = max(0.0, normal_lower(float(z2.mean()), float(z2.std()), len(s), DELTA / 2))
    corrected = 1.0 if ub1 + lb2 == 0 else min(1.0, ub1 / (ub1 + lb2))
    tau = tau_for(corrected)
    return tau, tau


def run_lotus(pool: Pool, metric_name: str, target: float, n: int, reps: int,
              seed: int) -> dict:
    out = pool.outcomes
    total = out.num_rows
    oracle_true = np.asarray(out.values[-1], dtype=object) == POSITIVE
    score = pool.proxy_true
    w = np.sqrt(np.clip(score, 0, None))
    w = 0.5 * w / w.sum() + 0.5 / total
    rng = np.random.default_rng(seed)
    misses = query_misses = 0
    calls, escalated, achieved, other = [], [], [], []
    for _ in range(reps):
        rows = rng.choice(total, n, replace=True, p=w)
        correction = (1.0 / total) / w[rows]
        tau_pos, tau_neg = lotus_thresholds(score[rows], oracle_true[rows], correction,
                                            metric_name, target)
        accept, reject = score >= tau_pos, score <= tau_neg
        if metric_name == "recall":
            accept, reject = score > tau_neg, score <= tau_neg
        to_oracle = ~accept & ~reject
        said = np.where(to_oracle, oracle_true, accept)
        answers = np.where(said, POSITIVE, BOOLEAN_LABELS[0]).astype(object)
        truth = np.where(oracle_true, POSITIVE, BOOLEAN_LABELS[0]).astype(object)
        value = metric(metric_name, answers, truth)
        misses += value < target
        sampled = np.unique(rows)
        answers[sampled] = truth[sampled]
        query_misses += metric(metric_name, answers, truth) < target
        rest = np.ones(total, dtype=bool)
        rest[sampled] = False
        calls.append(len(sampled) + int(to_oracle[rest].sum()))
        escalated.append(float(to_oracle[rest].mean()))
        achieved.append(value)
        other.append(metric("recall" if metric_name == "precision" else "precision",
                            answers, truth))
    return {"missed": misses / reps, "missed_query": query_misses / reps,
            "oracle_calls": float(np.mean(calls)), "escalated": float(np.mean(escalated)),
            "metric_mean": float(np.mean(achieved)), "metric_min": float(np.min(achieved)),
            "other_metric_mean": float(np.mean(other))}


def run_union_bound(pool: Pool, metric_name: str, target: float, n: int, reps: int,
                    seed: int) -> dict:
    """Accuracy, LOTUS-style: ken's path, the cheapest step whose normal-approximation bound
    at delta / steps clears the target (a union bound over the steps)."""
    out = pool.outcomes
    total = out.num_rows
    oracle_values = np.asarray(out.values[-1], dtype=object)
    path = quantile_path(out.certainties[:-1])
    rng = np.random.default_rng(seed)
    misses = 0
    calls, escalated, achieved = [], [], []
    for _ in range(reps):
        rows = rng.choice(total, n, replace=False)
        sample = out.take(rows)
        chosen = Cascade((out.models[-1],), (), out.certainty)
        for step in path.thresholds:
            cascade = Cascade(out.models, step, out.certainty)
            agree = (answers_of(sample, cascade)[0] == oracle_values[rows]).astype(float)
            if normal_lower(float(agree.mean()), float(agree.std()), n,
                            DELTA / path.num_steps) >= target:
                chosen = cascade
        answers, stage = answers_of(out, chosen)
        value = metric(metric_name, answers, oracle_values)
        misses += value < target
        rest = np.ones(total, dtype=bool)
        rest[rows] = False
        reach = stage[rest] == len(out.models) - 1
        calls.append(n + int(reach.sum()))
        escalated.append(float(reach.mean()))
        achieved.append(value)
    return {"missed": misses / reps, "oracle_calls": float(np.mean(calls)),
            "escalated": float(np.mean(escalated)), "metric_mean": float(np.mean(achieved)),
            "metric_min": float(np.min(achieved))}


def run_fixed(pool: Pool, metric_name: str, target: float) -> dict:
    out = pool.outcomes
    answers, stage = answers_of(out, pool.fixed)
    oracle_values = np.asarray(out.values[-1], dtype=object)
    value = metric(metric_name, answers, oracle_values)
    reach = int((stage == len(out.models) - 1).sum())
    return {"cascade": pool.fixed.describe(), "metric": value, "meets": value >= target,
            "oracle_calls": reach, "escalated": reach / out.num_rows}


# -- report ------------------------------------------------------------------------------------


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['operator']}\n{r['metric']}>={r['target']:g}\nn={r['n']}" for r in results]
    x = np.arange(len(results))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(10, len(results) * 0.9), 8),
                                      sharex=True)
    width = 0.2
    series = [("ken guarantee", [r["guarantee"]["oracle_calls"] for r in results]),
              ("LOTUS-style", [r["lotus"]["oracle_calls"] for r in results]),
              ("fixed thresholds", [r["fixed"]["oracle_calls"] for r in results]),
              ("oracle alone", [r["rows"] for r in results])]
    for k, (name, values) in enumerate(series):
        top.bar(x + (k - 1.5) * width, values, width, label=name)
    top.set_ylabel("oracle calls on the pool")
    top.legend(fontsize=8)
    top.set_title(f"Targets against the oracle, delta {DELTA}, 200 fresh samples each")
    bottom.bar(x - 0.2, [r["guarantee"]["missed"] for r in results], 0.4, label="ken guarantee")
    bottom.bar(x + 0.2, [r["lotus"]["missed"] for r in results], 0.4, label="LOTUS-style")
    bottom.scatter(x, [0.0 if r["fixed"]["meets"] else 1.0 for r in results], color="k",
                   marker="x", label="fixed thresholds (1 = misses)", zorder=3)
    bottom.axhline(DELTA, color="r", linestyle="--", label=f"delta = {DELTA}")
    bottom.set_ylabel("share of samples missing the target")
    bottom.set_xticks(x, labels, fontsize=7)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(results: list[dict]) -> str:
    lines = ["| operator | target | n (sized by) | ken missed | ken oracle calls (escalated) | "
             "ken fell back | LOTUS-style missed | LOTUS-style oracle calls | "
             "fixed: metric, oracle calls | oracle alone |", "|" + "---|" * 10]
    for r in results:
        g, lo, f = r["guarantee"], r["lotus"], r["fixed"]
        lines.append(
            f"| {r['operator']} | {r['metric']} >= {r['target']:g} | {r['n']} ({r['sizing']}) | "
            f"{g['missed']:.3f} | {g['oracle_calls']:.0f} ({g['escalated']:.1%}) | "
            f"{g['fell_back']:.0%} | {lo['missed']:.3f} | {lo['oracle_calls']:.0f} | "
            f"{f['metric']:.3f}{'' if f['meets'] else ' (misses)'}, {f['oracle_calls']} | "
            f"{r['rows']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--operators", default="sentiment,sem_filter,sem_match")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", type=int, default=300,
                    help="also run each target whose sample the bound sizes larger on this "
                         "many rows")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    session = ken.connect()
    started = time.perf_counter()
    results = []
    for name in args.operators.split(","):
        pool = load_pool(session, name)
        out = pool.outcomes
        oracle_true = np.mean(np.asarray(out.values[-1], dtype=object) == POSITIVE)
        for k, (metric_name, target) in enumerate(TARGETS[name]):
            n = sample_size(metric_name, target, DELTA,
                            positive_share=float(oracle_true) if metric_name != "accuracy"
                            else 1.0, max_rows=out.num_rows)
            for sizing, size in [("bound", n)] + ([("fixed", args.small)]
                                                   if n > args.small else []):
                results.append(run_target(pool, name, metric_name, target, sizing, size,
                                          float(oracle_true), args.reps,
                                          args.seed + 1000 * k))
    summary = {"delta": DELTA, "reps": args.reps, "seconds": time.perf_counter() - started,
               "binomial_tolerance": 3 * math.sqrt(DELTA * (1 - DELTA) / args.reps),
               "results": results}
    (args.out / "guarantees.json").write_text(json.dumps(summary, indent=2, default=float))
    plot(results, args.out / "guarantees.png")
    print(table(results))
    print(f"wrote {args.out / 'guarantees.json'} and guarantees.png in "
          f"{summary['seconds']:.0f} s")


def run_target(pool: Pool, name: str, metric_name: str, target: float, sizing: str, n: int,
               oracle_true: float, reps: int, seed: int) -> dict:
    """One target on one operator's pool with ``n`` sample rows: ken, the baseline, fixed."""
    out = pool.outcomes
    row = {"operator": name, "metric": metric_name, "target": target, "delta": DELTA,
           "sizing": sizing, "n": n, "rows": out.num_rows, "models": list(out.models),
           "oracle": out.models[-1], "oracle_positive_share": oracle_true,
           "guarantee": run_guarantee(pool, metric_name, target, n, reps, seed),
           "fixed": run_fixed(pool, metric_name, target)}
    if metric_name == "accuracy":
        row["lotus"] = run_union_bound(pool, metric_name, target, n, reps, seed)
        row["lotus"]["kind"] = "normal bound, union bound over ken's path"
    else:
        row["lotus"] = run_lotus(pool, metric_name, target, n, reps, seed)
        row["lotus"]["kind"] = "LOTUS thresholds on an importance sample"
    g, lo, f = row["guarantee"], row["lotus"], row["fixed"]
    print(f"{name} {metric_name}>={target} n={n} ({sizing}): ken missed {g['missed']:.3f}, "
          f"{g['oracle_calls']:.0f}/{out.num_rows} oracle calls; LOTUS-style missed "
          f"{lo['missed']:.3f}, {lo['oracle_calls']:.0f}; fixed {f['metric']:.3f}, "
          f"{f['oracle_calls']}", flush=True)
    return row


if __name__ == "__main__":
    main()
