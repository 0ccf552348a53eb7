"""Calibrating the simulator's runtimes to what serving measures (issues 5 and 33, fidelity).

Two calibrations. ``Calibration`` (what ``ken plan`` measures by default, issue 33): per model,
a serving call takes ``overhead_s + factor x`` what the simulator charges it (the profiled
runtime of its size, scaled by its largest row's size: ``predicted_s``), fitted on the calls of
a short replay (``measure_calibration``) and folded into the runtime tables (``apply``). The
older runtime *spread* (below) draws a measured ratio per batch instead; it charges the round
trip of small batches to large ones too, and was no closer than the profiles in
``benchmarks/serving_time.py``.

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ken import store
from ken.engine.machine import OtherLoad
from ken.engine.supervision import BatchRecord
from ken.errors import KenError
from ken.models.cascade import Cascade
from ken.optimizer.baselines import static_plans
from ken.optimizer.perf import Catalog, ModelPerf, sized_runtime
from ken.optimizer.plan_context import PlannerSettings, planning_context
from ken.optimizer.workload import Hardware, Trace, gamma_trace
from ken.policy.plan import GearPlan
from ken.progress import QUIET, Reporter


def predicted_s(record: BatchRecord, catalog: Catalog) -> float:
    """What the simulator charges the call ``record``: the profiled runtime of its size,
    scaled by its largest row's size where the catalog knows sizes (``Catalog.size_factors``)."""
    if record.model not in catalog.perf:
        raise KenError(f"the engine ran {record.model}, which the catalog has no profile of")
    return sized_runtime(catalog.perf_on(record.model, record.device).batch_runtime(record.rows),
                         catalog.size_factors(record.model, record.device, record.rows),
                         record.rows, record.largest)


def runtime_ratios(log: Iterable[BatchRecord], catalog: Catalog, include_bulk: bool = False
                   ) -> dict[str, list[tuple[BatchRecord, float]]]:
    """Per model: every model call with its ratio measured / predicted runtime
    (``predicted_s``)."""
    out: dict[str, list[tuple[BatchRecord, float]]] = {}
    for r in log:
        if r.bulk and not include_bulk:
            continue
        out.setdefault(r.model, []).append((r, r.seconds / predicted_s(r, catalog)))
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
        return {m: replace(p, spread=spreads.get(m, p.spread)) for m, p in perf.items()}

    return catalog.with_perf(spread(catalog.perf), spread(catalog.gpu_perf))


@dataclass(frozen=True)
class Calibration:
    """Per model ``(overhead_s, factor)``: a serving call of it takes ``overhead_s + factor
    x`` its predicted runtime (``predicted_s``); ``calls`` per model it was fitted on, and
    where the calls came from."""

    fits: Mapping[str, tuple[float, float]]
    calls: Mapping[str, int] = field(default_factory=dict)
    source: str = ""
    #: cores other programs kept busy while it was measured (``machine.OtherLoad``; None:
    #: not measured, e.g. loaded from a file written before it was recorded)
    other_cores: float | None = None

    def __post_init__(self) -> None:
        fits = {str(m): (float(a), float(b)) for m, (a, b) in self.fits.items()}
        bad = [m for m, (a, b) in fits.items()
               if not (np.isfinite([a, b]).all() and a >= 0 and b > 0)]
        if bad:
            raise KenError(f"runtime calibration of {bad}: an overhead must be >= 0 s and a "
                           "factor > 0")
        object.__setattr__(self, "fits", MappingProxyType(fits))
        object.__setattr__(self, "calls", MappingProxyType(
            {str(m): int(n) for m, n in self.calls.items()}))

    def apply(self, catalog: Catalog) -> Catalog:
        """``catalog`` with each fitted model's CPU runtimes ``overhead + factor x`` the
        profiled ones (GPU runtimes are kept: the calls were CPU workers')."""
        unknown = sorted(set(self.fits) - set(catalog.perf))
        if unknown:
            raise KenError(f"the calibration covers {unknown}, which the catalog does not "
                           f"have ({', '.join(catalog.models)})")
        perf = dict(catalog.perf)
        for m, (a, b) in self.fits.items():
            p = perf[m]
            perf[m] = replace(p, runtime_s=tuple(tuple(a + b * t for t in row)
                                                 for row in p.runtime_s))
        return catalog.with_perf(perf)

    def describe(self) -> str:
        """One line: ``model +overhead ms x factor`` per model."""
        return ", ".join(f"{m} +{1000 * a:.1f} ms x{b:.2f}"
                         for m, (a, b) in sorted(self.fits.items())) or "no model calls"

    def key(self) -> dict[str, tuple[float, ...]]:
        """What a cached frontier planned with it depends on."""
        return {m: (round(a, 6), round(b, 4)) for m, (a, b) in self.fits.items()}

    def save(self, path: str | Path) -> Path:
        """Write it as JSON, atomically (``Calibration.load`` reads it)."""
        return store.write_text(Path(path), json.dumps({
            "kind": CALIBRATION_KIND, "version": 2, "source": self.source,
            "other_cores": self.other_cores,
            "fits": {m: {"overhead_s": a, "factor": b, "calls": self.calls.get(m, 0)}
                     for m, (a, b) in self.fits.items()}}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """A calibration file ``save`` (``ken replay``, ``ken plan``) wrote."""
        path = Path(path)
        if not path.is_file():
            raise KenError(f"no calibration file at {path}; `ken replay` and `ken plan` write "
                           "one (calibration.json in their --out folder)")
        try:
            data = json.loads(path.read_text())
            if data.get("kind") != CALIBRATION_KIND:
                raise ValueError(f"kind is {data.get('kind')!r}")
            if data.get("version") != 2:
                raise ValueError(f"it is version {data.get('version')} (runtime spreads, "
                                 "written before issue 33); run `ken replay` again")
            fits = {m: (f["overhead_s"], f["factor"]) for m, f in data["fits"].items()}
            calls = {m: f.get("calls", 0) for m, f in data["fits"].items()}
            other = data.get("other_cores")
            return cls(fits, calls, str(data.get("source", "")),
                       None if other is None else float(other))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KenError(f"{path} is not a runtime calibration file: {exc}") from None


#: calls of a model a fit needs; a model with fewer is left as profiled
MIN_FIT_CALLS = 10
#: the bounds a fitted factor is held to (a fit outside them is a broken measurement)
FACTOR_RANGE = (0.5, 4.0)


def fit_calibration(log: Iterable[BatchRecord], catalog: Catalog, source: str = "",
                    min_calls: int = MIN_FIT_CALLS) -> Calibration:
    """Per model with at least ``min_calls`` online calls in ``log``: the non-negative
    least-squares line ``measured = overhead + factor x predicted`` through them, the slowest
    1% left out (a stall of the machine is not a property of the model); through the origin
    when no positive factor fits. Bulk calls are left out.

    Richer forms were tried on the same logs (``docs/results.md``, "A simulator that predicts
    the engine"): a slowdown while the other devices are busy, and the residual spread drawn
    per batch. Neither predicted held-out replays better on this machine, whose replays of one
    window differ by 20-40% at p95; their fits moved from run to run."""
    from scipy.optimize import nnls

    fits, calls = {}, {}
    for m, pairs in runtime_ratios(log, catalog).items():
        if len(pairs) < min_calls:
            continue
        y = np.array([r.seconds for r, _ in pairs])
        ratio = np.array([q for _, q in pairs])
        x = y / ratio  # the predicted runtimes ``runtime_ratios`` divided by
        keep = ratio <= np.percentile(ratio, 99)
        x, y = x[keep], y[keep]
        (a, b), _ = nnls(np.column_stack([np.ones_like(x), x]), y)
        if b <= 0:
            a, b = 0.0, float(np.dot(x, y) / np.dot(x, x))
        fits[m], calls[m] = (float(a), float(np.clip(b, *FACTOR_RANGE))), len(pairs)
    return Calibration(fits, calls, source)


def calibration_plan(catalog: Catalog, models: Sequence[str], hardware: Hardware,
                     trace: Trace) -> GearPlan:
    """A one-gear plan that runs every row through every one of ``models`` (a cascade of
    them, cheapest first, whose thresholds pass every row on), placed by ken's search on
    ``hardware``: what ``measure_calibration`` serves."""
    order = sorted(models, key=lambda m: catalog.perf[m].batch_runtime(1))
    cascade = Cascade(tuple(order), (PASS_ALL,) * (len(order) - 1))
    ctx = planning_context("calibration", [cascade], catalog, hardware, trace,
                           settings=PlannerSettings(num_ranges=1, include_static=False))
    return static_plans(ctx)[0]


#: a threshold no certainty reaches: every row goes on to the next stage
PASS_ALL = 2.0
#: the share of the calibration plan's capacity its replay offers (0.5 and 0.8 were tried:
#: the fits at 0.5 predicted held-out replays as well or better)
CALIBRATION_LOAD = 0.5


def measure_calibration(catalog: Catalog, loaders: Mapping[str, Any], sample: Any,
                        hardware: Hardware, seconds: float = 10.0, seed: int = 0,
                        reporter: Reporter = QUIET, attempts: int = 3,
                        other_load: Callable[[], OtherLoad] = OtherLoad,
                        **engine_options: Any) -> Calibration:
    """Serve ``calibration_plan`` of every model in ``loaders`` with the online engine on
    bursty arrivals (Gamma, CV 2) at ``CALIBRATION_LOAD`` of its capacity for ``seconds``, and fit
    the serving calls against the simulator's charges (``fit_calibration``).

    While it serves, ``other_load`` (``machine.OtherLoad``) reads how many cores other programs
    kept busy. At ``machine.BUSY_CORES`` or more the fit is for a busier machine than the one
    the plans will run on, so it measures again, up to ``attempts`` times in all, and keeps the
    fit measured beside the least other load; a warning says so when every attempt was busy."""
    from ken.engine.replay import serve_trace  # the engine, only when measuring

    if attempts < 1:
        raise KenError(f"calibration attempts must be >= 1, got {attempts}")
    models = sorted(loaders)
    probe = gamma_trace(10.0, 10.0, 2.0, seed=seed)
    plan = calibration_plan(catalog, models, hardware, probe)
    per_row = sum(catalog.perf_on(m, plan.devices[0]).batch_runtime(1) for m in models)
    rate = CALIBRATION_LOAD * len(plan.devices) / per_row
    trace = gamma_trace(rate, seconds, 2.0, seed=seed)
    best: tuple[Calibration, OtherLoad] | None = None
    for attempt in range(1, attempts + 1):
        reporter.note(f"calibrating runtimes: {len(trace)} rows through {' -> '.join(models)} "
                      f"on {len(plan.devices)} workers, {rate:.1f} rows/s for {seconds:g} s"
                      + ("" if attempt == 1 else f" (attempt {attempt} of {attempts})"))
        with other_load() as load:
            served = serve_trace(plan, loaders, trace, sample, seed=seed, reporter=reporter,
                                 admission="max_in_flight", **engine_options)
        fitted = fit_calibration(served.batch_log, catalog,
                                 f"{len(trace)} rows at {rate:.1f}/s through every model, "
                                 f"{len(served.batch_log)} calls"
                                 + ("" if load.cores is None else
                                    f", other programs {load.cores:.2f} cores")
                                 + ("" if attempt == 1 else f", attempt {attempt}"))
        if best is None or (load.cores is not None and best[1].cores is not None
                            and load.cores < best[1].cores):
            best = (fitted, load)
        warning = load.warning("calibrating")
        if warning is None:
            break
        if attempt < attempts:
            reporter.note(f"{warning}: measuring again")
    assert best is not None
    fitted, load = best
    warning = load.warning("calibrating")
    if warning:
        reporter.warn(f"{warning} (the least of {attempts} attempts): calibrate again on a "
                      "quiet machine, or plan with --no-calibration")
    return replace(fitted, other_cores=load.cores)


CALIBRATION_KIND = "ken-runtime-calibration"
