"""A model cascade: models tried in order; rows below a stage's certainty threshold escalate.

This module holds only the definition and the escalation rule, shared by the optimizer (which
scores cascades from profiles) and the engine (which runs them on data), so both agree exactly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ken.errors import CascadeError
from ken.models.certainty import CERTAINTY_FUNCTIONS

CASCADE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Cascade:
    """Models ``m1..mk`` and thresholds ``t1..t(k-1)``.

    Stage ``i`` resolves a row when its certainty is ``>= thresholds[i]``; otherwise the row goes
    to stage ``i + 1``. The last stage resolves every row that reaches it.
    """

    models: tuple[str, ...]
    thresholds: tuple[float, ...] = ()
    certainty: str = "max_prob"

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "thresholds", tuple(float(t) for t in self.thresholds))
        if not self.models:
            raise CascadeError("a cascade needs at least one model")
        if len(set(self.models)) != len(self.models):
            raise CascadeError(f"a cascade uses each model at most once: {self.models}")
        if len(self.thresholds) != len(self.models) - 1:
            raise CascadeError(
                f"a cascade of {len(self.models)} models needs {len(self.models) - 1} "
                f"thresholds, got {len(self.thresholds)}"
            )
        if any(math.isnan(t) for t in self.thresholds):
            raise CascadeError("cascade thresholds must not be NaN")
        if self.certainty not in CERTAINTY_FUNCTIONS:
            known = ", ".join(sorted(CERTAINTY_FUNCTIONS))
            raise CascadeError(f"unknown certainty {self.certainty!r}; use one of: {known}")

    @property
    def num_stages(self) -> int:
        return len(self.models)

    def describe(self) -> str:
        """``L3 -(0.80)-> L6 -(0.71)-> SmolLM2``."""
        parts = [self.models[0]]
        for threshold, model in zip(self.thresholds, self.models[1:], strict=True):
            parts.append(f"-({threshold:.3f})-> {model}")
        return " ".join(parts)

    def escalates(self, stage: int, certainties: np.ndarray | Sequence[float]) -> np.ndarray:
        """Boolean mask of the rows that ``stage`` (0-based) passes on to the next stage:
        certainty below the stage's threshold; the last stage passes nothing on. The one
        escalation rule of the system: batch execution, the cascade search, the catalog, the
        simulator and the online engine all call it."""
        c = np.asarray(certainties, dtype=np.float64)
        if stage >= len(self.thresholds):
            return np.zeros(c.shape, dtype=bool)
        return c < self.thresholds[stage]

    def to_json(self) -> str:
        return json.dumps({"schema_version": CASCADE_SCHEMA_VERSION, "models": list(self.models),
                           "thresholds": list(self.thresholds), "certainty": self.certainty})

    @classmethod
    def from_json(cls, text: str) -> Cascade:
        data = json.loads(text)
        if data.get("schema_version") != CASCADE_SCHEMA_VERSION:
            raise CascadeError(f"unsupported cascade schema version {data.get('schema_version')}")
        return cls(tuple(data["models"]), tuple(data["thresholds"]), data["certainty"])


def escalates_row(certainty: float, threshold: float) -> bool:
    """Whether a stage with ``threshold`` passes a row of ``certainty`` on: the escalation
    rule, for one row (the dispatcher's per-row loop); :func:`escalates` is its array form."""
    return certainty < threshold


def escalates(certainties: np.ndarray, threshold: float) -> np.ndarray:
    """Boolean mask of rows that a stage with ``threshold`` passes on to the next stage
    (:meth:`Cascade.escalates` for a stage of a cascade)."""
    return np.asarray(certainties, dtype=np.float64) < threshold
