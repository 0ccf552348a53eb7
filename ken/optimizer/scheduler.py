"""Invocation scheduler for one QPS range (DESIGN.md section 5.3).

Two steps, for a fixed cascade assignment and placement:

1. ``balance_load``: a linear program routes each model's demand (rows/s) over its replicas so
   that every device's busy time (seconds of work per second) deviates as little as possible
   from the average busy time. An overloaded device (busy > 1 s/s) is reported as an explicit
   infeasible ``Allocation``, never as an exception.
2. ``raise_queue_lengths``: batch sizes. Every replica starts at minimum queue length 1; on any
   device still busier than 1 s/s the smallest queue length of its replicas is raised,
   round-robin, so larger (cheaper per row) batches fit; if every replica there is at the maximum
   batch size the range is infeasible.

Replicas are identified by ``(model, index)`` where ``index`` is the position in the model's
replica list. A replica runs on one device (given as its id) or, tensor-parallel, on several
devices at once (given as a tuple of ids): a batch then occupies every one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
from scipy.optimize import linprog

from ken.errors import PlanningError
from ken.optimizer.workload import Hardware

#: where one replica runs: a device id, or a tuple of device ids for a tensor-parallel replica
ReplicaDevices = str | tuple[str, ...]
#: seconds of work per row for ``(model, replica devices, batch_size)``
PerRowCost = Callable[[str, ReplicaDevices, int], float]
#: a callable, or a table ``{(model, device_id): seconds per row}`` independent of batch size
PerRowCostLike = PerRowCost | Mapping[tuple[str, str], float]

# a device is overloaded only beyond this slack, so LP round-off never flips feasibility
_BUSY_TOLERANCE = 1e-9


def replica_devices(devices: ReplicaDevices) -> tuple[str, ...]:
    """The device ids a replica occupies."""
    return (devices,) if isinstance(devices, str) else tuple(devices)


def _as_cost_fn(per_row_s: PerRowCostLike) -> PerRowCost:
    if callable(per_row_s):
        return per_row_s
    table = dict(per_row_s)

    def lookup(model: str, device: ReplicaDevices, batch_size: int) -> float:
        try:
            return float(table[(model, device)])
        except KeyError:
            raise PlanningError(f"no per-row cost for model {model!r} on device {device!r}; "
                                f"the cost table has {sorted(table)}") from None

    return lookup


def _device_ids(devices: Hardware | Iterable[str]) -> tuple[str, ...]:
    ids = devices.ids if isinstance(devices, Hardware) else tuple(devices)
    if not ids:
        raise PlanningError("the scheduler needs at least one device")
    if len(set(ids)) != len(ids):
        raise PlanningError(f"device ids must be unique, got {list(ids)}")
    return ids


def _check_input(demand_rows_s: Mapping[str, float],
                 replicas: Mapping[str, Sequence[ReplicaDevices]],
                 device_ids: Sequence[str]) -> None:
    known = set(device_ids)
    for model, demand in demand_rows_s.items():
        if not np.isfinite(demand) or demand < 0:
            raise PlanningError(f"demand of model {model!r} must be >= 0 rows/s, got {demand}")
        if demand > 0 and not replicas.get(model):
            raise PlanningError(f"model {model!r} has demand {demand:g} rows/s but no replica; "
                                "place at least one replica of it")
    for model, devs in replicas.items():
        for rep in devs:
            for dev in replica_devices(rep):
                if dev not in known:
                    raise PlanningError(f"replica of {model!r} is on unknown device {dev!r}; "
                                        f"devices: {list(device_ids)}")


@dataclass(frozen=True)
class Allocation:
    """How one QPS range's demand is routed over replicas, and the resulting device load.

    ``shares[model][i]`` is the fraction of the model's rows sent to its ``i``-th replica;
    ``busy_s_per_s[device]`` is the seconds of work per second that device must do;
    ``feasible`` means no device needs more than 1 s of work per second.
    """

    shares: Mapping[str, tuple[float, ...]]
    busy_s_per_s: Mapping[str, float]
    max_busy_s_per_s: float
    deviation_s_per_s: float  # the LP objective: sum over devices of |busy - average busy|
    feasible: bool

    def share(self, model: str, replica: int) -> float:
        return self.shares[model][replica]


def device_busy(demand_rows_s: Mapping[str, float],
                replicas: Mapping[str, Sequence[ReplicaDevices]],
                shares: Mapping[str, Sequence[float]], per_row_s: PerRowCostLike,
                devices: Hardware | Iterable[str],
                queue_lengths: Mapping[str, Sequence[int]] | None = None) -> dict[str, float]:
    """Seconds of work per second on each device for given shares and batch sizes."""
    cost = _as_cost_fn(per_row_s)
    busy = dict.fromkeys(_device_ids(devices), 0.0)
    for model, devs in replicas.items():
        demand = float(demand_rows_s.get(model, 0.0))
        for i, dev in enumerate(devs):
            batch = queue_lengths[model][i] if queue_lengths is not None else 1
            if demand > 0 and shares[model][i] > 0:
                work = demand * shares[model][i] * cost(model, dev, batch)
                for d in replica_devices(dev):
                    busy[d] += work
    return busy


def balance_load(demand_rows_s: Mapping[str, float],
                 replicas: Mapping[str, Sequence[ReplicaDevices]],
                 per_row_s: PerRowCostLike, devices: Hardware | Iterable[str],
                 queue_lengths: Mapping[str, Sequence[int]] | None = None) -> Allocation:
    """Solve the load-balancing LP for one QPS range.

    Variables: share ``x[m, i] >= 0`` of model ``m``'s demand routed to its replica ``i``, with
    ``sum_i x[m, i] = 1``. Device busy time ``b_d = sum_{replicas on d} demand_m * x * cost``
    (cost = per-row seconds at that replica's queue length, default batch 1). The objective
    ``sum_d |b_d - mean(b)|`` is linearised with one auxiliary ``t_d >= |b_d - mean(b)|`` per
    device (two inequalities each). All given devices count in the mean, idle ones too.
    """
    cost = _as_cost_fn(per_row_s)
    ids = _device_ids(devices)
    _check_input(demand_rows_s, replicas, ids)
    dev_index = {d: k for k, d in enumerate(ids)}

    # only models with demand get variables; others route nothing
    var_model: list[str] = []
    var_devs: list[list[int]] = []
    var_cost: list[float] = []  # seconds of device work per second at share 1
    for model, demand in demand_rows_s.items():
        if demand <= 0:
            continue
        for i, dev in enumerate(replicas[model]):
            batch = queue_lengths[model][i] if queue_lengths is not None else 1
            c = float(cost(model, dev, batch))
            if not np.isfinite(c) or c < 0:
                raise PlanningError(f"per-row cost of {model!r} on {dev!r} at batch {batch} "
                                    f"must be >= 0 seconds, got {c}")
            var_model.append(model)
            var_devs.append([dev_index[d] for d in replica_devices(dev)])
            var_cost.append(float(demand) * c)

    shares: dict[str, list[float]] = {m: [0.0] * len(replicas.get(m, ())) for m in replicas}
    n_x, n_d = len(var_model), len(ids)
    deviation = 0.0
    if n_x:
        # membership[d, j] = 1 if variable j's replica is on device d
        membership = np.zeros((n_d, n_x))
        for j, devs in enumerate(var_devs):
            membership[devs, j] = 1.0
        c_row = np.asarray(var_cost)
        # (b_d - mean b) as a linear function of x
        # (b_d - mean b): a tensor-parallel replica adds its work to each of its devices
        centred = (membership - membership.sum(axis=0) / n_d) * c_row
        eye = np.eye(n_d)
        a_ub = np.block([[centred, -eye], [-centred, -eye]])
        b_ub = np.zeros(2 * n_d)
        models = list(dict.fromkeys(var_model))
        a_eq = np.zeros((len(models), n_x + n_d))
        for j, m in enumerate(var_model):
            a_eq[models.index(m), j] = 1.0
        objective = np.concatenate([np.zeros(n_x), np.ones(n_d)])
        bounds = [(0.0, 1.0)] * n_x + [(0.0, None)] * n_d
        res = linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=np.ones(len(models)),
                      bounds=bounds, method="highs")
        if res.status != 0:  # cannot happen for well-formed input: x = uniform is feasible
            raise PlanningError(f"load-balancing LP failed: {res.message}")
        x = np.clip(res.x[:n_x], 0.0, 1.0)
        deviation = float(res.fun)
        pos = {m: 0 for m in models}
        for j, m in enumerate(var_model):
            shares[m][pos[m]] = float(x[j])
            pos[m] += 1
        for m in models:  # renormalise away solver round-off so shares sum to exactly 1
            total = sum(shares[m])
            shares[m] = [s / total for s in shares[m]]
    frozen_shares = {m: tuple(s) for m, s in shares.items()}
    busy = device_busy(demand_rows_s, replicas, frozen_shares, cost, ids, queue_lengths)
    return _allocation(frozen_shares, busy, deviation)


def _allocation(shares: Mapping[str, tuple[float, ...]], busy: Mapping[str, float],
                deviation: float) -> Allocation:
    max_busy = max(busy.values())
    return Allocation(shares=MappingProxyType(dict(shares)),
                      busy_s_per_s=MappingProxyType(dict(busy)), max_busy_s_per_s=max_busy,
                      deviation_s_per_s=deviation, feasible=max_busy <= 1.0 + _BUSY_TOLERANCE)


@dataclass(frozen=True)
class QueuePlan:
    """Minimum queue lengths (batch triggers) per replica and the load they lead to."""

    queue_lengths: Mapping[str, tuple[int, ...]]
    busy_s_per_s: Mapping[str, float]
    max_busy_s_per_s: float
    feasible: bool
    allocation: Allocation  # the shares the queue lengths were chosen for


def raise_queue_lengths(demand_rows_s: Mapping[str, float],
                        replicas: Mapping[str, Sequence[ReplicaDevices]], per_row_s: PerRowCost,
                        devices: Hardware | Iterable[str], max_batch_size: int,
                        allocation: Allocation | None = None) -> QueuePlan:
    """Raise minimum queue lengths round-robin until no device is busier than 1 s/s.

    Shares stay fixed (``allocation``, or the LP's solution at queue length 1). Each round, on
    every overloaded device, the replica with the smallest queue length below ``max_batch_size``
    (ties: round-robin over that device's replicas) has its queue length doubled, capped at
    ``max_batch_size`` — doubling matches the power-of-two batch sizes profiles are measured
    at. Busy time is recomputed with ``per_row_s(model, device, batch_size)`` at the new sizes.
    Stops when feasible, or infeasible when an overloaded device has every replica at the max.
    """
    if max_batch_size < 1:
        raise PlanningError(f"max_batch_size must be >= 1, got {max_batch_size}")
    ids = _device_ids(devices)
    if allocation is None:
        allocation = balance_load(demand_rows_s, replicas, per_row_s, ids)
    else:
        _check_input(demand_rows_s, replicas, ids)
    queue: dict[str, list[int]] = {m: [1] * len(devs) for m, devs in replicas.items()}
    on_device: dict[str, list[tuple[str, int]]] = {d: [] for d in ids}
    for m, devs in replicas.items():
        for i, rep in enumerate(devs):
            for dev in replica_devices(rep):
                on_device[dev].append((m, i))
    next_turn = dict.fromkeys(ids, 0)  # round-robin pointer per device for ties

    def current_busy() -> dict[str, float]:
        return device_busy(demand_rows_s, replicas, allocation.shares, per_row_s, ids,
                           {m: tuple(q) for m, q in queue.items()})

    busy = current_busy()
    while True:
        overloaded = [d for d in ids if busy[d] > 1.0 + _BUSY_TOLERANCE]
        if not overloaded:
            break
        raised = False
        stuck = False
        for dev in overloaded:
            # only replicas that actually receive rows can relieve the device
            candidates = [(m, i) for m, i in on_device[dev]
                          if queue[m][i] < max_batch_size and allocation.shares[m][i] > 0
                          and demand_rows_s.get(m, 0.0) > 0]
            if not candidates:
                stuck = True
                continue
            smallest = min(queue[m][i] for m, i in candidates)
            tied = [c for c in candidates if queue[c[0]][c[1]] == smallest]
            m, i = tied[next_turn[dev] % len(tied)]
            next_turn[dev] += 1
            queue[m][i] = min(2 * queue[m][i], max_batch_size)
            raised = True
        busy = current_busy()
        if stuck or not raised:
            break  # some overloaded device cannot be relieved: infeasible
    max_busy = max(busy.values())
    return QueuePlan(queue_lengths=MappingProxyType({m: tuple(q) for m, q in queue.items()}),
                     busy_s_per_s=MappingProxyType(busy), max_busy_s_per_s=max_busy,
                     feasible=max_busy <= 1.0 + _BUSY_TOLERANCE, allocation=allocation)
