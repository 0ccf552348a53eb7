"""A session's DuckDB database as its threads use it.

A DuckDB connection runs one query at a time, so the thread that opened the database uses its
connection and every other thread a cursor of its own (same database), on which the tables
registered on the session are registered again. Site functions are global to a database:
queries of other threads name theirs in another namespace (``CallSite.namespace``).

The database also knows which threads are running a statement on it, so that SIGTERM can end
them before the process exits (``refuse``, then ``settle``; ``ken.engine.sigterm``): a thread
still inside DuckDB while the interpreter finalizes is stopped as it takes the GIL back, which
DuckDB's C++ cannot unwind through, and the process aborts (SIGABRT) with its query unanswered.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb

from ken.errors import KenError, ServingStopped, ShuttingDown

#: how long SIGTERM waits for running statements to end on their own, then after interrupting
#: those still running (seconds)
SETTLE_GRACE_S = 5.0
SETTLE_INTERRUPTED_S = 5.0


class Database:
    """The DuckDB connection of a session and the per-thread cursors of it."""

    def __init__(self, path: str | Path | None = None) -> None:
        try:
            self.con = duckdb.connect(str(path) if path else ":memory:")
        except duckdb.Error as error:
            raise KenError(f"cannot open database {path}: {error}") from None
        self._owner_thread = threading.get_ident()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._cursors: list[duckdb.DuckDBPyConnection] = []
        self._tables: dict[str, Any] = {}
        self._tables_version = 0
        self._thread_ids = itertools.count(1)
        self._functions: frozenset[str] | None = None
        # threads running a statement (or reading a result) on the database: thread id ->
        # [depth of nested statements, the connection it runs on]
        self._running: dict[int, list] = {}
        self._changed = threading.Condition()
        self._refusing: str | None = None  # why new statements are turned away
        # set by ``settle`` once it has interrupted what still ran: nothing enters DuckDB
        self.closed = threading.Event()
        self._interrupted: set[int] = set()  # threads whose statement ``settle`` interrupted

    def connection(self) -> duckdb.DuckDBPyConnection:
        """``con`` in the thread that opened the database; in any other thread that thread's
        own cursor of it, with the registered tables."""
        if threading.get_ident() == self._owner_thread:
            return self.con
        local = self._local
        cur = getattr(local, "con", None)
        if cur is None:
            with self._lock:
                cur = self.con.cursor()
                self._cursors.append(cur)
                local.namespace = f"t{next(self._thread_ids)}"
            local.con, local.version = cur, -1
        if local.version != self._tables_version:
            for table_name, data in list(self._tables.items()):
                cur.register(table_name, data)
            local.version = self._tables_version
        return cur

    def namespace(self) -> str:
        """The calling thread's prefix of site function names ("" in the opening thread)."""
        if threading.get_ident() == self._owner_thread:
            return ""
        self.connection()
        return self._local.namespace

    def register(self, name: str, data: Any) -> None:
        """Expose an Arrow table or pandas frame as a view ``name`` (in every thread)."""
        with self.statement() as con:
            con.register(name, data)
        with self._lock:
            self._tables[name] = data
            self._tables_version += 1

    def functions(self) -> frozenset[str]:
        """The names of DuckDB's own functions (lower case)."""
        if self._functions is None:
            rows = self.connection().execute(
                "SELECT DISTINCT lower(function_name) FROM duckdb_functions()").fetchall()
            self._functions = frozenset(r[0] for r in rows)
        return self._functions

    # -- statements, and shutting down ---------------------------------------------------------

    @property
    def refusing(self) -> str | None:
        """Why the database turns new statements away (None: it takes them)."""
        return self._refusing

    @contextmanager
    def statement(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """Run a statement on the calling thread's connection (given) while the block runs;
        raises ``ShuttingDown`` when the database turns statements away (a statement's own
        statements, nested, are not turned away). A statement that ``settle`` interrupted
        ends in ``ShuttingDown``, one whose served rows were cancelled in ``ServingStopped``."""
        me = threading.get_ident()
        with self._changed:
            entry = self._running.get(me)
            if entry is None and self._refusing is not None:
                raise ShuttingDown(f"the session is shutting down ({self._refusing}): it takes "
                                   "no more statements")
            if entry is None:
                entry = self._running[me] = [0, None]
            entry[0] += 1
        try:
            if entry[1] is None:
                entry[1] = self.connection()
            yield entry[1]
        except (ServingStopped, ShuttingDown):
            raise
        except Exception as exc:
            if me in self._interrupted:
                raise ShuttingDown(f"the statement was interrupted: the session is shutting "
                                   f"down ({self._refusing}); it had not finished ({exc})"
                                   ) from None
            raise
        finally:
            self._leave(me, entry)

    @contextmanager
    def reading(self) -> Iterator[duckdb.DuckDBPyConnection | None]:
        """Read a result on the calling thread's connection (given) while the block runs: None
        once the database is closed by ``settle`` (read it without DuckDB then: the rows of a
        statement that finished are still the caller's)."""
        me = threading.get_ident()
        with self._changed:
            if self.closed.is_set():
                entry = None
            else:
                entry = self._running.setdefault(me, [0, None])
                entry[0] += 1
        if entry is None:
            yield None
            return
        try:
            if entry[1] is None:
                entry[1] = self.connection()
            yield entry[1]
        finally:
            self._leave(me, entry)

    def _leave(self, me: int, entry: list) -> None:
        with self._changed:
            entry[0] -= 1
            if entry[0] == 0:
                del self._running[me]
                self._interrupted.discard(me)
                self._changed.notify_all()

    def refuse(self, reason: str) -> None:
        """Turn new statements away from now on (``ShuttingDown``, saying ``reason``); those
        running go on."""
        with self._changed:
            if self._refusing is None:
                self._refusing = reason

    def settle(self, grace_s: float = SETTLE_GRACE_S,
               interrupted_s: float = SETTLE_INTERRUPTED_S) -> int:
        """After ``refuse``: wait up to ``grace_s`` for the running statements to end, then
        interrupt those still running and wait up to ``interrupted_s`` more; from then on
        nothing enters DuckDB (results are read without it). Returns how many statements it
        interrupted."""
        with self._changed:
            self._refusing = self._refusing or "it was closed"
            self._wait_idle(grace_s)
            interrupted = [(me, entry[1]) for me, entry in self._running.items()
                           if entry[1] is not None]
            for me, con in interrupted:
                self._interrupted.add(me)
                con.interrupt()  # DuckDB stops the query at its next check
            self.closed.set()
            self._wait_idle(interrupted_s)
        return len(interrupted)

    def _wait_idle(self, timeout_s: float) -> None:
        """Wait (holding ``_changed``) until no statement runs, up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._running and (left := deadline - time.monotonic()) > 0:
            self._changed.wait(left)

    def close(self) -> None:
        for cur in self._cursors:
            cur.close()
        self.con.close()
