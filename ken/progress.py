"""Progress reporting for long work (preparing models, profiling, benchmarks); can be silenced."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class Reporter:
    """Shows progress bars and status lines on stderr, or nothing when ``quiet``."""

    def __init__(self, quiet: bool = False, console: Console | None = None) -> None:
        self.quiet = quiet
        self.console = console or Console(stderr=True)

    def note(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message, markup=False, highlight=False)  # names hold brackets

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        """Context yielding ``advance(n)``; draws a bar with rows done, total and elapsed time."""
        if self.quiet:
            yield lambda n: None
            return
        columns = (TextColumn("{task.description}", markup=False), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=False) as bar:
            task_id = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task_id, n)


QUIET = Reporter(quiet=True)
