"""The result cache: answers of semantic calls kept across queries, sessions and processes.

One SQLite file (``KEN_HOME/cache/results.sqlite``; SQLite rather than DuckDB because several
processes may write at once, which SQLite's write-ahead log serialises and DuckDB's file lock
refuses). Each entry is one answer, keyed by the hash of its *namespace* and its input:

- the namespace is a hash of everything the answer depends on besides the input (the caller's
  job, ``ken.sql.cache_key``: the operator and its constants, the cascade or gear plan, every
  model's content fingerprint, the output type and the code of ken itself), so training an
  operator, changing a cascade or a model's files, or upgrading ken makes a new namespace and
  the old answers unreachable (they age out of the LRU bound; ``ken cache clear`` drops them);
- the input is the call's argument value (a text, or a tuple of texts); it is not stored, only
  its hash.

What it promises:

- **Verified on read.** Every entry stores a checksum of its key and value; an entry that does
  not match (a bit flip, a hand edit) is deleted and counted as a miss, never returned. A file
  that is not a readable SQLite database is moved aside (``results.sqlite.corrupt-<time>``) and
  a new one started, with a message naming both paths: a corrupted cache costs its answers,
  never a wrong one.
- **Only answers.** Callers put the values of calls that returned; a failed or cancelled call
  has no value to put.
- **Bounded.** When the file's entries pass ``max_bytes`` the least recently used are deleted
  down to 90% of it.
- **Safe for concurrent sessions and processes.** Write-ahead log, a busy timeout, and one
  transaction per batch of puts; within a process one lock per cache object.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ken.errors import KenError
from ken.paths import ken_home

#: bump when the key or value encoding changes: older files are then started afresh
SCHEMA_VERSION = 1
#: the default size bound of the entries (``KEN_CACHE_MAX_MB`` overrides it)
DEFAULT_MAX_BYTES = 512 * 1024 * 1024
#: how long a writer waits for another process's transaction (seconds)
BUSY_TIMEOUT_S = 30.0
#: rows per SQL statement when looking up or touching many keys
CHUNK = 500
#: bytes an entry costs besides its value (key, checksum, row overhead)
ENTRY_OVERHEAD = 64

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS namespaces (
    id TEXT PRIMARY KEY, operator TEXT NOT NULL, description TEXT NOT NULL,
    created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    key BLOB PRIMARY KEY, namespace TEXT NOT NULL, value TEXT NOT NULL,
    checksum BLOB NOT NULL, size INTEGER NOT NULL, last_used REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_by_use ON entries (last_used);
CREATE INDEX IF NOT EXISTS entries_by_namespace ON entries (namespace);
"""


class CacheError(KenError):
    """The result cache cannot be used (a bad path or setting)."""


def default_path(home: Path | None = None) -> Path:
    """Where a session keeps its cache: ``KEN_HOME/cache/results.sqlite``."""
    return (home or ken_home()) / "cache" / "results.sqlite"


def cache_setting(value: Any) -> Any:
    """A session's ``cache=`` argument as True (the default file), False (none), a path, or
    a :class:`ResultCache`; None reads ``KEN_CACHE`` (unset, ``on``: True; ``off``: False;
    anything else: a path)."""
    if value is None:
        env = os.environ.get("KEN_CACHE", "").strip()
        if env.lower() in ("", "on", "1", "true", "yes"):
            return True
        if env.lower() in ("off", "0", "false", "no"):
            return False
        return Path(env).expanduser()
    if isinstance(value, bool | ResultCache):
        return value
    if isinstance(value, str | Path):
        return Path(value).expanduser()
    raise CacheError(f"cache= takes True, False, a path or a ResultCache, not {value!r}")


def max_bytes_from_env() -> int:
    """The size bound: ``KEN_CACHE_MAX_MB`` (megabytes) or :data:`DEFAULT_MAX_BYTES`."""
    text = os.environ.get("KEN_CACHE_MAX_MB")
    if not text:
        return DEFAULT_MAX_BYTES
    try:
        mb = float(text)
    except ValueError:
        raise CacheError(f"KEN_CACHE_MAX_MB must be a number of megabytes, not {text!r}"
                         ) from None
    if not mb > 0:
        raise CacheError(f"KEN_CACHE_MAX_MB must be above 0, not {text!r}")
    return int(mb * 1024 * 1024)


def encode_input(value: Any) -> str:
    """The canonical text of a call's input: a text, or a tuple/list of texts (pairs)."""
    if isinstance(value, tuple | list):
        return json.dumps(list(value), ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def encode_value(value: Any) -> str:
    """A SQL value (None, bool, int, float, str, or a dict of them for a STRUCT) as JSON; NaN
    and infinities are kept."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _key(namespace: str, value: Any) -> bytes:
    return hashlib.sha256(f"{namespace}\0{encode_input(value)}".encode()).digest()


def _checksum(key: bytes, text: str) -> bytes:
    return hashlib.sha256(key + text.encode()).digest()[:8]


@dataclass(frozen=True)
class OperatorUsage:
    """One operator's entries in the cache (``ken cache stats``)."""

    operator: str
    namespaces: int
    entries: int
    bytes: int
    last_used: float  # unix time of the newest use; 0 when none


@dataclass(frozen=True)
class CacheStats:
    path: Path
    entries: int
    bytes: int
    max_bytes: int
    file_bytes: int
    operators: tuple[OperatorUsage, ...]

    def lines(self) -> list[str]:
        mib = 1024 * 1024
        out = [f"result cache {self.path}: {_answers(self.entries)}, "
               f"{self.bytes / mib:,.1f} MiB of {self.max_bytes / mib:,.0f} MiB allowed "
               f"(file {self.file_bytes / mib:,.1f} MiB)"]
        for u in self.operators:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(u.last_used))
            versions = "1 version" if u.namespaces == 1 else f"{u.namespaces} versions"
            out.append(f"  {u.operator}: {_answers(u.entries)} in {versions}, "
                       f"{u.bytes / mib:,.2f} MiB, last used {when}")
        return out


class ResultCache:
    """Answers by (namespace, input); see the module docstring. Thread-safe."""

    def __init__(self, path: str | Path | None = None, max_bytes: int | None = None,
                 warn: Any = None, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        """``warn(message)`` is told when a corrupted file is set aside (default: stderr);
        ``busy_timeout_s``: how long to wait for another process's write before the cache
        gives up (``CacheError``; a query then goes on without the cache)."""
        self.path = Path(path) if path is not None else default_path()
        self.max_bytes = max_bytes_from_env() if max_bytes is None else int(max_bytes)
        if self.max_bytes <= 0:
            raise CacheError(f"the cache's max_bytes must be above 0, not {max_bytes}")
        self._warn = warn
        self.busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self._known_namespaces: set[str] = set()
        self.corrupt_entries = 0  # entries dropped by the read check since opening
        self._con: sqlite3.Connection | None = None
        self._open()

    # -- the file --------------------------------------------------------------------------

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot create the result cache's folder {self.path.parent}: "
                             f"{exc}") from None
        try:
            self._con = self._connect()
        except sqlite3.OperationalError as exc:
            if not _damaged(exc):
                raise CacheError(f"the result cache {self.path} cannot be opened: {exc}"
                                 ) from None
            self._set_aside(exc)
            self._con = self._connect()
        except sqlite3.DatabaseError as exc:
            self._set_aside(exc)
            self._con = self._connect()

    def _connect(self) -> sqlite3.Connection:
        """A connection with the schema in place. Switching a new file to the write-ahead log
        takes a lock SQLite's busy timeout does not wait for, so a process that finds another
        setting the file up tries again until ``busy_timeout_s`` has passed."""
        give_up = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                return self._set_up()
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= give_up:
                    raise
                time.sleep(0.02 + 0.08 * random.random())

    def _set_up(self) -> sqlite3.Connection:
        con = sqlite3.connect(self.path, timeout=self.busy_timeout_s,
                              check_same_thread=False, isolation_level=None)
        try:
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=NORMAL")
            con.executescript(_SCHEMA)
            row = con.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
            if row is None:
                con.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)",
                            (str(SCHEMA_VERSION),))
            elif row[0] != str(SCHEMA_VERSION):
                con.execute("BEGIN IMMEDIATE")
                con.execute("DELETE FROM entries")
                con.execute("DELETE FROM namespaces")
                con.execute("UPDATE meta SET value = ? WHERE name = 'schema'",
                            (str(SCHEMA_VERSION),))
                con.execute("COMMIT")
        except sqlite3.DatabaseError:
            con.close()
            raise
        return con

    def _set_aside(self, exc: Exception) -> None:
        """Move an unreadable file (and its WAL) aside and say so."""
        if self._con is not None:
            try:
                self._con.close()
            except sqlite3.Error:
                pass
            self._con = None
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(self.path, aside)
        for suffix in ("-wal", "-shm"):
            extra = self.path.with_name(self.path.name + suffix)
            if extra.exists():
                os.replace(extra, aside.with_name(aside.name + suffix))
        message = (f"the result cache {self.path} could not be read ({exc}); it was moved to "
                   f"{aside} and a new, empty cache started (answers are computed again)")
        if self._warn is not None:
            self._warn(message)
        else:
            import sys
            print(f"ken: {message}", file=sys.stderr)
        self._known_namespaces.clear()

    def _run(self, work: Any) -> Any:
        """``work(connection)`` under the lock; a corrupted file is set aside and the work
        tried once more on the new one."""
        with self._lock:
            if self._con is None:
                raise CacheError(f"the result cache {self.path} is closed")
            try:
                return work(self._con)
            except sqlite3.OperationalError as exc:
                # locked past the timeout, a full disk, a read-only file: not damage
                if _damaged(exc):
                    return self._rebuilt(work, exc)
                raise CacheError(f"the result cache {self.path} cannot be used now: {exc}"
                                 ) from None
            except sqlite3.DatabaseError as exc:
                return self._rebuilt(work, exc)

    def _rebuilt(self, work: Any, exc: Exception) -> Any:
        """Set the damaged file aside and do ``work`` on a new one (the lock is held)."""
        self._set_aside(exc)
        self._con = self._connect()
        return work(self._con)

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None

    # -- answers ---------------------------------------------------------------------------

    def get_many(self, namespace: str, inputs: Sequence[Any]) -> dict[Any, Any]:
        """The cached answers among ``inputs`` (distinct, hashable), by input; entries that
        fail the read check are deleted and left out."""
        if not inputs:
            return {}
        keys = {_key(namespace, v): v for v in inputs}

        def work(con: sqlite3.Connection) -> dict[Any, Any]:
            found: dict[Any, Any] = {}
            bad: list[bytes] = []
            ordered = list(keys)
            for i in range(0, len(ordered), CHUNK):
                part = ordered[i:i + CHUNK]
                marks = ",".join("?" * len(part))
                for key, text, check in con.execute(
                        f"SELECT key, value, checksum FROM entries WHERE key IN ({marks})",
                        part):
                    key = bytes(key)
                    try:
                        if _checksum(key, text) != bytes(check):
                            raise ValueError("checksum")
                        found[keys[key]] = json.loads(text)
                    except (ValueError, TypeError):
                        bad.append(key)
            if found or bad:
                now = time.time()
                con.execute("BEGIN IMMEDIATE")
                try:
                    hits = [_key(namespace, v) for v in found]
                    for i in range(0, len(hits), CHUNK):
                        part = hits[i:i + CHUNK]
                        con.execute(f"UPDATE entries SET last_used = ? WHERE key IN "
                                    f"({','.join('?' * len(part))})", [now, *part])
                    con.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in bad])
                    con.execute("COMMIT")
                except BaseException:
                    con.execute("ROLLBACK")
                    raise
            self.corrupt_entries += len(bad)
            return found

        return self._run(work)

    def count(self, namespace: str, inputs: Sequence[Any]) -> int:
        """How many of ``inputs`` (distinct) have an answer under ``namespace``; reads only
        (answers are checked when they are read for use)."""
        keys = [_key(namespace, v) for v in inputs]

        def work(con: sqlite3.Connection) -> int:
            found = 0
            for i in range(0, len(keys), CHUNK):
                part = keys[i:i + CHUNK]
                found += con.execute(f"SELECT COUNT(*) FROM entries WHERE key IN "
                                     f"({','.join('?' * len(part))})", part).fetchone()[0]
            return found

        return self._run(work) if keys else 0

    def put_many(self, namespace: str, operator: str, description: str,
                 answers: Mapping[Any, Any]) -> None:
        """Keep ``answers`` (input -> SQL value) under ``namespace``; ``operator`` and
        ``description`` name it in ``ken cache stats``. Evicts least recently used entries
        past the size bound."""
        if not answers:
            return
        now = time.time()
        rows = []
        for value_in, value in answers.items():
            key = _key(namespace, value_in)
            text = encode_value(value)
            rows.append((key, namespace, text, _checksum(key, text),
                         len(text.encode()) + ENTRY_OVERHEAD, now))

        def work(con: sqlite3.Connection) -> None:
            con.execute("BEGIN IMMEDIATE")
            try:
                if namespace not in self._known_namespaces:
                    con.execute("INSERT OR IGNORE INTO namespaces VALUES (?, ?, ?, ?)",
                                (namespace, operator, description, now))
                con.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                                rows)
                self._evict(con)
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
            self._known_namespaces.add(namespace)

        self._run(work)

    def _evict(self, con: sqlite3.Connection) -> None:
        total = con.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0]
        if total <= self.max_bytes:
            return
        excess = total - int(0.9 * self.max_bytes)
        doomed: list[bytes] = []
        for key, size in con.execute("SELECT key, size FROM entries ORDER BY last_used"):
            doomed.append(key)
            excess -= size
            if excess <= 0:
                break
        con.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in doomed])
        con.execute("DELETE FROM namespaces WHERE id NOT IN "
                    "(SELECT DISTINCT namespace FROM entries)")
        self._known_namespaces.clear()

    # -- administration --------------------------------------------------------------------

    def stats(self) -> CacheStats:
        def work(con: sqlite3.Connection) -> CacheStats:
            total = con.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries"
                                ).fetchone()
            usage = con.execute(
                "SELECT n.operator, COUNT(DISTINCT e.namespace), COUNT(*), SUM(e.size), "
                "MAX(e.last_used) FROM entries e JOIN namespaces n ON n.id = e.namespace "
                "GROUP BY n.operator ORDER BY n.operator").fetchall()
            return CacheStats(self.path, total[0], total[1], self.max_bytes,
                              _file_bytes(self.path),
                              tuple(OperatorUsage(o, ns, n, b, t or 0.0)
                                    for o, ns, n, b, t in usage))

        return self._run(work)

    def clear(self, operators: Iterable[str] = ()) -> int:
        """Delete every entry (or those of ``operators``); the number deleted."""
        names = list(operators)

        def work(con: sqlite3.Connection) -> int:
            con.execute("BEGIN IMMEDIATE")
            try:
                if names:
                    marks = ",".join("?" * len(names))
                    gone = con.execute(
                        f"DELETE FROM entries WHERE namespace IN (SELECT id FROM namespaces "
                        f"WHERE operator IN ({marks}))", names).rowcount
                    con.execute(f"DELETE FROM namespaces WHERE operator IN ({marks})", names)
                else:
                    gone = con.execute("DELETE FROM entries").rowcount
                    con.execute("DELETE FROM namespaces")
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
            self._known_namespaces.clear()
            return gone

        gone = self._run(work)
        if not names:
            self._run(lambda con: con.execute("VACUUM"))
        return gone


def _answers(n: int) -> str:
    return "1 answer" if n == 1 else f"{n:,} answers"


def _damaged(exc: sqlite3.OperationalError) -> bool:
    """Whether an operational error means the file's contents are bad (a missing table), not
    that the file cannot be written now."""
    return "no such table" in str(exc) or "malformed" in str(exc)


def _file_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal"))
               if p.exists())

