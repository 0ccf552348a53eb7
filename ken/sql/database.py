"""A session's DuckDB database as its threads use it.

A DuckDB connection runs one query at a time, so the thread that opened the database uses its
connection and every other thread a cursor of its own (same database), on which the tables
registered on the session are registered again. Site functions are global to a database:
queries of other threads name theirs in another namespace (``CallSite.namespace``).
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import duckdb

from ken.errors import KenError


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
        self.connection().register(name, data)
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

    def close(self) -> None:
        for cur in self._cursors:
            cur.close()
        self.con.close()
