"""Device workers: where an engine's batches run (DESIGN.md sections 6 and 14; issue 5).

A *runner* owns the models placed on one device and runs one batch at a time:

- ``ProcessRunner``: the device is its own process (a fresh Python process), with its own
  torch thread count and its own copy of the models, loaded from picklable zero-argument
  loaders before serving starts. Nothing is shared with other devices, not even the GIL. A
  batch that runs past its deadline gets its process killed (``BatchTimeout``); a process that
  dies (killed, out of memory, a crash in native code) is reported as ``WorkerDied``. Either
  way the next batch on the device starts a fresh process first (reloading the models), except
  once the engine is shutting down (``closing``): then nothing is restarted.
- ``ThreadRunner``: the device is a thread of the engine's process calling already-loaded
  ``Model`` objects (shared by every device). Used for models that cannot be pickled (tests,
  models built in a notebook); torch releases the GIL inside model calls, but tokenisation and
  Python code of two devices still take turns. A thread cannot be killed: a call past its
  deadline is abandoned (it may go on running, and using a core, until it returns; its answer
  is dropped) and the device goes on with a fresh thread.

Both return ``(values, scores, largest)`` from ``run`` (one value per row, the class
probabilities of a classifier or the model's own certainty per row, and the size of the
batch's largest row as the model counts sizes, ``Model.row_sizes``) or raise ``WorkerError``.

A worker process lives only as long as its engine wants it: it ignores SIGINT and SIGTERM
(Ctrl-C in a terminal or a SIGTERM to the process group reaches every process; the engine
drains and then stops its workers), and it exits quietly, without a traceback, when the engine
process is gone: at the end of its pipe, on a broken pipe, or, while a model call is stuck,
when a watchdog thread sees that its parent process changed.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection

import numpy as np

from ken.engine.collector import settle_worker
from ken.errors import BatchTimeout, WorkerDied, WorkerError
from ken.machine import process_rss_bytes
from ken.models.model import Model, ModelOutput
from ken.optimizer.workload import GPU_ID

Loader = Callable[[], Model]
Answers = tuple[list, np.ndarray, int]  # (values, scores, largest), see the module docstring

#: how often a worker process checks that its parent is still there (while a call is stuck)
PARENT_CHECK_S = 0.2


def answers(model: Model, texts: Sequence, out: ModelOutput) -> Answers:
    """``(values, scores, largest)`` of ``model``'s output on ``texts``, checked to have one
    answer per row; ``largest`` is the size of the largest row (``Model.row_sizes``: from the
    output where the model gives it, as a classifier on a transformers body does, so nothing
    is counted twice)."""
    rows = len(texts)
    values, scores = list(out.values), np.asarray(out.scores)
    if len(values) != rows or scores.shape[0] != rows:
        raise WorkerError(f"the model answered {len(values)} of {rows} rows")
    sizes = getattr(out, "row_sizes", None)
    if sizes is None or len(sizes) != rows:
        sizes = model.row_sizes(texts)
    return values, scores, int(max(sizes, default=0))


def load_models(loaders: Mapping[str, Loader], into: dict[str, Model], threads: int,
                driver_pid: int | None = None) -> dict[str, float]:
    """In a worker (process or Ray actor): load and warm up the models of ``loaders`` that
    ``into`` does not hold yet, into it; seconds per model loaded. torch is imported by the
    models that use it (importing it takes a second, and a restart waits for it): its thread
    count is set once they are loaded; the worker started with OMP_NUM_THREADS set, for
    what they ran while loading. What the worker holds then is frozen for its life
    (``ken.engine.collector.settle_worker``), unless it runs in ``driver_pid``, the process
    that started it (a Ray in local mode)."""
    seconds = {}
    for name, loader in loaders.items():
        if name in into:
            continue
        started = time.perf_counter()
        model = loader()
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(threads)
        model.warm_up()  # before it serves: weights paged in, kernels (GPU shapes) set up
        into[name] = model
        seconds[name] = time.perf_counter() - started
    if seconds:  # the worker holds its models for life: no collection walks them again
        settle_worker(driver_pid)
    return seconds


def gpu_index(device: str) -> int | None:
    """The GPU a device id names (``cuda1`` and a cluster's ``n0.cuda1`` name GPU 1 of their
    node), None for any other device (a CPU worker)."""
    found = GPU_ID.fullmatch(device)
    return int(found.group(1)) if found else None


def gpu_usage(index: int = 0) -> tuple[int, int] | None:
    """GPU ``index``'s memory as this process uses it: (the most torch's caching allocator
    has held at once, in bytes, the GPU's total memory), or None where this process has not
    started CUDA (a CPU worker, or models that never touched the GPU). What the allocator
    *reserves* is what other processes cannot have, so that is what is checked, not the
    smaller *allocated* figure."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return (int(torch.cuda.max_memory_reserved(index)),
            int(torch.cuda.get_device_properties(index).total_memory))


def worker_env(device: str, threads: int, base: Mapping[str, str] | None = None
               ) -> dict[str, str]:
    """The environment of ``device``'s worker process: ``base`` (this process's environment)
    with ``OMP_NUM_THREADS`` = ``threads``, and only the GPUs the worker may use visible.

    A GPU device's worker sees its one GPU, as ``cuda:0`` (``CUDA_VISIBLE_DEVICES`` = its index,
    read through this process's own ``CUDA_VISIBLE_DEVICES`` when that is set: GPU 1 of a
    process that sees ``"4,5"`` is physical GPU 5). A CPU device's worker sees no GPU, so a
    model loaded there cannot take GPU memory or start a CUDA context by accident."""
    env = dict(os.environ if base is None else base)
    env["OMP_NUM_THREADS"] = str(threads)
    index = gpu_index(device)
    if index is None:
        env["CUDA_VISIBLE_DEVICES"] = ""
        return env
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if "CUDA_VISIBLE_DEVICES" in env and index >= len(visible):
        raise WorkerError(f"device {device} names GPU {index}, but this process sees "
                          f"{len(visible)} GPU(s) (CUDA_VISIBLE_DEVICES="
                          f"{env['CUDA_VISIBLE_DEVICES']!r})")
    env["CUDA_VISIBLE_DEVICES"] = visible[index] if visible else str(index)
    return env


class _CallThread:
    """A daemon thread running the calls handed to it, in order. Daemon: a call stuck for ever
    must not keep the process alive at exit."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, fn: Callable, *args: object) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def abandon(self) -> None:
        """Let the thread end once its current call returns (if it ever does)."""
        self._calls.put(None)

    def _loop(self) -> None:
        while (item := self._calls.get()) is not None:
            future, fn, args = item
            item = None
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            # an idle thread holds neither the last call's rows nor its runner's models
            future = fn = args = None


class ThreadRunner:
    """A device served by a thread of this process, calling shared loaded models."""

    mode = "thread"

    def __init__(self, device: str, models: Mapping[str, Model]) -> None:
        self.device = device
        self.models = models  # shared dict: models added later are seen here too
        self.pid: int | None = None
        self.restarts = 0  # call threads abandoned at a deadline and replaced
        self.closing = False  # nothing to restart for threads; kept for the engine's sake
        self.restarting = False  # a fresh thread has nothing to load
        self._caller: _CallThread | None = None

    def start(self) -> dict[str, float]:
        return {}

    def rss_bytes(self) -> int | None:
        return None  # threads share the engine's process: no per-device figure

    def gpu_usage(self) -> tuple[int, int] | None:
        return None  # threads serve CPU devices only (GPU plans need process workers)

    def load(self, name: str, source: Model | Loader) -> float:
        return 0.0  # the engine loads shared models once, for every thread runner

    def _predict(self, model: str, texts: list) -> Answers:
        try:
            found = self.models[model]
            return answers(found, texts, found.predict(texts, batch_size=max(len(texts), 1)))
        except Exception as exc:  # noqa: BLE001 - any model failure is reported, re-run
            raise WorkerError(f"{type(exc).__name__}: {exc}") from exc

    def run(self, model: str, texts: Sequence[str], timeout_s: float | None = None) -> Answers:
        """Answer ``texts`` with ``model``; past ``timeout_s`` the call is abandoned and
        ``BatchTimeout`` raised (see the module docstring)."""
        if self._caller is None:
            self._caller = _CallThread(f"ken-model-{self.device}")
        call = self._caller.submit(self._predict, model, list(texts))
        try:
            return call.result(timeout=timeout_s)
        except TimeoutError:
            self._caller.abandon()
            self._caller = None
            self.restarts += 1
            raise BatchTimeout(
                f"{model} did not return within {timeout_s:.1f} s (its batch deadline) on "
                f"{len(texts)} rows on {self.device}; a thread worker cannot be stopped: the "
                "call was abandoned (it may still be running) and the device goes on with a "
                "fresh thread") from None

    def died_idle(self) -> int | None:
        """Never: a thread worker does not die on its own."""
        return None

    def close(self) -> None:
        self.closing = True
        if self._caller is not None:
            self._caller.abandon()
            self._caller = None


def ignore_stop_signals() -> None:
    """The engine decides when a worker (or its planner process) stops (see the module
    docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def exit_with_parent(parent: int) -> None:
    """Exit at once, quietly, when ``parent`` is no longer this process's parent: a model call
    that never returns would otherwise keep an orphaned worker alive."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="ken-parent-watch", daemon=True).start()


def _serve(inp: Connection, out: Connection, threads: int) -> None:
    """Body of a worker process: load every model, then answer batches until told to stop.
    Model and loader errors are sent to the engine; a pipe error (the engine is gone) ends
    the worker through its caller, quietly."""
    sys.path[:0] = [p for p in inp.recv() if p not in sys.path]  # the engine's import path
    models: dict[str, Model] = {}

    def load(raw: bytes) -> dict[str, float] | str:
        """Unpickle loaders and load their models: seconds per model, or the error."""
        try:
            return load_models(pickle.loads(raw), models, threads)
        except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it
            return f"{type(exc).__name__}: {exc}"

    loaded = load(inp.recv_bytes())
    if isinstance(loaded, str):
        out.send(("load_error", loaded))
        return
    for name, seconds in loaded.items():
        out.send(("loaded", name, seconds))
    # the peak after every model's warm-up (each batch shape run once): its serving peak;
    # reported when loading ends, not with each answer (the hot path). The GPU is cuda:0 here
    out.send(("ready", gpu_usage()))
    while True:
        msg = inp.recv()
        if msg is None:
            return
        if msg[0] == "load":
            loaded = load(msg[1])
            out.send(("load_error", loaded) if isinstance(loaded, str)
                     else ("loaded", *next(iter(loaded.items())), gpu_usage()))
            continue
        _, model, texts = msg
        try:
            found = models[model]
            values, scores, largest = answers(
                found, texts, found.predict(texts, batch_size=max(len(texts), 1)))
        except Exception as exc:  # noqa: BLE001 - the engine decides whether to re-run
            out.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        out.send(("ok", values, scores, largest))


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
        self.restarts = 0  # fresh processes started after the first
        self.closing = False  # set when the engine shuts down: nothing is restarted then
        self.restarting = False  # a fresh process loads its models (read by admission)
        self._gpu: tuple[int, int] | None = None  # the latest gpu_usage() the worker sent

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None else None

    def rss_bytes(self) -> int | None:
        """Resident memory of the worker process (None if it is not running)."""
        return process_rss_bytes(self.pid)

    def gpu_usage(self) -> tuple[int, int] | None:
        """(peak GPU memory the worker's allocator reserved, the GPU's total) as the worker
        last reported it after loading (its models' warm-up has run every batch shape they
        serve, so that is its serving peak too); None on a CPU device."""
        return self._gpu if self.pid is not None else None

    def start(self) -> dict[str, float]:
        """Start the process and wait until it has loaded every model; seconds per model.

        The worker is a fresh ``python`` running ``main`` below, talking over two pipes, so it never
        imports the caller's ``__main__`` (no ``if __name__ == "__main__"`` guard needed)."""
        if self.closing:
            raise WorkerDied(f"worker {self.device} is not started: the engine is shutting down")
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from ken.engine.workers import main; "
             "sys.exit(main(sys.argv[1:]))", str(to_child_r), str(to_parent_w),
             str(self.threads), self.device, str(os.getpid())],
            pass_fds=(to_child_r, to_parent_w), stdin=subprocess.DEVNULL,
            env=worker_env(self.device, self.threads))
        os.close(to_child_r)
        os.close(to_parent_w)
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(to_parent_r, writable=False)
        try:
            self._send.send(list(sys.path))
            self._send.send(self.sources)
        except OSError:
            pass  # the worker died at once: _receive reports it
        seconds: dict[str, float] = {}
        while True:
            msg = self._receive(self.start_timeout_s, "while loading its models")
            if msg[0] == "loaded":
                seconds[msg[1]] = msg[2]
            elif msg[0] == "ready":
                self._gpu = msg[1]
                return seconds
            else:
                self._stop()
                raise WorkerError(f"worker {self.device} could not load its models: {msg[1]}")

    def load(self, name: str, source: Model | Loader) -> float:
        """Load one more model in the running process (e.g. for a swapped-in plan)."""
        if isinstance(source, Model):
            raise WorkerError(f"{name}: a process worker needs a loader, not a loaded model")
        self.sources[name] = source
        send = self._send
        if send is None:  # not running: the next start loads it with the others
            return 0.0
        try:
            send.send(("load", pickle.dumps({name: source})))
        except OSError:
            return 0.0  # died: the next batch restarts it, with this model
        msg = self._receive(self.start_timeout_s, f"while loading {name}")
        if msg[0] != "loaded":
            raise WorkerError(f"worker {self.device} could not load {name}: {msg[1]}")
        self._gpu = msg[3]
        return msg[2]

    def run(self, model: str, texts: Sequence[str], timeout_s: float | None = None) -> Answers:
        """Answer ``texts`` with ``model``. A process found dead is replaced first; past
        ``timeout_s`` the process is killed (``BatchTimeout``); one that dies during the call
        raises ``WorkerDied``. Either way the next call starts a fresh process."""
        self.revive()
        proc, send, recv = self._proc, self._send, self._recv
        assert proc is not None and send is not None and recv is not None
        try:
            send.send(("run", model, list(texts)))
            if timeout_s is not None and not recv.poll(timeout_s):
                proc.kill()
                self._reap(proc)
                raise BatchTimeout(
                    f"{model} did not return within {timeout_s:.1f} s (its batch deadline) on "
                    f"{len(texts)} rows on {self.device}: its worker process (pid {proc.pid}) "
                    "was killed"
                    + ("" if self.closing else " and is replaced"))
            msg = recv.recv()
        except (EOFError, OSError):
            code = self._reap(proc)
            raise WorkerDied(
                f"the worker process of {self.device} (pid {proc.pid}) died (exit code {code}) "
                f"while running {model} on {len(texts)} rows"
                + ("; it is not restarted: the engine is shutting down" if self.closing
                   else "")) from None
        if msg[0] == "ok":
            return msg[1], msg[2], msg[3]
        raise WorkerError(msg[1])

    def died_idle(self) -> int | None:
        """The exit code of a worker process that died between batches (killed, or out of
        memory), found without running one; None while it runs, before it started and once
        the engine shuts down."""
        proc = self._proc
        return None if proc is None or self.closing else proc.poll()

    def revive(self) -> None:
        """Replace a process that died between batches (``died_idle``) with a fresh one that
        loads every model this device hosts; nothing if it runs."""
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            self._reap(proc)
            proc = None
        if proc is not None:
            return
        if self.closing:
            raise WorkerDied(f"the worker process of {self.device} is gone and the engine "
                             "is shutting down: it is not restarted")
        self.restarts += 1
        self.restarting = True
        try:
            self.start()
        except WorkerError as exc:
            raise WorkerDied(f"the worker process of {self.device} had died; restarting "
                             f"it failed: {exc}") from None
        finally:
            self.restarting = False

    def close(self) -> None:
        """Stop the process for good (no restart after this)."""
        self.closing = True
        self._stop()

    def _stop(self) -> None:
        proc, send = self._proc, self._send
        if proc is None:
            return
        try:
            if send is not None:
                send.send(None)
        except OSError:
            pass
        try:
            proc.wait(timeout=2.0)  # a busy worker reads the stop after its call: kill it
        except subprocess.TimeoutExpired:
            proc.kill()
        self._reap(proc)

    def _reap(self, proc: subprocess.Popen) -> int | None:
        """Wait for a dead (or killed) process and forget it; its exit code."""
        try:
            code = proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(timeout=5.0)
        if self._proc is proc:
            for c in (self._send, self._recv):
                if c is not None:
                    c.close()
            self._proc = self._send = self._recv = None
        return code

    def _receive(self, timeout_s: float, doing: str) -> tuple:
        recv, proc = self._recv, self._proc
        assert recv is not None and proc is not None
        try:
            if not recv.poll(timeout_s):
                proc.kill()
                self._reap(proc)
                raise WorkerError(f"worker {self.device} did not answer within "
                                  f"{timeout_s:.0f} s {doing}")
            return recv.recv()
        except (EOFError, OSError):
            code = self._reap(proc)
            raise WorkerError(f"worker process of {self.device} ended (exit code {code}) "
                              f"{doing}") from None


def main(argv: Sequence[str]) -> int:
    """Entry point of a worker process; arguments: IN OUT pipe fds, THREADS, DEVICE, and the
    engine's process id."""
    ignore_stop_signals()
    exit_with_parent(int(argv[4]))
    inp = Connection(int(argv[0]), writable=False)
    out = Connection(int(argv[1]), readable=False)
    try:
        _serve(inp, out, int(argv[2]))
    except (EOFError, OSError):  # the engine closed its end or is gone: nothing to report to
        pass
    return 0
