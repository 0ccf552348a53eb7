"""Progress on a console that is not a terminal (a log, a pipe, CI): plain lines while a task
runs, not a bar drawn only when it ends."""

from __future__ import annotations

import io

from rich.console import Console

from ken import progress
from ken.progress import Reporter


def test_a_task_on_a_log_says_its_progress_while_it_runs() -> None:
    out = io.StringIO()
    reporter = Reporter(console=Console(file=out, width=200, force_terminal=False))
    now = [100.0]
    reporter.clock = lambda: now[0]
    seen = []
    with reporter.task("fine-tuning", 10) as advance:
        seen.append(out.getvalue())
        for _ in range(10):
            now[0] += progress.PLAIN_EVERY_S / 4  # a line every fourth step
            advance(1)
            seen.append(out.getvalue())
    lines = out.getvalue().splitlines()
    assert lines[0] == "fine-tuning: 0/10"
    assert lines[1:-1] == ["fine-tuning: 4/10, 30 s, about 45 s left",
                           "fine-tuning: 8/10, 60 s, about 15 s left"]
    assert lines[-1] == "fine-tuning: done 10/10, 75 s"
    # each line was written when its step was, not at the end
    assert "4/10" in seen[4] and "4/10" not in seen[3]


def test_a_task_that_stops_early_says_where_and_quiet_says_nothing() -> None:
    out = io.StringIO()
    reporter = Reporter(console=Console(file=out, width=200, force_terminal=False))
    try:
        with reporter.task("profiling", 5) as advance:
            advance(2)
            raise RuntimeError("stopped")
    except RuntimeError:
        pass
    assert out.getvalue().splitlines()[-1].startswith("profiling: stopped at 2/5")
    # a task that ends early without an error is done; a count after its end says nothing
    early = io.StringIO()
    stops = Reporter(console=Console(file=early, force_terminal=False))
    stops.clock = lambda: 7.0
    with stops.task("plans", 9) as advance:
        advance(4)
    advance(1)
    assert early.getvalue().splitlines() == ["plans: 0/9", "plans: done 4/9, 0 s"]
    silent = io.StringIO()
    with Reporter(quiet=True, console=Console(file=silent)).task("x", 3) as advance:
        advance(3)
    assert silent.getvalue() == ""


def test_a_terminal_still_gets_a_bar() -> None:
    out = io.StringIO()
    reporter = Reporter(console=Console(file=out, width=200, force_terminal=True))
    with reporter.task("loading", 2) as advance:
        advance(2)
    assert "loading" in out.getvalue() and "2/2" in out.getvalue()
    assert "done 2/2" not in out.getvalue()
