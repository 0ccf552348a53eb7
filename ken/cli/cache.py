"""`ken cache stats` and `ken cache clear`: the result cache (``ken.cache``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ken.cache import ResultCache, cache_setting, default_path


def _path(args: argparse.Namespace) -> Path:
    """The file to look at: ``--path``, else ``KEN_CACHE`` when it names a file, else the
    default under ``KEN_HOME``."""
    if args.path is not None:
        return args.path
    setting = cache_setting(None)
    return setting if isinstance(setting, Path) else default_path()


def cmd_cache_stats(args: argparse.Namespace) -> int:
    path = _path(args)
    if not path.exists():
        print(f"result cache {path}: empty (no file yet; queries create it)")
        return 0
    cache = ResultCache(path)
    try:
        for line in cache.stats().lines():
            print(line)
    finally:
        cache.close()
    return 0


def cmd_cache_clear(args: argparse.Namespace) -> int:
    path = _path(args)
    if not path.exists():
        print(f"result cache {path}: nothing to clear (no file)")
        return 0
    cache = ResultCache(path)
    try:
        gone = cache.clear(args.operator)
    finally:
        cache.close()
    which = f" of {', '.join(args.operator)}" if args.operator else ""
    print(f"deleted {gone:,} answers{which} from {path}")
    return 0
