"""sem_match: data parsing and threshold logic (fast), and the real record matchers.

The matchers are trained once per module in a temporary KEN_HOME on a subset of Abt-Buy's
training pairs (validation and test splits in full). Tests that need the entity-matching data
skip when ``../shared/data/entity-matching`` is absent, as on a fresh clone; the fallback test
runs everywhere.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pytest

from ken.engine.batch import run_cascade
from ken.errors import DataError, ModelError, StoreError
from ken.models.model import DeviceConfig
from ken.models.records import parse_record
from ken.models.resources import Resources
from ken.ops.match_data import DATASET_ALL, has_data, load_pairs, schema, training_splits
from ken.ops.match_training import (
    MatchCard,
    MatchScores,
    cascade_labels,
    choose_threshold,
    load_card,
    load_matcher,
    match_dir,
    prepare_sem_match,
    train_matchers,
)
from ken.ops.sem_match import FALLBACK_OFFSET
from ken.ops.sem_match import bind_sem_match as bind
from ken.paths import shared_data_dir

DATASET = "Abt-Buy"
NUM_TRAIN = 800
SMALL = "abt-buy-subset"  # the matchers the tests train, cached under this name
DEVICE = DeviceConfig(threads=1)  # one thread: tolerant of other work on a 2-core machine
needs_data = pytest.mark.skipif(
    not has_data(DATASET),
    reason=f"entity-matching data not found at {shared_data_dir() / 'entity-matching'} "
           "(set KEN_DATA_DIR to the folder holding entity-matching/Abt-Buy)")


# ----------------------------------------------------------------- no models


def test_parse_record_keeps_attribute_order_and_empty_values() -> None:
    record = parse_record("COL name VAL sony bravia kdl-40 COL description VAL  COL price VAL 10")
    assert list(record) == ["name", "description", "price"]
    assert record == {"name": "sony bravia kdl-40", "description": "", "price": "10"}
    with pytest.raises(DataError, match="serialized entity"):
        parse_record("just text")


def test_load_pairs_reads_the_format(tmp_path) -> None:
    folder = tmp_path / "entity-matching" / "Tiny"
    folder.mkdir(parents=True)
    line = "COL title VAL a b COL year VAL 1\tCOL title VAL a c COL year VAL 2\t{}\n"
    for split in ("train", "valid", "test"):
        (folder / f"{split}.txt").write_text(line.format(1) + line.format(0))
    pairs = load_pairs("Tiny", "valid", tmp_path)
    assert pairs.left == ("COL title VAL a b COL year VAL 1",) * 2
    assert pairs.labels.tolist() == [1, 0]
    assert load_pairs("Tiny", "valid", tmp_path, attribute="first").right == ("a c", "a c")
    assert load_pairs("Tiny", "test", tmp_path, attribute="year").left == ("1", "1")
    with pytest.raises(DataError, match="no attribute 'price'"):
        load_pairs("Tiny", "test", tmp_path, attribute="price")
    (folder / "test.txt").write_text("broken line\n")
    with pytest.raises(DataError, match="TAB"):
        load_pairs("Tiny", "test", tmp_path)
    (folder / "test.txt").write_text("no record\tCOL a VAL b\t1\n")
    with pytest.raises(DataError, match="serialized entity"):
        load_pairs("Tiny", "test", tmp_path)
    with pytest.raises(DataError, match="not found"):
        load_pairs("Missing", "test", tmp_path)
    with pytest.raises(DataError, match="no entity-matching data sets"):
        load_pairs(DATASET_ALL, "test", tmp_path)


def test_training_splits_cap_pairs_per_data_set(tmp_path) -> None:
    for name, n in (("Beer", 30), ("Fodors-Zagats", 6)):
        folder = tmp_path / "entity-matching" / name
        folder.mkdir(parents=True)
        rows = "".join(f"COL n VAL x{i}\tCOL n VAL y{i}\t{i % 2}\n" for i in range(n))
        for split in ("train", "valid", "test"):
            (folder / f"{split}.txt").write_text(rows)
    splits = training_splits(DATASET_ALL, tmp_path, per_dataset=10)
    assert [len(splits[s]) for s in ("train", "valid", "test")] == [16, 10, 10]
    assert len(training_splits("Beer", tmp_path, per_dataset=10)["test"]) == 30


def test_schema_compares_attributes_only_when_records_share_them() -> None:
    assert schema([{"a": "1", "b": ""}, {"a": "2", "b": "x"}]) == ("a", "b")
    assert schema([{"a": "1"}, {"b": "2"}]) == ()
    assert schema([{"text": "plain"}]) == ()


def brute_force_threshold(cheap, strong, truth, tolerance):
    """Try every candidate threshold; keep the one escalating fewest rows within tolerance."""
    sure = cheap.max(axis=1)
    values = np.unique(sure)
    candidates = [0.0, *((values[:-1] + values[1:]) / 2), float(np.nextafter(values[-1], 2))]
    goal = MatchScores.of(strong.argmax(axis=1), truth).f1 - tolerance
    best = None
    for t in candidates:
        f1 = MatchScores.of(cascade_labels(cheap, strong, t), truth).f1
        rate = (sure < t).mean()
        if f1 >= goal - 1e-12 and (best is None or rate < best[0]):
            best = (rate, t)
    return best[1]


def test_choose_threshold_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    for trial in range(30):
        n = int(rng.integers(5, 40))
        truth = rng.integers(0, 2, n)
        p_cheap = np.round(rng.random(n), 1)  # coarse: many ties
        cheap = np.stack([1 - p_cheap, p_cheap], axis=1)
        p_strong = np.clip(truth * 0.7 + rng.random(n) * 0.5, 0, 1)
        strong = np.stack([1 - p_strong, p_strong], axis=1)
        tol = [0.0, 0.005, 0.05][trial % 3]
        got = choose_threshold(cheap, strong, truth, tol)
        want = brute_force_threshold(cheap, strong, truth, tol)
        assert (cheap.max(axis=1) < got).mean() == (cheap.max(axis=1) < want).mean()
        f1 = MatchScores.of(cascade_labels(cheap, strong, got), truth).f1
        assert f1 >= MatchScores.of(strong.argmax(axis=1), truth).f1 - tol - 1e-12


def test_match_scores() -> None:
    s = MatchScores.of(np.array([1, 1, 0, 0]), np.array([1, 0, 1, 0]))
    assert (s.accuracy, s.precision, s.recall, s.f1) == (0.5, 0.5, 0.5, 0.5)
    assert MatchScores.of(np.zeros(3), np.zeros(3)).f1 == 0.0


# ----------------------------------------------------------------- real models


@pytest.fixture(scope="module")
def resources(tmp_path_factory):
    path = tmp_path_factory.mktemp("ken_home_match")
    mp = pytest.MonkeyPatch()
    mp.setenv("KEN_HOME", str(path))
    yield Resources(DEVICE, home=path)
    mp.undo()


@pytest.fixture(scope="module")
def splits() -> dict:
    """800 Abt-Buy training pairs, 400 to choose thresholds on, 400 to test (seconds, not the
    minutes of the whole splits: Abt-Buy's long descriptions make embedding the slow part)."""
    if not has_data(DATASET):
        pytest.skip(f"entity-matching data not found at {shared_data_dir()}")
    whole = training_splits(DATASET, per_dataset=NUM_TRAIN)
    return {s: p.sample(NUM_TRAIN // 2, seed=1) if s != "train" else p
            for s, p in whole.items()}


@pytest.fixture(scope="module")
def card(resources, splits) -> MatchCard:
    return train_matchers(resources, SMALL, splits, "test-subset", match_dir(SMALL,
                                                                            resources.home))


@pytest.fixture(scope="module")
def bound(resources, card):
    return bind(resources, SMALL)  # no files for SMALL: the trained card is reused


@pytest.mark.models
@needs_data
def test_obvious_matches_and_non_matches(bound) -> None:
    left = ["sony bravia kdl-40v3000 40 ' lcd tv", "apple ipod nano 8gb silver mb598ll/a",
            "garmin nuvi 200w 4.3 ' portable gps", "samsung 52 ' lcd tv ln52a650",
            "bose quietcomfort 3 headphones", None, "garmin nuvi 200w gps"]
    right = ["sony bravia 40 ' lcd hdtv kdl-40v3000", "sony bravia kdl-40v3000 40 ' lcd tv",
             "garmin nuvi 200w gps navigator", "panasonic 50 ' plasma tv th-50pz800u",
             "bose quietcomfort 3 acoustic noise cancelling headphones", "anything", None]
    as_json = [[None if t is None else json.dumps({"name": t, "description": "", "price": ""})
                for t in side] for side in (left, right)]
    for columns in ((left, right), as_json):  # plain names, and records as SQL passes them
        result = run_cascade(bound.cascade, bound.models,
                             [pa.array(columns[0]), pa.array(columns[1])], batch_size=4)
        assert bound.to_sql_values(result.values) == [True, False, True, False, True, None,
                                                      None]
    assert bound.calibrated and bound.describe().startswith(f"sem_match: match-lex[{SMALL}]")


@pytest.mark.models
@needs_data
def test_matchers_are_symmetric(bound) -> None:
    pairs = [("COL name VAL samsung 52 ' lcd tv ln52a650 COL description VAL lcd COL price VAL 9",
              "COL name VAL ln52a650 samsung lcd television COL description VAL  COL price VAL "),
             ("logitech mx revolution mouse", "bose quietcomfort 3 headphones"), ("", "x")]
    for model in bound.models.values():
        forward = model.predict(pairs).probabilities
        backward = model.predict([(b, a) for a, b in pairs]).probabilities
        np.testing.assert_allclose(forward, backward, atol=1e-6)
        assert model.spec.num_inputs == 2


@pytest.mark.models
@needs_data
def test_card_test_f1_is_reproducible_from_the_saved_matchers(resources, card, splits) -> None:
    assert card.num_train == NUM_TRAIN and card.attributes == ("name", "description", "price")
    test = splits["test"]
    for member in card.members:
        model = load_matcher(resources, member.member, SMALL)
        pred = model.predict(test.pairs, batch_size=32).labels
        scores = MatchScores.of(pred, test.labels)
        assert scores.f1 == pytest.approx(member.test.f1, abs=1e-9)
        assert member.test.f1 > 0.6  # far above the ~0.2 of guessing at the 11% base rate
    assert load_card(resources, SMALL) == card  # JSON round trip
    assert prepare_sem_match(resources, SMALL) == card  # cached


@pytest.mark.models
@needs_data
@pytest.mark.models
@needs_data
def test_cascade_over_the_test_split_matches_the_card(bound, card, splits) -> None:
    test = splits["test"]
    result = run_cascade(bound.cascade, bound.models,
                         [pa.array(test.left), pa.array(test.right)], batch_size=32)
    predicted = np.array([1 if v == "true" else 0 for v in result.values])
    scores = MatchScores.of(predicted, test.labels)
    assert scores.f1 == pytest.approx(card.cascade_test.f1, abs=1e-9)
    escalated = result.stages[1].input_rows / len(test)
    assert escalated == pytest.approx(card.escalation_test, abs=1e-9)


@pytest.mark.models
@needs_data
def test_a_changed_trees_file_is_refused(resources, card) -> None:
    path = match_dir(SMALL, resources.home) / card.members[0].trees_file
    saved = path.read_bytes()
    try:
        path.write_bytes(saved[:-10])
        with pytest.raises(StoreError, match=f"{re.escape(str(path))} has .* bytes, ken wrote"):
            load_matcher(resources, "lexical", SMALL)
        flipped = bytearray(saved)
        flipped[len(saved) // 2] ^= 1
        path.write_bytes(bytes(flipped))
        with pytest.raises(StoreError, match="differs from what ken wrote"):
            load_matcher(resources, "lexical", SMALL)
    finally:
        path.write_bytes(saved)


@pytest.mark.models
def test_fallback_without_data_never_fails(resources, tmp_path) -> None:
    bound = bind(resources, "NoSuchDataset", data_dir=tmp_path)
    assert not bound.calibrated and "uncalibrated" in bound.describe()
    assert f"cos > {FALLBACK_OFFSET:g}" in bound.describe()
    result = run_cascade(bound.cascade, bound.models,
                         [pa.array(["apple ipod nano 8gb", None, '"red wine"']),
                          pa.array(['{"name": "apple ipod nano 8 gb"}', "x",
                                    "quantum physics lecture"])])
    assert bound.to_sql_values(result.values) == [True, None, False]
    with pytest.raises(ModelError, match="unknown sem_match model"):
        bind(resources, "NoSuchDataset", data_dir=tmp_path, single="gpt")
