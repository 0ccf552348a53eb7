"""The ``TRAIN`` statement: train a semantic function on a labelled table from SQL.

    TRAIN sentiment ON reviews LABEL mood
    TRAIN sem_match ON pairs LABEL is_match USING left_title, right_title
    TRAIN sem_filter ON reviews LABEL positive FOR 'expresses a positive opinion'
    TRAIN sentiment ON 'labelled.parquet' LABEL mood USING text

In a script (``Session.sql_script`` or ``ken sql "TRAIN ...; SELECT ..."``) statements may
follow it and use what it trained: a session keeps what it trained, and a new session
re-running the same ``TRAIN`` finds it cached on disk.
``ON`` names a table or view, or a quoted file DuckDB can read (CSV, Parquet, JSON); ``USING``
names the input columns (default: every text column but the label); ``FOR`` gives the
predicate of sem_filter or sem_join. The query runner trains it (``QueryRunner.train``, as
``Session.train`` does) and returns one row describing what was trained and its validation quality.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from ken.errors import KenError
from ken.sql.rewrite import SqlError

_IDENT = r'(?:"(?:[^"]|"")+"|[A-Za-z_][A-Za-z0-9_]*)'
_STRING = r"'(?:[^']|'')*'"
_STATEMENT = re.compile(
    rf"^\s*TRAIN\s+(?P<function>{_IDENT})\s+ON\s+(?P<source>{_IDENT}(?:\.{_IDENT})*|{_STRING})"
    rf"\s+LABEL\s+(?P<label>{_IDENT})"
    rf"(?:\s+USING\s+(?P<columns>{_IDENT}(?:\s*,\s*{_IDENT})*))?"
    rf"(?:\s+FOR\s+(?P<predicate>{_STRING}))?\s*(?:;|$)",
    re.IGNORECASE | re.DOTALL)
_START = re.compile(r"^\s*TRAIN\b", re.IGNORECASE)
USAGE = ("TRAIN <function> ON <table | 'file'> LABEL <column> [USING <column>, ...] "
         "[FOR '<predicate>']")


@dataclass(frozen=True)
class TrainStatement:
    function: str
    source: str  # a table name (as written, quotes kept) or a file path
    is_file: bool
    label: str
    columns: tuple[str, ...] | None
    predicate: str | None


def is_train(query: str) -> bool:
    return bool(_START.match(query))


def _name(token: str) -> str:
    return token[1:-1].replace('""', '"') if token.startswith('"') else token


def _string(token: str) -> str:
    return token[1:-1].replace("''", "'")


def parse_train(query: str) -> tuple[TrainStatement, str]:
    """Parse a leading ``TRAIN`` statement: ``(statement, the statements after it)``; a
    malformed one is an error that shows the syntax."""
    match = _STATEMENT.match(query)
    if not match:
        raise SqlError(f"cannot parse the TRAIN statement {query.strip()[:120]!r}; the syntax "
                       f"is: {USAGE}")
    source = match.group("source")
    is_file = source.startswith("'")
    columns = None
    if match.group("columns"):
        columns = tuple(_name(c.strip()) for c in
                        re.findall(_IDENT, match.group("columns")))
    predicate = match.group("predicate")
    return TrainStatement(_name(match.group("function")).lower(),
                          _string(source) if is_file else source, is_file,
                          _name(match.group("label")), columns,
                          _string(predicate) if predicate else None), query[match.end():]


def training_table(con: duckdb.DuckDBPyConnection, table: Any) -> tuple[pa.Table, str]:
    """The rows to train on and where they came from: ``table`` is a table or view name, a
    ``Path`` to a file DuckDB reads, an Arrow table or a pandas frame."""
    if isinstance(table, pa.Table):
        return table, "an Arrow table"
    if isinstance(table, Path):
        if not table.exists():
            raise KenError(f"no file {table} to train on")
        quoted = str(table).replace("'", "''")
        try:
            return con.sql(f"SELECT * FROM '{quoted}'").to_arrow_table(), str(table)
        except duckdb.Error as error:
            raise KenError(f"cannot read {table}: {error}") from None
    if isinstance(table, str):
        try:
            return con.sql(f"SELECT * FROM {table}").to_arrow_table(), table
        except duckdb.Error as error:
            raise KenError(f"cannot read table {table}: {error}") from None
    if hasattr(table, "to_arrow") or type(table).__name__ == "DataFrame":
        try:
            return pa.Table.from_pandas(table, preserve_index=False), "a DataFrame"
        except (TypeError, ValueError, pa.ArrowException) as error:
            raise KenError(f"cannot read the DataFrame to train on: {error}") from None
    raise KenError(f"cannot train on a {type(table).__name__}; pass a table name, a Path "
                   "to a file, an Arrow table or a pandas DataFrame")
