"""A node's gear plan copied onto identical nodes (ken.optimizer.scale)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_simulator import CATALOG, make_plan, random_plans, random_traces

from ken.errors import PlanError
from ken.models.cascade import Cascade
from ken.optimizer.scale import cluster_trace, replicate_hardware, replicate_plan
from ken.optimizer.simulator import simulate
from ken.optimizer.workload import Device, Hardware, Trace, poisson_trace
from ken.policy.plan import GearPlan


@settings(max_examples=40, deadline=None)
@given(random_plans(), st.integers(1, 5))
def test_copies_split_every_models_rows_evenly_over_disjoint_nodes(plan: GearPlan,
                                                                  copies: int) -> None:
    big = replicate_plan(plan, copies)
    n = len(plan.placement)
    assert len(big.placement) == n * copies
    assert big.qps_edges == tuple(e * copies for e in plan.qps_edges)
    nodes = [{d for r in big.placement[k * n:(k + 1) * n] for d in r.devices}
             for k in range(copies)]
    assert sum(len(s) for s in nodes) == len(set().union(*nodes))  # disjoint devices
    for rs, big_rs in zip(plan.ranges, big.ranges, strict=True):
        for k in range(copies):
            part = big_rs.shares[k * n:(k + 1) * n]
            assert part == pytest.approx([s / copies for s in rs.shares])
            assert big_rs.min_queue[k * n:(k + 1) * n] == rs.min_queue
    assert big.max_batch == plan.max_batch * copies
    assert GearPlan.from_json(big.to_json()) == big


@settings(max_examples=25, deadline=None)
@given(random_plans(), random_traces(), st.integers(0, 50))
def test_one_copy_simulates_exactly_like_the_node_plan(plan: GearPlan, trace: Trace,
                                                       seed: int) -> None:
    a = simulate(plan, CATALOG, trace, seed)
    b = simulate(replicate_plan(plan, 1), CATALOG, trace, seed)
    np.testing.assert_array_equal(a.latency_s, b.latency_s)


@pytest.mark.parametrize("copies", [2, 4, 5])
def test_each_copy_serves_its_share_as_the_node_served_the_whole(copies: int) -> None:
    # every arrival repeated ``copies`` times: the router deals the repeats one to each node
    # (one replica per model and node; ``copies`` divides the router's cycle of 1,000 picks),
    # each node sees the original trace, and every latency is the node plan's ``copies`` times
    # over (single-stage gears: a row's latency does not depend on which row it is)
    plan = make_plan([("a", ("d0",)), ("b", ("d1",))], (Cascade(("a",)), Cascade(("b",))),
                     [(1, (0.0, 1.0), (1, 2)), (0, (1.0, 0.0), (4, 1))],
                     edges=(0.0, 150.0, 400.0), max_batch=(8, 4), max_wait_s=0.01)
    trace = poisson_trace(300.0, 3.0, seed=1)
    node = simulate(plan, CATALOG, trace)
    big = simulate(replicate_plan(plan, copies), CATALOG,
                   Trace(np.repeat(trace.arrival_s, copies), "repeated"))
    assert len(node.latency_s) > 500
    assert node.metrics(0, plan).gear_switches > 0  # both gears were used
    np.testing.assert_allclose(np.sort(big.latency_s),
                               np.sort(np.repeat(node.latency_s, copies)))


def test_a_hop_per_batch_adds_to_the_predicted_latency() -> None:
    plan = make_plan([("a", ("d0",))], (Cascade(("a",)),), max_batch=(1,))
    trace = poisson_trace(5.0, 20.0, seed=0)  # idle: every batch is one row
    base = simulate(replicate_plan(plan, 4), CATALOG, trace).latency_s
    hop = simulate(replicate_plan(plan, 4), CATALOG.with_overhead(0.001), trace).latency_s
    np.testing.assert_allclose(hop - base, 0.001)


def test_cluster_hardware_names_devices_as_the_copied_plan_does() -> None:
    node = Hardware((Device("cuda0", "cuda", 16, 0, 0.001), Device("cuda1", "cuda", 16, 0,
                                                                     0.001)))
    cluster = replicate_hardware(node, 3)
    assert cluster.nodes == (0, 1, 2)
    assert cluster.dispatch_s == 0.001
    plan = make_plan([("a", ("cuda0",)), ("b", ("cuda1",))], (Cascade(("a", "b"), (0.6,)),))
    assert set(replicate_plan(plan, 3).devices) == set(cluster.ids)
    with pytest.raises(PlanError, match="at least one"):
        replicate_plan(plan, 0)
    with pytest.raises(PlanError, match="at least one"):
        replicate_hardware(node, 0)


def test_cluster_traffic_is_the_nodes_arrivals_n_times_with_bursts_together_or_apart() -> None:
    node = poisson_trace(100.0, 20.0, seed=3)
    same = cluster_trace(node, 8, "same")
    apart = cluster_trace(node, 8, "independent", seed=1)
    for t in (same, apart):
        assert len(t) == 8 * len(node)
        assert np.all(np.diff(t.arrival_s) >= 0)
        assert t.arrival_s[-1] <= node.duration_s + 1e-5
    assert same.qps_max() == pytest.approx(8 * node.qps_max(), rel=0.02)
    # a burst confined to one node's second stays one second long when all burst together,
    # and is spread over the trace when they do not
    bursty = Trace(np.sort(np.concatenate([np.linspace(5.0, 5.9, 500),
                                           np.linspace(0.0, 19.9, 200)])), "burst")
    assert cluster_trace(bursty, 8, "same").qps_max() > 2 * cluster_trace(
        bursty, 8, "independent", seed=2).qps_max()
    with pytest.raises(PlanError, match="same"):
        cluster_trace(node, 2, "sometimes")  # type: ignore[arg-type]
    assert cluster_trace(node, 1, "independent").arrival_s.tolist() == pytest.approx(
        node.arrival_s.tolist())
