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

from collections.abc import Iterable, Mapping

import numpy as np

from ken.engine.serving import BatchRecord
from ken.errors import KenError
from ken.optimizer.perf import Catalog, ModelPerf


def runtime_spread(log: Iterable[BatchRecord], catalog: Catalog, points: int = 101,
                   include_bulk: bool = False) -> dict[str, tuple[float, ...]]:
    """Per model: the measured / profiled runtime ratio as ``points`` equally likely values
    (the quantile at the middle of each of ``points`` equal-mass bins, so drawing one
    uniformly reproduces the distribution; the single worst call is not given 1/points)."""
    ratios: dict[str, list[float]] = {}
    for r in log:
        if r.bulk and not include_bulk:
            continue
        if r.model not in catalog.perf:
            raise KenError(f"the engine ran {r.model}, which the catalog has no profile of")
        ratios.setdefault(r.model, []).append(r.seconds / catalog.perf[r.model].batch_runtime(
            r.rows))
    qs = (np.arange(points) + 0.5) * 100.0 / points
    return {m: tuple(float(x) for x in np.percentile(v, qs)) for m, v in ratios.items()}


def calibrated(catalog: Catalog, spreads: Mapping[str, tuple[float, ...]]) -> Catalog:
    """``catalog`` with each model in ``spreads`` given that runtime distribution."""
    perf = {}
    for m, p in catalog.perf.items():
        perf[m] = ModelPerf(m, p.batch_sizes, p.runtime_s, p.memory_bytes, p.degrees,
                            spreads.get(m, p.spread))
    return Catalog(perf, dict(catalog.correct), dict(catalog.probabilities),
                   catalog.sample_hash)
