"""Certainty functions, the output contract, the escalation rule and the logistic-regression
head."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ken.errors import KenError, ModelError
from ken.models.cascade import Cascade, escalates, escalates_row
from ken.models.certainty import certainty_fn, certainty_of, margin, max_prob, neg_entropy
from ken.models.head import LinearHead, fit_logistic, fit_logistic_cv
from ken.models.model import Output, Prediction


def test_certainty_values() -> None:
    p = np.array([[0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3], [0.0, 1.0, 0.0]])
    assert max_prob(p) == pytest.approx([0.7, 1 / 3, 1.0])
    assert margin(p) == pytest.approx([0.5, 0.0, 1.0])
    h = -(0.7 * np.log(0.7) + 0.2 * np.log(0.2) + 0.1 * np.log(0.1))
    assert neg_entropy(p) == pytest.approx([-h, -np.log(3), 0.0])
    with pytest.raises(KenError, match="max_prob"):
        certainty_fn("confidence")


def test_certainty_of_probabilities_or_own_certainty() -> None:
    p = np.array([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]], dtype=np.float32)
    for name in ("max_prob", "margin", "neg_entropy"):
        got = certainty_of(p, name)
        assert got.dtype == np.float64
        assert got.tolist() == certainty_fn(name)(p).tolist()
    own = np.array([0.9, -1.5, 0.0], dtype=np.float32)  # a model's own certainty per row
    for name in ("max_prob", "margin", "neg_entropy"):
        got = certainty_of(own, name)
        assert got.dtype == np.float64 and got.tolist() == own.astype(np.float64).tolist()
    assert certainty_of(np.zeros((0, 3))).shape == (0,)
    with pytest.raises(KenError, match="max_prob"):
        certainty_of(p, "confidence")


def test_prediction_and_output_share_the_contract() -> None:
    probs = np.array([[0.1, 0.9], [0.6, 0.4], [0.5, 0.5]], dtype=np.float32)
    pred = Prediction(np.array([1, 0, 0]), probs, ("neg", "pos"))
    assert len(pred) == 3
    assert pred.values == ["pos", "neg", "neg"] == pred.label_strings()
    assert pred.scores is probs
    assert pred.certainty().tolist() == pytest.approx([0.9, 0.6, 0.5])
    assert pred.certainty("margin").tolist() == pytest.approx([0.8, 0.2, 0.0])
    out = Output([True, None, 3.5], [0.8, 0.1, 0.5])
    assert len(out) == 3 and out.values == [True, None, 3.5]
    assert out.scores.dtype == np.float64
    for name in ("max_prob", "margin"):  # its own certainty, whatever the function
        assert out.certainty(name).tolist() == [0.8, 0.1, 0.5]
    with pytest.raises(ModelError, match="one certainty per value"):
        Output(["a", "b"], [0.5])
    assert issubclass(ModelError, KenError)


@settings(max_examples=50, deadline=None)
@given(arrays(np.float64, 12, elements=st.floats(-2, 2)), st.floats(-2, 2))
def test_one_escalation_rule(cert, threshold) -> None:
    """Below the threshold escalates, at or above it resolves: array, row and cascade forms
    agree; the last stage passes nothing on."""
    mask = escalates(cert, threshold)
    assert mask.tolist() == [escalates_row(float(c), threshold) for c in cert]
    assert mask.tolist() == [bool(c < threshold) for c in cert]
    cascade = Cascade(("a", "b"), (threshold,))
    assert cascade.escalates(0, cert).tolist() == mask.tolist()
    assert not cascade.escalates(1, cert).any()
    assert not escalates_row(threshold, threshold)


@settings(max_examples=50, deadline=None)
@given(arrays(np.float64, (6, 4), elements=st.floats(0.01, 10)))
def test_certainty_orders_agree_on_extremes(raw) -> None:
    p = raw / raw.sum(axis=1, keepdims=True)
    onehot = np.eye(4)[[0]]
    uniform = np.full((1, 4), 0.25)
    for name in ("max_prob", "margin", "neg_entropy"):
        f = certainty_fn(name)
        assert (f(p) <= f(onehot)[0] + 1e-9).all()
        assert (f(p) >= f(uniform)[0] - 1e-9).all()


def test_head_learns_separable_data_and_round_trips(tmp_path) -> None:
    rng = np.random.default_rng(0)
    centers = np.array([[3.0, 0, 0], [0, 3.0, 0], [0, 0, 3.0]])
    y = rng.integers(0, 3, 600)
    x = centers[y] + rng.normal(size=(600, 3))
    head = fit_logistic_cv(x, y, ("a", "b", "c"))
    acc = (head.predict_proba(x).argmax(axis=1) == y).mean()
    assert acc > 0.9
    probs = head.predict_proba(x[:5])
    assert probs.sum(axis=1) == pytest.approx(np.ones(5), abs=1e-5)
    head.save(tmp_path / "h.safetensors")
    again = LinearHead.load(tmp_path / "h.safetensors")
    assert again.label_names == ("a", "b", "c")
    assert np.array_equal(again.predict_proba(x), head.predict_proba(x))


def test_head_matches_gradient_free_optimum() -> None:
    # the L-BFGS fit reaches a stationary point: the gradient there is ~0
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 2))
    y = (x[:, 0] + 0.5 * rng.normal(size=200) > 0).astype(int)
    head = fit_logistic(x, y, ("n", "p"), l2=1.0)
    z = (x - head.mean) / head.scale
    p = head.predict_proba(x).astype(float)
    onehot = np.eye(2)[y]
    grad_w = z.T @ (p - onehot) / 200 + head.l2 / 200 * head.weight
    assert np.abs(grad_w).max() < 1e-4


def test_head_errors(tmp_path) -> None:
    with pytest.raises(ModelError):
        fit_logistic(np.zeros((0, 2)), np.zeros(0, int), ("a",))
    with pytest.raises(ModelError, match="prepare"):
        LinearHead.load(tmp_path / "missing.safetensors")
