"""The bulk path of the online engine: rows of an analytical query (``submit_many(...,
bulk=True)``) run the lowest-load cascade (the most accurate gear) of the plan active when
they arrived, in throughput-sized batches on devices the online queues leave idle, escalated
by that plan's dispatcher rule. They are not metered, so they never move the gear."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from ken.models.certainty import certainty_of
from ken.policy.scheduling import Dispatcher


@dataclass(frozen=True, eq=False)
class BulkBatch:
    """A throughput batch of bulk rows on one device (not the dispatcher's)."""

    model: str
    devices: tuple[str, ...]
    request_ids: tuple[int, ...]


@dataclass(frozen=True)
class BulkAnswer:
    """A bulk row answered: its value, certainty and the 0-based stage that answered."""

    request_id: int
    value: object
    certainty: float
    stage: int


class BulkRows:
    """Bulk rows waiting per model and where each is in its cascade."""

    def __init__(self) -> None:
        # rid -> (dispatcher of the plan active when it arrived, cascade index, stage)
        self._rows: dict[int, tuple[Dispatcher, int, int]] = {}
        self._queue: dict[str, deque[int]] = {}  # model -> waiting bulk rows

    def enqueue(self, rid: int, disp: Dispatcher, cascade: int, stage: int) -> None:
        self._rows[rid] = (disp, cascade, stage)
        model = disp.escalation.models[cascade][stage]
        self._queue.setdefault(model, deque()).append(rid)

    def arrive(self, disp: Dispatcher, rids: Sequence[int]) -> None:
        """New bulk rows for ``disp``'s plan: its lowest-load cascade, first stage."""
        cascade = disp.plan.ranges[0].cascade
        for rid in rids:
            self.enqueue(rid, disp, cascade, 0)

    def batches(self, devices_of: Callable[[str], list[str]], busy: set[str],
                batch_size: int, away: Collection[str] = ()) -> list[BulkBatch]:
        """Batches of up to ``batch_size`` waiting rows, one per idle device that hosts their
        model (``devices_of``) and is not ``away`` (reloading); their devices are added to
        ``busy``."""
        out = []
        for model, q in self._queue.items():
            for device in devices_of(model):
                if not q:
                    break
                if device in busy or device in away:
                    continue
                ids = tuple(q.popleft() for _ in range(min(len(q), batch_size)))
                busy.add(device)
                out.append(BulkBatch(model, (device,), ids))
        return out

    def finished(self, batch: BulkBatch, values: list, scores: np.ndarray) -> list[BulkAnswer]:
        """A batch ran: its rows that are certain enough, answered; the others queued on
        their cascade's next stage."""
        answers = []
        certs: dict[str, np.ndarray] = {}  # certainty kind -> this batch's certainties
        for j, rid in enumerate(batch.request_ids):
            disp, cascade, stage = self._rows[rid]
            kind = disp.plan.certainty
            if kind not in certs:
                certs[kind] = certainty_of(scores, kind)
            cert = float(certs[kind][j])
            if disp.escalation.escalates(cascade, stage, cert):  # the dispatcher's rule
                self.enqueue(rid, disp, cascade, stage + 1)
                continue
            del self._rows[rid]
            answers.append(BulkAnswer(rid, values[j], cert, stage))
        return answers

    def failed(self, batch: BulkBatch) -> None:
        """A batch failed for good: its rows leave."""
        for rid in batch.request_ids:
            self._rows.pop(rid, None)

    def clear(self) -> None:
        self._queue.clear()
        self._rows.clear()
