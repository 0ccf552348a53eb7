"""`ken models verify`: every entry of the model store checked against the hashes recorded
when it was written, and repaired on request."""

from __future__ import annotations

import argparse
import functools
import shutil
from pathlib import Path

from ken import multihop_plan, ops, store
from ken.models import convert, family, registry
from ken.models.fetch import DOWNLOADS, gguf_entry
from ken.models.resources import CAUSAL_LMS, causal_lm_dir
from ken.optimizer import planning, profile, tokens
from ken.paths import ken_home
from ken.progress import Reporter
from ken.report import console


def _store_entries(home: Path) -> list[tuple[str, object, object]]:
    """``(kind, entry, rebuild or None)`` for every entry of the store at ``home``."""
    reporter = Reporter()
    out: list[tuple[str, object, object]] = []
    for entry in convert.store_entries(home):
        name = entry.root.name
        if registry.is_added(name, home):  # a user's: ken cannot make it again
            out.append(("added model", registry.entry(name, home), None))
            continue
        if name in CAUSAL_LMS:
            rebuild = functools.partial(causal_lm_dir, name, home, reporter)
        elif name in family.ALL_MEMBER_NAMES:
            rebuild = functools.partial(family.body_dir, family.member(name), home, reporter)
        else:
            rebuild = None
        out.append(("converted model", entry, rebuild))
    for spec in DOWNLOADS:
        entry = gguf_entry(spec, home / "models" / "gguf")
        if entry.exists():
            out.append(("download", entry, None))
    for entry in family.store_entries(home):
        data = family.data_from_tag(entry.root.parent.name)
        rebuild = None
        if not data.source.startswith("user-"):
            rebuild = functools.partial(family.prepare, data, home=home, reporter=reporter,
                                        names=(entry.root.name,))
        out.append(("model family", entry, rebuild))
    out += [(kind, e, None) for kind, e in ops.store_entries(home)]  # what users trained
    out += [("QA outcomes", e, None) for e in multihop_plan.store_entries(home)]
    out += [("profile", e, None) for e in profile.store_entries(home)]
    out += [("token cost", e, None) for e in tokens.store_entries(home)]
    out += [("frontier", e, None) for e in planning.store_entries(home)]
    return out


def _store_leftovers(home: Path) -> list[Path]:
    """Temporaries of interrupted writes anywhere in the store."""
    return sorted(p for p in home.rglob(".*") if store.is_leftover(p))


def cmd_models_verify(args: argparse.Namespace) -> int:
    """Check every file of the model store against the hashes recorded when it was written."""
    home = ken_home()
    if not home.is_dir():
        console.print(f"no model store at {home} yet (ken makes it on first use)",
                      markup=False, highlight=False)
        return 0
    counts = {"ok": 0, "adopted": 0, "damaged": 0, "repaired": 0}
    for kind, entry, rebuild in _store_entries(home):
        state, problems = store.check(entry)  # type: ignore[arg-type]
        where = entry.main.relative_to(home)  # type: ignore[attr-defined]
        if state == "damaged" and args.repair:
            store.remove(entry)  # type: ignore[arg-type]
            if rebuild is not None:
                rebuild()  # type: ignore[operator]
                state, problems = store.check(entry)  # type: ignore[arg-type]
                state = "repaired" if state != "damaged" else state
            else:
                state = "removed"
        counts[state] = counts.get(state, 0) + 1
        line = f"{state:<9} {kind:<20} {where}"
        if state == "adopted":
            line += "  (written before ken recorded hashes: checked, manifest written)"
        elif state == "removed":
            line += f"  (damaged; removed: {entry.fix})"  # type: ignore[attr-defined]
        console.print(line, markup=False, highlight=False)
        for problem in problems:
            console.print(f"          {problem}", markup=False, highlight=False)
    for folder in sorted((home / "families" / family.FAMILY).glob("*")):
        if folder.is_dir() and folder.name != family.RECIPE and not store.is_leftover(folder):
            console.print(f"{'unused':<9} {'model family':<20} {folder.relative_to(home)}  "
                          "(an older layout this ken does not read; it can be deleted)",
                          markup=False, highlight=False)
    for path in _store_leftovers(home):
        if args.repair:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        what = "removed" if args.repair else "leftover"
        console.print(f"{what:<9} {'temporary':<20} {path.relative_to(home)}  (of an "
                      "interrupted write; `ken models verify --repair` deletes it)",
                      markup=False, highlight=False)
    summary = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    console.print(f"model store {home}: {summary or 'empty'}", markup=False, highlight=False)
    if counts["damaged"]:
        console.print("damaged entries are rebuilt by `ken models verify --repair` (or by the "
                      "command shown with each)", markup=False, highlight=False)
        return 1
    return 0
