"""The query shapes semantic-SQL users write (issue 35): model calls and wall time of ken's plan
against the naive plan (every row through the full cascade), and answer quality where labels
exist.

Rows: the first ``--rows`` sentences of SST-2's dev split (movie-review sentences, labelled
positive / negative; about half positive), as the table ``reviews(id, review, label)``.

Shapes measured (each ken and naive, ``--repeats`` times interleaved; medians reported):

- ``first k``: ``SELECT id, review FROM reviews WHERE sem_filter(review, P) LIMIT k`` for a
  predicate about half the rows pass, and the same with a relational conjunct and a predicate
  fewer rows pass. ken stops once k rows pass (``ken.sql.limit``); the naive plan is the same
  statement with its semantic WHERE in a subquery, which every row reaches. Quality: the share
  of the rows returned whose label agrees with the predicate.
- ``score per group`` (when ``sem_score`` is registered): ``SELECT label, AVG(sem_score(review,
  R)), count(*) FROM reviews WHERE id < --score-rows GROUP BY label``. Quality: the mean score
  of each label and the ROC AUC of the score for the positive label. There is no cheaper plan
  for this shape (every row's score is needed), so only ken's run is reported.

- ``answer per group`` (when ``sem_agg`` is registered): ``SELECT label, sem_agg(review, I)
  FROM reviews WHERE id < --agg-rows GROUP BY label`` with the instruction to name the overall
  sentiment in one word. Quality: whether each group's answer names its label. Reported: the
  LM calls of the reduction and the wall time (every text is read once; no cheaper plan).

- ``join``: ``reviews a JOIN reviews b ON <a: the first --join-rows> AND <b: the next
  --join-rows> AND sem_join(a.review, b.review, P)`` for a predicate the per-side rewrite
  applies to ("both reviews are positive"), one it applies to through a property ("the same
  sentiment"), and one it does not (blocking). The plan the predicate allows is forced (the
  rewrite, else blocking), and what ``plan = "auto"`` would have chosen is reported from the
  rewrite's check or blocking's recall estimate: a refused rewrite under ``auto`` asks every
  pair, which takes tens of minutes here. The nested loop's questions are rows x rows by
  construction; its answers (and time per pair) are measured on ``--join-sample`` random
  pairs. Quality, where the labels decide the predicate: accuracy over every pair (ken's
  plan) and on the sampled pairs (both).
  With ``--join-train N``, sem_join is first trained (``session.train``) on N labelled
  pairs of other rows for each predicate the labels decide; its fit and held-out scores are
  reported with the shape, whose pair and per-side questions then answer by the trained
  thresholds.
- ``top k by score`` (``--shapes topk``; when ``sem_score`` is registered): ``SELECT id,
  sem_score(review, R) AS score FROM reviews WHERE id < --topk-rows ORDER BY score DESC LIMIT
  --topk`` with the cascade SmolLM2-135M -> Qwen2.5-Coder-0.5B (``TOPK_LLMS``). ken's top-k plan
  (``ken.sql.topk``: SmolLM2 scores every row, Qwen a sample and the rows near the k-th) against
  the naive plan, the same query with ``SET ken_topk = off`` (every row through the whole
  cascade). Reported: the rows each stage scored, Qwen's share of the rows (the goal: under
  20%), wall time, the overlap of the two top-k lists, the labels of each, and the plan's
  margin and pruned rows. It takes minutes: Qwen scores about 2 rows/s on 2 cores.

    python benchmarks/query_shapes.py --out DIR     # about an hour on 2 cores
    python benchmarks/query_shapes.py --shapes topk --out DIR   # the top-k shape alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

import ken
from ken.engine.batch import run_cascade
from ken.models.datasets import load_sst2
from ken.models.quality import roc_auc
from ken.ops.sem_join import side_rewrite

RESULTS = Path(__file__).parent / "results" / "query_shapes"
POSITIVE = "the review is positive"
NEGATIVE = "the review is negative"
AGG_INSTRUCTION = ("What is the overall sentiment of these reviews? Answer with one word: "
                   "positive or negative.")
RUBRIC = "How positive is the review? 1 = very negative, 3 = mixed, 5 = very positive"
#: the cascade of the top-k shape, cheap stage first
TOPK_LLMS = ("smollm2-135m", "qwen2.5-coder-0.5b")
SHAPES = ("first-k", "score", "agg", "join", "topk")
#: the sem_join shapes: a predicate, and how the labels decide it (None: they do not)
JOINS = (("both reviews are positive", "both"),
         ("the two reviews express the same sentiment", "same"),
         ("the two reviews criticise the same aspect of a film", None))


def model_calls(result: ken.Result) -> int:
    """Rows sent to models, over every call site and stage of a query."""
    return sum(s.model_calls for k, s in result.stats.items() if k not in ("limit", "topk"))


def timed(session: ken.Session, query: str) -> tuple[ken.Result, float]:
    started = time.perf_counter()
    result = session.sql(query)
    result.arrow()
    return result, time.perf_counter() - started


def naive(query: str) -> str:
    """The statement with its WHERE (and everything up to the LIMIT) in a subquery: DuckDB
    evaluates the semantic predicate on every row, then takes the LIMIT."""
    head, limit = query.rsplit(" LIMIT ", 1)
    return f"SELECT * FROM ({head}) AS every_row LIMIT {limit}"


def first_k(session: ken.Session, labels: dict[int, str], name: str, query: str, wanted: str,
            repeats: int) -> dict:
    """One first-k shape, ken and naive, interleaved."""
    runs: dict[str, list[dict]] = {"ken": [], "naive": []}
    for _ in range(repeats):
        for system, text in (("ken", query), ("naive", naive(query))):
            result, seconds = timed(session, text)
            ids = result.arrow().column("id").to_pylist()
            limit = result.stats.get("limit")
            runs[system].append({
                "seconds": seconds, "model_calls": model_calls(result), "rows": len(ids),
                "precision": (sum(labels[i] == wanted for i in ids) / len(ids)
                              if ids else None),
                "rows_evaluated": None if limit is None else limit.scanned_rows,
                "source_rows": None if limit is None else limit.source_rows,
                "chunks": None if limit is None else limit.chunks})
    out = {"shape": name, "query": query, "naive_query": naive(query), "runs": runs}
    for system, rs in runs.items():
        out[system] = {"seconds": statistics.median(r["seconds"] for r in rs),
                       "model_calls": statistics.median(r["model_calls"] for r in rs),
                       "precision": rs[0]["precision"], "rows": rs[0]["rows"]}
    out["calls_ratio"] = out["naive"]["model_calls"] / max(out["ken"]["model_calls"], 1)
    out["time_ratio"] = out["naive"]["seconds"] / out["ken"]["seconds"]
    return out



def score_shape(session: ken.Session, rows: int) -> dict:
    query = (f"SELECT label, AVG(sem_score(review, '{RUBRIC}')) AS mean_score, count(*) AS n "
             f"FROM reviews WHERE id < {rows} GROUP BY label ORDER BY label")
    result, seconds = timed(session, query)
    per_row, _ = timed(session, f"SELECT label, sem_score(review, '{RUBRIC}') AS s "
                                f"FROM reviews WHERE id < {rows}")
    table = per_row.arrow()
    scores = np.array([np.nan if v is None else v for v in table.column("s").to_pylist()])
    truth = np.array([v == "positive" for v in table.column("label").to_pylist()])
    ok = ~np.isnan(scores)
    return {"shape": "score per group", "query": query, "seconds": seconds,
            "model_calls": model_calls(result),
            "groups": result.arrow().to_pylist(),
            "auc_positive": roc_auc(scores[ok], truth[ok]) if ok.any() else None}


def agg_shape(session: ken.Session, rows: int) -> dict:
    query = (f"SELECT label, sem_agg(review, '{AGG_INSTRUCTION}') AS answer, count(*) AS n "
             f"FROM reviews WHERE id < {rows} GROUP BY label ORDER BY label")
    bound = session.bind("sem_agg", (AGG_INSTRUCTION,))
    models = [bound.models[m] for m in bound.cascade.models]
    before = [m.calls for m in models]
    result, seconds = timed(session, query)
    groups = result.arrow().to_pylist()
    return {"shape": "answer per group", "query": query, "seconds": seconds,
            "groups": groups,
            "lm_calls": {m.name: m.calls - b for m, b in zip(models, before, strict=True)},
            "right": sum(g["label"] in str(g["answer"]).lower() for g in groups)}


def train_join(session: ken.Session, labels: dict[int, str], predicate: str, truth: str,
               first: int, n: int) -> dict:
    """``session.train("sem_join", ...)`` on ``n`` pairs of the reviews from id ``first`` on
    (row ``first + k`` with row ``first + n + k``), labelled by ``truth`` as the join's pairs
    are; what it fitted and how long it took."""
    texts = session.sql(f"SELECT review FROM reviews WHERE id >= {first} AND id < "
                        f"{first + 2 * n} ORDER BY id").arrow().column(0).to_pylist()
    left, right = texts[:n], texts[n:]
    ids = [(first + k, first + n + k) for k in range(n)]
    y = [labels[i] == labels[j] == "positive" if truth == "both" else labels[i] == labels[j]
         for i, j in ids]
    started = time.perf_counter()
    trained = session.train("sem_join", pa.table({"l": left, "r": right, "y": y}), label="y",
                            predicate=predicate)
    seconds = time.perf_counter() - started
    fit = session.operators["sem_join"].fit_for(predicate, session.operators["sem_join"]
                                                 .llms[-1])
    print(f"trained sem_join on {n} pairs ({sum(y)} true) in {seconds:.0f} s: "
          f"{trained.quality}", file=sys.stderr, flush=True)
    return {"pairs": n, "true": int(sum(y)), "seconds": seconds, "quality": trained.quality,
            "fit": fit.to_dict() if fit else None}


def join_shape(session: ken.Session, labels: dict[int, str], predicate: str, rows: int,
               sample_pairs: int, truth: str | None) -> dict:
    """``reviews a JOIN reviews b ON <a: ids below rows> AND <b: the next rows> AND
    sem_join(...)`` run with the plan the predicate allows (the per-side rewrite, else
    blocking), forced so that a refused rewrite does not turn into the nested loop's
    ``rows x rows`` questions (tens of minutes here); what ``auto`` would have chosen follows
    from the rewrite's check (or blocking's estimated recall) and is reported. The nested
    loop's questions are ``rows x rows`` by construction; its answers and time per pair are
    measured on ``sample_pairs`` random pairs. ``truth``: "both" (both labels positive) or
    "same" (equal labels) when the labels decide the predicate."""
    op = session.operators["sem_join"]
    rewritable = side_rewrite(predicate)[0] is not None
    op.plan = "rewrite" if rewritable else "blocking"
    query = (f"SELECT a.id AS l, b.id AS r FROM reviews a JOIN reviews b ON a.id < {rows} AND "
             f"b.id >= {rows} AND b.id < {2 * rows} AND sem_join(a.review, b.review, "
             f"'{predicate}')")
    session.bind("sem_join", (predicate,))  # the LM loads outside the timed run
    try:
        result, seconds = timed(session, query)
    finally:
        op.plan = "auto"
    run = result.stats["join"][0]
    if rewritable:
        auto = ("per-side rewrite" if run.check_agreed >= op.check_agreement * run.check_pairs
                else "blocking or nested loop (the rewrite's check failed)")
    else:
        auto = ("blocking" if run.recall is None or run.recall >= op.recall_target
                else "nested loop (blocking's estimated recall is below the target)")
    got = set(map(tuple, result.fetchall()))
    rng = np.random.default_rng(0)
    every = [(i, j) for i in range(rows) for j in range(rows, 2 * rows)]
    picked = [every[k] for k in rng.choice(len(every), sample_pairs, replace=False)]
    bound = session.bind("sem_join", (predicate,))
    texts = session.sql(f"SELECT review FROM reviews WHERE id < {2 * rows} ORDER BY id"
                        ).arrow().column(0).to_pylist()
    started = time.perf_counter()
    asked = run_cascade(bound.cascade, bound.models,
                        [pa.array([texts[i] for i, _ in picked]),
                         pa.array([texts[j] for _, j in picked])]).values
    naive_s = (time.perf_counter() - started) / sample_pairs * len(every)
    nested = [v == "true" for v in asked]
    ken_says = [pair in got for pair in picked]
    out = {"shape": f"join: {predicate}", "query": query, "plan": run.plan, "auto": auto,
           "line": run.line(), "pairs": len(every),
           "ken": {"model_calls": run.pair_questions + run.side_questions,
                   "pair_questions": run.pair_questions, "side_questions": run.side_questions,
                   "seconds": seconds, "pairs_returned": len(got)},
           "naive": {"model_calls": len(every), "seconds": naive_s,
                     "seconds_note": f"extrapolated from {sample_pairs} sampled pairs"},
           "agreement_with_nested": float(np.mean([a == b for a, b in
                                                  zip(ken_says, nested, strict=True)])),
           "sample_pairs": sample_pairs, "nested_true_in_sample": int(sum(nested)),
           "ken_true_in_sample": int(sum(ken_says))}
    out["calls_ratio"] = out["naive"]["model_calls"] / max(out["ken"]["model_calls"], 1)
    if truth is not None:
        def right(i: int, j: int, value: bool) -> bool:
            want = (labels[i] == labels[j] == "positive" if truth == "both"
                    else labels[i] == labels[j])
            return value == want
        out["true_pairs"] = sum(right(i, j, True) for i, j in every)
        out["ken"]["accuracy_all_pairs"] = float(np.mean([right(i, j, (i, j) in got)
                                                          for i, j in every]))
        out["ken"]["accuracy_sample"] = float(np.mean([right(i, j, v) for (i, j), v
                                                       in zip(picked, ken_says, strict=True)]))
        out["naive"]["accuracy_sample"] = float(np.mean([right(i, j, v) for (i, j), v
                                                         in zip(picked, nested, strict=True)]))
    print(f"{out['shape']}: {run.line()}; auto would run: {auto}", file=sys.stderr, flush=True)
    return out


def topk_shape(session: ken.Session, labels: dict[int, str], rows: int, k: int) -> dict:
    """ORDER BY sem_score(...) DESC LIMIT k with the cascade ``TOPK_LLMS``: ken's top-k plan,
    then the naive plan (``SET ken_topk = off``). The naive run asks for every row in order
    (LIMIT = rows: the same model calls as LIMIT k, since it scores every row either way), so
    its first k rows are its top k and the rank of each of ken's rows in it is known. Then the
    rows of either top k are scored once more, alone (batch size 1), by each stage: their
    cheap scores say which of the naive top k the plan pruned, and the scores alone how far a
    row's score moves with the batch it is scored in."""
    op = session.operators["sem_score"]
    before = op.__dict__.get("llms")
    op.llms = TOPK_LLMS
    head = (f"SELECT id, sem_score(review, '{RUBRIC}') AS score FROM reviews WHERE id < {rows} "
            "ORDER BY score DESC LIMIT ")
    try:
        # load both models outside the timed runs
        session.sql("SET ken_topk = off")
        session.sql(f"SELECT sem_score(review, '{RUBRIC}') FROM reviews WHERE id >= {rows} "
                    f"LIMIT 2").arrow()
        out: dict = {"shape": f"top {k} by score", "query": head + str(k), "rows": rows,
                     "naive_query": "SET ken_topk = off; " + head + str(rows),
                     "cascade": " -> ".join(TOPK_LLMS)}
        for system, setting, limit in (("ken", "on", k), ("naive", "off", rows)):
            session.sql(f"SET ken_topk = {setting}")
            result, seconds = timed(session, head + str(limit))
            site = next(v for key, v in result.stats.items() if key not in ("limit", "topk"))
            table = result.arrow()
            ids = table.column("id").to_pylist()
            expensive = sum(st.input_rows for st in site.stages[1:])
            out[system] = {
                "seconds": seconds, "model_calls": site.model_calls,
                "cheap_calls": site.stages[0].input_rows, "expensive_calls": expensive,
                "expensive_share": expensive / rows, "ids": ids[:k],
                "stage_seconds": [st.seconds for st in site.stages],
                "scores": table.column("score").to_pylist()[:k],
                "labels": [labels[i] for i in ids[:k]],
                "precision": sum(labels[i] == "positive" for i in ids[:k]) / k if ids else None,
                "rows": min(len(ids), k)}
            run = result.stats.get("topk")
            if run is not None:
                out["plan"] = {key: getattr(run, key) for key in (
                    "distinct_inputs", "cheap_rows", "escalated", "sampled", "expensive_rows",
                    "pruned", "margin", "batches", "expected_misses")}
                out["plan"]["line"] = run.line()
            else:
                naive_rank = {i: r for r, i in enumerate(ids)}
                naive_score = dict(zip(ids, table.column("score").to_pylist(), strict=True))
        out["ken"]["naive_ranks"] = [naive_rank[i] + 1 for i in out["ken"]["ids"]]
        out["rows_of_either"] = _topk_rows(session, out, naive_score)
    finally:
        session.sql("RESET ken_topk")
        if before is None:
            op.__dict__.pop("llms", None)
        else:
            op.llms = before
    out["overlap"] = len(set(out["ken"]["ids"]) & set(out["naive"]["ids"]))
    out["same_order"] = out["ken"]["ids"] == out["naive"]["ids"]
    out["calls_ratio"] = out["naive"]["model_calls"] / max(out["ken"]["model_calls"], 1)
    out["time_ratio"] = out["naive"]["seconds"] / out["ken"]["seconds"]
    return out


def _topk_rows(session: ken.Session, out: dict, naive_score: dict[int, float]) -> list[dict]:
    """The rows of ken's and the naive top k: their scores in both runs and scored alone by
    each stage, and whether the plan pruned them (cheap score alone + margin below ken's k-th
    score: an approximation, as the cheap score moves a little with its batch too)."""
    bound = session.bind("sem_score", (RUBRIC,))
    cheap_model, expensive_model = (bound.models[m] for m in bound.cascade.models)
    ids = list(dict.fromkeys(out["naive"]["ids"] + out["ken"]["ids"]))
    texts = session.sql(f"SELECT id, review FROM reviews WHERE id IN ({', '.join(map(str, ids))})"
                        ).arrow().to_pydict()
    text_of = dict(zip(texts["id"], texts["review"], strict=True))
    batch = [text_of[i] for i in ids]
    cheap = bound.to_sql_values(cheap_model.predict(batch, batch_size=1).values)
    alone = bound.to_sql_values(expensive_model.predict(batch, batch_size=1).values)
    ken_score = dict(zip(out["ken"]["ids"], out["ken"]["scores"], strict=True))
    kth = out["ken"]["scores"][-1]
    margin = out["plan"]["margin"] or 0.0
    return [{"id": i, "in_ken": i in ken_score, "in_naive": i in out["naive"]["ids"],
             "cheap_alone": c, "expensive_alone": e, "ken_score": ken_score.get(i),
             "naive_score": naive_score[i], "pruned": i not in ken_score and c + margin < kth}
            for i, c, e in zip(ids, cheap, alone, strict=True)]


def plot(shapes: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [s for s in shapes if "ken" in s]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(len(pairs))
    for ax, key, title in ((axes[0], "model_calls", "rows sent to models"),
                           (axes[1], "seconds", "wall time (s)")):
        ax.bar(x - 0.2, [s["naive"][key] for s in pairs], 0.4, label="naive (every row)")
        ax.bar(x + 0.2, [s["ken"][key] for s in pairs], 0.4, label="ken")
        ax.set_xticks(x, [s["shape"] for s in pairs], fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000, help="reviews in the table")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--score-rows", type=int, default=60,
                    help="rows the sem_score shape scores (an LLM call each)")
    ap.add_argument("--agg-rows", type=int, default=48,
                    help="rows the sem_agg shape reads (in groups by label)")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma list of the shapes to run, of {', '.join(SHAPES)}")
    ap.add_argument("--join-rows", type=int, default=40,
                    help="rows of each side of the sem_join shapes (0: skip them)")
    ap.add_argument("--join-train", type=int, default=0,
                    help="train sem_join on this many labelled pairs (rows after the join's "
                         "own) before each join whose labels decide its predicate (0: no "
                         "training, the content-free calibration alone)")
    ap.add_argument("--join-labelled-only", action="store_true",
                    help="only the joins whose labels decide the predicate")
    ap.add_argument("--join-sample", type=int, default=300,
                    help="random pairs the nested loop's answers are measured on")
    ap.add_argument("--topk-rows", type=int, default=320,
                    help="rows the top-k shape ranks (SmolLM2 scores each)")
    ap.add_argument("--topk", type=int, default=10, help="k of the top-k shape")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    wanted = {x.strip() for x in args.shapes.split(",") if x.strip()}
    if not wanted or wanted - set(SHAPES):
        ap.error(f"--shapes takes a comma list of {', '.join(SHAPES)}; got {args.shapes!r}")
    sample = load_sst2("dev", args.data_dir)
    if len(sample.texts) < max(args.rows, args.topk_rows):
        ap.error(f"SST-2 dev has {len(sample.texts)} sentences; --rows and --topk-rows must "
                 "be at most that")
    names = [sample.label_names[i] for i in sample.labels[: args.rows]]
    table = pa.table({"id": list(range(args.rows)), "review": list(sample.texts[: args.rows]),
                      "label": names})
    labels = dict(enumerate(names))
    session = ken.connect(cache=False)  # measured: every run asks the models
    session.register_table("reviews", table)
    started = time.perf_counter()
    print(f"{args.rows} reviews, {names.count('positive')} positive", file=sys.stderr)
    k = args.limit
    shapes = []
    if "first-k" in wanted:
        # load the models and bind the predicates outside the timed runs
        session.sql(f"SELECT sem_filter(review, '{POSITIVE}'), sem_filter(review, "
                    f"'{NEGATIVE}') FROM reviews WHERE id < 4").arrow()
        shapes += [
            first_k(session, labels, f"first {k}, half pass",
                    f"SELECT id, review FROM reviews WHERE sem_filter(review, '{POSITIVE}') "
                    f"LIMIT {k}", "positive", args.repeats),
            first_k(session, labels, f"first {k}, long negative",
                    f"SELECT id, review FROM reviews WHERE length(review) > 150 AND "
                    f"sem_filter(review, '{NEGATIVE}') LIMIT {k}", "negative", args.repeats),
        ]
    if "score" in wanted and "sem_score" in session.operators:
        shapes.append(score_shape(session, args.score_rows))
    if "agg" in wanted and "sem_agg" in session.operators:
        shapes.append(agg_shape(session, args.agg_rows))
    if "join" in wanted and "sem_join" in session.operators and args.join_rows:
        if args.join_train and args.rows < 2 * args.join_rows + 2 * args.join_train:
            ap.error("--join-train needs --rows >= 2 x (--join-rows + --join-train)")
        for predicate, truth in JOINS:
            if args.join_labelled_only and truth is None:
                continue
            trained = (train_join(session, labels, predicate, truth, 2 * args.join_rows,
                                  args.join_train)
                       if args.join_train and truth is not None else None)
            shapes.append(join_shape(session, labels, predicate, args.join_rows,
                                     args.join_sample, truth))
            if trained is not None:
                shapes[-1]["trained"] = trained
    if "topk" in wanted and "sem_score" in session.operators:
        shapes.append(topk_shape(session, labels, args.topk_rows, args.topk))
    for s in shapes:
        if "agreement_with_nested" in s:
            print(f"{s['shape']}: {s['plan']} (auto: {s['auto']}), "
                  f"{s['ken']['model_calls']} questions vs "
                  f"{s['naive']['model_calls']} ({s['calls_ratio']:.1f}x fewer), "
                  f"{s['ken']['seconds']:.1f} s vs ~{s['naive']['seconds']:.0f} s, agreement "
                  f"with the nested loop {s['agreement_with_nested']:.3f} on "
                  f"{s['sample_pairs']} pairs; {s['line']}", file=sys.stderr)
        elif "rows_of_either" in s:
            print(f"{s['shape']}: {s['plan']['line']}", file=sys.stderr)
            print(f"{s['shape']}: expensive-stage calls {s['ken']['expensive_calls']} "
                  f"({s['ken']['expensive_share']:.1%} of {s['rows']} rows) vs naive "
                  f"{s['naive']['expensive_calls']}; {s['ken']['seconds']:.1f} s vs "
                  f"{s['naive']['seconds']:.1f} s; top-k overlap {s['overlap']}/"
                  f"{len(s['naive']['ids'])}; positive {s['ken']['precision']} vs "
                  f"{s['naive']['precision']}; ken's rows rank {s['ken']['naive_ranks']} in "
                  "the naive order", file=sys.stderr)
            for r in s["rows_of_either"]:
                print(f"  {r}", file=sys.stderr)
        elif "ken" in s:
            print(f"{s['shape']}: model calls {s['ken']['model_calls']:.0f} vs naive "
                  f"{s['naive']['model_calls']:.0f} ({s['calls_ratio']:.0f}x fewer), "
                  f"{s['ken']['seconds']:.2f} s vs {s['naive']['seconds']:.2f} s, precision "
                  f"{s['ken']['precision']} vs {s['naive']['precision']}", file=sys.stderr)
        elif "lm_calls" in s:
            print(f"{s['shape']}: {s['groups']}, {s['right']} groups right, LM calls "
                  f"{s['lm_calls']}, {s['seconds']:.1f} s", file=sys.stderr)
        else:
            print(f"{s['shape']}: {s['groups']}, AUC {s['auc_positive']}, "
                  f"{s['seconds']:.1f} s", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"rows": args.rows, "limit": k, "repeats": args.repeats, "shapes": shapes,
           "wall_s": time.perf_counter() - started}
    (args.out / "query_shapes.json").write_text(json.dumps(out, indent=1, default=float))
    plot(shapes, args.out / "query_shapes.png")
    print(f"wrote {args.out}/query_shapes.json and query_shapes.png", file=sys.stderr)
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
