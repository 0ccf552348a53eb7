"""Hardware, traces and workloads: JSON round trips, scaling, windows, peak rate, loaders."""

from __future__ import annotations

import numpy as np
import pytest

from ken.errors import KenError
from ken.optimizer.workload import (
    AZURE_CODE_TRACE,
    Device,
    Hardware,
    Trace,
    Workload,
    WorkloadError,
    fit_peak,
    gamma_trace,
    load_azure_trace,
    poisson_trace,
)
from ken.paths import shared_data_dir


def test_hardware_json_round_trip_and_helpers() -> None:
    hw = Hardware((Device("gpu0", "cuda", 16 << 30, 1), *Hardware.cpu_workers(2, 1 << 30).devices))
    again = Hardware.from_json(hw.to_json())
    assert again == hw
    assert again.ids == ("gpu0", "cpu0", "cpu1")
    assert all(d.node == 0 and d.kind == "cpu" for d in Hardware.cpu_workers(3, 5).devices)
    assert hw.device("cpu1").memory_bytes == 1 << 30


def test_hardware_validation() -> None:
    with pytest.raises(WorkloadError, match="unique"):
        Hardware((Device("a", "cpu", 1), Device("a", "cpu", 1)))
    with pytest.raises(WorkloadError, match="kind"):
        Device("a", "tpu", 1)  # type: ignore[arg-type]
    with pytest.raises(WorkloadError, match="schema version"):
        Hardware.from_json('{"schema_version": 99, "devices": []}')
    assert issubclass(WorkloadError, KenError)


def test_trace_json_round_trip_keeps_tokens() -> None:
    t = Trace(np.array([0.0, 0.5, 1.25]), "t", context_tokens=[1, 2, 3], generated_tokens=[4, 5, 6])
    again = Trace.from_json(t.to_json())
    np.testing.assert_array_equal(again.arrival_s, t.arrival_s)
    np.testing.assert_array_equal(again.context_tokens, [1, 2, 3])
    np.testing.assert_array_equal(again.generated_tokens, [4, 5, 6])
    assert again.name == "t"


def test_workload_json_round_trip() -> None:
    w = Workload.from_trace(Trace(np.array([0.0, 0.1, 0.2, 1.5]), "t"), "sample", "abc123")
    assert w.qps_max == 3.0
    again = Workload.from_json(w.to_json())
    assert (again.sample_name, again.sample_hash, again.qps_max) == ("sample", "abc123", 3.0)
    np.testing.assert_array_equal(again.trace.arrival_s, w.trace.arrival_s)


def test_rate_scaled_window_and_qps_max_by_hand() -> None:
    t = Trace(np.array([0.0, 0.2, 0.4, 1.0, 1.1, 3.9]), "t", context_tokens=[1, 2, 3, 4, 5, 6])
    assert t.duration_s == 3.9
    # buckets [0,1): 3, [1,2): 2, [3,4): 1
    assert t.qps_max() == 3.0
    # 2 s buckets: [0,2) has 5 arrivals -> 2.5 per second
    assert t.qps_max(2.0) == 2.5
    fast = t.rate_scaled(2.0)
    np.testing.assert_allclose(fast.arrival_s, [0.0, 0.1, 0.2, 0.5, 0.55, 1.95])
    assert fast.qps_max() == 5.0
    w = t.window(0.3, 1.0)  # [0.3, 1.3): 0.4, 1.0, 1.1 re-based by 0.3
    np.testing.assert_allclose(w.arrival_s, [0.1, 0.7, 0.8])
    np.testing.assert_array_equal(w.context_tokens, [3, 4, 5])
    # the rate each request arrived in: 3 requests met 3/s, 2 met 2/s, 1 met 1/s
    assert t.request_qps() == pytest.approx((3 * 3 + 2 * 2 + 1 * 1) / 6)
    assert t.request_qps(2.0) == pytest.approx((5 * 2.5 + 1 * 0.5) / 6)
    with pytest.raises(WorkloadError, match="window_s"):
        t.request_qps(0.0)


def test_bad_traces_raise() -> None:
    with pytest.raises(WorkloadError, match="empty"):
        Trace(np.array([]), "e")
    with pytest.raises(WorkloadError, match="sorted"):
        Trace(np.array([1.0, 0.5]), "u")
    t = Trace(np.array([0.0, 1.0]), "t")
    with pytest.raises(WorkloadError, match="positive"):
        t.rate_scaled(-1.0)
    with pytest.raises(WorkloadError, match="no arrivals"):
        t.window(5.0, 1.0)
    with pytest.raises(WorkloadError, match="rate_qps"):
        poisson_trace(-3.0, 10.0)
    with pytest.raises(WorkloadError, match="rate_qps"):
        gamma_trace(0.0, 10.0, 2.0)
    with pytest.raises(WorkloadError, match="cv"):
        gamma_trace(10.0, 10.0, -1.0)


def test_poisson_mean_rate() -> None:
    t = poisson_trace(200.0, 100.0, seed=1)
    assert t.arrival_s[-1] < 100.0
    assert len(t) / 100.0 == pytest.approx(200.0, rel=0.03)
    gaps = np.diff(t.arrival_s)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
    # same seed, same trace
    np.testing.assert_array_equal(poisson_trace(200.0, 100.0, seed=1).arrival_s, t.arrival_s)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_mean_rate_and_cv(cv: float) -> None:
    t = gamma_trace(200.0, 200.0, cv, seed=2)
    assert len(t) / 200.0 == pytest.approx(200.0, rel=0.1)
    gaps = np.diff(t.arrival_s)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_missing_azure_file_says_where(tmp_path) -> None:
    with pytest.raises(WorkloadError, match="AzureLLMInferenceTrace_code.csv|not found"):
        load_azure_trace(tmp_path / "nope.csv")


def test_azure_loader_on_real_file() -> None:
    path = shared_data_dir() / AZURE_CODE_TRACE
    if not path.is_file():
        pytest.skip(f"shared data absent: {path} (set KEN_DATA_DIR to the shared data folder)")
    t = load_azure_trace(path)
    assert len(t) == 8819  # data rows of the file
    assert t.arrival_s[0] == 0.0
    # 2023-11-16 18:17:03.9799600 -> 18:17:04.0319600 and the last at 19:14:19.9280160
    assert t.arrival_s[1] == pytest.approx(0.052, abs=1e-9)
    assert t.duration_s == pytest.approx(57 * 60 + 15.948056, abs=1e-6)
    assert t.context_tokens is not None and t.generated_tokens is not None
    assert t.context_tokens[:3].tolist() == [4808, 3180, 110]
    assert t.generated_tokens[-1] == 173
    assert np.all(np.diff(t.arrival_s) >= 0)


@pytest.mark.parametrize(("peak", "window_s"), [(40.0, 1.0), (0.8, 60.0)])
def test_fit_peak_scales_to_the_peak_over_its_window(peak, window_s) -> None:  # noqa: ANN001
    """Within one arrival per bucket of the target, also at rates where a 1-s bucket would
    hold one or two arrivals whatever the scale."""
    base = gamma_trace(20.0, 600.0, 3.0, seed=4)
    got = fit_peak(base.rate_scaled, peak / base.qps_max(window_s), peak, window_s)
    assert abs(got.qps_max(window_s) - peak) * window_s <= 1.0
    assert len(got) == len(base)
