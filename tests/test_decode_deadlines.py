"""Deadline-aware decode batches (Apt-Serve's choice of joiners, issue 37): the choice against
brute force on small cases, the rules by hand, goodput, and the simulator and the engine's
decode server taking the same decisions."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ken.errors import EngineError, PolicyError, SimulationError
from ken.optimizer.decode_sim import simulate_decoding
from ken.optimizer.tokens import TokenCost
from ken.policy.decoding import (
    Candidate,
    DecodeScheduler,
    DecodeStep,
    ServiceTargets,
    choose_joiners,
    joiner_value,
    trim_joiners,
)

LOOSE = ServiceTargets(ttft_s=1000.0, tbt_s=1000.0)  # every deadline can be met


def flat_cost(prefill: float = 1.0, decode: float = 0.5) -> TokenCost:
    """A pass costs a constant (no dependence on batch or length)."""
    return TokenCost("m", "hw", (), (), (prefill, 0.0, 0.0), (decode, 0.0, 0.0), 0, 1)


# -- the choice of joiners against brute force ------------------------------------------------

candidates = st.lists(st.tuples(st.integers(1, 30), st.sampled_from([0.0, 0.5, 1.0, 2.5, 4.0]),
                                st.booleans()), min_size=0, max_size=7)


def feasible(chosen: list[Candidate], rows: int, longest: int, max_running: int,
             budget: int | None) -> bool:
    if rows + len(chosen) > max_running:
        return False
    width = max([longest, *(c.final_tokens for c in chosen)])
    return budget is None or (rows + len(chosen)) * width <= budget


@settings(max_examples=300, deadline=None)
@given(candidates, st.integers(0, 3), st.integers(0, 30), st.integers(1, 6),
       st.sampled_from([None, 20, 45, 60, 100]))
def test_choice_is_the_best_subset_that_fits(cands, rows, longest, max_running, budget) -> None:  # noqa: ANN001
    """Every subset of the waiting requests that fits the budget and ``max_running``: none has
    a higher ``joiner_value`` than the one chosen, and the chosen one fits."""
    rows = min(rows, max_running)  # the scheduler never runs more
    if rows == 0:
        longest = 0  # no running row, no width yet
    assume(budget is None or rows * longest <= budget)  # the running rows fit
    pool = [Candidate(i, f, p, m) for i, (f, p, m) in enumerate(cands)]
    chosen_ids = choose_joiners(pool, rows, longest, max_running, budget)
    chosen = [c for c in pool if c.request_id in chosen_ids]
    assert list(chosen_ids) == sorted(chosen_ids)  # arrival order
    assert feasible(chosen, rows, longest, max_running, budget)
    best = max(joiner_value(s) for k in range(len(pool) + 1)
               for s in itertools.combinations(pool, k)
               if feasible(list(s), rows, longest, max_running, budget))
    assert joiner_value(chosen) == best


def test_choice_prefers_many_short_requests_to_one_long_one_under_the_budget() -> None:
    """FCFS would take the long head of the queue alone; the padded cache makes every row cost
    the width, so the four short ones (more pending time in all) win."""
    pool = [Candidate(0, 50, 3.0, True)] + [Candidate(k, 10, 1.0, True) for k in (1, 2, 3, 4)]
    assert choose_joiners(pool, 0, 0, 8, 50) == (1, 2, 3, 4)
    # one short request only: the long one is worth more
    assert choose_joiners(pool[:2], 0, 0, 8, 50) == (0,)


def test_requests_that_missed_their_deadline_join_only_when_room_is_left() -> None:
    late, fresh = Candidate(0, 10, 9.0, False), Candidate(1, 10, 0.1, True)
    assert choose_joiners([late, fresh], 0, 0, 1, None) == (1,)
    assert choose_joiners([late, fresh], 0, 0, 2, None) == (0, 1)
    assert choose_joiners([late], 0, 0, 1, None) == (0,)  # alone, it still runs


def test_a_prefill_is_cut_until_the_joiners_that_can_meet_their_deadline_do() -> None:
    """A prefill costs 1 s per row here. Four joiners at 0 s: A (deadline 1.5 s), B (2.5 s),
    C (9 s) and D (already late, the longest prompt). All four: the pass ends at 4 s and A
    and B miss. D goes first (late anyway), then C (latest deadline): A and B end at 2 s —
    B makes it, A (1.5 s) still misses, so B goes too and A runs alone, ending at 1 s."""
    cost = TokenCost("m", "hw", (), (), (0.0, 1.0, 0.0), (0.1, 0.0, 0.0), 0, 1)
    a = Candidate(0, 20, 1.0, True, 10, 1.5)
    b = Candidate(1, 20, 1.0, True, 10, 2.5)
    c = Candidate(2, 20, 1.0, True, 10, 9.0)
    d = Candidate(3, 40, 5.0, False, 30, -1.0)
    assert trim_joiners([a, b, c, d], cost, 0.0) == (0,)
    assert trim_joiners([b, c, d], cost, 0.0) == (1, 2)  # both end at 2 s
    assert trim_joiners([c, d], cost, 0.0) == (2, 3)  # C meets it beside D: nothing to cut
    assert trim_joiners([d], cost, 0.0) == (3,)


# -- the scheduler ------------------------------------------------------------------------------


def test_an_idle_server_admits_a_request_that_can_meet_its_deadline() -> None:
    sched = DecodeScheduler(4, 100, order="deadline",
                            targets=ServiceTargets(ttft_s=2.0, tbt_s=0.5), cost=flat_cost())
    sched.admit(7, 10, 3, arrival_s=5.0)
    step = sched.next_step(now=5.0)
    assert step == DecodeStep("prefill", (7,))
    sched.step_done(step, [], now=6.0)
    assert sched.next_step(now=6.0) == DecodeStep("decode", (7,))


def test_deadline_order_serves_a_meetable_request_before_an_older_lost_one() -> None:
    """One row per pass: FCFS serves the oldest (its TTFT target is already lost), the deadline
    order the one that can still make it; the lost one runs next."""
    targets = ServiceTargets(ttft_s=2.0, tbt_s=1.0)
    fcfs = DecodeScheduler(1, order="fcfs", targets=targets)
    late = DecodeScheduler(1, order="deadline", targets=targets, cost=flat_cost(1.0, 0.5))
    for sched in (fcfs, late):
        sched.admit(0, 10, 1, arrival_s=0.0)
        sched.admit(1, 10, 1, arrival_s=2.5)
    assert fcfs.next_step(now=3.0) == DecodeStep("prefill", (0,))
    step = late.next_step(now=3.0)
    assert step == DecodeStep("prefill", (1,))
    late.step_done(step, [1], now=4.0)
    assert late.next_step(now=4.0) == DecodeStep("prefill", (0,))


def test_a_prefill_waits_when_it_would_break_more_running_requests_than_it_saves() -> None:
    """Prefill 1 s, decode 0.1 s. A runs with 2 tokens left to make (one decode pass: done at
    0.1 s from now) and 0.5 s before its TGT deadline: a prefill first would finish it at
    1.1 s, too late; B waits with 10 s to its TTFT deadline, so B's prefill goes after A's
    decode. With B's deadline 1.05 s away (met now, missed after a decode pass) it is one
    against one and the prefill goes first."""
    cost = flat_cost(prefill=1.0, decode=0.1)
    for b_ttft_left, first in ((10.0, "decode"), (1.05, "prefill")):
        targets = ServiceTargets(ttft_s=b_ttft_left, tbt_s=0.1)
        sched = DecodeScheduler(4, order="deadline", targets=targets, cost=cost)
        # A: arrived at 0 with target ttft + 1 x tbt for its 2 tokens; now = that - 0.5 s
        sched.admit(0, 5, 2, arrival_s=0.0)
        step = sched.next_step(now=0.0)
        sched.step_done(step, [], now=0.0)  # first token at once: A met its TTFT target
        now = targets.tgt_s(2) - 0.5
        sched.admit(1, 5, 3, arrival_s=now)
        assert sched.next_step(now=now).kind == first


def test_fcfs_is_the_default_and_ignores_the_clock() -> None:
    steps = []
    for kwargs in ({}, {"order": "fcfs", "targets": LOOSE, "cost": flat_cost()}):
        sched = DecodeScheduler(2, 40, **kwargs)
        for rid, (p, n) in enumerate([(30, 5), (2, 2), (3, 3)]):
            sched.admit(rid, p, n, arrival_s=float(rid))
        got = []
        while sched.load:
            step = sched.next_step(now=100.0 * len(got)) if kwargs else sched.next_step()
            got.append(step)
            sched.step_done(step, list(step.request_ids))
        steps.append(got)
    assert steps[0] == steps[1]
    assert steps[0][0] == DecodeStep("prefill", (0,))  # the long head joins alone first


def test_bad_settings_are_refused_with_what_to_do() -> None:
    with pytest.raises(PolicyError, match="unknown decode order 'edf'; use fcfs or deadline"):
        DecodeScheduler(2, order="edf")  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="needs targets"):
        DecodeScheduler(2, order="deadline")
    with pytest.raises(PolicyError, match="ttft_s must be a finite number"):
        ServiceTargets(ttft_s=-1.0, tbt_s=0.1)
    with pytest.raises(PolicyError, match="tbt_s"):
        ServiceTargets(ttft_s=1.0, tbt_s=float("nan"))
    sched = DecodeScheduler(2, order="deadline", targets=LOOSE)
    sched.admit(0, 3, 1)
    with pytest.raises(PolicyError, match="needs the time"):
        sched.next_step()
    with pytest.raises(SimulationError, match="unknown decode order"):
        simulate_decoding(flat_cost(), [0.0], [3], [1], 1, order="lifo")  # type: ignore[arg-type]
    with pytest.raises(SimulationError, match="needs targets"):
        simulate_decoding(flat_cost(), [0.0], [3], [1], 1, order="deadline")


# -- the simulator and goodput ------------------------------------------------------------------


def test_goodput_counts_requests_meeting_both_targets() -> None:
    """Prefill 1 s, decode 0.5 s, one row per pass. A (0 s) has its first token at 1 and its 3rd
    at 2; B (0.25 s) waits, prefills 2-3 (TTFT 2.75 s) and ends at 4 (TGT 3.75 s)."""
    run = simulate_decoding(flat_cost(), [0.0, 0.25], [4, 4], [3, 3], max_running=1)
    assert run.first_token_s.tolist() == [1.0, 3.0]
    assert run.completion_s.tolist() == [2.0, 4.0]
    assert run.meets(ServiceTargets(1.0, 0.5)).tolist() == [True, False]
    assert run.meets(ServiceTargets(2.75, 0.5)).tolist() == [True, True]
    assert run.meets(ServiceTargets(2.75, 0.25)).tolist() == [True, False]  # B: TGT 3.75 > 3.25
    assert run.meets(ServiceTargets(0.75, 0.5)).tolist() == [False, False]
    assert run.goodput(ServiceTargets(1.0, 0.5)) == 0.5
    assert run.goodput(ServiceTargets(1.0, 0.5), requests=4) == 0.25  # 2 failed: missed
    with pytest.raises(SimulationError, match="only 1 were sent"):
        run.goodput(LOOSE, requests=1)


def test_deadline_order_meets_more_targets_than_fcfs_on_a_burst() -> None:
    """A burst of 6 at once, one row per pass (prefill 1 s, one token each): FCFS serves in
    arrival order, and so does the deadline order while deadlines can be met — then it serves
    a new arrival before older requests already past theirs."""
    arrivals = [0.0] * 6 + [3.5, 4.5]
    targets = ServiceTargets(ttft_s=2.0, tbt_s=1.0)
    runs = {order: simulate_decoding(flat_cost(), arrivals, [4] * 8, [1] * 8, 1, order=order,
                                     targets=targets)
            for order in ("fcfs", "deadline")}
    met = {order: run.meets(targets) for order, run in runs.items()}
    assert met["fcfs"].tolist() == [True, True] + [False] * 6
    assert met["deadline"].tolist() == [True, True] + [False] * 4 + [True, True]
    assert runs["deadline"].output_tokens.sum() == runs["fcfs"].output_tokens.sum()


requests = st.lists(st.tuples(st.floats(0, 20), st.integers(1, 40), st.integers(0, 10)),
                    min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(requests, st.integers(1, 5), st.sampled_from([None, 60, 150]),
       st.sampled_from(["continuous", "static"]), st.floats(0.5, 20), st.floats(0.05, 2))
def test_deadline_order_serves_every_request_within_the_limits(reqs, max_running, budget,  # noqa: ANN001
                                                               mode, ttft, tbt) -> None:
    """Whatever the targets, every request gets all its tokens (demoted ones too), the rows
    and the padded cache stay within their limits, and times are ordered."""
    cost = TokenCost("m", "hw", (), (), (0.05, 0.01, 1e-3), (0.02, 0.003, 2e-5), 0, 1)
    targets = ServiceTargets(ttft, tbt)
    reqs = sorted(reqs)
    if budget is not None:
        reqs = [r for r in reqs if r[1] + r[2] <= budget]
        if not reqs:
            return
    arrivals = [a for a, _, _ in reqs]
    prompts = [p for _, p, _ in reqs]
    outputs = [o for _, _, o in reqs]
    run = simulate_decoding(cost, arrivals, prompts, outputs, max_running, budget, mode,
                            order="deadline", targets=targets)
    assert run.output_tokens.tolist() == outputs  # the simulator also checks the total
    assert np.all(run.first_token_s > run.arrival_s)
    assert np.all(run.completion_s >= run.first_token_s)
    # the same requests through the scheduler by hand: limits after every pass
    sched = DecodeScheduler(max_running, budget, mode, "deadline", targets, cost)
    made, now, k = [0] * len(reqs), 0.0, 0
    while k < len(reqs) or sched.load:
        while k < len(reqs) and arrivals[k] <= now:
            sched.admit(k, prompts[k], outputs[k], arrivals[k])
            k += 1
        step = sched.next_step(now)
        if step is None:
            now = arrivals[k]
            continue
        now += 0.1
        done = []
        for rid in step.request_ids:
            made[rid] += outputs[rid] > made[rid]
            if made[rid] >= outputs[rid]:
                done.append(rid)
        sched.step_done(step, done, now)
        assert sched.running <= max_running
        assert budget is None or sched.kv_tokens() <= budget
    assert made == outputs


# -- the engine takes the simulator's decisions -------------------------------------------------


@pytest.fixture(scope="module")
def lm(home):  # noqa: ANN001 - conftest's KEN_HOME (SmolLM2 converted there)
    from conftest import REFERENCE_DEVICE

    from ken.models.resources import Resources

    return Resources(REFERENCE_DEVICE, home=home).causal_lm("smollm2-135m")


def prefill_groups(first_token_s: np.ndarray) -> list[tuple[int, ...]]:
    """Requests grouped by the prefill that gave them their first token, in time order."""
    groups: dict[float, list[int]] = {}
    for rid in np.argsort(first_token_s, kind="stable"):
        groups.setdefault(float(first_token_s[rid]), []).append(int(rid))
    return [tuple(g) for _, g in sorted(groups.items())]


@pytest.mark.models
def test_engine_and_simulator_admit_in_the_same_order(lm, monkeypatch) -> None:  # noqa: ANN001
    """Request 0 is in its prefill while a long request (1) and two short ones (2, 3) come.
    Under a KV budget of 100 slots the long one cannot run beside 0 (2 x 66 > 100): FCFS
    holds every request behind it, the deadline order lets 2 and 3 join at once. The
    decode server (wall clock, real passes) and the simulator take the same decisions."""
    from ken.engine.decode import DecodeServer, as_run
    from ken.models.generation import DecodeBatch
    from ken.optimizer.tokens import random_prompts

    rng = np.random.default_rng(0)
    prompts = [random_prompts(lm, 1, n, rng)[0] for n in (8, 60, 8, 8)]
    max_new = [6, 6, 6, 6]
    entered, gate = threading.Event(), threading.Event()
    real_prefill = DecodeBatch.prefill

    def prefill(cls, lm_, rows, keys, *args, **kwargs):  # noqa: ANN001, ANN202
        if 0 in keys:  # hold request 0's prefill until the others are queued
            entered.set()
            gate.wait(60)
        return real_prefill(lm_, rows, keys, *args, **kwargs)

    with pytest.raises(EngineError, match="needs targets"):
        DecodeServer(lm, order="deadline")
    monkeypatch.setattr(DecodeBatch, "prefill", classmethod(prefill))
    expected = {"fcfs": [(0,), (1,), (2, 3)], "deadline": [(0,), (2, 3), (1,)]}
    for order, groups in expected.items():
        entered.clear()
        gate.clear()
        with DecodeServer(lm, max_running=4, kv_budget_tokens=100, ignore_eos=True,
                          order=order, targets=LOOSE) as server:
            futures = [server.submit(prompts[0], max_new[0])]
            assert entered.wait(60)
            futures += [server.submit(p, n) for p, n in zip(prompts[1:], max_new[1:],
                                                             strict=True)]
            gate.set()
            outcomes = [f.result(timeout=120) for f in futures]
        assert [o.status for o in outcomes] == ["ok"] * 4
        engine = as_run(outcomes)
        sim = simulate_decoding(flat_cost(), [0.0, 0.5, 0.5, 0.5], [len(p) for p in prompts],
                                max_new, 4, 100, order=order, targets=LOOSE)
        assert prefill_groups(engine.first_token_s) == groups, order
        assert prefill_groups(sim.first_token_s) == groups, order


def test_a_cascade_served_in_deadline_order_answers_every_row_as_fcfs_does() -> None:
    """A two-model cascade in the simulator with the deadline order on every lane: each row is
    answered by the same stage with the same quality as in FCFS order (the order changes when,
    not what), and the tokens generated are the same."""
    from ken.models.cascade import Cascade
    from ken.optimizer.decode_sim import StageRows, simulate_gen_plan
    from ken.policy.plan import single_gear

    n = 40
    rng = np.random.default_rng(3)
    st_ = {"s": StageRows(rng.integers(5, 40, n), rng.integers(1, 10, n), rng.random(n),
                          rng.random(n)),
           "l": StageRows(rng.integers(5, 40, n), rng.integers(1, 12, n), rng.random(n),
                          rng.random(n))}
    costs = {"s": flat_cost(0.05, 0.02), "l": flat_cost(0.2, 0.08)}
    plan = single_gear("f", Cascade(("s", "l"), (0.5,)), max_running=3)
    arrivals = np.sort(rng.random(n) * 3)
    runs = [simulate_gen_plan(plan, costs, st_, arrivals, np.arange(n), order=order,
                              targets=ServiceTargets(0.5, 0.05))
            for order in ("fcfs", "deadline")]
    assert np.array_equal(runs[0].stage, runs[1].stage)
    assert np.array_equal(runs[0].quality, runs[1].quality)
    assert runs[0].tokens == runs[1].tokens
    assert not np.array_equal(runs[0].first_token_s, runs[1].first_token_s)
