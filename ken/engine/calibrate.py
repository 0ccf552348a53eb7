"""Calibrating the simulator's runtimes to what serving measures (issue 5, fidelity).

Profiles time each model back to back, alone, in the profiling process. Serving differs: the
engine's calls include the worker round trip, a device may have idled before a call (cold
caches), the devices and the engine share the machine's cores and memory bandwidth, and a
single tweet's runtime depends on its length. ``runtime_spread`` measures the ratio *serving
call / profiled runtime of that batch size* for every model call an engine made, and
``calibrated`` puts that empirical distribution into the catalog (``ModelPerf.spread``): the
simulator then draws one factor per batch.

Calibrate on one workload, predict another: ``benchmarks/fidelity.py`` calibrates on Poisson
arrivals and compares on the Azure trace.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from ken.engine.supervision import BatchRecord
from ken.errors import KenError
from ken.optimizer.perf import Catalog, ModelPerf


def runtime_ratios(log: Iterable[BatchRecord], catalog: Catalog, include_bulk: bool = False
                   ) -> dict[str, list[tuple[BatchRecord, float]]]:
    """Per model: every model call with its ratio measured / profiled runtime of that size."""
    out: dict[str, list[tuple[BatchRecord, float]]] = {}
    for r in log:
        if r.bulk and not include_bulk:
            continue
        if r.model not in catalog.perf:
            raise KenError(f"the engine ran {r.model}, which the catalog has no profile of")
        profiled = catalog.perf_on(r.model, r.device).batch_runtime(r.rows)
        out.setdefault(r.model, []).append((r, r.seconds / profiled))
    return out


def runtime_spread(log: Iterable[BatchRecord], catalog: Catalog, points: int = 101,
                   include_bulk: bool = False) -> dict[str, tuple[float, ...]]:
    """Per model: the measured / profiled runtime ratio as ``points`` equally likely values
    (the quantile at the middle of each of ``points`` equal-mass bins, so drawing one
    uniformly reproduces the distribution; the single worst call is not given 1/points)."""
    ratios = {m: [x for _, x in calls]
              for m, calls in runtime_ratios(log, catalog, include_bulk).items()}
    qs = (np.arange(points) + 0.5) * 100.0 / points
    return {m: tuple(float(x) for x in np.percentile(v, qs)) for m, v in ratios.items()}


def calibrated(catalog: Catalog, spreads: Mapping[str, tuple[float, ...]]) -> Catalog:
    """``catalog`` with each model in ``spreads`` given that runtime distribution."""
    unknown = sorted(set(spreads) - set(catalog.perf))
    if unknown:
        raise KenError(f"the calibration covers {unknown}, which the catalog does not have "
                       f"({', '.join(catalog.models)})")
    def spread(perf: Mapping[str, ModelPerf]) -> dict[str, ModelPerf]:
        return {m: ModelPerf(m, p.batch_sizes, p.runtime_s, p.memory_bytes, p.degrees,
                             spreads.get(m, p.spread)) for m, p in perf.items()}

    return catalog.with_perf(spread(catalog.perf), spread(catalog.gpu_perf))


CALIBRATION_KIND = "ken-runtime-calibration"


def save_spreads(spreads: Mapping[str, tuple[float, ...]], path: str | Path,
                 source: str = "") -> Path:
    """Write runtime spreads as JSON (``ken replay`` writes ``calibration.json``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kind": CALIBRATION_KIND, "version": 1, "source": source,
                                "spreads": {m: list(v) for m, v in spreads.items()}}, indent=1))
    return path


def load_spreads(path: str | Path) -> dict[str, tuple[float, ...]]:
    """Read a calibration file written by ``save_spreads``."""
    path = Path(path)
    if not path.is_file():
        raise KenError(f"no calibration file at {path}; `ken replay` writes one "
                       "(ken-replay/calibration.json)")
    try:
        data = json.loads(path.read_text())
        if data.get("kind") != CALIBRATION_KIND:
            raise ValueError(f"kind is {data.get('kind')!r}")
        spreads = {str(m): tuple(float(f) for f in v) for m, v in data["spreads"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KenError(f"{path} is not a runtime calibration file: {exc}") from None
    bad = [m for m, v in spreads.items() if not v or not all(np.isfinite(f) and f > 0
                                                             for f in v)]
    if bad:
        raise KenError(f"{path}: the runtime factors of {bad} must be positive numbers")
    return spreads
