"""Hardware and workload descriptions the offline planner works with (DESIGN.md section 4).

``Hardware`` lists the devices a plan may place replicas on; ``Trace`` holds request arrival
times (and, for LLM traces, token counts); ``Workload`` ties a trace to the labelled sample whose
per-sample predictions give accuracy. All are frozen dataclasses with versioned JSON round-trips.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ken.errors import WorkloadError
from ken.paths import shared_data_dir

SCHEMA_VERSION = 1
AZURE_CODE_TRACE = Path("traces") / "AzureLLMInferenceTrace_code.csv"

DeviceKind = Literal["cpu", "cuda"]
_DEVICE_KINDS = ("cpu", "cuda")


#: the id of a GPU device: ``cuda{j}`` (``Hardware.local``) or ``n{k}.cuda{j}`` (a cluster)
GPU_ID = re.compile(r"(?:n\d+\.)?cuda(\d+)")


def is_gpu_id(device_id: str) -> bool:
    """Whether a device id names a GPU (``GPU_ID``): how plans, which carry device ids only,
    tell GPUs from CPU workers."""
    return GPU_ID.fullmatch(device_id) is not None


def _check_version(data: Mapping[str, Any], what: str) -> None:
    if data.get("schema_version") != SCHEMA_VERSION:
        raise WorkloadError(
            f"unsupported {what} schema version {data.get('schema_version')!r}; "
            f"this KEN reads version {SCHEMA_VERSION} — re-create the file with this version"
        )


@dataclass(frozen=True)
class Device:
    """One device; it runs one batch at a time (replicas placed on it time-share it)."""

    id: str
    kind: DeviceKind
    memory_bytes: int
    node: int = 0
    # seconds every batch on this device pays to reach it and come back beyond a local
    # worker's pipe: the router-to-actor hop of a Ray actor (measured by
    # ken.engine.ray_runner.measure_hop_s); the planner charges it per batch
    dispatch_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.id:
            raise WorkloadError("a device needs a non-empty id")
        if not (self.dispatch_s >= 0 and np.isfinite(self.dispatch_s)):
            raise WorkloadError(f"device {self.id}: dispatch_s must be >= 0 seconds")
        if self.kind not in _DEVICE_KINDS:
            raise WorkloadError(f"device {self.id}: kind must be one of {_DEVICE_KINDS}, "
                                f"not {self.kind!r}")
        if self.memory_bytes < 0:
            raise WorkloadError(f"device {self.id}: memory_bytes must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "kind": self.kind, "memory_bytes": int(self.memory_bytes),
               "node": int(self.node)}
        if self.dispatch_s:  # written only when set: older files and keys stay as they were
            out["dispatch_s"] = float(self.dispatch_s)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Device:
        return cls(id=str(data["id"]), kind=data["kind"], memory_bytes=int(data["memory_bytes"]),
                   node=int(data["node"]), dispatch_s=float(data.get("dispatch_s", 0.0)))


@dataclass(frozen=True)
class Hardware:
    """The devices available to a plan; ids are unique."""

    devices: tuple[Device, ...]
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices:
            raise WorkloadError("hardware needs at least one device")
        ids = [d.id for d in self.devices]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise WorkloadError(f"device ids must be unique; repeated: {dupes}")

    @classmethod
    def cpu_workers(cls, n: int, memory_bytes: int) -> Hardware:
        """``n`` CPU devices ``cpu0..cpu{n-1}`` on node 0, each with ``memory_bytes``."""
        if n < 1:
            raise WorkloadError(f"cpu_workers needs n >= 1, got {n}")
        return cls.local(n, memory_bytes)

    @classmethod
    def local(cls, cpu_devices: int, memory_bytes: int,
              gpu_memory_bytes: Sequence[int] = ()) -> Hardware:
        """The devices of this machine: ``cpu_devices`` CPU workers ``cpu0..`` of
        ``memory_bytes`` each, and one device ``cuda{j}`` per entry of ``gpu_memory_bytes``
        (GPU ``j`` as this process numbers it, with that budget: weights, activations and
        KV cache of the replicas placed on it)."""
        if cpu_devices < 0:
            raise WorkloadError(f"cpu_devices must be >= 0, got {cpu_devices}")
        return cls((*(Device(f"cpu{i}", "cpu", memory_bytes, 0) for i in range(cpu_devices)),
                    *(Device(f"cuda{j}", "cuda", int(m), 0)
                      for j, m in enumerate(gpu_memory_bytes))))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of device present (``("cpu",)``, ``("cuda",)`` or both), in that order."""
        return tuple(k for k in _DEVICE_KINDS if any(d.kind == k for d in self.devices))

    @classmethod
    def from_nodes(cls, nodes: Sequence[Mapping[str, Any]], threads_per_device: int = 1,
                   memory_bytes: int | None = None, gpu_memory_bytes: int | None = None,
                   dispatch_s: float = 0.0) -> Hardware:
        """The devices of a cluster whose nodes are described as Ray describes them
        (``ray.nodes()``: dicts with ``Alive`` and ``Resources`` holding ``CPU``, ``GPU`` and
        ``memory``), in the given order: node ``k`` gets CPU devices ``n{k}.cpu{i}`` of
        ``threads_per_device`` cores each and one device ``n{k}.cuda{j}`` per GPU. A CPU
        device's memory budget is ``memory_bytes``, or the node's memory shared among its
        CPU devices; a GPU's is ``gpu_memory_bytes`` (Ray does not report it: without it
        the GPUs are left out). Every device pays ``dispatch_s`` per batch (the hop to an
        actor). Nodes that are not alive are left out."""
        if threads_per_device < 1:
            raise WorkloadError(f"threads_per_device must be >= 1, got {threads_per_device}")
        devices: list[Device] = []
        alive = [n for n in nodes if n.get("Alive", True)]
        for k, node in enumerate(alive):
            res = node.get("Resources", {})
            cpus = int(res.get("CPU", 0)) // threads_per_device
            gpus = int(res.get("GPU", 0))
            memory = memory_bytes
            if memory is None and cpus:
                memory = int(res.get("memory", 0)) // cpus
            devices += [Device(f"n{k}.cpu{i}", "cpu", memory or 0, k, dispatch_s)
                        for i in range(cpus)]
            if gpu_memory_bytes is not None:  # Ray does not report GPU memory
                devices += [Device(f"n{k}.cuda{j}", "cuda", gpu_memory_bytes, k, dispatch_s)
                            for j in range(gpus)]
        if not devices:
            raise WorkloadError(f"the cluster's {len(alive)} live node(s) have no CPU with "
                                f"{threads_per_device} thread(s) to spare and no GPU")
        return cls(tuple(devices))

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.devices)

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted({d.node for d in self.devices}))

    @property
    def dispatch_s(self) -> float:
        """The largest per-batch hop of any device: what the planner charges every batch."""
        return max(d.dispatch_s for d in self.devices)

    def device(self, device_id: str) -> Device:
        for d in self.devices:
            if d.id == device_id:
                return d
        raise WorkloadError(f"unknown device {device_id!r}; known: {list(self.ids)}")

    def to_json(self) -> str:
        return json.dumps({"schema_version": SCHEMA_VERSION,
                           "devices": [d.to_dict() for d in self.devices]})

    @classmethod
    def from_json(cls, text: str) -> Hardware:
        data = json.loads(text)
        _check_version(data, "hardware")
        return cls(tuple(Device.from_dict(d) for d in data["devices"]))


def _optional_int_array(values: Any) -> np.ndarray | None:
    return None if values is None else np.asarray(values, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class Trace:
    """Request arrival times in seconds from the first arrival (sorted, starting at >= 0).

    ``context_tokens``/``generated_tokens`` are per-request token counts for LLM traces, else None.
    """

    arrival_s: np.ndarray = field(repr=False)
    name: str = "trace"
    context_tokens: np.ndarray | None = field(default=None, repr=False)
    generated_tokens: np.ndarray | None = field(default=None, repr=False)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        arr = np.asarray(self.arrival_s, dtype=np.float64)
        if arr.ndim != 1 or arr.size == 0:
            raise WorkloadError(f"trace {self.name!r} is empty; a trace needs >= 1 arrival")
        if not np.all(np.isfinite(arr)) or arr[0] < 0 or np.any(np.diff(arr) < 0):
            raise WorkloadError(f"trace {self.name!r}: arrival times must be finite, >= 0 and "
                                "sorted")
        object.__setattr__(self, "arrival_s", arr)
        for name in ("context_tokens", "generated_tokens"):
            tokens = _optional_int_array(getattr(self, name))
            if tokens is not None and tokens.shape != arr.shape:
                raise WorkloadError(f"trace {self.name!r}: {name} has {tokens.shape[0]} entries "
                                    f"for {arr.size} arrivals")
            object.__setattr__(self, name, tokens)

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    @property
    def num_requests(self) -> int:
        return len(self)

    @property
    def duration_s(self) -> float:
        """Time of the last arrival (the trace starts at 0)."""
        return float(self.arrival_s[-1])

    @property
    def mean_qps(self) -> float:
        return len(self) / self.duration_s if self.duration_s > 0 else float("inf")

    def _with(self, arrival_s: np.ndarray, idx: slice | None, name: str) -> Trace:
        """A trace with new arrival times; token arrays are sliced by ``idx`` (None: kept)."""

        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return a if a is None or idx is None else a[idx]

        return Trace(arrival_s, name, pick(self.context_tokens), pick(self.generated_tokens))

    def rate_scaled(self, factor: float) -> Trace:
        """The same arrival pattern at ``factor`` times the rate (times divided by ``factor``)."""
        if not factor > 0 or not np.isfinite(factor):
            raise WorkloadError(f"rate factor must be a positive number, got {factor}")
        return self._with(self.arrival_s / factor, None, f"{self.name}x{factor:g}")

    def window(self, start_s: float, duration_s: float) -> Trace:
        """Arrivals in ``[start_s, start_s + duration_s)``, re-based so the window starts at 0.

        The re-based trace keeps the offset of its first arrival from ``start_s`` (it does not
        shift the first arrival to 0), so the idle gap at the start of the window is preserved.
        """
        if duration_s <= 0 or start_s < 0:
            raise WorkloadError(f"window needs start_s >= 0 and duration_s > 0, got "
                                f"{start_s}, {duration_s}")
        lo, hi = np.searchsorted(self.arrival_s, [start_s, start_s + duration_s], side="left")
        if hi <= lo:
            raise WorkloadError(f"trace {self.name!r} has no arrivals in "
                                f"[{start_s}, {start_s + duration_s}) s")
        idx = slice(int(lo), int(hi))
        return self._with(self.arrival_s[idx] - start_s, idx,
                          f"{self.name}[{start_s:g}+{duration_s:g}s]")

    def around_peak(self, duration_s: float) -> Trace:
        """The ``duration_s`` window around the busiest 1-s bucket; it starts on a whole
        second, so the window's 1-s buckets (and its peak) are the trace's own."""
        if self.duration_s <= duration_s:
            return self
        counts = np.bincount(np.floor(self.arrival_s).astype(np.int64))
        peak_at = int(np.argmax(counts))
        start = min(max(0, peak_at - int(duration_s // 2)), int(self.duration_s - duration_s))
        return self.window(float(max(start, 0)), duration_s)

    def qps_max(self, window_s: float = 1.0) -> float:
        """Peak rate: the most arrivals in one *bucketed* window, divided by ``window_s``.

        Buckets are ``[k * window_s, (k + 1) * window_s)`` from time 0 (fixed, not sliding), as
        the gear plan's rate meter also counts in fixed windows.
        """
        if window_s <= 0:
            raise WorkloadError(f"window_s must be > 0, got {window_s}")
        buckets = np.floor(self.arrival_s / window_s).astype(np.int64)
        return float(np.bincount(buckets).max()) / window_s

    def request_qps(self, window_s: float = 1.0) -> float:
        """The rate a request arrives in, on average over the requests: each request counts its
        ``window_s`` bucket's arrivals per second (``qps_max``'s buckets, the request itself
        included). About the mean rate for steady arrivals; near the busy periods' rate for a
        bursty trace, whose mean is mostly quiet time few requests see (`ken plan`'s Azure
        trace with a 135-qps peak: 10 qps on average, 55 as its requests met it)."""
        if window_s <= 0:
            raise WorkloadError(f"window_s must be > 0, got {window_s}")
        counts = np.bincount(np.floor(self.arrival_s / window_s).astype(np.int64))
        return float((counts.astype(float) ** 2).sum() / counts.sum()) / window_s

    def to_dict(self) -> dict[str, Any]:
        def opt(a: np.ndarray | None) -> list[int] | None:
            return None if a is None else a.tolist()

        return {"schema_version": SCHEMA_VERSION, "name": self.name,
                "arrival_s": self.arrival_s.tolist(),
                "context_tokens": opt(self.context_tokens),
                "generated_tokens": opt(self.generated_tokens)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trace:
        _check_version(data, "trace")
        return cls(np.asarray(data["arrival_s"], dtype=np.float64), str(data["name"]),
                   data.get("context_tokens"), data.get("generated_tokens"))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Trace:
        return cls.from_dict(json.loads(text))


def fit_peak(make: Callable[[float], Trace], start: float, peak_qps: float,
             window_s: float = 1.0) -> Trace:
    """``make(x)`` for the ``x`` whose trace has a peak rate (arrivals in the busiest fixed
    ``window_s`` bucket, per second) closest to ``peak_qps`` (``fit_peak_scale``)."""
    return fit_peak_scale(make, start, peak_qps, window_s)[1]


def fit_peak_scale(make: Callable[[float], Trace], start: float, peak_qps: float,
                   window_s: float = 1.0) -> tuple[float, Trace]:
    """The ``x`` whose trace ``make(x)`` has a peak rate (arrivals in the busiest fixed
    ``window_s`` bucket, per second) closest to ``peak_qps``, and that trace.

    Peaks are counts in fixed buckets, so they move in steps as ``x`` scales the rate; a few
    multiplicative corrections get within one step. For low rates (a few requests per second)
    a 1-s bucket holds one or two arrivals whatever the scale: measure over a longer window.
    """
    x, best, best_x = start, None, start
    for _ in range(12):
        trace = make(x)
        got = trace.qps_max(window_s)
        if best is None or abs(got - peak_qps) < abs(best.qps_max(window_s) - peak_qps):
            best, best_x = trace, x
        if abs(got - peak_qps) * window_s < 1.0:
            break
        x *= peak_qps / got
    assert best is not None
    return best_x, best


def load_azure_trace(path: str | Path | None = None) -> Trace:
    """The Azure LLM inference trace (``TIMESTAMP,ContextTokens,GeneratedTokens`` CSV).

    Timestamps look like ``2023-11-16 18:17:03.9799600``; they become seconds from the first
    arrival. Defaults to ``<shared data>/traces/AzureLLMInferenceTrace_code.csv``.
    """
    p = Path(path) if path is not None else shared_data_dir() / AZURE_CODE_TRACE
    if not p.is_file():
        raise WorkloadError(
            f"Azure trace not found at {p}; it should be in the shared data folder as "
            f"{AZURE_CODE_TRACE} (set KEN_DATA_DIR to the folder that holds 'traces/')"
        )
    stamps: list[str] = []
    context: list[int] = []
    generated: list[int] = []
    with p.open(encoding="utf-8") as f:
        header = f.readline().strip().split(",")
        if header[:3] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise WorkloadError(f"{p}: expected columns TIMESTAMP,ContextTokens,GeneratedTokens, "
                                f"got {header}")
        for lineno, line in enumerate(f, start=2):
            if not line.strip():
                continue
            parts = line.strip().split(",")
            try:
                stamps.append(parts[0])
                context.append(int(parts[1]))
                generated.append(int(parts[2]))
            except (IndexError, ValueError) as exc:
                raise WorkloadError(f"{p}:{lineno}: malformed row {line.strip()!r}") from exc
    if not stamps:
        raise WorkloadError(f"{p} holds no requests")
    try:
        # datetime64[ns] keeps the 7 fractional digits (100 ns) exactly; floats would round them
        times = np.array(stamps, dtype="datetime64[ns]")
    except ValueError as exc:
        raise WorkloadError(f"{p}: cannot parse timestamps: {exc}") from exc
    ns = (times - times.min()).astype(np.int64)
    order = np.argsort(ns, kind="stable")  # the file is sorted, but do not rely on it
    return Trace(ns[order] / 1e9, p.stem, np.asarray(context)[order],
                 np.asarray(generated)[order])


def _check_rate(rate_qps: float, duration_s: float) -> None:
    if not rate_qps > 0 or not np.isfinite(rate_qps):
        raise WorkloadError(f"rate_qps must be a positive number, got {rate_qps}")
    if not duration_s > 0 or not np.isfinite(duration_s):
        raise WorkloadError(f"duration_s must be a positive number, got {duration_s}")


def _from_gaps(gaps: np.ndarray, duration_s: float, name: str) -> Trace:
    times = np.cumsum(gaps)
    times = times[times < duration_s]
    if times.size == 0:
        raise WorkloadError(f"{name}: no arrival within {duration_s} s; raise the rate or "
                            "the duration")
    return Trace(times, name)


def _draw_gaps(rng: np.random.Generator, rate_qps: float, duration_s: float,
               draw: Any) -> np.ndarray:
    # draw a few standard deviations more gaps than expected, then top up if still short
    expected = rate_qps * duration_s
    n = int(expected + 10 * np.sqrt(expected) + 10)
    gaps = draw(n)
    while gaps.sum() < duration_s:
        gaps = np.concatenate([gaps, draw(n)])
    return gaps


def poisson_trace(rate_qps: float, duration_s: float, seed: int = 0) -> Trace:
    """Poisson arrivals (exponential inter-arrival gaps) at ``rate_qps`` over ``duration_s``."""
    _check_rate(rate_qps, duration_s)
    rng = np.random.default_rng(seed)
    gaps = _draw_gaps(rng, rate_qps, duration_s,
                      lambda n: rng.exponential(1.0 / rate_qps, size=n))
    return _from_gaps(gaps, duration_s, f"poisson{rate_qps:g}qps")


def gamma_trace(rate_qps: float, duration_s: float, cv: float, seed: int = 0) -> Trace:
    """Bursty arrivals: Gamma inter-arrival gaps with mean ``1/rate_qps`` and CV ``cv``.

    Shape ``k = 1/cv**2`` and scale ``1/(rate_qps * k)``; ``cv = 1`` is Poisson, larger is burstier.
    """
    _check_rate(rate_qps, duration_s)
    if not cv > 0 or not np.isfinite(cv):
        raise WorkloadError(f"cv must be a positive number, got {cv}")
    rng = np.random.default_rng(seed)
    shape = 1.0 / cv**2
    scale = 1.0 / (rate_qps * shape)
    gaps = _draw_gaps(rng, rate_qps, duration_s, lambda n: rng.gamma(shape, scale, size=n))
    return _from_gaps(gaps, duration_s, f"gamma{rate_qps:g}qps_cv{cv:g}")


@dataclass(frozen=True, eq=False)
class Workload:
    """An arrival trace plus the labelled sample that accuracy is measured on."""

    trace: Trace
    sample_name: str
    sample_hash: str
    qps_max: float
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not self.qps_max > 0 or not np.isfinite(self.qps_max):
            raise WorkloadError(f"workload qps_max must be a positive number, got {self.qps_max}")

    @classmethod
    def from_trace(cls, trace: Trace, sample_name: str, sample_hash: str,
                   window_s: float = 1.0) -> Workload:
        """A workload whose ``qps_max`` is the trace's peak bucketed rate."""
        return cls(trace, sample_name, sample_hash, trace.qps_max(window_s))

    def to_json(self) -> str:
        return json.dumps({"schema_version": SCHEMA_VERSION, "trace": self.trace.to_dict(),
                           "sample_name": self.sample_name, "sample_hash": self.sample_hash,
                           "qps_max": float(self.qps_max)})

    @classmethod
    def from_json(cls, text: str) -> Workload:
        data = json.loads(text)
        _check_version(data, "workload")
        return cls(Trace.from_dict(data["trace"]), str(data["sample_name"]),
                   str(data["sample_hash"]), float(data["qps_max"]))
