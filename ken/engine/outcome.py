"""What happened to one request, whichever server answered it: the classifier engine
(``serving.Engine``) or a decode server of generating models (``decode.DecodeServer``,
``decode.CascadeServer``). One type and one status vocabulary for every served function, so a
SQL query, a replay or a benchmark reads any server's answers the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ken.models.generation import Generation

#: ``ok``: answered (``value``); ``null``: a NULL input, answered NULL without a model;
#: ``rejected``: admission turned it away (``error`` says why, ``retry_after_s`` when to
#: retry); ``error``: its model call failed (``error``); ``cancelled``: the server shut down
#: before it ran; ``dropped``: it could no longer make its end-to-end deadline, so the engine's
#: dropping policy dropped it (``error`` says where and why: ``ken.engine.deadlines``)
Status = Literal["ok", "null", "rejected", "error", "cancelled", "dropped"]


@dataclass(frozen=True)
class Outcome:
    """One request's answer and its times (seconds on the server's clock)."""

    request_id: int
    status: Status
    arrival_s: float
    completion_s: float
    value: Any = None  # the answer: a label, boolean, number or text (None unless ok)
    certainty: float | None = None
    stage: int | None = None  # 0-based cascade stage that answered
    model: str | None = None
    gear: int | None = None  # the plan's gear when the request was admitted (None: bulk)
    error: str | None = None
    retry_after_s: float | None = None  # rejected: when a retry may be admitted
    first_token_s: float | None = None  # generating models: the answer's first token
    generation: Generation | None = None  # generating models: tokens and log-probabilities

    @property
    def latency_s(self) -> float:
        return self.completion_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        """Time to the first token (generating models; None otherwise)."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s
