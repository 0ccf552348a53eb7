"""Python's cyclic garbage collector in a serving process (issue 38).

A full collection walks every object the process tracks and holds the GIL while it does, so
every thread of the process waits: the engine's scheduler, a decode server's passes, a
worker's batch. A process that has imported torch and transformers and loaded the packaged
models tracks 430,000-460,000 objects, and a full collection of them takes 190-230 ms on this
project's CPUs (``docs/reliability.md``) — more than the fast plans' whole latency target. What
is loaded before serving starts lives as long as the server, so it need not be walked again:
``gc.freeze()`` moves every tracked object to a generation no collection walks (objects still
die when nothing refers to them; only cycles among frozen objects wait for ``gc.unfreeze()``).

- A worker process or Ray actor holds its models for its whole life: after loading it collects
  once and freezes what it holds (``settle_worker``).
- The engine's process is the user's. An ``Engine`` or ``DecodeServer`` holds a freeze while it
  serves (``hold``); when the last one stops, what was frozen goes back to the collector
  (``gc.unfreeze()``), so a closed session's models are collected as before. A process that had
  frozen objects itself before ken's first hold keeps them frozen: ken does not unfreeze what it
  did not freeze.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0
_frozen_before = False  # the process had frozen objects itself when ken's first hold began


class Hold:
    """One server's freeze (``hold``): ``release`` once it stops serving; twice is harmless."""

    def __init__(self) -> None:
        self._held = True

    def release(self) -> None:
        global _holders
        with _lock:
            if not self._held:
                return
            self._held = False
            _holders -= 1
            if _holders == 0 and not _frozen_before:
                gc.unfreeze()


def hold() -> Hold:
    """Freeze every object this process tracks now (what a server that starts serving has
    loaded) until the returned hold, and every other one, is released."""
    global _holders, _frozen_before
    with _lock:
        if _holders == 0:
            _frozen_before = gc.get_freeze_count() > 0
        _holders += 1
        gc.freeze()
    return Hold()


def holders() -> int:
    """How many servers of this process hold a freeze now."""
    with _lock:
        return _holders


def settle_worker() -> None:
    """In a worker process or Ray actor whose models were just loaded: collect the loading's
    garbage, then freeze what is left (the models, the imports) for the worker's life."""
    gc.collect()
    gc.freeze()
