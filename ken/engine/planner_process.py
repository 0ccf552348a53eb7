"""Re-planning in a child process (issue 33): a re-plan must not take the serving engine's
cores or its interpreter.

A re-plan simulates candidate plans for seconds of pure Python. Run in a thread of the
engine's process, it holds the GIL that the engine's scheduler and device threads need for
every request (each waits up to the interpreter's switch interval for it, several times per
request), and on a machine whose cores the workers fill it takes a core from them too. In the
robustness benchmark the windows where such a re-plan ran were a run's worst (up to 5.9 s
p95); in a child process the run's p95 was 4.8-13.8x lower in three of six A/B pairs and
within 10% in the others (``docs/results.md``).

``PlannerProcess`` is one fresh Python process (``python -c``, like the device workers, so it
never imports the caller's ``__main__``) at a lower CPU priority (``nice`` ``NICE``), started
once and kept: ``call(fn, *args)`` pickles ``fn`` and its arguments over, runs ``fn(*args)``
there and returns its result together with ``fn`` as it was after the call, so a stateful
planner (``GearReplan`` keeps the catalog a drift changed) can copy its new state back. The
child exits when the caller closes it or its parent process is gone; a child that died is
started again by the next call.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from ken.engine.workers import exit_with_parent, ignore_stop_signals
from ken.errors import KenError

#: how much lower the planner's CPU priority is than the engine's (``os.nice`` increment)
NICE = 10


class PlannerProcess:
    """A child process that runs planning calls (see the module docstring)."""

    def __init__(self, nice: int = NICE, start_timeout_s: float = 120.0) -> None:
        self.nice = nice
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._send: Connection | None = None
        self._recv: Connection | None = None
        self.starts = 0
        self._lock = threading.Lock()  # one call at a time over the pipes

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> PlannerProcess:
        """Start the child (imports ken's planner there) and wait until it is ready."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from ken.engine.planner_process import main; "
             "sys.exit(main(sys.argv[1:]))", str(to_child_r), str(to_parent_w),
             str(self.nice), str(os.getpid())],
            pass_fds=(to_child_r, to_parent_w), stdin=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(to_parent_w)
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(to_parent_r, writable=False)
        self.starts += 1
        try:
            self._send.send(list(sys.path))
        except OSError:
            pass  # it died at once: the wait below says so
        if self._wait(self.start_timeout_s, "starting")[0] != "ready":
            raise KenError("the planner process did not start")
        return self

    def call(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, Callable[..., Any]]:
        """``fn(*args)`` in the child: (its result, ``fn`` as it was after the call). An
        exception ``fn`` raises is raised here as a ``KenError`` naming it; ``fn`` or an
        argument that cannot be pickled raises before anything is sent. Calls from several
        threads take turns."""
        payload = pickle.dumps((fn, args))
        with self._lock:
            self.start()
            assert self._send is not None
            try:
                self._send.send_bytes(payload)
            except OSError:
                self._forget()
                raise KenError("the planner process ended before the call reached it") from None
            msg = self._wait(None, "planning")
        if msg[0] == "ok":
            return pickle.loads(msg[1]), pickle.loads(msg[2])
        raise KenError(f"planning failed in the planner process: {msg[1]}")

    def _wait(self, timeout_s: float | None, doing: str) -> tuple:
        recv, proc = self._recv, self._proc
        assert recv is not None and proc is not None
        try:
            if timeout_s is not None and not recv.poll(timeout_s):
                self.close()
                raise KenError(f"the planner process did not answer within {timeout_s:.0f} s "
                               f"while {doing}")
            return recv.recv()
        except (EOFError, OSError):
            code = proc.wait()
            self._forget()
            raise KenError(f"the planner process ended (exit code {code}) while {doing}; the "
                           "next re-plan starts a new one") from None

    def _forget(self) -> None:
        for c in (self._send, self._recv):
            if c is not None:
                c.close()
        self._proc = self._send = self._recv = None

    def close(self) -> None:
        """Stop the child (a call under way is cut short: close after the caller's last)."""
        proc, send = self._proc, self._send
        if proc is None:
            return
        try:
            if send is not None:
                send.send_bytes(b"")
        except OSError:
            pass
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._forget()

    def __enter__(self) -> PlannerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def picklable(value: object) -> bool:
    """Whether ``value`` survives ``pickle`` (a planner a child process can run)."""
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - any failure means: run it in this process
        return False
    return True


def _serve(inp: Connection, out: Connection) -> None:
    sys.path[:0] = [p for p in inp.recv() if p not in sys.path]  # the caller's import path
    import ken.optimizer.replan  # noqa: F401 - the planner's imports, paid before the first call

    out.send(("ready",))
    while True:
        raw = inp.recv_bytes()
        if not raw:
            return
        try:
            fn, args = pickle.loads(raw)
            result = fn(*args)
            out.send(("ok", pickle.dumps(result), pickle.dumps(fn)))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which raises it
            out.send(("error", f"{type(exc).__name__}: {exc}"))


def main(argv: Sequence[str]) -> int:
    """Entry point of the planner process; arguments: IN OUT pipe fds, NICE, the parent's
    process id."""
    ignore_stop_signals()
    exit_with_parent(int(argv[3]))
    os.nice(int(argv[2]))
    inp = Connection(int(argv[0]), writable=False)
    out = Connection(int(argv[1]), readable=False)
    try:
        _serve(inp, out)
    except (EOFError, OSError):  # the parent closed its end or is gone
        pass
    return 0
