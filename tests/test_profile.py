"""Profiles: measurement with a stand-in model, interpolation, storage and the cache."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pytest
from fakes import LABELS, FakeModel

from ken import store
from ken.errors import ProfileError, StoreError
from ken.models.datasets import LabelledSample, split
from ken.models.model import DeviceConfig, Model, ModelSpec, Output
from ken.models.quality import EvalSample
from ken.optimizer.profile import (
    SCHEMA_VERSION,
    Profile,
    load_or_run_profile,
    profile_dir,
    profile_entry,
    run_profile,
)


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
    assert p.values == tuple(expected.label_strings())
    assert p.metric == "accuracy" and p.label_names == LABELS
    assert p.quality.dtype == np.float64
    assert p.quality.tolist() == (expected.labels == s.labels).astype(float).tolist()
    assert p.scores.dtype == np.float32 and p.scores.shape == (len(s), len(LABELS))
    assert np.array_equal(p.scores, expected.probabilities)
    assert np.array_equal(p.certainty("margin"), expected.certainty("margin"))
    assert p.accuracy == pytest.approx(float((expected.labels == s.labels).mean()))
    p.save(tmp_path / "p")
    q = Profile.load(tmp_path / "p")
    assert q.header() == p.header()
    assert np.array_equal(q.scores, p.scores) and q.scores.dtype == np.float32
    assert np.array_equal(q.quality, p.quality)
    assert q.values == p.values and q.metric == p.metric


class Counting(FakeModel):
    """A FakeModel that counts the rows it answers."""

    rows = 0

    def predict(self, texts, batch_size: int = 32):  # noqa: ANN001, ANN201
        self.rows += len(texts)
        return super().predict(texts, batch_size)


def test_profile_keeps_the_answers_of_timed_rows() -> None:
    model = Counting("a")
    s = sample(200)
    # times 32 + 32 + 32 distinct rows, once (not again on a busy machine)
    p = run_profile(model, s, (1, 4, 16), repeats=2, attempts=1)
    expected = model.predict(list(s.texts))
    assert p.values == tuple(expected.label_strings())
    assert np.array_equal(p.scores, expected.probabilities)
    # warm-up 8 + 96 timed + the 104 rows the timing did not reach (+ the 200 just above)
    assert model.rows == 8 + 96 + 104 + 200


class ShortAnswers(Model):
    """A stand-in extractive model: answers the first word of the text, or None for empty
    texts; its certainty is 1 / (number of words)."""

    def __init__(self) -> None:
        self.spec = ModelSpec("short", "fake", "fake", "", 10, 40, 16, (), "fp-short")
        self.device = DeviceConfig()

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Output:
        words = [t.split() for t in texts]
        return Output([w[0] if w else None for w in words],
                      np.array([1.0 / len(w) if w else 0.0 for w in words]))


def test_profile_of_any_output_type(tmp_path) -> None:
    sample = EvalSample("qa", ("paris is big", "the Louvre", "", "rome"),
                        ("Paris", "Louvre", "x", ["Rome", "roma"]), "exact_match")
    p = run_profile(ShortAnswers(), sample, (1, 2), repeats=1)
    assert p.values == ("paris", "the", None, "rome")
    assert p.quality.tolist() == [1.0, 0.0, 0.0, 1.0]  # articles are not answers
    assert p.accuracy == 0.5 and p.metric == "exact_match" and p.label_names == ()
    assert p.scores.ndim == 1 and p.scores.tolist() == pytest.approx([1 / 3, 0.5, 0.0, 1.0])
    for kind in ("max_prob", "margin"):  # the model's own certainty, whatever the function
        assert p.certainty(kind).tolist() == p.scores.tolist()
    assert p.sample_hash == sample.content_hash
    p.save(tmp_path / "p")
    q = Profile.load(tmp_path / "p")
    assert q.header() == p.header() and q.header()["metric"] == "exact_match"
    assert np.array_equal(q.scores, p.scores) and q.scores.ndim == 1
    assert np.array_equal(q.quality, p.quality) and q.values == p.values


def test_profile_of_a_classifier_on_an_eval_sample() -> None:
    model = FakeModel("a")
    s = sample(30)
    p = run_profile(model, s.as_eval(), (1, 2), repeats=1)
    q = run_profile(model, s, (1, 2), repeats=1)
    assert p.values == q.values and np.array_equal(p.quality, q.quality)
    assert np.array_equal(p.scores, q.scores) and p.label_names == q.label_names
    # the same rows in either form are the same sample: their profiles combine in cascades
    assert p.sample_hash == q.sample_hash
    bad = EvalSample("s", s.texts, ("nope",) * len(s), "accuracy")
    with pytest.raises(ProfileError, match="references"):
        run_profile(model, bad, (1,), repeats=1)


def test_profile_checks_lengths_and_schema(tmp_path) -> None:
    with pytest.raises(ProfileError, match="differ in length"):
        Profile("m", "x", (1,), (0.1,), 1, 1, (), "s", "h", "f", np.ones(3), np.ones(2))
    with pytest.raises(ProfileError, match="differ in length"):
        Profile("m", "x", (1,), (0.1,), 1, 1, (), "s", "h", "f", np.ones(3), np.ones(3),
                ("a", "b"))
    p = run_profile(FakeModel("a"), sample(8), (1,), repeats=1)
    folder = p.save(tmp_path / "p")
    header = json.loads((folder / "header.json").read_text())
    header["schema_version"] = SCHEMA_VERSION - 1
    (folder / "header.json").write_text(json.dumps(header))
    with pytest.raises(StoreError, match="header.json has .* bytes, ken wrote"):
        Profile.load(folder)  # an edited file no longer matches its manifest
    store.seal(profile_entry(folder))  # as if another version of ken had written it
    with pytest.raises(ProfileError, match="schema version"):
        Profile.load(folder)


def test_interpolation_and_best_batch() -> None:
    s = sample(4)
    p = Profile("m", "cpu-1t", (1, 2, 4), (0.010, 0.012, 0.040), 1, 1, LABELS, "s", "h", "f",
                np.ones(4), np.eye(3)[s.labels].astype(np.float32))
    assert p.batch_runtime(1) == pytest.approx(0.010)
    assert p.batch_runtime(3) == pytest.approx(0.026)
    assert p.batch_runtime(8) == pytest.approx(0.080)  # per-row cost of the largest batch
    assert p.ms_per_row(2) == pytest.approx(6.0)
    assert p.best_batch_size() == 2
    with pytest.raises(ProfileError):
        Profile("m", "x", (2, 1), (0.1, 0.1), 1, 1, LABELS, "s", "h", "f",
                np.ones(4), np.eye(3)[s.labels])


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


def test_runtimes_timed_on_a_busy_machine_are_timed_again_and_the_quietest_kept(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While other programs keep ``BUSY_CORES`` or more busy the runtimes are timed again;
    those timed beside the least other load are kept with that load (stored in the header,
    read back; a profile from before has None), and a warning says when every attempt was
    busy. The answers are the model's either way."""
    from fakes import Warnings, fake_loads

    from ken.machine import BUSY_CORES
    from ken.optimizer import profile as profiling

    timed = []
    real = profiling.measure_batch_runtimes

    def measure(model, texts, sizes, repeats, on_step, answers, single):  # noqa: ANN001, ANN202
        timed.append(on_step)
        real(model, texts, sizes, repeats, on_step, answers, single)
        return [float(len(timed))] * len(sizes), 0  # each attempt's runtimes differ

    monkeypatch.setattr(profiling, "measure_batch_runtimes", measure)
    steps: list[int] = []
    busy = [BUSY_CORES + 0.5, BUSY_CORES + 0.2, BUSY_CORES + 0.7]
    said = Warnings()
    model = FakeModel("a")
    p = run_profile(model, sample(), (1, 4), repeats=1, on_step=steps.append, reporter=said,
                    other_load=fake_loads(busy))
    assert len(timed) == 3 and timed[1:] == [None, None]  # progress is reported once
    assert steps == [1, 4, 0]
    assert p.batch_runtime_s == (2.0, 2.0) and p.other_cores == busy[1]
    assert len(said.warnings) == 1 and "timing a" in said.warnings[0]
    assert p.values == tuple(model.predict(list(sample().texts)).label_strings())
    assert Profile.load(p.save(tmp_path / "p")).other_cores == busy[1]

    timed.clear()
    said = Warnings()
    q = run_profile(model, sample(), (1, 4), repeats=1, reporter=said,
                    other_load=fake_loads([BUSY_CORES + 1.0, 0.01]))
    assert len(timed) == 2 and q.batch_runtime_s == (2.0, 2.0) and q.other_cores == 0.01
    assert said.warnings == []
    header = json.loads((q.save(tmp_path / "q") / "header.json").read_text())
    del header["other_cores"]  # a profile saved before the reading was kept
    (tmp_path / "q" / "header.json").write_text(json.dumps(header))
    store.seal(profile_entry(tmp_path / "q"))
    assert Profile.load(tmp_path / "q").other_cores is None
