"""The fidelity yardstick of ``benchmarks/e2e.py`` and ``benchmarks/fidelity_parts.py``: each
replay of a plan against the median of the same plan's other replays (``self_errors``), and
the counts ``goals`` and ``summarise`` make of it, checked against a brute force."""

from __future__ import annotations

import importlib
import math
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from test_simulator import make_catalog, single

from ken.optimizer.simulator import sample_rows, simulate
from ken.optimizer.workload import gamma_trace

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def _bench(name: str) -> ModuleType:
    """A benchmark module, imported with benchmarks/ on the path only while importing (its
    generic module names must not shadow others for the rest of the test run)."""
    sys.path.insert(0, BENCHMARKS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(BENCHMARKS)


e2e = _bench("e2e")
fidelity_parts = _bench("fidelity_parts")


def brute(p95s: list[float]) -> list[float]:
    out = []
    for i, x in enumerate(p95s):
        others = sorted(p95s[:i] + p95s[i + 1:])
        k = len(others)
        middle = others[k // 2] if k % 2 else (others[k // 2 - 1] + others[k // 2]) / 2
        out.append(x / middle - 1.0)
    return out


@pytest.mark.parametrize("p95s", [[100.0, 110.0], [100.0, 110.0, 90.0],
                                  [50.0, 80.0, 200.0, 65.0], [1.0, 1.0, 1.0]])
def test_each_replay_is_set_against_the_median_of_the_others(p95s: list[float]) -> None:
    assert e2e.self_errors(p95s) == pytest.approx(brute(p95s))


def test_fewer_than_two_replays_have_nothing_to_compare() -> None:
    assert e2e.self_errors([]) == []
    assert e2e.self_errors([42.0]) == []
    # nothing to divide by: no error, not an exception
    assert math.isnan(e2e.self_errors([5.0, 0.0])[0])


def test_goals_count_the_engine_and_the_simulator_per_replay() -> None:
    rng = np.random.default_rng(3)
    fid, replays = [], []
    for _ in range(4):
        reps = list(rng.uniform(80, 130, 3))
        replays.append(reps)
        sim = float(rng.uniform(90, 110))
        fid.append({"error": float(np.median(reps)) / sim - 1.0,
                    "engine_self_error": e2e.self_errors(reps),
                    "error_at_rate": float(np.median(reps)) / sim - 1.0,
                    "replay_errors_at_rate": [r / sim - 1.0 for r in reps],
                    "error_at_rate_cheapest": 0.0})
    g = e2e.goals([], fid, set())
    assert g["engine_replays_compared"] == 12
    assert g["engine_within_10pct_of_its_other_replays"] == sum(
        abs(e) <= 0.10 for reps in replays for e in brute(reps))
    assert g["fidelity_replays_within_10pct_at_rate"] == sum(
        abs(e) <= 0.10 for f in fid for e in f["replay_errors_at_rate"])
    assert g["fidelity_replays_at_rate"] == 12
    # without per-replay errors at the rate (a run with --calibration), no count is made up;
    # a plan replayed once has nothing for the engine to be compared with
    for f in fid:
        del f["replay_errors_at_rate"]
    fid[0]["engine_self_error"] = []
    g = e2e.goals([], fid, set())
    assert "fidelity_replays_within_10pct_at_rate" not in g
    assert "fidelity_replays_at_rate" not in g
    assert g["engine_replays_compared"] == 9


def test_fidelity_parts_summarises_the_engine_beside_the_simulations() -> None:
    measured = {"fast": [30.0, 33.0, 40.0], "main": [100.0, 101.0]}
    out = {"traces": {"gamma": {"plans": {
        name: [{"measured_p95_ms": m, "error": {k: 0.05 for k in fidelity_parts.FORMS}}
               for m in ms] for name, ms in measured.items()}}}}
    summary = fidelity_parts.summarise(out)["summary"]
    for name, ms in measured.items():
        engine = summary[f"gamma/{name}"]["engine_self"]
        errors = brute(ms)
        assert engine["replays"] == len(ms)
        assert engine["within_10pct"] == sum(abs(e) <= 0.10 for e in errors)
        assert engine["mean_log_error"] == pytest.approx(np.mean(np.log1p(errors)))
    assert summary["all"]["engine_self"]["replays"] == 5
    assert summary["all"]["planned"]["within_10pct"] == 5
    assert list(summary) == ["gamma/fast", "gamma/main", "all"]


def test_fidelity_predicts_by_the_median_over_seeds_and_sets_each_replay_against_it() -> None:
    catalog = make_catalog()
    # a wide spread, so that the seeds' draws differ
    wide = replace(catalog.perf["a"], spread=(0.3, 1.0, 2.7))
    catalog = catalog.with_perf({**catalog.perf, "a": wide})
    plan = single("a", max_batch=4)
    window = gamma_trace(150.0, 4.0, 3.0, seed=2)
    base = simulate(plan, catalog, window, 0).metrics(0, plan)
    replays = [replace(base, p95_ms=base.p95_ms * f) for f in (0.9, 1.0, 1.3)]
    system = e2e.System("ken", plan, base, base, replays, [{}, {}, {}], calls=[(), (), ()])
    [f] = e2e.fidelity([system], {"at_rate": catalog}, window, seed=5)
    # the replays asked the rows of seed 5: every seed's simulation answers those
    rows = sample_rows(len(window), catalog.num_rows, 5)
    seeds = [simulate(plan, catalog, window, 5 + k, rows=rows).metrics(0, plan).p95_ms
             for k in range(e2e.SIM_SEEDS)]
    assert f["simulated_p95s_ms_at_rate_seeds"] == pytest.approx(seeds)
    assert len(set(seeds)) > 1
    median = float(np.median(seeds))
    assert f["simulated_p95_ms_at_rate"] == pytest.approx(median)
    assert f["error_at_rate"] == pytest.approx(float(np.median(
        [m.p95_ms for m in replays])) / median - 1.0)
    assert f["replay_errors_at_rate"] == pytest.approx(
        [m.p95_ms / median - 1.0 for m in replays])
    assert f["engine_self_error"] == pytest.approx(brute([m.p95_ms for m in replays]))

    # e2e.md's fidelity table: as many cells in every row as in its header
    info = {"planning_trace": "p", "planning_requests": 1, "planning_peak_qps": 1.0,
            "evaluation_trace": "e", "evaluation_requests": 1, "evaluation_peak_qps": 1.0,
            "replayed_requests": 1, "replayed_s": 1.0, "replayed_peak_qps": 1.0}
    lean = {k: v for k, v in f.items() if "at_rate" not in k and "own" not in k}
    for entry in (f, lean):
        text = e2e.markdown({"setup": {"replays": 3}, "goals": e2e.goals([], [entry], set()),
                             "workloads": {"w": {"info": info, "points": [],
                                                 "fidelity": [entry]}}})
        lines = text.splitlines()
        head = next(i for i, line in enumerate(lines) if line.startswith("| replayed plan"))
        assert lines[head + 2].startswith(f"| {f['plan']} |")
        assert lines[head].count("|") == lines[head + 1].count("|") == lines[head + 2].count("|")
        assert (f"(seeds {min(seeds):,.0f}-{max(seeds):,.0f})" in text) == (entry is f)
