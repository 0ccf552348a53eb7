"""A decode server at background CPU priority (``DecodeServer(cpu_priority="background")``):
its thread runs in the CPU scheduler's idle class, and a pass starved by busier threads is
slow, not stuck (its deadline counts only the time it was not waiting for a core)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fakes import GatedLM, StandInGenerator, gen_plan

from ken.engine.decode import CascadeServer
from ken.errors import EngineError
from ken.machine import runqueue_wait_s, yield_cores

IDLE_CLASS = getattr(os, "SCHED_IDLE", None) is not None and Path(
    f"/proc/self/task/{threading.get_native_id()}/schedstat").is_file()
needs_idle_class = pytest.mark.skipif(
    not IDLE_CLASS, reason="needs Linux's SCHED_IDLE and /proc/<pid>/task/<tid>/schedstat")


@needs_idle_class
def test_yield_cores_moves_only_the_calling_thread_to_the_idle_class() -> None:
    seen: dict[str, int] = {}

    def run() -> None:
        seen["ok"] = yield_cores()
        seen["policy"] = os.sched_getscheduler(0)

    before = os.sched_getscheduler(0)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == {"ok": True, "policy": os.SCHED_IDLE}
    assert os.sched_getscheduler(0) == before != os.SCHED_IDLE


def test_runqueue_wait_reads_the_threads_schedstat(tmp_path: Path) -> None:
    task = tmp_path / "self" / "task" / "41"
    task.mkdir(parents=True)
    (task / "schedstat").write_text("1200 2500000000 7\n")
    assert runqueue_wait_s(41, tmp_path) == 2.5
    assert runqueue_wait_s(42, tmp_path) is None  # gone
    (task / "schedstat").write_text("garbled")
    assert runqueue_wait_s(41, tmp_path) is None


def test_an_unknown_cpu_priority_is_refused() -> None:
    with pytest.raises(EngineError, match="cpu_priority must be 'normal' or 'background'"):
        CascadeServer({"g": StandInGenerator(GatedLM())}, gen_plan(),
                      cpu_priority="urgent")  # type: ignore[arg-type]


@needs_idle_class
def test_a_background_server_runs_its_passes_in_the_idle_class() -> None:
    lm = GatedLM()
    lm.gate.set()
    policies: list[int] = []
    inner = lm.net.forward

    def forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        policies.append(os.sched_getscheduler(0))
        return inner(*args, **kwargs)

    lm.net.forward = forward
    for priority, policy in (("background", os.SCHED_IDLE), ("normal", os.SCHED_OTHER)):
        policies.clear()
        server = CascadeServer({"g": StandInGenerator(lm)}, gen_plan(),
                               cpu_priority=priority).start()
        try:
            outcomes = [f.result(timeout=60) for f in
                        [server.submit_row(r) for r in ("abc", "de", "fgh")]]
        finally:
            server.shutdown()
        assert [o.status for o in outcomes] == ["ok"] * 3
        assert server.yielded == (priority == "background")
        assert policies and set(policies) == {policy}


SPIN = ("import sys, time\nprint('go', flush=True)\nt = time.time()\n"
        "while time.time() - t < {s}: pass\n")


@needs_idle_class
def test_a_starved_background_pass_is_slow_not_stuck() -> None:
    """Every core busy with normal threads for 5 s while a background pass needs 0.2 s of CPU:
    the pass takes longer than its 2-s timeout on the wall clock, but was waiting for a core,
    so its requests are answered; without the wait taken off, the watchdog would have failed
    them as a model that did not return."""
    lm = GatedLM()
    lm.gate.set()
    inner = lm.net.forward
    spun: list[float] = []

    def forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if not spun:  # the first pass: 0.2 s of this thread's CPU
            t0, w0 = time.thread_time(), time.monotonic()
            while time.thread_time() - t0 < 0.2:
                pass
            spun.append(time.monotonic() - w0)
        return inner(*args, **kwargs)

    lm.net.forward = forward
    cores = len(os.sched_getaffinity(0))
    server = CascadeServer({"g": StandInGenerator(lm)}, gen_plan(), pass_timeout_s=2.0,
                           cpu_priority="background").start()
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=5.0)],
                                 stdout=subprocess.PIPE, text=True) for _ in range(cores)]
    try:
        for p in spinners:  # every core is taken before the pass begins
            assert p.stdout is not None and p.stdout.readline().strip() == "go"
        outcome = server.submit_row("abc").result(timeout=60)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
        server.shutdown()
    assert server.yielded
    assert outcome.status == "ok", outcome.error
    assert spun and spun[0] > 2.0  # starved past the timeout on the wall clock


@needs_idle_class
def test_a_stuck_pass_at_background_priority_still_fails_at_its_deadline() -> None:
    """A pass that blocks (its gate never opens) waits for no core: the watchdog fails it
    after ``pass_timeout_s`` as at normal priority."""
    lm = GatedLM()
    server = CascadeServer({"g": StandInGenerator(lm)}, gen_plan(), pass_timeout_s=1.0,
                           cpu_priority="background").start()
    try:
        t0 = time.monotonic()
        future = server.submit_row("abc")
        assert lm.entered.wait(timeout=30)
        outcome = future.result(timeout=30)
        waited = time.monotonic() - t0
        assert server.yielded
        assert outcome.status == "error"
        assert "did not return from a forward pass within 1 s" in (outcome.error or "")
        assert waited < 10.0
    finally:
        lm.gate.set()
        server.shutdown()
