"""Standby replicas (``ken.engine.standby``): a model a plan places on one CPU worker is loaded
on another one too, with no share of the rows, and serves the rows that would wait for its
own worker while that worker reloads after a kill."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import fakes
from fakes import FakeModel, wait_for

from ken.engine.admission import Admission
from ken.engine.serving import Engine
from ken.engine.standby import standby_replicas, with_standby
from ken.engine.supervision import BatchDeadline
from ken.models.cascade import Cascade
from ken.policy.plan import GearPlan, PlanMetrics, RangeSchedule, Replica
from ken.policy.scheduling import Dispatcher, VirtualClock

#: escalates every row: certainties are at most 1
ALWAYS = 2.0
RELOAD_S = 8.0


def cascade_plan(placement: tuple[Replica, ...], shares: tuple[float, ...],
                 runtimes: bool = True, split_qps: float = 10.0) -> GearPlan:
    """a -(escalates every row)-> b over ``placement`` up to ``split_qps``, a alone above;
    10 ms a batch of <= 4 rows, except a batch size of 3 and runtimes 20 ms on the last
    replica (to see them copied)."""
    n = len(placement)
    return GearPlan("op", (0.0, split_qps, 1e6),
                    (Cascade(("a", "b"), (ALWAYS,)), Cascade(("a",))),
                    placement,
                    (RangeSchedule(0, shares, (1,) * n), RangeSchedule(1, shares, (2,) * n)),
                    (4,) * (n - 1) + (3,), max_wait_s=0.005,
                    predicted=PlanMetrics(1.0, 25.0, 45.0, 50.0, 25.0, 1000, 0, 10.0),
                    batch_runtime_s=(((0.01,) * 4,) * (n - 1) + ((0.02,) * 3,))
                    if runtimes else ())


def test_a_model_on_one_cpu_worker_gets_a_standby_without_a_share() -> None:
    plan = cascade_plan((Replica("a", ("cpu0",)), Replica("a", ("cpu1",)),
                         Replica("b", ("cpu0",))), (0.5, 0.5, 1.0))
    served = with_standby(plan, "process")
    assert served.placement == (*plan.placement, Replica("b", ("cpu1",)))
    assert [rs.shares for rs in served.ranges] == [(0.5, 0.5, 1.0, 0.0)] * 2
    assert [rs.min_queue for rs in served.ranges] == [(1, 1, 1, 1), (2, 2, 2, 2)]
    assert served.max_batch == (4, 4, 3, 3)
    assert served.batch_runtime_s[3] == plan.batch_runtime_s[2] == (0.02,) * 3
    assert served.replicas_of("b") == [2, 3] and served.qps_edges == plan.qps_edges
    assert with_standby(plan, "ray") == served
    # where the model's one replica has no share in a range, it gets all of it there (the
    # router would spread a model without shares over the standby too)
    unshared = cascade_plan(plan.placement, (0.5, 0.5, 0.0))
    assert [rs.shares for rs in with_standby(unshared, "process").ranges] == \
        [(0.5, 0.5, 1.0, 0.0)] * 2
    router = Dispatcher(with_standby(unshared, "process"), VirtualClock(0.0)).router
    assert {router.pick(0, "b") for _ in range(100)} == {2}
    # a thread worker shares one copy of each model: nothing to add
    assert with_standby(plan, "thread") is plan
    # a plan without runtimes stays without them
    assert with_standby(cascade_plan(plan.placement, (0.5, 0.5, 1.0), runtimes=False),
                        "process").batch_runtime_s == ()


def test_standbys_go_to_the_cpu_device_hosting_fewest_replicas_never_to_a_gpu() -> None:
    # a and b each on one device: each gets a standby on the other
    crossed = cascade_plan((Replica("a", ("cpu0",)), Replica("b", ("cpu1",))), (1.0, 1.0))
    assert standby_replicas(crossed) == [Replica("a", ("cpu1",)), Replica("b", ("cpu0",))]
    # three devices: the standby of b goes to the one hosting nothing yet
    spread = cascade_plan((Replica("a", ("cpu0",)), Replica("a", ("cpu1",)),
                           Replica("b", ("cpu1",)), Replica("a", ("cpu2",))),
                          (0.4, 0.3, 1.0, 0.3))
    assert standby_replicas(spread) == [Replica("b", ("cpu0",))]
    # every model already has two replicas, or one device only: nothing to add
    both = cascade_plan((Replica("a", ("cpu0",)), Replica("a", ("cpu1",)),
                         Replica("b", ("cpu0",)), Replica("b", ("cpu1",))),
                        (0.5, 0.5, 0.5, 0.5))
    alone = cascade_plan((Replica("a", ("cpu0",)), Replica("b", ("cpu0",))), (1.0, 1.0))
    assert standby_replicas(both) == standby_replicas(alone) == []
    assert with_standby(alone, "process") is alone
    # a model on a GPU gets no copy (the plan did not budget GPU memory for one), and a CPU
    # model's standby does not go to a GPU
    gpu = cascade_plan((Replica("a", ("cpu0",)), Replica("b", ("cuda0",))), (1.0, 1.0))
    assert standby_replicas(gpu) == []


def test_admission_queues_at_the_standby_while_the_first_stage_reloads() -> None:
    plan = with_standby(cascade_plan((Replica("a", ("cpu0",)), Replica("b", ("cpu1",))),
                                     (1.0, 1.0)), "process")
    disp = Dispatcher(plan, VirtualClock(0.0))
    admission = Admission(VirtualClock(0.0))
    # while a's own worker lives, the standby (replica 2, on cpu1) gets nothing
    assert disp.first_stage_replicas() == (0,)
    assert admission.place(disp, 0, disp.route(), lambda: {"cpu0": 1.0}).reason is not None
    # while it reloads, new requests go to the standby
    assert disp.first_stage_replicas(avoid={"cpu0"}) == (2,)
    placed = admission.place(disp, 1, disp.route(), dict, reloading={"cpu0"})
    assert placed.reason is None and placed.replica == 2
    # every replica reloading: the routed one, as before
    assert disp.first_stage_replicas(avoid={"cpu0", "cpu1"}) == ()
    assert admission.place(disp, 2, 0, dict, reloading={"cpu0", "cpu1"}).replica == 0


def _sources(tmp_path: Path, slow: str) -> dict:
    """``slow`` hangs on its first call and loads slowly (``RELOAD_S``) after its first two
    loads (its own worker's and its standby's, at start); the other model is quick."""
    quick = "b" if slow == "a" else "a"
    return {slow: functools.partial(fakes.reloads_slowly, slow, str(tmp_path), 2, RELOAD_S,
                                    str(tmp_path / "hung")),
            quick: functools.partial(FakeModel, quick)}


def _kill_the_hung_worker(engine: Engine, tmp_path: Path) -> str:
    pid = int(wait_for(tmp_path / "hung"))
    killed = next(d for d, p in engine.pids().items() if p == pid)
    os.kill(pid, signal.SIGKILL)
    wait_for(tmp_path / "reloading")  # the fresh worker loads (8 s)
    return killed


def test_rows_escalated_to_a_model_on_the_killed_worker_run_on_its_standby(tmp_path: Path
                                                                           ) -> None:
    """b on cpu0 only, a on both: cpu0's worker hangs on b's batch and is killed, and
    reloads for 8 s. That batch's row, and the rows that escalate to b meanwhile, are
    answered by b's standby on cpu1 at once, not after the reload (without the standby
    they wait for it)."""
    # the six rows arrive at once: the escalating gear must cover their rate (at 10 qps
    # the rate meter can switch to the gear without b, and a answers them)
    plan = cascade_plan((Replica("a", ("cpu0",)), Replica("a", ("cpu1",)),
                         Replica("b", ("cpu0",))), (0.5, 0.5, 1.0), split_qps=1e5)
    patient = BatchDeadline(floor_s=120.0)  # the kill, not the deadline, ends the held call
    with Engine(plan, _sources(tmp_path, "b"), workers="process", deadline=patient,
                admission="max_in_flight") as engine:
        held = engine.submit("held until its worker is killed")
        killed = _kill_the_hung_worker(engine, tmp_path)
        futures = [engine.submit(f"row {i}") for i in range(6)]
        meanwhile = [f.result(timeout=RELOAD_S / 2) for f in futures]
        outcome = held.result(timeout=RELOAD_S / 2)
        still_loading = killed in engine.pool.loading()
        b_on = {r.device for r in engine.batch_log if r.model == "b"}
    assert killed == "cpu0" and still_loading
    assert [o.status for o in meanwhile] == ["ok"] * 6 and outcome.status == "ok"
    assert [o.model for o in meanwhile] == ["b"] * 6
    assert b_on == {"cpu1"}  # the standby answered every b row


def test_requests_whose_first_model_reloads_are_admitted_at_its_standby(tmp_path: Path
                                                                        ) -> None:
    """a on cpu0 only (b on cpu1): cpu0's worker hangs on a's batch and is killed, and
    reloads for 8 s. New requests, one after another, are admitted at a's standby on cpu1
    and answered while it reloads, none turned away (without the standby they are queued
    behind the reload). cpu1 now runs both stages: admission still holds its queue to the
    plan's target."""
    plan = cascade_plan((Replica("a", ("cpu0",)), Replica("b", ("cpu1",))), (1.0, 1.0))
    patient = BatchDeadline(floor_s=120.0)
    with Engine(plan, _sources(tmp_path, "a"), workers="process", deadline=patient) as engine:
        held = engine.submit("held until its worker is killed")
        killed = _kill_the_hung_worker(engine, tmp_path)
        until = time.monotonic() + RELOAD_S / 2
        meanwhile = [engine.submit(f"row {i}").result(timeout=until - time.monotonic())
                     for i in range(6)]
        outcome = held.result(timeout=until - time.monotonic())
        still_loading = killed in engine.pool.loading()
        rejected = engine.rejected
        a_on = [r.device for r in engine.batch_log if r.model == "a"]
    assert killed == "cpu0" and still_loading and rejected == 0
    assert [o.status for o in meanwhile] == ["ok"] * 6 and outcome.status == "ok"
    assert set(a_on) == {"cpu1"}  # the hung batch was never logged: it never ended


def test_the_engine_names_its_standby_copies_for_explain() -> None:
    plan = cascade_plan((Replica("a", ("cpu0",)), Replica("a", ("cpu1",)),
                         Replica("b", ("cpu0",))), (0.5, 0.5, 1.0))
    loaders = {m: functools.partial(FakeModel, m) for m in "ab"}
    served = Engine(plan, loaders, workers="process")
    assert served.standby_replicas() == [Replica("b", ("cpu1",))]
    assert served.describe_serving(64, "op").endswith(
        "; standby b@cpu1 (no share of the rows: serves while its own worker reloads)")
    assert served.plan is plan  # the plan as given; only its dispatcher serves the copy
    assert served.dispatcher().plan.placement[-1] == Replica("b", ("cpu1",))
    alone = Engine(plan, loaders, workers="process", standby=False)
    assert alone.standby_replicas() == [] and "standby" not in alone.describe_serving(64, "op")
    assert alone.dispatcher().plan is plan
    # none under a dropping policy: its forecast reads the plan's replicas as simulated
    dropping = Engine(plan, loaders, workers="process", dropping="proactive")
    assert dropping.standby_replicas() == [] and dropping.dispatcher().plan is plan
