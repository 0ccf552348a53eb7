"""Cost before running (issue 36, item 3): EXPLAIN's estimate of model calls and time per call
site, with the result cache's answers taken off, and the session limits that refuse a query
before any model is called."""

from __future__ import annotations

import pyarrow as pa
import pytest
from fakes import FakeModel

import ken
from ken.models.cascade import Cascade
from ken.ops.base import ClassifierBinding, SemanticFunction
from ken.sql.cost import CostLimitExceeded
from ken.sql.rewrite import SqlError

TEXTS = ["great flight", "delayed again", None, "great flight", "lost my bag", "meh",
         "thanks!", "so so"]  # 6 distinct non-NULL
QUERY = "SELECT id, mood(text) AS m FROM tweets"


def session(path=None, profiled: bool = False) -> tuple[ken.Session, dict[str, FakeModel]]:  # noqa: ANN001
    s = ken.connect(builtins=False, cache=path if path is not None else False)
    models = {"a": FakeModel("a"), "b": FakeModel("b")}
    cascade = Cascade(("a", "b"), (0.5,))
    if profiled:  # what a profile gives a bound cascade: stage fractions and time per row
        binding = ClassifierBinding("mood", cascade, models, stage_fractions=(1.0, 0.5),
                                    cost_ms_per_row=200.0)
        s.register("mood", SemanticFunction("mood", 1, (), "varchar", lambda _c: binding))
    else:
        s.register("mood", cascade, models=models)
    s.register_table("tweets", pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}))
    return s, models


def estimated(s: ken.Session, query: str = QUERY) -> str:
    return next(line for line in s.explain(query).splitlines() if "estimated:" in line)


def seen(models: dict[str, FakeModel]) -> int:
    return sum(len(m.rows_seen) for m in models.values())


def test_explain_estimates_calls_per_stage_and_time_from_the_profile() -> None:
    s, _ = session()
    assert estimated(s).endswith("8 input rows, ≤ 6 distinct non-NULL inputs; model calls ≤ "
                                 "a 6, b 6")
    s, _ = session(profiled=True)
    line = estimated(s)
    assert "model calls ≈ a 6, b 3" in line and "model time ≈ 1.2 s" in line
    line = estimated(s, "SELECT mood(text) FROM tweets WHERE id < 3")
    assert "≤ 3 input rows, ≤ 2 distinct" in line and "a 2, b 1" in line


def test_answers_in_the_result_cache_cost_nothing(tmp_path) -> None:
    path = tmp_path / "r.sqlite"
    s, _ = session(path, profiled=True)
    s.sql("SELECT mood(text) FROM tweets WHERE id < 5")  # 3 distinct inputs answered
    line = estimated(s)
    assert "6 distinct non-NULL inputs (3 answered by the result cache)" in line
    assert "model calls ≈ a 3, b 2" in line and "model time ≈ 0.6 s" in line
    s.sql(QUERY)
    assert "model calls ≈ a 0, b 0" in estimated(s)


def test_a_query_over_the_call_limit_is_refused_before_any_model_call(tmp_path) -> None:
    s, models = session(tmp_path / "r.sqlite")
    assert s.sql("SET ken_max_model_calls = 10").fetchall() == [("ken_max_model_calls", "10")]
    with pytest.raises(CostLimitExceeded, match=r"up to 12 model calls, more than the "
                       r"session's max_model_calls = 10 \(s0 mood\(text\): .*a 6, b 6"):
        s.sql(QUERY)
    assert seen(models) == 0
    s.sql("SELECT mood(text) FROM tweets WHERE id < 5")  # 3 distinct: at most 6 calls
    assert seen(models) > 0
    s.sql(QUERY)  # now 3 left to answer: at most 6 calls, under the limit
    s.sql("RESET ken_max_model_calls")
    assert s.max_model_calls is None


def test_the_time_limit_needs_a_profile_and_refuses_past_it() -> None:
    s, models = session()
    s.max_model_seconds = 100.0
    with pytest.raises(CostLimitExceeded, match="has no profile to estimate its model time"):
        s.sql(QUERY)
    s, models = session(profiled=True)
    s.sql("SET ken_max_model_seconds = 1")
    with pytest.raises(CostLimitExceeded, match=r"about 1.2 s of model time, more than the "
                       r"session's max_model_seconds = 1"):
        s.sql(QUERY)
    assert seen(models) == 0
    assert len(s.sql("SELECT mood(text) FROM tweets WHERE id < 5").fetchall()) == 5  # 0.6 s
    s.sql("SET ken_max_model_seconds = none")
    assert s.max_model_seconds is None


def test_limit_settings_reject_bad_values_and_plain_sql_is_never_refused() -> None:
    s, _ = session()
    for bad in ("0", "-3", "lots", "1.5"):
        with pytest.raises(SqlError, match="takes a number above 0"):
            s.sql(f"SET ken_max_model_calls = {bad}")
    s.max_model_calls = 1
    assert s.sql("SELECT count(*) FROM tweets").fetchall() == [(8,)]
    with pytest.raises(CostLimitExceeded, match="cannot be estimated"):
        s.sql("SELECT mood(text) FROM tweets WHERE id < ?", params=[3])
