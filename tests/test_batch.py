"""Cascade execution over Arrow columns, against a row-by-row loop (fake models)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pytest
from fakes import FakeModel
from hypothesis import given, settings
from hypothesis import strategies as st

from ken.engine.batch import run_cascade, text_column
from ken.errors import CascadeError, DataError, KenError
from ken.models.cascade import Cascade
from ken.models.certainty import certainty_fn
from ken.models.model import DeviceConfig, Model, ModelSpec, Output


def by_hand(cascade: Cascade, models: dict, values: list) -> list:
    """The definition: each row walks the stages; below threshold -> next stage."""
    out = []
    score = certainty_fn(cascade.certainty)
    for text in values:
        if text is None:
            out.append(None)
            continue
        for i, name in enumerate(cascade.models):
            pred = models[name].predict([text], batch_size=1)
            last = i == len(cascade.models) - 1
            if last or score(pred.probabilities)[0] >= cascade.thresholds[i]:
                out.append(pred.label_strings()[0])
                break
    return out


@pytest.fixture()
def models() -> dict:
    return {n: FakeModel(n) for n in ("a", "b", "c")}


texts_strategy = st.lists(st.one_of(st.none(), st.text(max_size=20)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(values=texts_strategy, t1=st.floats(0.3, 1.0), t2=st.floats(0.3, 1.0),
       stages=st.integers(1, 3), batch=st.integers(1, 9))
def test_cascade_equals_row_by_row(values, t1, t2, stages, batch) -> None:
    models = {n: FakeModel(n) for n in ("a", "b", "c")}
    cascade = Cascade(("a", "b", "c")[:stages], (t1, t2)[: stages - 1])
    result = run_cascade(cascade, models, pa.array(values, pa.string()), batch_size=batch)
    assert result.values == by_hand(cascade, models, values)
    assert isinstance(result.values, list) and len(result.values) == len(values)
    # conservation: every non-NULL row resolved exactly once, at one stage
    non_null = sum(v is not None for v in values)
    assert sum(s.resolved_rows for s in result.stages) == non_null
    assert result.stages[0].input_rows == non_null
    for prev, nxt in zip(result.stages, result.stages[1:], strict=False):
        assert nxt.input_rows == prev.input_rows - prev.resolved_rows


def test_batches_not_rows(models) -> None:
    values = [f"tweet {i}" for i in range(100)]
    result = run_cascade(Cascade(("a",)), models, pa.array(values), batch_size=16)
    assert models["a"].calls == [(100, 16)]  # one batched call, the model batches by 16
    assert result.stages[0].num_batches == 7


def test_nulls_never_reach_a_model(models) -> None:
    values = [None, "x", None, "", "y"]
    result = run_cascade(Cascade(("a", "b"), (0.99,)), models, pa.array(values, pa.string()))
    assert result.values[0] is None and result.values[2] is None
    assert sum(v is None for v in result.values) == 2
    assert None not in models["a"].rows_seen
    assert list(result.stage[[0, 2]]) == [-1, -1]
    assert np.isnan(result.certainty[[0, 2]]).all()


def test_empty_and_all_null_columns(models) -> None:
    assert run_cascade(Cascade(("a",)), models, pa.array([], pa.string())).num_rows == 0
    result = run_cascade(Cascade(("a",)), models, pa.array([None, None]))
    assert result.values == [None, None]
    assert models["a"].calls == []


def test_chunked_large_and_dictionary_columns(models) -> None:
    values = ["p", "q", None, "p"]
    expected = run_cascade(Cascade(("a",)), models, pa.array(values)).values
    chunked = pa.chunked_array([pa.array(values[:2]), pa.array(values[2:], pa.string())])
    for column in (chunked, pa.array(values, pa.large_string()),
                   pa.array(values).dictionary_encode(), values):
        assert run_cascade(Cascade(("a",)), models, column).values == expected


class Judge(Model):
    """A stand-in non-classifier: says whether the text is longer than ``cut`` characters,
    with its own certainty per row (no class probabilities)."""

    def __init__(self, name: str, cut: int) -> None:
        self.spec = ModelSpec(name, "fake", "fake", "", 10, 40, 16, (), f"fp-{name}")
        self.device = DeviceConfig()
        self.cut = cut
        self.seen: list[str] = []

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Output:
        self.seen.extend(texts)
        return Output([len(t) > self.cut for t in texts],
                      np.array([min(1.0, abs(len(t) - self.cut) / 4) for t in texts]))


def test_any_value_type_with_the_models_own_certainty() -> None:
    judges = {"j1": Judge("j1", 3), "j2": Judge("j2", 5)}
    values = ["ab", None, "abcd", "abcdefghij", "abcde", ""]
    result = run_cascade(Cascade(("j1", "j2"), (0.5,), "margin"), judges,
                         pa.array(values, pa.string()), batch_size=2)
    # j1's certainties: 0.25, -, 0.25, 1.0, 0.5, 0.75 -> rows 0 and 2 escalate to j2
    assert result.stage.tolist() == [1, -1, 1, 0, 0, 0]
    assert result.values == [False, None, False, True, True, False]
    assert result.certainty[[0, 2, 3, 4, 5]].tolist() == [0.75, 0.25, 1.0, 0.5, 0.75]
    assert np.isnan(result.certainty[1])
    assert judges["j2"].seen == ["ab", "abcd"]
    assert [s.resolved_rows for s in result.stages] == [3, 2]


@pytest.mark.parametrize("column", [pa.array([1, 2, 3]), pa.array([1.5]), pa.array([True]),
                                    pa.array([b"bytes"]), [1, "mixed"]])
def test_non_text_column_is_a_clear_error(models, column) -> None:
    with pytest.raises(DataError, match="text"):
        run_cascade(Cascade(("a",)), models, column, name="price")
    assert issubclass(DataError, KenError)


def test_bad_cascades(models) -> None:
    with pytest.raises(CascadeError, match="only"):
        run_cascade(Cascade(("a", "zzz"), (0.5,)), models, ["x"])
    with pytest.raises(CascadeError, match="batch size"):
        run_cascade(Cascade(("a",)), models, ["x"], batch_size=0)
    two = {"a": FakeModel("a"), "d": FakeModel("d", ("neg", "pos"))}
    with pytest.raises(CascadeError, match="same labels"):
        run_cascade(Cascade(("a", "d"), (0.5,)), two, ["x"])


def test_cascade_validation() -> None:
    with pytest.raises(CascadeError):
        Cascade(())
    with pytest.raises(CascadeError):
        Cascade(("a", "b"))
    with pytest.raises(CascadeError):
        Cascade(("a", "a"), (0.5,))
    with pytest.raises(CascadeError):
        Cascade(("a",), (), "confidence")
    c = Cascade(("a", "b"), (0.75,), "margin")
    assert Cascade.from_json(c.to_json()) == c
    assert "a -(0.750)-> b" == c.describe()


def test_text_column_types() -> None:
    assert text_column(pa.nulls(3)).type == pa.string()
