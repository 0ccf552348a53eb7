"""Profiles: measured runtime per batch size, memory, and per-sample outcomes of one model.

A profile is what the offline phase plans with, so that re-planning never re-runs models. Per
sample row it holds the model's value, its certainty (class probabilities for classifiers, from
which every certainty function is computed, else the model's own certainty) and the value's
quality under the evaluation sample's metric. It is stored as a JSON header plus a Parquet
table, in a folder keyed by (model fingerprint, hardware, data) under ``KEN_HOME/profiles``.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ken import store
from ken.errors import ProfileError, StoreError
from ken.machine import OtherLoad, least_loaded
from ken.models.certainty import certainty_of
from ken.models.datasets import LabelledSample
from ken.models.model import DeviceConfig, Model, ModelOutput, Prediction
from ken.models.quality import EvalSample
from ken.paths import ken_home
from ken.progress import QUIET, Reporter

SCHEMA_VERSION = 2
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
#: every batch size is timed on at least this many rows (see ``measure_batch_runtimes``)
MIN_TIMED_ROWS = 32
#: part of the cache key: profiles timed by an older method are measured again
TIMING_METHOD = "timing-v4"  # v3: per-row sizes and the runtime's share that grows with them;
# v4: sizes as the model counts them (tokens for a transformers classifier, not characters)


@dataclass(frozen=True, eq=False)
class Profile:
    """One model on one hardware configuration, measured on one evaluation sample.

    ``scores`` are the class probabilities (rows x classes, float32) of a classifier, or the
    model's own certainty per row (rows,) for other outputs; ``quality`` is each row's quality
    under ``metric`` (1/0 correctness for accuracy); ``values`` the model's value per row.
    """

    model: str
    hardware: str
    batch_sizes: tuple[int, ...]
    batch_runtime_s: tuple[float, ...]  # median seconds for one batch of each size
    memory_bytes: int  # resident weights
    peak_memory_bytes: int  # at the largest batch: process RSS (CPU), weights + batch (GPU)
    label_names: tuple[str, ...]  # a classifier's labels; () for other outputs
    sample_name: str
    sample_hash: str
    model_fingerprint: str
    quality: np.ndarray = field(repr=False)  # float64 (rows,)
    scores: np.ndarray = field(repr=False)  # float32 (rows, classes) or float64 (rows,)
    values: tuple = field(default=(), repr=False)  # per-row values (may be empty if unknown)
    num_params: int = 0
    metric: str = "accuracy"
    # each row's size as the model counts it (``Model.row_sizes``: the tokens it runs, or the
    # characters of its text) and the share of a one-row call's runtime that grows with the
    # size (``size_share``; 0: none measured)
    row_sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    size_share: float = 0.0
    #: cores other programs kept busy while the runtimes were timed (``ken.machine.OtherLoad``;
    #: None: not read, or a profile from before it was)
    other_cores: float | None = None

    def __post_init__(self) -> None:
        if len(self.batch_sizes) != len(self.batch_runtime_s) or not self.batch_sizes:
            raise ProfileError(
                f"profile of {self.model}: batch sizes and runtimes differ in length"
            )
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ProfileError(f"profile of {self.model}: batch sizes must be increasing")
        object.__setattr__(self, "quality", np.asarray(self.quality, dtype=np.float64))
        n = self.quality.shape[0]
        object.__setattr__(self, "row_sizes", np.asarray(self.row_sizes, dtype=np.int64))
        if self.scores.shape[0] != n or (self.values and len(self.values) != n) \
                or self.row_sizes.shape[0] not in (0, n):
            raise ProfileError(f"profile of {self.model}: per-sample arrays differ in length")
        if not 0.0 <= self.size_share <= 1.0:
            raise ProfileError(f"profile of {self.model}: size_share must be in [0, 1], got "
                               f"{self.size_share}")

    @property
    def num_rows(self) -> int:
        return int(self.quality.shape[0])

    @property
    def accuracy(self) -> float:
        """Mean per-row quality on the sample (accuracy, or the sample's metric)."""
        return float(self.quality.mean()) if self.num_rows else 0.0

    def certainty(self, name: str = "max_prob") -> np.ndarray:
        return certainty_of(self.scores, name)

    def batch_runtime(self, batch_size: float) -> float:
        """Seconds for one batch, linearly interpolated between profiled sizes.

        Beyond the largest profiled size the per-row cost of the largest batch is extrapolated.
        """
        sizes = np.asarray(self.batch_sizes, dtype=np.float64)
        times = np.asarray(self.batch_runtime_s, dtype=np.float64)
        if batch_size <= sizes[-1]:
            return float(np.interp(batch_size, sizes, times))
        return float(times[-1] / sizes[-1] * batch_size)

    def ms_per_row(self, batch_size: int) -> float:
        return self.batch_runtime(batch_size) / batch_size * 1000.0

    def best_batch_size(self) -> int:
        """The profiled batch size with the lowest time per row (throughput-optimal)."""
        per_row = np.asarray(self.batch_runtime_s) / np.asarray(self.batch_sizes)
        return int(self.batch_sizes[int(np.argmin(per_row))])

    # -- storage -----------------------------------------------------------------------------

    def header(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "hardware": self.hardware,
            "batch_sizes": list(self.batch_sizes),
            "batch_runtime_s": list(self.batch_runtime_s),
            "memory_bytes": self.memory_bytes,
            "peak_memory_bytes": self.peak_memory_bytes,
            "label_names": list(self.label_names),
            "metric": self.metric,
            "sample_name": self.sample_name,
            "sample_hash": self.sample_hash,
            "model_fingerprint": self.model_fingerprint,
            "num_params": self.num_params,
            "num_rows": self.num_rows,
            "accuracy": self.accuracy,
            "size_share": self.size_share,
            "other_cores": self.other_cores,
        }

    def save(self, folder: Path) -> Path:
        """Write the profile to ``folder`` as a store entry: built in a staging folder with its
        manifest and renamed into place whole."""
        columns = {
            "row": pa.array(np.arange(self.num_rows), pa.int64()),
            "quality": pa.array(self.quality, pa.float64()),
            "value": pa.array([json.dumps(v, default=str) for v in self.values]
                              if self.values else [None] * self.num_rows, pa.string()),
        }
        if self.row_sizes.size:
            columns["size"] = pa.array(self.row_sizes, pa.int64())
        if self.scores.ndim == 2:
            columns["probabilities"] = pa.array(list(self.scores.astype(np.float32)),
                                                pa.list_(pa.float32()))
        else:
            columns["certainty"] = pa.array(self.scores, pa.float64())
        with store.staging_dir(folder) as staging:
            pq.write_table(pa.table(columns), staging / "samples.parquet")
            (staging / "header.json").write_text(json.dumps(self.header(), indent=2))
            store.seal(store.Entry(staging, "", ""))
        return folder

    @classmethod
    def load(cls, folder: Path) -> Profile:
        """The profile in ``folder``, its files verified first (StoreError names a damaged
        file; ProfileError when there is none)."""
        folder = Path(folder)
        if not (folder / "header.json").exists():
            raise ProfileError(f"no profile at {folder}; run `ken profile` to create it")
        store.ensure(profile_entry(folder))
        try:
            header = json.loads((folder / "header.json").read_text())
        except (OSError, ValueError) as exc:
            raise StoreError(f"model store: {folder / 'header.json'} cannot be read ({exc}); "
                             f"{_PROFILE_FIX}") from None
        if header.get("schema_version") != SCHEMA_VERSION:
            raise ProfileError(
                f"profile at {folder} has schema version {header.get('schema_version')}, "
                f"this KEN reads version {SCHEMA_VERSION}; delete it and run `ken profile` again"
            )
        try:
            table = pq.read_table(folder / "samples.parquet")
        except (OSError, pa.ArrowException) as exc:
            raise StoreError(f"model store: {folder / 'samples.parquet'} cannot be read "
                             f"({exc}); {_PROFILE_FIX}") from None
        if "probabilities" in table.column_names:
            scores = np.asarray(table.column("probabilities").to_pylist(), dtype=np.float32)
            scores = scores.reshape(table.num_rows, len(header["label_names"]))
        else:
            scores = table.column("certainty").to_numpy().astype(np.float64)
        raw = table.column("value").to_pylist()
        values = tuple(json.loads(v) for v in raw) if raw and raw[0] is not None else ()
        return cls(
            model=header["model"],
            hardware=header["hardware"],
            batch_sizes=tuple(header["batch_sizes"]),
            batch_runtime_s=tuple(header["batch_runtime_s"]),
            memory_bytes=header["memory_bytes"],
            peak_memory_bytes=header["peak_memory_bytes"],
            label_names=tuple(header["label_names"]),
            sample_name=header["sample_name"],
            sample_hash=header["sample_hash"],
            model_fingerprint=header["model_fingerprint"],
            num_params=header.get("num_params", 0),
            metric=header.get("metric", "accuracy"),
            quality=table.column("quality").to_numpy().astype(np.float64),
            scores=scores,
            values=values,
            row_sizes=(table.column("size").to_numpy() if "size" in table.column_names
                       else np.zeros(0, np.int64)),
            size_share=float(header.get("size_share", 0.0)),
            other_cores=header.get("other_cores"),
        )


_PROFILE_FIX = "it is measured again on next use (`ken profile`, or the query that needs it)"


def profile_entry(folder: Path) -> store.Entry:
    """The store entry of the profile in ``folder`` (header and per-sample Parquet table)."""
    folder = Path(folder)
    return store.Entry(folder, f"the profile {folder.name}", _PROFILE_FIX,
                       legacy=_adopt_profile)


def _adopt_profile(entry: store.Entry) -> tuple[str, ...]:
    """Check a profile written before ken kept manifests: its header parses with this schema
    and its Parquet table is complete with as many rows as the header says."""
    header = store.check_json(entry.root / "header.json", entry)
    table_path = entry.root / "samples.parquet"
    problem = ""
    if not isinstance(header, dict) or header.get("schema_version") != SCHEMA_VERSION:
        problem = f"{entry.root / 'header.json'} is not a profile header of this ken"
    else:
        try:
            rows = pq.read_metadata(table_path).num_rows
            if rows != header.get("num_rows"):
                problem = (f"{table_path} has {rows} rows, its header says "
                           f"{header.get('num_rows')}")
        except (OSError, pa.ArrowException) as exc:
            problem = f"{table_path} is not a complete Parquet file ({exc})"
    if problem:
        raise StoreError(f"model store: {problem}. It belongs to {entry.what}. To fix it: "
                         f"{entry.fix}.")
    return ("header.json", "samples.parquet")


def store_entries(home: Path) -> list[store.Entry]:
    """Every profile folder in ``home``."""
    return [profile_entry(folder) for folder in sorted((home / "profiles").glob("*"))
            if folder.is_dir() and not store.is_leftover(folder)]


# -- measuring ---------------------------------------------------------------------------------


def hardware_fingerprint(device: DeviceConfig) -> str:
    """Device label plus what makes timings comparable: CPU model, architecture, torch version,
    and for a GPU its name and CUDA version (an H100's profile is not an A100's)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    text = f"{device.label}|{cpu}|{platform.machine()}|torch-{torch.__version__}"
    if device.kind == "cuda":
        text += f"|{torch.cuda.get_device_name(device.index)}|cuda-{torch.version.cuda}"
    return text


Sample = EvalSample | LabelledSample


def sample_hash(sample: Sample) -> str:
    """The hash a profile records: that of the evaluation sample, so the same rows profiled
    as a ``LabelledSample`` or as its ``as_eval()`` share profiles and combine in cascades."""
    return (sample.as_eval() if isinstance(sample, LabelledSample) else sample).content_hash


def profile_key(model: Model, sample: Sample, batch_sizes: Sequence[int]) -> str:
    text = "|".join(
        [TIMING_METHOD, model.spec.fingerprint or model.spec.name,
         hardware_fingerprint(model.device),
         sample_hash(sample), ",".join(map(str, batch_sizes))]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def profile_dir(model: Model, sample: Sample, batch_sizes: Sequence[int],
                home: Path | None = None) -> Path:
    base = (home or ken_home()) / "profiles"
    return base / f"{model.name}-{model.device.label}-{profile_key(model, sample, batch_sizes)}"


def _read_status_kb(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _reset_peak(device: DeviceConfig) -> int:
    """Start measuring peak memory: the process's RSS on a CPU; on a GPU the allocator's peak,
    returning what is allocated there now (every model loaded on it, not only this one)."""
    if device.kind == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device.index)
        return int(torch.cuda.memory_allocated(device.index))
    _reset_peak_rss()
    return 0


def _peak_bytes(device: DeviceConfig, baseline: int) -> int:
    """Peak memory since ``_reset_peak``: the process's peak RSS on a CPU; on a GPU the most
    the batch allocated beyond ``baseline`` (activations, KV cache), other models left out."""
    if device.kind == "cuda":
        import torch

        return max(0, int(torch.cuda.max_memory_allocated(device.index)) - baseline)
    return _read_status_kb("VmHWM") * 1024


def measure_batch_runtimes(
    model: Model, texts: Sequence[str], batch_sizes: Sequence[int], repeats: int = 3,
    on_step: Callable[[int], None] | None = None,
    answers: dict[int, tuple] | None = None,
    single: list[tuple[int, float]] | None = None,
) -> tuple[list[float], int]:
    """Median seconds per batch for each size, and peak memory (RSS; on a GPU, what the
    largest batch allocated beyond the models already there). ``single``, when given,
    receives ``(row, seconds)`` of every one-row batch (for ``size_share``).

    Each size is timed on at least ``repeats`` batches and at least ``MIN_TIMED_ROWS`` rows:
    a text's runtime depends on its length, so the median of three single tweets is a noisy
    estimate of the typical single-row runtime. The timed batches are consecutive slices of
    ``texts`` (wrapping around), so they cover as many distinct rows as they can; when
    ``answers`` is given, each row's first answer goes there as ``row -> (value, scores,
    label names)`` (the profile keeps them instead of running those rows again).
    """
    if not texts:
        raise ProfileError("cannot time a model on an empty sample")
    model.predict(list(texts[: min(8, len(texts))]), batch_size=8)  # warm-up
    if model.device.kind == "cuda":  # every batch shape seen once (``Model.warm_up``)
        model.warm_up(max(batch_sizes))
    runtimes: list[float] = []
    peak = baseline = 0
    offset = 0
    for size in batch_sizes:
        if size == batch_sizes[-1]:
            baseline = _reset_peak(model.device)
        times = []
        for _ in range(max(repeats, -(-MIN_TIMED_ROWS // size))):
            rows = [(offset + i) % len(texts) for i in range(size)]
            offset += size
            chunk = [texts[i] for i in rows]
            t0 = time.perf_counter()
            out = model.predict(chunk, batch_size=size)
            times.append(time.perf_counter() - t0)
            if single is not None and size == 1:
                single.append((rows[0], times[-1]))
            if len(out.values) != size:
                raise ProfileError(f"{model.name} returned {len(out.values)} values for a "
                                   f"batch of {size}")
            if answers is not None:
                names = _label_names(out)
                for row, value, score in zip(rows, out.values, _row_scores(out), strict=True):
                    answers.setdefault(row, (value, score, names))
        runtimes.append(float(np.median(times)))
        if size == batch_sizes[-1]:
            peak = _peak_bytes(model.device, baseline)
        if on_step:
            on_step(size)
    return runtimes, peak


def _label_names(out: ModelOutput) -> tuple[str, ...]:
    return tuple(out.label_names) if isinstance(out, Prediction) else ()


def _row_scores(out: ModelOutput) -> np.ndarray:
    """What a profile keeps per row: class probabilities, or the model's own certainty."""
    if isinstance(out, Prediction):
        return out.probabilities.astype(np.float32)
    return out.certainty().astype(np.float64)


def run_profile(
    model: Model, sample: Sample, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    repeats: int = 3, on_step: Callable[[int], None] | None = None,
    reporter: Reporter = QUIET, attempts: int = 3,
    other_load: Callable[[], OtherLoad] = OtherLoad,
) -> Profile:
    """Measure ``model`` on ``sample``: batch runtimes, memory, values, certainty, quality.

    Rows the timing already ran keep those answers; the rest run once more at batch 32.
    ``on_step`` is called after each batch size and once more (with 0) after the predictions.
    While the runtimes are timed, ``other_load`` reads how many cores other programs kept
    busy; at ``machine.BUSY_CORES`` or more they are timed again, up to ``attempts`` times in
    all, and those timed beside the least other load are kept (``Profile.other_cores``), with
    a warning when every attempt was busy (``machine.least_loaded``, as a calibration is).
    """
    if isinstance(sample, LabelledSample):
        if tuple(model.spec.labels) != tuple(sample.label_names):
            raise ProfileError(
                f"model {model.name} predicts {model.spec.labels} but sample {sample.name} is "
                f"labelled {sample.label_names}"
            )
    recorded_hash = sample_hash(sample)
    if isinstance(sample, LabelledSample):
        sample = sample.as_eval()
    inputs = list(sample.inputs)
    answers: dict[int, tuple] = {}

    def timed(attempt: int) -> tuple[list[float], int, list[tuple[int, float]]]:
        single: list[tuple[int, float]] = []
        runtimes, peak = measure_batch_runtimes(model, inputs, batch_sizes, repeats,
                                                on_step if attempt == 1 else None, answers,
                                                single)
        return runtimes, peak, single

    (runtimes, peak, single), load, _ = least_loaded(
        timed, f"timing {model.name}", attempts, other_load, reporter.note, reporter.warn,
        "plans made from this profile expect slower calls than a quiet machine makes; "
        "profile again on a quiet machine (delete its folder under KEN_HOME/profiles)")
    sizes = np.asarray(model.row_sizes(inputs), dtype=np.int64)
    rest = [i for i in range(len(inputs)) if i not in answers]
    if rest:
        out = model.predict([inputs[i] for i in rest], batch_size=32)
        names = _label_names(out)
        answers.update((i, (value, score, names)) for i, value, score in
                       zip(rest, out.values, _row_scores(out), strict=True))
    if on_step:
        on_step(0)  # 0 marks the per-sample predictions, the step after the batch sizes
    values = tuple(_plain(answers[i][0]) for i in range(len(inputs)))
    scores = np.stack([answers[i][1] for i in range(len(inputs))])
    label_names = answers[0][2]
    if label_names:
        unknown = sorted({str(r) for r in sample.references} - set(label_names))
        if sample.metric in ("accuracy", "balanced_accuracy") and unknown and all(
                isinstance(r, str) for r in sample.references):
            raise ProfileError(f"model {model.name} predicts {label_names}, but sample "
                               f"{sample.name} has references {unknown[:5]}")
    return Profile(
        model=model.name,
        hardware=model.device.label,
        batch_sizes=tuple(batch_sizes),
        batch_runtime_s=tuple(runtimes),
        # what a replica needs of its device's budget: the weights on a CPU worker (a process
        # budget covers the rest); on a GPU its weights (in the precision loaded) plus what
        # its largest batch allocated (activations, KV cache)
        memory_bytes=model.spec.memory_bytes + (peak if model.device.kind == "cuda" else 0),
        peak_memory_bytes=(model.spec.memory_bytes + peak if model.device.kind == "cuda"
                           else peak),
        label_names=label_names,
        sample_name=sample.name,
        sample_hash=recorded_hash,
        model_fingerprint=model.spec.fingerprint,
        num_params=model.spec.num_params,
        metric=sample.metric,
        quality=sample.quality(values),
        scores=scores,
        values=values,
        row_sizes=sizes,
        size_share=size_share(sizes, single),
        other_cores=load.cores,
    )


#: one-row timings a size fit needs (the profile times at least ``MIN_TIMED_ROWS``)
MIN_SIZE_FIT_ROWS = 8


def size_share(sizes: np.ndarray, single: Sequence[tuple[int, float]]) -> float:
    """The share of a one-row call's runtime, on the sample's mean row, that grows with the
    row's size: a least-squares line ``seconds = a + s * size`` through the timed one-row
    calls, ``s * mean / (a + s * mean)``, in [0, 1]. 0 with too few calls, rows of one size,
    or no positive slope. (Runtime grows with length: a tweet's one-row call through
    MiniLM-L6 or SmolLM2 correlates 0.87-0.89 with its characters, and rows that escalate to
    a cascade's later stages are longer than the average row: ``benchmarks/row_size.py``.)"""
    if len(single) < MIN_SIZE_FIT_ROWS or not sizes.size:
        return 0.0
    x = np.array([sizes[r] for r, _ in single], dtype=np.float64)
    y = np.array([t for _, t in single], dtype=np.float64)
    if np.ptp(x) == 0:
        return 0.0
    slope, intercept = np.polyfit(x, y, 1)
    mean = float(sizes.mean())
    at_mean = intercept + slope * mean
    if slope <= 0 or at_mean <= 0:
        return 0.0
    return float(min(1.0, slope * mean / at_mean))


def _plain(value: object) -> object:
    """A value as a plain JSON-able Python object (numpy scalars unwrapped)."""
    return value.item() if isinstance(value, np.generic) else value


def load_or_run_profile(
    model: Model, sample: Sample, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    home: Path | None = None, repeats: int = 3, on_step: Callable[[int], None] | None = None,
    reporter: Reporter = QUIET,
) -> Profile:
    """The cached profile for (model, hardware, sample), measuring it on the first call and
    again when the cached one is damaged (under the store lock, so that two processes never
    measure the same model at once: the second waits, then reads the first one's profile)."""
    home = home or ken_home()
    folder = profile_dir(model, sample, batch_sizes, home)
    cached = _cached_profile(folder, reporter)
    if cached is None:
        with store.store_lock(home, f"profiling {model.name}", reporter.note):
            cached = _cached_profile(folder, QUIET)  # measured by another process meanwhile?
            if cached is None:
                profile = run_profile(model, sample, batch_sizes, repeats, on_step, reporter)
                profile.save(folder)
                return profile
    if on_step:  # report every step as done, so progress bars show a cache hit as complete
        for size in (*batch_sizes, 0):
            on_step(size)
    return cached


def _cached_profile(folder: Path, reporter: Reporter) -> Profile | None:
    """The verified profile in ``folder``, or None when there is none or it is damaged (the
    reporter says what is wrong; it is measured again)."""
    if not (folder / "header.json").exists():
        return None
    try:
        return Profile.load(folder)
    except (StoreError, ProfileError) as exc:
        reporter.note(f"{exc}\n  -> measuring it again")
        return None


def cached_profile(model: Model, sample: Sample, batch_sizes: Sequence[int],
                   home: Path | None = None) -> Profile | None:
    """The stored profile of ``model`` on ``sample`` if there is one and it verifies (None
    otherwise: ``load_or_run_profile`` measures it)."""
    return _cached_profile(profile_dir(model, sample, batch_sizes, home), QUIET)


def is_cached(model: Model, sample: Sample, batch_sizes: Sequence[int],
              home: Path | None = None) -> bool:
    """Whether a profile of ``model`` on ``sample`` is stored (not whether it verifies)."""
    return (profile_dir(model, sample, batch_sizes, home) / "header.json").exists()
