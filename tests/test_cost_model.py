"""What the simulator charges a batch beyond its profiled runtime (issue 33, item 3): the size
of its largest row, and the serving calibration that ``ken plan`` measures. Brute force on
small cases; synthetic logs with known parameters; the engine with stand-in models."""

from __future__ import annotations

import itertools
import json
import re
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ken.engine.calibrate import SPREAD_POINTS, Calibration, fit_calibration, predicted_s
from ken.engine.supervision import BatchRecord
from ken.errors import KenError, ProfileError
from ken.models.cascade import Cascade
from ken.models.model import row_size
from ken.optimizer.perf import Catalog, ModelPerf, batch_shares, expected_max, size_factor
from ken.optimizer.profile import size_share
from ken.optimizer.simulator import simulate_many
from ken.optimizer.workload import Trace
from ken.policy.plan import GearPlan, RangeSchedule, Replica

RT = 0.010  # seconds for a batch of 1 (and 8 for a batch of 8, linearly between)


def catalog(sizes: list[int] | None, share: float = 0.0, rows: int = 6) -> Catalog:
    perf = {m: ModelPerf(m, (1, 8), ((RT, 8 * RT),), (100,), size_share=share)
            for m in ("a", "b")}
    q = {m: np.ones(rows) for m in perf}
    p = {m: np.full((rows, 2), 0.5) for m in perf}
    return Catalog(perf, q, p, "t", row_sizes=None if sizes is None else np.array(sizes))


def one_model(devices: tuple[str, ...] = ("d0",), max_batch: int = 4) -> GearPlan:
    reps = tuple(Replica("a", (d,)) for d in devices)
    return GearPlan("op", (0.0, 1e6), (Cascade(("a",)),), reps,
                    (RangeSchedule(0, (1.0 / len(reps),) * len(reps), (1,) * len(reps)),),
                    (max_batch,) * len(reps))


def test_row_size_counts_the_characters_of_every_text() -> None:
    assert row_size("abcd") == 4
    assert row_size(("ab", "cde")) == 5
    assert row_size({"q": "abc", "t": ["d", "ef"]}) == 6
    assert row_size(3.5) == 0


def test_size_share_recovers_the_share_of_a_linear_runtime() -> None:
    sizes = np.array([10, 20, 30, 40, 50, 60, 70, 80, 90, 100] * 3)
    a, s = 0.004, 0.0001  # 4 ms + 0.1 ms per character
    single = [(i, a + s * sizes[i]) for i in range(len(sizes))]
    mean = sizes.mean()
    assert size_share(sizes, single) == pytest.approx(s * mean / (a + s * mean))
    assert size_share(sizes, single[:5]) == 0.0  # too few calls to fit
    flat = np.full(30, 50)
    assert size_share(flat, [(i, 0.01) for i in range(30)]) == 0.0  # one size: nothing to fit
    falling = [(i, 0.02 - s * sizes[i]) for i in range(len(sizes))]
    assert size_share(sizes, falling) == 0.0  # no positive slope


def test_expected_max_is_exact_against_enumeration() -> None:
    values = np.array([3.0, 7.0, 1.0, 12.0, 7.0])
    table = expected_max(values, 3)
    assert table[0] == 0.0
    for b in (1, 2, 3):
        brute = np.mean([max(t) for t in itertools.product(values, repeat=b)])
        assert table[b] == pytest.approx(brute)


def test_size_factors_average_one_over_random_batches() -> None:
    """A random batch costs its profiled runtime on average: the size-bound share scales
    with the largest row against the expected largest, so it averages out exactly."""
    values = np.array([5.0, 40.0, 9.0, 22.0])
    table = expected_max(values, 3)
    for b, share in itertools.product((1, 2, 3), (0.3, 1.0)):
        mean = np.mean([size_factor(share, max(t), table[b])
                        for t in itertools.product(values, repeat=b)])
        assert mean == pytest.approx(1.0)
    assert size_factor(0.5, 10.0, 0.0) == 1.0


def test_a_batch_pads_to_its_largest_row_so_its_size_share_grows_with_its_rows() -> None:
    """A batch of b rows runs every row as long as its largest (padding): a fixed part, a
    part per row, and ``b x largest`` units of size. ``batch_shares`` recovers each batch
    size's share from the one-row share alone, so that every batch, checked against brute
    force over all batches of up to 4 rows, is charged its own runtime."""
    values = np.array([5.0, 40.0, 9.0, 22.0, 13.0])
    expected = expected_max(values, 4)
    fixed, per_row, per_unit = 0.004, 0.001, 0.0002
    runtimes = [0.0] + [fixed + per_row * b + per_unit * b * expected[b] for b in range(1, 5)]
    shares = batch_shares(per_unit * expected[1] / runtimes[1], expected, runtimes)
    for b in range(1, 5):
        assert shares[b] == pytest.approx(per_unit * b * expected[b] / runtimes[b])
        for rows in itertools.product(values, repeat=b):
            truth = fixed + per_row * b + per_unit * b * max(rows)
            charged = runtimes[b] * size_factor(shares[b], max(rows), expected[b])
            assert charged == pytest.approx(truth)
    assert shares[1] < shares[2] < shares[4]
    assert batch_shares(0.9, expected, [0.0, 1.0, 0.5, 0.5, 0.5])[2:].tolist() == [1.0] * 3


def test_a_profiles_batch_shares_survive_calibration_and_thin_out_under_an_overhead() -> None:
    """The shares per batch size come from the profile's own rows and runtimes; a calibration
    scales whole calls, so it keeps them (a batch's size-bound seconds scale with it), while
    a hop's added seconds do not grow with the rows, so they dilute them."""
    from ken.optimizer.profile import Profile

    sizes = np.array([5, 40, 9, 22, 13, 30] * 5)
    runtimes = (0.010, 0.016, 0.030, 0.060)
    profile = Profile("a", "cpu-1t", (1, 2, 4, 8), runtimes, 100, 100, (), "s", "h", "fp",
                      np.ones(30), np.full((30, 2), 0.5), row_sizes=sizes, size_share=0.4)
    perf = ModelPerf.from_profile(profile)
    dense = batch_shares(0.4, expected_max(sizes, 8),
                         [0.0, *np.interp(np.arange(1, 9), (1, 2, 4, 8), runtimes)])
    assert perf.size_shares == pytest.approx([dense[b] for b in (1, 2, 4, 8)])
    assert perf.size_shares[0] == pytest.approx(0.4) and perf.size_shares[3] > 0.4
    cat = Catalog.from_profiles([profile])
    before = cat.size_factors("a", "d0", 8)[0]
    assert before[3] == pytest.approx(np.interp(3, (1, 2, 4, 8), perf.size_shares))
    calibrated = Calibration({"a": ((1, 0.8), (8, 1.3))}).apply(cat)
    assert calibrated.perf["a"].batch_runtime(8) == pytest.approx(1.3 * 0.060)
    np.testing.assert_allclose(calibrated.size_factors("a", "d0", 8)[0], before)
    hop = cat.with_overhead(0.005).size_factors("a", "d0", 8)[0]
    for b, t in zip((1, 2, 4, 8), runtimes, strict=True):
        assert hop[b] == pytest.approx(before[b] * t / (t + 0.005))


def test_each_model_scales_by_its_own_row_sizes() -> None:
    """Sizes are per model (a tokenizer's tokens differ by model): the simulator charges a
    replica by its own model's sizes; a model without sizes is unscaled; sizes of a model
    the catalog does not know are refused."""
    trace = Trace([0.0, 1.0])
    base = catalog(None, share=0.5)
    a_sizes, b_sizes = np.array([100.0, 10, 10, 10, 10, 10]), np.array([10.0, 100, 10, 10, 10, 10])
    both = Catalog(base.perf, dict(base.quality), dict(base.scores), "t",
                   row_sizes={"a": a_sizes, "b": b_sizes})
    lat = simulate_many([one_model()], [both], trace, rows=[0, 1], routes=[(0,)] * 6).latency_s
    assert lat[0] == pytest.approx(RT * (0.5 + 0.5 * 100 / a_sizes.mean()))
    assert lat[1] == pytest.approx(RT * (0.5 + 0.5 * 10 / a_sizes.mean()))
    only_b = Catalog(base.perf, dict(base.quality), dict(base.scores), "t",
                     row_sizes={"b": b_sizes})
    assert only_b.sizes_of("a") is None and only_b.size_factors("a", "d0", 4) is None
    assert np.allclose(simulate_many([one_model()], [only_b], trace, rows=[0, 1],
                                     routes=[(0,)] * 6).latency_s, RT)
    with pytest.raises(ProfileError, match="row sizes of .'z'., which the catalog"):
        Catalog(base.perf, dict(base.quality), dict(base.scores), row_sizes={"z": a_sizes})


def test_the_simulator_charges_long_rows_more_and_knows_nothing_without_sizes() -> None:
    trace = Trace([0.0, 1.0, 2.0, 3.0])  # far apart: each request alone in its batch
    sizes = [100, 10, 10, 10, 10, 10]
    rows = [0, 1, 0, 1]
    sized = catalog(sizes, share=0.5)
    lat = simulate_many([one_model()], [sized], trace, rows=rows,
                        routes=[(0,)] * 6).latency_s
    mean = np.mean(sizes)
    assert lat[0] == pytest.approx(RT * (0.5 + 0.5 * 100 / mean))
    assert lat[1] == pytest.approx(RT * (0.5 + 0.5 * 10 / mean))
    plain = simulate_many([one_model()], [catalog(None, share=0.5)], trace, rows=rows,
                          routes=[(0,)] * 6).latency_s
    assert np.allclose(plain, RT)  # no row sizes: every batch its profiled runtime
    with pytest.raises(ProfileError, match="size_share"):
        ModelPerf("x", (1,), ((0.1,),), (1,), size_share=1.5)
    with pytest.raises(ProfileError, match="row sizes of a cover 3 rows"):
        Catalog(sized.perf, dict(sized.quality), dict(sized.scores), row_sizes=np.ones(3))
    unshared = simulate_many([one_model()], [catalog(sizes, share=0.0)], trace, rows=rows,
                             routes=[(0,)] * 6).latency_s
    assert np.allclose(unshared, RT)


def _log(factors: dict[int, float], n: int = 300, seed: int = 0, wake: float = 1.0,
         noise_sd: float = 0.05, model: str = "a") -> list[BatchRecord]:
    """Calls of ``model`` of 1-4 rows (the sizes ``factors`` has), each ``factors[rows] x
    predicted`` long times a noise factor (median 1, ``noise_sd``), with two stalls of a
    second; every other call after 0.2 s of idle and ``wake`` times longer, the rest back to
    back."""
    sizes = sorted(factors)
    rng = np.random.default_rng(seed)
    cat = catalog(None)
    out = []
    for i in range(n):
        idle = 0.2 if i % 2 else 0.0
        r = BatchRecord("d0", model, int(sizes[rng.integers(len(sizes))]), i * 1.0, i * 1.0,
                        idle)
        noise = 1.0 + noise_sd * rng.standard_normal() + (100.0 if i in (7, 90) else 0.0)
        noise *= wake if idle else 1.0
        out.append(BatchRecord("d0", model, r.rows, r.start_s,
                               r.start_s + factors[r.rows] * predicted_s(r, cat) * noise, idle))
    return out


def test_fit_calibration_separates_the_wake_up_after_idle() -> None:
    """Calls after idle 10% slower: the wake-up factor is found from the one-row calls, and
    the size factors are the back-to-back ones; without idle calls it is 1."""
    log = _log({1: 0.9, 2: 1.0, 3: 1.2, 4: 1.2}, n=600, wake=1.1)
    cal = fit_calibration(log, catalog(None), prior_calls=0)
    assert cal.wake == pytest.approx(1.1, rel=0.03)
    for (_, got), want in zip(cal.fits["a"], (0.9, 1.0, 1.2), strict=True):
        assert got == pytest.approx(want, rel=0.03)
    busy = [r for r in log if r.idle_before_s == 0.0]
    assert fit_calibration(busy, catalog(None)).wake == 1.0
    assert "x1.10 after 50 ms idle" in cal.describe()
    again = Calibration.load(cal.save(Path(tempfile.mkdtemp()) / "c.json"))
    assert again.wake == pytest.approx(cal.wake)
    assert cal.apply(catalog(None)).perf["a"].wake == pytest.approx(cal.wake)
    with pytest.raises(KenError, match="wake-up factor"):
        Calibration({}, wake=0.0)


def test_the_simulator_charges_a_wake_up_after_idle_only() -> None:
    """Requests 1 s apart each find the device idle (wake x the runtime); a burst's second
    batch starts back to back (its plain runtime)."""
    woken = catalog(None)
    woken = woken.with_perf({m: replace(p, wake=1.5) for m, p in woken.perf.items()})
    apart = simulate_many([one_model(max_batch=1)], [woken], Trace([0.0, 1.0, 2.0]),
                          rows=[0, 1, 2], routes=[(0,)] * 3).latency_s
    assert np.allclose(apart, 1.5 * RT)
    burst = simulate_many([one_model(max_batch=1)], [woken], Trace([0.0, 0.0]),
                          rows=[0, 1], routes=[(0,)] * 2).latency_s
    assert burst[0] == pytest.approx(1.5 * RT)  # the first batch wakes the device
    assert burst[1] == pytest.approx(1.5 * RT + RT)  # the second runs back to back
    with pytest.raises(ProfileError, match="wake-up"):
        ModelPerf("x", (1,), ((0.1,),), (1,), wake=0.0)


def test_fit_calibration_recovers_a_factor_per_batch_size() -> None:
    """One-row calls faster than profiled, larger ones slower (as the packaged encoders
    serve): a factor per power-of-two bin (3 rows fall in the 4-row bin), stalls left out;
    75-150 calls per bin, so pooling with the model's factor moves each by a few percent."""
    log = _log({1: 0.85, 2: 1.1, 3: 1.3, 4: 1.3})
    cal = fit_calibration(log, catalog(None), source="synthetic", prior_calls=0)
    assert [b for b, _ in cal.fits["a"]] == [1, 2, 4]
    for (_, got), want in zip(cal.fits["a"], (0.85, 1.1, 1.3), strict=True):
        assert got == pytest.approx(want, rel=0.03)  # the stalls are left out of the fit
    pooled = fit_calibration(log, catalog(None))  # the default pooling: a few percent
    for (_, got), (_, own) in zip(pooled.fits["a"], cal.fits["a"], strict=True):
        assert got == pytest.approx(own, rel=0.05) and got != own
    assert cal.factor("a", 1) == pytest.approx(0.85, rel=0.03)
    assert cal.factor("a", 64) == cal.factor("a", 4)  # the nearest fitted size outside them
    assert cal.factor("b", 4) == 1.0  # not covered
    assert cal.calls["a"] == len(log)
    assert "b" not in cal.fits  # never called: left as profiled
    assert fit_calibration(log[:5], catalog(None)).fits == {}  # too few calls
    # bins of few calls (against the prior's weight) are pulled to the model's factor
    flat = fit_calibration(log, catalog(None), prior_calls=10_000)
    assert max(f for _, f in flat.fits["a"]) - min(f for _, f in flat.fits["a"]) < 0.01


def test_fit_calibration_keeps_what_is_left_of_each_call_as_a_spread_of_mean_one() -> None:
    """Calls whose noise has a 20% sd around their size's factor: the spread is that noise
    (mean 1, its sd, its tail up to the p99), not the differences between sizes or the
    wake-up, and not the two stalls; the simulator then draws it, so a one-row plan's p99
    grows as the noise's and its mean does not. Too few calls: no spread."""
    factors = {1: 0.85, 2: 1.1, 4: 1.3}
    cal = fit_calibration(_log(factors, n=2000, wake=1.2, noise_sd=0.2), catalog(None))
    spread = np.array(cal.spread["a"])
    assert len(spread) == 51 and np.mean(spread) == pytest.approx(1.0)
    assert np.std(spread) == pytest.approx(0.2, rel=0.15)
    assert spread.max() < 2.0  # the stalls (100x) are not in it
    assert "(p95 call x1.3" in cal.describe()  # the noise's p95: 1 + 1.645 x 0.2
    narrow = fit_calibration(_log(factors, n=2000, wake=1.2), catalog(None))
    assert np.std(narrow.spread["a"]) == pytest.approx(0.05, rel=0.15)
    few = fit_calibration(_log(factors, n=15, noise_sd=0.2), catalog(None))
    assert few.fits["a"] and few.spread == {}
    cat = cal.apply(catalog(None))
    assert cat.perf["a"].spread == cal.spread["a"] and cat.perf["b"].spread == ()
    trace = Trace(np.arange(400) * 1.0)  # calls never queue: latency is the call
    plain = Calibration(cal.fits, cal.calls, wake=cal.wake).apply(catalog(None))
    drawn = simulate_many([one_model(max_batch=1)], [cat], trace, rows=[0] * 400,
                          routes=[(0,)] * 400).latency_s
    fixed = simulate_many([one_model(max_batch=1)], [plain], trace, rows=[0] * 400,
                          routes=[(0,)] * 400).latency_s
    assert np.ptp(fixed[1:]) == pytest.approx(0.0, abs=1e-12)
    assert np.mean(drawn[1:]) == pytest.approx(np.mean(fixed[1:]), rel=0.05)
    assert np.percentile(drawn[1:] / fixed[1:], 99) == pytest.approx(1 + 2.326 * 0.2, rel=0.06)


def test_calibration_applies_round_trips_and_refuses_bad_files(tmp_path) -> None:  # noqa: ANN001
    cal = Calibration({"a": ((1, 0.8), (4, 1.2))}, {"a": 50}, "test")
    assert cal.factor("a", 2) == pytest.approx(1.0)  # halfway in log2 of the rows
    cat = cal.apply(catalog([5, 6, 7, 8, 9, 10], share=0.4))
    assert cat.perf["a"].batch_runtime(1) == pytest.approx(0.8 * RT)
    assert cat.perf["b"].batch_runtime(1) == RT
    assert cat.perf["a"].size_share == 0.4 and cat.sizes_of("a") is not None  # kept
    assert "minilm" not in cal.describe() and "a x0.80@1 x1.20@4" in cal.describe()
    path = cal.save(tmp_path / "calibration.json")
    again = Calibration.load(path)
    assert again.fits == cal.fits and again.calls == cal.calls and again.source == "test"
    assert again.spread == {}
    spread = Calibration(cal.fits, cal.calls, "test", spread={"a": (0.8, 1.0, 1.2)})
    assert "(p95 call x1.18)" in spread.describe() and spread.key() != cal.key()
    assert Calibration.load(spread.save(tmp_path / "s.json")).spread == {"a": (0.8, 1.0, 1.2)}
    v3 = json.loads(path.read_text())  # before the spread was fitted: every call its mean
    v3["version"] = 3
    for f in v3["fits"].values():
        del f["spread"]
    (tmp_path / "v3.json").write_text(json.dumps(v3))
    assert Calibration.load(tmp_path / "v3.json").fits == cal.fits
    assert Calibration.load(tmp_path / "v3.json").spread == {}
    assert "fitted on the calls alone" in Calibration.load(tmp_path / "v3.json").source
    assert "calls alone" not in again.source  # version 5: fitted on the held time
    assert "characters" in Calibration.load(tmp_path / "v3.json").source  # before version 6
    assert "characters" not in again.source
    for bad in ({"a": (0.0, 1.0)}, {"b": (1.0,)}):
        with pytest.raises(KenError, match="runtime spread"):
            Calibration(cal.fits, spread=bad)
    with pytest.raises(KenError, match="ken replay"):
        Calibration.load(tmp_path / "missing.json")
    for version, old in ((1, {"spreads": {"a": [1.0]}}),
                         (2, {"fits": {"a": {"overhead_s": 0.0, "factor": 1.0}}})):
        (tmp_path / "old.json").write_text(json.dumps(
            {"kind": "ken-runtime-calibration", "version": version, **old}))
        with pytest.raises(KenError, match=f"version {version}"):
            Calibration.load(tmp_path / "old.json")
    with pytest.raises(KenError, match="covers"):
        Calibration({"zz": ((1, 1.0),)}).apply(catalog(None))
    for bad in ((), ((1, -1.0),), ((0, 1.0),), ((2, 1.0), (2, 1.1))):
        with pytest.raises(KenError, match="one factor > 0 per batch size"):
            Calibration({"a": bad})


def test_a_calibration_updated_by_serving_calls_keeps_the_models_they_did_not_call() -> None:
    first = Calibration({"a": ((1, 0.8),), "b": ((1, 1.3), (4, 1.5))}, {"a": 40, "b": 30},
                        "ken plan", wake=1.1, spread={"a": (0.9, 1.1), "b": (0.5, 1.5)})
    served = Calibration({"a": ((1, 1.2), (2, 1.25))}, {"a": 200}, "a replay", wake=1.05,
                         spread={"a": (0.8, 1.2)})
    both = first.updated(served)
    assert both.fits == {"a": ((1, 1.2), (2, 1.25)), "b": ((1, 1.3), (4, 1.5))}
    assert both.calls == {"a": 200, "b": 30} and both.wake == 1.05
    assert both.spread == {"a": (0.8, 1.2), "b": (0.5, 1.5)}
    assert both.source == "a replay; b from ken plan"
    cat = both.apply(catalog(None))
    assert cat.perf["a"].batch_runtime(1) == pytest.approx(1.2 * RT)
    assert cat.perf["b"].batch_runtime(1) == pytest.approx(1.3 * RT)
    assert first.updated(Calibration({**first.fits})).source == ""  # nothing kept from first
    assert first.updated(Calibration({})) is first  # a file that fitted nothing
    measured = Calibration(first.fits, other_cores=0.1)  # the reading kept: the file has none
    assert measured.updated(served).other_cores == 0.1


def _sleeping_models(rows: int, bases: dict[str, float]) -> tuple[Catalog, dict]:
    """Profiles of ``base`` + 1 ms per row for each model of ``bases`` over ``rows`` rows, and
    loaders of fake models whose calls sleep twice that."""
    import functools

    import fakes

    perf = {m: ModelPerf(m, (1, 8), ((base + 0.001, base + 0.008),), (1000,))
            for m, base in bases.items()}
    cat = Catalog(perf, {m: np.ones(rows) for m in perf},
                  {m: np.full((rows, 3), 1 / 3) for m in perf}, "t")
    return cat, {m: functools.partial(fakes.SlowModel, m, 2 * base, 0.002)
                 for m, base in bases.items()}


def test_measure_calibration_serves_every_model_and_fits_what_it_saw() -> None:
    """The engine, process workers and fake models whose calls sleep twice as long as their
    profile says: the fit finds a factor near 2 for both (a sleep does not contend)."""

    import fakes

    from ken.engine.calibrate import measure_calibration
    from ken.models.datasets import LabelledSample
    from ken.optimizer.workload import Hardware

    rows = 40
    sample = LabelledSample("t", tuple(f"row {i} " + "x" * (i % 7) for i in range(rows)),
                            np.arange(rows) % 3, fakes.LABELS)
    # the profiles: a 5 ms + 1 ms per row, b 10 ms + 1 ms per row; the models take twice that
    cat, loaders = _sleeping_models(rows, {"a": 0.005, "b": 0.010})
    cal = measure_calibration(cat, loaders, sample, Hardware.cpu_workers(2, 2**30),
                              seconds=3.0, workers="process")
    assert set(cal.fits) == {"a", "b"}
    for m in ("a", "b"):
        assert cal.calls[m] >= 10
        # about 2x, with the round trip; the bursts made batches of more than one row
        assert 1.6 < cal.factor(m, 1) < 2.8, cal.describe()
        assert max(b for b, _ in cal.fits[m]) > 1, cal.describe()
    assert "every model" in cal.source


def test_a_calibration_moved_to_the_serving_rate_fits_each_model_on_its_calls_there() -> None:
    """Each model's calls at the plans' rate: ``a``'s ran 1.25x what the calibration charged,
    ``b``'s 1.5x; each is fitted on its own calls (factors and spread), and a model served
    there with too few calls (``c``: none) moves by their call-weighted mean shift, its
    spread kept; no model with enough calls leaves the calibration as it was."""
    from ken.engine.calibrate import at_serving_rate

    fitted = Calibration({"a": ((1, 0.8), (2, 0.8)), "b": ((1, 1.0), (2, 1.0), (4, 2.0)),
                          "c": ((1, 1.5), (4, 2.0))},
                         {"a": 40, "b": 40, "c": 30}, "cascade", wake=1.1,
                         spread={"c": (0.9, 1.1)})
    logs = {"a": _log({1: 1.0, 2: 1.0}, n=400, wake=1.1),  # 1.25 x the fitted 0.8, woken x1.1
            "b": _log({1: 1.5, 2: 1.5}, n=200, wake=1.1, model="b", seed=1)}
    moved = at_serving_rate(fitted, logs, catalog(None), "at the rate")
    assert moved.shifts["a"] == pytest.approx(1.25, rel=0.03)
    assert moved.shifts["b"] == pytest.approx(1.5, rel=0.03)
    rest = moved.calibration.fits["c"][0][1] / 1.5
    assert rest == pytest.approx((400 * 1.25 + 200 * 1.5) / 600, rel=0.03)
    assert moved.calibration.fits["c"][1][1] == pytest.approx(2.0 * rest)
    assert moved.calibration.factor("a", 1) == pytest.approx(1.0, rel=0.03)  # on the calls
    assert moved.calibration.factor("b", 2) == pytest.approx(1.5, rel=0.03)
    # b made no calls of 4 rows at the rate: the cascade's factor there, shifted as b's were
    assert dict(moved.calibration.fits["b"])[4] == pytest.approx(2.0 * moved.shifts["b"])
    assert moved.calibration.spread["c"] == (0.9, 1.1)
    assert len(moved.calibration.spread["a"]) == len(moved.calibration.spread["b"]) == \
        SPREAD_POINTS
    assert moved.calibration.calls == {"a": 400, "b": 200, "c": 30}
    assert moved.calibration.wake == 1.1
    assert "charge: a x1.2" in moved.calibration.source and "b x1." in moved.calibration.source
    assert "every other model moved x1.3" in moved.calibration.source
    few = at_serving_rate(fitted, {"a": logs["a"][:5]}, catalog(None), "few")
    assert few.calibration is fitted and few.shifts == {}
    # every model fitted there: none moved by the others' shift
    both = at_serving_rate(Calibration({m: fitted.fits[m] for m in "ab"}, wake=1.1), logs,
                           catalog(None), "both")
    assert "every other model" not in both.calibration.source
    # a model the first calibration did not fit is taken as its calls at the rate show it
    new = at_serving_rate(Calibration({"a": fitted.fits["a"]}, wake=1.1), logs,
                          catalog(None), "new")
    assert new.fitted == {"a", "b"} and set(new.shifts) == {"a"}
    assert new.calibration.factor("b", 1) == pytest.approx(1.5, rel=0.03)


def test_calibration_calls_move_the_models_asked_and_say_what_they_could_not_fit() -> None:
    """``CalibrationCalls.moved``: by default every model served at the rate; one with too
    few calls there, and one the cascade fitted but the rate part did not serve, move by the
    others' shift, each with a note; a subset moves by its own calls; a model not served
    there is an error."""
    import fakes

    from ken.engine.calibrate import CalibrationCalls, cheapest_only

    fitted = Calibration({"a": ((1, 0.8),), "b": ((1, 1.0),), "c": ((1, 2.0),)},
                         {"a": 40, "b": 40, "c": 30}, "cascade", wake=1.1)
    calls = CalibrationCalls(fitted, {"a": tuple(_log({1: 1.0}, n=200, wake=1.1)),
                                      "b": tuple(_log({1: 1.5}, n=5, wake=1.1, model="b"))},
                             {"a": "200 rows of a", "b": "5 rows of b"}, catalog(None))
    said = fakes.Warnings()
    cal = calls.moved(reporter=said)
    assert cal.factor("a", 1) == pytest.approx(1.0, rel=0.03)  # 1.25 x the cascade's 0.8
    assert cal.factor("b", 1) == pytest.approx(1.25, rel=0.03)  # a's shift: too few of b
    assert cal.factor("c", 1) == pytest.approx(2.5, rel=0.03)  # not served there: a's shift
    assert any("too few calls of b at the serving rate" in n and "moved x1.2" in n
               for n in said.notes), said.notes
    assert any(n.startswith("c not served alone at the serving rate") for n in said.notes)
    quiet = fakes.Warnings()
    assert calls.moved(["a"], reporter=quiet).fits == cal.fits and not quiet.notes
    assert calls.moved([]) is fitted
    assert cheapest_only(calls).fits == calls.moved(["a"]).fits  # "a" was served first
    with pytest.raises(KenError, match="not served at the serving rate: c"):
        calls.moved(["c"])


def test_measure_calibration_at_a_rate_serves_each_model_alone_at_it() -> None:
    """With ``rate`` the calibration also serves each model alone at that rate, capped at 0.8
    of its capacity (fake models that sleep twice their profile: the same level either way),
    and says so."""

    import fakes

    from ken.engine.calibrate import measure_calibration
    from ken.models.datasets import LabelledSample
    from ken.optimizer.workload import Hardware

    rows = 40
    sample = LabelledSample("t", tuple(f"row {i}" for i in range(rows)), np.arange(rows) % 3,
                            fakes.LABELS)
    cat, loaders = _sleeping_models(rows, {"a": 0.004, "b": 0.008})
    hardware = Hardware.cpu_workers(2, 2**30)
    said = fakes.Warnings()
    cal = measure_calibration(cat, loaders, sample, hardware, seconds=3.0, rate=250.0,
                              workers="thread", reporter=said)
    assert "a at 250.0/s" in cal.source, cal.source
    # b's capacity (a 9-ms row on each worker): 0.8 of it is under 250 rows/s
    b_rate = re.search(r"rows of b at ([0-9.]+)/s", cal.source)
    assert b_rate and float(b_rate.group(1)) < 250.0, cal.source
    assert "fitted on those calls" in cal.source, cal.source
    for m in ("a", "b"):  # each model alone, at most 0.8 of its capacity
        assert any("at the serving rate" in n and f"through {m} " in n for n in said.notes)
    for m in ("a", "b"):  # (thread workers: a busy machine can slow the sleeps' wake-ups)
        assert 1.6 < cal.factor(m, 1) < 3.5, cal.describe()
    slow = measure_calibration(cat, loaders, sample, hardware, seconds=2.0, rate=1.0,
                               workers="thread")
    assert "serving rate" not in slow.source  # 1 row/s: the cascade's rows are faster
    with pytest.raises(KenError, match="serving rate must be > 0"):
        measure_calibration(cat, loaders, sample, hardware, rate=0.0)


def test_a_busy_machine_is_measured_again_and_the_quietest_fit_kept() -> None:
    """Other programs' cores, as a fake ``OtherLoad`` reports them per attempt: calibration
    measures again while they are at ``BUSY_CORES`` or more, keeps the fit measured beside
    the least of them, and warns only when every attempt was busy."""
    import functools

    import fakes

    from ken.engine.calibrate import measure_calibration
    from ken.machine import BUSY_CORES
    from ken.models.datasets import LabelledSample
    from ken.optimizer.workload import Hardware

    rows = 20
    sample = LabelledSample("t", tuple(f"row {i}" for i in range(rows)), np.arange(rows) % 3,
                            fakes.LABELS)
    perf = {"a": ModelPerf("a", (1, 8), ((0.003, 0.006),), (1000,))}
    cat = Catalog(perf, {"a": np.ones(rows)}, {"a": np.full((rows, 3), 1 / 3)}, "t")
    loaders = {"a": functools.partial(fakes.SlowModel, "a", 0.003, 0.001)}

    said = fakes.Warnings()
    quiet_at_last = [BUSY_CORES + 0.6, BUSY_CORES + 0.1, 0.05]
    cal = measure_calibration(cat, loaders, sample, Hardware.cpu_workers(1, 2**30),
                              seconds=1.0, workers="thread", reporter=said,
                              other_load=fakes.fake_loads(quiet_at_last))
    assert cal.other_cores == 0.05 and "attempt 3" in cal.source
    assert said.warnings == []

    said = fakes.Warnings()
    busy = [BUSY_CORES + 0.5, BUSY_CORES + 0.2, BUSY_CORES + 0.7]
    cal = measure_calibration(cat, loaders, sample, Hardware.cpu_workers(1, 2**30),
                              seconds=1.0, workers="thread", reporter=said,
                              other_load=fakes.fake_loads(busy))
    assert cal.other_cores == busy[1] and "attempt 2" in cal.source
    assert len(said.warnings) == 1 and "least of 3 attempts" in said.warnings[0]

    quiet = measure_calibration(cat, loaders, sample, Hardware.cpu_workers(1, 2**30),
                                seconds=1.0, workers="thread",
                                other_load=fakes.fake_loads([0.0]))  # one attempt, nothing more
    assert quiet.other_cores == 0.0 and "attempt" not in quiet.source


def test_a_worker_reports_its_batch_largest_row_as_its_model_counts_sizes() -> None:
    """What the engine logs as a batch's largest row (``BatchRecord.largest``) is in the
    unit of the model's own sizes, which its profile and the simulator use: characters by
    default, the model's ``row_sizes`` where it counts otherwise, and the sizes its output
    carries where it gives them (a classifier on a transformers body: the tokens it ran)."""
    from dataclasses import replace

    from fakes import FakeModel

    from ken.engine.workers import ThreadRunner

    class Words(FakeModel):
        def row_sizes(self, rows: list) -> np.ndarray:
            return np.array([len(r.split()) for r in rows])

    class Given(Words):
        def predict(self, texts: list, batch_size: int = 32) -> object:
            return replace(super().predict(texts, batch_size), row_sizes=np.full(len(texts), 7))

    texts = ["a b c", "one two three four", "xxxxxxxxxxxxxxxxxxxxxxxx"]
    runner = ThreadRunner("cpu0", {m.name: m for m in (FakeModel("chars"), Words("words"),
                                                       Given("given"))})
    try:
        assert runner.run("chars", texts)[2] == 24
        assert runner.run("words", texts)[2] == 4
        assert runner.run("given", texts)[2] == 7
    finally:
        runner.close()
