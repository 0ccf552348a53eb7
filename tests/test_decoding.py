"""Continuous batching policy and the decode simulator: invariants on random traces
(hypothesis), a hand-computed timeline, and the token-cost fit against exact coefficients."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ken.errors import PolicyError, ProfileError, SimulationError
from ken.optimizer.decode_sim import simulate_decoding
from ken.optimizer.tokens import TokenCost
from ken.policy.decoding import DecodeScheduler, DecodeStep


def flat_cost(prefill: float = 1.0, decode: float = 0.5) -> TokenCost:
    """A pass costs a constant (no dependence on batch or length)."""
    return TokenCost("m", "hw", (), (), (prefill, 0.0, 0.0), (decode, 0.0, 0.0), 0, 1)


def linear_cost() -> TokenCost:
    return TokenCost("m", "hw", (), (), (0.01, 0.002, 1e-4), (0.02, 0.003, 2e-5), 1000, 64)


requests = st.lists(st.tuples(st.floats(0, 5), st.integers(1, 40), st.integers(0, 12)),
                    min_size=1, max_size=30)


def drive(arrivals, prompts, outputs, max_running, budget, mode):  # noqa: ANN001, ANN201
    """Run the scheduler by hand, checking the invariants after every pass."""
    sched = DecodeScheduler(max_running, budget, mode)
    made = [0] * len(arrivals)
    first_step = [-1] * len(arrivals)
    tokens_by_step = 0
    order = []
    i = step_no = 0
    while i < len(arrivals) or sched.load:
        if i < len(arrivals):  # one arrival per pass boundary, in arrival order
            sched.admit(i, prompts[i], outputs[i])
            i += 1
        step = sched.next_step()
        if step is None:
            continue
        step_no += 1
        finished = []
        for rid in step.request_ids:
            if outputs[rid] > made[rid]:
                made[rid] += 1
                tokens_by_step += 1
            if step.kind == "prefill":
                first_step[rid] = step_no
                order.append(rid)
            if made[rid] >= outputs[rid]:
                finished.append(rid)
        sched.step_done(step, finished)
        assert sched.running <= max_running
        if budget is not None:
            assert sched.kv_tokens() <= budget
        if mode == "static" and step.kind == "prefill":
            assert sched.running == len(step.request_ids) - len(finished)
    return made, tokens_by_step, order, first_step


@settings(max_examples=60, deadline=None)
@given(requests, st.integers(1, 6), st.sampled_from([None, 64, 200]),
       st.sampled_from(["continuous", "static"]))
def test_scheduler_conserves_tokens_and_keeps_limits(reqs, max_running, budget, mode) -> None:  # noqa: ANN001
    prompts = [p for _, p, _ in reqs]
    outputs = [o for _, _, o in reqs]
    if budget is not None:  # requests that could never fit are rejected up front
        sched = DecodeScheduler(max_running, budget, mode)
        keep = [k for k, (p, o) in enumerate(zip(prompts, outputs, strict=True))
                if sched.fits(p, o)]
        prompts = [prompts[k] for k in keep]
        outputs = [outputs[k] for k in keep]
    made, total, order, _ = drive(list(range(len(prompts))), prompts, outputs, max_running,
                                  budget, mode)
    assert made == outputs  # every request got exactly its tokens
    assert total == sum(outputs)
    assert order == sorted(order)  # first come, first served


@settings(max_examples=60, deadline=None)
@given(requests, st.integers(1, 6), st.sampled_from(["continuous", "static"]))
def test_simulator_conserves_tokens_and_orders_times(reqs, max_running, mode) -> None:  # noqa: ANN001
    arrivals = np.sort([a for a, _, _ in reqs])
    prompts = [p for _, p, _ in reqs]
    outputs = [o for _, _, o in reqs]
    run = simulate_decoding(linear_cost(), arrivals, prompts, outputs, max_running, mode=mode)
    assert run.output_tokens.sum() == sum(outputs)
    assert np.all(run.first_token_s > run.arrival_s)
    assert np.all(run.completion_s >= run.first_token_s)
    # a request with k tokens needs one prefill and k - 1 decode passes, each shared
    assert run.passes >= max(1, max(outputs)) and run.prefill_passes >= 1
    assert run.busy_s <= run.completion_s.max() + 1e-9
    m = run.metrics()
    assert m.num_requests == len(reqs) and m.ttft_p50_ms <= m.tgt_p99_ms + 1e-9


def test_simulated_timeline_by_hand() -> None:
    """Prefill 1 s, decode 0.5 s, two slots, 3 tokens each. A arrives at 0 and prefills 0-1
    (its first token). B arrives at 0.2, waits for that pass, and joins at 1 (a prefill goes
    before decodes): 1-2, its first token. Then A and B decode together 2-2.5 and 2.5-3, and
    both have their 3 tokens at 3."""
    run = simulate_decoding(flat_cost(), [0.0, 0.2], [10, 10], [3, 3], max_running=2)
    assert run.first_token_s.tolist() == [1.0, 2.0]
    assert run.completion_s.tolist() == [3.0, 3.0]
    assert run.passes == 4 and run.prefill_passes == 2
    static = simulate_decoding(flat_cost(), [0.0, 0.2], [10, 10], [3, 3], max_running=2,
                               mode="static")
    # static: B waits until A is done (2.0), then 1 s prefill and two decodes
    assert static.first_token_s.tolist() == [1.0, 3.0]
    assert static.completion_s.tolist() == [2.0, 4.0]
    assert static.metrics().ttft_p50_ms > run.metrics().ttft_p50_ms


def test_kv_budget_holds_back_joins_first_come_first_served() -> None:
    sched = DecodeScheduler(max_running=4, kv_budget_tokens=40)
    sched.admit(0, 10, 10)  # 20 slots at its end
    sched.admit(1, 15, 5)  # 2 rows x 20 = 40: fits
    sched.admit(2, 2, 2)  # 3 rows x 20 = 60: waits, though small
    step = sched.next_step()
    assert step == DecodeStep("prefill", (0, 1))
    sched.step_done(step, [])
    assert sched.next_step() == DecodeStep("decode", (0, 1))
    with pytest.raises(PolicyError, match="exceed the KV budget"):
        sched.admit(3, 30, 20)
    with pytest.raises(PolicyError, match="already admitted"):
        sched.admit(2, 1, 1)
    assert sched.load == 3 and sched.queued == 1


def test_scheduler_rejects_bad_settings_and_reports() -> None:
    with pytest.raises(PolicyError, match="max_running"):
        DecodeScheduler(0)
    with pytest.raises(PolicyError, match="mode"):
        DecodeScheduler(1, mode="eager")  # type: ignore[arg-type]
    sched = DecodeScheduler(2)
    sched.admit(0, 3, 1)
    step = sched.next_step()
    with pytest.raises(PolicyError, match="not been reported"):
        sched.next_step()
    with pytest.raises(PolicyError, match="not running"):
        sched.step_done(step, [7])
    with pytest.raises(SimulationError, match="one prompt length"):
        simulate_decoding(flat_cost(), [0.0], [1, 2], [1], 1)


def test_token_cost_fit_recovers_exact_coefficients() -> None:
    a, b, c = 0.05, 0.01, 3e-4
    pts = [(bs, n, a + b * bs + c * bs * n) for bs in (1, 4, 8) for n in (16, 64, 256)]
    cost = TokenCost.fit("m", "hw", pts, pts, 10**6, 128)
    assert cost.prefill_coef == pytest.approx((a, b, c), rel=1e-6)
    assert cost.prefill_error < 1e-6
    assert cost.decode_s(2, 100) == pytest.approx(a + 2 * b + 200 * c)
    assert cost.kv_bytes(3, 10) == 3 * 10 * 128
    assert cost.kv_budget_tokens(10**6 + 1280) == 10
    assert TokenCost.from_json(cost.to_json()) == cost
    with pytest.raises(ProfileError, match="at least 3"):
        TokenCost.fit("m", "hw", pts[:2], pts, 1, 1)


def test_a_token_cost_timed_on_a_busy_machine_is_timed_again_and_the_quietest_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The passes are timed again while other programs keep ``BUSY_CORES`` or more busy (a
    cost timed beside a test run made ``ken demo``'s simulated TTFT 16x the engine's); the
    cost timed beside the least other load is kept, with that load, and a warning says so
    when every attempt was busy."""
    from fakes import Warnings, fake_loads

    from ken.machine import BUSY_CORES
    from ken.optimizer import tokens

    timed: list[str] = []

    def time_passes(lm, model, batches, lengths, steps, repeats, reporter, attempt):  # noqa: ANN001, ANN202
        timed.append(attempt)
        slow = 1.0 + len(timed)  # each attempt's cost differs
        return TokenCost(model, "hw", (), (), (slow, 0.0, 0.0), (slow, 0.0, 0.0), 0, 1)

    monkeypatch.setattr(tokens, "_time_passes", time_passes)
    said = Warnings()
    busy = [BUSY_CORES + 0.5, BUSY_CORES + 0.2, BUSY_CORES + 0.7]
    cost = tokens.measure_token_cost(None, "lm", reporter=said, other_load=fake_loads(busy))
    assert timed == ["", " (attempt 2 of 3)", " (attempt 3 of 3)"]
    assert cost.prefill_coef[0] == 3.0 and cost.other_cores == busy[1]  # the second attempt
    assert len(said.warnings) == 1 and "tokens-lm-*.json" in said.warnings[0]
    assert TokenCost.from_json(cost.to_json()) == cost  # the reading is kept in the file

    timed.clear()
    said = Warnings()
    cost = tokens.measure_token_cost(None, "lm", reporter=said,
                                     other_load=fake_loads([BUSY_CORES + 1.0, 0.02]))
    assert len(timed) == 2 and cost.other_cores == 0.02 and said.warnings == []
