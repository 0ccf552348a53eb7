"""The result of one statement, read like a DuckDB relation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import duckdb
import pyarrow as pa


class Result:
    """A query result; converts like a DuckDB relation: ``arrow()``, ``df()``, ``fetchall()``."""

    def __init__(self, con: duckdb.DuckDBPyConnection | Callable[[], duckdb.DuckDBPyConnection],
                 table: pa.Table | None = None, relation: Any = None,
                 stats: dict | None = None) -> None:
        # a connection, or (from a session) a function giving the calling thread's connection:
        # a result may be read in another thread than the one that ran the query
        self._connect = con if callable(con) else (lambda: con)
        self._table = table
        self._relation = relation
        self.stats = stats or {}  # call-site label -> SiteStats, for semantic queries
        # (and "limit" -> LimitRun, "topk" -> TopkRun, "join" -> [JoinRun] where those ran)

    def arrow(self) -> pa.Table:
        if self._table is None:
            self._table = (self._relation.to_arrow_table() if self._relation is not None
                           else pa.table({}))
        return self._table

    to_arrow = arrow

    def df(self):  # noqa: ANN201 - pandas is optional
        return self.arrow().to_pandas()

    def fetchall(self) -> list[tuple]:
        table = self.arrow()
        if table.num_columns == 0:
            return []
        return self._connect().from_arrow(table).fetchall()

    @property
    def columns(self) -> list[str]:
        return self.arrow().column_names

    def __len__(self) -> int:
        return self.arrow().num_rows

    def __repr__(self) -> str:
        return (str(self._connect().from_arrow(self.arrow())) if self.arrow().num_columns
                else "<empty>")

    def __str__(self) -> str:
        table = self.arrow()
        if table.column_names == ["explain"]:
            return "\n".join(table.column("explain").to_pylist())
        return self.__repr__()
