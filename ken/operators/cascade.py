"""A model cascade: models tried in order; rows below a stage's certainty threshold escalate.

This module holds only the definition and the escalation rule, shared by the optimizer (which
scores cascades from profiles) and the engine (which runs them on data), so both agree exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from ken.errors import CascadeError
from ken.operators.certainty import CERTAINTY_FUNCTIONS

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

    def to_json(self) -> str:
        return json.dumps({"schema_version": CASCADE_SCHEMA_VERSION, "models": list(self.models),
                           "thresholds": list(self.thresholds), "certainty": self.certainty})

    @classmethod
    def from_json(cls, text: str) -> Cascade:
        data = json.loads(text)
        if data.get("schema_version") != CASCADE_SCHEMA_VERSION:
            raise CascadeError(f"unsupported cascade schema version {data.get('schema_version')}")
        return cls(tuple(data["models"]), tuple(data["thresholds"]), data["certainty"])


def escalates(certainties: np.ndarray, threshold: float) -> np.ndarray:
    """Boolean mask of rows that a stage with ``threshold`` passes on to the next stage."""
    return np.asarray(certainties) < threshold
