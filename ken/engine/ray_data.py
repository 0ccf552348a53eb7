"""Semantic columns of a big table through Ray Data (DESIGN.md section 13; issue 20, item 4).

``semantic_columns`` streams a Parquet dataset through Ray Data: ``read_parquet`` -> one
``map_batches`` whose callable (``CascadeColumns``, a class: Ray keeps one instance per actor,
so each actor loads its models once) appends one column per semantic call site, computed by
the site's cascade on the block's rows -> ``write_parquet`` into a folder. Blocks stream
through a bounded number of actors, so memory stays bounded whatever the table's size; the
relational part of the query then runs on DuckDB over that folder (``ken.sql.ray_query``).

A site's values are those of the in-process path: the same bound cascade (``run_cascade``),
the same conversion to SQL values, NULL for a row with a NULL argument, each distinct input of
a block answered once.

A stream that stops moving fails: when no block is read, answered or written for
:func:`stall_limit_s` (ten times what a block is expected to take by the cascades' profiles,
at least :data:`STALL_FLOOR_S`; without a profile, Ray Data's own setting, 30 minutes unless
``RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S`` says otherwise), Ray Data's no-progress guard
ends the execution and the query fails with an ``EngineError`` saying so, e.g. when a node was
lost and the nodes left have too few CPUs for the actors (Ray Data would otherwise wait for
capacity to come back; an autoscaling cluster that takes longer than the limit to add a node
needs a larger ``session.ray_stall_s``).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ken.engine.batch import run_cascade
from ken.engine.ray_runner import ensure_ray, ray_error_cause
from ken.engine.workers import load_models
from ken.errors import EngineError
from ken.models.model import Model

#: the least time without progress before a Ray Data stream fails (an actor loads its models
#: before its first block is answered)
STALL_FLOOR_S = 300.0
#: a stream fails after this many times a block's expected time without progress
STALL_FACTOR = 10.0


@dataclass(frozen=True)
class SiteColumn:
    """One call site computed as a column: ``column`` = function(``inputs`` columns).

    ``bound`` is the operator bound to the site's constants (pickled without its models when
    ``loaders`` can load them in the actor, with them otherwise)."""

    column: str
    inputs: tuple[str, ...]
    bound: Any
    arrow_type: pa.DataType
    loaders: Mapping[str, Callable[[], Model]] | None = None

    @classmethod
    def of(cls, column: str, inputs: Sequence[str], bound: Any, arrow_type: pa.DataType,
           loaders: Mapping[str, Callable[[], Model]] | None) -> SiteColumn:
        """Ship loaders instead of loaded models where they cover the cascade's models."""
        needed = set(bound.cascade.models)
        if loaders and needed <= set(loaders) and dataclasses.is_dataclass(bound):
            return cls(column, tuple(inputs), dataclasses.replace(bound, models={}),
                       arrow_type, {m: loaders[m] for m in needed})
        return cls(column, tuple(inputs), bound, arrow_type, None)


class CascadeColumns:
    """The Ray Data callable: one instance per actor (models loaded once), called per block."""

    def __init__(self, raw_sites: bytes, batch_size: int, threads: int,
                 sys_path: Sequence[str] = (), driver_pid: int | None = None) -> None:
        sys.path[:0] = [p for p in sys_path if p not in sys.path]  # the driver's imports
        self.sites: list[SiteColumn] = pickle.loads(raw_sites)
        self.batch_size = batch_size
        self.models: list[Mapping[str, Model]] = []
        for site in self.sites:
            if site.loaders is None:
                self.models.append(site.bound.models)
            else:
                loaded: dict[str, Model] = {}
                load_models(site.loaders, loaded, threads, driver_pid)
                self.models.append(loaded)

    def __call__(self, block: pa.Table) -> pa.Table:
        for site, models in zip(self.sites, self.models, strict=True):
            columns = [block.column(c).to_pylist() for c in site.inputs]
            keys: list[Any] = (columns[0] if len(columns) == 1
                               else [None if any(v is None for v in row) else row
                                     for row in zip(*columns, strict=True)])
            distinct = list(dict.fromkeys(k for k in keys if k is not None))
            answers: dict[Any, Any] = {}
            if distinct:
                column: Any = (pa.array(distinct, pa.string()) if len(columns) == 1 else
                               [pa.array([k[i] for k in distinct], pa.string())
                                for i in range(len(columns))])
                result = run_cascade(site.bound.cascade, models, column, self.batch_size,
                                     name=site.column)
                answers = dict(zip(distinct, site.bound.to_sql_values(result.values),
                                   strict=True))
            values = [None if k is None else answers[k] for k in keys]
            block = block.append_column(site.column, pa.array(values, site.arrow_type))
        return block


def stall_limit_s(sites: Sequence[SiteColumn], block_rows: int) -> float | None:
    """How long a stream may go without progress before it fails: :data:`STALL_FACTOR` times
    a block's expected model time (each site's profiled ``cost_ms_per_row`` times
    ``block_rows``), at least :data:`STALL_FLOOR_S`; None (Ray Data's own setting) when a
    site's cascade has no profile. The profile is the session's device's: actors on slower
    CPUs than it need a larger ``session.ray_stall_s``."""
    costs = [getattr(site.bound, "cost_ms_per_row", None) for site in sites]
    if not costs or any(c is None for c in costs):
        return None
    block_s = block_rows * sum(costs) / 1000.0
    return max(STALL_FLOOR_S, STALL_FACTOR * block_s)


def semantic_columns(source: str | Sequence[str], sites: Sequence[SiteColumn], out_dir: str,
                     actors: int = 2, threads: int = 1, block_rows: int = 4096,
                     batch_size: int = 32, columns: Sequence[str] | None = None,
                     show_progress: bool = True, stall_s: float | None = None) -> int:
    """Stream the Parquet ``source`` (paths or a glob) through ``actors`` Ray actors of
    ``threads`` torch threads each (asking Ray for at most that many CPUs, leaving one of
    the cluster's CPUs to Ray Data's own tasks), appending one column per site in blocks of
    ``block_rows`` rows, and write the result as Parquet files into ``out_dir`` (in the
    source's row order). ``columns``: the source columns to keep (default all).

    ``stall_s``: fail with an ``EngineError`` when no block moves for this long (default
    :func:`stall_limit_s`; ``float("inf")``: never)."""
    if actors < 1 or threads < 1 or block_rows < 1:
        raise EngineError("semantic_columns needs actors, threads and block_rows >= 1")
    if stall_s is not None and not (isinstance(stall_s, (int, float)) and stall_s > 0):
        raise EngineError(f"a Ray Data stall limit (session.ray_stall_s) must be a number of "
                          f"seconds above 0, or None; got {stall_s!r}")
    stall = stall_limit_s(sites, block_rows) if stall_s is None else float(stall_s)
    ray = ensure_ray()
    # the actors share the cluster's CPUs but one: Ray Data's own tasks (listing files,
    # reading, writing) need a CPU too, and a stream whose reads wait behind its actors stalls
    cpus = float(ray.cluster_resources().get("CPU", 0))
    per_actor = max(min(float(threads), (cpus - 1) / actors), 0.0)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # results in the table's order
    ctx.enable_progress_bars = show_progress
    paths = [source] if isinstance(source, str) else list(source)
    ds = ray.data.read_parquet(paths, columns=None if columns is None else list(columns))
    ds = ds.map_batches(CascadeColumns, fn_constructor_args=(pickle.dumps(list(sites)),
                                                              batch_size, threads, sys.path,
                                                              os.getpid()),
                        batch_format="pyarrow", batch_size=block_rows,
                        compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=per_actor)
    from ray.data.exceptions import ExecutionTimeoutError  # Ray >= 2.60 (ken[ray])

    if stall is not None:  # this dataset's context (Ray Data copies it per dataset)
        ds.context.execution_no_progress_timeout_s = stall
    try:
        ds.write_parquet(out_dir)
    except ExecutionTimeoutError as exc:
        waited = ds.context.execution_no_progress_timeout_s
        first = (str(exc).strip().splitlines() or [""])[0]
        raise EngineError(
            f"the semantic step on Ray Data made no progress for {waited:g} s (no block was "
            f"read, answered or written) and was stopped; nothing was returned. The cluster "
            f"may have too few CPUs left for its {actors} actor(s) of {per_actor:g} CPUs (a "
            f"node lost?): add nodes or lower session.ray_actors, or, if one block of "
            f"{block_rows} rows takes longer than that, raise session.ray_stall_s. Ray Data: "
            f"{first}") from None
    except ray.exceptions.RayError as exc:
        if _node_died(exc):
            raise EngineError(
                "the semantic step on Ray Data failed: a Ray node died while it ran, and Ray "
                "could not run that node's work again on the nodes left (an actor or task of "
                "Ray Data's own that is not restarted); nothing was returned: run the query "
                "again") from None
        raise EngineError(f"the semantic step on Ray Data failed: {ray_error_cause(exc)}") from None
    expected = parquet_rows(paths)
    files = _parquet_files(out_dir)
    rows = parquet_rows(files)
    if rows != expected:  # e.g. files written on another node, out of this folder's reach
        raise EngineError(
            f"the semantic step on Ray Data wrote {rows} of {expected} rows into {out_dir}; "
            "on a cluster of several nodes the folder must be shared storage that every "
            "node writes to")
    if not files:  # an empty dataset: an empty file with the right columns
        schema = pq.read_schema(paths[0])
        for site in sites:
            schema = schema.append(pa.field(site.column, site.arrow_type))
        pq.write_table(schema.empty_table(), f"{out_dir}/empty.parquet")
    return rows


def _node_died(exc: BaseException) -> bool:
    """Whether a Ray error comes from a node that died (its text names the cause: Ray wraps
    the actor's or task's death in errors it cannot always deserialize)."""
    text = str(exc)
    return any(marker in text for marker in ("node has died", "NodeDiedError",
                                             "node was terminated unexpectedly"))


def parquet_rows(files: Sequence[str]) -> int:
    """Rows of the Parquet ``files``, from their footers (no data is read)."""
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def _parquet_files(folder: str) -> list[str]:
    return sorted(str(p) for p in Path(folder).glob("*.parquet"))
