"""Calibrating the simulator's runtimes to what serving measures (issues 5 and 33, fidelity).

Two calibrations. ``Calibration`` (what ``ken plan`` measures by default, issue 33): per model
and batch size, a serving call takes ``factor x`` what the simulator charges it (the profiled
runtime of its size, scaled by its largest row's size: ``predicted_s``), fitted on the calls of
a short replay with bursts (``measure_calibration``) and folded into the runtime tables
(``apply``), with what is left of each call after its factor kept as a spread of mean 1 that
the simulator draws per batch (``Calibration.spread``, since session 34). The older runtime
*spread* (below) draws a measured ratio to the profile per batch instead; it charges the round
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
from typing import Any, NamedTuple

import numpy as np

from ken import store
from ken.engine.charge import predicted_s
from ken.engine.supervision import BatchRecord
from ken.errors import KenError
from ken.machine import OtherLoad, least_loaded
from ken.models.cascade import Cascade
from ken.optimizer.baselines import static_plans
from ken.optimizer.perf import WAKE_IDLE_S, Catalog, ModelPerf, woke
from ken.optimizer.plan_context import PlannerSettings, planning_context
from ken.optimizer.workload import Hardware, Trace, gamma_trace
from ken.policy.plan import GearPlan
from ken.progress import QUIET, Reporter


def runtime_ratios(log: Iterable[BatchRecord], catalog: Catalog, include_bulk: bool = False
                   ) -> dict[str, list[tuple[BatchRecord, float]]]:
    """Per model: every model call with its ratio measured / predicted runtime
    (``predicted_s``), measured as the time the engine held the device for it
    (``BatchRecord.held_s``: the call, and the hand-off before it and the report after it,
    during which no other batch can start there either; since session 37)."""
    out: dict[str, list[tuple[BatchRecord, float]]] = {}
    for r in log:
        if r.bulk and not include_bulk:
            continue
        out.setdefault(r.model, []).append((r, r.held_s / predicted_s(r, catalog)))
    return out


def runtime_spread(log: Iterable[BatchRecord], catalog: Catalog, points: int = 101,
                   include_bulk: bool = False) -> dict[str, tuple[float, ...]]:
    """Per model: the measured / profiled runtime ratio as ``points`` equally likely values
    (the quantile at the middle of each of ``points`` equal-mass bins, so drawing one
    uniformly reproduces the distribution; the single worst call is not given 1/points)."""
    return {m: residual_spread(np.array([x for _, x in calls]), points)
            for m, calls in runtime_ratios(log, catalog, include_bulk).items()}


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
    """Per model, how much longer than its predicted runtime (``predicted_s``) a serving call
    holds its device (``BatchRecord.held_s``: the hand-off to the device's thread and the
    report back to the scheduler included, 0.45-0.65 ms a batch on 2 cores at 30-60
    requests/s),
    by batch size: ``fits[model]`` is ``((rows, factor), ...)`` in ascending rows, and a
    batch of ``b`` rows is charged ``factor(model, b)`` x its prediction (interpolated in
    log2 of the rows between fitted sizes, the nearest one's outside them); ``calls`` per model
    it was fitted on, and where the calls came from.

    Per size, not one line through all calls: the packaged encoders' one-row calls ran at
    0.8-0.9x their profile while their four-row calls ran at 1.1-1.2x (``docs/results.md``,
    "Calibration per batch size"), so a line fitted on a quiet replay's one-row calls
    undercharged the batches a burst forms.

    ``spread[model]``: what is left of each call's ratio after its factor (and the wake-up
    factor), as equally likely values of mean 1 (``SPREAD_POINTS`` quantiles); the simulator
    draws one per batch (``ModelPerf.spread``). Two calls of the same size and row length
    differ by up to 2x while serving (the machine's cores, caches and the other processes):
    a simulator that charges every call its mean predicts the median well and the tail of a
    plan whose latency is one or two calls too low (``docs/results.md``, "The calls' own
    spread")."""

    fits: Mapping[str, tuple[tuple[int, float], ...]]
    calls: Mapping[str, int] = field(default_factory=dict)
    source: str = ""
    #: cores other programs kept busy while it was measured (``machine.OtherLoad``; None:
    #: not measured, e.g. loaded from a file written before it was recorded)
    other_cores: float | None = None
    #: how much longer a call runs after its device idled ``perf.WAKE_IDLE_S`` or more than
    #: back to back (the ``fits`` are back-to-back factors); every fitted model's ``wake``
    wake: float = 1.0
    spread: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (np.isfinite(self.wake) and self.wake > 0):
            raise KenError(f"a wake-up factor must be > 0, got {self.wake}")
        spread = {}
        for m, factors in self.spread.items():
            factors = tuple(float(f) for f in factors)
            if m not in self.fits or not all(np.isfinite(f) and f > 0 for f in factors):
                raise KenError(f"runtime spread of {m}: give factors > 0 of a fitted model, "
                               f"got {list(factors)[:5]}")
            spread[str(m)] = factors
        object.__setattr__(self, "spread", MappingProxyType(spread))
        fits = {}
        for m, pairs in self.fits.items():
            pairs = tuple(sorted((int(b), float(f)) for b, f in pairs))
            rows = [b for b, _ in pairs]
            if not pairs or len(set(rows)) != len(rows) or rows[0] < 1 or not all(
                    np.isfinite(f) and f > 0 for _, f in pairs):
                raise KenError(f"runtime calibration of {m}: give one factor > 0 per batch "
                               f"size >= 1, got {list(pairs)}")
            fits[str(m)] = pairs
        object.__setattr__(self, "fits", MappingProxyType(fits))
        object.__setattr__(self, "calls", MappingProxyType(
            {str(m): int(n) for m, n in self.calls.items()}))

    def factor(self, model: str, rows: int) -> float:
        """What a call of ``model`` on ``rows`` rows takes over its prediction (1.0 for a
        model the calibration does not cover)."""
        pairs = self.fits.get(model)
        if not pairs:
            return 1.0
        return float(np.interp(np.log2(max(rows, 1)), [np.log2(b) for b, _ in pairs],
                               [f for _, f in pairs]))

    def apply(self, catalog: Catalog) -> Catalog:
        """``catalog`` with each fitted model's CPU runtimes scaled per batch size
        (``factor``) and its ``wake`` set; GPU runtimes are kept: the calls were CPU
        workers'."""
        unknown = sorted(set(self.fits) - set(catalog.perf))
        if unknown:
            raise KenError(f"the calibration covers {unknown}, which the catalog does not "
                           f"have ({', '.join(catalog.models)})")
        perf = dict(catalog.perf)
        for m in self.fits:
            p = perf[m]
            perf[m] = replace(p.scaled([self.factor(m, b) for b in p.batch_sizes]),
                              wake=self.wake, spread=self.spread.get(m, p.spread))
        return catalog.with_perf(perf)

    def updated(self, newer: Calibration) -> Calibration:
        """This calibration with ``newer``'s fits (and spreads) for the models ``newer``
        fitted, and ``newer``'s wake-up factor: e.g. ``ken plan``'s calibration, which served
        every candidate model, updated by a replay's serving calls (``ken replay``'s
        calibration.json), which fitted only the models of the plan it served. A ``newer``
        that fitted nothing leaves this one as it is; this one's other-load reading is kept
        where ``newer`` has none."""
        if not newer.fits:
            return self
        keep = [m for m in self.fits if m not in newer.fits]
        source = newer.source if not keep else (
            f"{newer.source or 'serving calls'}; {', '.join(keep)} from "
            f"{self.source or 'an earlier calibration'}")
        return Calibration({**{m: self.fits[m] for m in keep}, **newer.fits},
                           {**{m: self.calls.get(m, 0) for m in keep}, **newer.calls},
                           source, self.other_cores if newer.other_cores is None
                           else newer.other_cores, newer.wake,
                           {**{m: v for m, v in self.spread.items() if m in keep},
                            **newer.spread})

    def describe(self) -> str:
        """One line: ``model x factor@rows ...`` per model, then the wake-up factor."""
        if not self.fits:
            return "no model calls"
        def tail(m: str) -> str:
            f = self.spread.get(m)
            return f" (p95 call x{np.percentile(f, 95):.2f})" if f else ""

        return ", ".join(f"{m} " + " ".join(f"x{f:.2f}@{b}" for b, f in pairs) + tail(m)
                         for m, pairs in sorted(self.fits.items())) + \
            f"; x{self.wake:.2f} after {1000 * WAKE_IDLE_S:g} ms idle"

    def key(self) -> dict[str, Any]:
        """What a cached frontier planned with it depends on."""
        return {"wake": round(self.wake, 4),
                "fits": {m: tuple((b, round(f, 4)) for b, f in pairs)
                         for m, pairs in self.fits.items()},
                "spread": {m: tuple(round(f, 3) for f in v) for m, v in self.spread.items()}}

    def save(self, path: str | Path) -> Path:
        """Write it as JSON, atomically (``Calibration.load`` reads it)."""
        return store.write_text(Path(path), json.dumps({
            "kind": CALIBRATION_KIND, "version": 6, "source": self.source,
            "other_cores": self.other_cores, "wake": self.wake,
            "fits": {m: {"factors": [[b, f] for b, f in pairs], "calls": self.calls.get(m, 0),
                         "spread": list(self.spread.get(m, ()))}
                     for m, pairs in self.fits.items()}}, indent=1))

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
            if data.get("version") not in (3, 4, 5, 6):
                raise ValueError(f"it is version {data.get('version')} (one factor for all "
                                 "batch sizes or runtime spreads, written before the fit per "
                                 "batch size); run `ken replay` or `ken plan` again")
            fits = {m: tuple(tuple(x) for x in f["factors"]) for m, f in data["fits"].items()}
            calls = {m: f.get("calls", 0) for m, f in data["fits"].items()}
            # version 3 (before the calls' spread was fitted): every call charged its mean
            spread = {m: tuple(f["spread"]) for m, f in data["fits"].items() if f.get("spread")}
            other = data.get("other_cores")
            source = str(data.get("source", ""))
            if data["version"] < 5:  # fitted on the calls alone, before session 37
                source += (" (fitted on the calls alone, without the hand-off and report "
                           "around them: charges 3-7% less than serving holds a device)")
            if data["version"] < 6:  # rows sized in characters, before session 41
                source += (" (fitted with rows sized in characters and one size share for "
                           "every batch size: its factors and spread are against the size "
                           "model ken had then; run `ken replay` or `ken plan` again)")
            return cls(fits, calls, source,
                       None if other is None else float(other), float(data.get("wake", 1.0)),
                       spread)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KenError(f"{path} is not a runtime calibration file: {exc}") from None


def _not_slowest(ratios: np.ndarray) -> np.ndarray:
    """Which ``ratios`` to keep: all but the slowest 1% (a stall of the machine is not a
    property of the model)."""
    return ratios <= np.percentile(ratios, 99)


#: calls of a model a fit needs; a model with fewer is left as profiled
MIN_FIT_CALLS = 10
#: how many calls' weight the model's factor over all its calls has in each batch-size bin's
#: factor (partial pooling: a bin of a few calls, noisy in a 10-s calibration, stays near the
#: model's factor; a bin of many calls keeps its own)
PRIOR_CALLS = 8
#: the bounds a fitted factor is held to (a fit outside them is a broken measurement)
FACTOR_RANGE = (0.5, 4.0)
#: how many equally likely values a model's residual spread keeps (``Calibration.spread``)
SPREAD_POINTS = 51
#: calls of a model its spread needs (with fewer its calls are charged their mean: a handful
#: of calls, such as a pipeline's reading LM in a calibration stream, is no distribution;
#: `ken plan`'s 10-s calibration of the packaged family's three models made fewer than 50
#: calls of each in session 34)
SPREAD_MIN_CALLS = 20
#: a call this many times its model's median residual is a stall of the machine, not spread
STALL = 5.0
#: the least residual kept (a call timed at 0 s would make a factor of 0)
SPREAD_FLOOR = 0.05


def fit_calibration(log: Iterable[BatchRecord], catalog: Catalog, source: str = "",
                    min_calls: int = MIN_FIT_CALLS, prior_calls: float = PRIOR_CALLS,
                    wake: float | None = None) -> Calibration:
    """Per model with at least ``min_calls`` online calls in ``log``: its calls binned by
    batch size (the nearest power of two) and, per bin, the mean ratio measured / predicted
    runtime (``runtime_ratios``) pooled with the model's mean ratio over all its calls, which
    counts as ``prior_calls`` calls; the model's slowest 1% of calls left out (a stall of the
    machine is not a property of the model). Bulk calls are left out.

    Richer forms were tried on the same logs (``docs/results.md``, "A simulator that predicts
    the engine"): a slowdown while the other devices are busy, and the residual spread drawn
    per batch. Neither predicted held-out replays' p95 better on this machine; a line through
    all calls (``overhead + factor x predicted``, the previous form) fitted one-row calls and
    undercharged larger batches.

    The spread is fitted since (``Calibration.spread``), per model with ``SPREAD_MIN_CALLS``
    calls or more: each call's ratio over what the fitted calibration charges it (its size's
    interpolated factor, the wake-up), the machine's stalls (``STALL`` x the median) left out
    but not the slowest 1% (the tail is what it models), as ``SPREAD_POINTS`` equally likely
    values scaled to mean 1 (so the busy time the factors charge stays as it is). The earlier
    spread drew the ratio to the profile, row length and batch size included, and charged
    the round trip of small batches to large ones; this one is what is left after both."""
    fits, calls, spread = {}, {}, {}
    ratios = {m: pairs for m, pairs in runtime_ratios(log, catalog).items()
              if len(pairs) >= min_calls}
    # on top of what ``catalog`` charges for waking (1.0 for profiles, which never idle)
    if wake is None:  # else the wake-up factor given (one fitted on other calls)
        wake = wake_factor(ratios)
    # back-to-back ratios: a call after idle counts as ``wake`` times its own
    back = {m: np.array([q / (wake if woke(r.idle_before_s) else 1.0) for r, q in pairs])
            for m, pairs in ratios.items()}
    for m, pairs in ratios.items():
        ratio = back[m]
        size = np.array([2 ** round(np.log2(max(r.rows, 1))) for r, _ in pairs])
        keep = _not_slowest(ratio)
        ratio, size = ratio[keep], size[keep]
        overall = float(ratio.mean())
        bins = [(int(b), float((ratio[size == b].sum() + prior_calls * overall)
                               / ((size == b).sum() + prior_calls)))
                for b in np.unique(size)]
        fits[m] = tuple((b, float(np.clip(f, *FACTOR_RANGE))) for b, f in bins)
        calls[m] = len(pairs)
    charged = Calibration(fits, calls, wake=wake)
    for m, pairs in ratios.items():
        if len(pairs) < SPREAD_MIN_CALLS:
            continue
        # each call against what the simulator will charge it (its size's interpolated
        # factor, the wake-up); every call but the machine's stalls: the spread is the tail
        rest = back[m] / np.array([charged.factor(m, r.rows) for r, _ in pairs])
        rest = np.maximum(rest[rest <= STALL * np.median(rest)], SPREAD_FLOOR)
        values = residual_spread(rest)
        spread[m] = tuple(v / float(np.mean(values)) for v in values)
    return Calibration(fits, calls, source, wake=wake, spread=spread)


def residual_spread(ratios: np.ndarray, points: int = SPREAD_POINTS) -> tuple[float, ...]:
    """``ratios`` as ``points`` equally likely values: the quantile at the middle of each of
    ``points`` equal-mass bins (drawing one uniformly reproduces the distribution)."""
    qs = (np.arange(points) + 0.5) * 100.0 / points
    return tuple(float(x) for x in np.percentile(ratios, qs))


def recent_ratio(log: Sequence[BatchRecord], catalog: Catalog, since_s: float
                 ) -> tuple[float, int] | None:
    """The mean ratio measured / predicted runtime (``runtime_ratios``) of the online calls
    in ``log`` that started at ``since_s`` or later, the slowest 1% left out, and how many
    calls; None without such calls. Reads ``log`` from its end (the engine appends calls as
    they end; a list is copied first, in one step, since the engine trims it in place)."""
    if isinstance(log, list):
        log = tuple(log)
    i = len(log)
    while i > 0 and log[i - 1].start_s >= since_s:
        i -= 1
    recent = [r for r in log[i:] if r.model in catalog.perf]
    ratios = [q for calls in runtime_ratios(recent, catalog).values() for _, q in calls]
    if not ratios:
        return None
    x = np.asarray(ratios)
    return float(x[_not_slowest(x)].mean()), len(ratios)


def model_levels(log: Iterable[BatchRecord], catalog: Catalog) -> dict[str, float]:
    """Per model with online calls in ``log``: the mean ratio of their held time to what
    ``catalog`` charges them (``recent_ratio``: the slowest 1% left out). Above 1: the model
    ran slower than ``catalog`` says."""
    by_model: dict[str, list[BatchRecord]] = {}
    for r in log:
        if not r.bulk and r.model in catalog.perf:
            by_model.setdefault(r.model, []).append(r)
    out = {}
    for model, calls in sorted(by_model.items()):
        got = recent_ratio(calls, catalog, -np.inf)
        if got is not None:
            out[model] = got[0]
    return out


def at_levels(catalog: Catalog, levels: Mapping[str, float]) -> Catalog:
    """``catalog`` with each model in ``levels`` that many times as long (``model_levels``
    of a replay: that replay's runtimes, in hindsight)."""
    return catalog.with_perf({m: p.scaled(levels[m]) if m in levels else p
                              for m, p in catalog.perf.items()})


#: one-row calls of a model after idle and back to back that its wake-up ratio needs
MIN_WAKE_CALLS = 5
#: the bounds the wake-up factor is held to
WAKE_RANGE = (0.8, 1.5)


def wake_factor(ratios: Mapping[str, list[tuple[BatchRecord, float]]],
                min_calls: int = MIN_WAKE_CALLS) -> float:
    """How much longer a one-row call runs after its device idled ``WAKE_IDLE_S`` or more
    than back to back: per model with ``min_calls`` one-row calls of each kind, the ratio of
    their mean ratios to the prediction (``runtime_ratios``, each kind's slowest 1% left
    out); averaged over models weighted by the smaller count; 1.0 where no model has both.
    One factor for the machine, not per model: the calibration replay runs a later stage
    right after an earlier one, so most models show only one kind of call."""
    num = den = 0.0
    for pairs in ratios.values():
        one = [(woke(r.idle_before_s), q) for r, q in pairs if r.rows == 1]
        idle = np.array([q for woke, q in one if woke])
        busy = np.array([q for woke, q in one if not woke])
        n = min(idle.size, busy.size)
        if n < min_calls:
            continue
        trim = [x[_not_slowest(x)] for x in (idle, busy)]
        num += n * float(trim[0].mean() / trim[1].mean())
        den += n
    return float(np.clip(num / den, *WAKE_RANGE)) if den else 1.0


def cheapest_first(catalog: Catalog, models: Iterable[str]) -> list[str]:
    """``models`` by their profiled one-row runtime, cheapest first."""
    return sorted(models, key=lambda m: catalog.perf[m].batch_runtime(1))


def calibration_plan(catalog: Catalog, models: Sequence[str], hardware: Hardware,
                     trace: Trace) -> GearPlan:
    """A one-gear plan that runs every row through every one of ``models`` (a cascade of
    them, cheapest first, whose thresholds pass every row on), placed by ken's search on
    ``hardware``: what ``measure_calibration`` serves."""
    order = cheapest_first(catalog, models)
    cascade = Cascade(tuple(order), (PASS_ALL,) * (len(order) - 1))
    ctx = planning_context("calibration", [cascade], catalog, hardware, trace,
                           settings=PlannerSettings(num_ranges=1, include_static=False))
    return static_plans(ctx)[0]


#: a threshold no certainty reaches: every row goes on to the next stage
PASS_ALL = 2.0
#: the share of the calibration plan's capacity its replay offers (0.5 and 0.8 were tried:
#: the fits at 0.5 predicted held-out replays as well or better)
CALIBRATION_LOAD = 0.5
#: rows arriving at once, in turn, every ``BURST_EVERY_S`` on top of the steady arrivals: so
#: that queues form and the fit sees the batch sizes a burst makes, not one-row calls only
BURSTS = (2, 4, 8, 16)
BURST_EVERY_S = 2.0


def calibration_trace(rate: float, seconds: float, seed: int = 0) -> Trace:
    """Bursty arrivals (Gamma, CV 2) at ``rate`` for ``seconds``, with ``BURSTS`` rows
    arriving at once in turn every ``BURST_EVERY_S`` (the first after one interval)."""
    steady = gamma_trace(rate, seconds, 2.0, seed=seed)
    at = np.arange(BURST_EVERY_S, seconds, BURST_EVERY_S)
    bursts = [np.full(BURSTS[i % len(BURSTS)], t) for i, t in enumerate(at)]
    return Trace(np.sort(np.concatenate([steady.arrival_s, *bursts])),
                 f"{steady.name} + bursts of {'/'.join(map(str, BURSTS))} rows every "
                 f"{BURST_EVERY_S:g} s")


#: with ``measure_calibration(rate=...)``: how long it serves each model alone at the rate
#: the plans will serve, as a share of its ``seconds`` (on top of them, per model), and the
#: most of that model's capacity offered
AT_RATE_SHARE = 0.5
AT_RATE_MAX_LOAD = 0.8


class _AtRate(NamedTuple):
    """One model served alone at the serving rate: its plan, rate and arrivals."""
    model: str
    plan: GearPlan
    rate: float
    trace: Trace


def _at_rate_parts(catalog: Catalog, models: Sequence[str], hardware: Hardware, rate: float,
                   faster_than: float, seconds: float, seed: int) -> list[_AtRate]:
    """Per model, cheapest first: the model alone, placed by ken, on bursty arrivals at
    ``rate`` (at most ``AT_RATE_MAX_LOAD`` of its capacity there); none for a model whose
    capped rate is no faster than ``faster_than`` (the cascade's own rows)."""
    parts = []
    for i, m in enumerate(cheapest_first(catalog, models)):
        alone = calibration_plan(catalog, [m], hardware, gamma_trace(rate, 10.0, 2.0, seed=seed))
        capacity = len(alone.devices) / catalog.perf_on(m, alone.devices[0]).batch_runtime(1)
        at = min(rate, AT_RATE_MAX_LOAD * capacity)
        if at > faster_than:
            parts.append(_AtRate(m, alone, at, calibration_trace(
                at, seconds * AT_RATE_SHARE, seed=seed + 1 + i)))
    return parts


def measure_calibration(catalog: Catalog, loaders: Mapping[str, Any], sample: Any,
                        hardware: Hardware, seconds: float = 10.0, seed: int = 0,
                        reporter: Reporter = QUIET, attempts: int = 3,
                        other_load: Callable[[], OtherLoad] = OtherLoad,
                        rate: float | None = None, **engine_options: Any) -> Calibration:
    """The calibration ``calibration_calls`` measures (the same arguments), moved to the
    serving rate where it served models at ``rate`` (``CalibrationCalls.moved``)."""
    return calibration_calls(catalog, loaders, sample, hardware, seconds, seed, reporter,
                             attempts, other_load, rate, **engine_options).moved(
                                 reporter=reporter)


class CalibrationCalls(NamedTuple):
    """What ``calibration_calls`` measured: the fit on the cascade's calls, and each model's
    calls served alone at the serving rate (none without a rate)."""
    cascade: Calibration
    #: per model served alone at the rate, cheapest first: its calls there
    at_rate: Mapping[str, tuple[BatchRecord, ...]]
    #: what was served at the rate, per model, e.g. "152 rows of minilm-l3 at 31.6/s"
    served: Mapping[str, str]
    #: the profiles the calls are measured against
    catalog: Catalog
    #: the cascade's calls ``cascade`` was fitted on
    cascade_calls: tuple[BatchRecord, ...] = ()

    def moved(self, models: Iterable[str] | None = None,
              reporter: Reporter = QUIET) -> Calibration:
        """``cascade`` moved to the level of the calls at the rate of ``models`` (every model
        served there by default; ``at_serving_rate``), with a note for a model served there
        with too few calls, and (by default) for a model the cascade fitted that was not
        served there; ``cascade`` itself where none was served at the rate."""
        models = list(self.at_rate if models is None else models)
        unknown = [m for m in models if m not in self.at_rate]
        if unknown:
            raise KenError(f"not served at the serving rate: {', '.join(unknown)} (served "
                           f"there: {', '.join(self.at_rate) or 'none'})")
        if not models:
            return self.cascade
        out = at_serving_rate(self.cascade, {m: self.at_rate[m] for m in models},
                              self.catalog, "at the serving rate: "
                              + ", ".join(self.served[m] for m in models))
        how = ("kept as the cascade measured" if out.rest is None else
               f"moved x{out.rest:.2f} as the others' calls were")
        few = [m for m in models if m not in out.fitted]
        if few:
            reporter.note(f"too few calls of {', '.join(few)} at the serving rate to fit "
                          f"{'it' if len(few) == 1 else 'them'} there; {how}")
        unserved = [m for m in self.cascade.fits if m not in self.at_rate]
        if unserved and len(models) == len(self.at_rate):
            reporter.note(f"{', '.join(unserved)} not served alone at the serving rate (at "
                          f"most {AT_RATE_MAX_LOAD:g} of {'its' if len(unserved) == 1 else 'their'}"
                          f" capacity is no faster than the cascade's rows); {how}")
        return out.calibration


def cheapest_only(calls: CalibrationCalls) -> Calibration:
    """Session 35's form of the calibration at the serving rate, from the same calls: moved by
    the cheapest model's calls alone (``at_rate`` is cheapest first); the cascade's fit where
    none was served at the rate. For comparing the two forms on one measurement."""
    return calls.moved(list(calls.at_rate)[:1])


def calibration_calls(catalog: Catalog, loaders: Mapping[str, Any], sample: Any,
                      hardware: Hardware, seconds: float = 10.0, seed: int = 0,
                      reporter: Reporter = QUIET, attempts: int = 3,
                      other_load: Callable[[], OtherLoad] = OtherLoad,
                      rate: float | None = None, **engine_options: Any) -> CalibrationCalls:
    """Serve ``calibration_plan`` of every model in ``loaders`` with the online engine on
    bursty arrivals at ``CALIBRATION_LOAD`` of its capacity for ``seconds``, with bursts of
    rows arriving at once (``calibration_trace``), and fit the serving calls against the
    simulator's charges per batch size (``fit_calibration``).

    With ``rate`` (the rate the plans' requests will arrive in, e.g. ``Trace.request_qps``),
    it then serves each model alone for ``AT_RATE_SHARE`` x ``seconds`` more, cheapest
    first, on ``rate`` arrivals (at most ``AT_RATE_MAX_LOAD`` of that model's capacity; not
    where that is no faster than the cascade's own rows), and keeps each model's calls there:
    ``CalibrationCalls.moved`` fits each model at the level of its own calls there
    (``at_serving_rate``; what ``measure_calibration`` returns): a call runs slower when requests
    arrive faster (the router's and the arrivals' share of the cores grows, both workers
    compute at once), which the cascade's few rows per second do not show, and by how much
    differs per model (``docs/results.md``, "Fits on serving calls").

    While it serves, ``other_load`` (``machine.OtherLoad``) reads how many cores other programs
    kept busy. At ``machine.BUSY_CORES`` or more the fit is for a busier machine than the one
    the plans will run on, so it measures again, up to ``attempts`` times in all, and keeps the
    fit measured beside the least other load; a warning says so when every attempt was busy."""
    from ken.engine.replay import serve_trace  # the engine, only when measuring

    if rate is not None and not (np.isfinite(rate) and rate > 0):
        raise KenError(f"the calibration's serving rate must be > 0 rows/s, got {rate}")
    models = sorted(loaders)
    probe = gamma_trace(10.0, 10.0, 2.0, seed=seed)
    plan = calibration_plan(catalog, models, hardware, probe)
    per_row = sum(catalog.perf_on(m, plan.devices[0]).batch_runtime(1) for m in models)
    cascade_rate = CALIBRATION_LOAD * len(plan.devices) / per_row
    trace = calibration_trace(cascade_rate, seconds, seed=seed)
    parts = ([] if rate is None else
             _at_rate_parts(catalog, models, hardware, rate, cascade_rate, seconds, seed))

    def serve(attempt: int) -> Any:
        again = "" if attempt == 1 else f" (attempt {attempt} of {attempts})"
        reporter.note(f"calibrating runtimes: {len(trace)} rows through {' -> '.join(models)} "
                      f"on {len(plan.devices)} workers, {cascade_rate:.1f} rows/s and bursts "
                      f"for {seconds:g} s" + again)
        # no standby copies (standby.py): they take no rows in a replay without faults, and
        # would only add their load time and memory to the measurement's
        options = {"admission": "max_in_flight", "standby": False, **engine_options}
        first = serve_trace(plan, loaders, trace, sample, seed=seed, reporter=reporter,
                            **options)
        logs = {}
        for part in parts:
            reporter.note(f"calibrating runtimes at the serving rate: {len(part.trace)} rows "
                          f"through {part.model} on {len(part.plan.devices)} workers, "
                          f"{part.rate:.1f} rows/s and bursts for "
                          f"{seconds * AT_RATE_SHARE:g} s" + again)
            logs[part.model] = tuple(serve_trace(
                part.plan, {part.model: loaders[part.model]}, part.trace, sample, seed=seed,
                reporter=reporter, **options).batch_log)
        return first, logs

    (served, logs), load, attempt = least_loaded(
        serve, "calibrating", attempts, other_load, reporter.note, reporter.warn,
        "calibrate again on a quiet machine, or plan with --no-calibration")
    where = (("" if load.cores is None else f", other programs {load.cores:.2f} cores")
             + ("" if attempt == 1 else f", attempt {attempt}"))
    fitted = fit_calibration(served.batch_log, catalog,
                             f"{len(trace)} rows at {cascade_rate:.1f}/s and bursts through "
                             f"every model, {len(served.batch_log)} calls" + where)
    return CalibrationCalls(replace(fitted, other_cores=load.cores), logs,
                            {p.model: f"{len(p.trace)} rows of {p.model} at {p.rate:.1f}/s"
                             for p in parts}, catalog, tuple(served.batch_log))


class AtServingRate(NamedTuple):
    """What ``at_serving_rate`` returns: the calibration moved; the models fitted on their
    calls at the rate; per model also fitted in the first calibration, how much slower its
    calls there ran than that one charged them; and the call-weighted mean of those shifts
    the other models were moved by (None: no shift, nothing moved)."""
    calibration: Calibration
    fitted: frozenset[str]
    shifts: Mapping[str, float]
    rest: float | None


def at_serving_rate(fitted: Calibration, logs: Mapping[str, Iterable[BatchRecord]],
                    catalog: Catalog, what: str) -> AtServingRate:
    """``fitted`` moved to the level of ``logs[model]``'s calls (each model served alone at
    the rate the plans will serve): per model with ``MIN_FIT_CALLS`` calls there or more, its
    factors and spread fitted on those calls, and, where ``fitted`` has the model, for the
    batch sizes it made no calls of there ``fitted``'s factors times its shift (how much
    slower its calls ran than ``fitted`` charges them, back to back, the slowest 1% left
    out); every other model's factors times the mean of those shifts, weighted by their calls
    (every model's calls pay the share of the cores the router and the arrivals take at that
    rate). The other models' spreads are kept as ``fitted`` measured them. ``fitted`` as it
    is where no model has enough calls."""
    alone, shifts, calls = {}, {}, {}
    for model, log in logs.items():
        log = list(log)
        # the wake-up as ``fitted`` found it (a call every 30 ms seldom finds its device idle)
        fit = fit_calibration(log, catalog, wake=fitted.wake)
        if model not in fit.fits:
            continue
        alone[model], calls[model] = fit, fit.calls[model]
        if model in fitted.fits:
            back = np.array([q / (fitted.wake if woke(r.idle_before_s) else 1.0)
                             / fitted.factor(model, r.rows)
                             for r, q in runtime_ratios(log, catalog)[model]])
            shifts[model] = float(back[_not_slowest(back)].mean())
    if not alone:
        return AtServingRate(fitted, frozenset(), {}, None)
    rest = (sum(shifts[m] * calls[m] for m in shifts) / sum(calls[m] for m in shifts)
            if shifts else None)

    def factors(m: str) -> tuple[tuple[int, float], ...]:
        there = dict(alone[m].fits[m]) if m in alone else {}
        # sizes not served at the rate: the cascade's, shifted (as it was: no shift known)
        by = shifts.get(m, 1.0 if rest is None else rest)
        cascade = {b: float(np.clip(f * by, *FACTOR_RANGE)) for b, f in fitted.fits.get(m, ())}
        return tuple(sorted({**cascade, **there}.items()))

    fits = {m: factors(m) for m in {**fitted.fits, **alone}}
    spread = {**fitted.spread, **{m: alone[m].spread[m] for m in alone
                                  if m in alone[m].spread}}
    moved = ", ".join(f"{m} x{s:.2f}" for m, s in shifts.items())
    others = ("" if rest is None or set(fitted.fits) <= set(alone) else
              f"; every other model moved x{rest:.2f}")
    return AtServingRate(
        Calibration(fits, {**fitted.calls, **calls},
                    f"{fitted.source}; {what}: fitted on those calls"
                    + (f" (their calls over the cascade's charge: {moved})" if moved else "")
                    + others,
                    fitted.other_cores, fitted.wake, spread),
        frozenset(alone), shifts, rest)


CALIBRATION_KIND = "ken-runtime-calibration"
