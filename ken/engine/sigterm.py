"""SIGTERM drains what a process serves, then exits (DESIGN.md section 14).

One handler for every server: a standalone ``Engine`` started in the main thread installs one
for itself (``drain_on_sigterm``); the serving manager installs one for every server it runs
(the classifier engine and each generating function's decode server), so a served generating
function drains exactly as a classifier does, and ends the session's SQL statements before
the process exits (``ServingManager.drain_on_sigterm``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any


class SigtermDrain:
    """The SIGTERM handler: the first SIGTERM calls ``drain`` in a thread (a signal handler
    must not wait: the main thread may hold a server's lock); when the drain is done that
    thread signals the main thread again, and the handler puts the previous handler back and
    calls it, or exits with status 128 + SIGTERM."""

    def __init__(self, drain: Callable[[], object], previous: Any) -> None:
        self.drain = drain
        self.previous = previous
        self.drained = False
        self._thread: threading.Thread | None = None

    @classmethod
    def install(cls, drain: Callable[[], object]) -> SigtermDrain | None:
        """Install it (None: not in the main thread, or SIGTERM is ignored or handled
        outside Python, which is left alone)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None or previous is signal.SIG_IGN:
            return None
        handler = cls(drain, previous)
        signal.signal(signal.SIGTERM, handler)
        return handler

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self.drained:
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="ken-sigterm-drain",
                                                daemon=True)
                self._thread.start()
            return
        self.restore()
        if callable(self.previous):
            self.previous(signum, frame)
            return
        raise SystemExit(128 + signum)

    def _drain(self) -> None:
        try:
            self.drain()
        finally:
            self.drained = True
            main = threading.main_thread()
            if main.is_alive() and main.ident is not None:
                signal.pthread_kill(main.ident, signal.SIGTERM)

    def restore(self) -> bool:
        """Put the previous handler back (in the main thread; False elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) is self:
            signal.signal(signal.SIGTERM, self.previous)
        return True
