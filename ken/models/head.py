"""Classification heads trained on frozen features: multinomial logistic regression."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file
from scipy.optimize import minimize
from scipy.special import log_softmax, softmax

from ken import store
from ken.errors import ModelError


@dataclass(frozen=True, eq=False)
class LinearHead:
    """``softmax(((x - mean) / scale) @ weight + bias)`` over ``label_names``."""

    weight: np.ndarray = field(repr=False)  # (features, classes)
    bias: np.ndarray = field(repr=False)  # (classes,)
    mean: np.ndarray = field(repr=False)  # (features,)
    scale: np.ndarray = field(repr=False)  # (features,)
    label_names: tuple[str, ...]
    l2: float = 1.0

    @property
    def num_params(self) -> int:
        return int(self.weight.size + self.bias.size)

    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        x = (np.asarray(features, dtype=np.float64) - self.mean) / self.scale
        return softmax(x @ self.weight + self.bias, axis=1).astype(np.float32)

    def save(self, path: Path) -> None:
        """Write the head to ``path`` (safetensors) atomically."""
        with store.atomic_path(path) as tmp:
            save_file(
                {"weight": self.weight, "bias": self.bias, "mean": self.mean,
                 "scale": self.scale},
                str(tmp),
                metadata={"label_names": json.dumps(list(self.label_names)),
                          "l2": str(self.l2)},
            )

    @classmethod
    def load(cls, path: Path) -> LinearHead:
        """The head saved at ``path``; a file that is not a complete head is a ModelError
        naming it (callers verify store files first, see ``ken.store``)."""
        from safetensors import safe_open

        if not path.exists():
            raise ModelError(f"no classification head at {path}; run `ken models prepare`")
        try:
            tensors = load_file(str(path))
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
            return cls(tensors["weight"], tensors["bias"], tensors["mean"], tensors["scale"],
                       tuple(json.loads(meta["label_names"])), float(meta.get("l2", 1.0)))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise ModelError(f"cannot read the classification head {path}: "
                             f"{type(exc).__name__}: {exc}") from None


def fit_logistic(features: np.ndarray, labels: np.ndarray, label_names: tuple[str, ...],
                 l2: float = 1.0, max_iter: int = 500) -> LinearHead:
    """Fit L2-regularised softmax regression with L-BFGS on standardised features.

    ``l2`` is the penalty on the summed squared weights (bias unpenalised); the loss is the mean
    negative log-likelihood plus ``l2 / n * ||W||^2 / 2``, so ``l2`` behaves like ``1 / C`` in
    scikit-learn.
    """
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    n, d = x.shape
    k = len(label_names)
    if n == 0 or y.min() < 0 or y.max() >= k:
        raise ModelError(f"cannot fit a head: {n} rows, labels outside 0..{k - 1} or none")
    mean = x.mean(axis=0)
    scale = x.std(axis=0) + 1e-6
    z = (x - mean) / scale
    onehot = np.zeros((n, k))
    onehot[np.arange(n), y] = 1.0

    def loss_grad(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w = theta[: d * k].reshape(d, k)
        b = theta[d * k:]
        logits = z @ w + b
        logp = log_softmax(logits, axis=1)
        loss = -(onehot * logp).sum() / n + 0.5 * l2 / n * (w * w).sum()
        diff = (np.exp(logp) - onehot) / n
        grad_w = z.T @ diff + l2 / n * w
        grad_b = diff.sum(axis=0)
        return float(loss), np.concatenate([grad_w.ravel(), grad_b])

    result = minimize(loss_grad, np.zeros(d * k + k), jac=True, method="L-BFGS-B",
                      options={"maxiter": max_iter})
    w = result.x[: d * k].reshape(d, k)
    b = result.x[d * k:]
    return LinearHead(w.astype(np.float32), b.astype(np.float32), mean.astype(np.float32),
                      scale.astype(np.float32), tuple(label_names), l2)


def fit_logistic_cv(features: np.ndarray, labels: np.ndarray, label_names: tuple[str, ...],
                    l2_grid: tuple[float, ...] = (1.0, 10.0, 100.0, 1000.0), seed: int = 0
                    ) -> LinearHead:
    """Pick the L2 strength on a 20% validation split of the training rows, then refit on all."""
    n = len(labels)
    order = np.random.default_rng(seed).permutation(n)
    cut = max(1, n // 5)
    val, fit = order[:cut], order[cut:]
    best_l2, best_acc = l2_grid[0], -1.0
    for l2 in l2_grid:
        head = fit_logistic(features[fit], labels[fit], label_names, l2)
        acc = float((head.predict_proba(features[val]).argmax(axis=1) == labels[val]).mean())
        if acc > best_acc:
            best_l2, best_acc = l2, acc
    return fit_logistic(features, labels, label_names, best_l2)
