"""Profiles: measurement with a stand-in model, interpolation, storage and the cache."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import LABELS, FakeModel

from ken.errors import ProfileError
from ken.models.datasets import LabelledSample, split
from ken.optimizer.profile import Profile, load_or_run_profile, profile_dir, run_profile


def sample(n: int = 50) -> LabelledSample:
    rng = np.random.default_rng(0)
    return LabelledSample("s", tuple(f"text {i}" for i in range(n)),
                          rng.integers(0, 3, n), LABELS)


def test_profile_measures_and_round_trips(tmp_path) -> None:
    model = FakeModel("a")
    s = sample()
    p = run_profile(model, s, (1, 4, 16), repeats=2)
    assert p.batch_sizes == (1, 4, 16) and all(t > 0 for t in p.batch_runtime_s)
    expected = model.predict(list(s.texts))
    assert np.array_equal(p.predictions, expected.labels)
    assert p.accuracy == pytest.approx(float((expected.labels == s.labels).mean()))
    p.save(tmp_path / "p")
    q = Profile.load(tmp_path / "p")
    assert q.header() == p.header()
    assert np.array_equal(q.probabilities, p.probabilities)
    assert np.array_equal(q.true_labels, p.true_labels)


def test_interpolation_and_best_batch() -> None:
    s = sample(4)
    p = Profile("m", "cpu-1t", (1, 2, 4), (0.010, 0.012, 0.040), 1, 1, LABELS, "s", "h", "f",
                s.labels, s.labels, np.eye(3)[s.labels].astype(np.float32))
    assert p.batch_runtime(1) == pytest.approx(0.010)
    assert p.batch_runtime(3) == pytest.approx(0.026)
    assert p.batch_runtime(8) == pytest.approx(0.080)  # per-row cost of the largest batch
    assert p.ms_per_row(2) == pytest.approx(6.0)
    assert p.best_batch_size() == 2
    with pytest.raises(ProfileError):
        Profile("m", "x", (2, 1), (0.1, 0.1), 1, 1, LABELS, "s", "h", "f",
                s.labels, s.labels, np.eye(3)[s.labels])


def test_cache_reuses_and_keys_on_data(tmp_path) -> None:
    model = FakeModel("a")
    first = load_or_run_profile(model, sample(), (1, 2), home=tmp_path, repeats=1)
    calls = len(model.calls)
    again = load_or_run_profile(model, sample(), (1, 2), home=tmp_path, repeats=1)
    assert len(model.calls) == calls  # served from disk, the model never ran
    assert again.batch_runtime_s == first.batch_runtime_s
    other = sample(49)
    assert profile_dir(model, other, (1, 2), tmp_path) != profile_dir(model, sample(), (1, 2),
                                                                       tmp_path)


def test_label_mismatch_and_missing(tmp_path) -> None:
    model = FakeModel("a", ("neg", "pos"))
    with pytest.raises(ProfileError, match="labelled"):
        run_profile(model, sample(), (1,))
    with pytest.raises(ProfileError, match="ken profile"):
        Profile.load(tmp_path / "nothing")


def test_split_is_disjoint_and_deterministic() -> None:
    s = sample(100)
    train, test = split(s, 60, 30)
    assert not set(train.texts) & set(test.texts)
    assert split(s, 60, 30)[1].texts == test.texts
