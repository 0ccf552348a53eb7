"""The one metrics type: JSON round trip, old plan JSON, and the generating runs' fields."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ken.optimizer.decode_sim import GenRun
from ken.policy.metrics import PlanMetrics, RangeMetrics, latency_percentiles

# the predicted metrics of a gear plan as saved before generating runs shared the type
OLD_JSON = {"accuracy": 0.8, "p50_ms": 10.0, "p95_ms": 20.0, "p99_ms": 30.0, "mean_ms": 12.0,
            "num_requests": 100, "gear_switches": 2, "duration_s": 5.0,
            "utilisation": [["d0", 0.5]],
            "per_range": [{"lo_qps": 0.0, "hi_qps": 10.0, "num_requests": 100, "accuracy": 0.8,
                           "p50_ms": 10.0, "p95_ms": 20.0, "p99_ms": 30.0}]}


def test_old_plan_metrics_json_loads_and_writes_back_the_same() -> None:
    m = PlanMetrics.from_dict(OLD_JSON)
    assert m.per_range == (RangeMetrics(0.0, 10.0, 100, 0.8, 10.0, 20.0, 30.0),)
    assert m.ttft_p95_ms is None and m.accuracy_se is None
    assert m.to_dict() == OLD_JSON  # a classifier's metrics keep their JSON


def test_generating_metrics_round_trip_through_json() -> None:
    run = GenRun(np.array([0.0, 1.0, 2.0]), np.array([0.5, 1.5, 2.5]),
                 np.array([2.0, 3.0, 6.0]), np.array([0, 1, 1]), np.array([0, 0, 1]),
                 np.array([1.0, 0.5, 0.0]), {"s": 3, "l": 9}, {"s": 4, "l": 6},
                 {"s": 1, "l": 2}, 4.0, ((1.5, 0, 1),))
    m = run.metrics()
    assert m.num_requests == 3 and m.gear_switches == 1
    assert m.accuracy == pytest.approx(0.5) and m.accuracy_se == pytest.approx(0.5 / math.sqrt(3))
    assert m.escalated == pytest.approx(2 / 3) and m.passes == 10 and m.prefill_passes == 3
    assert (m.tgt_p50_ms, m.tgt_p95_ms, m.tgt_p99_ms) == latency_percentiles(
        np.array([2000.0, 2000.0, 4000.0]))
    assert m.ttft_p50_ms == pytest.approx(500.0)
    assert m.duration_s == 6.0 and m.tokens_per_s == pytest.approx(2.0)
    assert m.utilisation == (("device", pytest.approx(4 / 6)),)
    assert PlanMetrics.from_dict(json.loads(json.dumps(m.to_dict()))) == m
