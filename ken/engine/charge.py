"""What the simulator charges a batch the engine ran, before calibration (``predicted_s``):
what the calibration compares serving calls with (``ken.engine.calibrate``) and what
``ken.engine.hindsight`` charges the replay's batches again."""

from __future__ import annotations

from ken.engine.supervision import BatchRecord
from ken.errors import KenError
from ken.optimizer.perf import Catalog, sized_runtime


def predicted_s(record: BatchRecord, catalog: Catalog) -> float:
    """What the simulator charges the batch ``record`` before calibration: the profiled
    runtime of its size,
    scaled by its largest row's size where the catalog knows sizes (``Catalog.size_factors``),
    times the model's ``wake`` when its device idled ``WAKE_IDLE_S`` or more before it."""
    if record.model not in catalog.perf:
        raise KenError(f"the engine ran {record.model}, which the catalog has no profile of")
    perf = catalog.perf_on(record.model, record.device)
    return perf.woken(record.idle_before_s) * sized_runtime(
        perf.batch_runtime(record.rows),
        catalog.size_factors(record.model, record.device, record.rows), record.rows,
        record.largest)
