"""The model interface every backend implements, and the data it exchanges."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ken.errors import KenError


@dataclass(frozen=True)
class DeviceConfig:
    """Where and how a model runs: a device kind, its index and (for CPU) a thread count."""

    kind: str = "cpu"
    index: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "cuda"):
            raise KenError(f"device kind must be 'cpu' or 'cuda', not {self.kind!r}")
        if self.threads < 1:
            raise KenError(f"a device needs at least one thread, got {self.threads}")

    @property
    def torch_device(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def label(self) -> str:
        """Short stable name, used in cache keys and tables (``cpu-2t``, ``cuda0``)."""
        return f"cpu-{self.threads}t" if self.kind == "cpu" else f"cuda{self.index}"


@dataclass(frozen=True)
class ModelSpec:
    """What a model is, independent of where it runs."""

    name: str
    family: str
    backend: str
    source: str  # a local folder or a hub model id
    num_params: int
    memory_bytes: int  # resident weights (fp32)
    max_tokens: int  # inputs are truncated to this many tokens
    labels: tuple[str, ...]
    fingerprint: str = ""  # content hash of weights + head; keys the profile cache
    num_inputs: int = 1  # texts per row: 1, or 2 for pair models (predict gets tuples)


@dataclass(frozen=True, eq=False)
class Prediction:
    """Batched classifier output: label index and class probabilities per row."""

    labels: np.ndarray  # int64, shape (rows,)
    probabilities: np.ndarray  # float32, shape (rows, classes)
    label_names: tuple[str, ...]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def label_strings(self) -> list[str]:
        return [self.label_names[i] for i in self.labels]


class Model(ABC):
    """A classifier that maps a batch of texts to labels and probabilities."""

    spec: ModelSpec
    device: DeviceConfig

    @property
    def name(self) -> str:
        return self.spec.name

    @abstractmethod
    def predict(self, texts: Sequence, batch_size: int = 32) -> Prediction:
        """Classify ``texts``; runs in batches of ``batch_size``; output is in input order.

        ``texts`` holds strings, or tuples of ``spec.num_inputs`` strings for pair models.
        """
