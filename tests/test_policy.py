"""The scheduling policy shared by simulator and engine: rate meter, gears, router, queue
trigger, escalation and the dispatcher, all driven by a virtual clock."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ken.models.cascade import Cascade
from ken.policy.plan import GearPlan, RangeSchedule, Replica
from ken.policy.scheduling import (
    Batch,
    Dispatcher,
    Escalation,
    GearSelector,
    PolicyError,
    QueueTrigger,
    RateMeter,
    Router,
    VirtualClock,
)

AB = Cascade(("a", "b"), (0.5,))


def plan_of(placement: list[tuple[str, tuple[str, ...]]], cascades: tuple[Cascade, ...] = (AB,),
            ranges: list[tuple[int, tuple[float, ...], tuple[int, ...]]] | None = None,
            edges: tuple[float, ...] = (0.0, 1000.0), max_batch: tuple[int, ...] | None = None,
            **kwargs: Any) -> GearPlan:
    reps = tuple(Replica(m, d) for m, d in placement)
    n = len(reps)
    if ranges is None:
        ranges = [(0, (1.0,) * n, (1,) * n)] * (len(edges) - 1)
    return GearPlan("op", edges, cascades, reps,
                    tuple(RangeSchedule(c, s, q) for c, s, q in ranges),
                    max_batch if max_batch is not None else (4,) * n, **kwargs)


def simple_plan(min_queue: int = 1, max_batch: int = 4, max_wait_s: float = 0.05) -> GearPlan:
    """a@d0 -(0.5)-> b@d1."""
    return plan_of([("a", ("d0",)), ("b", ("d1",))],
                   ranges=[(0, (1.0, 1.0), (min_queue, min_queue))],
                   max_batch=(max_batch, max_batch), max_wait_s=max_wait_s)


# -- RateMeter ---------------------------------------------------------------------------------


def test_rate_meter_counts_fixed_windows_from_its_first_arrival() -> None:
    m = RateMeter(0.25)
    assert m.record(0.11) is True  # opened window 0: [0.11, 0.36)
    assert m.record(0.15) is False
    assert m.record(0.31, n=2) is False  # window 0 now holds 4
    assert m.rate(0.35) == 0.0  # no complete window yet
    assert m.record(0.41) is True  # window 1 opens
    assert m.rate(0.41) == 4 / 0.25  # rate of the last complete window
    m.record(0.51)
    assert m.rate(0.6) == 16.0  # still window 1: unchanged
    assert m.rate(0.66) == 2 / 0.25  # window 2: window 1 held 2
    assert m.rate(0.91) == 0.0  # window 3: window 2 was empty
    m.record(1.01)
    assert m.rate(1.11) == 4.0  # window 4: window 3 held 1
    m.record(1.21)
    m.record(1.31)
    assert m.rate(3.11) == 0.0  # idle gap: the last complete window (11) was empty
    assert m.record(3.12) is False  # rate() already opened window 12
    assert m.rate(3.41) == 4.0


def test_rate_meter_windows_do_not_depend_on_the_clock_origin() -> None:
    """The same arrivals on clocks with other origins (the simulator's trace time, the
    engine's wall clock started before its models loaded) measure the same rates."""
    times = np.cumsum(np.random.default_rng(3).exponential(0.01, 400))
    seen = []
    for origin in (0.0, 0.037, 12.5):
        m = RateMeter(0.1)
        seen.append([(m.record(origin + t), m.rate(origin + t)) for t in times])
    assert seen[0] == seen[1] == seen[2]


def test_rate_meter_rejects_bad_window() -> None:
    with pytest.raises(PolicyError, match="rate window"):
        RateMeter(0.0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 5.0, allow_nan=False), min_size=1, max_size=80),
       st.sampled_from([0.125, 0.25, 0.5]))
def test_rate_meter_property(times: list[float], window: float) -> None:
    times.sort()
    times = [t - times[0] for t in times]  # windows start at the first arrival
    windows = [math.floor(t / window) for t in times]  # exact: window is a power of two
    per_window = Counter(windows)
    m = RateMeter(window)
    for t, w in zip(times, windows, strict=True):
        m.record(t)
        assert m.rate(t) == per_window[w - 1] / window if w > 0 else m.rate(t) == 0.0
    after = windows[-1] + 1
    assert m.rate(after * window) == per_window[after - 1] / window
    assert m.rate((after + 1) * window) == 0.0


# -- GearSelector ------------------------------------------------------------------------------


def gear_plan() -> GearPlan:
    """Ranges 0-10 (a->b), 10-20 (a), 20-30 (a); alpha 8."""
    return plan_of([("a", ("d0",)), ("b", ("d1",))], cascades=(AB, Cascade(("a",))),
                   ranges=[(0, (1.0, 1.0), (1, 1)), (1, (1.0, 0.0), (1, 1)),
                           (1, (1.0, 0.0), (2, 1))],
                   edges=(0.0, 10.0, 20.0, 30.0), alpha=8.0)


def test_gear_selector_range_lookup() -> None:
    g = GearSelector(gear_plan())
    assert [g.range_for(r) for r in (-1.0, 0.0, 9.99, 10.0, 19.0, 20.0, 30.0, 1e9)] == \
        [0, 0, 0, 1, 1, 2, 2, 2]


def test_gear_selector_hysteresis() -> None:
    g = GearSelector(gear_plan())
    assert g.current == 0
    assert g.update(1.0, 5.0, 1000) == 0 and g.switches == []
    assert g.update(2.0, 15.0, 1000) == 1  # up: immediate, whatever the queue
    assert g.switches == [(2.0, 0, 1)]
    assert g.update(3.0, 25.0, 1000) == 2  # up again, same cascade: no switch recorded
    assert g.switches == [(2.0, 0, 1)]
    assert g.update(4.0, 5.0, 1) == 2  # down: 1 queued > 5 / 8, held
    assert g.held == 1
    assert g.update(5.0, 12.0, 2) == 2  # down to range 1: 2 > 1.5, held
    assert g.held == 2
    assert g.update(6.0, 12.0, 1) == 1  # 1 <= 1.5: switch; same cascade, not recorded
    assert g.switches == [(2.0, 0, 1)]
    assert g.update(7.0, 8.0, 2) == 1  # 2 > 1: held
    assert g.update(8.0, 8.0, 1) == 0  # 1 == 8 / 8 is not "more than": switch
    assert g.switches == [(2.0, 0, 1), (8.0, 1, 0)]
    assert g.held == 3


def test_dispatcher_switches_gear_on_measured_rate() -> None:
    plan = plan_of([("a", ("d0",)), ("b", ("d1",))], cascades=(AB, Cascade(("b",))),
                   ranges=[(0, (1.0, 1.0), (1, 1)), (1, (0.0, 1.0), (1, 1))],
                   edges=(0.0, 10.0, 100.0), rate_window_s=0.25)
    clock = VirtualClock()
    d = Dispatcher(plan, clock)
    started = []
    for rid, t in enumerate([0.01, 0.02, 0.03, 0.04]):  # 4 per 0.25 s = 16 qps
        clock.t = t
        started += d.admit(rid)
        assert d.range_of(rid) == 0
    clock.t = 0.3
    started += d.admit(4)  # window 1 opens: measured 16 qps -> range 1 (cascade "b")
    assert d.range_of(4) == 1 and d.current_range == 1
    assert d.gears.switches == [(0.3, 0, 1)]
    assert [b.model for b in started] == ["a", "b"]
    assert started[-1].request_ids == (4,)  # routed to the first model of range 1's cascade


def test_rows_queued_on_a_reloading_device_move_to_the_other_replicas_oldest_first() -> None:
    """``move_queued``: the rows waiting at the replicas on the devices given go to the other
    replicas of the same model, each to the shortest queue, merged by the time each was
    queued; ready batches start; a model with no replica elsewhere keeps its rows."""
    plan = plan_of([("a", ("d0",)), ("a", ("d1",)), ("a", ("d2",)), ("b", ("d0",))],
                   ranges=[(0, (1.0, 1.0, 1.0, 1.0), (1,) * 4)], max_batch=(2, 2, 2, 2),
                   max_wait_s=0.05)
    clock = VirtualClock()
    d = Dispatcher(plan, clock, busy={"d0", "d1", "d2"})  # every device runs a batch
    for rid, (t, rep) in enumerate([(0.01, 0), (0.02, 1), (0.03, 0), (0.04, 2), (0.05, 0),
                                    (0.06, 0), (0.07, 1)]):
        clock.t = t
        assert d.admit(rid, metered=False, replica=rep) == []
    clock.t = 0.08
    # d0's rows 0, 2, 4, 5 (queued at 0.01, 0.03, 0.05, 0.06), one at a time to the shorter
    # of d1 (rows 1, 6) and d2 (row 3), the first of them on a tie, in time order there
    assert d.move_queued({"d0"}) == []  # every device is busy: nothing starts
    assert d.queued(0) == 0
    assert d.queued_ids(1) == (1, 2, 5, 6) and d.queued_ids(2) == (0, 3, 4)
    assert list(d._since[2]) == [0.01, 0.04, 0.05]
    # the moved head's deadline is its own: due max_wait_s after 0.01
    assert d.next_deadline() == pytest.approx(0.06)
    d._busy.discard("d2")
    started = d.poll({"d2"})
    assert [b.request_ids for b in started] == [(0, 3)] and started[0].devices == ("d2",)
    # a replica on a device that loads too gets none of them
    d2 = Dispatcher(plan, VirtualClock(), busy={"d0", "d1", "d2"})
    for rid, rep in enumerate((0, 0, 1)):
        d2.admit(rid, metered=False, replica=rep)
    d2.move_queued({"d0"}, avoid={"d1"})
    assert d2.queued_ids(2) == (0, 1) and d2.queued_ids(1) == (2,)
    d2.move_queued({"d1"}, avoid={"d0", "d2"})  # nowhere to go: it stays
    assert d2.queued_ids(1) == (2,)
    # b has no other replica: its rows stay at d0
    clock.t = 0.09
    d._enqueue(3, 99, 0.09)
    d._req_stage[99], d._req_cascade[99], d._req_range[99] = 1, 0, 0
    d.move_queued({"d0"})
    assert d.queued_ids(3) == (99,)


def test_a_failed_batch_requeues_at_the_other_replicas_and_keeps_its_devices_busy() -> None:
    """``requeue``: a running batch whose worker died goes back to the queues of its model's
    other replicas (the shortest queue first, ahead of rows queued after it started), and
    what is ready starts there; its own devices stay busy (the worker reloads). The rows
    named failed leave the dispatcher. With no other replica (or only ones that load too)
    the rows wait at the batch's own replica, for its devices."""
    plan = plan_of([("a", ("d0",)), ("a", ("d1",)), ("a", ("d2",))], (Cascade(("a",)),),
                   ranges=[(0, (1.0, 1.0, 1.0), (1, 1, 1))], max_batch=(3, 3, 3),
                   max_wait_s=0.05)
    clock = VirtualClock()
    d = Dispatcher(plan, clock)
    started = d.admit(0, metered=False, replica=0)
    started += d.admit(1, metered=False, replica=0)  # d0 is busy with row 0: row 1 waits
    assert [b.request_ids for b in started] == [(0,)]
    failed = started[0]
    d._busy.update({"d1", "d2"})  # the other devices run batches too
    clock.t = 0.01
    d.admit(2, metered=False, replica=1)  # queued after the failed batch started
    clock.t = 0.02
    assert d.requeue(failed) == ([], True)  # nothing can start: every device is busy
    assert d.busy_devices() == {"d0", "d1", "d2"}  # d0 stays busy: its worker reloads
    assert d.queued_ids(2) == (0,) and d.queued_ids(1) == (2,)  # the shorter queue, d2
    assert list(d._since[2]) == [0.0] and d.next_deadline() == pytest.approx(0.05)
    d._busy.discard("d2")
    assert [b.request_ids for b in d.poll({"d2"})] == [(0,)]
    # ahead of the rows queued after the batch started; a replica whose device loads is
    # avoided; a failed row leaves
    clock2 = VirtualClock()
    d2 = Dispatcher(plan, clock2)
    d2._busy.add("d0")  # d0 runs another plan's batch
    b = d2.admit(7, metered=False, replica=1)[0]  # runs on d1 from 0.0
    assert d2.admit(8, metered=False, replica=1) == []  # waits for d1
    clock2.t = 1.0
    d2.admit(9, metered=False, replica=0)  # waits at d0
    with pytest.raises(PolicyError, match="not in flight in this batch"):
        d2.requeue(b, failed=[8])  # row 8 is not in the batch: nothing changes
    assert d2.requeue(b, avoid={"d2"}) == ([], True)  # d2 loads: 7 goes to d0
    assert d2.queued_ids(0) == (7, 9) and d2.queued(2) == 0 and d2.in_flight == 3
    d2._busy.discard("d0")
    assert [b.request_ids for b in d2.poll({"d0"})] == [(7, 9)]
    with pytest.raises(PolicyError, match="not running here"):  # it was taken off
        d2.requeue(b)
    # one replica only: the surviving rows wait at it until its devices are free again
    one = plan_of([("b", ("d0",))], (Cascade(("b",)),), ranges=[(0, (1.0,), (1,))],
                  max_batch=(3,))
    clock3 = VirtualClock()
    d3 = Dispatcher(one, clock3)
    running = d3.admit(0, metered=False)[0]
    assert d3.admit(1, metered=False) == d3.admit(5, metered=False) == []  # they wait
    clock3.t = 0.5
    assert d3.requeue(running) == ([], False)
    assert d3.busy_devices() == {"d0"} and d3.queued_ids(0) == (0, 1, 5)  # 0 ahead
    d3._busy.discard("d0")
    again = d3.poll({"d0"})
    assert [x.request_ids for x in again] == [(0, 1, 5)]
    assert d3.requeue(again[0], failed=[1]) == ([], False)  # row 1 ends in error
    assert d3.in_flight == 2 and d3.queued_ids(0) == (0, 5)
    with pytest.raises(KeyError):
        d3.range_of(1)

def test_router_follows_shares_and_is_deterministic() -> None:
    plan = plan_of([("a", ("d0",)), ("a", ("d1",)), ("a", ("d2",)), ("b", ("d3",))],
                   ranges=[(0, (0.2, 0.3, 0.5, 1.0), (1,) * 4),
                           (0, (0.0, 0.0, 0.0, 1.0), (1,) * 4),
                           (0, (0.7, 0.0, 0.3, 0.0), (1,) * 4)],
                   edges=(0.0, 1.0, 2.0, 3.0))
    r1, r2 = Router(plan), Router(plan)
    picks = [r1.pick(0, "a") for _ in range(1000)]
    assert picks == [r2.pick(0, "a") for _ in range(1000)]
    counts = Counter(picks)
    for rep, share in ((0, 0.2), (1, 0.3), (2, 0.5)):
        assert abs(counts[rep] - 1000 * share) <= 10
    assert {r1.pick(0, "b") for _ in range(20)} == {3}
    # all shares 0 in range 1: spread evenly
    assert Counter(r1.pick(1, "a") for _ in range(999)) == {0: 333, 1: 333, 2: 333}
    # a replica with share 0 is never picked
    assert set(Counter(r1.pick(2, "a") for _ in range(1000))) == {0, 2}
    with pytest.raises(PolicyError, match="no replica of 'c'"):
        r1.pick(0, "c")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=5)
       .filter(lambda w: sum(w) > 1e-3))
def test_router_shares_property(weights: list[float]) -> None:
    n = len(weights)
    plan = plan_of([("a", (f"d{i}",)) for i in range(n)], cascades=(Cascade(("a",)),),
                   ranges=[(0, tuple(weights), (1,) * n)])
    router = Router(plan)
    picks = [router.pick(0, "a") for _ in range(1000)]
    counts = Counter(picks)
    total = sum(weights)
    for rep, w in enumerate(weights):
        assert abs(counts[rep] - 1000 * w / total) <= 10, (rep, counts, weights)
        if w == 0:
            assert counts[rep] == 0
    other = Router(plan)
    assert picks == [other.pick(0, "a") for _ in range(1000)]


# -- QueueTrigger and Escalation ---------------------------------------------------------------


def test_queue_trigger() -> None:
    trig = QueueTrigger(0.2)
    assert trig.ready(5, 5, 0.0, 0.0) and trig.ready(6, 5, 0.0, 0.0)
    assert not trig.ready(4, 5, 0.0, 0.1)
    assert not trig.ready(0, 1, 0.0, 10.0)  # an empty queue never runs
    oldest = 0.1
    assert trig.deadline(oldest) == 0.1 + 0.2  # 0.30000000000000004
    assert trig.ready(1, 5, oldest, trig.deadline(oldest))
    assert trig.ready(1, 5, oldest, 0.30000000000000004)
    assert not trig.ready(1, 5, oldest, 0.3)


@settings(max_examples=60, deadline=None)
@given(st.floats(0.0, 1e6, allow_nan=False), st.floats(1e-6, 10.0, allow_nan=False))
def test_queue_trigger_deadline_always_fires(oldest: float, max_wait: float) -> None:
    trig = QueueTrigger(max_wait)
    deadline = trig.deadline(oldest)
    assert trig.ready(1, 5, oldest, deadline)
    assert not trig.ready(1, 5, oldest, math.nextafter(deadline, -math.inf))


def test_escalation_uses_each_cascades_stage_thresholds() -> None:
    """Two cascades in one plan: a row escalates by its own cascade's threshold at its stage."""
    plan = plan_of([("a", ("d0",)), ("b", ("d1",)), ("c", ("d2",))],
                   cascades=(Cascade(("a", "b", "c"), (0.6, 0.7)), Cascade(("b", "c"), (0.2,))),
                   ranges=[(0, (1.0, 1.0, 1.0), (1, 1, 1)), (1, (1.0, 1.0, 1.0), (1, 1, 1))],
                   edges=(0.0, 10.0, 1000.0), rate_window_s=0.25)
    esc = Escalation(plan)
    assert esc.escalates(0, 0, 0.59) and not esc.escalates(0, 0, 0.6)
    assert esc.escalates(0, 1, 0.65) and not esc.escalates(0, 1, 0.7)
    assert not esc.escalates(0, 2, -1e300)  # the last stage resolves everything
    assert esc.escalates(1, 0, 0.1) and not esc.escalates(1, 1, 0.0)
    clock = VirtualClock()
    d = Dispatcher(plan, clock)
    [a0] = d.admit(0)  # range 0: cascade a -(0.6)-> b -(0.7)-> c
    clock.t = 0.01
    done = d.finish(a0, [0.59])
    assert done.escalated == (0,)
    [b0] = done.started
    assert b0.model == "b"
    clock.t = 0.02
    done = d.finish(b0, [0.65])  # stage 1 threshold is 0.7, not 0.6
    assert done.escalated == (0,)
    [c0] = done.started
    clock.t = 0.03
    assert d.finish(c0, [0.0]).resolved_stages == (2,)
    # 12 arrivals in window 0 (48 qps) move range 1 (cascade b -(0.2)-> c) in at t = 0.3
    for rid in range(1, 13):
        for b in d.admit(rid):
            d.finish(b, [1.0] * len(b.request_ids))
    clock.t = 0.3
    [b1] = d.admit(100)
    assert d.range_of(100) == 1 and b1.model == "b"
    clock.t = 0.31
    done = d.finish(b1, [0.25])  # above cascade 1's 0.2: resolved at its first stage
    assert done.resolved == (100,) and done.resolved_stages == (0,)


# -- Dispatcher --------------------------------------------------------------------------------


def test_admit_starts_batch_when_device_free() -> None:
    clock = VirtualClock()
    d = Dispatcher(simple_plan(), clock)
    [b] = d.admit(7)
    assert b == Batch(0, "a", ("d0",), (7,), 0.0)
    assert d.busy_devices() == {"d0"} and d.in_flight == 1 and d.queued() == 0
    clock.t = 0.001
    assert d.admit(8) == []  # d0 is busy
    clock.t = 0.002
    assert d.admit(9) == []
    assert d.queued(0) == 2 and d.in_flight == 3
    clock.t = 0.01
    done = d.finish(b, [0.9])
    assert done.resolved == (7,) and done.resolved_stages == (0,) and done.escalated == ()
    [b2] = done.started
    assert b2.request_ids == (8, 9) and b2.started_s == 0.01 and b2.replica == 0
    assert d.busy_devices() == {"d0"} and d.in_flight == 2


def test_min_queue_waits_for_rows_or_max_wait() -> None:
    clock = VirtualClock()
    d = Dispatcher(simple_plan(min_queue=4, max_wait_s=0.05), clock)
    for rid in range(3):
        clock.t = 0.01 * rid
        assert d.admit(rid) == []
    assert d.next_deadline() == pytest.approx(0.05)
    clock.t = 0.03
    [b] = d.admit(3)  # the fourth row triggers the batch
    assert b.request_ids == (0, 1, 2, 3)
    assert d.next_deadline() is None
    # now only one row: it runs when it has waited max_wait
    d.finish(b, [1.0] * 4)
    clock.t = 0.1
    assert d.admit(4) == []
    deadline = d.next_deadline()
    assert deadline == 0.1 + 0.05
    clock.t = 0.14
    assert d.expire() == []  # too early
    clock.t = deadline
    [b] = d.expire()
    assert b.request_ids == (4,) and b.started_s == deadline
    assert d.next_deadline() is None


def test_deadline_while_device_busy_runs_when_device_frees() -> None:
    clock = VirtualClock()
    d = Dispatcher(simple_plan(min_queue=4, max_wait_s=0.05), clock)
    [b] = [x for rid in range(4) for x in d.admit(rid)]
    clock.t = 0.01
    d.admit(4)
    clock.t = d.next_deadline()  # type: ignore[assignment]
    assert clock.t == 0.01 + 0.05
    assert d.expire() == []  # d0 still busy
    clock.t = 0.2
    [nxt] = d.finish(b, [1.0] * 4).started
    assert nxt.request_ids == (4,)


def test_finish_escalates_rows_below_threshold() -> None:
    clock = VirtualClock()
    d = Dispatcher(simple_plan(min_queue=1, max_batch=8), clock)
    [first] = d.admit(0)
    for rid in range(1, 6):
        d.admit(rid)
    done = d.finish(first, [0.1])
    assert done.escalated == (0,) and done.resolved == ()
    batches = {b.model: b for b in done.started}
    assert batches["a"].request_ids == (1, 2, 3, 4, 5)
    assert batches["b"].request_ids == (0,) and batches["b"].devices == ("d1",)
    clock.t = 0.5
    # below (0.2, 0.49999), at (0.5) and above (0.9, 1.0) the 0.5 threshold
    done = d.finish(batches["a"], [0.2, 0.5, 0.9, 0.49999, 1.0])
    assert done.escalated == (1, 4)
    assert done.resolved == (2, 3, 5) and done.resolved_stages == (0, 0, 0)
    assert done.started == ()  # b's device is still busy
    assert d.queued(1) == 2
    clock.t = 0.6
    done = d.finish(batches["b"], [0.0])  # the last stage resolves whatever its certainty
    assert done.resolved == (0,) and done.resolved_stages == (1,)
    [b2] = done.started
    assert b2.model == "b" and b2.request_ids == (1, 4)
    done = d.finish(b2, [0.0, 0.3])
    assert done.resolved == (1, 4) and done.resolved_stages == (1, 1)
    assert d.in_flight == 0 and d.busy_devices() == frozenset()


def test_batches_never_exceed_max_batch() -> None:
    clock = VirtualClock()
    d = Dispatcher(simple_plan(max_batch=3), clock)
    [b] = d.admit(0)
    for rid in range(1, 8):
        assert d.admit(rid) == []
    sizes = []
    while d.in_flight:
        sizes.append(len(b.request_ids))
        started = d.finish(b, [1.0] * len(b.request_ids)).started
        if not started:
            break
        [b] = started
    assert sizes == [1, 3, 3, 1] and d.in_flight == 0


def test_replicas_on_one_device_time_share_it() -> None:
    clock = VirtualClock()
    d = Dispatcher(plan_of([("a", ("d0",)), ("b", ("d0",))]), clock)
    [b0] = d.admit(0)
    clock.t = 0.01
    assert d.admit(1) == []
    clock.t = 0.02
    done = d.finish(b0, [0.0])  # row 0 escalates to b, also on d0
    [b1] = done.started  # only one of the two ready queues may run: the older head (a's)
    assert b1.model == "a" and b1.request_ids == (1,)
    assert d.queued(1) == 1
    clock.t = 0.03
    [b2] = d.finish(b1, [1.0]).started
    assert b2.model == "b" and b2.request_ids == (0,)


def test_tensor_parallel_replica_needs_all_its_devices() -> None:
    busy: set[str] = set()
    clock = VirtualClock()
    main = Dispatcher(plan_of([("a", ("d0",)), ("b", ("d1", "d2"))]), clock, busy)
    other = Dispatcher(plan_of([("c", ("d2",))], cascades=(Cascade(("c",)),)), clock, busy)
    [oc] = other.admit(100)  # another operator occupies d2
    [ba] = main.admit(0)
    assert busy == {"d0", "d2"}
    clock.t = 0.01
    assert main.finish(ba, [0.0]).started == ()  # b needs d1 and d2; d2 is busy
    assert main.queued(1) == 1 and busy == {"d2"}
    clock.t = 0.02
    assert other.finish(oc, [1.0]).resolved == (100,)
    assert main.poll(["d2"]) == [Batch(1, "b", ("d1", "d2"), (0,), 0.02)]
    assert busy == {"d1", "d2"}
    assert other.admit(101) == []  # d2 is taken by the tensor-parallel replica
    assert main.poll(["zzz"]) == []


def test_drain_returns_queued_requests() -> None:
    clock = VirtualClock()
    d = Dispatcher(simple_plan(min_queue=4), clock)
    for rid in range(4):
        d.admit(rid)  # the fourth starts a batch
    for rid in range(4, 7):
        d.admit(rid)
    assert sorted(d.drain()) == [4, 5, 6]
    assert d.queued() == 0 and d.in_flight == 4 and d.next_deadline() is None
    assert d.drain() == []
    d.admit(5)  # a drained id may be admitted again


def test_dispatcher_errors() -> None:
    clock = VirtualClock()
    d = Dispatcher(simple_plan(), clock)
    [b] = d.admit(1)
    with pytest.raises(PolicyError, match="already admitted"):
        d.admit(1)
    with pytest.raises(PolicyError, match="1 rows got 2 certainties"):
        d.finish(b, [1.0, 1.0])
    with pytest.raises(PolicyError, match="is not running here"):
        d.finish(Batch(1, "b", ("d1",), (1,), 0.0), [1.0])
    d.finish(b, [1.0])
    with pytest.raises(PolicyError, match="not running here"):
        d.finish(b, [1.0])  # finished twice


def test_rejected_finish_leaves_state_unchanged() -> None:
    clock = VirtualClock()
    d = Dispatcher(simple_plan(), clock)
    [b] = d.admit(1)
    with pytest.raises(PolicyError, match="not running here|not in flight"):
        d.finish(Batch(0, "a", ("d0",), (99,), 0.0), [1.0])
    assert d.busy_devices() == {"d0"}
    assert d.finish(b, [1.0]).resolved == (1,)


def test_finish_rejects_a_batch_it_never_started() -> None:
    clock = VirtualClock()
    d = Dispatcher(simple_plan(), clock)
    d.admit(1)  # running on d0
    d.admit(2)  # queued behind it
    with pytest.raises(PolicyError):
        d.finish(Batch(0, "a", ("d0",), (2,), 0.0), [1.0])


# -- Dispatcher under random operation sequences ------------------------------------------------


CASCADES = (Cascade(("a",)), Cascade(("a", "b"), (0.5,)), Cascade(("b", "c"), (0.3,)),
            Cascade(("a", "b", "c"), (0.5, 0.7)))


@st.composite
def random_plans(draw: st.DrawFn) -> GearPlan:
    chosen = draw(st.lists(st.sampled_from(range(len(CASCADES))), min_size=1, max_size=3,
                           unique=True))
    cascades = tuple(CASCADES[i] for i in chosen)
    models = sorted({m for c in cascades for m in c.models})
    device_sets = st.sampled_from([("d0",), ("d1",), ("d2",), ("d0", "d1"), ("d1", "d2")])
    placement = []
    for m in models:
        for devs in draw(st.lists(device_sets, min_size=1, max_size=2, unique=True)):
            placement.append((m, devs))
    n = len(placement)
    n_ranges = draw(st.integers(1, 3))
    ranges = [(draw(st.integers(0, len(cascades) - 1)),
               tuple(draw(st.lists(st.sampled_from([0.0, 0.25, 1.0]), min_size=n, max_size=n))),
               tuple(draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))))
              for _ in range(n_ranges)]
    edges = tuple(float(20 * k) for k in range(n_ranges + 1))
    max_batch = tuple(draw(st.lists(st.integers(1, 5), min_size=n, max_size=n)))
    return plan_of(placement, cascades, ranges, edges, max_batch,
                   max_wait_s=draw(st.sampled_from([0.01, 0.05])), rate_window_s=0.05)


class Harness:
    """Drives a dispatcher and checks every batch it starts."""

    def __init__(self, plan: GearPlan, seed: int) -> None:
        self.plan = plan
        self.clock = VirtualClock()
        self.d = Dispatcher(plan, self.clock)
        self.rng = np.random.default_rng(seed)
        self.running: list[Batch] = []
        self.device_of: dict[str, Batch] = {}
        self.stage: dict[int, int] = {}
        self.cascade: dict[int, Cascade] = {}
        self.resolved: Counter[int] = Counter()
        self.next_id = 0

    def started(self, batches: Any) -> None:
        for b in batches:
            rep = self.plan.placement[b.replica]
            assert b.model == rep.model and b.devices == rep.devices
            assert 1 <= len(b.request_ids) <= self.plan.max_batch[b.replica]
            assert b.started_s == self.clock.t
            for dev in b.devices:
                assert dev not in self.device_of, f"{dev} runs two batches at once"
                self.device_of[dev] = b
            running_ids = {i for r in self.running for i in r.request_ids}
            for rid in b.request_ids:
                assert rid not in running_ids
                assert self.cascade[rid].models[self.stage[rid]] == b.model
            self.running.append(b)

    def admit(self) -> None:
        rid = self.next_id
        self.next_id += 1
        started = self.d.admit(rid)
        self.cascade[rid] = self.plan.cascade_of(self.d.range_of(rid))
        self.stage[rid] = 0
        self.started(started)

    def finish(self, index: int) -> None:
        b = self.running.pop(index % len(self.running))
        for dev in b.devices:
            del self.device_of[dev]
        cert = self.rng.choice([0.0, 0.3, 0.5, 0.7, 1.0], size=len(b.request_ids))
        done = self.d.finish(b, cert)
        expected_up = []
        for rid, c in zip(b.request_ids, cert, strict=True):
            cas, s = self.cascade[rid], self.stage[rid]
            if s < len(cas.thresholds) and c < cas.thresholds[s]:
                expected_up.append(rid)
                self.stage[rid] = s + 1
        assert list(done.escalated) == expected_up
        assert set(done.resolved) == set(b.request_ids) - set(expected_up)
        for rid, s in zip(done.resolved, done.resolved_stages, strict=True):
            assert s == self.stage[rid]
            self.resolved[rid] += 1
        self.started(done.started)

    def tick(self, dt: float) -> None:
        self.clock.t += dt
        deadline = self.d.next_deadline()
        if deadline is not None and deadline <= self.clock.t:
            self.started(self.d.expire())

    def run_to_completion(self) -> None:
        for _ in range(10_000):
            if self.running:
                self.clock.t += 0.001
                self.finish(0)
            elif self.d.in_flight:
                deadline = self.d.next_deadline()
                assert deadline is not None, "rows are queued but nothing will run them"
                self.clock.t = max(self.clock.t, deadline)
                started = self.d.expire()
                assert started, "an expired queue did not start on free devices"
                self.started(started)
            else:
                return
        raise AssertionError("did not finish")


@settings(max_examples=60, deadline=None)
@given(random_plans(), st.integers(0, 2**32 - 1),
       st.lists(st.one_of(st.just(("admit", 0)), st.tuples(st.just("finish"), st.integers(0, 9)),
                          st.tuples(st.just("tick"), st.sampled_from([0.001, 0.01, 0.04, 0.2]))),
                min_size=1, max_size=60))
def test_dispatcher_random_operations(plan: GearPlan, seed: int,
                                      ops: list[tuple[str, Any]]) -> None:
    h = Harness(plan, seed)
    for op, arg in ops:
        if op == "admit":
            h.admit()
        elif op == "finish" and h.running:
            h.clock.t += 0.001
            h.finish(arg)
        elif op == "tick":
            h.tick(arg)
    h.run_to_completion()
    assert h.d.in_flight == 0 and h.d.queued() == 0 and not h.d.busy_devices()
    assert h.resolved == Counter(range(h.next_id))  # every request resolved exactly once


@settings(max_examples=30, deadline=None)
@given(random_plans(), st.integers(0, 2**32 - 1), st.integers(1, 30))
def test_drain_returns_every_queued_request(plan: GearPlan, seed: int, n: int) -> None:
    h = Harness(plan, seed)
    for _ in range(n):
        h.admit()
        h.clock.t += 0.002
    if h.running:
        h.finish(0)  # some rows may escalate into later queues
    running = {i for b in h.running for i in b.request_ids}
    drained = h.d.drain()
    assert len(drained) == len(set(drained))
    assert set(drained) | running | set(h.resolved) == set(range(n))
    assert not set(drained) & running and not set(drained) & set(h.resolved)
    assert h.d.in_flight == len(running) and h.d.queued() == 0
