"""Admission by capacity and the crash-loop breaker of decode servers (issue 38): the
scheduler's completion estimate against the decode simulator (brute force), the measured
pass times and answer lengths, admission's verdicts on a hand-built queue, and a served
stand-in LM that is flooded, or that fails every pass."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from fakes import GatedLM, StandInGenerator, gen_plan
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decoding import linear_cost

from ken.engine.decode_admission import MIN_ANSWERS, AnswerLengths, DecodeAdmission, PassTimes
from ken.optimizer.decode_sim import simulate_decoding
from ken.optimizer.tokens import TokenCost
from ken.policy.decoding import DecodeScheduler, ServiceTargets

TARGETS = ServiceTargets(1.0, 0.05)
#: so tight that deadline order demotes and trims joiners on these costs
TIGHT = ServiceTargets(0.02, 0.004)
queues = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 12)), min_size=1, max_size=14)


def scheduler(max_running: int, budget: int | None, mode: str, order: str,
              cost: TokenCost, targets: ServiceTargets = TARGETS) -> DecodeScheduler:
    return DecodeScheduler(max_running, budget, mode, order,  # type: ignore[arg-type]
                           targets if order == "deadline" else None, cost)


def run_passes(sched: DecodeScheduler, outputs: list[int], made: list[int], cost: TokenCost,
               passes: int, t: float) -> float:
    """Run ``passes`` passes of ``sched`` by hand (each request makes ``outputs[rid]``
    tokens), from time ``t``; returns the time after them."""
    for _ in range(passes):
        step = sched.next_step(t)
        if step is None:
            break
        ids = step.request_ids
        if step.kind == "prefill":
            t += cost.prefill_s(len(ids), max(sched._requests[r].prompt_tokens for r in ids))
        else:
            t += cost.decode_s(len(ids), sched.width())
        finished = []
        for rid in ids:
            if outputs[rid] > made[rid]:
                made[rid] += 1
            if made[rid] >= outputs[rid]:
                finished.append(rid)
        sched.step_done(step, finished, t)
    return t


@settings(max_examples=80, deadline=None)
@given(queues, st.integers(1, 4), st.sampled_from([None, 60, 120]),
       st.sampled_from(["continuous", "static"]), st.sampled_from(["fcfs", "deadline"]),
       st.integers(0, 12), st.sampled_from([TARGETS, TIGHT]))
def test_completion_estimate_equals_the_simulator(reqs, max_running, budget, mode, order,  # noqa: ANN001
                                                  passes, targets) -> None:
    """``completion_s`` from any pass boundary (``passes`` passes into the run) says when
    the last request is done, and when one more arriving now would be, exactly as the
    decode simulator serves the same requests."""
    if budget is not None:
        reqs = [(p, o) for p, o in reqs if p + o <= budget] or [(1, 1)]
    prompts, outputs = [p for p, _ in reqs], [o for _, o in reqs]
    n = len(reqs)
    cost = linear_cost()
    run = simulate_decoding(cost, np.zeros(n), prompts, outputs, max_running, budget, mode,
                            order, targets if order == "deadline" else None)
    # every request but the last queued at 0; the last one is the estimate's newcomer
    sched = scheduler(max_running, budget, mode, order, cost, targets)
    for rid in range(n - 1):
        sched.admit(rid, prompts[rid], outputs[rid], 0.0)
    assert sched.completion_s(0.0, cost, (prompts[-1], outputs[-1])) == pytest.approx(
        run.completion_s[-1], rel=1e-12, abs=1e-12)
    # all of them, some passes in
    sched = scheduler(max_running, budget, mode, order, cost, targets)
    for rid in range(n):
        sched.admit(rid, prompts[rid], outputs[rid], 0.0)
    made = [0] * n
    t = run_passes(sched, outputs, made, cost, passes, 0.0)
    before = (dict(sched._running), list(sched._waiting), sched.steps)
    expected = float(run.completion_s.max()) if sched.load else t
    assert sched.completion_s(t, cost) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert (dict(sched._running), list(sched._waiting), sched.steps) == before  # a copy ran
    if sched.load:
        assert sched.completion_s(t, cost, horizon_s=(expected - t) / 2) == math.inf


def test_completion_estimate_with_shorter_answers_is_earlier() -> None:
    """Answers expected to stop early (``tokens``) finish the queue earlier than the
    budget says; a running request past its expected tokens is charged one more pass."""
    cost = linear_cost()
    sched = DecodeScheduler(2, None)
    for rid in range(4):
        sched.admit(rid, 10, 12, 0.0)
    full = sched.completion_s(0.0, cost)
    short = sched.completion_s(0.0, cost, tokens=lambda m: 3)
    assert short < full
    outputs = [3] * 4
    made = [0] * 4
    t = run_passes(sched, outputs, made, cost, 1, 0.0)  # the prefill of two
    # the two running end after their next decode pass, the two waiting with their prefill
    assert sched.completion_s(t, cost, tokens=lambda m: 1) == pytest.approx(
        t + cost.decode_s(2, sched.width()) + cost.prefill_s(2, 10))


def test_pass_times_fit_measured_passes_or_scale_a_base_cost() -> None:
    exact = linear_cost()
    fitted = PassTimes()
    assert not fitted.ready
    rng = np.random.default_rng(0)
    for _ in range(40):
        b, t = int(rng.integers(1, 9)), int(rng.integers(5, 80))
        fitted.add("prefill", b, t, exact.prefill_s(b, t))
        fitted.add("decode", b, t, exact.decode_s(b, t))
    assert fitted.ready
    assert fitted.prefill_s(4, 50) == pytest.approx(exact.prefill_s(4, 50), rel=1e-6)
    assert fitted.decode_s(7, 30) == pytest.approx(exact.decode_s(7, 30), rel=1e-6)
    scaled = PassTimes(base=exact)
    assert scaled.ready and scaled.decode_s(3, 20) == exact.decode_s(3, 20)
    for _ in range(20):
        scaled.add("decode", 2, 10, 2.0 * exact.decode_s(2, 10))
    assert scaled.decode_s(3, 20) == pytest.approx(2.0 * exact.decode_s(3, 20))
    assert scaled.prefill_s(3, 20) == exact.prefill_s(3, 20)  # no prefill measured: as given


def test_answer_lengths_replace_the_budget_once_measured() -> None:
    lengths = AnswerLengths(quantile=0.9)
    for _ in range(MIN_ANSWERS - 1):
        lengths.add(4, 16)
    assert lengths.expected(16) == 16  # too few answers: the budget
    lengths.add(4, 16)
    assert lengths.expected(16) == 4 and lengths.expected(32) == 8


def test_admission_holds_a_request_to_its_target_by_the_queue_ahead() -> None:
    """On a hand-built queue, a request is admitted exactly when the simulator's completion
    of it (the queue served, then it) is within the target; refused with the reason and a
    retry hint past it; an idle server admits whatever the target."""
    cost = linear_cost()
    queue = [(20, 8), (30, 8), (25, 8), (12, 8)]
    new = (15, 8)
    arrivals = np.zeros(len(queue) + 1)
    run = simulate_decoding(cost, arrivals, [p for p, _ in queue] + [new[0]],
                            [o for _, o in queue] + [new[1]], 2)
    done = float(run.completion_s[-1])
    for target, admitted in ((done * 1.01, True), (done * 0.99, False)):
        admission = DecodeAdmission(target, base_costs={"": cost})
        sched = DecodeScheduler(2, None)
        assert admission.check(0, "", {"": sched}, *new, 0.0, 0.0).reason is None  # idle
        for rid, (p, o) in enumerate(queue):
            sched.admit(rid, p, o, 0.0)
        verdict = admission.check(9, "", {"": sched}, *new, 0.0, 0.0)
        assert (verdict.reason is None) == admitted
        if admitted:
            assert verdict.estimate_s == pytest.approx(done)
            # the same request after 5% of that in the inbox: counted, and now too late
            late = admission.check(10, "", {"": sched}, *new, -0.05 * done, 0.0)
            assert late.reason is not None and "over capacity" in late.reason
        else:
            assert "over capacity" in verdict.reason and "latency target" in verdict.reason
            assert verdict.retry_after_s is not None and verdict.retry_after_s > 0
            assert admission.rejected == 1


def test_a_request_is_estimated_through_the_later_stages_enough_requests_reach() -> None:
    """A cascade's request is estimated with its own work on the later stages while at least
    1 in 100 requests were passed on there (until 20 answers are seen, they count): the
    estimate of the first lane plus a prefill and the expected tokens on the next; with
    nothing passed on, the first lane's alone."""
    cost = linear_cost()
    admission = DecodeAdmission(100.0, base_costs={"a": cost, "b": cost})
    lanes = {"a": DecodeScheduler(2, None), "b": DecodeScheduler(2, None)}
    lanes["a"].admit(0, 20, 8, 0.0)  # not idle
    new, later = (15, 8), [("b", 6)]
    alone = admission.check(9, "a", lanes, *new, 0.0, 0.0).estimate_s
    own_b = cost.prefill_s(1, 15) + 5 * cost.decode_s(1, 15 + 6)
    assert admission.later_stages_s("a", later, lanes, 15) == pytest.approx(own_b)
    unmeasured = admission.check(9, "a", lanes, *new, 0.0, 0.0, later=later).estimate_s
    assert unmeasured == pytest.approx(alone + own_b)
    for k in range(MIN_ANSWERS):
        admission.stage_ended("a", k == 0)  # 1 in 20 passed on: 5%, counted
    assert admission.onward("a") == pytest.approx(0.05)
    assert admission.check(9, "a", lanes, *new, 0.0, 0.0, later=later).estimate_s == \
        pytest.approx(alone + own_b)
    for _ in range(200):
        admission.stage_ended("a", False)  # none of the last 200: the first lane's alone
    assert admission.check(9, "a", lanes, *new, 0.0, 0.0, later=later).estimate_s == \
        pytest.approx(alone)


def test_a_cold_server_admits_one_batch_then_turns_the_flood_away() -> None:
    """Before any pass is measured (no token cost), a flooded server admits what fills one
    batch and turns the rest away at once, each with a reason and a retry hint; every
    request gets exactly one outcome."""
    from ken.engine.decode import CascadeServer

    lm = GatedLM()
    server = CascadeServer({"g": StandInGenerator(lm)}, gen_plan(),
                           latency_target_s=5.0).start()
    try:
        first = server.submit_row("abc")
        assert lm.entered.wait(timeout=30)  # its prefill holds the gate
        flood = [server.submit_row(f"row {i}") for i in range(12)]
        lm.gate.set()
        outcomes = [f.result(timeout=60) for f in [first, *flood]]
    finally:
        lm.gate.set()
        server.shutdown()
    statuses = [o.status for o in outcomes]
    assert statuses.count("ok") == 2  # the first, and one more to fill max_running = 2
    assert statuses.count("rejected") == 11 == server.rejected
    refused = [o for o in outcomes if o.status == "rejected"]
    assert all("not measured its passes" in o.error and o.retry_after_s for o in refused)
    assert len({o.request_id for o in outcomes}) == 13


def test_a_plan_without_a_target_queues_every_request() -> None:
    from ken.engine.decode import CascadeServer

    lm = GatedLM()
    lm.gate.set()
    with CascadeServer({"g": StandInGenerator(lm)}, gen_plan()) as server:
        assert not server.admission.active  # a hand-written plan: no predicted p99
        outcomes = [f.result(timeout=60) for f in [server.submit_row(f"r{i}")
                                                   for i in range(10)]]
    assert [o.status for o in outcomes] == ["ok"] * 10


def test_an_llm_that_fails_every_pass_is_marked_failed_within_seconds() -> None:
    """A generating model whose every forward pass raises: the first requests end in error
    with the model's exception; after 3 passes in a row that failed for two or more requests
    each, the model is marked failed (the classifier engine's breaker), its queued requests
    and every later one end in error at once naming it. A pass that one request alone fails
    does not count: that request may be the cause."""
    from ken.engine.decode import MAX_FAILED_PASSES, CascadeServer, DecodeServer

    lm = GatedLM()
    lm.gate.set()

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("CUDA error: an illegal memory access")

    lm.net.forward = broken
    t0 = time.monotonic()
    with CascadeServer({"g": StandInGenerator(lm)}, gen_plan()) as server:
        outcomes = [f.result(timeout=30) for f in [server.submit_row(f"row {i}")
                                                   for i in range(12)]]
        waited = time.monotonic() - t0
        late = server.submit_row("late").result(timeout=5)
    assert [o.status for o in outcomes] == ["error"] * 12
    assert "illegal memory access" in outcomes[0].error
    assert "g is marked failed" in outcomes[-1].error
    assert "failed a forward pass for every request in it 3 times" in outcomes[-1].error
    assert late.status == "error" and "g is marked failed" in late.error
    assert waited < 5.0
    with DecodeServer(lm, max_running=2) as plain:
        alone = [plain.submit([1, 2, 3], 2).result(timeout=30) for _ in range(4)]
        assert [o.status for o in alone] == ["error"] * 4
        assert plain.breaker.reason("the model") is None  # one request a pass: not counted
        assert plain.submit([1, 2, 3], 2).result(timeout=30).status == "error"
        burst = [plain.submit([1, 2, 3], 2) for _ in range(2 * MAX_FAILED_PASSES + 4)]
        outcomes = [f.result(timeout=30) for f in burst]
        assert [o.status for o in outcomes] == ["error"] * len(burst)
        assert "marked failed" in outcomes[-1].error
        at_once = plain.submit([1, 2, 3], 2)
        assert at_once.done() and "marked failed" in at_once.result().error


def test_a_pass_that_hangs_after_fast_ones_fails_within_its_deadline() -> None:
    """Every pass has a deadline by the classifier engine's rule (``BatchDeadline``: 10x what
    such passes were seen to take, at least a floor: 10 s by default, 2 s here): a model that
    answered fast and then hangs fails its requests after the floor, not the old fixed 60 s,
    saying where the bound came from."""
    from ken.engine.decode import PASS_DEADLINE, CascadeServer
    from ken.engine.supervision import BatchDeadline

    assert PASS_DEADLINE.floor_s == 10.0 and PASS_DEADLINE.first_call_s == 60.0
    lm = GatedLM()
    lm.gate.set()
    server = CascadeServer({"g": StandInGenerator(lm)}, gen_plan(),
                           deadline=BatchDeadline(floor_s=2.0)).start()
    try:
        for i in range(6):  # one at a time: a prefill and decode passes each
            assert server.submit_row(f"row {i}").result(timeout=30).status == "ok"
        lm.gate.clear()
        t0 = time.monotonic()
        stuck = server.submit_row("this one hangs").result(timeout=30)
        waited = time.monotonic() - t0
    finally:
        lm.gate.set()
    assert stuck.status == "error" and "did not return from a forward pass" in stuck.error
    assert "observed" in stuck.error and "at least 2 s" in stuck.error
    assert 2.0 <= waited < 6.0


def test_a_served_plan_is_held_to_its_predicted_p99_but_bulk_rows_are_always_queued() -> None:
    """A generation plan with a predicted p99 is served with admission by default; a table's
    rows sent in bulk (with a gear) are never turned away, online requests are."""
    import dataclasses

    from ken.engine.decode import CascadeServer, GenerationEngine
    from ken.policy.plan import PlanMetrics

    plan = dataclasses.replace(gen_plan(), predicted=PlanMetrics(
        1.0, 1.0, 2.0, 3.0, 1.0, 100, 0, 10.0))
    lm = GatedLM()
    engine = GenerationEngine(CascadeServer({"g": StandInGenerator(lm)}, plan).start())
    try:
        assert engine.server.admission.target_s == pytest.approx(0.003)
        first = engine.submit_many(["abc"])[0]
        assert lm.entered.wait(timeout=30)
        online = engine.submit_many([f"online {i}" for i in range(8)])
        bulk = engine.submit_many([f"bulk {i}" for i in range(8)], bulk=True)
        lm.gate.set()
        online_out = [f.result(timeout=60) for f in [first, *online]]
        bulk_out = [f.result(timeout=60) for f in bulk]
    finally:
        lm.gate.set()
        engine.shutdown()
    assert [o.status for o in bulk_out] == ["ok"] * 8
    statuses = [o.status for o in online_out]
    assert statuses.count("rejected") >= 7 and set(statuses) == {"ok", "rejected"}


def test_a_warm_server_admits_by_its_measured_passes() -> None:
    """After a few answers (passes of both kinds measured), a burst of 40 requests at once
    against a 0.3-s target: the estimate from the measured passes admits the first few and
    turns the rest away as over capacity, each request with exactly one outcome; the ones
    admitted near the target teach the slowdown."""
    from ken.engine.decode import CascadeServer

    lm = GatedLM()
    lm.gate.set()
    gated = lm.net.forward

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(0.02)
        return gated(*args, **kwargs)

    lm.net.forward = slow
    with CascadeServer({"g": StandInGenerator(lm)}, gen_plan(), latency_target_s=0.3) as server:
        for i in range(6):  # one at a time: the server measures its passes
            assert server.submit_row(f"warm {i}").result(timeout=30).status == "ok"
        assert server.admission.lane_times("g").ready
        burst = [server.submit_row(f"burst {i}") for i in range(40)]
        outcomes = [f.result(timeout=60) for f in burst]
    statuses = [o.status for o in outcomes]
    assert set(statuses) == {"ok", "rejected"} and len({o.request_id for o in outcomes}) == 40
    assert 2 <= statuses.count("ok") <= 20
    refused = [o for o in outcomes if o.status == "rejected"]
    assert all("over capacity" in o.error and o.retry_after_s > 0 for o in refused)
    assert server.admission_errors == 0


def test_a_cascade_server_names_each_request_s_later_stages() -> None:
    from ken.engine.decode import CascadeServer
    from ken.models.cascade import Cascade
    from ken.policy.plan import single_gear

    lm = GatedLM()
    plan = single_gear("gen", Cascade(("g", "h"), (0.5,)), max_running=2)
    server = CascadeServer({"g": StandInGenerator(lm), "h": StandInGenerator(lm)}, plan)
    assert server.dispatcher.admit(7, 0.0) == "g"
    assert server._later(7, "g") == [("h", 4)] and server._later(7, "h") == []
