"""The result cache (issue 36, item 2): answers across queries and sessions, invalidation on
every kind of change, verification on read, the size bound, concurrent processes."""

from __future__ import annotations

import math
import multiprocessing
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pytest
from fakes import FakeModel
from test_training import NEGATIVE, POSITIVE

import ken
from ken import store
from ken.cache import ResultCache, cache_setting
from ken.cli import main as cli_main
from ken.errors import KenError
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig, ModelSpec, Prediction
from ken.ops.base import ClassifierBinding, SemanticFunction
from ken.sql.cache_key import model_fingerprint

TEXTS = ["great flight", "delayed again", None, "great flight", "lost my bag", "meh",
         "thanks!", "so so"]
QUERY = "SELECT id, mood(text) AS m FROM tweets ORDER BY id"


class BoolBinding(ClassifierBinding):
    def to_sql_values(self, labels):  # noqa: ANN001, ANN201
        return [None if v is None else v == "true" for v in labels]


class FailingModel(FakeModel):
    """Raises on every call (a model whose batch fails)."""

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        raise KenError(f"{self.spec.name} failed on a batch of {len(texts)}")


def session(path: Path, models: dict[str, FakeModel] | None = None,
            cascade: Cascade | None = None) -> ken.Session:
    s = ken.connect(builtins=False, cache=path)
    models = models if models is not None else {"a": FakeModel("a"), "b": FakeModel("b")}
    s.register("mood", cascade or Cascade(("a", "b"), (0.5,)), models=models)
    s.register_table("tweets", pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}))
    return s


def calls(models: dict[str, FakeModel]) -> int:
    return sum(len(m.rows_seen) for m in models.values())


# ------------------------------------------------------------------------ across sessions


def test_a_second_session_answers_from_the_cache_with_no_model_call(tmp_path) -> None:
    path = tmp_path / "results.sqlite"
    first_models = {"a": FakeModel("a"), "b": FakeModel("b")}
    with session(path, first_models) as s:
        first = s.sql(QUERY).fetchall()
        assert calls(first_models) > 0
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    with session(path, models) as s:
        assert s.sql(QUERY).fetchall() == first
        assert calls(models) == 0
        text = s.explain(QUERY, analyze=True)
        assert "6 from the result cache" in text and "6 hits, 0 misses" in text
        assert s.cache is not None and s.cache.stats().entries == 6


def test_set_ken_cache_off_neither_reads_nor_writes(tmp_path) -> None:
    path = tmp_path / "results.sqlite"
    with session(path) as s:
        s.sql(QUERY)
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    with session(path, models) as s:
        assert s.sql("SET ken_cache = off").fetchall() == [("ken_cache", "off")]
        s.sql(QUERY)
        assert calls(models) > 0 and s.cache is None
        assert "result cache" not in s.explain(QUERY, analyze=True)
        with pytest.raises(KenError, match="takes on or off"):
            s.sql("SET ken_cache = maybe")
        s.sql("RESET ken_cache")
        assert s.cache is not None
    with ken.connect(builtins=False, cache=False) as s:
        assert s.cache is None


def test_cache_setting_reads_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KEN_CACHE", "off")
    assert cache_setting(None) is False
    monkeypatch.setenv("KEN_CACHE", str(tmp_path / "c.sqlite"))
    assert cache_setting(None) == tmp_path / "c.sqlite"
    monkeypatch.delenv("KEN_CACHE")
    assert cache_setting(None) is True
    with pytest.raises(KenError, match="cache= takes"):
        cache_setting(3)


# ------------------------------------------------------------------------------- invalidation


def test_a_changed_cascade_or_model_misses(tmp_path) -> None:
    path = tmp_path / "results.sqlite"
    with session(path) as s:
        s.sql(QUERY)
    # other thresholds
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    with session(path, models, Cascade(("a", "b"), (0.6,))) as s:
        s.sql(QUERY)
        assert calls(models) > 0
    # the same names, another model's contents (its fingerprint)
    changed = {"a": FakeModel("a"), "b": FakeModel("b")}
    spec = changed["b"].spec
    changed["b"].spec = ModelSpec(spec.name, spec.family, spec.backend, spec.source,
                                  spec.num_params, spec.memory_bytes, spec.max_tokens,
                                  spec.labels, "fp-b-retrained")
    with session(path, changed) as s:
        s.sql(QUERY)
        assert calls(changed) > 0
    # the first configuration again: its answers are still there
    again = {"a": FakeModel("a"), "b": FakeModel("b")}
    with session(path, again) as s:
        s.sql(QUERY)
        assert calls(again) == 0


def test_other_constants_and_precision_miss(tmp_path) -> None:
    path = tmp_path / "results.sqlite"
    models: dict[str, FakeModel] = {}

    def bind(constants: tuple[str, ...]) -> BoolBinding:
        name = f"f[{constants[0]}]"
        models.setdefault(name, FakeModel(name, ("false", "true")))
        return BoolBinding("fsem", Cascade((name,)), {name: models[name]}, "boolean")

    seen = []
    for _ in range(2):
        with ken.connect(builtins=False, cache=path) as s:
            s.register("fsem", SemanticFunction("fsem", 1, ("predicate",), "boolean", bind))
            s.register_table("t", pa.table({"x": ["a", "b", "c", "d", "e", "f"]}))
            s.sql("SELECT x FROM t WHERE fsem(x, 'one') OR fsem(x, 'two')")
            seen.append([len(m.rows_seen) for m in models.values()])
    assert seen[0][0] == 6 and seen[0][1] > 0  # 'two' has its own answers, asked of its model
    assert seen[1] == seen[0]  # and the second session asked nothing
    fp32 = FakeModel("m")
    bf16 = FakeModel("m")
    bf16.device = DeviceConfig(threads=2, precision="bf16")
    assert model_fingerprint(fp32) != model_fingerprint(bf16)


def test_a_model_folder_whose_files_change_gets_another_fingerprint(tmp_path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "weights.safetensors").write_bytes(b"one")
    entry = store.Entry(folder, "a test model", "rebuild it")
    store.seal(entry)
    model = FakeModel("m")
    model.spec = ModelSpec("m", "fake", "fake", str(folder), 1, 1, 16, ("a", "b"))
    before = model_fingerprint(model)
    (folder / "weights.safetensors").write_bytes(b"two")
    store.seal(entry)
    assert model_fingerprint(model) != before


@pytest.mark.models
def test_training_an_operator_stops_its_cached_answers(home, tmp_path) -> None:
    query = "SELECT sentiment(review) FROM films"
    path = tmp_path / "results.sqlite"
    with ken.connect(home=home, device=DeviceConfig(threads=2), cache=path) as s:
        s.register_table("films", pa.table({
            "review": POSITIVE + NEGATIVE,
            "stars": ["good"] * len(POSITIVE) + ["bad"] * len(NEGATIVE),
            "liked": ["yes"] * len(POSITIVE) + ["no"] * len(NEGATIVE)}))
        s.train("sentiment", "films", "stars", columns=("review",), models=("minilm-l3",))
        assert {v for (v,) in s.sql(query).fetchall()} <= {"good", "bad"}
        assert f"{len(POSITIVE + NEGATIVE)} hits, 0 misses" in s.explain(query, analyze=True)
        s.train("sentiment", "films", "liked", columns=("review",), models=("minilm-l3",))
        # the newly trained head answers, not the cache of the first one
        assert {v for (v,) in s.sql(query).fetchall()} <= {"yes", "no"}
        assert f"{len(POSITIVE + NEGATIVE)} hits, 0 misses" in s.explain(query, analyze=True)


# -------------------------------------------------------------------------- what is kept


def test_failed_calls_are_not_cached(tmp_path) -> None:
    path = tmp_path / "results.sqlite"
    broken = {"a": FakeModel("a"), "b": FailingModel("b")}
    with session(path, broken) as s:
        with pytest.raises(KenError, match="failed on a batch"):
            s.sql(QUERY)
        assert s.cache is not None and s.cache.stats().entries == 0


def test_values_of_every_type_round_trip(tmp_path) -> None:
    cache = ResultCache(tmp_path / "r.sqlite")
    answers = {"text": "positive", "yes": True, "no": False, "n": 3, "x": 2.5,
               "nan": float("nan"), "null": None, "struct": {"name": "Ada", "age": 36},
               ("pair", "left"): True, "ünïcode ✓": "ok"}
    cache.put_many("ns", "op", "op by a", answers)
    got = cache.get_many("ns", list(answers) + ["absent"])
    assert set(got) == set(answers)
    for k, v in answers.items():
        assert (math.isnan(got[k]) if k == "nan" else got[k] == v and type(got[k]) is type(v))
    assert cache.get_many("other namespace", list(answers)) == {}
    cache.close()


# ------------------------------------------------------------------- verified on read


def test_a_damaged_entry_is_a_miss_never_a_wrong_answer(tmp_path) -> None:
    path = tmp_path / "results.sqlite"
    with session(path) as s:
        right = s.sql(QUERY).fetchall()
    con = sqlite3.connect(path)
    con.execute("UPDATE entries SET value = '\"neutral-ish\"'")  # every answer altered
    con.commit()
    con.close()
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    with session(path, models) as s:
        assert s.sql(QUERY).fetchall() == right
        assert len(set(calls_rows(models))) == 6  # all recomputed
        assert s.cache is not None and s.cache.corrupt_entries == 6
    with session(path, models) as s:  # and written back correctly
        s.sql(QUERY)
        assert s.cache is not None and s.cache.corrupt_entries == 0


def calls_rows(models: dict[str, FakeModel]) -> list[str]:
    return [r for m in models.values() for r in m.rows_seen if m.spec.name == "a"]


def test_a_corrupted_file_is_set_aside_and_rebuilt(tmp_path) -> None:
    path = tmp_path / "results.sqlite"
    with session(path) as s:
        right = s.sql(QUERY).fetchall()
    path.write_bytes(b"this is not a database, it was overwritten" * 100)
    warnings: list[str] = []
    cache = ResultCache(path, warn=warnings.append)
    assert len(warnings) == 1 and "moved to" in warnings[0] and str(path) in warnings[0]
    assert list(tmp_path.glob("results.sqlite.corrupt-*"))
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    with session(path, models) as s:
        assert s.sql(QUERY).fetchall() == right
        assert calls(models) > 0
    cache.close()


# -------------------------------------------------------------------------- bounded


def test_least_recently_used_answers_go_first(tmp_path) -> None:
    cache = ResultCache(tmp_path / "r.sqlite", max_bytes=20_000)  # about 120 answers
    old = [f"old {i}" for i in range(100)]
    cache.put_many("ns", "op", "", dict.fromkeys(old, "x" * 100))
    assert cache.stats().entries == 100  # under the bound: nothing goes
    cache.get_many("ns", ["old 0", "old 1"])  # used again: now the newest of the old
    cache.put_many("ns", "op", "", {f"new {i}": "x" * 100 for i in range(60)})
    stats = cache.stats()
    assert stats.bytes <= 0.9 * 20_000  # down to 90% of the bound
    kept = cache.get_many("ns", [*old, "new 0", "new 59"])
    assert {"old 0", "old 1", "new 0", "new 59"} <= set(kept)
    assert len(set(kept) & set(old)) <= 100 - 50  # the least recently used went
    with pytest.raises(KenError, match="above 0"):
        ResultCache(tmp_path / "s.sqlite", max_bytes=0)
    cache.close()


# -------------------------------------------------------------------- concurrent processes


def _writer(path: str, worker: int, rounds: int) -> None:
    cache = ResultCache(path)
    for r in range(rounds):
        cache.put_many("shared", "op", "", {f"w{worker} r{r} i{i}": [worker, r, i][i % 3]
                                            for i in range(50)})
        got = cache.get_many("shared", [f"w{1 - worker} r{r} i0", f"w{worker} r{r} i1"])
        assert got[f"w{worker} r{r} i1"] == r
    cache.close()


def test_two_processes_write_one_cache_at_once(tmp_path) -> None:
    path = str(tmp_path / "r.sqlite")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, w, 40)) for w in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    cache = ResultCache(path)
    assert cache.stats().entries == 2 * 40 * 50
    got = cache.get_many("shared", ["w0 r39 i2", "w1 r7 i0"])
    assert got == {"w0 r39 i2": 2, "w1 r7 i0": 1}
    cache.close()


# ---------------------------------------------------------------------------------- CLI


def test_cli_stats_and_clear(tmp_path, capsys) -> None:
    path = tmp_path / "results.sqlite"
    with session(path) as s:
        s.sql(QUERY)
    assert cli_main(["cache", "stats", "--path", str(path)]) == 0
    out = capsys.readouterr().out
    assert "6 answers" in out and "mood: 6 answers in 1 version," in out
    assert cli_main(["cache", "clear", "--path", str(path), "--operator", "other"]) == 0
    assert "deleted 0 answers of other" in capsys.readouterr().out
    assert cli_main(["cache", "clear", "--path", str(path)]) == 0
    assert "deleted 6 answers" in capsys.readouterr().out
    assert cli_main(["cache", "stats", "--path", str(tmp_path / "none.sqlite")]) == 0
    assert "no file yet" in capsys.readouterr().out


# ----------------------------------------------------------------------- served by a plan


def test_a_served_function_caches_under_its_plan(tmp_path) -> None:
    from test_serving_sql import mood_plan

    path = tmp_path / "results.sqlite"
    texts = [f"tweet {i} about the game" for i in range(40)]

    def served(plan_cascade: Cascade) -> tuple[dict, dict[str, FakeModel]]:
        models = {"a": FakeModel("a"), "b": FakeModel("b")}
        with ken.connect(builtins=False, cache=path) as s:
            s.register("mood", Cascade(("a", "b"), (0.6,)), models=models)
            s.register_table("t", pa.table({"text": texts}))
            s.use_plan(mood_plan(plan_cascade))
            s.serve(workers="thread")
            answers = dict(s.sql("SELECT text, mood(text) FROM t").fetchall())
        return answers, models

    first, models = served(Cascade(("a", "b"), (0.6,)))
    assert calls(models) > 0
    again, models = served(Cascade(("a", "b"), (0.6,)))
    assert again == first and calls(models) == 0
    _, models = served(Cascade(("a", "b"), (0.9,)))  # another plan: its own answers
    assert calls(models) > 0
    with session(path, {"a": FakeModel("a"), "b": FakeModel("b")}) as s:
        # in-process, the same cascade as the plan's: a namespace of its own too
        s.sql(QUERY)
        assert s.cache is not None and s.cache.stats().operators[0].namespaces == 3


def test_a_cache_another_process_holds_locked_costs_its_answers_not_the_query(tmp_path) -> None:
    path = tmp_path / "results.sqlite"
    ResultCache(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process writing, for longer than we wait
    try:
        models = {"a": FakeModel("a"), "b": FakeModel("b")}
        s = ken.connect(builtins=False, cache=ResultCache(path, busy_timeout_s=0.05))
        s.register("mood", Cascade(("a", "b"), (0.5,)), models=models)
        s.register_table("tweets", pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}))
        with session(tmp_path / "other.sqlite") as plain:
            assert s.sql(QUERY).fetchall() == plain.sql(QUERY).fetchall()
        text = s.explain(QUERY, analyze=True)
        assert "then not used: the result cache" in text and "locked" in text
        s.close()
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_an_unusable_cache_path_leaves_the_session_working(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with session(blocker / "results.sqlite") as s:  # its folder cannot be made
        assert len(s.sql(QUERY).fetchall()) == len(TEXTS)
        assert s.cache is None and not s.cache_enabled


def _opener(path: str, worker: int, start) -> None:  # noqa: ANN001
    start.wait()
    cache = ResultCache(path)
    cache.put_many("ns", "op", "", {f"{worker}-{i}": i for i in range(20)})
    cache.close()


def test_processes_opening_a_new_cache_at_the_same_moment_all_succeed(tmp_path) -> None:
    """Setting up a new file (its write-ahead log) takes a lock the busy timeout does not wait
    for; without the retry about one open in a hundred failed ("database is locked")."""
    ctx = multiprocessing.get_context("fork")
    for attempt in range(5):
        path = str(tmp_path / f"r{attempt}.sqlite")
        start = ctx.Event()
        procs = [ctx.Process(target=_opener, args=(path, w, start)) for w in range(6)]
        for p in procs:
            p.start()
        start.set()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * 6
        cache = ResultCache(path)
        assert cache.stats().entries == 6 * 20
        cache.close()
