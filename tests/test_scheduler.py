"""Invocation scheduler: the load-balancing LP against brute force, and the queue heuristic."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ken.optimizer.scheduler import (
    PlanningError,
    balance_load,
    device_busy,
    raise_queue_lengths,
)
from ken.optimizer.workload import Hardware


def _simplex_grid(parts: int, steps: int) -> np.ndarray:
    """All share vectors of length ``parts`` with entries in multiples of 1/steps summing to 1."""
    rows = [c for c in itertools.product(range(steps + 1), repeat=parts - 1) if sum(c) <= steps]
    grid = np.array([[*c, steps - sum(c)] for c in rows], dtype=float)
    return grid / steps


def _deviation(busy: np.ndarray) -> np.ndarray:
    return np.abs(busy - busy.mean(axis=-1, keepdims=True)).sum(axis=-1)


@pytest.mark.parametrize("seed", range(8))
def test_lp_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    devices = ["d0", "d1", "d2"] if seed % 2 else ["d0", "d1"]
    # overlapping placements and skewed demand, so the optimum is usually not perfectly even
    replicas = {"a": devices[:2], "b": list(devices[1:])}
    demand = {"a": float(rng.uniform(5, 50)), "b": float(rng.uniform(50, 200))}
    cost = {(m, d): float(rng.uniform(1e-3, 1e-2)) for m in replicas for d in devices}
    alloc = balance_load(demand, replicas, cost, devices)

    grid_a = _simplex_grid(2, 1000)
    grid_b = _simplex_grid(len(replicas["b"]), 1000)
    idx = {d: k for k, d in enumerate(devices)}
    busy_a = np.zeros((len(grid_a), len(devices)))
    for i, d in enumerate(replicas["a"]):
        busy_a[:, idx[d]] += grid_a[:, i] * demand["a"] * cost[("a", d)]
    busy_b = np.zeros((len(grid_b), len(devices)))
    for i, d in enumerate(replicas["b"]):
        busy_b[:, idx[d]] += grid_b[:, i] * demand["b"] * cost[("b", d)]
    best = _deviation(busy_a[:, None, :] + busy_b[None, :, :]).min()

    assert alloc.deviation_s_per_s <= best + 1e-7
    # the grid is fine enough that the LP optimum is close to the best grid point
    assert best - alloc.deviation_s_per_s < 0.05 * max(best, 1e-3) + 1e-3
    # the reported objective is the deviation of the reported shares
    busy = np.array([alloc.busy_s_per_s[d] for d in devices])
    assert _deviation(busy) == pytest.approx(alloc.deviation_s_per_s, abs=1e-7)
    for m in replicas:
        assert sum(alloc.shares[m]) == pytest.approx(1.0)
        assert min(alloc.shares[m]) >= 0.0


def test_balanced_split_on_identical_devices() -> None:
    hw = Hardware.cpu_workers(2, 1 << 30)
    alloc = balance_load({"m": 100.0}, {"m": ["cpu0", "cpu1"]}, {("m", "cpu0"): 0.004,
                                                                 ("m", "cpu1"): 0.004}, hw)
    assert alloc.shares["m"] == pytest.approx((0.5, 0.5))
    assert alloc.busy_s_per_s["cpu0"] == pytest.approx(0.2)
    assert alloc.feasible and alloc.max_busy_s_per_s == pytest.approx(0.2)


def test_infeasible_is_an_outcome_not_an_exception() -> None:
    # 1000 rows/s x 2 ms/row = 2 s of work per second on a single device
    alloc = balance_load({"m": 1000.0}, {"m": ["d0"]}, {("m", "d0"): 0.002}, ["d0", "d1"])
    assert not alloc.feasible
    assert alloc.max_busy_s_per_s == pytest.approx(2.0)
    assert alloc.busy_s_per_s["d1"] == 0.0


def test_malformed_input_raises() -> None:
    with pytest.raises(PlanningError, match="no replica"):
        balance_load({"m": 5.0}, {}, {}, ["d0"])
    with pytest.raises(PlanningError, match="unknown device"):
        balance_load({"m": 5.0}, {"m": ["zz"]}, {("m", "zz"): 0.1}, ["d0"])
    with pytest.raises(PlanningError, match=">= 0"):
        balance_load({"m": -1.0}, {"m": ["d0"]}, {("m", "d0"): 0.1}, ["d0"])
    # zero demand without replicas is fine
    alloc = balance_load({"m": 0.0, "n": 1.0}, {"n": ["d0"]}, {("n", "d0"): 0.1}, ["d0"])
    assert alloc.feasible and alloc.shares["n"] == (1.0,)


def _batched_cost(fixed_s: float, per_row_s: float):
    """Per-row seconds of a batch with a fixed overhead: (fixed + b * per_row) / b."""

    def cost(model: str, device: str, batch_size: int) -> float:
        return (fixed_s + batch_size * per_row_s) / batch_size

    return cost


def test_raise_queue_lengths_until_feasible() -> None:
    # per row: 10 ms overhead per batch + 1 ms; at 150 rows/s on one device:
    # batch 1 -> 1.65 s/s, 2 -> 0.9 s/s (feasible)
    cost = _batched_cost(0.010, 0.001)
    plan = raise_queue_lengths({"m": 150.0}, {"m": ["d0"]}, cost, ["d0"], max_batch_size=64)
    assert plan.feasible
    assert plan.queue_lengths["m"] == (2,)
    assert plan.busy_s_per_s["d0"] == pytest.approx(0.9)
    # two models on one device: round-robin raises both before going further
    demand = {"a": 100.0, "b": 100.0}
    replicas = {"a": ["d0"], "b": ["d0"]}
    plan = raise_queue_lengths(demand, replicas, cost, ["d0"], max_batch_size=64)
    assert plan.feasible
    q = [plan.queue_lengths["a"][0], plan.queue_lengths["b"][0]]
    assert max(q) <= 2 * min(q)  # round-robin keeps them within one doubling
    busy = device_busy(demand, replicas, plan.allocation.shares, cost, ["d0"],
                       plan.queue_lengths)
    assert busy["d0"] == pytest.approx(plan.busy_s_per_s["d0"]) and busy["d0"] <= 1.0


def test_raise_queue_lengths_reports_infeasible_at_max_batch() -> None:
    # even infinite batches cost 1 ms per row: 2000 rows/s needs >= 2 s/s
    cost = _batched_cost(0.010, 0.001)
    plan = raise_queue_lengths({"m": 2000.0}, {"m": ["d0"]}, cost, ["d0"], max_batch_size=16)
    assert not plan.feasible
    assert plan.queue_lengths["m"] == (16,)
    assert plan.max_busy_s_per_s > 1.0


def test_raise_queue_lengths_leaves_unloaded_devices_at_one() -> None:
    cost = _batched_cost(0.010, 0.001)
    demand = {"hot": 150.0, "cold": 10.0}
    plan = raise_queue_lengths(demand, {"hot": ["d0"], "cold": ["d1"]}, cost, ["d0", "d1"],
                               max_batch_size=8)
    assert plan.feasible
    assert plan.queue_lengths["cold"] == (1,)
    assert plan.queue_lengths["hot"][0] > 1
