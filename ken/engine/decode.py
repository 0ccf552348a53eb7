"""Online continuous batching of one generating model (``DecodeServer``).

A server thread owns a causal LM and runs forward passes back to back, each decided by
``ken.policy.decoding.DecodeScheduler`` — the rule the simulator (``ken.optimizer.decode_sim``)
uses — on a wall clock: a *prefill* pass for requests that may join (their prompts, yielding
their first token), else a *decode* pass over every running request. New requests join at
pass boundaries (``DecodeBatch.join``); finished ones leave (``DecodeBatch.pop_finished``).

Every submitted request gets exactly one ``GenOutcome``: ``ok`` with its ``Generation``,
``rejected`` when it could never fit the KV budget, or ``error`` when its pass failed: a
failed prefill is retried one joiner at a time, so only the request that breaks it fails; a
failed decode pass fails the requests running in it; queued requests run next. ``shutdown`` lets the
submitted requests finish first. Times are seconds on the server's
clock: arrival, first token (TTFT) and completion (TGT).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ken.errors import EngineError, ModelError, PolicyError
from ken.models.generation import DecodeBatch, Generation, end_token_ids
from ken.models.llm import GenerativeModel
from ken.models.model import Output
from ken.models.resources import CausalLM
from ken.optimizer.decode_sim import DecodeRun
from ken.policy.decoding import DecodeScheduler, Mode
from ken.policy.scheduling import WallClock

GenStatus = Literal["ok", "rejected", "error"]


@dataclass(frozen=True)
class GenOutcome:
    request_id: int
    status: GenStatus
    arrival_s: float
    first_token_s: float | None
    completion_s: float
    generation: Generation | None = None
    error: str | None = None


@dataclass
class _Pending:
    prompt: list[int]
    max_new: int
    arrival_s: float
    future: Future
    first_token_s: float | None = None


class DecodeServer:
    """Continuous batching of ``lm`` on its device (see the module docstring)."""

    def __init__(self, lm: CausalLM, max_running: int = 8, kv_budget_tokens: int | None = None,
                 mode: Mode = "continuous", stop: Sequence[str] = (),
                 ignore_eos: bool = False, memory_budget_bytes: int | None = None) -> None:
        """``memory_budget_bytes``: the device memory for weights plus KV cache; the cache gets
        what the weights leave (``kv_budget_tokens`` slots, whichever is smaller)."""
        if memory_budget_bytes is not None:
            room = kv_tokens_in(lm, memory_budget_bytes)
            kv_budget_tokens = room if kv_budget_tokens is None else min(kv_budget_tokens, room)
        self.lm = lm
        self.scheduler = DecodeScheduler(max_running, kv_budget_tokens, mode)
        self.stop = tuple(stop)
        self.ignore_eos = ignore_eos
        self.clock = WallClock()
        self._ends = end_token_ids(lm)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._batch: DecodeBatch | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()  # set by shutdown (under the lock): no new requests
        self._stopping = False  # the loop read shutdown's marker: it stops once idle
        self._lock = threading.Lock()
        self._crashed = ""
        self._vocab = int(lm.net.get_input_embeddings().num_embeddings)
        self.passes = 0
        self.prefill_passes = 0
        self.busy_s = 0.0

    # -- client side ------------------------------------------------------------------------

    def start(self) -> DecodeServer:
        if self._thread is not None:
            raise EngineError("the decode server was already started")
        self._thread = threading.Thread(target=self._guarded_loop, name="ken-decode",
                                        daemon=True)
        self._thread.start()
        return self

    def submit(self, prompt: Sequence[int], max_new_tokens: int) -> Future:
        """Queue a prompt (token ids); the future resolves to its ``GenOutcome``.

        Raises ``EngineError`` at once for what can never run: no prompt token, a token id
        outside the model's vocabulary, or more tokens than the model's context."""
        prompt = [int(t) for t in prompt]
        if not prompt or max_new_tokens < 0:
            raise EngineError("a request needs at least one prompt token and max_new_tokens "
                              ">= 0")
        if min(prompt) < 0 or max(prompt) >= self._vocab:
            raise EngineError(f"prompt token ids must be in [0, {self._vocab}); got "
                              f"{min(prompt)}..{max(prompt)}")
        if len(prompt) + max_new_tokens > self.lm.context_tokens:
            raise EngineError(f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed the "
                              f"model's context of {self.lm.context_tokens} tokens")
        fut: Future = Future()
        fut.set_running_or_notify_cancel()  # an outcome always comes; it cannot be cancelled
        with self._lock:
            if self._thread is None or self._closing.is_set() or not self._thread.is_alive():
                raise EngineError("the decode server is not running; call start() first"
                                  + (f" (it stopped: {self._crashed})" if self._crashed else ""))
            self._inbox.put((next(self._ids), prompt, int(max_new_tokens), self.clock.now(),
                             fut))
        return fut

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Finish the requests already submitted, then stop the thread."""
        if self._thread is None:
            return
        with self._lock:
            if not self._closing.is_set():
                self._closing.set()
                self._inbox.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise EngineError(f"the decode server did not stop within {timeout_s:g} s")

    def __enter__(self) -> DecodeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the loop ---------------------------------------------------------------------------

    def _receive(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is None:
                self._stopping = True
                continue
            rid, prompt, max_new, arrival, fut = item
            if not self.scheduler.fits(len(prompt), max_new):
                fut.set_result(GenOutcome(rid, "rejected", arrival, None, self.clock.now(),
                                          error=f"{len(prompt)} prompt + {max_new} new tokens "
                                          f"exceed the KV budget of "
                                          f"{self.scheduler.kv_budget_tokens} tokens"))
                continue
            self._pending[rid] = _Pending(prompt, max_new, arrival, fut)
            self.scheduler.admit(rid, len(prompt), max_new)

    def _guarded_loop(self) -> None:
        """The loop; if it fails where no request is to blame (a bug), every request still
        gets an error outcome and ``submit`` refuses new ones."""
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            self._crashed = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._closing.set()
            now = self.clock.now()
            for rid, p in list(self._pending.items()):
                if not p.future.done():
                    p.future.set_result(GenOutcome(rid, "error", p.arrival_s, p.first_token_s,
                                                   now, error=f"the decode server stopped: "
                                                   f"{self._crashed}"))
            self._pending.clear()
            self._reject_inbox(f"the decode server stopped: {self._crashed}")
            return
        self._reject_inbox("the decode server was shut down")

    def _reject_inbox(self, message: str) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                rid, _prompt, _max_new, arrival, fut = item
                fut.set_result(GenOutcome(rid, "error", arrival, None, self.clock.now(),
                                          error=message))

    def _loop(self) -> None:
        import torch

        torch.set_num_threads(self.lm.device.threads)
        while True:
            idle = self.scheduler.load == 0
            if idle and self._stopping:
                return
            self._receive(block=idle)
            step = self.scheduler.next_step()
            if step is None:
                continue
            start = self.clock.now()
            failed: dict[int, str] = {}
            try:
                if step.kind == "prefill":
                    failed = self._prefill(step.request_ids)
                else:
                    self._decode()
                finished = [(int(k), g) for k, g in self._batch.pop_finished()] \
                    if self._batch is not None else []
            except Exception as exc:  # noqa: BLE001 - a failed decode fails its batch only
                self._fail_running(f"{type(exc).__name__}: {exc}")
                continue
            now = self.clock.now()
            self.busy_s += now - start
            self.passes += 1
            self.prefill_passes += step.kind == "prefill"
            if step.kind == "prefill":
                for rid in step.request_ids:
                    self._pending[rid].first_token_s = now
            self.scheduler.step_done(step, [rid for rid, _ in finished] + list(failed))
            for rid, gen in finished:
                p = self._pending.pop(rid)
                p.future.set_result(GenOutcome(rid, "ok", p.arrival_s, p.first_token_s, now,
                                               gen))
            for rid, message in failed.items():
                p = self._pending.pop(rid)
                p.future.set_result(GenOutcome(rid, "error", p.arrival_s, None, now,
                                               error=message))

    def _prefill(self, ids: tuple[int, ...]) -> dict[int, str]:
        """Prefill the joiners and merge them into the running batch. If the pass fails,
        each joiner is tried alone, so one bad request does not fail the others; returns the
        joiners that failed, with the error."""
        groups = [ids]
        failed: dict[int, str] = {}
        while groups:
            group = groups.pop()
            try:
                joined = DecodeBatch.prefill(
                    self.lm, [self._pending[r].prompt for r in group], group,
                    [self._pending[r].max_new for r in group], self.stop, self._ends,
                    self.ignore_eos)
            except Exception as exc:  # noqa: BLE001 - reported per request
                if len(group) > 1:
                    groups.extend((r,) for r in group)
                else:
                    failed[group[0]] = f"{type(exc).__name__}: {exc}"
                continue
            if self._batch is None:
                self._batch = joined
            else:
                self._batch.join(joined)
        return failed

    def _decode(self) -> None:
        if self._batch is None:
            raise PolicyError("a decode pass with no running batch; this is a bug")
        self._batch.step()

    def _fail_running(self, message: str) -> None:
        now = self.clock.now()
        self._batch = None
        for rid in self.scheduler.drop_running():
            p = self._pending.pop(rid, None)
            if p is not None:
                p.future.set_result(GenOutcome(rid, "error", p.arrival_s, p.first_token_s, now,
                                               error=message))


def generate_rows(model: GenerativeModel, rows: Sequence, max_running: int = 8) -> Output:
    """``model``'s answers for ``rows`` by continuous batching: at most ``max_running`` rows
    decode together, and a row that finishes gives its place to the next row at the next
    pass (a ``DecodeServer`` for the call), where ``model.predict`` runs ``max_running`` rows
    at a time, each group until its longest answer ends. Same answers, fewer idle slots, but
    on this CPU not faster for a table's rows known at once (each join copies the running
    rows' KV cache; ``benchmarks/llm_batch.py``), so SQL queries use ``model.predict``.

    A row whose pass fails fails the call (``ModelError`` naming how many rows failed)."""
    prompts = model.requests(rows)
    live = [i for i, p in enumerate(prompts) if p]
    if not live:
        return model.output(len(rows), [], [])
    with DecodeServer(model.lm, max_running=max(1, max_running), stop=model.stop) as server:
        futures = [server.submit(prompts[i], model.max_new_tokens) for i in live]
        outcomes = [f.result() for f in futures]
    bad = [o for o in outcomes if o.status != "ok" or o.generation is None]
    if bad:
        raise ModelError(f"{model.name}: {len(bad)} of {len(live)} rows failed to generate: "
                         f"{bad[0].error}")
    return model.output(len(rows), live, [o.generation for o in outcomes])


def kv_tokens_in(lm: CausalLM, memory_bytes: int) -> int:
    """KV-cache token slots that fit in ``memory_bytes`` beside ``lm``'s weights."""
    from ken.models.transformers_backend import weight_bytes
    from ken.optimizer.tokens import kv_bytes_per_token

    weights = weight_bytes(lm.net)
    per_token = kv_bytes_per_token(lm)
    if memory_bytes < weights + per_token:
        raise EngineError(f"a memory budget of {memory_bytes / 2**20:.0f} MiB holds no KV cache "
                          f"beside the {weights / 2**20:.0f} MiB of weights; give more memory")
    return (memory_bytes - weights) // per_token


def replay(server: DecodeServer, arrival_s: Sequence[float] | np.ndarray,
           prompts: Sequence[Sequence[int]], max_new: Sequence[int]) -> list[GenOutcome]:
    """Submit ``prompts`` at the trace's arrival times (relative to now) and wait for all."""
    import time

    if not (len(arrival_s) == len(prompts) == len(max_new)):
        raise EngineError("give one prompt and one max_new per arrival")
    t0 = time.monotonic()
    futures = []
    for t, prompt, m in zip(arrival_s, prompts, max_new, strict=True):
        delay = float(t) - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)
        futures.append(server.submit(prompt, int(m)))
    return [f.result() for f in futures]


def as_run(outcomes: Sequence[GenOutcome], passes: int = 0, prefill_passes: int = 0,
           busy_s: float = 0.0) -> DecodeRun:
    """The measured run in the simulator's terms (only ``ok`` outcomes)."""
    ok = [o for o in outcomes if o.status == "ok" and o.generation is not None]
    if not ok:
        raise EngineError("no request finished; nothing to measure")
    return DecodeRun(
        np.array([o.arrival_s for o in ok]), np.array([o.first_token_s for o in ok]),
        np.array([o.completion_s for o in ok]),
        np.array([o.generation.prompt_tokens for o in ok]),  # type: ignore[union-attr]
        np.array([o.generation.num_tokens for o in ok]),  # type: ignore[union-attr]
        passes, prefill_passes, busy_s)
