"""Device workers: where an engine's batches run (DESIGN.md section 6; issue 5).

A *runner* owns the models placed on one device and runs one batch at a time:

- ``ProcessRunner``: the device is its own process (a fresh Python process), with its own
  torch thread count and its own copy of the models, loaded from picklable zero-argument
  loaders before serving starts. Nothing is shared with other devices, not even the GIL. If
  the process dies (killed, out of memory, a crash in native code) the runner starts a fresh
  one, reloads the models, and reports ``WorkerDied``; the engine then runs the batch again.
- ``ThreadRunner``: the device is a thread of the engine's process calling already-loaded
  ``Model`` objects (shared by every device). Used for models that cannot be pickled (tests,
  models built in a notebook); torch releases the GIL inside model calls, but tokenisation and
  Python code of two devices still take turns.

Both return ``(values, scores)`` from ``run`` (one value per row, and the class probabilities
of a classifier or the model's own certainty per row) or raise ``WorkerError``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection

import numpy as np

from ken.errors import WorkerDied, WorkerError
from ken.models.model import Model, ModelOutput

Loader = Callable[[], Model]
Answers = tuple[list, np.ndarray]  # (values, scores), see the module docstring


WARM_UP_TEXT = ("a warm-up row: the first calls of a freshly loaded model page in its weights "
                "and set up its kernels, which would otherwise stall the first requests")


def warm_up(model: Model) -> None:
    """Run ``model`` on a few batches before it serves (a fresh process's first forward pass
    pages in the weights and initialises kernels: up to a second for the larger models)."""
    if model.spec.num_inputs != 1:
        rows: list = [(WARM_UP_TEXT, WARM_UP_TEXT)]
    else:
        rows = [WARM_UP_TEXT]
    for n in (1, 8, 1):
        model.predict(rows * n, batch_size=n)


def answers(out: ModelOutput, rows: int) -> Answers:
    """``(values, scores)`` of a model's output, checked to have one answer per row."""
    values, scores = list(out.values), np.asarray(out.scores)
    if len(values) != rows or scores.shape[0] != rows:
        raise WorkerError(f"the model answered {len(values)} of {rows} rows")
    return values, scores


class ThreadRunner:
    """A device served by a thread of this process, calling shared loaded models."""

    mode = "thread"

    def __init__(self, device: str, models: Mapping[str, Model]) -> None:
        self.device = device
        self.models = models  # shared dict: models added later are seen here too
        self.pid: int | None = None

    def start(self) -> dict[str, float]:
        return {}

    def rss_bytes(self) -> int | None:
        return None  # threads share the engine's process: no per-device figure

    def load(self, name: str, source: Model | Loader) -> float:
        return 0.0  # the engine loads shared models once, for every thread runner

    def run(self, model: str, texts: Sequence[str]) -> Answers:
        try:
            out = self.models[model].predict(list(texts), batch_size=max(len(texts), 1))
            return answers(out, len(texts))
        except Exception as exc:  # noqa: BLE001 - any model failure is reported, re-run
            raise WorkerError(f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        pass


def _serve(inp: Connection, out: Connection, threads: int) -> None:
    """Body of a worker process: load every model, then answer batches until told to stop."""
    sys.path[:0] = [p for p in inp.recv() if p not in sys.path]  # the engine's import path
    try:
        import torch

        torch.set_num_threads(threads)
    except ImportError:  # fake models in tests need no torch
        pass
    models: dict[str, Model] = {}

    def load(name: str, loader: Loader) -> None:
        started = time.perf_counter()
        models[name] = loader()
        warm_up(models[name])
        out.send(("loaded", name, time.perf_counter() - started))

    try:
        for name, loader in inp.recv().items():
            load(name, loader)
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it
        out.send(("load_error", f"{type(exc).__name__}: {exc}"))
        return
    out.send(("ready",))
    while True:
        try:
            msg = inp.recv()
        except EOFError:  # the engine is gone
            return
        if msg is None:
            return
        if msg[0] == "load":
            try:
                load(msg[1], msg[2])
            except Exception as exc:  # noqa: BLE001
                out.send(("load_error", f"{type(exc).__name__}: {exc}"))
            continue
        _, model, texts = msg
        try:
            values, scores = answers(models[model].predict(texts, batch_size=max(len(texts), 1)),
                                     len(texts))
            out.send(("ok", values, scores))
        except Exception as exc:  # noqa: BLE001 - the engine decides whether to re-run
            out.send(("error", f"{type(exc).__name__}: {exc}"))


class ProcessRunner:
    """A device served by its own process (see the module docstring)."""

    mode = "process"

    def __init__(self, device: str, sources: Mapping[str, Loader], threads: int = 1,
                 start_timeout_s: float = 600.0) -> None:
        self.device = device
        self.sources = dict(sources)
        self.threads = threads
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._send: Connection | None = None
        self._recv: Connection | None = None
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def rss_bytes(self) -> int | None:
        """Resident memory of the worker process (None if it is not running)."""
        if self._proc is None:
            return None
        try:
            with open(f"/proc/{self._proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def start(self) -> dict[str, float]:
        """Start the process and wait until it has loaded every model; seconds per model.

        The worker is a fresh ``python`` running ``main`` below, talking over two pipes, so it never
        imports the caller's ``__main__`` (no ``if __name__ == "__main__"`` guard needed)."""
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from ken.engine.workers import main; "
             "sys.exit(main(sys.argv[1:]))", str(to_child_r), str(to_parent_w),
             str(self.threads), self.device],
            pass_fds=(to_child_r, to_parent_w), stdin=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(to_parent_w)
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(to_parent_r, writable=False)
        self._send.send(list(sys.path))
        self._send.send(self.sources)
        seconds: dict[str, float] = {}
        while True:
            msg = self._receive(self.start_timeout_s, "while loading its models")
            if msg[0] == "loaded":
                seconds[msg[1]] = msg[2]
            elif msg[0] == "ready":
                return seconds
            else:
                self.close()
                raise WorkerError(f"worker {self.device} could not load its models: {msg[1]}")

    def load(self, name: str, source: Model | Loader) -> float:
        """Load one more model in the running process (e.g. for a swapped-in plan)."""
        if isinstance(source, Model):
            raise WorkerError(f"{name}: a process worker needs a loader, not a loaded model")
        assert self._send is not None
        self.sources[name] = source
        self._send.send(("load", name, source))
        msg = self._receive(self.start_timeout_s, f"while loading {name}")
        if msg[0] != "loaded":
            raise WorkerError(f"worker {self.device} could not load {name}: {msg[1]}")
        return msg[2]

    def run(self, model: str, texts: Sequence[str]) -> Answers:
        if self._proc is None:  # an earlier restart failed: try again (WorkerError if not)
            self.start()
        assert self._send is not None and self._recv is not None
        try:
            self._send.send(("run", model, list(texts)))
            msg = self._recv.recv()
        except (EOFError, OSError):
            code = self._proc.wait(timeout=5.0) if self._proc is not None else None
            died = (f"worker process of {self.device} died (exit code {code}) while running "
                    f"{model} on {len(texts)} rows")
            try:
                self._restart()
            except WorkerError as exc:
                raise WorkerDied(f"{died}; restarting it failed: {exc}") from None
            raise WorkerDied(died) from None
        if msg[0] == "ok":
            return msg[1], msg[2]
        raise WorkerError(msg[1])

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            if self._send is not None:
                self._send.send(None)
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5.0)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for c in (self._send, self._recv):
            if c is not None:
                c.close()
        self._proc = self._send = self._recv = None

    def _restart(self) -> None:
        self.restarts += 1
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=5.0)
        self._close_pipes()
        self.start()

    def _receive(self, timeout_s: float, doing: str) -> tuple:
        assert self._recv is not None
        try:
            if not self._recv.poll(timeout_s):
                self.close()
                raise WorkerError(f"worker {self.device} did not answer within "
                                  f"{timeout_s:.0f} s {doing}")
            return self._recv.recv()
        except (EOFError, OSError):
            code = self._proc.wait(timeout=5.0) if self._proc is not None else None
            self._close_pipes()
            raise WorkerError(f"worker process of {self.device} ended (exit code {code}) "
                              f"{doing}") from None


def main(argv: Sequence[str]) -> int:
    """Entry point of a worker process; arguments: IN OUT pipe fds, THREADS, DEVICE."""
    inp = Connection(int(argv[0]), writable=False)
    out = Connection(int(argv[1]), readable=False)
    _serve(inp, out, int(argv[2]))
    return 0
