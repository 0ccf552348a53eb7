"""The model interface every backend implements, and the data it exchanges.

A model maps a batch of inputs to one value per row and one certainty per row (the output
contract). Values may be labels, booleans, numbers or generated text: :class:`Output`.
Classifiers are the fast special case, :class:`Prediction`: label indices plus class
probabilities, from which any certainty function (``max_prob``, ``margin``, ...) is computed.
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ken.errors import KenError, ModelError
from ken.models.certainty import certainty_of

#: label order of every boolean classifier (``sem_filter``, ``sem_match`` models)
BOOLEAN_LABELS = ("false", "true")


#: weight precisions a device can run in ("auto": see ``DeviceConfig.dtype_name``)
PRECISIONS = ("auto", "fp32", "bf16", "fp16")

#: what "auto" means on a GPU: fp16. Both half precisions run at the same tensor-core rate, and
#: fp16 keeps 3 more mantissa bits. Measured on the packaged sentiment family on a CPU
#: (``benchmarks/gpu_overhead.py --part quality``, 300 held-out rows): neither changes a label
#: of any member, but fp16 features stay within cosine 0.99995 of fp32's (class probabilities
#: move by at most 0.005) where bf16 drops to 0.984 on SmolLM2's layer-15 features (0.068);
#: SmolLM2's greedy answers equal fp32's on 23 of 24 chat prompts in fp16, 19 of 24 in bf16;
#: nothing overflowed fp16's range. Qwen2.5-Coder was not measured (not prepared there); Qwen
#: models are trained in bf16, so check it with the benchmark before serving it in fp16.
CUDA_AUTO_PRECISION = "fp16"

#: what "auto" means for a causal LM on a CPU that multiplies bf16 natively (``cpu_has_bf16``):
#: bf16. Measured on this project's CPU (AMD EPYC, avx512_bf16; ``python
#: benchmarks/llm_precision.py``, docs/results.md): ``sem_qa`` and ``sem_map`` serve 2.3-2.5x
#: (SmolLM2-135M) and 3.2-3.4x (Qwen2.5-Coder-0.5B) the rows/s of fp32, with 96% of Qwen's
#: ``sem_qa`` answers unchanged (F1 51.6 against 51.9). Encoders stay fp32 on
#: CPUs (their profiles and plans are measured so). int8 (torch dynamic quantisation) was as fast
#: and changed most answers: it is not offered. Without native bf16 a CPU emulates it slowly, so
#: "auto" is fp32 there.
CPU_LLM_AUTO_PRECISION = "bf16"

#: environment variable that overrides "auto" for causal LMs on a CPU: ``fp32`` or ``bf16``
LLM_PRECISION_ENV = "KEN_LLM_PRECISION"


@functools.lru_cache(maxsize=4)
def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 natively: ``avx512_bf16`` or ``amx_bf16`` among the
    flags of ``cpuinfo`` (False where that file is absent, as on macOS)."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool({"avx512_bf16", "amx_bf16"} & set(line.partition(":")[2].split()))
    return False


@dataclass(frozen=True)
class DeviceConfig:
    """Where and how a model runs: a device kind, its index, (for CPU) a thread count, and the
    precision its weights are loaded in (``auto``: fp32 on CPU, ``CUDA_AUTO_PRECISION`` on a
    GPU; a causal LM resolves it with :meth:`for_causal_lm`, bf16 on CPUs that have it)."""

    kind: str = "cpu"
    index: int = 0
    threads: int = 1
    precision: str = "auto"

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "cuda"):
            raise KenError(f"device kind must be 'cpu' or 'cuda', not {self.kind!r}")
        if self.threads < 1:
            raise KenError(f"a device needs at least one thread, got {self.threads}")
        if self.precision not in PRECISIONS:
            raise KenError(f"precision must be one of {', '.join(PRECISIONS)}, not "
                           f"{self.precision!r}")

    @property
    def torch_device(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def dtype_name(self) -> str:
        """The precision weights are loaded in, ``auto`` resolved: fp32, bf16 or fp16."""
        if self.precision != "auto":
            return self.precision
        return "fp32" if self.kind == "cpu" else CUDA_AUTO_PRECISION

    def for_causal_lm(self) -> DeviceConfig:
        """This device with "auto" resolved for a causal LM: on a CPU ``$KEN_LLM_PRECISION``
        if set, else ``CPU_LLM_AUTO_PRECISION`` where the CPU multiplies bf16 natively, else
        fp32; a GPU's "auto" is already ``CUDA_AUTO_PRECISION``. An explicit precision is
        kept. The label then names the precision, so profiles and caches keep them apart."""
        if self.precision != "auto" or self.kind != "cpu":
            return self
        forced = os.environ.get(LLM_PRECISION_ENV, "").strip().lower()
        if forced:
            if forced not in ("fp32", "bf16"):
                raise KenError(f"{LLM_PRECISION_ENV} must be fp32 or bf16, not {forced!r}")
            return replace(self, precision=forced)
        return replace(self, precision=CPU_LLM_AUTO_PRECISION if cpu_has_bf16() else "fp32")

    @property
    def torch_dtype(self) -> Any:
        """``dtype_name`` as a torch dtype (what ``from_pretrained`` loads weights in)."""
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16,
                "fp16": torch.float16}[self.dtype_name]

    @property
    def label(self) -> str:
        """Short stable name, used in cache keys and tables (``cpu-2t``, ``cuda0-fp16``); the
        precision is named unless it is fp32, so fp32 keys stay what they always were."""
        base = f"cpu-{self.threads}t" if self.kind == "cpu" else f"cuda{self.index}"
        return base if self.dtype_name == "fp32" else f"{base}-{self.dtype_name}"


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
    labels: tuple[str, ...]  # class labels of a classifier; () for other output types
    fingerprint: str = ""  # content hash of weights + head; keys the profile cache
    num_inputs: int = 1  # texts per row: 1, or 2 for pair models (predict gets tuples)


@dataclass(frozen=True, eq=False)
class Prediction:
    """Batched classifier output: label index and class probabilities per row."""

    labels: np.ndarray  # int64, shape (rows,)
    probabilities: np.ndarray  # float32, shape (rows, classes)
    label_names: tuple[str, ...]
    # each row's size as the model ran it (``Model.row_sizes``), where the model gives it
    row_sizes: np.ndarray | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def label_strings(self) -> list[str]:
        return [self.label_names[i] for i in self.labels]

    @property
    def values(self) -> list[str]:
        """The predicted label of each row (the output contract's values)."""
        return self.label_strings()

    @property
    def scores(self) -> np.ndarray:
        """What certainties are computed from: the class probabilities."""
        return self.probabilities

    def certainty(self, kind: str = "max_prob") -> np.ndarray:
        """Certainty per row, by the named function of the class probabilities."""
        return certainty_of(self.probabilities, kind)


@dataclass(frozen=True, eq=False)
class Output:
    """Batched output of any model: one value per row and the model's certainty per row.

    ``values`` hold Python values (``str``, ``bool``, ``int``, ``float``; ``None`` where the
    model has no answer). ``scores`` is the model's own certainty (larger is surer), e.g. the
    probability of a scored choice or a length-normalised sequence log-probability. For
    generation, ``token_counts`` (generated tokens per row) and per-token ``logprobs`` may be
    given.

    >>> out = Output(["yes", "no"], np.array([0.9, 0.6]))
    >>> out.values, out.certainty().tolist()
    (['yes', 'no'], [0.9, 0.6])
    """

    values: list[Any]
    scores: np.ndarray  # float64 (rows,)
    token_counts: np.ndarray | None = field(default=None, repr=False)
    logprobs: tuple[np.ndarray, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", list(self.values))
        scores = np.asarray(self.scores, dtype=np.float64).reshape(-1)
        object.__setattr__(self, "scores", scores)
        if scores.shape[0] != len(self.values):
            raise ModelError(f"an output needs one certainty per value: {len(self.values)} "
                             f"values, {scores.shape[0]} certainties")

    def __len__(self) -> int:
        return len(self.values)

    def certainty(self, kind: str = "max_prob") -> np.ndarray:
        """The model's own certainty per row. Certainty functions of class probabilities
        (``kind``) apply to classifiers only; other outputs carry their certainty."""
        return self.scores


WARM_UP_TEXT = ("a warm-up row: the first calls of a freshly loaded model page in its weights "
                "and set up its kernels, which would otherwise stall the first requests")

#: what ``Model.predict`` returns: both have ``values`` and ``certainty(kind)``
ModelOutput = Prediction | Output


class Model(ABC):
    """A model that maps a batch of texts to one value and one certainty per row."""

    spec: ModelSpec
    device: DeviceConfig

    @property
    def name(self) -> str:
        return self.spec.name

    def warm_up(self, max_batch: int = 8) -> None:
        """Run a few batches before serving or timing: a fresh process's first forward pass
        pages in the weights and initialises kernels (up to a second for the larger models).
        Models on a GPU also see every input shape they will be given (see
        ``TransformersClassifier.warm_up``)."""
        row: object = WARM_UP_TEXT if self.spec.num_inputs == 1 else (WARM_UP_TEXT,) * 2
        for n in (1, min(8, max_batch), 1):
            self.predict([row] * n, batch_size=n)

    def row_sizes(self, rows: Sequence) -> np.ndarray:
        """Each row's size as this model's runtime grows with it (int64): the characters of its
        text (``row_size``); models that run tokens count the tokens they run. A model's
        outputs carry the same sizes where they give any (``Prediction.row_sizes``)."""
        return np.fromiter((row_size(r) for r in rows), dtype=np.int64, count=len(rows))

    @abstractmethod
    def predict(self, texts: Sequence, batch_size: int = 32) -> ModelOutput:
        """Answer ``texts``; runs in batches of ``batch_size``; output is in input order.

        Classifiers return a :class:`Prediction`, other models an :class:`Output`.

        ``texts`` holds strings, or tuples of ``spec.num_inputs`` strings for pair models.
        """


def row_size(row: object) -> int:
    """How big a row is for a model's runtime: the characters of its text (of all its texts
    for a pair or record); 0 for inputs that are not text."""
    if isinstance(row, str | bytes):
        return len(row)
    if isinstance(row, tuple | list):
        return sum(row_size(x) for x in row)
    if isinstance(row, dict):
        return sum(row_size(x) for x in row.values())
    return 0
