"""Where a request's time goes (``ken.engine.request_path``): the parts of a latency on a
hand-built log, and on an engine serving a two-stage cascade of fake models."""

from __future__ import annotations

import pytest
from fakes import SlowModel
from test_engine import CASCADE, plan, texts

from ken.engine.calibrate import at_levels, model_levels, predicted_s, runtime_ratios
from ken.engine.outcome import Outcome
from ken.engine.request_path import (
    BatchPath,
    PathLog,
    request_paths,
    summarize,
    where_time_went,
)
from ken.engine.serving import Engine
from ken.engine.supervision import BatchRecord


def _record(model: str, formed: float, start: float, end: float, taken: float,
            rows: int = 1) -> BatchRecord:
    return BatchRecord("cpu0", model, rows, start, end, 0.0, handoff_s=start - formed,
                       report_s=taken - end)


def test_the_parts_of_a_two_stage_request_and_what_is_left_out() -> None:
    """Request 0: admitted 1 ms after submit, formed at once, escalated, waits 4 ms for stage
    b; every part by hand. Request 1's stage-b batch is not in the log, request 2 was
    rejected, request 3 was admitted before the log's oldest admission: none has a path."""
    log = PathLog(capacity=3)
    log.admit(3, 0.0)  # pushed out by the three below
    log.admit(0, 0.001)
    log.admit(1, 0.002)
    a = _record("a", 0.001, 0.0015, 0.0115, 0.012, rows=2)
    b = _record("b", 0.016, 0.0162, 0.0362, 0.037)
    log.batch(BatchPath(a, (0, 1)))
    log.batch(BatchPath(b, (0,)))
    log.admit(4, 0.05)
    outcomes = [Outcome(0, "ok", 0.0, 0.037, value="x", stage=1),
                Outcome(1, "ok", 0.001, 0.012, value="x", stage=1),  # its stage b is missing
                Outcome(2, "rejected", 0.002, 0.002),
                Outcome(3, "ok", 0.0, 0.01, value="x", stage=0)]
    (p,) = request_paths(outcomes, log)
    assert p.request_id == 0 and p.stages == 2
    assert p.admit_s == pytest.approx(0.001)
    assert p.wait_s == pytest.approx(0.0 + 0.004)
    assert p.handoff_s == pytest.approx(0.0005 + 0.0002)
    assert p.call_s == pytest.approx(0.010 + 0.020)
    assert p.report_s == pytest.approx(0.0005 + 0.0008)
    assert p.resolve_s == pytest.approx(0.0)
    assert p.latency_s == pytest.approx(0.037)
    assert p.host_s == pytest.approx(0.001 + 0.0007 + 0.0013)
    s = summarize([p], log.batches())
    assert s.requests == 1 and s.batches == 2
    assert s.batch_host_ms["mean"] == pytest.approx((1.0 + 1.0) / 2)
    assert s.median_ms["call"] == pytest.approx(30.0)
    assert s.host_share == pytest.approx(3.0 / 37.0)
    assert "admission 1.0/1.0, queues 4.0/4.0" in s.describe()
    assert "reports 8.1% of all latency" in s.describe()
    with pytest.raises(ValueError, match="no answered request"):
        summarize([], [])
    assert where_time_went(outcomes[2:], log) is None  # none of them has a path
    assert where_time_went(outcomes, log) == s


def test_the_engine_logs_every_answered_requests_path() -> None:
    """A two-stage cascade of a 5-ms and a 10-ms model on thread workers: every answered
    request has a path whose batches are the stages it ran, in the engine's call log with the
    same hand-off and report times (filled in: not left at 0); its parts are non-negative and
    add up to its latency; a request resolved by a batch completes when the scheduler took
    that batch in."""
    models = {"a": SlowModel("a", 0.005), "b": SlowModel("b", 0.010)}
    with Engine(plan(max_wait_s=0.002), models, workers="thread") as engine:
        outcomes = [f.result(timeout=30) for f in [engine.submit(t) for t in texts(60)]]
        log = engine.path_log
        calls = [r for r in engine.batch_log if not r.bulk]
    paths = {p.request_id: p for p in request_paths(outcomes, log)}
    assert len(paths) == 60 and all(o.status == "ok" for o in outcomes)
    batches = log.batches()
    assert {b.record for b in batches} == set(calls) and len(batches) == len(calls)
    for o in outcomes:
        p = paths[o.request_id]
        assert p.stages == o.stage + 1
        assert min(p.admit_s, p.wait_s, p.handoff_s, p.call_s, p.report_s, p.resolve_s) >= 0
        assert p.latency_s == pytest.approx(o.latency_s, abs=1e-9)
        last = max((b for b in batches if o.request_id in b.request_ids),
                   key=lambda b: b.formed_s)
        assert o.completion_s == pytest.approx(last.taken_s, abs=1e-9)
        assert last.record.model == CASCADE.models[o.stage]
    for b in batches:
        r = b.record
        assert r.seconds >= (0.005 if r.model == "a" else 0.010)
        assert r.handoff_s >= 0 and r.report_s >= 0
    # the scheduler fills both in: a thread's hand-off and an event queue take some time
    assert any(b.record.handoff_s > 0 for b in batches)
    assert any(b.record.report_s > 0 for b in batches)


def test_calibration_charges_the_time_a_batch_holds_its_device() -> None:
    """A call's ratio to its prediction counts its hand-off and report: the device is held
    for them, and the dispatcher starts nothing else there meanwhile."""
    from test_cost_model import catalog

    cat = catalog(None)
    call = BatchRecord("d0", "a", 1, 1.0, 1.0, 0.0)
    call = BatchRecord("d0", "a", 1, 1.0, 1.0 + predicted_s(call, cat), 0.0)
    held = BatchRecord("d0", "a", 1, call.start_s, call.end_s, 0.0,
                       handoff_s=0.1 * call.seconds, report_s=0.2 * call.seconds)
    (_, plain), (_, around) = runtime_ratios([call, held], cat)["a"]
    assert plain == pytest.approx(1.0)
    assert around == pytest.approx(1.3)


def test_a_replays_own_level_and_the_catalog_moved_to_it() -> None:
    """Calls held 1.2x their charge: ``model_levels`` finds 1.2 (the slowest 1%, here two
    stalls, left out); on ``at_levels`` of it the same calls run at 1.0; a model without
    calls keeps its runtimes."""
    from test_cost_model import _log, catalog

    cat = catalog(None)
    log = _log({1: 1.2, 2: 1.2, 3: 1.2, 4: 1.2}, n=400, noise_sd=0.0)
    levels = model_levels(log, cat)
    assert list(levels) == ["a"] and levels["a"] == pytest.approx(1.2)
    moved = at_levels(cat, levels)
    assert model_levels(log, moved)["a"] == pytest.approx(1.0)
    others = [m for m in cat.perf if m != "a"]
    assert others and all(moved.perf[m] == cat.perf[m] for m in others)
