"""Deterministic stand-in models for fast unit tests (no weights; torch only for the
generating stand-ins, ``GatedLM``)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ken.machine import OtherLoad
from ken.models.cascade import Cascade
from ken.models.model import WARM_UP_TEXT, DeviceConfig, Model, ModelSpec, Output, Prediction
from ken.ops.base import ModelOperator
from ken.progress import Reporter

LABELS = ("negative", "neutral", "positive")


class FakeModel(Model):
    """Probabilities derived from a hash of (model name, text); records every call it gets."""

    def __init__(self, name: str, labels: tuple[str, ...] = LABELS, num_inputs: int = 1) -> None:
        self.spec = ModelSpec(name, "fake", "fake", "", 1000, 4000, 16, labels, f"fp-{name}",
                              num_inputs)
        self.device = DeviceConfig()
        self.calls: list[tuple[int, int]] = []  # (rows, batch_size) per predict call
        self.rows_seen: list[str] = []

    def probabilities(self, text: str) -> np.ndarray:
        digest = hashlib.sha256(f"{self.spec.name}|{text}".encode()).digest()
        raw = np.frombuffer(digest[: 4 * len(self.spec.labels)], dtype=np.uint32).astype(float)
        logits = (raw / 2**32) * 4.0
        e = np.exp(logits - logits.max())
        return (e / e.sum()).astype(np.float32)

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        if not any(t == WARM_UP_TEXT for t in texts):  # the engine's warm-up is not counted
            self.calls.append((len(texts), batch_size))
            self.rows_seen.extend(texts)
        probs = np.array([self.probabilities(t) for t in texts], dtype=np.float32).reshape(
            len(texts), len(self.spec.labels))
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, self.spec.labels)


class SlowModel(FakeModel):
    """A fake model whose every call takes ``seconds`` (plus ``per_row_s`` per row)."""

    def __init__(self, name: str, seconds: float, per_row_s: float = 0.0) -> None:
        super().__init__(name)
        self.seconds = seconds
        self.per_row_s = per_row_s

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        time.sleep(self.seconds + self.per_row_s * len(texts))
        return super().predict(texts, batch_size)


class NodeMarking(SlowModel):
    """A ``SlowModel`` that, on its first call, writes the id of the Ray node it runs on into
    ``folder`` (a file per process), so a test knows which node to take away."""

    def __init__(self, name: str, folder: str, seconds: float) -> None:
        super().__init__(name, seconds)
        self.folder = folder
        self._marked = False

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        if not self._marked:
            import os

            import ray

            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
            (Path(self.folder) / f"{os.getpid()}.node").write_text(node)
            self._marked = True
        return super().predict(texts, batch_size)


def wait_for(path: Path, timeout_s: float = 60.0) -> str:
    """The text of ``path`` once a worker (process or Ray actor) has written it."""
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path.name} was never written"
        time.sleep(0.01)
    return path.read_text()


def broken_loader(name: str) -> Model:
    """A loader that fails the way a missing weights file does."""
    raise FileNotFoundError(f"no weights for {name}")


def loads_slowly(name: str, flag: str, seconds: float) -> Model:
    """A loader that leaves ``flag`` and then takes ``seconds`` to load (a model a swapped-in
    plan adds to a running worker)."""
    from pathlib import Path

    Path(flag).write_text("loading")
    time.sleep(seconds)
    return FakeModel(name)


def load_once(name: str, flag: str, seconds: float = 0.0) -> Model:
    """A loader that works once (it leaves ``flag``) and fails every later time: a worker
    that cannot come back after dying."""
    from pathlib import Path

    if Path(flag).exists():
        raise RuntimeError(f"{name}: weights gone")
    Path(flag).write_text("loaded")
    return SlowModel(name, seconds)


def reloads_slowly(name: str, folder: str, first_loads: int, seconds: float,
                   hang_flag: str) -> Model:
    """A loader of ``HangingModel(name, flag=hang_flag)`` (its first call hangs) whose first
    ``first_loads`` loads (the engine's start) are quick and each later one (a worker
    restarted after a kill) takes ``seconds``, leaving ``reloading`` in ``folder`` first."""
    import os
    from pathlib import Path

    n = 0
    while True:  # count the loads across processes: one file each, created exclusively
        try:
            os.close(os.open(os.path.join(folder, f"load-{n}"), os.O_CREAT | os.O_EXCL))
            break
        except FileExistsError:
            n += 1
    if n >= first_loads:
        Path(folder, "reloading").write_text(str(os.getpid()))
        time.sleep(seconds)
    return HangingModel(name, flag=hang_flag)


class HangingModel(FakeModel):
    """A model call that does not return for ``seconds`` (a day by default: for ever, for a
    test), the warm-up excepted; with ``flag``, only the first call hangs (it leaves the flag
    file), so a fresh worker answers."""

    def __init__(self, name: str, seconds: float = 86_400.0, flag: str | None = None) -> None:
        super().__init__(name)
        self.seconds = seconds
        self.flag = flag

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        if WARM_UP_TEXT not in texts:
            from pathlib import Path

            if self.flag is None or not Path(self.flag).exists():
                if self.flag is not None:  # says which process hangs
                    import os

                    Path(self.flag).write_text(str(os.getpid()))
                time.sleep(self.seconds)
        return super().predict(texts, batch_size)


class AnswersOnceThenHangs(FakeModel):
    """Answers its first call at once (it leaves ``flag``, so in every process), then hangs
    ``seconds`` on each later one (the warm-up excepted): a model that was seen to be fast,
    then stopped returning."""

    def __init__(self, name: str, flag: str, seconds: float = 86_400.0) -> None:
        super().__init__(name)
        self.flag = flag
        self.seconds = seconds

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        if WARM_UP_TEXT not in texts:
            from pathlib import Path

            if Path(self.flag).exists():
                time.sleep(self.seconds)
            else:
                Path(self.flag).write_text("answered once")
        return super().predict(texts, batch_size)


class CrashingModel(FakeModel):
    """A model whose every call (the warm-up excepted) ends its process at once, the way a
    crash in native code does."""

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        if WARM_UP_TEXT not in texts:
            import os

            os._exit(70)
        return super().predict(texts, batch_size)


class CrashesOn(FakeModel):
    """A model whose calls end its process at once when a row holds ``word`` (an input that
    crashes native code), and take ``slow_s`` when a row holds ``slow_word``; other calls
    answer as ``FakeModel``."""

    def __init__(self, name: str, word: str, slow_word: str | None = None,
                 slow_s: float = 0.0, slow_flag: str | None = None) -> None:
        """``slow_flag``: a file written when a slow call starts."""
        super().__init__(name)
        self.word = word
        self.slow_word = slow_word
        self.slow_s = slow_s
        self.slow_flag = slow_flag

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        if any(self.word in t for t in texts):
            import os

            os._exit(70)
        if self.slow_word is not None and any(self.slow_word in t for t in texts):
            if self.slow_flag is not None:
                from pathlib import Path

                Path(self.slow_flag).write_text("slow call started")
            time.sleep(self.slow_s)
        return super().predict(texts, batch_size)


class EnvModel(Model):
    """Answers every row with the ``CUDA_VISIBLE_DEVICES`` of the process it runs in
    (``"<unset>"`` when unset): which GPUs a worker was given."""

    def __init__(self, name: str) -> None:
        self.spec = ModelSpec(name, "fake", "fake", "", 1, 1, 16, (), f"fp-{name}")
        self.device = DeviceConfig()

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Output:
        import os

        seen = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        return Output([seen] * len(texts), np.ones(len(texts)))


class FreezeCount(Model):
    """Answers every row with how many objects Python's collector holds frozen in the process
    it runs in (``gc.get_freeze_count()``): what a worker froze after loading."""

    def __init__(self, name: str) -> None:
        self.spec = ModelSpec(name, "fake", "fake", "", 1, 1, 16, (), f"fp-{name}")
        self.device = DeviceConfig()

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Output:
        import gc

        return Output([str(gc.get_freeze_count())] * len(texts), np.ones(len(texts)))


class GpuHog(Model):
    """Holds ``mb`` MB on the process's GPU (cuda:0) from its load on, and answers every row
    with the GPU's name: a model whose GPU memory the engine can check."""

    def __init__(self, name: str, mb: int) -> None:
        import torch

        self.spec = ModelSpec(name, "fake", "fake", "", 1, mb * 2**20, 16, (), f"fp-{name}")
        self.device = DeviceConfig("cuda", 0)
        self.held = torch.empty(mb * 2**20, dtype=torch.uint8, device="cuda:0")
        self.gpu = torch.cuda.get_device_name(0)

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Output:
        return Output([self.gpu] * len(texts), np.ones(len(texts)))


class FixedReplan:
    """A picklable re-planner (so ``Replanner`` runs it in its planner process) that returns
    ``plan`` and records, in its own state, how often and in which process it ran."""

    def __init__(self, plan: object) -> None:
        self.plan = plan
        self.calls = 0
        self.pid: int | None = None
        self.nice: int | None = None

    def __call__(self, trace: object, drift: object) -> object:
        import os

        self.calls += 1
        self.pid = os.getpid()
        self.nice = os.getpriority(os.PRIO_PROCESS, 0)
        return self.plan


def failing_plan(trace: object, drift: object) -> object:
    raise ValueError("no plan fits")


class Profiled(ModelOperator):
    """A cascade operator whose profiles were measured elsewhere: ``source(threads)`` returns
    them (synthetic profiles with known runtimes and per-row outcomes)."""

    def __init__(self, name: str, cascade: Cascade, models: dict, source, **kwargs) -> None:  # noqa: ANN001, ANN003
        super().__init__(name, cascade, models, **kwargs)
        self.source = source

    def plannable(self) -> bool:
        return True

    def profiles(self, ctx, threads):  # noqa: ANN001, ANN201
        return self.source(threads)


# -- a generating model for decode servers ---------------------------------------------------


class GatedLM:
    """A causal LM stand-in for a decode server: a one-layer random Llama (64 token ids), a
    tokenizer that spells token ids, and a gate every forward pass waits at, so a test holds
    a pass open while it shuts the server down (``entered``: a pass is waiting)."""

    def __init__(self) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from ken.models.model import DeviceConfig

        torch.manual_seed(0)
        self.net = LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
            eos_token_id=None, bos_token_id=None, pad_token_id=0)).eval()
        self.tokenizer = SpellingTokenizer()
        self.device = DeviceConfig()
        self.pad_id = 0
        self.context_tokens = 128
        self.gate, self.entered = threading.Event(), threading.Event()
        inner = self.net.forward

        def gated(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.entered.set()
            assert self.gate.wait(timeout=60), "the test never opened the gate"
            return inner(*args, **kwargs)

        self.net.forward = gated


class SpellingTokenizer:
    eos_token_id = None
    unk_token_id = None

    def convert_tokens_to_ids(self, token: str) -> None:
        return None

    def decode(self, tokens, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        return " ".join(f"t{t}" for t in tokens)


class StandInGenerator:
    """What a ``CascadeServer`` needs of a ``GenerativeModel``: a row's prompt (its token ids:
    one per character code, mod 60, plus 1), 4 new tokens, no stop string, the answer's value
    (its text)."""

    def __init__(self, lm: GatedLM) -> None:
        self.lm = lm
        self.stop = ()
        self.max_new_tokens = 4
        self.certainty_kind = "mean_prob"
        self.finish = None

    def requests(self, rows) -> list[list[int] | None]:  # noqa: ANN001
        return [None if not r else [1 + ord(c) % 60 for c in r] for r in rows]

    def value(self, text: str, row) -> str:  # noqa: ANN001
        return text


def gen_plan(function: str = "gen"):  # noqa: ANN201
    from ken.policy.plan import single_gear

    return single_gear(function, Cascade(("g",)), max_running=2)


def two_replica_plan():  # noqa: ANN201
    """a on cpu0 and on cpu1, half the rows each; 10 ms a batch of <= 4 rows; target 50 ms."""
    from ken.policy.plan import GearPlan, PlanMetrics, RangeSchedule, Replica

    return GearPlan("op", (0.0, 1e6), (Cascade(("a",)),),
                    (Replica("a", ("cpu0",)), Replica("a", ("cpu1",))),
                    (RangeSchedule(0, (0.5, 0.5), (1, 1)),), (4, 4), max_wait_s=0.005,
                    predicted=PlanMetrics(1.0, 25.0, 45.0, 50.0, 25.0, 1000, 0, 10.0),
                    batch_runtime_s=((0.01,) * 4, (0.01,) * 4))


class Warnings(Reporter):
    """A quiet reporter that keeps the warnings and notes it is given."""

    def __init__(self) -> None:
        super().__init__(quiet=True)
        self.warnings: list[str] = []
        self.notes: list[str] = []

    def note(self, message: str) -> None:
        self.notes.append(message)

    def warn(self, message: str) -> None:
        self.warnings.append(message)


def fake_loads(cores: list[float | None]) -> type[OtherLoad]:
    """An ``OtherLoad`` that reports ``cores`` in turn, one per measurement."""
    seen = iter(cores)

    class Fake(OtherLoad):
        def __exit__(self, *exc: object) -> None:
            self.cores = next(seen)

    return Fake
