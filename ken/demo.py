"""``ken demo``: the pipeline so far on the packaged models and data, end to end."""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa
from rich.console import Console
from rich.table import Table

from ken.progress import Reporter


def run_demo(args: argparse.Namespace, console: Console) -> int:
    from ken.cli import frontier_table, models_table
    from ken.engine.batch import run_cascade
    from ken.operators import family
    from ken.operators.cascade import Cascade
    from ken.operators.model import DeviceConfig
    from ken.optimizer.cascades import evaluate, pareto_cascades
    from ken.optimizer.profile import load_or_run_profile

    reporter = Reporter(args.quiet)
    if args.quick:
        data = family.FamilyData(args.data, 800, 400)
        batch_sizes: tuple[int, ...] = (1, 8, 32)
        query_rows = 300
    else:
        data = family.FamilyData(args.data, args.train_rows, args.test_rows)
        batch_sizes = (1, 2, 4, 8, 16, 32, 64, 128)
        query_rows = 1000
    device = DeviceConfig(threads=args.threads)
    started = time.perf_counter()

    console.rule("1. the packaged model family (prepared on first use, then cached)")
    cards = family.prepare(data, device, reporter=reporter, data_dir=args.data_dir)
    sample = family.heldout_sample(data, args.data_dir)
    models = {c.name: family.load_model(c, device, data=data) for c in cards}

    console.rule(f"2. profiles on {len(sample)} held-out tweets ({device.label})")
    profiles = {}
    for name, model in models.items():
        with reporter.task(f"profile {name}", len(batch_sizes) + 1) as advance:
            profiles[name] = load_or_run_profile(model, sample, batch_sizes,
                                                 on_step=lambda _s: advance(1))
    console.print(models_table(cards, list(profiles.values())))

    console.rule("3. the cascade frontier (accuracy vs compute per row, from profiles alone)")
    front = pareto_cascades(profiles, max_stages=3, grid_size=16, batch_size=32)
    console.print(frontier_table(front, "Pareto cascades (cost at batch 32)"))
    largest = cards[-1].name
    alone = evaluate(Cascade((largest,)), profiles, batch_size=32)
    best = max(front, key=lambda m: m.accuracy)
    matching = [m for m in front if m.accuracy >= alone.accuracy]
    console.print(f"most accurate: {best.cascade.describe()} — {best.accuracy:.1%} at "
                  f"{best.cost_ms_per_row:.1f} ms/row vs {largest} alone {alone.accuracy:.1%} at "
                  f"{alone.cost_ms_per_row:.1f} ms/row")
    if matching:
        cheap = matching[0]
        console.print(f"cheapest cascade at least as accurate as {largest}: "
                      f"{cheap.cascade.describe()} — {cheap.accuracy:.1%} at "
                      f"{cheap.cost_ms_per_row:.1f} ms/row "
                      f"({alone.cost_ms_per_row / cheap.cost_ms_per_row:.1f}x cheaper)")

    console.rule(f"4. a batch query: classify {query_rows} unseen tweets from an Arrow table")
    rows = data.unseen(query_rows, args.data_dir)
    texts = list(rows.texts) + [None, ""]  # NULL stays NULL, an empty string is a valid input
    table = pa.table({"id": pa.array(np.arange(len(texts))), "text": pa.array(texts, pa.string())})
    truth = rows.labels
    results = {}
    for title, cascade in (("best cascade", best.cascade), (f"{largest} alone", alone.cascade)):
        t0 = time.perf_counter()
        result = run_cascade(cascade, models, table.column("text"), batch_size=32)
        seconds = time.perf_counter() - t0
        acc = float((result.label_index[: len(truth)] == truth).mean())
        stages = ", ".join(f"{s.model}: {s.input_rows} in / {s.resolved_rows} resolved"
                           for s in result.stages)
        console.print(f"[bold]{title}[/] {cascade.describe()}: accuracy {acc:.1%}, "
                      f"{seconds:.2f} s ({seconds / len(texts) * 1000:.1f} ms/row); {stages}")
        results[title] = result
    out = table.append_column("sentiment", results["best cascade"].labels)
    preview = Table(title="best cascade: first rows and the edge cases (NULL, empty string)")
    for col in ("id", "text", "sentiment"):
        preview.add_column(col)
    for i in [*range(5), len(texts) - 2, len(texts) - 1]:
        text = out.column("text")[i].as_py()
        preview.add_row(str(i), "NULL" if text is None else repr(text[:70]),
                        str(out.column("sentiment")[i].as_py()))
    console.print(preview)

    console.rule("5. semantic SQL on DuckDB: EXPLAIN, then EXPLAIN ANALYZE")
    import ken
    from ken.sql.builtins import load_demo_tables

    with ken.connect(device=device, data=data, reporter=reporter) as session:
        session.sentiment_cascade = best.cascade
        load_demo_tables(session, num_rows=query_rows)
        session.sql("CREATE TABLE replies AS SELECT * FROM tweets UNION ALL "
                    "SELECT id + 100000, text, label, len FROM tweets WHERE id % 4 = 0")
        query = ("SELECT sentiment(text) AS mood, count(*) AS n, "
                 "round(avg(CASE WHEN sentiment(text) = label THEN 1 ELSE 0 END), 3) AS agree "
                 "FROM replies WHERE len > 60 GROUP BY mood ORDER BY n DESC")
        console.print(query)
        console.print(session.explain(query), markup=False, highlight=False)
        analyzed = session.explain(query, analyze=True).split("DuckDB physical plan")[0]
        console.print(analyzed, markup=False, highlight=False)
        console.print(str(session.sql(query)), markup=False, highlight=False)
    console.print(f"demo finished in {time.perf_counter() - started:.0f} s")
    return 0
