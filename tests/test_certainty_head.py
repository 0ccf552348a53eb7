"""Certainty functions and the logistic-regression head."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ken.errors import KenError, ModelError
from ken.models.certainty import certainty_fn, margin, max_prob, neg_entropy
from ken.models.head import LinearHead, fit_logistic, fit_logistic_cv


def test_certainty_values() -> None:
    p = np.array([[0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3], [0.0, 1.0, 0.0]])
    assert max_prob(p) == pytest.approx([0.7, 1 / 3, 1.0])
    assert margin(p) == pytest.approx([0.5, 0.0, 1.0])
    h = -(0.7 * np.log(0.7) + 0.2 * np.log(0.2) + 0.1 * np.log(0.1))
    assert neg_entropy(p) == pytest.approx([-h, -np.log(3), 0.0])
    with pytest.raises(KenError, match="max_prob"):
        certainty_fn("confidence")


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
