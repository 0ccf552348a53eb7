"""`ken plan`, Session.plan / use_plan, gear plans in EXPLAIN, the frontier plot.

Everything runs on synthetic profiles (three made-up models with known runtimes and per-sample
outcomes) and deterministic stand-in models, so no weights are loaded.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from fakes import LABELS, FakeModel, Profiled

import ken
from ken.cli import main
from ken.errors import KenError
from ken.models.cascade import Cascade
from ken.optimizer.planner import PlannerSettings
from ken.optimizer.planning import (
    default_peak_qps,
    held_out_window,
    plan_operator,
    planning_inputs,
    planning_trace,
    sustained_qps,
)
from ken.optimizer.plotting import plot_frontier
from ken.optimizer.profile import Profile
from ken.optimizer.query import Target
from ken.optimizer.workload import Hardware, Trace, poisson_trace
from ken.policy.plan import Frontier, GearPlan

ROWS = 120
BATCH_SIZES = (1, 4, 16)
#: per model: seconds per batch at BATCH_SIZES, and how often it is right
MODELS = {"a": ((0.004, 0.010, 0.032), 0.55),
          "b": ((0.010, 0.028, 0.090), 0.70),
          "c": ((0.030, 0.090, 0.300), 0.85)}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_profiles(seed: int = 0) -> dict[str, Profile]:
    """Three models whose certainty predicts correctness (so cascades are worth it)."""
    rng = np.random.default_rng(seed)
    truth = rng.integers(0, len(LABELS), ROWS)
    out = {}
    for name, (runtimes, skill) in MODELS.items():
        probs = rng.dirichlet(np.full(len(LABELS), 0.7), size=ROWS)
        sure = probs.max(axis=1)
        correct = rng.random(ROWS) < np.clip(skill - 0.3 + 0.6 * sure, 0, 1)
        pred = np.where(correct, truth, (truth + 1 + rng.integers(0, 2, ROWS)) % len(LABELS))
        # put each row's largest probability on its prediction
        top = probs.argmax(axis=1)
        rows = np.arange(ROWS)
        probs[rows, top], probs[rows, pred] = probs[rows, pred], probs[rows, top]
        out[name] = Profile(name, "cpu-1t", BATCH_SIZES, runtimes, 50 * 2**20, 60 * 2**20,
                            LABELS, "synthetic", "sample-hash", f"fp-{name}",
                            (pred == truth).astype(np.float64), probs.astype(np.float32),
                            tuple(LABELS[i] for i in pred))
    return out


PROFILES = synthetic_profiles()
SETTINGS = PlannerSettings(num_ranges=3, placement_scoring="estimate", max_rounds=3)


@pytest.fixture(scope="module")
def frontier() -> Frontier:
    catalog, cascades = planning_inputs(PROFILES, grid_size=4)
    trace = poisson_trace(20.0, 10.0, seed=1)
    front, _stats = plan_operator("mood", PROFILES, catalog, cascades,
                                  Hardware.cpu_workers(2, 2**30), trace, 30.0, SETTINGS)
    return front


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KEN_HOME", str(tmp_path / "ken_home"))
    return tmp_path / "ken_home"


# -- frontier, plot, JSON ----------------------------------------------------------------------


def test_plot_writes_a_png(frontier: Frontier, tmp_path) -> None:
    path = plot_frontier(frontier, tmp_path / "sub" / "front.png", title="synthetic",
                         extra_points=[("c alone", 300.0, 0.8)])
    data = path.read_bytes()
    assert path == tmp_path / "sub" / "front.png"
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_frontier_json_round_trip(frontier: Frontier, tmp_path) -> None:
    again = Frontier.from_json(frontier.to_json())
    assert again == frontier
    assert dict(again.provenance) == dict(frontier.provenance)  # sorted by key on load
    assert Frontier.load(frontier.save(tmp_path / "f.json")) == frontier
    lat = [p95 for p95, _ in frontier.points()]
    acc = [a for _, a in frontier.points()]
    assert lat == sorted(lat) and acc == sorted(acc)  # Pareto: slower plans are more accurate


def test_plan_operator_caches_by_inputs(tmp_path) -> None:
    catalog, cascades = planning_inputs(PROFILES, grid_size=4)
    hw = Hardware.cpu_workers(2, 2**30)
    trace = poisson_trace(20.0, 10.0, seed=1)
    args: tuple[Any, ...] = ("mood", PROFILES, catalog, cascades, hw, trace, 30.0, SETTINGS)
    first, stats = plan_operator(*args, cache_dir=tmp_path)
    assert stats is not None and len(list(tmp_path.glob("mood-*.json"))) == 1
    again, stats = plan_operator(*args, cache_dir=tmp_path)
    assert stats is None and again == first  # served from the cache
    other = poisson_trace(20.0, 10.0, seed=2)
    _f, stats = plan_operator("mood", PROFILES, catalog, cascades, hw, other, 30.0, SETTINGS,
                              cache_dir=tmp_path)
    assert stats is not None and len(list(tmp_path.glob("mood-*.json"))) == 2


def test_a_model_too_big_for_every_device_is_named(tmp_path) -> None:
    catalog, cascades = planning_inputs(PROFILES, grid_size=4)
    needs = r"\(a 50 MB, b 50 MB, c 50 MB\), but the largest device has 10 MB.*--memory-gb"
    with pytest.raises(KenError, match=needs):
        plan_operator("mood", PROFILES, catalog, cascades,
                      Hardware.cpu_workers(2, 10 * 2**20), poisson_trace(5.0, 5.0), 10.0,
                      SETTINGS)


# -- load and traces ---------------------------------------------------------------------------


def test_sustained_and_default_peak_by_hand() -> None:
    catalog, cascades = planning_inputs(PROFILES, grid_size=4)
    single = Cascade(("c",))
    # c alone at its best batch (16 rows in 0.3 s): 53.3 rows/s per device
    assert sustained_qps(catalog, single, 2) == pytest.approx(2 / (0.300 / 16))
    two = Cascade(("a", "c"), (0.5,))
    reach_c = catalog.stage_fractions(two)[1]
    assert sustained_qps(catalog, two, 1) == pytest.approx(1 / (0.032 / 16 + reach_c * 0.3 / 16))
    best = max(cascades, key=catalog.accuracy)
    assert default_peak_qps(catalog, cascades, 2) == round(1.5 * sustained_qps(catalog, best, 2))


@pytest.mark.parametrize("kind", ["poisson", "gamma"])
def test_synthetic_planning_traces_hit_the_peak(kind: str) -> None:
    trace = planning_trace(kind, 40.0, 30.0, seed=3)
    assert abs(trace.qps_max() - 40.0) <= 1.0
    assert trace.duration_s <= 30.0


@pytest.mark.parametrize("kind", ["poisson", "gamma"])
def test_held_out_window_is_the_planning_process_drawn_again(kind: str) -> None:
    planning = planning_trace(kind, 60.0, 60.0, seed=0)
    window = held_out_window(kind, 60.0, 60.0, 15.0)
    assert window.name == planning.name  # the name carries the mean rate (and CV)
    assert window.duration_s <= 15.0
    assert not np.array_equal(window.arrival_s[:10], planning.arrival_s[:10])
    # fitting a 15-s window to the 60-s trace's 1-s peak raises its mean rate instead
    refitted = planning_trace(kind, planning.qps_max(), 15.0, seed=1)
    assert refitted.name != planning.name
    many = [held_out_window(kind, 60.0, 60.0, 60.0, window_seed=s) for s in range(1, 9)]
    assert np.mean([len(w) for w in many]) == pytest.approx(len(planning), rel=0.35)
    with pytest.raises(KenError, match="another seed"):
        held_out_window(kind, 60.0, 60.0, 15.0, seed=2, window_seed=2)
    with pytest.raises(KenError, match="Trace.window"):
        held_out_window("azure", 60.0, 60.0, 15.0)


def test_azure_planning_trace_is_a_window_around_the_peak() -> None:
    from ken.optimizer.workload import AZURE_CODE_TRACE
    from ken.paths import shared_data_dir

    if not (shared_data_dir() / AZURE_CODE_TRACE).is_file():
        pytest.skip("the Azure trace is not in ../shared/data")
    trace = planning_trace("azure", 50.0, 60.0)
    assert abs(trace.qps_max() - 50.0) <= 1.0
    assert trace.duration_s < 60.0 and len(trace) > 50


def test_given_trace_is_scaled_and_unknown_kind_is_an_error() -> None:
    base = Trace(np.arange(0.0, 10.0, 0.1))  # 10 per second
    assert planning_trace(base, 20.0, 99.0).qps_max() == pytest.approx(20.0, abs=1.0)
    with pytest.raises(KenError, match="unknown trace 'nope'.*azure, poisson, gamma"):
        planning_trace("nope", 10.0, 10.0)


def test_missing_azure_data_says_what_to_do(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KEN_DATA_DIR", str(tmp_path))
    with pytest.raises(KenError, match="Azure trace not found.*--trace poisson"):
        planning_trace("azure", 10.0, 10.0)


# -- ken plan ----------------------------------------------------------------------------------


@pytest.fixture
def fake_profiles(monkeypatch) -> list[int]:
    """`ken plan` gets the synthetic profiles instead of profiling the packaged models."""
    calls: list[int] = []

    def load(_op: Any, _ctx: Any, threads: int, *_rest: Any, device: Any = None) -> Any:
        calls.append(threads)
        return dict(PROFILES)

    monkeypatch.setattr("ken.optimizer.planning.operator_profiles", load)
    return calls


def test_ken_plan_end_to_end(home, fake_profiles, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    argv = ["plan", "--trace", "poisson", "--duration", "10", "--peak-qps", "30",
            "--ranges", "3", "--grid", "4", "--placement-scoring", "estimate",
            "--target", "accuracy >= 0.6", "--out", str(out), "--quiet", "--no-calibration"]
    assert main(argv) == 0
    assert fake_profiles == [1]  # one thread per worker by default
    text = capsys.readouterr().out
    front = Frontier.load(out / "frontier-sentiment.json")
    assert (out / "frontier-sentiment.png").read_bytes().startswith(PNG_MAGIC)
    assert f"Gear-plan frontier of sentiment ({len(front)} plans)" in text
    assert "for target accuracy >= 0.6" in text
    chosen = front.pick(min_accuracy=0.6)
    for line in chosen.describe():
        assert line.split(" (")[0] in " ".join(text.split())
    assert "C0 = " in text and "placement: " in text
    # the frontier is cached: a second run does not plan again
    assert main(argv) == 0
    assert "from cache" in capsys.readouterr().out
    assert len(list((home / "plans").glob("sentiment-*.json"))) == 1
    assert dict(front.provenance)["runtimes"] == "profiles, uncalibrated"
    assert not (out / "calibration.json").exists()


def test_ken_plan_calibrates_by_default_and_records_it(home, fake_profiles, tmp_path,
                                                       monkeypatch, capsys) -> None:
    """Without --no-calibration `ken plan` measures a calibration on this machine's workers
    (here a stand-in for the replay), plans with it, writes it and names it in every plan;
    --calibration FILE plans with a saved one instead, measuring nothing."""
    from ken.engine.calibrate import Calibration
    from ken.ops.sentiment import Sentiment

    measured: list[tuple] = []

    def measure(catalog: Any, loaders: Any, sample: Any, hardware: Any, seconds: float,
                **_kw: Any) -> Calibration:
        measured.append((sorted(loaders), seconds, hardware.ids))
        # the rate the planning trace's requests arrive in (its peak is 30 qps)
        assert 0 < _kw["rate"] <= 30
        return Calibration({m: ((1, 1.5),) for m in loaders}, {m: 40 for m in loaders},
                           "stand-in replay")

    monkeypatch.setattr("ken.cli.plan.measure_calibration", measure)
    monkeypatch.setattr(Sentiment, "loaders", lambda self, ctx, device: {
        m: None for m in PROFILES})
    monkeypatch.setattr(Sentiment, "eval_sample", lambda self, ctx: "sample")
    out = tmp_path / "cal"
    base = ["plan", "--trace", "poisson", "--duration", "10", "--peak-qps", "30",
            "--ranges", "2", "--grid", "4", "--placement-scoring", "estimate", "--quiet"]
    assert main([*base, "--calibration-seconds", "3", "--out", str(out)]) == 0
    assert measured == [(sorted(PROFILES), 3.0, ("cpu0", "cpu1"))]
    text = " ".join(capsys.readouterr().out.split())
    assert "runtimes: calibrated:" in text and "x1.50@1" in text
    front = Frontier.load(out / "frontier-sentiment.json")
    assert all(dict(p.provenance)["runtimes"].startswith("calibrated: ") for p in front.plans)
    saved = Calibration.load(out / "calibration.json")
    assert saved.fits == {m: ((1, 1.5),) for m in PROFILES}
    # slower runtimes: the calibrated frontier predicts more latency than the uncalibrated
    plain = tmp_path / "plain"
    assert main([*base, "--no-calibration", "--out", str(plain)]) == 0
    fast = Frontier.load(plain / "frontier-sentiment.json")
    assert fast.plans[0].predicted.p50_ms < front.plans[0].predicted.p50_ms
    again = tmp_path / "again"
    assert main([*base, "--calibration", str(out / "calibration.json"),
                 "--out", str(again)]) == 0
    assert len(measured) == 1  # the file was used, nothing measured
    assert "from cache" in capsys.readouterr().out  # same calibration: the same frontier
    # a replay's calibration fits only the models its plan served: the others measured now
    first, *rest = sorted(PROFILES)
    Calibration({first: ((1, 2.0),)}, {first: 500}, "a replay").save(tmp_path / "r.json")
    assert main([*base, "--calibration", str(tmp_path / "r.json"),
                 "--out", str(tmp_path / "part")]) == 0
    assert measured[-1][0] == rest
    both = Calibration.load(tmp_path / "part" / "calibration.json")
    assert both.fits == {first: ((1, 2.0),), **{m: ((1, 1.5),) for m in rest}}
    assert both.source == f"a replay; {', '.join(rest)} from stand-in replay"
    assert main([*base, "--calibration", str(tmp_path / "r.json"), "--no-calibration",
                 "--out", str(tmp_path / "part-profiles")]) == 0
    assert len(measured) == 2  # --no-calibration: the others on their profiles
    assert Calibration.load(tmp_path / "part-profiles" / "calibration.json").fits == {
        first: ((1, 2.0),)}
    capsys.readouterr()

    def broken(*_a: Any, **_kw: Any) -> Calibration:
        raise KenError("a worker could not load its model")

    monkeypatch.setattr("ken.cli.plan.measure_calibration", broken)
    assert main([*base, "--out", str(tmp_path / "broken")]) == 0  # planned, uncalibrated
    text = " ".join(capsys.readouterr().out.split())
    assert "runtime calibration failed (a worker could not load its model)" in text
    assert "runtimes: profiles, uncalibrated" in text


@pytest.mark.parametrize(("args", "message"), [
    (["--devices", "0"], "devices must be >= 1"),
    (["--memory-gb", "-1"], "memory per device must be > 0 GB"),
    (["--ranges", "0"], "QPS ranges must be >= 1"),
    (["--duration", "0"], "duration must be > 0 s"),
    (["--peak-qps", "0"], "peak QPS must be > 0"),
    (["--device-threads", "0"], "threads per device must be >= 1"),
    (["--devices", "0", "--ranges", "0"], "devices must be >= 1.*QPS ranges must be >= 1"),
    (["--target", "acc > 3"], "cannot read target 'acc > 3'.*accuracy >= 0.7"),
    (["--calibration-seconds", "0"], "calibration-seconds must be > 0"),
])
def test_ken_plan_argument_errors(args: list[str], message: str, fake_profiles,
                                  capsys) -> None:
    assert main(["plan", "--trace", "poisson", *args]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "error:" in err
    assert re.search(message, err), err
    assert fake_profiles == []  # rejected before any profiling


def test_ken_plan_without_azure_data(tmp_path, monkeypatch, fake_profiles, capsys) -> None:
    monkeypatch.setenv("KEN_DATA_DIR", str(tmp_path))
    assert main(["plan"]) == 1  # a failure ken reports (data missing), not a usage error
    err = " ".join(capsys.readouterr().err.split())
    assert "Azure trace is not at" in err and "--trace poisson" in err
    assert fake_profiles == []


def test_ken_plan_unknown_trace_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--trace", "uniform"])
    assert exc.value.code == 2
    assert "invalid choice: 'uniform'" in capsys.readouterr().err


def test_ken_explain_with_a_frontier_file(frontier: Frontier, tmp_path, capsys) -> None:
    plans = [GearPlan.from_dict({**p.to_dict(), "operator": "sentiment"})
             for p in frontier.plans]
    path = Frontier("sentiment", plans).save(tmp_path / "frontier-sentiment.json")
    db = str(tmp_path / "empty.duckdb")
    # no semantic call: the plan is loaded and set, and nothing runs a model
    assert main(["explain", "--quiet", "--db", db, "--frontier", str(path), "--target",
                 "accuracy >= 0.6", "SELECT 42 AS answer"]) == 0
    assert "[duckdb] Project 42 AS answer" in capsys.readouterr().out
    assert main(["explain", "--quiet", "--db", db, "--frontier",
                 str(tmp_path / "missing.json"), "SELECT 1"]) == 1  # a missing file: failure
    assert "create one with `ken plan`" in " ".join(capsys.readouterr().err.split())
    assert main(["explain", "--quiet", "--db", db, "--target", "p95 <= 5", "SELECT 1"]) == 2
    assert "--target picks a gear plan from --frontier" in capsys.readouterr().err


# -- Session.plan, use_plan, EXPLAIN ------------------------------------------------------------


def fake_session() -> ken.Session:
    s = ken.connect(builtins=False)
    models = {m: FakeModel(m) for m in MODELS}
    s.register("mood", Cascade(("a", "b", "c"), (0.5, 0.45)), models=models)
    s.register("other", Cascade(("a",)), models=models)
    s.register_table("tweets", pa.table({"id": [1, 2, 3], "text": ["great", "awful", None]}))
    return s


QUERY = "SELECT id, mood(text) AS m FROM tweets WHERE other(text) = 'positive'"


def with_profiles(s: ken.Session, source) -> None:  # noqa: ANN001
    old = s.operators["mood"]
    s.register("mood", Profiled("mood", old.cascade, old.models, source))


def test_explain_without_plan() -> None:
    s = fake_session()
    with_profiles(s, lambda _threads: PROFILES)
    text = s.explain(QUERY)
    assert "      gear plan: none (run session.plan(...) or `ken plan`)" in text
    assert "      gear plan: none (other() has no profiles to plan with; session.use_plan(...)" \
        in text


def test_explain_shows_the_plan_set_with_use_plan(frontier: Frontier) -> None:
    s = fake_session()
    plan = frontier.plans[-1]
    s.use_plan(plan)
    assert s.plans["mood"] is plan
    text = s.explain(QUERY)
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if "gear plan: " in line and "none" not in line)
    gears = len(plan.gears())
    assert lines[head] == (f"      gear plan: {gears} gear{'s' if gears != 1 else ''} over "
                           f"0-{plan.qps_max:g} qps on {', '.join(plan.devices)} (for online "
                           "serving, session.serve(); until then queries run the implementation "
                           "above)")
    assert lines[head + 1: head + 1 + len(plan.describe())] == \
        [f"        {line}" for line in plan.describe()]
    assert lines[head - 3].startswith("  s0: mood(text)")  # under the mood site, not other
    assert "predicted: accuracy" in text and "placement: " in text and "batch triggers" in text
    assert "gear plan: none" in text  # other() still has none
    analyzed = str(s.sql("EXPLAIN ANALYZE " + QUERY))
    assert lines[head] in analyzed.splitlines()
    # re-registering the name drops the plan made for the old function
    s.register("mood", Cascade(("a",)), models={"a": FakeModel("a")})
    assert "mood" not in s.plans


def test_use_plan_errors(frontier: Frontier) -> None:
    s = fake_session()
    with pytest.raises(KenError, match=r"use_plan\(\) takes a plan \(ken.Plan\), not Frontier"):
        s.use_plan(frontier)  # type: ignore[arg-type]
    stray = GearPlan.from_dict({**frontier.plans[0].to_dict(), "operator": "sentimnet"})
    with pytest.raises(KenError, match=r"sentimnet\(\), which is not a semantic function.*"
                                       r"registered: mood, other"):
        s.use_plan(stray)
    with pytest.raises(TypeError):
        s.plans["mood"] = frontier.plans[0]  # type: ignore[index]


def test_session_plan_with_profiles(home) -> None:
    s = fake_session()
    seen: list[int] = []

    def source(threads: int) -> dict[str, Profile]:
        seen.append(threads)
        return PROFILES

    with_profiles(s, source)
    result = s.plan("accuracy >= 0.6", functions=("mood",), trace="poisson", duration_s=10,
                    peak_qps=30, settings=SETTINGS)
    assert seen == [1]
    assert result.target == Target(min_accuracy=0.6)
    plan = result.plan_for("mood")
    assert s.plans == {"mood": plan}
    assert plan.predicted.accuracy >= 0.6  # type: ignore[union-attr]
    assert s.frontiers["mood"].plans[0].predicted.p95_ms <= \
        plan.predicted.p95_ms  # type: ignore[union-attr]
    assert len(list((home / "plans").glob("mood-*.json"))) == 1
    assert "gear plan: none" not in s.explain("SELECT mood(text) FROM tweets")


def test_session_plan_on_a_function_without_profiles() -> None:
    s = ken.connect()  # builtins: registering them loads no models
    s.register("other", Cascade(("a",)), models={"a": FakeModel("a")})
    with pytest.raises(KenError, match=r"other\(\) cannot be planned: .*has none .*; "
                                       r"functions this session can plan: .*sem_classify, "
                                       r".*sem_filter, .*sentiment"):
        s.plan("accuracy >= 0.7", functions=("other",))
    with pytest.raises(KenError, match=r"unknown function sentimnet\(\)"):
        s.plan("accuracy >= 0.7", functions=("sentimnet",))
    with pytest.raises(KenError, match="cannot read target"):
        s.plan("fast please")
    with pytest.raises(KenError, match="devices must be >= 1"):
        s.plan("p95 <= 50", devices=0)
    assert dict(s.plans) == {}


def test_ken_plan_for_a_ray_cluster_places_on_its_devices(home, fake_profiles, tmp_path,
                                                          capsys) -> None:
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'ken[ray]'")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        out = tmp_path / "out"
        assert main(["plan", "--ray", "local", "--trace", "poisson", "--duration", "10",
                     "--peak-qps", "30", "--ranges", "2", "--grid", "4", "--placement-scoring",
                     "estimate", "--out", str(out)]) == 0  # not calibrated: a note says so
    finally:
        ray.shutdown()
    assert "devices n0.cpu0, n0.cpu1" in " ".join(capsys.readouterr().err.split())
    front = Frontier.load(out / "frontier-sentiment.json")
    placed = {d for p in front.plans for r in p.placement for d in r.devices}
    assert placed <= {"n0.cpu0", "n0.cpu1"} and placed
