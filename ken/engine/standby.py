"""Standby replicas: a second copy of each model a plan places on one worker only.

A plan may place a model on one device (the planner's choice: say MiniLM-L6 on ``cpu0``
alone, the cheap model on both). When that device's worker process dies, the rows waiting
for the model — the ones queued there, the ones its batch was running, and every row
escalated to it meanwhile — had no other replica to move to and waited for the fresh
worker to load its models: about 10 s of the classifier's p99 for each such kill in the
hour's soak (``docs/reliability.md``).

``with_standby`` gives the engine's scheduler a copy of the plan with one more replica of
each such model, on another CPU device of the plan (the one hosting the fewest replicas),
with no share of the rows in any range: the plan's routing, batching and admission are
unchanged while its workers live, and the model is loaded there beside the others at start
(or at a swap). While the model's own worker reloads, the rows that would wait for it move
to the standby (``Dispatcher.move_queued`` and ``requeue``: every replica of the model not
on a reloading device), and new requests whose first stage reloads are admitted there
(``Dispatcher.first_stage_replicas``).

Only models on one CPU device get a standby, and only on another CPU device of the same
plan, served by worker processes or Ray actors: a thread worker shares one copy of each
model and has nothing to reload, and a copy on another GPU would take GPU memory the plan
did not budget for. Standby replicas are appended after the plan's own, so every replica
index of the plan means the same replica in both. Where the plan gives such a model's one
replica no share in a range, the served plan gives it all (the router spreads a model
without shares evenly over its replicas: the standby would get half). The engine serves no
standby under a dropping policy: its forecast reads the plan's replicas as simulated.
"""

from __future__ import annotations

from dataclasses import replace

from ken.engine.workers import gpu_index
from ken.policy.plan import GearPlan, RangeSchedule, Replica

#: worker kinds whose workers reload their models after a crash or a kill
RELOADING_WORKERS = ("process", "ray")


def standby_replicas(plan: GearPlan) -> list[Replica]:
    """The standby replica ``with_standby`` adds for each model ``plan`` places on one CPU
    device only (none when the plan has no other CPU device)."""
    cpus = [d for d in plan.devices if gpu_index(d) is None]
    hosted = {d: sum(d in r.devices for r in plan.placement) for d in cpus}
    out: list[Replica] = []
    for model in dict.fromkeys(r.model for r in plan.placement):
        reps = [plan.placement[i] for i in plan.replicas_of(model)]
        if len(reps) != 1 or reps[0].degree != 1 or gpu_index(reps[0].devices[0]) is not None:
            continue
        others = [d for d in cpus if d != reps[0].devices[0]]
        if not others:
            continue
        device = min(others, key=lambda d: (hosted[d], cpus.index(d)))
        hosted[device] += 1
        out.append(Replica(model, (device,)))
    return out


def with_standby(plan: GearPlan, workers: str) -> GearPlan:
    """``plan`` with a standby replica (no share in any range; the batch size, batch
    triggers and profiled runtimes of the model's own replica) for each model it places on
    one CPU device only, for ``workers`` that reload (see the module docstring); ``plan``
    itself when there is none to add."""
    if workers not in RELOADING_WORKERS:
        return plan
    extra = standby_replicas(plan)
    if not extra:
        return plan
    own = [plan.replicas_of(r.model)[0] for r in extra]

    def shares(rs: RangeSchedule) -> tuple[float, ...]:
        # where the plan gives the model's one replica no share (a range whose rows it does
        # not expect), all of it: the router spreads a model without shares evenly over its
        # replicas, and the standby must get none of them
        kept = [1.0 if i in own and s == 0 else s for i, s in enumerate(rs.shares)]
        return (*kept, *(0.0 for _ in own))

    ranges = tuple(RangeSchedule(rs.cascade, shares(rs),
                                 (*rs.min_queue, *(rs.min_queue[i] for i in own)), rs.feasible)
                   for rs in plan.ranges)
    runtimes = (*plan.batch_runtime_s, *(plan.batch_runtime_s[i] for i in own)) \
        if plan.batch_runtime_s else ()
    return replace(plan, placement=(*plan.placement, *extra), ranges=ranges,
                   max_batch=(*plan.max_batch, *(plan.max_batch[i] for i in own)),
                   batch_runtime_s=runtimes)
