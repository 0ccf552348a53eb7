"""``is_urgent(text) -> BOOLEAN``: does a support ticket need an answer today?

The example operator of docs/adding-an-operator.md: two keyword classifiers, the cheap one
first, and a labelled sample of tickets to plan them on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ken.models.model import BOOLEAN_LABELS, DeviceConfig, Model, ModelSpec, Prediction
from ken.models.quality import EvalSample
from ken.models.resources import Resources
from ken.ops.base import OpContext, Operator, Stage

FEW = ("urgent", "asap", "outage")
MANY = (*FEW, "down", "cannot", "broken", "immediately", "today")

TICKETS = (
    "URGENT: checkout is down for every customer", "outage in eu-west, asap please",
    "the app is broken and we cannot log in", "please fix this today, payments fail",
    "invoices cannot be downloaded", "dashboard broken since the update",
    "how do I change my avatar?", "thanks for the quick reply last week",
    "feature request: dark mode", "can you add CSV export some time?",
    "typo on the pricing page", "is there a student discount?",
)
URGENT = (True, True, True, True, True, False, False, False, False, False, False, False)


class KeywordModel(Model):
    """``P(urgent)`` from how many of ``words`` a ticket has: none means no (0.88), one is a
    guess (0.73), two or more mean yes (0.98)."""

    def __init__(self, name: str, words: tuple[str, ...], device: DeviceConfig) -> None:
        self.words = words
        self.device = device
        self.spec = ModelSpec(name, family="urgent", backend="python", source="keywords",
                              num_params=len(words), memory_bytes=1 << 20, max_tokens=256,
                              labels=BOOLEAN_LABELS, fingerprint=f"{name}-{'|'.join(words)}")

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        hits = np.array([sum(w in t.lower() for w in self.words) for t in texts], dtype=float)
        p_true = 1.0 / (1.0 + np.exp(2.0 - 3.0 * hits))
        probs = np.stack([1.0 - p_true, p_true], axis=1).astype(np.float32).reshape(-1, 2)
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, BOOLEAN_LABELS)


def load_keywords(resources: Resources, device: DeviceConfig, name: str,
                  words: tuple[str, ...]) -> Model:
    """A stage's load: module-level, plain arguments, so worker processes can build it."""
    return KeywordModel(name, words, device)


class IsUrgent(Operator):
    name = "is_urgent"
    num_columns = 1
    constants = ()
    output_type = "boolean"
    doc = "does a support ticket need an answer today"
    threshold = 0.8  # one keyword (certainty 0.73) escalates to the second stage

    def stages(self, ctx: OpContext, constants: tuple[str, ...]) -> list[Stage]:
        return [Stage("urgent-few", load_keywords, ("urgent-few", FEW)),
                Stage("urgent-many", load_keywords, ("urgent-many", MANY))]

    def eval_sample(self, ctx: OpContext) -> EvalSample:
        return EvalSample("tickets", TICKETS, URGENT, "balanced_accuracy")

    def plannable(self) -> bool:
        return True

    def eval_description(self) -> str:
        return f"{len(TICKETS)} hand-labelled tickets, balanced accuracy"


OPERATOR = IsUrgent
