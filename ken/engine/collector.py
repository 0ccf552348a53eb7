"""Python's cyclic garbage collector in a serving process (issue 38).

A full collection walks every object the process tracks and holds the GIL while it does, so
every thread of the process waits: the engine's scheduler, a decode server's passes, a
worker's batch. A process that has imported torch and transformers and loaded the packaged
models tracks 430,000-470,000 objects, and a full collection of them takes 190-240 ms on this
project's CPUs (``docs/reliability.md``) — more than the fast plans' whole latency target. What
is loaded before serving starts lives as long as the server, so it need not be walked again:
``gc.freeze()`` moves every tracked object to a generation no collection walks (objects still
die when nothing refers to them; only cycles among frozen objects wait for ``gc.unfreeze()``).

- A worker process or Ray actor holds its models for its whole life: after loading it collects
  once and freezes what it holds (``settle_worker``; not in the driver's own process, where a
  Ray started in local mode runs its actors).
- The engine's process is the user's. An ``Engine`` or ``DecodeServer`` holds a freeze while it
  serves (``hold``: the process's garbage collected first, then what is left frozen; models
  an engine's thread workers load later, for a swapped-in plan, are frozen then,
  ``refreeze``); when the last one stops, what was frozen goes back to the collector
  (``gc.unfreeze()``), so the models of closed servers are collected as before once no server
  of the process serves. A process that
  had frozen objects itself before ken's first hold keeps them frozen: ken does not unfreeze
  what it did not freeze (objects the process freezes itself while ken holds a freeze are
  unfrozen with ken's at the last release).
"""

from __future__ import annotations

import gc
import os
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
    """Collect the process's garbage, then freeze every object it still tracks (what a server
    that starts serving has loaded) until the returned hold, and every other one, is released.
    The collection walks what no live hold has frozen: the whole process at the first hold."""
    global _holders, _frozen_before
    gc.collect()  # garbage is not frozen (outside the lock: a finalizer may run here)
    with _lock:
        if _holders == 0:
            _frozen_before = gc.get_freeze_count() > 0
        _holders += 1
        gc.freeze()
    return Hold()


def refreeze() -> None:
    """Freeze what was loaded since the holds began (a plan swap's models), if any is live."""
    if holders():
        gc.collect()
        with _lock:
            if _holders:
                gc.freeze()


def holders() -> int:
    """How many servers of this process hold a freeze now."""
    with _lock:
        return _holders


def settle_worker(driver_pid: int | None = None) -> None:
    """In a worker process or Ray actor whose models were just loaded: collect the loading's
    garbage, then freeze what is left (the models, the imports) for the worker's life. Nothing
    in the process ``driver_pid`` (a Ray in local mode runs actors in the driver, the user's
    process)."""
    if os.getpid() == driver_pid:
        return
    gc.collect()
    gc.freeze()
