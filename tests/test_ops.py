"""The operator interface and the output contract, end to end with deterministic stand-ins:
registry, signatures, values of any type, profiles on an evaluation sample, planning several
operators at once and serving them to many threads with the in-process answers."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pytest
from fakes import FakeModel

import ken
from ken.engine.batch import run_cascade
from ken.errors import DataError, KenError
from ken.models.model import DeviceConfig, Model, ModelSpec, Output
from ken.models.quality import EvalSample, balanced_accuracy, exact_match, token_f1
from ken.ops import BUILTIN_MODULES, builtin_operators
from ken.ops import store_entries as ops_store_entries
from ken.ops.base import OpContext, to_sql_value
from ken.ops.sem_classify import parse_labels
from ken.optimizer.planning import operator_profiles

BOOL = ("false", "true")


class Scorer(Model):
    """A model with numeric values: the text's length, sure only for short texts."""

    def __init__(self, name: str, scale: float = 1.0) -> None:
        self.spec = ModelSpec(name, "fake", "fake", "", 10, 100, 16, (), f"fp-{name}")
        self.device = DeviceConfig()
        self.scale = scale

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Output:
        values = [len(t) * self.scale for t in texts]
        return Output(values, np.array([1.0 if len(t) < 6 else 0.2 for t in texts]))


def test_registry_has_every_builtin_with_a_signature() -> None:
    ops = builtin_operators()
    assert set(ops) == {"sentiment", "sem_filter", "sem_match", "sem_classify", "sem_choice",
                        "sem_score", "sem_complete", "sem_qa", "sem_extract", "sem_map",
                        "sem_agg", "sem_similarity", "sem_join"}
    assert len(BUILTIN_MODULES) == len(ops)
    assert ops["sem_classify"].signature() == "sem_classify(text, 'labels') -> VARCHAR"
    assert ops["sem_match"].signature() == "sem_match(text1, text2) -> BOOLEAN"
    assert ops["sem_complete"].signature() == "sem_complete(text1, text2) -> BIGINT"
    assert ops["sem_extract"].signature() == "sem_extract(text, 'what') -> VARCHAR"
    assert ops["sem_similarity"].signature() == "sem_similarity(text1, text2) -> DOUBLE"
    assert ops["sem_score"].signature() == "sem_score(text, 'rubric') -> DOUBLE"
    assert ops["sem_agg"].signature() == "sem_agg(text, 'instruction') -> VARCHAR"
    for op in ops.values():
        assert op.eval_description()
    # each call gives fresh instances: one session's choices never leak into another's
    assert builtin_operators()["sentiment"] is not ops["sentiment"]


def test_builtin_stages_are_named_and_pickle_without_loading_a_model(tmp_path) -> None:
    ctx = OpContext(DeviceConfig(), home=tmp_path)
    ops = builtin_operators()
    for name in ("sem_choice", "sem_score", "sem_agg", "sem_qa", "sem_complete",
                 "sem_similarity"):
        op = ops[name]
        names = [s.name for s in op.declared_stages(ctx, op.eval_constants)]
        loaders = op.loaders(ctx, DeviceConfig(threads=1))
        assert list(loaders) == names and len(set(names)) == len(names)
        assert all(callable(pickle.loads(pickle.dumps(f))) for f in loaders.values())
    # a copy under another SQL name names its stages after it (its own models and plans)
    assert [n.split("[")[0] for n in ops["sem_qa"].renamed("text_qa").loaders(ctx, ctx.device)
            ] == ["text_qa-smol", "text_qa-qwen05"]
    # the default binding of an LLM operator: its stages, escalating below the threshold
    stages = ops["sem_map"].declared_stages(ctx, ("Summarise",))
    assert [s.name.split("[")[0] for s in stages] == ["map-smol", "map-qwen05"]
    assert ops["sem_map"].threshold == 0.5


def test_store_entries_come_from_the_operators(tmp_path) -> None:
    (tmp_path / "trained" / "sem_filter").mkdir(parents=True)
    (tmp_path / "trained" / "sem_filter" / "0123456789abcdef.json").write_text("{}")
    (tmp_path / "trained" / "sem_classify" / "fedcba9876543210").mkdir(parents=True)
    (tmp_path / "families" / "sem-match" / "Abt-Buy").mkdir(parents=True)
    (tmp_path / "families" / "sem-match" / "Abt-Buy" / "card.json").write_text("{}")
    (tmp_path / "families" / "sem-match" / "untrained").mkdir()
    found = [(kind, entry.root.name) for kind, entry in ops_store_entries(tmp_path)]
    assert found == [("trained sem_filter", "sem_filter"), ("sem_match", "Abt-Buy"),
                     ("trained sem_classify", "fedcba9876543210")]


def test_sem_classify_labels_are_checked() -> None:
    assert parse_labels(" sports | politics|weather ") == ("sports", "politics", "weather")
    for bad in ("sports", "a||b", "a|a", "|"):
        with pytest.raises(DataError):
            parse_labels(bad)
    s = ken.connect()
    s.register_table("t", pa.table({"x": ["a"]}))
    with pytest.raises(KenError, match="at least two labels"):
        s.sql("SELECT sem_classify(x, 'only') FROM t")


def test_sql_values_of_every_type() -> None:
    assert to_sql_value("true", "boolean") is True
    assert to_sql_value(1.5, "double") == 1.5
    assert to_sql_value(7.0, "bigint") == 7
    assert to_sql_value(None, "bigint") is None
    with pytest.raises(DataError):
        to_sql_value("maybe", "boolean")
    with pytest.raises(DataError):
        to_sql_value("seven", "double")


def test_quality_metrics() -> None:
    refs = [True, False, False, False]
    # balanced accuracy: the mean over rows is the mean recall per class
    assert balanced_accuracy([True, True, False, False], refs).mean() == pytest.approx(
        (1.0 + 2 / 3) / 2)
    assert exact_match(["The Beatles", None], [["beatles"], "x"]).tolist() == [1.0, 0.0]
    assert token_f1(["new york city"], ["york city"]).tolist() == [pytest.approx(0.8)]
    sample = EvalSample("s", ("a", "b"), (True, False), "accuracy")
    # boolean classifiers' labels score as booleans; other strings never equal a boolean
    assert sample.quality(["true", "false"]).tolist() == [1.0, 1.0]
    assert sample.quality(["yes", 0]).tolist() == [0.0, 0.0]


def test_values_of_any_type_run_through_cascades_and_sql() -> None:
    small, big = Scorer("small"), Scorer("big", scale=10.0)
    models = {"small": small, "big": big}
    cascade = ken.Cascade(("small", "big"), (0.5,))
    result = run_cascade(cascade, models, pa.array(["abc", "a long text", None]))
    assert result.values == [3.0, 110.0, None]  # the long text escalated by its certainty
    assert result.stage.tolist() == [0, 1, -1]
    s = ken.connect(builtins=False)
    s.register("size", cascade, models=models, output_type="double")
    s.register_table("t", pa.table({"x": ["abc", "a long text", None]}))
    table = s.sql("SELECT x, size(x) AS n FROM t").arrow()
    assert table.schema.field("n").type == pa.float64()
    assert table.column("n").to_pylist() == [3.0, 110.0, None]


# -- planning and serving user operators with evaluation samples --------------------------


TEXTS = [f"text number {i} {'!' * (i % 4)}" for i in range(60)]
LABELS = ("negative", "neutral", "positive")


def _reference(model: FakeModel, rows: Sequence) -> tuple:
    return tuple(model.spec.labels[int(model.probabilities(r).argmax())] for r in rows)


def plannable_session(cascades: dict | None = None) -> ken.Session:
    """Three operators like the built-ins (3 labels; a boolean filter; a boolean pair
    matcher), each a cascade of stand-ins with a labelled evaluation sample; ``cascades``
    replaces an operator's default cascade."""
    cascades = cascades or {}
    s = ken.connect(builtins=False)
    mood = {m: FakeModel(m) for m in ("m1", "m2")}
    s.register("mood", cascades.get("mood", ken.Cascade(("m1", "m2"), (0.4,))), models=mood,
               sample=EvalSample("moods", tuple(TEXTS), _reference(mood["m2"], TEXTS)))
    keep = {m: FakeModel(m, BOOL) for m in ("k1", "k2")}
    s.register("wanted", cascades.get("wanted", ken.Cascade(("k1", "k2"), (0.6,))), models=keep,
               output_type="boolean",
               sample=EvalSample("keeps", tuple(TEXTS),
                                 tuple(v == "true" for v in _reference(keep["k2"], TEXTS)),
                                 "balanced_accuracy"))
    pair = {m: FakeModel(m, BOOL, num_inputs=2) for m in ("p1", "p2")}
    pairs = tuple((a, b) for a, b in zip(TEXTS, TEXTS[1:] + TEXTS[:1], strict=True))
    s.register("same", cascades.get("same", ken.Cascade(("p1", "p2"), (0.6,))), models=pair,
               output_type="boolean",
               sample=EvalSample("pairs", pairs, tuple(
                   v == "true" for v in _reference(pair["p2"], pairs)), "balanced_accuracy"))
    s.register_table("t", pa.table({"id": list(range(40)), "x": TEXTS[:40],
                                    "y": TEXTS[20:60]}))
    return s


QUERY = ("SELECT id, mood(x) AS m, same(x, y) AS p FROM t WHERE wanted(x) OR id % 3 = 0 "
         "ORDER BY id")


def test_profiles_on_the_evaluation_sample(tmp_path) -> None:
    s = plannable_session()
    ctx = OpContext(DeviceConfig(), home=tmp_path)
    profiles = operator_profiles(s.operators["same"], ctx)
    assert set(profiles) == {"p1", "p2"}
    # p2 defines the references, so it is perfect; the metric is the sample's
    assert profiles["p2"].accuracy == pytest.approx(1.0)
    assert profiles["p1"].metric == "balanced_accuracy"
    assert profiles["p1"].values and isinstance(profiles["p1"].values[0], str)


def run_in_threads(s: ken.Session, query: str, n: int = 8) -> list:
    results: list = [None] * n
    errors: list = []

    def run(i: int) -> None:
        try:
            results[i] = s.sql(query).fetchall()
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_plan_several_operators_and_serve_them_to_eight_threads(tmp_path) -> None:
    s = plannable_session()
    s.ctx.home = tmp_path
    qp = s.plan("accuracy >= 0.5", functions=["mood", "wanted", "same"], trace="poisson",
                peak_qps=50, duration_s=5.0, num_ranges=2)
    assert {p.operator for p in qp.plans} == {"mood", "wanted", "same"}
    assert set(s.plans) == {"mood", "wanted", "same"}
    assert s.explain(QUERY).count("gear plan:") == 3
    # in process, each operator running its plan's first (most accurate) gear
    first_gear = {n: p.cascades[p.ranges[0].cascade] for n, p in s.plans.items()}
    expected = plannable_session(first_gear).sql(QUERY).fetchall()
    assert expected, "the query must return rows"
    s.serve(workers="thread", bulk_threshold=1)  # bulk rows run the first gear's cascade
    try:
        # one engine serves all three on the one pool of devices
        engines = {id(e) for e in s.engines.values()}
        assert set(s.engines) == {"mood", "wanted", "same"} and len(engines) == 1
        assert set(next(iter(s.engines.values())).plans) == {"mood", "wanted", "same"}
        results = run_in_threads(s, QUERY)
        assert all(r == expected for r in results)
        assert "online engine" in str(s.sql("EXPLAIN ANALYZE " + QUERY))
        # as online requests (metered, batched across threads) every row is answered too;
        # under load a batch may run any gear of the plan, so the rows that pass the filter
        # lie between those every gear's cascade keeps and those some gear's cascade keeps
        s.bulk_threshold = 10_000
        kept = []
        for c in s.plans["wanted"].cascades:
            rows = plannable_session({"wanted": c}).sql("SELECT id FROM t WHERE wanted(x) "
                                                         "OR id % 3 = 0").fetchall()
            kept.append({r[0] for r in rows})
        online = run_in_threads(s, QUERY)
        for rows in online:
            ids = [r[0] for r in rows]
            assert ids == sorted(ids)
            assert set.intersection(*kept) <= set(ids) <= set.union(*kept)
            assert {r[1] for r in rows} <= set(LABELS)
            assert {r[2] for r in rows} <= {True, False}
    finally:
        s.stop_serving()
