"""A semantic query over a big Parquet dataset, its semantic step on Ray Data (issue 20).

``session.sql(query, engine="ray")``, or the default ``engine="auto"`` when the dataset holds at
least ``session.ray_min_rows`` rows (``ray_choice``): the query must read one Parquet dataset
(``FROM 'path/*.parquet'`` or ``read_parquet(...)``), and its semantic calls must take text
columns of it. Then:

1. every call site becomes a column computed by Ray Data over the dataset's blocks
   (``ken.engine.ray_data.semantic_columns``: streaming, models loaded once per actor,
   progress shown), written as Parquet into a temporary folder;
2. the query is rewritten to read that folder instead of the source and each call to read its
   column, and DuckDB runs it (filters, joins, aggregates, order) as it would have.

The values equal those of the single-machine run row for row: the same bound cascade answers
each row. Every row goes through the semantic step (filters that DuckDB would evaluate before
a semantic call do not prune it here): the price of streaming the table once.
"""

from __future__ import annotations

import glob
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import sqlglot
from sqlglot import exp

from ken.engine.ray_data import SiteColumn, parquet_rows, semantic_columns
from ken.errors import SqlError
from ken.sql.execute import arrow_type
from ken.sql.rewrite import Rewritten


def parquet_source(statement: exp.Expression) -> tuple[exp.Table, list[str]]:
    """The one table of ``statement`` that reads Parquet files, and those files."""
    found = []
    for table in statement.find_all(exp.Table):
        node = table.this
        if isinstance(node, exp.ReadParquet):
            paths = [e.this for e in node.expressions if isinstance(e, exp.Literal)]
        elif isinstance(node, exp.Identifier) and node.quoted and node.this.endswith(
                ".parquet"):
            paths = [node.this]
        else:
            continue
        found.append((table, paths))
    if len(found) != 1:
        raise SqlError("engine='ray' runs a query over one Parquet dataset (FROM "
                       "'data/*.parquet' or FROM read_parquet(...)); this query reads "
                       f"{len(found)}")
    table, patterns = found[0]
    files: list[str] = []
    for pattern in patterns:
        p = Path(pattern).expanduser()
        if p.is_dir():
            files += sorted(str(f) for f in p.rglob("*.parquet"))
        else:
            files += sorted(glob.glob(str(p))) or ([str(p)] if p.is_file() else [])
    if not files:
        raise SqlError(f"no Parquet files at {', '.join(patterns)}")
    return table, files


@dataclass(frozen=True)
class RayInputs:
    """What the Ray Data path needs of a query: its Parquet source and files, and per call
    site the columns of the dataset it takes."""

    source: exp.Table
    files: tuple[str, ...]
    columns: tuple[tuple[str, ...], ...]  # per site of the rewritten statement


def ray_inputs(rw: Rewritten, statement: exp.Expression | None = None) -> RayInputs:
    """The source and the columns each call site of ``rw`` takes; a ``SqlError`` saying why
    when the query does not have the shape the Ray Data path runs (module docstring)."""
    source, files = parquet_source(rw.statement if statement is None else statement)
    schema = pq.read_schema(files[0])
    columns = []
    for site in rw.sites:
        inputs = []
        for arg in site.args:
            col = sqlglot.parse_one(arg, read="duckdb")
            names = {source.alias_or_name, source.name}
            if not isinstance(col, exp.Column) or col.name not in schema.names or (
                    col.table and col.table not in names):
                raise SqlError(f"engine='ray' computes semantic calls over columns of the "
                               f"Parquet dataset; {site.call_sql()} takes {arg}, which is not "
                               f"one of its columns ({', '.join(schema.names)})")
            kind = schema.field(col.name).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise SqlError(f"{site.function}() needs text arguments, but "
                               f"{site.call_sql()} passes {col.name} of type {kind}; with "
                               "engine='ray' the arguments are text columns of the dataset")
            inputs.append(col.name)
        columns.append(tuple(inputs))
    return RayInputs(source, tuple(files), tuple(columns))


def ray_choice(rw: Rewritten, min_rows: int | None) -> tuple[bool, str]:
    """Whether ``engine="auto"`` runs ``rw`` on Ray Data, and why (or why not) when its
    dataset is big: it does when the query has the shape the Ray path runs, its dataset holds
    at least ``min_rows`` rows (None: never), Ray is installed and DuckDB could not skip rows
    before the semantic calls. The reason is "" when the dataset is not big (or the query
    reads no single Parquet dataset): nothing worth saying."""
    if min_rows is None or not rw.is_semantic:
        return False, ""
    try:  # the row count first: most datasets are small, and that ends it
        rows = parquet_rows(parquet_source(rw.statement)[1])
        if rows < min_rows:
            return False, ""
        ray_inputs(rw)
    except (SqlError, OSError, pa.ArrowException):
        return False, ""
    if _prunes_first(rw):
        return False, (f"{rows:,} rows, but its WHERE clause lets DuckDB skip rows before the "
                       "semantic calls, which the Ray Data path would run on every row: "
                       "DuckDB (engine='ray' to force it)")
    try:
        import ray  # noqa: F401
    except ImportError:
        return False, (f"{rows:,} rows: big enough for Ray Data, but Ray is not installed "
                       f"(pip install 'ken[ray]'); running it here")
    return True, f"{rows:,} rows >= session.ray_min_rows ({min_rows:,}): semantic step on Ray Data"


def _prunes_first(rw: Rewritten) -> bool:
    """Whether the statement's WHERE clause tests a column outside any semantic call."""
    where = rw.statement.args.get("where")
    if where is None:
        return False
    udfs = {site.udf_name for site in rw.sites}
    for column in where.find_all(exp.Column):
        call = column.find_ancestor(exp.Anonymous)
        while call is not None and str(call.this) not in udfs:
            call = call.find_ancestor(exp.Anonymous)
        if call is None:
            return True
    return False


def run_on_ray(rw: Rewritten, bind: Callable[[str, tuple[str, ...]], Any],
               loaders: Callable[[str], Mapping[str, Callable[[], Any]] | None],
               sql: Callable[[str], pa.Table],
               actors: int = 2, threads: int = 1, block_rows: int = 4096,
               show_progress: bool = True, stall_s: float | None = None) -> pa.Table:
    """Run the rewritten statement ``rw`` with its semantic step on Ray Data (see the module
    docstring). ``bind``: a site's bound operator; ``loaders``: a function's picklable
    model loaders (or None); ``sql``:
    runs plain DuckDB SQL and returns its Arrow table; ``stall_s``: how long the stream may
    make no progress before the query fails (``ken.engine.ray_data.stall_limit_s`` when
    None)."""
    statement = rw.statement.copy()
    found = ray_inputs(rw, statement)
    calls = {s.udf_name: s for s in rw.sites}
    sites = []
    for site, inputs in zip(rw.sites, found.columns, strict=True):
        bound = bind(site.function, site.constants)
        sites.append(SiteColumn.of(f"__ken_{site.label}", list(inputs), bound,
                                   arrow_type(bound.output_type), loaders(site.function)))
    out = tempfile.mkdtemp(prefix="ken-ray-")
    try:
        semantic_columns(list(found.files), sites, out, actors=actors, threads=threads,
                         block_rows=block_rows, show_progress=show_progress, stall_s=stall_s)
        source = found.source
        alias = source.args.get("alias")
        source.replace(exp.Table(this=exp.ReadParquet(expressions=[
            exp.Literal.string(str(Path(out) / "*.parquet"))]), alias=alias))
        for node in list(statement.find_all(exp.Anonymous)):
            site = calls.get(str(node.this))
            if site is not None:
                node.replace(exp.column(f"__ken_{site.label}", quoted=True))
        return sql(statement.sql(dialect="duckdb"))
    finally:
        shutil.rmtree(out, ignore_errors=True)
