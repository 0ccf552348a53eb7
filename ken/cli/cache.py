"""`ken cache stats` and `ken cache clear`: the result cache (``ken.cache``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from ken.cache import ResultCache, cache_setting, default_path


def _path(args: argparse.Namespace) -> Path:
    """The file to look at: ``--path``, else ``KEN_CACHE`` when it names a file, else the
    default under ``KEN_HOME``."""
    if args.path is not None:
        return args.path
    setting = cache_setting(None)
    return setting if isinstance(setting, Path) else default_path()


def _on_cache(args: argparse.Namespace, no_file: str,
              work: Callable[[ResultCache, Path], list[str]]) -> int:
    """Print ``work``'s lines for the cache file of ``args`` (``no_file`` when there is none:
    nothing is created)."""
    path = _path(args)
    if not path.exists():
        print(f"result cache {path}: {no_file}")
        return 0
    cache = ResultCache(path)
    try:
        lines = work(cache, path)
    finally:
        cache.close()
    print("\n".join(lines))
    return 0


def cmd_cache_stats(args: argparse.Namespace) -> int:
    return _on_cache(args, "empty (no file yet; queries create it)",
                     lambda cache, _path: cache.stats().lines())


def cmd_cache_clear(args: argparse.Namespace) -> int:
    which = f" of {', '.join(args.operator)}" if args.operator else ""
    return _on_cache(args, "nothing to clear (no file)", lambda cache, path: [
        f"deleted {cache.clear(args.operator):,} answers{which} from {path}"])
