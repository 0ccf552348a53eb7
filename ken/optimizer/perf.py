"""What the planner and the simulator know about each model (DESIGN.md section 4).

``ModelPerf`` holds a model's batch runtimes per tensor-parallel degree and its memory per device;
``Catalog`` adds the per-sample outcomes (correct or not, certainty) measured on the labelled
sample, from which cascade accuracy and escalation are derived. Both are built from the
foundation's ``Profile`` objects, or from other measured profiles (``ken.optimizer.artifact``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType

import numpy as np

from ken.errors import ProfileError
from ken.models.cascade import Cascade
from ken.models.certainty import certainty_of
from ken.optimizer.profile import Profile
from ken.optimizer.workload import Hardware, is_gpu_id

#: tensor-parallel degrees a replica may span (one node)
PARALLEL_DEGREES = (1, 2, 4, 8)
#: a batch that starts on devices idle for this long or more pays its model's ``wake`` factor:
#: one-row calls after 50 ms or more of idle ran 7-8% slower than back-to-back ones on this
#: machine's workers (docs/results.md, "Calibration per batch size")
WAKE_IDLE_S = 0.05


def woke(idle_s: float) -> bool:
    """Whether a batch after ``idle_s`` of device idle pays its model's ``wake`` factor."""
    return idle_s >= WAKE_IDLE_S


@dataclass(frozen=True)
class ModelPerf:
    """Batch runtimes (seconds) at ``batch_sizes`` for each tensor-parallel degree.

    ``runtime_s[k][j]`` is the time of one batch of ``batch_sizes[j]`` rows on a replica spanning
    ``degrees[k]`` devices; ``memory_bytes[k]`` is what such a replica needs on *each* device.
    Runtimes between profiled sizes are interpolated linearly; beyond the largest size the
    per-row cost of the largest batch is extrapolated.
    """

    name: str
    batch_sizes: tuple[int, ...]
    runtime_s: tuple[tuple[float, ...], ...]
    memory_bytes: tuple[int, ...]
    degrees: tuple[int, ...] = (1,)
    # optional runtime noise: multiplicative factors, one drawn per batch by the simulator
    # (an empirical distribution, e.g. measured serving calls / profiled runtime; see
    # ken.engine.calibrate). Empty: every batch takes exactly its profiled runtime.
    spread: tuple[float, ...] = ()
    # the share of a one-row call's runtime on the mean row that grows with the row's size
    # (``Profile.size_share``); the simulator scales a batch by its rows' sizes (``size_factor``)
    size_share: float = 0.0
    # how much longer a batch runs when its devices were idle for ``WAKE_IDLE_S`` or more
    # before it (measured by ``ken.engine.calibrate``; 1.0: no difference)
    wake: float = 1.0
    # the share of a batch's runtime that grows with its largest row, per size of
    # ``batch_sizes`` (``batch_shares``, from the profile's rows and runtimes: a batch pads to
    # its largest row); kept by ``scaled`` (the whole call scales), diluted by
    # ``with_overhead`` (the added seconds do not grow with rows). Empty: ``size_share`` at
    # every size
    size_shares: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_sizes", tuple(int(b) for b in self.batch_sizes))
        object.__setattr__(self, "runtime_s",
                           tuple(tuple(float(t) for t in row) for row in self.runtime_s))
        object.__setattr__(self, "memory_bytes", tuple(int(m) for m in self.memory_bytes))
        object.__setattr__(self, "degrees", tuple(int(d) for d in self.degrees))
        object.__setattr__(self, "spread", tuple(float(f) for f in self.spread))
        object.__setattr__(self, "size_shares", tuple(float(f) for f in self.size_shares))
        where = f"performance profile of {self.name!r}"
        if not self.batch_sizes or list(self.batch_sizes) != sorted(set(self.batch_sizes)) \
                or self.batch_sizes[0] < 1:
            raise ProfileError(f"{where}: batch sizes must be increasing and >= 1")
        if not self.degrees or any(d not in PARALLEL_DEGREES for d in self.degrees) \
                or len(set(self.degrees)) != len(self.degrees):
            raise ProfileError(f"{where}: degrees must be distinct values of {PARALLEL_DEGREES}")
        if len(self.runtime_s) != len(self.degrees) or len(self.memory_bytes) != len(self.degrees):
            raise ProfileError(f"{where}: need one runtime row and one memory size per degree")
        if not 0.0 <= self.size_share <= 1.0:
            raise ProfileError(f"{where}: size_share must be in [0, 1], got {self.size_share}")
        if self.size_shares and (len(self.size_shares) != len(self.batch_sizes) or any(
                not 0.0 <= f <= 1.0 for f in self.size_shares)):
            raise ProfileError(f"{where}: size_shares need one share in [0, 1] per batch size")
        if not (np.isfinite(self.wake) and self.wake > 0):
            raise ProfileError(f"{where}: the wake-up factor must be positive, got {self.wake}")
        if any(not np.isfinite(f) or f <= 0 for f in self.spread):
            raise ProfileError(f"{where}: runtime spread factors must be positive")
        for row in self.runtime_s:
            if len(row) != len(self.batch_sizes):
                raise ProfileError(f"{where}: a runtime row has {len(row)} entries for "
                                   f"{len(self.batch_sizes)} batch sizes")
            if any(not np.isfinite(t) or t <= 0 for t in row):
                raise ProfileError(f"{where}: runtimes must be positive seconds")

    def with_overhead(self, seconds: float) -> ModelPerf:
        """The same model with ``seconds`` added to every batch (a hop to a remote worker),
        which does not grow with the rows' sizes."""
        one = self.runtime_s[self.degrees.index(1) if 1 in self.degrees else 0]
        return replace(self, runtime_s=tuple(tuple(t + seconds for t in row)
                                             for row in self.runtime_s),
                       size_shares=tuple(f * t / (t + seconds) for f, t in
                                         zip(self.size_shares, one, strict=True))
                       if self.size_shares else ())

    def shares_table(self, up_to: int) -> np.ndarray:
        """``out[b]``: the share of a ``b``-row batch's runtime that grows with its largest row,
        ``b = 0..up_to`` (``size_shares`` interpolated between batch sizes, the largest's
        beyond it; ``size_share`` at every size without them; ``out[0] = 0``)."""
        rows = np.arange(up_to + 1, dtype=np.float64)
        out = (np.interp(rows, self.batch_sizes, self.size_shares) if self.size_shares
               else np.full(up_to + 1, self.size_share))
        out[0] = 0.0
        return out

    def scaled(self, factors: float | Sequence[float]) -> ModelPerf:
        """The same model with every batch ``factors`` times as long: one factor, or one per
        batch size of ``batch_sizes``."""
        scale = ([float(factors)] * len(self.batch_sizes) if isinstance(factors, int | float)
                 else list(factors))
        return replace(self, runtime_s=tuple(
            tuple(k * t for k, t in zip(scale, row, strict=True)) for row in self.runtime_s))

    def woken(self, idle_s: float) -> float:
        """What a batch after ``idle_s`` of device idle is charged on top: ``wake`` or 1."""
        return self.wake if woke(idle_s) else 1.0

    @classmethod
    def from_profile(cls, profile: Profile) -> ModelPerf:
        perf = cls(profile.model, profile.batch_sizes, (profile.batch_runtime_s,),
                   (profile.memory_bytes,), (1,), size_share=profile.size_share)
        if profile.size_share <= 0 or not profile.row_sizes.size:
            return perf
        top = perf.max_batch
        dense = batch_shares(profile.size_share, expected_max(profile.row_sizes, top),
                             perf.runtime_table(1, top))
        return replace(perf, size_shares=tuple(float(dense[b]) for b in perf.batch_sizes))

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    def _row(self, degree: int) -> tuple[float, ...]:
        try:
            return self.runtime_s[self.degrees.index(degree)]
        except ValueError:
            raise ProfileError(f"{self.name!r} has no runtimes for {degree} devices; profiled "
                               f"degrees: {list(self.degrees)}") from None

    def memory(self, degree: int = 1) -> int:
        self._row(degree)
        return self.memory_bytes[self.degrees.index(degree)]

    def batch_runtime(self, batch_size: float, degree: int = 1) -> float:
        times = self._row(degree)
        if batch_size <= self.batch_sizes[-1]:
            return float(np.interp(batch_size, self.batch_sizes, times))
        return times[-1] / self.batch_sizes[-1] * batch_size

    def runtime_table(self, degree: int = 1, up_to: int | None = None) -> list[float]:
        """``table[b]`` = seconds for a batch of ``b`` rows, ``b = 0..up_to`` (``table[0] = 0``)."""
        top = self.max_batch if up_to is None else up_to
        sizes = np.arange(1, top + 1, dtype=np.float64)
        times = self._row(degree)
        table = np.interp(sizes, self.batch_sizes, times)
        beyond = sizes > self.batch_sizes[-1]
        table[beyond] = times[-1] / self.batch_sizes[-1] * sizes[beyond]
        return [0.0, *table.tolist()]

    def per_row_s(self, batch_size: int, degree: int = 1) -> float:
        return self.batch_runtime(batch_size, degree) / batch_size


@dataclass(frozen=True, eq=False)
class Catalog:
    """Models available to a plan: performance plus per-sample outcomes on one sample.

    ``quality[m]`` is model ``m``'s quality per sample row (1/0 correctness for accuracy;
    booleans are read as 1/0); ``scores[m]`` the class probabilities (rows x classes) that
    certainties are computed from, or the model's own certainty per row (rows,).

    ``gpu_perf`` (optional, for hardware with CPU workers and GPUs) holds every model's
    performance on a GPU, used for replicas on devices whose id names a GPU
    (``workload.is_gpu_id``); ``perf`` is then the CPU workers'. Without it ``perf`` is used
    on every device. ``perf_on(model, device)`` picks.
    """

    perf: Mapping[str, ModelPerf]
    quality: Mapping[str, np.ndarray] = field(repr=False)
    scores: Mapping[str, np.ndarray] = field(repr=False)
    sample_hash: str = ""
    gpu_perf: Mapping[str, ModelPerf] = field(default_factory=dict, repr=False)
    # each sample row's size per model (``Profile.row_sizes``: as that model counts sizes,
    # tokens or characters), or one array for every model; None or a model left out:
    # unknown, every row average
    row_sizes: Mapping[str, np.ndarray] | np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "perf", MappingProxyType(dict(self.perf)))
        object.__setattr__(self, "gpu_perf", MappingProxyType(dict(self.gpu_perf)))
        if self.gpu_perf and set(self.gpu_perf) != set(self.perf):
            raise ProfileError("GPU performance must cover the catalog's models: got "
                               f"{sorted(self.gpu_perf)} for {sorted(self.perf)}")
        object.__setattr__(self, "quality", MappingProxyType(
            {m: np.asarray(c, dtype=np.float64) for m, c in self.quality.items()}))
        object.__setattr__(self, "scores", MappingProxyType(
            {m: np.asarray(p, dtype=np.float64) for m, p in self.scores.items()}))
        if not self.perf:
            raise ProfileError("a catalog needs at least one model")
        if set(self.perf) != set(self.quality) or set(self.perf) != set(self.scores):
            raise ProfileError("a catalog needs performance and per-sample outcomes for the "
                               f"same models; got {sorted(self.perf)} vs {sorted(self.quality)}")
        sizes = {c.shape[0] for c in self.quality.values()}
        sizes |= {p.shape[0] for p in self.scores.values()}
        if len(sizes) != 1 or 0 in sizes:
            raise ProfileError(f"per-sample outcomes must cover the same non-empty sample; "
                               f"row counts: {sorted(sizes)}")
        given = self.row_sizes
        if given is None:
            given = {}
        elif not isinstance(given, Mapping):
            given = dict.fromkeys(self.perf, given)
        unknown = sorted(set(given) - set(self.perf))
        if unknown:
            raise ProfileError(f"row sizes of {unknown}, which the catalog has no profile of")
        checked = {m: np.asarray(v, dtype=np.float64) for m, v in given.items()}
        for m, v in checked.items():
            if v.shape != (next(iter(sizes)),):
                raise ProfileError(f"row sizes of {m} cover {v.shape[0]} rows of a "
                                   f"{next(iter(sizes))}-row sample")
        object.__setattr__(self, "row_sizes", MappingProxyType(checked))

    def with_overhead(self, seconds: float) -> Catalog:
        """Every model's batches ``seconds`` longer (``ModelPerf.with_overhead``)."""
        if not seconds:
            return self
        return self.with_perf({m: p.with_overhead(seconds) for m, p in self.perf.items()},
                              {m: p.with_overhead(seconds) for m, p in self.gpu_perf.items()})

    def with_perf(self, perf: Mapping[str, ModelPerf],
                  gpu_perf: Mapping[str, ModelPerf] | None = None) -> Catalog:
        """The same outcomes with other performance (``gpu_perf`` None: kept)."""
        return Catalog(perf, dict(self.quality), dict(self.scores), self.sample_hash,
                       dict(self.gpu_perf) if gpu_perf is None else gpu_perf,
                       dict(self.row_sizes))

    def perf_on(self, model: str, device: str | Sequence[str]) -> ModelPerf:
        """``model``'s performance on ``device`` (or on the first of a replica's devices)."""
        first = device if isinstance(device, str) else device[0]
        if self.gpu_perf and is_gpu_id(first):
            return self.gpu_perf[self._known(model)]
        return self.perf[self._known(model)]

    def __reduce__(self) -> tuple:
        # mapping proxies do not pickle; rebuild from plain dicts (e.g. in planner workers)
        return (Catalog, (dict(self.perf), dict(self.quality), dict(self.scores),
                          self.sample_hash, dict(self.gpu_perf), dict(self.row_sizes)))

    @classmethod
    def from_profiles(cls, profiles: Mapping[str, Profile] | Sequence[Profile]) -> Catalog:
        items = list(profiles.values()) if isinstance(profiles, Mapping) else list(profiles)
        return cls({p.model: ModelPerf.from_profile(p) for p in items},
                   {p.model: p.quality for p in items},
                   {p.model: p.scores for p in items},
                   items[0].sample_hash if items else "",
                   row_sizes={p.model: p.row_sizes for p in items if p.row_sizes.size})

    def sizes_of(self, model: str) -> np.ndarray | None:
        """Each sample row's size as ``model`` counts it, or None where unknown."""
        return self.row_sizes.get(model)

    def size_factors(self, model: str, device: str | Sequence[str], max_batch: int
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        """What scales a batch of ``model`` on ``device`` by the size of its rows: for
        ``b = 0..max_batch``, the share of a ``b``-row batch's runtime that grows with its
        largest row (``ModelPerf.shares_table``) and the expected size of the largest of ``b``
        rows drawn from the sample (so that random batches average their profiled runtime);
        None when the catalog has no row sizes of the model or the model no size share. (The
        shares are taken at one device whatever the replica's degree.)"""
        perf = self.perf_on(model, device)
        sizes = self.sizes_of(model)
        if sizes is None or perf.size_share <= 0 or not sizes.size:
            return None
        # every simulation of a plan asks for the same tables
        key = (model, perf is not self.perf.get(model), max_batch)
        cache = self._size_factor_cache
        if key not in cache:
            cache[key] = (perf.shares_table(max_batch), expected_max(sizes, max_batch))
        return cache[key]

    @cached_property
    def _size_factor_cache(self) -> dict[tuple[str, bool, int], tuple[np.ndarray, np.ndarray]]:
        return {}

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(sorted(self.perf))

    @property
    def num_rows(self) -> int:
        return int(next(iter(self.quality.values())).shape[0])

    @cached_property
    def _certainty_cache(self) -> dict[tuple[str, str], np.ndarray]:
        return {}

    def certainty(self, model: str, kind: str = "max_prob") -> np.ndarray:
        key = (model, kind)
        cache = self._certainty_cache
        if key not in cache:
            cache[key] = certainty_of(self.scores[self._known(model)], kind)
        return cache[key]

    def _known(self, model: str) -> str:
        if model not in self.perf:
            raise ProfileError(f"model {model!r} is not in the catalog; known: "
                               f"{list(self.models)}")
        return model

    def stage_fractions(self, cascade: Cascade) -> tuple[float, ...]:
        """Fraction of sample rows that reach each stage of ``cascade``."""
        active = np.ones(self.num_rows, dtype=bool)
        out = []
        for i, model in enumerate(cascade.models):
            self._known(model)
            out.append(float(active.mean()))
            active &= cascade.escalates(i, self.certainty(model, cascade.certainty))
        return tuple(out)

    def quality_per_row(self, cascade: Cascade) -> np.ndarray:
        """The quality of the cascade's answer, per sample row."""
        result = np.zeros(self.num_rows, dtype=np.float64)
        active = np.ones(self.num_rows, dtype=bool)
        for i, model in enumerate(cascade.models):
            self._known(model)
            done = active & ~cascade.escalates(i, self.certainty(model, cascade.certainty))
            result[done] = self.quality[model][done]
            active &= ~done
        return result

    def accuracy(self, cascade: Cascade) -> float:
        """Mean per-row quality of ``cascade`` (its accuracy under the sample's metric)."""
        return float(self.quality_per_row(cascade).mean())


def expected_max(values: np.ndarray, up_to: int) -> np.ndarray:
    """``out[b]``: the expected largest of ``b`` values drawn with replacement from
    ``values`` (``out[0] = 0``), from the order statistics of their empirical distribution."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    n = x.size
    cdf = np.arange(n + 1, dtype=np.float64) / n  # P(draw <= x_(k)), k = 0..n
    out = np.zeros(up_to + 1)
    for b in range(1, up_to + 1):
        p = cdf ** b
        out[b] = float(np.dot(x, p[1:] - p[:-1]))
    return out


def batch_shares(share: float, expected: np.ndarray, runtimes: Sequence[float]) -> np.ndarray:
    """``out[b]``: the share of a ``b``-row batch's runtime that grows with its largest row's
    size, from a one-row call's ``share`` (``Profile.size_share``), ``expected[b]`` (the
    expected largest size of ``b`` rows) and ``runtimes[b]`` (a ``b``-row batch's runtime,
    ``runtimes[0]`` unused). A batch pads every row to its largest, so the size-bound part of
    a one-row call on the mean row, ``share * runtimes[1]``, grows to ``b * expected[b] /
    expected[1]`` times as much, while the rest of the batch's runtime does not; capped at 1.
    (With one share for every size, the residuals of batches of 2-4 rows grew with their
    largest row's tokens: ``benchmarks/call_rows.py``.)"""
    out = np.zeros(expected.size)
    if expected.size < 2 or expected[1] <= 0:
        return out
    per_size = share * runtimes[1] / expected[1]  # seconds per unit of size in one row
    for b in range(1, expected.size):
        if runtimes[b] > 0:
            out[b] = min(1.0, per_size * b * expected[b] / runtimes[b])
    return out


def sized_runtime(seconds: float, sizing: tuple[np.ndarray, np.ndarray] | None, rows: int,
                  largest: float) -> float:
    """``seconds`` (a batch of ``rows`` rows' profiled runtime) scaled by its largest row's
    size, with ``sizing`` from ``Catalog.size_factors`` (None: unscaled): what the simulator
    charges a batch, and what calibration compares serving calls with."""
    if sizing is None or largest <= 0:
        return seconds
    shares, expected = sizing
    b = min(rows, expected.size - 1)
    return seconds * size_factor(float(shares[b]), largest, expected[b])


def size_factor(share: float, largest: float, expected: float) -> float:
    """How much longer than its profiled runtime a batch whose largest row has size
    ``largest`` runs, where an average batch of its size has ``expected``: the size-bound
    share of the runtime scales with the ratio, the rest stays."""
    if expected <= 0:
        return 1.0
    return (1.0 - share) + share * largest / expected


def sustained_qps(catalog: Catalog, cascade: Cascade, devices: int | Hardware) -> float:
    """Rows/s that ``devices`` equal workers (or the devices of a ``Hardware``, each at its own
    speed) sustain running ``cascade`` flat out.

    ``devices / sum_i(f_i * s_i)``: ``f_i`` is the fraction of rows reaching stage ``i`` and
    ``s_i`` that model's seconds per row at its throughput-optimal (profiled) batch size.
    """
    fractions = catalog.stage_fractions(cascade)

    def rate(device: str) -> float:  # "" (no GPU id): the catalog's default perf
        seconds = 0.0
        for model, fraction in zip(cascade.models, fractions, strict=True):
            perf = catalog.perf_on(model, device)
            seconds += fraction * min(perf.per_row_s(b) for b in perf.batch_sizes)
        return 1.0 / seconds

    if isinstance(devices, Hardware):
        return sum(rate(d.id) for d in devices.devices)
    return devices * rate("")
