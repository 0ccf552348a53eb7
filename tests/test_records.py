"""Record parsing, similarity features, boosted trees and F1 thresholds (no models needed)."""

from __future__ import annotations

import numpy as np
import pytest

from ken.errors import DataError, ModelError
from ken.models.records import (
    PLAIN,
    SIMILARITIES,
    BoostedTrees,
    RecordFeaturizer,
    RecordMatcher,
    as_record,
    best_f1_threshold,
    f1_score,
    similarities,
)


def test_as_record_reads_every_form() -> None:
    assert as_record("COL name VAL sony tv COL price VAL 10") == {"name": "sony tv",
                                                                 "price": "10"}
    assert as_record('{"name": "sony tv", "price": 10, "d": null}') == {
        "name": "sony tv", "price": "10", "d": ""}
    assert as_record('"sony tv"') == {PLAIN: "sony tv"}  # a text column passed as JSON
    assert as_record("sony tv") == {PLAIN: "sony tv"}
    assert as_record("{not json") == {PLAIN: "{not json"}
    assert as_record({"a": 1, "b": None}) == {"a": "1", "b": ""}
    assert as_record(None) == {PLAIN: ""}
    # row identifiers differ between tables: left out, unless they are all there is
    assert as_record('{"id": 7, "name": "tv", "buy_id": 3, "idea": "x"}') == {"name": "tv",
                                                                             "idea": "x"}
    assert as_record({"id": 7}) == {"id": "7"}


def test_similarities_of_model_numbers_and_empty_values() -> None:
    idf = RecordFeaturizer.fit([{"n": "lg lds4821ww dishwasher"}, {"n": "sony tv"}]).idf["*"]
    same = dict(zip(SIMILARITIES, similarities("LG LDS4821WW dishwasher",
                                               "lds4821ww white dishwasher", idf), strict=True))
    assert same["shares_code"] == 1.0 and same["word_jaccard"] == pytest.approx(2 / 4)
    assert same["exact"] == 0.0 and 0 < same["idf_cosine"] < 1
    empty = dict(zip(SIMILARITIES, similarities("", "x", idf), strict=True))
    assert empty["one_empty"] == 1.0 and empty["both_empty"] == 0.0
    assert similarities("a 10", "a 12", idf)[SIMILARITIES.index("number_difference")] == \
        pytest.approx(2 / 12)


def test_features_are_symmetric_and_json_round_trips() -> None:
    records = [{"name": "sony bravia kdl-40", "price": "999"},
               {"name": "bravia 40 sony", "price": "979.5"}, {"name": "ipod", "price": ""}]
    f = RecordFeaturizer.fit(records, ("name", "price"))
    pairs = [(records[0], records[1]), (records[1], records[2])]
    forward = f.features(pairs)
    assert forward.shape == (2, len(f.names))
    np.testing.assert_allclose(forward, f.features([(b, a) for a, b in pairs]))
    again = RecordFeaturizer.from_json(f.to_json())
    np.testing.assert_allclose(again.features(pairs), forward)
    # a record without the featurizer's attributes compares through its first value and whole
    generic = RecordFeaturizer.fit(records)
    assert generic.slots == ("^", "*")


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.random((n, 4))
    x[rng.random((n, 4)) < 0.05] = np.nan
    y = ((np.nan_to_num(x[:, 0]) + 0.5 * np.nan_to_num(x[:, 1]) + 0.2 * rng.random(n)) > 0.9)
    return x, y.astype(int)


def test_boosted_trees_predict_like_scikit_learn(tmp_path) -> None:
    from sklearn.ensemble import HistGradientBoostingClassifier

    x, y = _data(400, 0)
    test, _ = _data(200, 1)
    clf = HistGradientBoostingClassifier(max_iter=40, random_state=0, early_stopping=False)
    clf.fit(x, y)
    trees = BoostedTrees.from_sklearn(clf)
    np.testing.assert_allclose(trees.raw(test), clf.decision_function(test), atol=1e-9)
    trees.save(tmp_path / "t.npz")
    np.testing.assert_allclose(BoostedTrees.load(tmp_path / "t.npz").raw(test), trees.raw(test))
    (tmp_path / "bad.npz").write_bytes(b"not an archive")
    with pytest.raises(ModelError, match="cannot read"):
        BoostedTrees.load(tmp_path / "bad.npz")
    with pytest.raises(DataError, match="both matching and non-matching"):
        BoostedTrees.fit(x, np.zeros(len(x), dtype=int))


def test_best_f1_threshold_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(5, 60))
        truth = rng.integers(0, 2, n)
        truth[0] = 1
        p = np.round(np.clip(truth * 0.4 + rng.random(n) * 0.6, 0, 1), 2)
        cut, score = best_f1_threshold(p, truth)
        brute = max(f1_score(p > c, truth) for c in np.concatenate([p, [0.0]]))
        assert score == pytest.approx(brute) and f1_score(p > cut, truth) == pytest.approx(brute)


def test_matcher_says_match_above_its_threshold() -> None:
    brands = ["sony", "lg", "garmin", "apple", "bose", "canon", "nikon", "dell"]
    products = [f"{b} {kind} {b[:2]}{100 + 7 * i}x" for i, b in enumerate(brands)
                for kind in ("tv", "camera")]
    variants = [(i, {"n": text}) for i, p in enumerate(products)
                for text in (p, " ".join(reversed(p.split())))]
    f = RecordFeaturizer.fit([r for _, r in variants], ("n",))
    pairs = [(a, b) for _, a in variants for _, b in variants]
    truth = np.array([int(i == j) for i, _ in variants for j, _ in variants])
    trees = BoostedTrees.fit(f.features(pairs), truth, max_iter=30)
    p = 1 / (1 + np.exp(-trees.raw(f.features(pairs))))
    cut, score = best_f1_threshold(p, truth)
    model = RecordMatcher("m", f, trees, cut)
    pred = model.predict([("COL n VAL sony tv so100x", '{"n": "so100x tv sony"}'),
                          ("garmin camera ga121x", "apple tv ap128x")])
    assert pred.labels.tolist() == [1, 0] and score > 0.9
    with pytest.raises(ModelError, match="threshold"):
        RecordMatcher("m", f, trees, 1.0)
    with pytest.raises(DataError, match="pairs of records"):
        model.predict(["just one text"])
