"""`ken sql` and `ken explain`: a semantic SQL statement on a session, with the demo tables
unless a database is given."""

from __future__ import annotations

import argparse

from rich.console import Console

from ken.cli import family_data, pick_plan, visible
from ken.demo_tables import load_demo_tables
from ken.errors import UsageError
from ken.models.model import DeviceConfig
from ken.policy.plan import Frontier
from ken.progress import Reporter
from ken.report import console
from ken.session import Session, connect


def _session(args: argparse.Namespace) -> Session:
    session = connect(args.db, device=DeviceConfig(threads=args.threads),
                      data=family_data(args), reporter=Reporter(args.quiet))
    if args.db is None or args.demo_tables:
        tables = load_demo_tables(session)
        if not args.quiet:
            Console(stderr=True).print(f"demo tables: {', '.join(tables)}")
    return session


def cmd_sql(args: argparse.Namespace) -> int:
    with _session(args) as session:
        result = session.sql_script(args.query)  # the user typed the whole script
        console.print(visible(str(result)), markup=False, highlight=False)  # data, not markup
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    if args.target is not None and not args.frontier:
        raise UsageError("--target picks a gear plan from --frontier FILE (written by `ken plan`)")
    frontiers = [Frontier.load(path) for path in args.frontier or ()]
    with _session(args) as session:
        for frontier in frontiers:
            session.use_plan(pick_plan(frontier, args.target))
        console.print(session.explain(args.query, analyze=args.analyze), highlight=False,
                      markup=False)
    return 0
