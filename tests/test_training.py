"""Training operators on a user's labels: session.train, the TRAIN statement, errors, caching."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ken
from ken.errors import DataError, KenError
from ken.models.model import DeviceConfig
from ken.models.records import parse_record
from ken.ops.match_data import load_pairs
from ken.ops.training import TrainingData, cascade_values
from ken.paths import shared_data_dir
from ken.sql.rewrite import SqlError
from ken.sql.train import parse_train

POSITIVE = ["a wonderful, moving film", "I loved every minute of it", "great acting, great story",
            "a delight from start to finish", "beautifully made and very funny",
            "the best thing I have seen this year", "warm, clever and charming",
            "an absolute joy", "brilliant, I would watch it again", "superb and touching",
            "what a lovely surprise", "fantastic soundtrack and a great cast"]
NEGATIVE = ["a dull, lifeless film", "I hated every minute of it", "terrible acting, no story",
            "a chore from start to finish", "badly made and never funny",
            "the worst thing I have seen this year", "cold, stupid and boring",
            "an absolute mess", "awful, I walked out", "tedious and pointless",
            "what a waste of time", "horrible soundtrack and a weak cast"]


def reviews() -> pa.Table:
    return pa.table({"text": POSITIVE + NEGATIVE,
                     "liked": [True] * len(POSITIVE) + [False] * len(NEGATIVE)})


# ------------------------------------------------------------------------- data, no models

def test_training_data_reads_columns_and_hashes_values_only() -> None:
    data = TrainingData.from_arrow(reviews(), "liked", source="t1")
    assert data.columns == ("text",) and data.classes == ("false", "true")
    same = TrainingData.from_arrow(reviews(), "liked", source="elsewhere")
    assert same.content_hash == data.content_hash  # where rows come from is not in the key
    flipped = reviews().set_column(1, "liked", pa.array([False] + [True] * 11 + [False] * 12))
    assert TrainingData.from_arrow(flipped, "liked").content_hash != data.content_hash
    edited = reviews().set_column(0, "text", pa.array(["x"] + POSITIVE[1:] + NEGATIVE))
    assert TrainingData.from_arrow(edited, "liked").content_hash != data.content_hash
    assert data.booleans().sum() == len(POSITIVE)


def test_training_data_errors_are_clear() -> None:
    with pytest.raises(DataError, match="NULL label.*first: row 1"):
        TrainingData.from_arrow(pa.table({"t": ["a", "b"], "y": ["x", None]}), "y")
    with pytest.raises(DataError, match="NULL 't'"):
        TrainingData.from_arrow(pa.table({"t": ["a", None], "y": ["x", "z"]}), "y")
    with pytest.raises(DataError, match="only 'pos'.*at least 2 classes"):
        TrainingData.from_arrow(pa.table({"t": ["a", "b"], "y": ["pos", "pos"]}),
                                "y").need_classes()
    with pytest.raises(DataError, match="no row has a true label"):
        TrainingData.from_arrow(pa.table({"t": ["a", "b"], "y": [False, False]}),
                                "y").booleans()
    with pytest.raises(DataError, match="every row has a true label"):
        TrainingData.from_arrow(pa.table({"t": ["a", "b"], "y": [1, 1]}), "y").booleans()
    with pytest.raises(DataError, match="not a boolean"):
        TrainingData.from_arrow(pa.table({"t": ["a", "b"], "y": ["yes", "maybe"]}),
                                "y").booleans()
    with pytest.raises(DataError, match="no label column 'lable'.*Did you mean 'label'"):
        TrainingData.from_arrow(pa.table({"t": ["a"], "label": ["x"]}), "lable")
    with pytest.raises(DataError, match="no rows"):
        TrainingData.from_arrow(pa.table({"t": pa.array([], pa.string()),
                                          "y": pa.array([], pa.string())}), "y")


def test_split_is_stratified_disjoint_and_complete() -> None:
    data = TrainingData.from_arrow(reviews(), "liked")
    parts = data.split((0.7, 0.15, 0.15))
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(len(data)))
    truth = data.booleans()
    assert all(truth[p].any() and (~truth[p]).any() for p in parts)


def test_parse_train_statement() -> None:
    st, rest = parse_train("TRAIN sem_filter ON reviews LABEL liked USING text "
                           "FOR 'is it''s positive'")
    assert rest == ""
    assert (st.function, st.source, st.is_file, st.label, st.columns, st.predicate) == (
        "sem_filter", "reviews", False, "liked", ("text",), "is it's positive")
    st, rest = parse_train('train Sem_Match on \'pairs.parquet\' label "is match" '
                           'using a, "b c"; SELECT 1')
    assert rest.strip() == "SELECT 1"
    assert st.function == "sem_match" and st.is_file and st.source == "pairs.parquet"
    assert st.label == "is match" and st.columns == ("a", "b c")
    with pytest.raises(SqlError, match="TRAIN <function> ON"):
        parse_train("TRAIN sentiment reviews")


def test_untrainable_and_unknown_functions(tmp_path) -> None:
    with ken.connect(home=tmp_path) as session:
        session.register_table("r", reviews())
        with pytest.raises(KenError, match="sem_qa\\(\\) cannot be trained"):
            session.train("sem_qa", "r", "liked")
        with pytest.raises(KenError, match="Did you mean 'sentiment'"):
            session.train("sentimnet", "r", "liked")
        with pytest.raises(KenError, match="cannot read table nowhere"):
            session.train("sentiment", "nowhere", "liked")
        with pytest.raises(KenError, match="needs the predicate"):
            session.train("sem_filter", "r", "liked")


# ------------------------------------------------------------------------- real models

@pytest.mark.models
def test_sem_filter_trained_from_a_table_equals_from_a_file(home, tmp_path) -> None:
    """A table and a Parquet file with the same rows calibrate the same filter, once."""
    predicate = "expresses a positive opinion"
    path = tmp_path / "reviews.parquet"
    pq.write_table(reviews(), path)
    with ken.connect(home=home, device=DeviceConfig(threads=2)) as session:
        session.operators["sem_filter"].llm = None  # the similarity stage alone: fast
        session.register_table("r", reviews())
        from_table = session.train("sem_filter", "r", "liked", predicate=predicate)
        calibration_t = session.operators["sem_filter"].trained[predicate][0]
        assert "validation balanced accuracy" in from_table.quality
        assert "head on MiniLM-L6 embeddings" in from_table.quality
        plan = session.explain(f"SELECT sem_filter(text, '{predicate}') FROM r")
        assert "trained on r (24 rows" in plan and "uncalibrated" not in plan
        kept = {t for (t,) in session.sql(
            f"SELECT text FROM r WHERE sem_filter(text, '{predicate}')").fetchall()}
        if "serving the head" in from_table.quality:  # it learned its own training rows
            assert len(kept & set(POSITIVE)) > len(kept & set(NEGATIVE))
    with ken.connect(home=home, device=DeviceConfig(threads=2)) as session:
        session.operators["sem_filter"].llm = None
        row = session.sql(f"TRAIN sem_filter ON '{path}' LABEL liked FOR '{predicate}'"
                          ).fetchall()[0]
        calibration_f = session.operators["sem_filter"].trained[predicate][0]
    assert row[0] == "sem_filter" and str(path) in row[1]
    assert row[3] == from_table.where  # the same cache entry
    assert calibration_f.to_json() == calibration_t.to_json()


@pytest.mark.models
def test_sentiment_trained_on_user_labels(home) -> None:
    table = pa.table({"review": POSITIVE + NEGATIVE,
                      "stars": ["good"] * len(POSITIVE) + ["bad"] * len(NEGATIVE)})
    with ken.connect(home=home, device=DeviceConfig(threads=2)) as session:
        session.register_table("films", table)
        trained = session.train("sentiment", "films", "stars", models=("minilm-l3",))
        assert "validation accuracy on 5 held-out rows: minilm-l3" in trained.quality
        labels = [v for (v,) in session.sql("SELECT sentiment(review) FROM films").fetchall()]
        assert set(labels) <= {"good", "bad"}
        assert "trained on films (24 rows" in session.explain(
            "SELECT sentiment(review) FROM films")
        again = session.train("sentiment", "films", "stars", models=("minilm-l3",))
        assert again == trained  # cached: same hash, same folder, same scores
        with pytest.raises(KenError, match="one text column"):
            session.train("sentiment", "films", "stars", columns=("review", "review"))


needs_pairs = pytest.mark.skipif(
    not (shared_data_dir() / "entity-matching" / "Abt-Buy" / "train.txt").exists(),
    reason=f"entity-matching data not found under {shared_data_dir()}")


@pytest.mark.models
@needs_pairs
def test_sem_match_trained_on_user_pairs(home) -> None:
    pairs = load_pairs("Abt-Buy", "train")
    keep = np.r_[np.flatnonzero(pairs.labels == 1)[:40], np.flatnonzero(pairs.labels == 0)[:120]]
    # records as struct columns (name, description, price), as a user's table holds them
    table = pa.table({"a": [parse_record(pairs.left[i]) for i in keep],
                      "b": [parse_record(pairs.right[i]) for i in keep],
                      "same": [bool(pairs.labels[i]) for i in keep]})
    with ken.connect(home=home, device=DeviceConfig(threads=2)) as session:
        session.register_table("pairs", table)
        with pytest.raises(KenError, match="compares two columns"):
            session.train("sem_match", "pairs", "same", columns=("a",))
        trained = session.train("sem_match", "pairs", "same")
        assert "held-out pairs" in trained.quality and "user-" in trained.where
        assert "name, description, price" in session.explain("SELECT sem_match(a, b) FROM pairs")
        same = session.sql("SELECT sem_match(a, b) AS m FROM pairs LIMIT 20").to_arrow()
        assert same.column("m").null_count == 0
        op = session.operators["sem_match"]
        sample = op.eval_sample(session.ctx)
        assert sample is not None and len(sample.inputs) == 24  # the held-out 15%
        bound = session.bind("sem_match", ())
        values = cascade_values(bound.cascade, bound.models, list(sample.inputs))
        assert set(values) <= {"true", "false"}
        assert "trained on pairs (160 rows" in session.explain(
            "SELECT sem_match(a, b) FROM pairs")
        no_match = table.set_column(2, "same", pa.array([False] * len(keep)))
        with pytest.raises(DataError, match="no row has a true label"):
            session.train("sem_match", no_match, "same")


def test_training_file_must_exist(tmp_path) -> None:
    with ken.connect(home=tmp_path) as session, pytest.raises(KenError, match="no file"):
        session.train("sentiment", Path(tmp_path / "missing.csv"), "y")


TOPICS = {
    "sports": ["the striker scored twice in the second half", "a late goal won the cup final",
               "the coach praised the defence after the match", "she ran the marathon in record "
               "time", "the team lost on penalties", "he hit a home run in the ninth inning",
               "the tennis final went to five sets", "fans cheered as the race began"],
    "cooking": ["simmer the onions until golden", "bake the bread at 220 degrees for 30 minutes",
                "add a pinch of salt to the sauce", "whisk the eggs with sugar and butter",
                "roast the vegetables with olive oil", "the soup needs more garlic",
                "knead the dough for ten minutes", "season the steak and sear it quickly"],
    "weather": ["heavy rain is expected tomorrow", "a cold front brings snow to the hills",
                "sunny skies and light winds all week", "the storm knocked out power lines",
                "temperatures will drop below freezing tonight", "fog delayed the morning "
                "flights", "a heatwave is forecast for the weekend", "thunder and hail in the "
                "afternoon"],
}


@pytest.mark.models
def test_sem_classify_trained_on_user_labels(home) -> None:
    texts = [t for ts in TOPICS.values() for t in ts]
    topics = [k for k, ts in TOPICS.items() for _ in ts]
    table = pa.table({"text": texts, "topic": topics})
    with ken.connect(home=home, device=DeviceConfig(threads=2)) as session:
        session.register_table("posts", table)
        with pytest.raises(DataError, match="no row is labelled politics"):
            session.train("sem_classify", "posts", "topic", labels="sports|cooking|weather|"
                          "politics")
        with pytest.raises(DataError, match="rows labelled weather are not among the labels"):
            session.sql("TRAIN sem_classify ON posts LABEL topic FOR 'sports|cooking'")
        trained = session.train("sem_classify", "posts", "topic")
        assert "held-out accuracy on" in trained.quality and "zero-shot cascade" in trained.quality
        query = "SELECT sem_classify(text, 'weather|sports|cooking') AS t FROM posts"
        assert "trained on posts (24 rows" in session.explain(query)
        answers = [v for (v,) in session.sql(query).fetchall()]
        assert set(answers) <= set(TOPICS) and np.mean(np.array(answers) == topics) > 0.6
        other = "SELECT sem_classify(text, 'happy|sad') FROM posts"
        assert "trained on" not in session.explain(other)  # other labels stay zero-shot
