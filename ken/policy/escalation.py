"""The cascade rule of a plan's gears, shared by every dispatcher.

A stage passes a row on when the row's certainty is below the stage's threshold (the rule is
``ken.models.cascade.escalates_row``); the last stage resolves everything. Classifier gear
plans (``ken.policy.scheduling.Dispatcher``) and generation plans
(``ken.policy.generating.GenDispatcher``) escalate by this one class.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from ken.models.cascade import Cascade, escalates_row


class HasCascades(Protocol):
    """Any plan: a cascade per gear."""

    @property
    def cascades(self) -> Sequence[Cascade]: ...


class Escalation:
    """Per cascade: the threshold below which a stage passes a row on (-inf at the last stage,
    so the last stage resolves everything). The rule is ``ken.models.cascade.escalates``.
    Shared by the gear plans' ``Dispatcher`` and the generation plans' ``GenDispatcher``
    (``plan.cascades``: a cascade per gear)."""

    def __init__(self, plan: HasCascades) -> None:
        self.thresholds = [(*c.thresholds, -math.inf) for c in plan.cascades]
        self.models = [c.models for c in plan.cascades]

    def escalates(self, cascade: int, stage: int, certainty: float) -> bool:
        return escalates_row(certainty, self.thresholds[cascade][stage])
