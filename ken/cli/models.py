"""`ken models prepare | list | fetch | add | remove`, `ken profile` and `ken cascades`: the
packaged model family, its profiles and its Pareto cascades, and the causal LMs a user adds."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ken import store
from ken.cli import family_data, op_context
from ken.errors import ProfileError, StoreError
from ken.models import family, registry
from ken.models.cascade import Cascade
from ken.models.fetch import CHUNKED_MODELS
from ken.models.model import DeviceConfig
from ken.models.resources import CAUSAL_LMS, causal_lm_dir
from ken.ops.sentiment import Sentiment
from ken.optimizer.cascades import evaluate, pareto_cascades
from ken.optimizer.planning import operator_profiles
from ken.optimizer.profile import DEFAULT_BATCH_SIZES, Profile
from ken.paths import ken_home
from ken.progress import Reporter
from ken.report import console, frontier_table, models_table


def cmd_models_prepare(args: argparse.Namespace) -> int:
    cards = family.prepare(family_data(args), DeviceConfig(threads=args.threads),
                           reporter=Reporter(args.quiet), force=args.force)
    console.print(models_table(cards))
    return 0


def cmd_models_fetch(args: argparse.Namespace) -> int:
    if args.name in family.ALL_MEMBER_NAMES and args.name not in CAUSAL_LMS:
        folder = family.body_dir(family.member(args.name), reporter=Reporter(args.quiet))
    else:
        if args.name not in CHUNKED_MODELS:
            console.print(f"{args.name}: converted from its installed wheel (no download)")
        folder = causal_lm_dir(args.name, reporter=Reporter(args.quiet))
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    console.print(f"{args.name} ready: {folder} ({size / 1e9:.2f} GB)")
    return 0


def family_profiles(args: argparse.Namespace, threads: Sequence[int], reporter: Reporter,
                    batch_sizes: Sequence[int] | None = None
                    ) -> tuple[list[family.ModelCard], list[Profile]]:
    """The family's cards and the profiles of its models on CPU devices of each of
    ``threads``, measured as the sentiment operator's candidates (every batch size unless
    ``batch_sizes``)."""
    data = family_data(args)
    cards = family.prepare(data, DeviceConfig(threads=args.threads), reporter=reporter)
    family.check_sample(cards, family.heldout_sample(data))
    ctx = op_context(args, reporter)
    sizes = tuple(batch_sizes or DEFAULT_BATCH_SIZES)
    return cards, [p for t in threads
                   for p in operator_profiles(Sentiment(), ctx, t, sizes).values()]


def cmd_models_add(args: argparse.Namespace) -> int:
    added = registry.add(args.name, args.path, force=args.force, reporter=Reporter(args.quiet))
    console.print(f"added {added.name}: {added.architecture}, {added.num_params / 1e6:.0f}M "
                  f"parameters, {added.size_bytes / 1e6:.0f} MB in {added.folder}; use it with "
                  f"session.operators['sem_qa'].llms = ('{added.name}',)",
                  markup=False, highlight=False)
    return 0


def cmd_models_remove(args: argparse.Namespace) -> int:
    folder = registry.remove(args.name)
    console.print(f"removed {args.name} ({folder})", markup=False, highlight=False)
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    cards = family.load_cards(family_data(args), missing_ok=True)
    added = added_table()
    if not cards and added is None:
        console.print("no models prepared yet; run `ken models prepare`")
        return 1
    if cards:
        console.print(models_table(cards, _cached_profiles(cards)))
    else:
        console.print("no model family prepared yet; run `ken models prepare`")
    if added is not None:
        console.print(added)
    return 0


def added_table() -> Table | None:
    """The causal LMs added with `ken models add` (None when there are none); a damaged one
    is listed with what is wrong."""
    names = registry.added_names()
    if not names:
        return None
    table = Table(title="language models added with `ken models add`")
    for column in ("name", "source", "architecture", "params", "size"):
        table.add_column(column, justify="right" if column in ("params", "size") else "left")
    for name in names:
        try:
            lm = registry.load(name)
        except StoreError as exc:
            table.add_row(Text(name), Text(f"damaged: {exc}"), "", "", "")
            continue
        # Text cells: a path or a name may hold brackets, which are not markup here
        table.add_row(Text(lm.name), Text(f"{lm.source} ({lm.source_format})"),
                      Text(lm.architecture), f"{lm.num_params / 1e6:.0f}M",
                      f"{lm.size_bytes / 1e6:.0f} MB")
    return table


def _cached_profiles(cards: Sequence[family.ModelCard]) -> list[Profile]:
    found = []
    fingerprints = {c.fingerprint for c in cards}
    for header in sorted((ken_home() / "profiles").glob("*/header.json")):
        try:
            p = Profile.load(header.parent)
        except (StoreError, ProfileError) as exc:  # measured again when next needed
            Console(stderr=True).print(f"skipping a damaged profile: {exc}", markup=False,
                                       highlight=False)
            continue
        if p.model_fingerprint in fingerprints:
            found.append(p)
    return found


def cmd_profile(args: argparse.Namespace) -> int:
    reporter = Reporter(args.quiet)
    cards, profiles = family_profiles(args, args.profile_threads, reporter, args.batch_sizes)
    console.print(models_table(cards, profiles))
    return 0


def cmd_cascades(args: argparse.Namespace) -> int:
    reporter = Reporter(args.quiet)
    _cards, profiles = family_profiles(args, [args.threads], reporter)
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
        store.write_text(args.json, json.dumps([m.to_dict() for m in front], indent=2))
        console.print(f"wrote {args.json}")
    return 0
