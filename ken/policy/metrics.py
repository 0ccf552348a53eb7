"""What a plan did on a trace, simulated or measured: one metrics type for every kind of cascade.

``PlanMetrics`` is what the classifier simulator, the decode simulator and a measured replay
report, and what a plan records as its prediction. Every run has a quality (``accuracy``: the
operator's own metric, accuracy or token F1, mean over requests) and request latency
percentiles (``p50_ms``...: arrival to answer; for a generating function that is its total
generation time, TGT, which the ``tgt_*`` names read). Generating runs add the time to first
token (``ttft_*``), the share of requests a later stage answered and token throughput; those
fields are None where they do not apply and are left out of the JSON then, so a classifier
plan's JSON is what it was before generating runs shared this type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

#: the latency percentiles every run reports
PERCENTILES = (50, 95, 99)


def latency_percentiles(latency_ms: np.ndarray) -> tuple[float, float, float]:
    """p50, p95 and p99 of ``latency_ms`` (numpy's linear interpolation)."""
    p = np.percentile(latency_ms, PERCENTILES)
    return float(p[0]), float(p[1]), float(p[2])


@dataclass(frozen=True)
class RangeMetrics:
    """Simulated latency of the requests admitted while a QPS range's gear was active."""

    lo_qps: float
    hi_qps: float
    num_requests: int
    accuracy: float
    p50_ms: float
    p95_ms: float
    p99_ms: float


# the optional fields of PlanMetrics and how their JSON values are read back
_OPTIONAL: dict[str, type] = {
    "accuracy_se": float, "ttft_p50_ms": float, "ttft_p95_ms": float, "ttft_p99_ms": float,
    "escalated": float, "tokens_per_s": float, "time_per_token_ms": float, "passes": int,
    "prefill_passes": int,
}


@dataclass(frozen=True)
class PlanMetrics:
    """What a run of a plan on a trace found (see the module docstring). ``accuracy`` is NaN
    for a run without answers to score (a decode-only replay)."""

    accuracy: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    num_requests: int
    gear_switches: int
    duration_s: float
    utilisation: tuple[tuple[str, float], ...] = ()  # per device: busy share of the run
    per_range: tuple[RangeMetrics, ...] = ()
    accuracy_se: float | None = None  # standard error of ``accuracy`` over requests
    ttft_p50_ms: float | None = None  # time to the answer's first token (generating runs)
    ttft_p95_ms: float | None = None
    ttft_p99_ms: float | None = None
    escalated: float | None = None  # share of requests a later stage answered
    tokens_per_s: float | None = None  # generated tokens over the run's span
    time_per_token_ms: float | None = None  # median of (last - first token) / (tokens - 1)
    passes: int | None = None  # forward passes of the generating models
    prefill_passes: int | None = None

    # a generating function's request latency is its total generation time (TGT): the names a
    # target uses (``tgt_p95 <= 15s``) read the request latency
    @property
    def tgt_p50_ms(self) -> float:
        return self.p50_ms

    @property
    def tgt_p95_ms(self) -> float:
        return self.p95_ms

    @property
    def tgt_p99_ms(self) -> float:
        return self.p99_ms

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "accuracy": self.accuracy, "p50_ms": self.p50_ms, "p95_ms": self.p95_ms,
            "p99_ms": self.p99_ms, "mean_ms": self.mean_ms, "num_requests": self.num_requests,
            "gear_switches": self.gear_switches, "duration_s": self.duration_s,
            "utilisation": [[d, u] for d, u in self.utilisation],
            "per_range": [vars(r) for r in self.per_range]}
        out.update((name, getattr(self, name)) for name in _OPTIONAL
                   if getattr(self, name) is not None)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanMetrics:
        """Reads ``to_dict``'s output, and the JSON of plans saved before the optional
        fields existed."""
        optional = {name: kind(data[name]) for name, kind in _OPTIONAL.items()
                    if data.get(name) is not None}
        return cls(float(data["accuracy"]), float(data["p50_ms"]), float(data["p95_ms"]),
                   float(data["p99_ms"]), float(data["mean_ms"]), int(data["num_requests"]),
                   int(data["gear_switches"]), float(data["duration_s"]),
                   tuple((str(d), float(u)) for d, u in data.get("utilisation", ())),
                   tuple(RangeMetrics(**r) for r in data.get("per_range", ())), **optional)
