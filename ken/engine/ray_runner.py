"""Device workers as Ray actors (DESIGN.md section 13; issue 20).

``RayRunner`` sits beside ``ThreadRunner`` and ``ProcessRunner`` (``workers.py``) behind the
same interface: ``start``, ``load``, ``run``, ``close``. Each device of the engine's plans is
one Ray actor that holds the models placed on that device (a device runs one batch at a time,
so one actor per device serialises its replicas the way the plan's simulation assumes). The
actor asks Ray for ``num_cpus`` = the device's threads and ``num_gpus`` = 1 for a CUDA device,
and is pinned to its node when the plan was made for the cluster's ``Hardware``
(``RayCluster.hardware``). Models are loaded and warmed in the actor before serving starts;
batches go as lists of texts and come back as ``(values, scores)`` with numpy scores.

Ray hosts and restarts the actors; ken decides what runs. The engine's dispatcher (the policy
the simulator uses) batches, routes and escalates exactly as with local workers. Failures:

- an actor that dies during a call (killed, out of memory, a crash in native code) fails the
  call with ``WorkerDied``; Ray restarts it (``max_restarts``) and ``revive``, which the
  engine calls between batches, waits for Ray's restart and reloads its models (a
  restarted actor runs only its constructor) while the batch's rows run on another replica,
  or wait for it where there is none (the next call reloads them too, if nothing did);
- an actor killed between calls is restarted by Ray without its models: the next call finds
  it so (``WorkerDied``) and is handled as above;
- a call past its deadline gets its actor killed (Ray restarts it) and raises
  ``BatchTimeout``;
- once Ray's restarts are spent the runner starts a fresh actor itself, as a process runner
  starts a fresh process; during shutdown (``closing``) nothing is restarted.

So every request still ends with exactly one outcome. Ray is an optional extra
(``pip install 'ken[ray]'``); importing this module does not import it.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ken.engine.workers import (
    Answers,
    Loader,
    answers,
    gpu_index,
    load_models,
)
from ken.errors import BatchTimeout, KenError, WorkerDied, WorkerError
from ken.machine import process_rss_bytes
from ken.models.model import Model
from ken.optimizer.workload import Hardware

INSTALL_HINT = "install it with `pip install 'ken[ray]'` (or `pip install ray`)"

#: restarts Ray gives an actor before the runner starts a fresh one itself
MAX_RESTARTS = 3


def import_ray() -> Any:
    """The ``ray`` module, or a ``KenError`` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise KenError(f"serving on Ray needs the ray package: {INSTALL_HINT}") from None
    return ray


def ensure_ray(address: str | None = None) -> Any:
    """Connect to Ray once per process: ``address`` ``"auto"`` (a running cluster, e.g. one
    started by ``ray start --head``), ``"ray://host:port"`` (Ray Client) or None (a local
    Ray started for this process, with the machine's CPUs)."""
    ray = import_ray()
    if ray.is_initialized() and address not in (None, "auto", "local"):
        raise KenError(f"this process is already connected to a Ray cluster; it cannot "
                       f"also join {address!r} (one Ray connection per process)")
    if not ray.is_initialized():
        options: dict[str, Any] = {"include_dashboard": False, "logging_level": "ERROR",
                                   "log_to_driver": False}
        try:
            ray.init(address=address, **options)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise KenError(f"cannot connect to the Ray cluster at {address!r}: {exc}; start "
                           "one with `ray start --head` or pass its address") from None
        _STARTED["local"] = address is None
    return ray


#: whether ken itself started the local Ray this process is connected to (``ensure_ray`` with
#: no address), so that it stops it when the last session closes (``stop_local_ray``)
_STARTED = {"local": False}


def stop_local_ray() -> bool:
    """Shut down the local Ray ``ensure_ray`` started, if it did and it still runs (a Ray the
    user started or joined is left alone); True when it stopped one."""
    if not _STARTED["local"]:
        return False
    _STARTED["local"] = False
    ray = sys.modules.get("ray")  # imported by ensure_ray (None: hidden, as tests do)
    if ray is None or not ray.is_initialized():
        return False
    ray.shutdown()
    return True


class _DeviceActor:
    """The body of a device's actor (made a Ray actor class by ``_actor_class``)."""

    def __init__(self, sys_path: list[str], threads: int, driver_pid: int | None = None
                 ) -> None:
        sys.path[:0] = [p for p in sys_path if p not in sys.path]  # the driver's imports
        self.driver_pid = driver_pid
        os.environ["OMP_NUM_THREADS"] = str(threads)
        self.threads = threads
        self.models: dict[str, Model] = {}

    def ensure_loaded(self, raw: bytes) -> dict[str, float]:
        """Load (and warm up) the models of ``raw`` (pickled name -> loader) not loaded yet;
        seconds per model loaded now."""
        return load_models(pickle.loads(raw), self.models, self.threads, self.driver_pid)

    def where(self) -> tuple[int, str]:
        """This actor's process id and Ray node id."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def predict(self, model: str, texts: list) -> Answers:
        if model not in self.models:  # Ray restarted this actor: only its constructor ran
            raise WorkerDied(f"the Ray actor (pid {os.getpid()}) has not loaded {model}: "
                             "Ray restarted it")
        try:
            found = self.models[model]
            return answers(found, texts, found.predict(texts, batch_size=max(len(texts), 1)))
        except Exception as exc:  # noqa: BLE001 - a model failure, reported as WorkerError
            raise WorkerError(f"{type(exc).__name__}: {exc}") from None


_ACTOR_CLASS: Any = None


def _actor_class() -> Any:
    global _ACTOR_CLASS  # one remote class per process: Ray registers it once
    if _ACTOR_CLASS is None:
        ray = import_ray()
        _ACTOR_CLASS = ray.remote(max_restarts=MAX_RESTARTS, max_task_retries=0)(_DeviceActor)
    return _ACTOR_CLASS


@dataclass(frozen=True)
class ActorPlacement:
    """What Ray is asked for one device's actor."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    node_id: str | None = None  # Ray node id the actor must run on (None: anywhere)

    def ray_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.node_id,
                                                                         soft=False)
        return opts


class RayRunner:
    """A device served by a Ray actor (see the module docstring)."""

    mode = "ray"

    def __init__(self, device: str, sources: Mapping[str, Loader], threads: int = 1,
                 placement: ActorPlacement | None = None, start_timeout_s: float = 600.0
                 ) -> None:
        self.device = device
        self.sources = dict(sources)
        self.threads = threads
        self.placement = placement or ActorPlacement(num_cpus=threads)
        self.start_timeout_s = start_timeout_s
        self.restarts = 0  # actors that died or were killed and came back (Ray's or ours)
        self.closing = False
        self.restarting = False  # a restarted or fresh actor loads its models (``revive``)
        self.node_id: str | None = None  # where the actor runs (after start)
        self._actor: Any = None
        self._pid: int | None = None
        self._reload = False  # the actor was restarted: load its models before the next call

    @property
    def pid(self) -> int | None:
        """The actor's process id (on its node) as of its latest start or call."""
        return self._pid

    def rss_bytes(self) -> int | None:
        """Resident memory of the actor's process when it runs on this machine, else None."""
        if self.node_id is None or self.node_id != import_ray().get_runtime_context(
                ).get_node_id():
            return None
        return process_rss_bytes(self._pid)

    def gpu_usage(self) -> tuple[int, int] | None:
        """Not measured for actors: Ray reserves an actor's GPU itself (``num_gpus``)."""
        return None

    def start(self) -> dict[str, float]:
        """Create the actor and wait until it has loaded every model; seconds per model."""
        if self.closing:
            raise WorkerDied(f"worker {self.device} is not started: the engine is shutting down")
        ray = ensure_ray()
        actor_cls = _actor_class()
        try:
            self._actor = actor_cls.options(**self.placement.ray_options()).remote(
                list(sys.path), self.threads, os.getpid())
        except Exception as exc:  # noqa: BLE001 - Ray's own errors, reported as ours
            raise WorkerError(f"worker {self.device}: Ray could not create its actor: "
                              f"{exc}") from None
        return self._load_all(ray, "while loading its models")

    def _load_all(self, ray: Any, doing: str, restarted: bool = False) -> dict[str, float]:
        """Load every model of ``sources`` the actor has not loaded. For an actor Ray is
        ``restarted`` (after it died), the calls wait for the restart to finish (they are
        retried while the actor is restarting: both are safe to run again) instead of failing
        at once, which threw Ray's restart away for a fresh actor; an actor whose restarts
        are spent fails them at once. Each of the two calls waits at most ``start_timeout_s``;
        past it the actor is killed (``WorkerError``) and ``revive`` starts a fresh one."""
        raw = pickle.dumps(self.sources)
        retries = {"max_task_retries": -1} if restarted else {}
        try:
            seconds = ray.get(self._actor.ensure_loaded.options(**retries).remote(raw),
                              timeout=self.start_timeout_s)
            self._pid, self.node_id = ray.get(self._actor.where.options(**retries).remote(),
                                              timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._kill(restart=False)
            raise WorkerError(f"worker {self.device} (a Ray actor) did not answer within "
                              f"{self.start_timeout_s:.0f} s {doing}") from None
        except ray.exceptions.RayError as exc:
            self._kill(restart=False)
            raise WorkerError(f"worker {self.device} (a Ray actor) could not load its models: "
                              f"{ray_error_cause(exc)}") from None
        self._reload = False
        return seconds

    def load(self, name: str, source: Model | Loader) -> float:
        """Load one more model in the running actor (e.g. for a swapped-in plan)."""
        if isinstance(source, Model):
            raise WorkerError(f"{name}: a Ray worker needs a loader, not a loaded model")
        self.sources[name] = source
        if self._actor is None:
            return 0.0
        ray = ensure_ray()
        return self._load_all(ray, f"while loading {name}").get(name, 0.0)

    def run(self, model: str, texts: Sequence[str], timeout_s: float | None = None) -> Answers:
        """Answer ``texts`` with ``model``. An actor that Ray restarted reloads its models
        first; past ``timeout_s`` the actor is killed (``BatchTimeout``); one that dies during
        the call raises ``WorkerDied``."""
        ray = ensure_ray()
        self.revive()
        try:
            values, scores, largest = ray.get(self._actor.predict.remote(model, list(texts)),
                                              timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._kill(restart=not self.closing)
            raise BatchTimeout(
                f"{model} did not return within {timeout_s:.1f} s (its batch deadline) on "
                f"{len(texts)} rows on {self.device}: its Ray actor was killed"
                + ("" if self.closing else " and is restarted")) from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            if isinstance(cause, WorkerDied):  # killed while idle, restarted without models
                self._reload = True
                self.restarts += 1
                raise WorkerDied(f"{cause}; its models are loaded again") from None
            if isinstance(cause, WorkerError):
                raise WorkerError(str(cause)) from None
            raise WorkerError(f"{type(cause).__name__}: {cause}") from None
        except ray.exceptions.RayError as exc:  # the actor died (RayActorError and kin)
            self._reload = True
            self.restarts += 1
            raise WorkerDied(
                f"the Ray actor of {self.device} (pid {self._pid}) died while running {model} "
                f"on {len(texts)} rows: {ray_error_cause(exc)}"
                + ("; it is not restarted: the engine is shutting down" if self.closing
                   else "")) from None
        return values, np.asarray(scores), largest

    def revive(self) -> None:
        """Between batches: load the models of an actor that died or was killed with a batch
        (Ray restarted it, or a fresh one is started), so that the batch's rows, run on
        another replica meanwhile, are not the ones to wait for it; nothing if it runs with
        its models."""
        if self._actor is not None and not self._reload:
            return
        self.restarting = True
        try:
            self._revive(ensure_ray())
        finally:
            self.restarting = False

    def _revive(self, ray: Any) -> None:
        """Before a call: load the models of an actor Ray restarted, or start a fresh actor
        when Ray gave up on it (or there is none)."""
        if self.closing:
            raise WorkerDied(f"the Ray actor of {self.device} is gone and the engine is "
                             "shutting down: it is not restarted")
        if self._actor is not None:
            try:
                self._load_all(ray, "after a restart", restarted=True)
                return
            except WorkerError:
                pass  # Ray's restarts are spent, or it cannot load: a fresh actor below
        try:
            self.start()
        except WorkerError as exc:
            raise WorkerDied(f"the Ray actor of {self.device} had died; starting a new one "
                             f"failed: {exc}") from None

    def _kill(self, restart: bool) -> None:
        actor = self._actor
        if actor is None:
            return
        ray = import_ray()
        try:
            ray.kill(actor, no_restart=not restart)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if restart:
            self._reload = True
            self.restarts += 1
        else:
            self._actor = None
            self._pid = None

    def died_idle(self) -> int | None:
        """Not looked for between calls: Ray restarts a dead actor itself, and the next call
        finds it without its models (``WorkerDied``, so the engine reloads them with
        ``revive`` while the call's rows run elsewhere)."""
        return None

    def close(self) -> None:
        """Stop the actor for good (no restart after this)."""
        self.closing = True
        self._kill(restart=False)


def ray_error_cause(exc: BaseException) -> str:
    """What went wrong in the actor: the exception a task raised there, else the first line
    of Ray's error (its messages carry the actor's traceback and terminal colours)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()
    return text[0] if text else type(exc).__name__


class RayCluster:
    """A Ray cluster as ken plans and serves on it: its live nodes in a fixed order (the head
    first), the ``Hardware`` they make (``hardware``), and where each device's actor goes
    (``placement``). ``connect`` joins a running cluster or starts a local Ray."""

    def __init__(self, nodes: Sequence[Mapping[str, Any]]) -> None:
        alive = [n for n in nodes if n.get("Alive", True)]
        # the head node first, then by id: node k of the Hardware is the same machine on
        # every call
        alive.sort(key=lambda n: ("node:__internal_head__" not in n.get("Resources", {}),
                                  n.get("NodeID", "")))
        if not alive:
            raise KenError("the Ray cluster has no live node")
        self.nodes = tuple(alive)
        self.node_ids = tuple(n.get("NodeID") for n in alive)

    @classmethod
    def connect(cls, address: str | None = None) -> RayCluster:
        """``address``: "auto" (the running cluster), "ray://host:port", "host:port", or
        "local" / None (a Ray started for this process; see ``ensure_ray``). A process
        already connected to Ray keeps that connection."""
        ray = ensure_ray(None if address in (None, "local") else address)
        return cls(ray.nodes())

    def hardware(self, threads_per_device: int = 1, memory_bytes: int | None = None,
                 gpu_memory_bytes: int | None = None, dispatch_s: float | None = None
                 ) -> Hardware:
        """The cluster's devices (``Hardware.from_nodes``) for ``ken plan`` / ``session.plan``;
        each pays ``dispatch_s`` per batch, by default the hop measured now
        (``measure_hop_s``), rounded up to 0.5 ms so that plans stay cached across runs."""
        if dispatch_s is None:
            dispatch_s = self.hop_s()
        return Hardware.from_nodes(self.nodes, threads_per_device, memory_bytes,
                                   gpu_memory_bytes, dispatch_s)

    @staticmethod
    def hop_s() -> float:
        """The hop to an actor measured now (``measure_hop_s``), rounded up to 0.5 ms: what
        plans for this cluster charge per batch."""
        return math.ceil(measure_hop_s() / 5e-4) * 5e-4

    def placement(self, device: str, threads: int) -> ActorPlacement:
        """What Ray is asked for ``device``'s actor: a device named by ``hardware``
        (``n{k}.cpu{i}``, ``n{k}.cuda{j}``) runs on node ``k`` with ``threads`` CPUs or one
        GPU; a local GPU device (``cuda{j}``, from ``Hardware.local``) runs wherever Ray finds
        a GPU, and any other device name (a plan made for ``Hardware.cpu_workers``) wherever
        Ray finds ``threads`` CPUs. Ray shows an actor only the GPU it was given, as
        ``cuda:0``, so GPU loaders are the same as for a worker process."""
        node, _, kind = device.partition(".")
        if gpu_index(device) is not None and not kind:
            return ActorPlacement(num_cpus=0.0, num_gpus=1.0)
        if node.startswith("n") and node[1:].isdigit() and int(node[1:]) < len(self.node_ids):
            node_id = self.node_ids[int(node[1:])]
            if kind.startswith("cuda"):
                return ActorPlacement(num_cpus=0.0, num_gpus=1.0, node_id=node_id)
            return ActorPlacement(num_cpus=float(threads), node_id=node_id)
        return ActorPlacement(num_cpus=float(threads))


def measure_hop_s(calls: int = 200, rows: int = 8) -> float:
    """Median seconds of one call to an idle actor that returns at once, with ``rows`` short
    texts each way: the hop the router pays per batch on Ray beside a local worker's pipe."""
    ray = ensure_ray()

    @ray.remote(num_cpus=0)
    class Echo:
        def echo(self, texts: list) -> list:
            return texts

    echo = Echo.remote()
    texts = [f"row {i}" for i in range(rows)]
    seconds = []
    try:
        ray.get(echo.echo.remote(texts))
        for _ in range(calls):
            started = time.perf_counter()
            ray.get(echo.echo.remote(texts))
            seconds.append(time.perf_counter() - started)
    except ray.exceptions.RayError as exc:
        raise KenError(f"cannot measure the hop to a Ray actor: {ray_error_cause(exc)}") from None
    finally:
        ray.kill(echo)
    return float(np.median(seconds))
