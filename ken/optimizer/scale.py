"""A gear plan for one node, copied onto a cluster of identical nodes (issue 20, item 5).

The planner searches placements device by device, which is affordable for one node of a few
GPUs or CPU workers but not for 64 nodes of 8 GPUs. A cluster of identical nodes is served by
copying one node's plan: every replica of the node plan gets a copy on each node (device ``d``
of copy ``k`` becomes ``n{k}.{d}``, the names ``RayCluster.hardware`` gives), each copy takes
an equal part of every model's rows, and the QPS ranges scale with the number of copies (the
router still sees the whole cluster's rate, and the gear for ``k`` times the load is the node's
gear for its own load). The simulator then predicts what one router in front of the whole
cluster gives (``benchmarks/ray_scaling.py``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from ken.errors import PlanError
from ken.optimizer.workload import Device, Hardware, Trace
from ken.policy.plan import GearPlan, RangeSchedule, Replica


def node_device(copy: int, device: str) -> str:
    """The name of ``device`` of a node plan on node ``copy`` of the cluster."""
    return f"n{copy}.{device}"


def replicate_plan(plan: GearPlan, copies: int) -> GearPlan:
    """``plan`` (made for one node) on ``copies`` identical nodes, as described in the module
    docstring. The prediction is dropped: simulate the copy on the cluster's load."""
    if copies < 1:
        raise PlanError(f"a plan needs at least one copy, got {copies}")
    placement = tuple(Replica(r.model, tuple(node_device(k, d) for d in r.devices))
                      for k in range(copies) for r in plan.placement)
    ranges = tuple(RangeSchedule(rs.cascade, tuple(s / copies for s in rs.shares) * copies,
                                 rs.min_queue * copies, rs.feasible)
                   for rs in plan.ranges)
    provenance = dict(plan.provenance) | {"replicated": f"{copies} nodes"}
    return GearPlan(plan.operator, tuple(e * copies for e in plan.qps_edges), plan.cascades,
                    placement, ranges, plan.max_batch * copies, plan.max_wait_s, plan.alpha,
                    plan.rate_window_s, None, tuple(sorted(provenance.items())),
                    plan.batch_runtime_s * copies)


def replicate_hardware(hardware: Hardware, copies: int) -> Hardware:
    """``copies`` nodes with ``hardware``'s devices each, named as ``replicate_plan`` names
    them (node ``k`` holds the devices of copy ``k``)."""
    if copies < 1:
        raise PlanError(f"a cluster needs at least one node, got {copies}")
    return Hardware(tuple(Device(node_device(k, d.id), d.kind, d.memory_bytes, k, d.dispatch_s)
                          for k in range(copies) for d in hardware.devices))


def cluster_trace(node: Trace, nodes: int, bursts: Literal["same", "independent"] = "same",
                  seed: int = 0) -> Trace:
    """The traffic of ``nodes`` nodes, each offered ``node``'s arrivals over its duration.

    ``"same"``: every arrival ``nodes`` times, each within a microsecond (the whole cluster
    bursts at once: ``nodes`` times the node's load with its peaks where they were).
    ``"independent"``: copy ``k`` of the node's arrivals shifted by a random offset, wrapping
    around the trace's end (users whose bursts do not coincide; the sum is smoother)."""
    if nodes < 1:
        raise PlanError(f"a cluster needs at least one node, got {nodes}")
    rng = np.random.default_rng(seed)
    arrivals = node.arrival_s
    if bursts == "same":
        out = np.repeat(arrivals, nodes) + rng.uniform(0.0, 1e-6, len(arrivals) * nodes)
    elif bursts == "independent":
        span = max(node.duration_s, 1e-9)
        shifts = np.concatenate([[0.0], rng.uniform(0.0, span, nodes - 1)])
        moved = [arrivals + s for s in shifts]
        out = np.concatenate([np.where(m > span, m - span, m) for m in moved])
    else:
        raise PlanError(f"bursts must be 'same' or 'independent', not {bursts!r}")
    return Trace(np.sort(out), f"{node.name}x{nodes}-nodes-{bursts}")
