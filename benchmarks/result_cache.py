"""The result cache (issue 36, item 2): the same query over 2,000 rows, first with an empty
cache and then from a second session on the same cache file; and after TRAIN, that the trained
operator's calls do not use the answers cached before.

    python benchmarks/result_cache.py --out DIR        # about 4 minutes on 2 cores

For each operator (``sentiment``, the packaged cascade; ``sem_filter`` zero-shot) and each of
``--repeats`` rounds, a fresh cache file: session 1 loads the models (a query on 8 rows with
the cache off), then runs the query (timed: every answer from the models); session 2 on the
same file loads its models the same way and runs the query again (timed). Reported: both times,
their ratio (median and spread over the rounds), model calls, cache hits, and whether the
answers are the same. Then ``sentiment`` is trained on 300 labelled SST-2 training sentences
and the query runs once more: the hits must be 0 and the answers the trained head's labels.
Writes DIR/result_cache.json and DIR/result_cache.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

import ken
from ken.models.datasets import load_sst2

RESULTS = Path(__file__).parent / "results" / "result_cache"
QUERIES = {
    "sentiment": "SELECT id, sentiment(review) AS v FROM reviews",
    "sem_filter": "SELECT id, sem_filter(review, 'the review is positive') AS v FROM reviews",
}


def warm(session: ken.Session, query: str) -> None:
    """Load the query's models outside the timed run (8 rows, cache off)."""
    session.sql("SET ken_cache = off")
    session.sql(f"SELECT * FROM ({query}) WHERE id < 8").arrow()
    session.sql("SET ken_cache = on")


def run(session: ken.Session, query: str) -> dict:
    started = time.perf_counter()
    result = session.sql(query)
    seconds = time.perf_counter() - started
    stats = [st for st in result.stats.values() if hasattr(st, "cache_hits")]
    return {"seconds": seconds,
            "model_calls": sum(st.model_calls for st in stats),
            "cache_hits": sum(st.cache_hits for st in stats),
            "answers": dict(result.fetchall())}


def session_on(table: pa.Table, cache: Path) -> ken.Session:
    s = ken.connect(cache=cache)
    s.register_table("reviews", table)
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    sample = load_sst2("dev", args.data_dir)
    if len(sample.texts) < args.rows:
        ap.error(f"SST-2 dev has {len(sample.texts)} sentences; --rows must be at most that")
    table = pa.table({"id": list(range(args.rows)), "review": list(sample.texts[:args.rows])})
    out: dict = {"rows": args.rows, "repeats": args.repeats, "operators": {}}
    folder = Path(tempfile.mkdtemp(prefix="ken-cache-bench-"))
    for name, query in QUERIES.items():
        rounds = []
        for r in range(args.repeats):
            cache = folder / f"{name}-{r}.sqlite"
            with session_on(table, cache) as s:
                warm(s, query)
                first = run(s, query)
            with session_on(table, cache) as s:
                warm(s, query)
                second = run(s, query)
            rounds.append({"first_s": first["seconds"], "second_s": second["seconds"],
                           "ratio": first["seconds"] / second["seconds"],
                           "first_model_calls": first["model_calls"],
                           "second_model_calls": second["model_calls"],
                           "second_cache_hits": second["cache_hits"],
                           "same_answers": first["answers"] == second["answers"]})
            print(f"{name} round {r + 1}: {first['seconds']:.2f} s then "
                  f"{second['seconds']:.3f} s ({rounds[-1]['ratio']:.0f}x), model calls "
                  f"{first['model_calls']} then {second['model_calls']}, hits "
                  f"{second['cache_hits']}, same answers {rounds[-1]['same_answers']}",
                  file=sys.stderr)
        ratios = [x["ratio"] for x in rounds]
        out["operators"][name] = {
            "query": query, "rounds": rounds, "ratio_median": statistics.median(ratios),
            "ratio_spread": (max(ratios) - min(ratios)) / 2,
            "distinct_inputs": len(set(table.column("review").to_pylist()))}
    # after TRAIN: the trained sentiment() does not answer from the cache
    train = load_sst2("train", args.data_dir)
    labelled = pa.table({"review": list(train.texts[:300]),
                         "liked": ["yes" if train.label_names[i] == "positive" else "no"
                                   for i in train.labels[:300]]})
    cache = folder / "sentiment-0.sqlite"
    with session_on(table, cache) as s:
        s.register_table("labelled", labelled)
        warm(s, QUERIES["sentiment"])
        before = run(s, QUERIES["sentiment"])
        trained = s.train("sentiment", "labelled", "liked", models=("minilm-l3",))
        after = run(s, QUERIES["sentiment"])
    out["after_train"] = {
        "trained": trained.describe(), "hits_before": before["cache_hits"],
        "hits_after": after["cache_hits"], "model_calls_after": after["model_calls"],
        "labels_after": sorted(set(after["answers"].values()) - {None})}
    print(f"after TRAIN: hits {before['cache_hits']} before, {after['cache_hits']} after; "
          f"{after['model_calls']} model calls; labels {out['after_train']['labels_after']}",
          file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result_cache.json").write_text(json.dumps(out, indent=1))
    plot(out, args.out / "result_cache.png")
    print(f"wrote {args.out / 'result_cache.json'}", file=sys.stderr)
    return 0


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["operators"])
    first = [statistics.median(x["first_s"] for x in out["operators"][n]["rounds"])
             for n in names]
    second = [statistics.median(x["second_s"] for x in out["operators"][n]["rounds"])
              for n in names]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], first, 0.4, label="first run (models)")
    ax.bar([x + 0.2 for x in xs], second, 0.4, label="second session (result cache)")
    ax.set_xticks(list(xs), names)
    ax.set_yscale("log")
    ax.set_ylabel("query seconds (median of rounds)")
    ax.set_title(f"the same query over {out['rows']:,} rows")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
