"""Semantic SQL served by the online engine: many threads / asyncio tasks through one session,
their rows batched together; analytical queries as bulk rows; plan swap; overload errors.
Fake models, thread workers (the process workers are tested in test_engine.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest
from fakes import LABELS, WARM_UP_TEXT, FakeModel, HangingModel, SlowModel

import ken
from ken.engine.supervision import BatchDeadline
from ken.errors import KenError, ModelCallFailed
from ken.models.cascade import Cascade
from ken.policy.plan import GearPlan, RangeSchedule, Replica
from ken.sql.execute import EngineBusy

CASCADE = Cascade(("a", "b"), (0.6,))


def mood_plan(cascade: Cascade = CASCADE, max_wait_s: float = 0.02) -> GearPlan:
    placement = (Replica("a", ("cpu0",)), Replica("b", ("cpu1",)))
    return GearPlan("mood", (0.0, 1e6), (cascade,), placement,
                    (RangeSchedule(0, (1.0, 1.0), (1, 1)),), (32, 32), max_wait_s=max_wait_s)


def session_with(models: dict) -> ken.Session:
    s = ken.connect(builtins=False)
    s.register("mood", CASCADE, models=models)
    return s


def rows(n: int) -> list[str]:
    return [f"tweet {i} about the game" for i in range(n)]


@pytest.fixture
def serial_answers() -> dict[str, str]:
    """What the session answers without an engine (the cascade run in-process)."""
    with session_with({"a": FakeModel("a"), "b": FakeModel("b")}) as s:
        s.register_table("t", pa.table({"text": rows(300)}))
        return dict(s.sql("SELECT text, mood(text) FROM t").fetchall())


def test_32_threads_of_sql_get_the_serial_answers_and_share_batches(serial_answers) -> None:  # noqa: ANN001
    models = {"a": SlowModel("a", 0.01), "b": FakeModel("b")}
    texts = rows(300)
    with session_with(models) as s:
        s.use_plan(mood_plan())
        report = s.serve(workers="thread")
        assert report["mood"].workers == "thread"

        def client(part: list[str]) -> list[tuple[str, str]]:
            return [(t, s.sql("SELECT mood(?) AS m", [t]).fetchall()[0][0]) for t in part]

        with ThreadPoolExecutor(32) as pool:
            got = dict(x for part in pool.map(client, [texts[i::32] for i in range(32)])
                       for x in part)
        assert s.engines["mood"].in_flight == 0
    assert got == {t: serial_answers[t] for t in texts}
    # rows of different queries were batched together on model a
    assert max(n for n, _ in models["a"].calls) > 1
    assert len(models["a"].calls) < len(texts)
    assert len(models["a"].rows_seen) == len(texts)  # each row once on stage 1


def test_asql_runs_many_queries_at_once(serial_answers) -> None:  # noqa: ANN001
    models = {"a": SlowModel("a", 0.01), "b": FakeModel("b")}
    texts = rows(64)
    with session_with(models) as s:
        s.use_plan(mood_plan())
        s.serve(workers="thread")

        async def main() -> list:
            results = await asyncio.gather(*(s.asql("SELECT mood(?)", [t]) for t in texts))
            return [r.fetchall()[0][0] for r in results]

        got = asyncio.run(main())
    assert got == [serial_answers[t] for t in texts]
    assert max(n for n, _ in models["a"].calls) > 1


def test_an_analytical_query_runs_as_bulk_rows(serial_answers) -> None:  # noqa: ANN001
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    texts = rows(300)
    with session_with(models) as s:
        s.register_table("t", pa.table({"text": texts + texts[:50]}))  # 50 repeats
        s.use_plan(mood_plan())
        s.serve(workers="thread", bulk_threshold=16)
        result = s.sql("SELECT text, mood(text) AS m FROM t")
        assert dict(result.fetchall()) == serial_answers
        stats = result.stats["s0"]
        assert stats.bulk_rows == 300 and stats.online_rows == 0
        assert sum(stats.resolved_by.values()) == 300
        assert s.engines["mood"].gear_switches == []
        assert max(n for n, _ in models["a"].calls) == 32  # the plan's max batch
        text = str(s.sql("EXPLAIN ANALYZE SELECT mood(text) FROM t"))
    assert "online engine" in text and "bulk rows" in text


def test_tables_registered_on_the_session_are_seen_from_other_threads() -> None:
    with session_with({"a": FakeModel("a"), "b": FakeModel("b")}) as s:
        s.register_table("t", pa.table({"x": [1, 2, 3]}))
        got = []
        th = threading.Thread(target=lambda: got.append(s.sql("SELECT sum(x) FROM t")
                                                        .fetchall()))
        th.start()
        th.join()
    assert got == [[(6,)]]


def test_use_plan_while_serving_swaps_the_engine_plan() -> None:
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    with session_with(models) as s:
        s.use_plan(mood_plan())
        s.serve(workers="thread")
        engine = s.engines["mood"]
        first = s.sql("SELECT mood('a quiet evening')").fetchall()[0][0]
        only_b = mood_plan(Cascade(("b",)))
        s.use_plan(only_b)
        assert engine.plan is only_b and len(engine.plan_swaps) == 1
        second = s.sql("SELECT mood('a loud morning')").fetchall()[0][0]
    assert first in ("negative", "neutral", "positive")
    assert second == models["b"].spec.labels[int(models["b"].probabilities(
        "a loud morning").argmax())]


def test_a_query_sends_rejected_rows_again_then_fails_with_an_explicit_error(monkeypatch
                                                                               ) -> None:
    import ken.sql.execute

    models = {"a": SlowModel("a", 0.5), "b": FakeModel("b")}
    with session_with(models) as s:
        s.use_plan(mood_plan())
        s.serve(workers="thread", max_in_flight=1)
        # the first row holds the only in-flight slot for 0.5 s: the second query's row is
        # turned away, sent again after the retry hint, and answered once the slot is free
        busy = threading.Thread(target=lambda: s.sql("SELECT mood('first in')"))
        busy.start()
        time.sleep(0.15)
        started = time.monotonic()
        assert s.sql("SELECT mood('second')").fetchall()[0][0] in LABELS
        assert time.monotonic() - started > 0.2
        busy.join()
        # past REJECTED_RETRY_S of being turned away, the query fails and says why
        monkeypatch.setattr(ken.sql.execute, "REJECTED_RETRY_S", 0.1)
        busy = threading.Thread(target=lambda: s.sql("SELECT mood('first again')"))
        busy.start()
        time.sleep(0.15)
        with pytest.raises(EngineBusy, match="rejected.*retry later"):
            s.sql("SELECT mood('third')")
        busy.join()


class _Raising(FakeModel):
    """Raises on every batch but the engine's warm-up (a user model with a bug)."""

    def predict(self, texts, batch_size: int = 32):  # noqa: ANN001, ANN201
        if WARM_UP_TEXT not in texts:
            raise ValueError("tokenizer exploded")
        return super().predict(texts, batch_size)


def test_a_model_that_fails_every_batch_is_named_as_the_cause_not_the_load() -> None:
    with session_with({"a": _Raising("a"), "b": FakeModel("b")}) as s:
        s.use_plan(mood_plan())
        s.serve(workers="thread")
        for text in ("x", "y"):  # also once the model is marked failed
            with pytest.raises(ModelCallFailed, match=r"\(a failed \d+ times: ValueError: "
                                                      r"tokenizer exploded\).*not the load") as e:
                s.sql(f"SELECT mood('{text}')")
            assert "latency_target_s" not in str(e.value)
            assert isinstance(e.value, EngineBusy)  # callers catching EngineBusy still do


def test_a_model_that_never_returns_fails_its_query_within_the_first_call_bound() -> None:
    """A hand-written plan (no runtimes) over a user's model whose call blocks: the query
    fails with the model named and the bound it missed, after two 20-s first-call deadlines
    (the batch is retried once), not 2 x 60 s and not as load."""
    first_call_s = BatchDeadline().first_call_s
    with session_with({"a": HangingModel("a", seconds=3 * first_call_s),
                       "b": FakeModel("b")}) as s:
        s.use_plan(mood_plan())
        s.serve(workers="thread")
        started = time.monotonic()
        with pytest.raises(ModelCallFailed, match=rf"a did not return within "
                                                  rf"{first_call_s:.1f} s") as e:
            s.sql("SELECT mood('blocks for ever')")
        took = time.monotonic() - started
        assert s.engines["mood"].timeouts == 2
    assert "first-call bound" in str(e.value) and "not the load" in str(e.value)
    assert "latency_target_s" not in str(e.value)
    assert 2 * first_call_s <= took < 2 * first_call_s + 10


def test_serve_needs_a_gear_plan() -> None:
    with session_with({"a": FakeModel("a"), "b": FakeModel("b")}) as s:
        with pytest.raises(KenError, match="no function has a plan"):
            s.serve()
        with pytest.raises(KenError, match="has no plan"):
            s.serve(["mood"])
        s.use_plan(mood_plan())
        with pytest.raises(KenError, match="loaders for worker processes"):
            s.serve(workers="process")


class _Noting(ken.progress.Reporter):
    """A quiet reporter that remembers its notes and says when a re-plan was noted."""

    def __init__(self) -> None:
        super().__init__(quiet=True)
        self.notes: list[str] = []
        self.replanned = threading.Event()

    def note(self, message: str) -> None:
        self.notes.append(message)
        if "re-planned" in message:
            self.replanned.set()


class _SwapTo:
    """A re-plan recipe that answers with a given plan (the planner is tested elsewhere)."""

    latency_limit_ms = None  # an accuracy target: no latency drift
    catalog = None  # no runtimes: no runtime drift

    def __init__(self, plan: GearPlan) -> None:
        self.plan = plan
        self.calls = 0

    def __call__(self, trace, drift) -> GearPlan:  # noqa: ANN001
        self.calls += 1
        return self.plan

    def expected(self, plan: GearPlan) -> dict:
        return {c: (0.5,) * (len(c.models) - 1) for c in plan.cascades}


def test_a_served_function_is_replanned_when_its_load_passes_the_plan_and_explain_says_so(
        ) -> None:
    reporter = _Noting()
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    low = GearPlan("mood", (0.0, 10.0), (CASCADE,), mood_plan().placement,
                   (RangeSchedule(0, (1.0, 1.0), (1, 1)),), (32, 32), max_wait_s=0.005)
    recipe = _SwapTo(mood_plan(Cascade(("a",))))
    with ken.connect(builtins=False, reporter=reporter) as s:
        s.register("mood", CASCADE, models=models)
        s.use_plan(low)
        s.replans["mood"] = recipe  # as session.plan leaves it
        s.serve(workers="thread")
        texts = rows(400)
        with ThreadPoolExecutor(8) as pool:  # far above the plan's 10 qps
            answers = list(pool.map(lambda t: s.sql("SELECT mood(?)", [t]).fetchall(), texts))
            assert reporter.replanned.wait(15)
        assert len(answers) == 400 and all(len(a) == 1 for a in answers)
        assert recipe.calls == 1
        # the session's plan is the swapped-in one (made in the planner process: an equal copy)
        assert s.plans["mood"] == recipe.plan
        text = s.explain("SELECT mood(text) FROM (SELECT 'x' AS text)")
        assert "re-plans while serving (1):" in text and "rate:" in text
        # a plan given by hand is kept: no recipe, so no re-planning
        s.use_plan(low)
        assert "mood" not in s.replans


class _Gated(_SwapTo):
    """A recipe whose re-plan waits for ``gate`` (in the watching thread: an Event does not
    pickle, so it is not sent to the planner process)."""

    def __init__(self, plan: GearPlan) -> None:
        super().__init__(plan)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __call__(self, trace, drift) -> GearPlan:  # noqa: ANN001
        self.entered.set()
        assert self.gate.wait(30)
        return super().__call__(trace, drift)


def test_a_plan_given_by_hand_while_a_replan_runs_is_the_plan_that_serves() -> None:
    """``use_plan`` while a re-plan is under way: the re-plan finishes, and the user's plan,
    set after it, is the one the session keeps and the engine serves (it used to be
    overwritten by the re-plan's)."""
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    low = GearPlan("mood", (0.0, 10.0), (CASCADE,), mood_plan().placement,
                   (RangeSchedule(0, (1.0, 1.0), (1, 1)),), (32, 32), max_wait_s=0.005)
    recipe = _Gated(mood_plan(Cascade(("a",))))
    mine = mood_plan()
    with ken.connect(builtins=False, reporter=_Noting()) as s:
        s.register("mood", CASCADE, models=models)
        s.use_plan(low)
        s.replans["mood"] = recipe
        s.serve(workers="thread")
        watcher = s.serving._replanners["mood"]
        with ThreadPoolExecutor(8) as pool:  # far above the plan's 10 qps: a rate drift
            answers = [pool.submit(lambda t: s.sql("SELECT mood(?)", [t]).fetchall(), t)
                       for t in rows(400)]
            assert recipe.entered.wait(15)  # the re-plan is under way
            setter = threading.Thread(target=s.use_plan, args=(mine,))
            setter.start()
            assert watcher._stop.wait(15)  # use_plan is stopping the watch
            recipe.gate.set()
            setter.join(30)
            assert not setter.is_alive()
            assert all(len(a.result(timeout=60)) == 1 for a in answers)
        assert recipe.calls == 1
        assert s.plans["mood"] == mine
        assert s.engines["mood"].plans["mood"] == mine
