"""Batch execution of a cascade over an Arrow column.

Stage 1 runs on every non-NULL row in batches (values of any type, one certainty per row);
rows whose certainty is below the stage threshold escalate to the next stage; every row's
output comes back in input order. NULL input gives NULL output and never reaches a model.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ken.errors import CascadeError, DataError
from ken.models.cascade import Cascade
from ken.models.model import Model


@dataclass(frozen=True)
class StageStats:
    """What one cascade stage did during a run."""

    model: str
    input_rows: int
    resolved_rows: int
    num_batches: int
    seconds: float


@dataclass(frozen=True, eq=False)
class CascadeResult:
    """Per-row outputs of a cascade run (input order) and per-stage statistics.

    ``values`` are the models' values (labels of classifiers, or any value type), ``None``
    where the input was NULL.
    """

    values: list = field(repr=False)
    certainty: np.ndarray = field(repr=False)  # float64 of the resolving stage, NaN for NULL
    stage: np.ndarray = field(repr=False)  # int64 resolving stage (0-based), -1 for NULL
    stages: tuple[StageStats, ...]

    @property
    def num_rows(self) -> int:
        return int(self.stage.shape[0])


def text_column(column: pa.Array | pa.ChunkedArray | Sequence[str | None], name: str = "input"
                ) -> pa.Array:
    """The input as one Arrow string array; anything that is not text is a ``DataError``."""
    if not isinstance(column, pa.Array | pa.ChunkedArray):
        try:
            column = pa.array(list(column))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
            raise DataError(f"column {name!r} cannot be read as text: {exc}") from None
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks else pa.array([], pa.string())
    kind = column.type
    if pa.types.is_null(kind):
        return pa.nulls(len(column), pa.string())
    if pa.types.is_dictionary(kind) and pa.types.is_string(kind.value_type):
        return column.cast(pa.string())
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or (
        hasattr(pa.types, "is_string_view") and pa.types.is_string_view(kind)
    ):
        return column
    raise DataError(
        f"semantic functions need a text column, but {name!r} has type {kind}; "
        f"cast it first, e.g. CAST({name} AS VARCHAR)"
    )


def run_cascade(cascade: Cascade, models: Mapping[str, Model],
                column: pa.Array | pa.ChunkedArray | Sequence,
                batch_size: int = 32, name: str = "input") -> CascadeResult:
    """Run ``cascade`` on every row of a text column, in batches, returning outputs in order.

    For pair models (``spec.num_inputs == 2``) ``column`` is a list of two text columns.

    >>> # result = run_cascade(Cascade(("minilm-l3", "minilm-l6"), (0.8,)), models, table["text"])
    """
    if batch_size < 1:
        raise CascadeError(f"batch size must be at least 1, got {batch_size}")
    missing = [m for m in cascade.models if m not in models]
    if missing:
        raise CascadeError(f"cascade uses {missing} but only {sorted(models)} are loaded")
    label_names = models[cascade.models[0]].spec.labels
    for m in cascade.models[1:]:  # a classifier cascade's stages must agree on the labels
        if models[m].spec.labels != label_names:
            raise CascadeError(f"models of a cascade must predict the same labels: {m} predicts "
                               f"{models[m].spec.labels}, {cascade.models[0]} {label_names}")
    arity = models[cascade.models[0]].spec.num_inputs
    if any(models[m].spec.num_inputs != arity for m in cascade.models):
        raise CascadeError("models of a cascade must take the same number of inputs per row")
    if arity == 1:
        columns = [text_column(column, name)]
    else:
        if not isinstance(column, list | tuple) or len(column) != arity:
            raise CascadeError(f"{cascade.models[0]} takes {arity} text columns per row")
        columns = [text_column(c, f"{name}[{i}]") for i, c in enumerate(column)]
        if len({len(c) for c in columns}) != 1:
            raise DataError(f"the {arity} input columns of {name!r} differ in length")
    n = len(columns[0])
    out: list = [None] * n
    certainty = np.full(n, np.nan)
    stage = np.full(n, -1, dtype=np.int64)
    valid = np.ones(n, bool)
    for c in columns:  # a row with any NULL argument is NULL
        valid &= c.is_valid().to_numpy(zero_copy_only=False) if n else np.zeros(0, bool)
    pending = np.flatnonzero(valid)
    values = (columns[0].to_pylist() if arity == 1
              else list(zip(*(c.to_pylist() for c in columns), strict=True)))
    stats: list[StageStats] = []
    for i, model_name in enumerate(cascade.models):
        if not len(pending):
            stats.append(StageStats(model_name, 0, 0, 0, 0.0))
            continue
        started = time.perf_counter()
        prediction = models[model_name].predict([values[j] for j in pending], batch_size)
        seconds = time.perf_counter() - started
        sure = prediction.certainty(cascade.certainty)
        answers = prediction.values
        if len(answers) != len(pending) or sure.shape[0] != len(pending):
            raise CascadeError(f"{model_name} returned {len(answers)} values for "
                               f"{len(pending)} rows")
        up = cascade.escalates(i, sure)
        done = pending[~up]
        for j in np.flatnonzero(~up).tolist():
            out[pending[j]] = answers[j]
        certainty[done] = sure[~up]
        stage[done] = i
        stats.append(StageStats(model_name, len(pending), len(done),
                                -(-len(pending) // batch_size), seconds))
        pending = pending[up]
    return CascadeResult(out, certainty, stage, tuple(stats))
