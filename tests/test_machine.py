"""Other programs' share of the machine while ken measures (``ken.machine``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fakes import fake_loads

from ken.engine.calibrate import Calibration
from ken.errors import KenError
from ken.machine import (
    BUSY_CORES,
    CpuReading,
    OtherLoad,
    _machine_busy,
    _tree_busy,
    least_loaded,
    other_cores,
    steal_cores,
)

SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\n"


def test_other_cores_is_the_machine_less_this_process_tree() -> None:
    before = CpuReading(machine=1000, ours=400, wall_s=10.0)
    after = CpuReading(machine=1400, ours=600, wall_s=12.0)  # 400 busy, 200 ours, in 2 s
    assert other_cores(before, after, ticks_per_s=100) == pytest.approx(1.0)
    assert other_cores(before, CpuReading(1100, 600, 12.0), ticks_per_s=100) == 0.0
    assert other_cores(before, CpuReading(1400, 600, 10.0), ticks_per_s=100) == 0.0
    stolen = CpuReading(machine=1400, ours=600, wall_s=12.0, steal=50)  # 0.25 of a core
    assert steal_cores(before, stolen, ticks_per_s=100) == pytest.approx(0.25)
    assert other_cores(before, stolen, ticks_per_s=100) == pytest.approx(1.0)  # in there


def test_a_reading_splits_the_machine_s_stolen_time_from_its_busy_time(tmp_path: Path) -> None:
    #                     user nice system idle iowait irq softirq steal guest guest_nice
    (tmp_path / "stat").write_text("cpu  100 10 50 900 40 5 5 30 0 0\ncpu0 1 2 3\n")
    assert _machine_busy(tmp_path) == (200, 30)


def test_tree_sums_descendants_and_reads_names_with_parentheses(tmp_path: Path) -> None:
    def proc(pid: int, name: str, ppid: int, utime: int, stime: int, reaped: int = 0) -> None:
        (tmp_path / str(pid)).mkdir()
        fields = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime), str(reaped), "0"] + \
            ["0"] * 3
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) {' '.join(fields)}\n")

    proc(10, "ken", 1, 5, 5, reaped=7)  # a worker that exited
    proc(11, "worker (1) x", 10, 20, 2)  # a child whose name holds ") "
    proc(12, "grandchild", 11, 3, 0)
    proc(13, "other", 1, 100, 100)  # not ours
    (tmp_path / "self").mkdir()  # not a pid: ignored
    assert _tree_busy(tmp_path, 10) == 42
    assert _tree_busy(tmp_path, 13) == 200


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="needs Linux's /proc")
def test_a_program_outside_the_tree_counts_and_a_worker_of_ours_does_not() -> None:
    # ours: a child process spinning for 1 s of CPU; read its output to wait for its end
    with OtherLoad() as ours:
        subprocess.run([sys.executable, "-c", SPIN], check=True)
    # another program's: the same spinner, started through a shell that exits at once, so
    # the spinner is re-parented away from this process; its stdout closes when it ends
    with OtherLoad() as others:
        shell = subprocess.Popen(["sh", "-c", f"{sys.executable} -c '{SPIN}' &"],
                                 stdout=subprocess.PIPE)
        shell.wait()
        assert shell.stdout is not None
        shell.stdout.read()  # EOF once the spinner exits
    assert ours.cores is not None and others.cores is not None
    assert others.cores >= ours.cores + 0.5
    assert others.warning("testing") is not None and "cores busy while testing" in \
        others.warning("testing")
    assert BUSY_CORES > 0


def test_calibration_records_the_other_load(tmp_path: Path) -> None:
    cal = Calibration({"m": ((1, 1.2),)}, {"m": 40}, "probe", other_cores=0.8)
    again = Calibration.load(cal.save(tmp_path / "calibration.json"))
    assert again.other_cores == pytest.approx(0.8)
    old = Calibration({"m": ((1, 1.2),)})
    assert Calibration.load(old.save(tmp_path / "old.json")).other_cores is None


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="needs Linux's /proc")
def test_tree_usage_counts_a_child_its_threads_and_its_open_files() -> None:
    """A child holding 20 extra open files: it is one process with at least those 20
    descriptors and a thread, and this process's tree holds at least as much as the child."""
    from ken.machine import tree_usage

    child = subprocess.Popen([sys.executable, "-c",
                              "import sys\nfiles = [open(sys.executable, 'rb') for _ in "
                              "range(20)]\nprint('ready', flush=True)\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        alone = tree_usage(child.pid)
        tree = tree_usage()
        assert alone is not None and tree is not None
        assert alone.processes == 1 and alone.open_files >= 20 + 3 and alone.threads >= 1
        assert alone.rss_bytes > 2**20
        assert tree.processes >= 2 and tree.open_files >= alone.open_files + 3
        assert tree.rss_bytes > alone.rss_bytes
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)


@pytest.mark.parametrize(("cores", "runs", "kept"), [
    ([0.0], 1, 1),                                          # quiet: measured once
    ([BUSY_CORES + 0.5, 0.1], 2, 2),                        # busy, then quiet
    ([BUSY_CORES + 0.5, BUSY_CORES + 0.1, BUSY_CORES + 0.9], 3, 2),  # busy throughout: least
    ([None], 1, 1),                                         # no /proc: nothing to compare
])
def test_least_loaded_measures_again_while_busy_and_keeps_the_quietest(
        cores: list[float | None], runs: int, kept: int) -> None:
    """Against brute force: the measurement kept is the one beside the least other load
    among the runs made, and runs stop at the first quiet one or after ``attempts``."""
    made: list[int] = []
    notes: list[str] = []
    result, load, attempt = least_loaded(lambda a: made.append(a) or f"run {a}", "probing",
                                         3, fake_loads(cores), notes.append)
    assert made == list(range(1, runs + 1))
    assert (result, attempt, load.cores) == (f"run {kept}", kept, cores[kept - 1])
    assert len(notes) == sum(c is not None and c >= BUSY_CORES for c in cores[:runs]) - (
        runs == 3 and cores[2] is not None and cores[2] >= BUSY_CORES)
    assert (load.warning("probing") is None) == (cores[kept - 1] is None
                                                  or cores[kept - 1] < BUSY_CORES)
    with pytest.raises(KenError, match="attempts must be >= 1"):
        least_loaded(lambda a: a, "probing", 0)
