"""The result of one statement, read like a DuckDB relation."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import duckdb
import pyarrow as pa

from ken.errors import ShuttingDown


class Result:
    """A query result; converts like a DuckDB relation: ``arrow()``, ``df()``, ``fetchall()``."""

    def __init__(self, con: duckdb.DuckDBPyConnection | Callable[[], duckdb.DuckDBPyConnection],
                 table: pa.Table | None = None, relation: Any = None,
                 stats: dict | None = None,
                 reading: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        # a connection, or (from a session) a function giving the calling thread's connection:
        # a result may be read in another thread than the one that ran the query
        self._connect = con if callable(con) else (lambda: con)
        # (from a session) reading on the calling thread's connection, None once the session
        # has shut down (``Database.reading``): a finished result is then read without DuckDB
        self._reading = reading
        self._table = table
        self._relation = relation
        self.stats = stats or {}  # call-site label -> SiteStats, for semantic queries
        # (and "limit" -> LimitRun, "topk" -> TopkRun, "join" -> [JoinRun] where those ran)

    @contextmanager
    def _duckdb(self) -> Iterator[duckdb.DuckDBPyConnection | None]:
        if self._reading is None:
            yield self._connect()
            return
        with self._reading() as con:
            yield con

    def arrow(self) -> pa.Table:
        if self._table is None:
            if self._relation is None:
                self._table = pa.table({})
            else:
                with self._duckdb() as con:
                    if con is None:
                        raise ShuttingDown("the session has shut down before this result was "
                                           "read; it cannot be read any more")
                    self._table = self._relation.to_arrow_table()
        return self._table

    to_arrow = arrow

    def df(self):  # noqa: ANN201 - pandas is optional
        return self.arrow().to_pandas()

    def fetchall(self) -> list[tuple]:
        table = self.arrow()
        if table.num_columns == 0:
            return []
        with self._duckdb() as con:
            if con is None:
                return list(zip(*(column.to_pylist() for column in table.columns), strict=True))
            return con.from_arrow(table).fetchall()

    @property
    def columns(self) -> list[str]:
        return self.arrow().column_names

    def __len__(self) -> int:
        return self.arrow().num_rows

    def __repr__(self) -> str:
        table = self.arrow()
        if not table.num_columns:
            return "<empty>"
        with self._duckdb() as con:
            return str(table) if con is None else str(con.from_arrow(table))

    def __str__(self) -> str:
        table = self.arrow()
        if table.column_names == ["explain"]:
            return "\n".join(table.column("explain").to_pylist())
        return self.__repr__()
