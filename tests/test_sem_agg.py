"""sem_agg (issue 35, item 5): packing against brute force, the SQL rewrite, and the aggregate
through SQL on the packaged SmolLM2 against the model called on each group directly."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pytest
from conftest import REFERENCE_DEVICE, SMALL_FAMILY
from hypothesis import given
from hypothesis import strategies as st

import ken
from ken.errors import KenError
from ken.ops.sem_agg import FAN_IN, group_texts, pack

INSTRUCTION = "What do these texts complain about? Answer in a few words."


@given(sizes=st.lists(st.integers(1, 300), max_size=40), fan_in=st.integers(2, 9),
       budget=st.integers(50, 700))
def test_pack_blocks_are_consecutive_and_within_limits(sizes: list[int], fan_in: int,
                                                       budget: int) -> None:
    blocks = pack([str(i) for i in range(len(sizes))], sizes, fan_in, budget)
    assert [i for b in blocks for i in b] == list(range(len(sizes)))
    for b in blocks:
        assert 1 <= len(b) <= fan_in
        assert len(b) == 1 or sum(sizes[i] for i in b) <= budget
    # greedy: no block could have taken the next text
    for b, nxt in zip(blocks, blocks[1:], strict=False):
        assert len(b) == fan_in or sum(sizes[i] for i in b) + sizes[nxt[0]] > budget


def test_group_texts_drops_nulls_and_blanks() -> None:
    assert group_texts(None) is None
    assert group_texts(json.dumps(["b  c", None, " ", "a", 3])) == ["b c", "a", "3"]
    assert group_texts("[]") == []


def test_rewrite_passes_each_group_as_a_sorted_list() -> None:
    from ken.sql.rewrite import parse, rewrite

    s = ken.connect(builtins=True)
    statement = parse(f"SELECT g, sem_agg(t, '{INSTRUCTION}') FROM x GROUP BY g")[0]
    rw = rewrite(statement, s.operators, s.db.functions())
    assert "TO_JSON(LIST_SORT(LIST(T)))" in rw.sql.upper()
    assert rw.sites[0].args == ("t",) and rw.sites[0].clauses == ("SELECT",)


@pytest.fixture(scope="module")
def session(home):  # noqa: ANN001 - conftest's KEN_HOME (SmolLM2 converted there)
    s = ken.connect(device=REFERENCE_DEVICE, data=SMALL_FAMILY, home=home)
    s.operators["sem_agg"].llms = ("smollm2-135m",)
    complaints = [f"My order number {i} arrived late and the box was damaged." for i in range(20)]
    rows = [("small", "The soup was cold."), ("small", "The waiter was rude."),
            ("small", None), ("small", "We waited an hour for a table."),
            ("empty", None), ("empty", "  ")] + [("big", t) for t in complaints]
    s.register_table("reviews", pa.table({"g": [r[0] for r in rows], "t": [r[1] for r in rows]}))
    yield s
    s.close()


@pytest.mark.models
def test_sql_equals_the_model_on_each_group(session) -> None:  # noqa: ANN001
    s = session
    out = s.sql(f"SELECT g, sem_agg(t, '{INSTRUCTION}') AS a FROM reviews GROUP BY g "
                "ORDER BY g").fetchall()
    got = dict(out)
    assert set(got) == {"big", "empty", "small"}
    assert got["empty"] is None  # no text in the group
    assert isinstance(got["small"], str) and got["small"].strip()
    bound = s.bind("sem_agg", (INSTRUCTION,))
    model = bound.models[bound.cascade.models[0]]
    groups = s.sql("SELECT g, list_sort(list(t)) FROM reviews GROUP BY g").fetchall()
    for g, texts in groups:
        expected = model.predict([json.dumps(texts)]).values[0]
        assert got[g] == expected, g


@pytest.mark.models
def test_a_big_group_is_reduced_in_levels(session) -> None:  # noqa: ANN001
    s = session
    bound = s.bind("sem_agg", (INSTRUCTION,))
    model = bound.models[bound.cascade.models[0]]
    calls = model.calls
    texts = [f"Complaint {i}: the delivery was late." for i in range(20)]
    out = model.predict([json.dumps(texts)])
    leaves = -(-20 // FAN_IN)
    assert model.calls - calls == leaves + 1  # 3 blocks, then one call combines them
    assert model.levels >= 2 and isinstance(out.values[0], str)
    # EXPLAIN gives the fan-in, EXPLAIN ANALYZE the LM calls of the reduction
    # (big: 3 + 1, small: 1, empty: 0)
    query = f"SELECT g, sem_agg(t, '{INSTRUCTION}') FROM reviews GROUP BY g"
    assert f"at most {FAN_IN} texts" in s.explain(query)
    text = s.explain(query, analyze=True)
    assert re.search(r"3 in, 3 resolved, \d+ batches, 5 LM calls", text), text
    assert "s0:sem_agg(t)" in text
    # a whole-table aggregate is one group
    one = s.sql(f"SELECT sem_agg(t, '{INSTRUCTION}') FROM reviews WHERE g = 'small'").fetchall()
    assert len(one) == 1 and isinstance(one[0][0], str)


def test_bad_calls_say_what_to_do() -> None:
    s = ken.connect()
    s.register_table("r", pa.table({"g": ["a"], "t": ["x"]}))
    with pytest.raises(KenError, match="sem_agg needs an instruction"):
        s.sql("SELECT sem_agg(t, '  ') FROM r")
    with pytest.raises(KenError, match="sem_agg\\(\\) is an aggregate.*not in WHERE"):
        s.sql(f"SELECT t FROM r WHERE sem_agg(t, '{INSTRUCTION}') = 'x'")
    with pytest.raises(KenError, match="not in GROUP BY"):
        s.sql(f"SELECT count(*) FROM r GROUP BY sem_agg(t, '{INSTRUCTION}')")


def test_label_named_wants_the_label_and_no_other() -> None:
    from ken.models.quality import label_named

    refs = ["positive", "negative", "neutral", "positive", "negative"]
    values = ["The overall sentiment is Positive.", "positive, not negative", "neutral",
              None, "nonnegative"]
    assert label_named(values, refs).tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]


@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=2, max_size=30))
def test_roc_auc_against_every_pair(rows: list[tuple[int, bool]]) -> None:
    from ken.errors import DataError
    from ken.models.quality import roc_auc

    scores = [float(s) for s, _ in rows]
    truth = [t for _, t in rows]
    pos = [s for s, t in zip(scores, truth, strict=True) if t]
    neg = [s for s, t in zip(scores, truth, strict=True) if not t]
    if not pos or not neg:
        with pytest.raises(DataError):
            roc_auc(scores, truth)
        return
    pairs = [1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg]
    assert roc_auc(scores, truth) == pytest.approx(sum(pairs) / len(pairs))
