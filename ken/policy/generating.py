"""Gear plans of generating operators: cascades of causal LMs picked by load in forward passes.

Shared by the simulator (``ken.optimizer.gen_sim``) and the online engine's decode server
(``ken.engine.decode``): the same rules on a virtual or a wall clock.

A *load-gear plan* (``GenPlan``) lists cascades of generating models, most accurate first, each
with the load up to which it serves. **Load** is what the forward passes still have to serve:
the requests admitted and not yet answered, running or queued, at any stage. Generation time
grows with the tokens each request generates, so a request rate says little about how busy a
decode server is; the requests in the system say it directly (Little's law: load = rate x time
in system).

- ``GenDispatcher.admit`` picks the gear for a new request from the load at that moment (a
  cheaper gear as soon as the load reaches its edge; back to a more accurate one only once the
  load has fallen below ``hysteresis`` x that gear's edge) and returns its first model;
- ``GenDispatcher.finished`` takes the certainty of a stage's answer and returns the next
  model of the request's cascade, or None when the answer stands (the escalation rule is
  ``ken.models.cascade.escalates_row``).

One decode server hosts every model of the plan on its device, one *lane* per model (its own
``DecodeScheduler`` and KV cache). ``pick_lane`` says which lane runs the next forward pass:
the one holding the request that came to the operator first (an escalated request keeps its
arrival time, so it does not wait behind newer ones).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ken.errors import PolicyError
from ken.policy.escalation import Escalation
from ken.policy.plan import GenPlan


class GenDispatcher:
    """Gear choice and escalation of one ``GenPlan`` (see the module docstring)."""

    def __init__(self, plan: GenPlan) -> None:
        self.plan = plan
        self._edges = [g.max_load for g in plan.gears]
        self._escalation = Escalation(plan)
        self.current = 0
        self.switches: list[tuple[float, int, int]] = []  # (time, from gear, to gear)
        self._gear: dict[int, int] = {}
        self._stage: dict[int, int] = {}

    @property
    def load(self) -> int:
        """Requests admitted and not yet answered (running or queued, at any stage)."""
        return len(self._stage)

    def gear_of(self, request_id: int) -> int:
        return self._gear[request_id]

    def stage_of(self, request_id: int) -> int:
        return self._stage[request_id]

    def _choose(self, load: int) -> int:
        target = next(k for k, e in enumerate(self._edges) if load < e)
        cur = self.current
        if target >= cur:
            return target
        # back towards accuracy only once the load fell well below that gear's edge
        for k in range(target, cur):
            if load < self.plan.hysteresis * self._edges[k]:
                return k
        return cur

    def admit(self, request_id: int, now: float, gear: int | None = None) -> str:
        """A new request: choose the gear from the load (or take ``gear``, e.g. bulk rows
        served by the most accurate gear: the current gear stays), return its first model."""
        if request_id in self._stage:
            raise PolicyError(f"request {request_id} was already admitted")
        if gear is None:
            gear = self._choose(len(self._stage))
            if gear != self.current:
                self.switches.append((now, self.current, gear))
                self.current = gear
        self._gear[request_id] = gear
        self._stage[request_id] = 0
        return self._escalation.models[gear][0]

    def finished(self, request_id: int, certainty: float) -> str | None:
        """A stage answered with ``certainty``: the next model, or None (answered)."""
        try:
            gear, stage = self._gear[request_id], self._stage[request_id]
        except KeyError:
            raise PolicyError(f"request {request_id} is not in flight") from None
        if self._escalation.escalates(gear, stage, certainty):
            self._stage[request_id] = stage + 1
            return self._escalation.models[gear][stage + 1]
        self.drop(request_id)
        return None

    def drop(self, request_id: int) -> None:
        """The request left (answered, or its pass failed)."""
        self._stage.pop(request_id, None)
        self._gear.pop(request_id, None)


def pick_lane(oldest_arrivals: Sequence[float | None]) -> int | None:
    """The lane whose next pass serves the request that arrived first (None: all idle)."""
    best, best_t = None, math.inf
    for k, t in enumerate(oldest_arrivals):
        if t is not None and t < best_t:
            best, best_t = k, t
    return best
