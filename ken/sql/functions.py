"""Semantic SQL functions: what a name means, how many arguments it takes, how it is bound.

A ``SemanticFunction`` is registered on a session under a SQL name. At each call site its
trailing constant arguments (e.g. the predicate of ``sem_filter``) are bound, giving a
``Bound`` operator: a cascade plus the models that run it and how labels become SQL values.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ken.errors import KenError
from ken.operators.cascade import Cascade
from ken.operators.model import Model

SQL_TYPES = {"varchar": "VARCHAR", "boolean": "BOOLEAN"}


class Bound(Protocol):
    """A semantic operator bound to its constant arguments, ready to run on columns."""

    function: str
    cascade: Cascade
    models: Mapping[str, Model]
    output_type: str  # "varchar" | "boolean"

    def describe(self) -> str: ...

    def to_sql_values(self, labels: Sequence[str | None]) -> list[Any]: ...


@dataclass(frozen=True)
class ClassifierBinding:
    """A classification cascade whose labels are the SQL values (e.g. ``sentiment``)."""

    function: str
    cascade: Cascade
    models: Mapping[str, Model]
    output_type: str = "varchar"
    calibrated: bool = True
    stage_fractions: tuple[float, ...] | None = None  # expected, from the profile
    expected_accuracy: float | None = None

    def describe(self) -> str:
        text = f"cascade {self.cascade.describe()} [{self.cascade.certainty}]"
        if self.expected_accuracy is not None:
            text += f", profiled accuracy {self.expected_accuracy:.1%}"
        return text

    def to_sql_values(self, labels: Sequence[str | None]) -> list[Any]:
        return list(labels)


@dataclass(frozen=True)
class SemanticFunction:
    """A SQL-callable semantic operator.

    ``num_columns`` text arguments come first, then ``constants`` (names of string-literal
    arguments, bound per call site). ``bind(constants)`` returns the runnable operator.
    """

    name: str
    num_columns: int
    constants: tuple[str, ...]
    output_type: str
    bind: Callable[[tuple[str, ...]], Bound]
    doc: str = ""

    def __post_init__(self) -> None:
        if self.output_type not in SQL_TYPES:
            raise KenError(f"output type must be one of {sorted(SQL_TYPES)}")
        if not self.name.isidentifier():
            raise KenError(f"{self.name!r} is not a valid SQL function name")

    @property
    def arity(self) -> int:
        return self.num_columns + len(self.constants)

    def signature(self) -> str:
        args = [f"text{i + 1}" if self.num_columns > 1 else "text"
                for i in range(self.num_columns)]
        args += [f"'{c}'" for c in self.constants]
        return f"{self.name}({', '.join(args)}) -> {SQL_TYPES[self.output_type]}"


def suggest(name: str, candidates: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest candidate, or nothing."""
    close = difflib.get_close_matches(name.lower(), sorted(set(candidates)), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""
