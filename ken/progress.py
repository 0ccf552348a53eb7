"""Progress reporting for long work (preparing models, profiling, benchmarks); can be silenced."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

#: on a console that is not a terminal (a log file, a pipe, CI), a task's progress is a plain
#: line at most this often, instead of a bar drawn only when the task ends
PLAIN_EVERY_S = 30.0


class Reporter:
    """Shows progress bars and status lines on stderr, or nothing when ``quiet``.

    With ``long_work_only`` (what a ``Session`` shows by default) it stays silent except
    inside :meth:`long_work`: work that takes minutes (preparing the model family the first
    time, profiling) says what it is about to do and how long it takes, then shows its
    progress; everything else stays quiet.
    """

    #: the clock of the plain progress lines (tests replace it)
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, quiet: bool = False, console: Console | None = None,
                 long_work_only: bool = False) -> None:
        self.quiet = quiet
        self.long_work_only = long_work_only
        self.console = console or Console(stderr=True)
        self._local = threading.local()

    @property
    def showing(self) -> bool:
        """Whether notes and bars are shown now."""
        if self.quiet:
            return False
        return not self.long_work_only or getattr(self._local, "depth", 0) > 0

    def note(self, message: str) -> None:
        if self.showing:
            self.console.print(message, markup=False, highlight=False)  # names hold brackets

    def warn(self, message: str) -> None:
        """Say something went wrong and was handled (shown unless quiet, also outside long
        work)."""
        if not self.quiet:
            self.console.print(f"warning: {message}", markup=False, highlight=False)

    @contextmanager
    def long_work(self, message: str) -> Iterator[None]:
        """Say ``message`` (what is about to happen and roughly how long it takes) unless
        quiet, and show the progress of the work inside the block."""
        if not self.quiet:
            self.console.print(message, markup=False, highlight=False)
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        """Context yielding ``advance(n)``; draws a bar with rows done, total, elapsed time and the
        time left at the rate so far (plain lines on a console that is not a terminal)."""
        if not self.showing:
            yield lambda n: None
            return
        if not (self.console.is_terminal or self.console.is_jupyter):
            with self._plain_task(description, total) as advance:
                yield advance
            return
        columns = (TextColumn("{task.description}", markup=False), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=self.console, transient=False) as bar:
            task_id = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task_id, n)

    @contextmanager
    def _plain_task(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        """``task`` on a console that is not a terminal: a line when it starts, one at most
        every ``PLAIN_EVERY_S`` while it advances, and one when it ends ("done", or "stopped
        at" when an exception ends it; a bar there would be drawn once, at the end: nothing to
        see for the minutes a task takes)."""
        lock = threading.Lock()
        started = self.clock()
        state = {"done": 0, "said": started, "ended": False}

        def say(prefix: str, left: bool = False) -> None:
            elapsed = self.clock() - started
            done = state["done"]
            rest = ""
            if left and 0 < done < total:  # at the rate so far
                rest = f", about {elapsed / done * (total - done):.0f} s left"
            self.console.print(f"{description}: {prefix}{done}/{total}, {elapsed:.0f} s{rest}",
                               markup=False, highlight=False)

        def advance(n: int) -> None:
            with lock:
                if state["ended"]:  # a callback after the task's end says nothing more
                    return
                state["done"] += n
                if (now := self.clock()) - state["said"] >= PLAIN_EVERY_S:
                    state["said"] = now
                    say("", left=True)

        self.console.print(f"{description}: 0/{total}", markup=False, highlight=False)
        try:
            yield advance
        except BaseException:
            with lock:
                state["ended"] = True
                say("stopped at ")
            raise
        with lock:  # work may end before its total (an early stop), or count after it ends
            state["ended"] = True
            say("done ")


QUIET = Reporter(quiet=True)
