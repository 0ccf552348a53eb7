"""How much of the machine other programs used while ken measured something (issue 33).

A runtime calibration (``engine.calibrate.measure_calibration``) fits what serving calls take
on this machine, and a token cost (``optimizer.tokens.measure_token_cost``) what an LLM's
passes take; when another program shares the cores meanwhile, every call is slower and the
plans and simulations made from them are for a busier machine than the one they will run on
(measured: calibration factors of x1.70-2.05 against x1.03-1.17 on a quiet machine; a token
cost measured beside a test run made ``ken demo``'s simulated time to first token 16x the
engine's, ``docs/results.md``). ``least_loaded`` measures again while the machine is busy.
``OtherLoad`` reads
Linux's ``/proc``: the CPU time the whole machine spent busy over an interval, less the CPU time
of this process and its descendants (ken's worker processes), in cores. Elsewhere (no
``/proc``) it measures nothing and says so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ken.errors import KenError

T = TypeVar("T")

_PROC = Path("/proc")


@dataclass(frozen=True)
class CpuReading:
    """Busy jiffies of the whole machine and of this process tree, and when; ``steal``: the
    jiffies the hypervisor gave this machine's cores to other machines (counted in
    ``machine``)."""

    machine: int
    ours: int
    wall_s: float
    steal: int = 0


def _machine_busy(proc: Path) -> tuple[int, int]:
    """Busy and stolen jiffies of the whole machine."""
    fields = (proc / "stat").read_text().splitlines()[0].split()
    # user nice system idle iowait irq softirq steal (steal since Linux 2.6.11)
    values = [int(v) for v in fields[1:9]]
    return sum(values) - values[3] - values[4], values[7] if len(values) > 7 else 0


def _processes(proc: Path) -> dict[int, list[str]]:
    """Every live process: its ``stat`` fields after the name (the name may hold spaces and
    ")")."""
    out = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # it exited meanwhile
            continue
        out[int(entry.name)] = text[text.rfind(")") + 2:].split()
    return out


def _tree(processes: dict[int, list[str]], root: int) -> list[int]:
    """``root`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for pid, rest in processes.items():
        children.setdefault(int(rest[1]), []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _tree_busy(proc: Path, root: int) -> int:
    """utime + stime + the reaped children's cutime + cstime of ``root`` and of every live
    process below it (jiffies)."""
    processes = _processes(proc)
    # its own time and its reaped children's (a worker that exited moves there)
    return sum(sum(int(v) for v in processes[pid][11:15])
               for pid in _tree(processes, root) if pid in processes)


@dataclass(frozen=True)
class TreeUsage:
    """What a process and its descendants (ken's workers) hold now."""

    processes: int
    rss_bytes: int
    threads: int
    open_files: int


def tree_usage(root: int | None = None, proc: Path = _PROC, alone: bool = False
               ) -> TreeUsage | None:
    """Resident memory, threads and open file descriptors of ``root`` (default: this
    process) and every process below it (``alone``: ``root`` only); None without
    ``/proc``."""
    root = os.getpid() if root is None else root
    try:
        pids = [root] if alone else _tree(_processes(proc), root)
    except OSError:
        return None
    count = rss = threads = files = 0
    for pid in pids:
        fields = _status(proc, pid)
        try:
            fds = sum(1 for _ in (proc / str(pid) / "fd").iterdir())
        except OSError:  # it exited meanwhile
            continue
        if fields is None:
            continue
        count += 1
        rss += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
        threads += int(fields.get("Threads", "0"))
        files += fds
    return TreeUsage(count, rss, threads, files)


def _status(proc: Path, pid: int) -> dict[str, str] | None:
    """The fields of ``/proc/<pid>/status``; None when the process is gone."""
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def process_rss_bytes(pid: int | None, proc: Path = _PROC) -> int | None:
    """Resident memory of process ``pid`` of this machine (None if unknown or gone)."""
    fields = None if pid is None else _status(proc, pid)
    if fields is None or "VmRSS" not in fields:
        return None
    return int(fields["VmRSS"].split()[0]) * 1024


def cpu_reading(proc: Path = _PROC) -> CpuReading | None:
    """The machine's and this process tree's busy CPU time now; None without ``/proc``."""
    try:
        busy, steal = _machine_busy(proc)
        return CpuReading(busy, _tree_busy(proc, os.getpid()), time.monotonic(), steal)
    except (OSError, ValueError, IndexError):
        return None


def other_cores(before: CpuReading, after: CpuReading, ticks_per_s: float | None = None
                ) -> float:
    """Cores other programs kept busy, on average, between two readings."""
    others = (after.machine - before.machine) - (after.ours - before.ours)
    return _cores(others, before, after, ticks_per_s)


def steal_cores(before: CpuReading, after: CpuReading, ticks_per_s: float | None = None
                ) -> float:
    """Cores the hypervisor gave to other machines, on average, between two readings (part
    of ``other_cores``)."""
    return _cores(after.steal - before.steal, before, after, ticks_per_s)


def _cores(jiffies: int, before: CpuReading, after: CpuReading, ticks_per_s: float | None
           ) -> float:
    """``jiffies`` spent between two readings as cores kept busy on average (at least 0)."""
    ticks = ticks_per_s or float(os.sysconf("SC_CLK_TCK"))
    wall = after.wall_s - before.wall_s
    return max(0.0, jiffies / ticks / wall) if wall > 0 else 0.0


#: other programs' share above which a measurement is reported as taken on a busy machine
BUSY_CORES = 0.25


class OtherLoad:
    """``with OtherLoad() as load: ...`` then ``load.cores`` (None where it cannot tell)."""

    def __init__(self, proc: Path = _PROC) -> None:
        self.proc = proc
        self.cores: float | None = None
        self._before: CpuReading | None = None

    def __enter__(self) -> OtherLoad:
        self._before = cpu_reading(self.proc)
        return self

    def __exit__(self, *exc: object) -> None:
        after = cpu_reading(self.proc)
        if self._before is not None and after is not None:
            self.cores = other_cores(self._before, after)

    def warning(self, what: str) -> str | None:
        """A sentence for the user when other programs used at least ``BUSY_CORES``."""
        if self.cores is None or self.cores < BUSY_CORES:
            return None
        return (f"other programs kept {self.cores:.2f} cores busy while {what}; the "
                f"runtimes measured are for a busier machine than an idle one")


def least_loaded(measure: Callable[[int], T], what: str, attempts: int = 3,
                 other_load: Callable[[], OtherLoad] = OtherLoad,
                 note: Callable[[str], None] = lambda _: None,
                 warn: Callable[[str], None] | None = None, advice: str = ""
                 ) -> tuple[T, OtherLoad, int]:
    """``measure(attempt)`` (1, 2, ...) while an ``OtherLoad`` reads other programs' share of
    the machine, again while that share is ``BUSY_CORES`` or more, up to ``attempts`` runs in
    all (``note`` says why it measures again). Returns the result measured beside the least
    other load, that reading (its ``warning(what)`` is not None when every run was busy) and
    the attempt it came from. When every run was busy, ``warn`` is told so, with ``advice``."""
    if attempts < 1:
        raise KenError(f"{what}: attempts must be >= 1, got {attempts}")
    best: tuple[T, OtherLoad, int] | None = None
    for attempt in range(1, attempts + 1):
        with other_load() as load:
            result = measure(attempt)
        if best is None or (load.cores is not None and best[1].cores is not None
                            and load.cores < best[1].cores):
            best = (result, load, attempt)
        warning = load.warning(what)
        if warning is None:
            break
        if attempt < attempts:
            note(f"{warning}: measuring again")
    assert best is not None
    if warn is not None and (warning := best[1].warning(what)) is not None:
        warn(f"{warning} (the least of {attempts} attempts): {advice}")
    return best


def yield_cores() -> bool:
    """Put the calling thread in the CPU scheduler's idle class (Linux ``SCHED_IDLE``): it gets
    a tiny share of a core any other thread wants (a weight of 3 against a normal thread's
    1,024), and a normal thread that wakes takes its core at once rather than sharing it for
    a time slice. It still holds what it holds meanwhile (Python's GIL between its C calls:
    ken's other threads wait for it until it next runs). For work that can wait behind work with
    a tighter latency target on the same cores (a decode server beside classifier workers,
    ``DecodeServer(cpu_priority="background")``). The class holds for the thread's life: an
    unprivileged thread cannot leave it. False where the OS has no such class (the thread
    keeps its priority)."""
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(0, idle, os.sched_param(0))
    except OSError:
        return False
    return True


def runqueue_wait_s(tid: int, proc: Path = _PROC) -> float | None:
    """Seconds thread ``tid`` of this process has spent runnable but waiting for a core, over
    its life (``/proc/self/task/<tid>/schedstat``'s second field); None where the kernel does
    not keep it or the thread is gone."""
    try:
        fields = (proc / "self" / "task" / str(tid) / "schedstat").read_text().split()
        return int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


__all__ = ["BUSY_CORES", "CpuReading", "OtherLoad", "TreeUsage", "cpu_reading", "least_loaded",
           "other_cores", "process_rss_bytes", "runqueue_wait_s", "tree_usage", "yield_cores"]
