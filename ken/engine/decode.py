"""Online continuous batching of generating models (``DecodeServer``, ``CascadeServer``).

A server thread owns a causal LM and runs forward passes back to back, each decided by
``ken.policy.decoding.DecodeScheduler`` — the rule the simulator (``ken.optimizer.decode_sim``)
uses — on a wall clock: a *prefill* pass for requests that may join (their prompts, yielding
their first token), else a *decode* pass over every running request. New requests join at
pass boundaries (``DecodeBatch.join``); finished ones leave (``DecodeBatch.pop_finished``).

Every submitted request gets exactly one ``Outcome``: ``ok`` with its ``Generation``,
``rejected`` when it could never fit the KV budget, or ``error`` when its pass failed: a
failed prefill is retried one joiner at a time, so only the request that breaks it fails; a
failed decode pass fails the requests running in it; queued requests run next. ``shutdown``
drains as the classifier engine does: the submitted requests finish first (up to a timeout),
or with ``drain=False`` those still queued or running end ``cancelled`` at the next pass
boundary. Times are seconds on the server's clock: arrival, first token (TTFT) and completion
(TGT).

The server keeps a *lane* per model (its scheduler and KV cache); ``DecodeServer`` has one.
``CascadeServer`` serves a generation plan (``ken.policy.generating``) with a lane per model
of the plan: ``GenDispatcher`` picks each request's cascade from the load and escalates
uncertain answers, ``pick_lane`` picks the lane of each pass — the rules
``ken.optimizer.decode_sim.simulate_gen_plan`` runs on a virtual clock.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from ken.engine import collector
from ken.engine.decode_admission import DecodeAdmission, Verdict
from ken.engine.outcome import Outcome, Status
from ken.engine.supervision import BatchDeadline, Breaker
from ken.errors import EngineError, ModelError, PolicyError
from ken.machine import runqueue_wait_s, yield_cores
from ken.models.generation import DecodeBatch, Generation, end_token_ids
from ken.models.llm import GenerativeModel
from ken.models.model import Output
from ken.models.resources import CausalLM
from ken.models.transformers_backend import weight_bytes
from ken.optimizer.decode_sim import DecodeRun, GenRun
from ken.optimizer.tokens import kv_bytes_per_token
from ken.policy.decoding import (
    DecodeScheduler,
    DecodeStep,
    Mode,
    Order,
    PassCost,
    ServiceTargets,
)
from ken.policy.generating import GenDispatcher, pick_lane
from ken.policy.plan import GenPlan
from ken.policy.scheduling import WallClock

#: failed passes of a model in a row (every request in them failed) before it is marked failed
#: (the classifier engine's ``Breaker``: its requests then end in error at once)
MAX_FAILED_PASSES = 3

AdmissionMode = Literal["target", "none"]
#: ``"normal"``: the server's thread shares the cores as any thread does; ``"background"``: on
#: a CPU it runs in the scheduler's idle class (``ken.machine.yield_cores``)
CpuPriority = Literal["normal", "background"]
CPU_PRIORITIES: tuple[str, ...] = get_args(CpuPriority)

#: the default deadline of a forward pass: the classifier engine's rule (10x what such passes
#: were seen to take) with a floor of 10 s, not 2 s, and 60 s (the old fixed bound) until
#: passes of the kind were measured: a classifier worker past its deadline is replaced, but a
#: decode pass past it abandons the server for good (its thread cannot be stopped), so a
#: stall of a busy machine, or a cold first prefill, must not reach it
PASS_DEADLINE = BatchDeadline(factor=10.0, floor_s=10.0, first_call_s=60.0)


@dataclass(frozen=True)
class _PassRef:
    """A failed pass as the breaker sees a batch."""

    model: str
    devices: tuple[str, ...] = ()
    request_ids: tuple[int, ...] = ()


def _admission(mode: str, target_s: float | None,
               costs: Mapping[str, PassCost | None]) -> DecodeAdmission:
    if mode not in ("target", "none"):
        raise EngineError(f"admission must be 'target' or 'none', not {mode!r}")
    if target_s is not None and not (math.isfinite(target_s) and target_s > 0):
        raise EngineError(f"latency_target_s must be a finite number of seconds > 0, got "
                          f"{target_s!r}")
    return DecodeAdmission(target_s if mode == "target" else None, base_costs=costs)


#: inbox markers of ``shutdown``: stop once idle; cancel what is left at the next pass boundary
_STOP = object()
_CANCEL = object()


@dataclass
class _Pending:
    prompt: list[int]
    max_new: int
    arrival_s: float
    future: Future
    lane: str
    row: Any = None
    first_token_s: float | None = None


class _Lane:
    """One model's decoding on the server's device: its scheduler and its running batch."""

    def __init__(self, lm: CausalLM, max_running: int, kv_budget_tokens: int | None,
                 mode: Mode, stop: Sequence[str], ignore_eos: bool, order: Order = "fcfs",
                 targets: ServiceTargets | None = None, cost: PassCost | None = None) -> None:
        self.lm = lm
        try:
            self.scheduler = DecodeScheduler(max_running, kv_budget_tokens, mode, order,
                                             targets, cost)
        except PolicyError as exc:
            raise EngineError(str(exc)) from None
        self.stop = tuple(stop)
        self.ignore_eos = ignore_eos
        self.ends = end_token_ids(lm)
        self.vocab = int(lm.net.get_input_embeddings().num_embeddings)
        self.batch: DecodeBatch | None = None
        self.last_tokens = 0

    def check(self, prompt: Sequence[int], max_new_tokens: int) -> str | None:
        """Why such a request can never run on this lane (None: it can)."""
        if not prompt or max_new_tokens < 0:
            return "a request needs at least one prompt token and max_new_tokens >= 0"
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            return (f"prompt token ids must be in [0, {self.vocab}); got "
                    f"{min(prompt)}..{max(prompt)}")
        if len(prompt) + max_new_tokens > self.lm.context_tokens:
            return (f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed the model's "
                    f"context of {self.lm.context_tokens} tokens")
        return None

    def over_budget(self, prompt_tokens: int, max_new_tokens: int) -> str | None:
        """Why such a request can never fit this lane's KV budget (None: it can)."""
        if self.scheduler.fits(prompt_tokens, max_new_tokens):
            return None
        return (f"{prompt_tokens} prompt + {max_new_tokens} new tokens exceed the KV budget "
                f"of {self.scheduler.kv_budget_tokens} tokens")

    def run(self, pending: dict[int, _Pending], clock: WallClock,
            chosen: Callable[[DecodeStep], None] | None = None
            ) -> tuple[DecodeStep, list[tuple[int, Generation]], dict[int, str]]:
        """Run the lane's next pass: the pass, the requests it finished and the joiners whose
        prefill failed (with the error). A failed pass raises (the caller then fails the
        running requests: ``drop_running``). ``chosen`` is told the pass before it runs."""
        step = self.scheduler.next_step(clock.now())
        if step is None:
            raise PolicyError("a lane with requests has no pass; this is a bug")
        # what the pass's time grows with: the longest prompt, or the width decoded over
        self.last_tokens = (max(len(pending[r].prompt) for r in step.request_ids)
                            if step.kind == "prefill" else self.scheduler.width())
        if chosen is not None:
            chosen(step)
        failed: dict[int, str] = {}
        if step.kind == "prefill":
            failed = self._prefill(step.request_ids, pending)
        elif self.batch is None:
            raise PolicyError("a decode pass with no running batch; this is a bug")
        else:
            self.batch.step()
        finished = [(int(k), g) for k, g in self.batch.pop_finished()] \
            if self.batch is not None else []
        self.scheduler.step_done(step, [rid for rid, _ in finished] + list(failed),
                                 clock.now())
        return step, finished, failed

    def _prefill(self, ids: tuple[int, ...], pending: dict[int, _Pending]) -> dict[int, str]:
        """Prefill the joiners and merge them into the running batch. If the pass fails,
        each joiner is tried alone, so one bad request does not fail the others."""
        groups = [ids]
        failed: dict[int, str] = {}
        while groups:
            group = groups.pop()
            try:
                joined = DecodeBatch.prefill(
                    self.lm, [pending[r].prompt for r in group], group,
                    [pending[r].max_new for r in group], self.stop, self.ends,
                    self.ignore_eos)
            except Exception as exc:  # noqa: BLE001 - reported per request
                if len(group) > 1:
                    groups.extend((r,) for r in group)
                else:
                    failed[group[0]] = f"{type(exc).__name__}: {exc}"
                continue
            if self.batch is None:
                self.batch = joined
            else:
                self.batch.join(joined)
        return failed

    def drop_running(self) -> list[int]:
        """Forget the running batch (its pass failed); returns its requests."""
        self.batch = None
        return self.scheduler.drop_running()

    def clear(self) -> list[int]:
        """Forget every request here, running or queued (the model is marked failed)."""
        self.batch = None
        return self.scheduler.clear()


class DecodeServer:
    """Continuous batching of ``lm`` on its device (see the module docstring)."""

    def __init__(self, lm: CausalLM, max_running: int = 8, kv_budget_tokens: int | None = None,
                 mode: Mode = "continuous", stop: Sequence[str] = (),
                 ignore_eos: bool = False, memory_budget_bytes: int | None = None,
                 order: Order = "fcfs", targets: ServiceTargets | None = None,
                 pass_cost: PassCost | None = None,
                 pass_timeout_s: float | None = None,
                 latency_target_s: float | None = None,
                 admission: AdmissionMode = "target",
                 deadline: BatchDeadline | None = None,
                 cpu_priority: CpuPriority = "normal") -> None:
        """``memory_budget_bytes``: the device memory for weights plus KV cache; the cache gets
        what the weights leave (``kv_budget_tokens`` slots, whichever is smaller).

        Every forward pass has a deadline, as the classifier engine's batches do
        (``deadline``, a ``BatchDeadline``; ``PASS_DEADLINE`` by default: 10x what such a pass
        was seen to take, at least 10 s; 60 s until passes of that kind were measured);
        ``pass_timeout_s`` fixes it instead. A pass past it abandons the server (every
        request in it or waiting ends ``error``, saying the model did not return and where
        the bound came from).

        ``order="deadline"`` with ``targets`` (TTFT and time between tokens): each prefill's
        joiners are chosen by Apt-Serve's rule (``ken.policy.decoding``), passes estimated by
        ``pass_cost`` (e.g. the model's ``TokenCost``; None: joiners only); the default
        ``"fcfs"`` joins in arrival order. ``EngineError`` for an unknown order or missing
        targets.

        ``latency_target_s`` (arrival to last token): admission by capacity holds requests to
        it (``ken.engine.decode_admission``: turned away at once, ``rejected`` with a reason
        and a retry hint, when the queue ahead would make them miss it); None (the default
        here) or ``admission="none"``: every request is queued.

        ``cpu_priority="background"``: on a CPU the server's thread runs in the scheduler's
        idle class (Linux's ``SCHED_IDLE``, ``ken.machine.yield_cores``): a classifier worker
        that wakes on its core takes the core at once instead of sharing it for a time slice,
        so workers with tighter latency targets on the same cores keep their tail (measured:
        ``benchmarks/decode_priority.py``); the passes get what the cores leave, and slow
        down while the cores are saturated (admission, which times the passes, then turns
        new requests away sooner). A pass's deadline then leaves out the waits for a core
        the kernel has accounted (``_pass_elapsed``). Applied only where the kernel reports
        those waits (``/proc/self/task/<tid>/schedstat``); ``yielded`` says whether it was,
        once ``start`` has returned. ``"normal"`` (the default): the passes share the cores.
        ``EngineError`` for another value."""
        if memory_budget_bytes is not None:
            room = kv_tokens_in(lm, memory_budget_bytes)
            kv_budget_tokens = room if kv_budget_tokens is None else min(kv_budget_tokens, room)
        self._lanes: dict[str, _Lane] = {
            "": _Lane(lm, max_running, kv_budget_tokens, mode, stop, ignore_eos, order,
                      targets, pass_cost)}
        self._init_loop(pass_timeout_s, _admission(admission, latency_target_s,
                                                   {"": pass_cost}), deadline, cpu_priority)

    def _init_loop(self, pass_timeout_s: float | None, admission: DecodeAdmission,
                   deadline: BatchDeadline | None, cpu_priority: CpuPriority = "normal"
                   ) -> None:
        if cpu_priority not in CPU_PRIORITIES:
            raise EngineError(f"cpu_priority must be 'normal' or 'background', not "
                              f"{cpu_priority!r}")
        self.cpu_priority = cpu_priority
        #: the loop's thread runs in the idle class (``cpu_priority="background"`` on a CPU
        #: whose kernel has the class and reports a thread's waits for a core)
        self.yielded = False
        self._settled = threading.Event()  # the loop's thread has taken its priority
        self._tid: int | None = None  # the loop thread's native id
        self._pass_wait0: float | None = None  # the thread's core wait when the pass began
        if pass_timeout_s is not None and not (math.isfinite(pass_timeout_s)
                                               and pass_timeout_s > 0):
            raise EngineError(f"pass_timeout_s must be finite and > 0, got {pass_timeout_s}")
        if deadline is not None and not isinstance(deadline, BatchDeadline):
            raise EngineError(f"deadline must be a BatchDeadline, not {deadline!r}")
        self.pass_timeout_s = pass_timeout_s
        self.deadline = deadline or PASS_DEADLINE
        self._pass_limit: tuple[float, str] = (math.inf, "")  # the pass under way's bound
        self._pass_model = ""  # and the model it runs
        self.admission = admission
        # the crash-loop breaker of the classifier engine's workers: a model whose passes
        # fail MAX_FAILED_PASSES times in a row is marked failed (its rows end in error at once)
        self.breaker = Breaker(max_retries=0, max_crashes=MAX_FAILED_PASSES,
                               crash="failed a forward pass for every request in it")
        # lane -> (boundary, prompt tokens, max new, verdict) of the last request refused
        self._refused: dict[str, tuple[int, int, int, Verdict]] = {}
        self.admission_errors = 0  # estimates that raised (the request was admitted)
        self._boundary = 0  # pass boundaries the loop has reached
        self._pass_lock = threading.Lock()  # the loop's pass against the watchdog's verdict
        self._pass_started: float | None = None  # when the pass under way began
        self._abandoned = False  # the watchdog gave up on a pass that never returned
        self.clock = WallClock()
        self._lane_names = list(self._lanes)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._thread: threading.Thread | None = None
        self._frozen: collector.Hold | None = None  # the loaded model, while serving
        #: set by shutdown (under the lock): no new requests are taken
        self.closing = threading.Event()
        self._stopping = False  # the loop read shutdown's _STOP: it stops once idle
        self._cancelling = False  # the loop read _CANCEL: it cancels what is left and stops
        self._lock = threading.Lock()
        self._shutdown_lock = threading.Lock()
        self.cancelled = 0  # requests cancelled by shutdown
        self._crashed = ""
        self.passes = 0
        self.prefill_passes = 0
        self.busy_s = 0.0

    @property
    def lm(self) -> CausalLM:
        return self._lanes[self._lane_names[0]].lm

    @property
    def scheduler(self) -> DecodeScheduler:
        return self._lanes[self._lane_names[0]].scheduler

    @property
    def load(self) -> int:
        """Requests running or queued in the server's lanes."""
        return sum(lane.scheduler.load for lane in self._lanes.values())

    @property
    def rejected(self) -> int:
        """Requests admission turned away."""
        return self.admission.rejected

    # -- client side ------------------------------------------------------------------------

    def start(self) -> DecodeServer:
        if self._thread is not None:
            raise EngineError("the decode server was already started")
        self._thread = threading.Thread(target=self._guarded_loop, name="ken-decode",
                                        daemon=True)
        self._frozen = collector.hold()  # no full collection walks the loaded model
        self._thread.start()
        threading.Thread(target=self._watch, name="ken-decode-watchdog", daemon=True).start()
        self._settled.wait(timeout=10.0)  # ``yielded`` is known when start returns
        return self

    def submit(self, prompt: Sequence[int], max_new_tokens: int) -> Future:
        """Queue a prompt (token ids); the future resolves to its ``Outcome``.

        Raises ``EngineError`` at once for what can never run: no prompt token, a token id
        outside the model's vocabulary, or more tokens than the model's context."""
        prompt = [int(t) for t in prompt]
        problem = self._lanes[self._lane_names[0]].check(prompt, max_new_tokens)
        if problem:
            raise EngineError(problem)
        return self._put(prompt, int(max_new_tokens))

    def _put(self, item: Any, max_new: int) -> Future:
        fut: Future = Future()
        fut.set_running_or_notify_cancel()  # an outcome always comes; it cannot be cancelled
        with self._lock:
            if self._abandoned:
                raise EngineError(f"the decode server stopped: {self._crashed}")
            if self._thread is None or not self._thread.is_alive():
                raise EngineError("the decode server is not running; call start() first"
                                  + (f" (it stopped: {self._crashed})" if self._crashed else ""))
            failed = self.breaker.reason(self._lane_model(self._lane_names[0]))
            if failed is not None and len(self._lanes) == 1:
                now = self.clock.now()
                fut.set_result(Outcome(next(self._ids), "error", now, now, error=failed))
                return fut
            if self.closing.is_set():  # draining: turned away as the classifier engine does
                now = self.clock.now()
                fut.set_result(Outcome(next(self._ids), "cancelled", now, now, error=(
                    "the decode server is shutting down; nothing was run")))
                return fut
            self._inbox.put((next(self._ids), item, max_new, self.clock.now(), fut))
        return fut

    def shutdown(self, drain: bool = True, timeout_s: float = 60.0,
                 pass_timeout_s: float = 60.0) -> int:
        """Stop taking requests. With ``drain``, wait (up to ``timeout_s``) for the submitted
        requests to finish; whatever is still queued or running then ends ``cancelled`` once
        the pass under way is done (``EngineError`` if it is not within ``pass_timeout_s``).
        Returns how many were cancelled. Safe to call twice and from any thread."""
        try:
            return self._shutdown(drain, timeout_s, pass_timeout_s)
        finally:
            if self._frozen is not None:
                self._frozen.release()

    def _shutdown(self, drain: bool, timeout_s: float, pass_timeout_s: float) -> int:
        with self._shutdown_lock:
            if self._thread is None or self._abandoned or (
                    self.closing.is_set() and not self._thread.is_alive()):
                return 0  # (an abandoned server failed every request when it gave up)
            with self._lock:
                if not self.closing.is_set():
                    self.closing.set()
                    self._inbox.put(_STOP)
            if drain:
                self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._inbox.put(_CANCEL)
                self._thread.join(pass_timeout_s)
            if self._thread.is_alive():
                raise EngineError(f"the decode server did not stop within {pass_timeout_s:g} s "
                                  "of being told to cancel its requests (a pass hangs)")
            return self.cancelled

    def __enter__(self) -> DecodeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- hooks (CascadeServer overrides them) -----------------------------------------------

    def _enter(self, rid: int, item: Any, max_new: int, arrival: float, fut: Future) -> None:
        """A request arrives at a pass boundary: queue it on its lane."""
        name = self._lane_names[0]
        lane = self._lanes[name]
        problem = lane.over_budget(len(item), max_new)
        if problem:
            fut.set_result(Outcome(rid, "rejected", arrival, self.clock.now(), error=problem))
            return
        if self._turned_away(rid, name, len(item), max_new, arrival, fut):
            return
        self._pending[rid] = _Pending(item, max_new, arrival, fut, name)
        lane.scheduler.admit(rid, len(item), max_new, arrival)

    def _turned_away(self, rid: int, lane: str, prompt_tokens: int, max_new: int,
                     arrival: float, fut: Future, later: Sequence[tuple[str, int]] = ()
                     ) -> bool:
        """Whether a new request for ``lane`` ends at once: its model is marked failed
        (``error``), or admission turns it away (``rejected``, with the reason and a retry
        hint). A request refused at a pass boundary refuses the later ones of its lane at
        the same boundary that are at least as long (prompt and budget) without another
        estimate (first come, first served: they would finish no sooner). An estimate that
        raises admits the request (``admission_errors`` counts them)."""
        now = self.clock.now()
        failed = self.breaker.reason(self._lane_model(lane))
        if failed is not None:
            fut.set_result(Outcome(rid, "error", arrival, now, error=failed))
            return True
        if not self.admission.active:
            return False
        refused = self._refused.get(lane)
        if refused is not None and refused[0] == self._boundary and \
                prompt_tokens >= refused[1] and max_new >= refused[2]:
            verdict = refused[3]  # as long a request behind a refused one: refused too
            self.admission.rejected += 1
        else:
            try:
                verdict = self.admission.check(
                    rid, lane, {n: ln.scheduler for n, ln in self._lanes.items()},
                    prompt_tokens, max_new, arrival, now, self._boundary, later)
            except Exception:  # noqa: BLE001 - an estimate must not stop the server
                self.admission_errors += 1
                return False
            if verdict.reason is None:
                return False
            self._refused[lane] = (self._boundary, prompt_tokens, max_new, verdict)
        fut.set_result(Outcome(rid, "rejected", arrival, now, error=verdict.reason,
                               retry_after_s=verdict.retry_after_s))
        return True

    def _lane_model(self, lane: str) -> str:
        """The model a lane runs, by name (for the breaker and messages)."""
        return lane or self._lm_name()

    def _answered(self, rid: int, lane: str, gen: Generation, now: float) -> None:
        """A lane finished a request's answer."""
        p = self._pending.pop(rid)
        self.admission.answered(rid, lane, gen.num_tokens, p.max_new, now - p.arrival_s, now)
        p.future.set_result(Outcome(rid, "ok", p.arrival_s, now, gen.text, stage=0, gear=0,
                                    first_token_s=p.first_token_s, generation=gen))

    def _failed(self, rid: int, message: str, now: float, status: Status = "error") -> None:
        """A request ends without an answer: its pass failed (``error``), or shutdown
        cancelled it (``cancelled``)."""
        self.admission.forget(rid)
        p = self._pending.pop(rid, None)
        if p is not None and not p.future.done():
            p.future.set_result(Outcome(rid, status, p.arrival_s, now, error=message,
                                        first_token_s=p.first_token_s))

    # -- the loop ---------------------------------------------------------------------------

    def _receive(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is _STOP:
                self._stopping = True
                continue
            if item is _CANCEL:
                self._cancelling = True
                continue
            self._enter(*item)

    def _guarded_loop(self) -> None:
        """The loop; if it fails where no request is to blame (a bug), every request still
        gets an error outcome and ``submit`` refuses new ones."""
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            self._settled.set()
            self._crashed = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.closing.set()
            now = self.clock.now()
            for rid in list(self._pending):
                self._failed(rid, f"the decode server stopped: {self._crashed}", now)
            self._reject_inbox(f"the decode server stopped: {self._crashed}", "error")
            return
        self._reject_inbox("the decode server shut down before it ran", "cancelled")

    def _reject_inbox(self, message: str, status: Status) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP and item is not _CANCEL:
                rid, _item, _max_new, arrival, fut = item
                fut.set_result(Outcome(rid, status, arrival, self.clock.now(), error=message))

    def _loop(self) -> None:
        import torch

        torch.set_num_threads(self.lm.device.threads)
        self._tid = threading.get_native_id()
        # the idle class only where the watchdog can tell a starved pass from a stuck one
        if (self.cpu_priority == "background" and self.lm.device.kind == "cpu"
                and runqueue_wait_s(self._tid) is not None):
            self.yielded = yield_cores()
        self._settled.set()
        lanes = [self._lanes[n] for n in self._lane_names]
        while True:
            self._boundary += 1
            self._receive(block=self.load == 0 and not self._stopping)
            if self._cancelling:
                self._cancel_pending()
                return
            if self._stopping and self.load == 0:
                return
            k = pick_lane([lane.scheduler.oldest() for lane in lanes])
            if k is None:
                continue
            name, lane = self._lane_names[k], lanes[k]
            start = self.clock.now()
            wait0 = runqueue_wait_s(self._tid) if self.yielded else None
            with self._pass_lock:
                self._pass_started = start
                self._pass_wait0 = wait0
            try:
                step, finished, failed = lane.run(
                    self._pending, self.clock,
                    lambda step, lane=lane, name=name: self._set_limit(name, lane, step))
            except Exception as exc:  # noqa: BLE001 - a failed decode fails its batch only
                with self._pass_lock:
                    self._pass_started = None
                    if self._abandoned:
                        return
                now = self.clock.now()
                dropped = lane.drop_running()
                message = self._pass_failed(name, dropped, f"{type(exc).__name__}: {exc}")
                for rid in dropped:
                    self._failed(rid, message, now)
                continue
            with self._pass_lock:
                self._pass_started = None
                if self._abandoned:  # too late: every request already has its outcome
                    return
            now = self.clock.now()
            self.busy_s += now - start
            self.passes += 1
            self.prefill_passes += step.kind == "prefill"
            if step.kind == "prefill":
                for rid in step.request_ids:
                    if rid not in failed:
                        self._pending[rid].first_token_s = now
            if failed and len(failed) == len(step.request_ids):  # every joiner failed
                reason = self._pass_failed(name, list(failed), next(iter(failed.values())))
                if self.breaker.reason(self._lane_model(name)) is not None:
                    failed = dict.fromkeys(failed, reason)
            else:
                self.breaker.ran(_PassRef(self._lane_model(name)))
                if not failed:
                    try:
                        self.admission.passed(name, step.kind, len(step.request_ids),
                                              lane.last_tokens, now - start)
                    except Exception:  # noqa: BLE001 - a measurement must not stop the server
                        self.admission_errors += 1
            for rid, gen in finished:
                self._answered(rid, name, gen, now)
            for rid, message in failed.items():
                self._failed(rid, message, now)


    def _pass_failed(self, lane: str, ids: Sequence[int], message: str) -> str:
        """A pass of ``lane`` failed for every request in it (``ids``): when they are two or
        more (a failure one request alone can cause is not the model's), count it toward
        the crash-loop breaker; once the model is marked failed, every request queued on
        its lane ends ``error`` with the breaker's reason, which is returned for ``ids``
        (else ``message``)."""
        model = self._lane_model(lane)
        if len(set(ids)) < 2:
            return message
        self.breaker.failed(_PassRef(model, request_ids=tuple(ids)), message, crashed=True)
        reason = self.breaker.reason(model)
        if reason is None:
            return message
        now = self.clock.now()
        for rid in self._lanes[lane].clear():
            if rid not in ids:
                self._failed(rid, reason, now)
        return reason

    def _set_limit(self, name: str, lane: _Lane, step: DecodeStep) -> None:
        """The deadline of the pass about to run (``_watch`` reads it)."""
        if self.pass_timeout_s is not None:
            limit = (self.pass_timeout_s, "pass_timeout_s")
        else:
            times = self.admission.lane_times(name)
            expected = times.expected_s(step.kind, len(step.request_ids), lane.last_tokens)
            measured = times.measured(step.kind)
            limit = self.deadline.explain(None if measured else expected,
                                          expected if measured else None)
        with self._pass_lock:
            self._pass_limit = limit
            self._pass_model = self._lane_model(name)

    def _watch(self) -> None:
        """Give up on a pass that has not returned within its deadline (``_set_limit``; a
        stuck model: its thread cannot be stopped, so it is left behind, as a thread
        worker's call is): every request in the server ends ``error`` at once, and
        ``submit`` refuses more. A server at background priority is not charged the time its
        pass waited for a core (``_pass_elapsed``): a pass starved by busier threads is slow,
        not stuck. A pass stuck blocked still fails at its deadline; one stuck spinning, once
        it has spun that long between its waits."""
        thread = self._thread
        tick = 0.1 if self.pass_timeout_s is None else min(0.1, self.pass_timeout_s / 10)
        while thread is not None and thread.is_alive():
            time.sleep(tick)
            with self._pass_lock:
                started = self._pass_started
                limit, why = self._pass_limit
                if started is None or self._pass_elapsed(started) <= limit:
                    continue
                self._abandoned = True
                self._crashed = (f"{self._pass_model or self._lm_name()} did not return from a "
                                 f"forward pass within "
                                 f"{limit:.3g} s ({why}); its requests were failed and the "
                                 "server stopped")
                with self._lock:
                    self.closing.set()
                now = self.clock.now()
                for rid in list(self._pending):
                    self._failed(rid, self._crashed, now)
                self._reject_inbox(self._crashed, "error")
            return

    def _pass_elapsed(self, started: float) -> float:
        """Seconds the pass under way has run, less (at background priority) the time its
        thread waited for a core since it began. The kernel accounts a wait when it ends, so
        a wait under way counts until the thread next runs (a slice comes every second or so
        even on saturated cores: small against the deadline's 10-s floor); with more than one
        thread per pass (``DeviceConfig.threads``), only the loop thread's waits are left
        out."""
        elapsed = self.clock.now() - started
        if self._pass_wait0 is not None and self._tid is not None:
            waited = runqueue_wait_s(self._tid)
            if waited is not None:
                elapsed -= max(0.0, waited - self._pass_wait0)
        return elapsed

    def _lm_name(self) -> str:
        """The model the server runs, for messages."""
        return str(getattr(self.lm, "name", None) or "the model")

    def _cancel_pending(self) -> None:
        """Shutdown without drain: every request still queued or running ends cancelled."""
        now = self.clock.now()
        left = list(self._pending)
        for rid in left:
            self._failed(rid, "the decode server shut down before it finished", now,
                         "cancelled")
        self.cancelled += len(left)


class CascadeServer(DecodeServer):
    """A generation plan (``ken.policy.generating.GenPlan``) served on one device: a lane per
    model of the plan, each request's cascade chosen by the load when it arrives, a request
    whose answer is less certain than its stage's threshold queued on the next model's lane.

    ``submit_row(row)`` takes an operator's row (e.g. ``(question, passage)``); the future's
    ``Outcome`` carries the SQL value, the answering model, stage and gear. A row with no
    prompt (NULL or blank input) is answered at once with ``None``."""

    def __init__(self, models: Mapping[str, GenerativeModel], plan: GenPlan,
                 order: Order = "fcfs", targets: ServiceTargets | None = None,
                 pass_costs: Mapping[str, PassCost] | None = None,
                 pass_timeout_s: float | None = None,
                 latency_target_s: float | None = None,
                 admission: AdmissionMode = "target",
                 deadline: BatchDeadline | None = None,
                 cpu_priority: CpuPriority = "normal") -> None:
        """``order``, ``targets`` and ``pass_costs`` (per model): each lane's order of joiners,
        as in ``DecodeServer`` (the function's targets hold on every lane); ``pass_timeout_s``,
        ``deadline`` and ``cpu_priority`` as there. Admission holds each new request to
        ``latency_target_s``, by default the plan's predicted p99 (none when the plan was not
        simulated, e.g. written by hand); ``admission="none"`` queues every request. Rows
        sent with a gear (a table's rows in bulk) are always queued."""
        missing = [m for m in plan.models if m not in models]
        if missing:
            raise EngineError(f"the plan uses models {missing} that were not given")
        self.models = {m: models[m] for m in plan.models}
        self.plan = plan
        self.dispatcher = GenDispatcher(plan)
        self.tokens = dict.fromkeys(plan.models, 0)  # generated per model, every stage
        costs = pass_costs or {}
        self._lanes = {m: _Lane(model.lm, plan.max_running, plan.kv_budget_tokens,
                                plan.mode, model.stop, False, order, targets, costs.get(m))
                       for m, model in self.models.items()}
        target = latency_target_s if latency_target_s is not None else plan.latency_target_s()
        self._init_loop(pass_timeout_s, _admission(admission, target,
                                                   {m: costs.get(m) for m in plan.models}),
                        deadline, cpu_priority)

    @property
    def lm(self) -> CausalLM:
        return self.models[self.plan.models[0]].lm

    def submit(self, prompt: Sequence[int], max_new_tokens: int) -> Future:
        raise EngineError("a CascadeServer takes rows: use submit_row")

    def submit_row(self, row: Any, gear: int | None = None) -> Future:
        """Queue one row; the future resolves to its ``Outcome``. ``gear``: serve it with
        that gear whatever the load (e.g. 0, the most accurate, for a table's rows in bulk;
        they still count as load for the requests around them)."""
        if gear is not None and not 0 <= gear < len(self.plan.gears):
            raise EngineError(f"the plan has gears 0..{len(self.plan.gears) - 1}, not {gear}")
        return self._put((row, gear), 0)

    def _enter(self, rid: int, item: Any, max_new: int, arrival: float, fut: Future) -> None:
        now = self.clock.now()
        row, gear = item
        first = self.dispatcher.admit(rid, now, gear)
        self._pending[rid] = _Pending([], 0, arrival, fut, first, row=row)
        self._queue_on(rid, first, now, admit=gear is None)

    def _queue_on(self, rid: int, name: str, now: float, admit: bool = False) -> bool:
        """Queue the request on ``name``'s lane; answer it at once if the row has no prompt
        (None), fail it if the prompt can never run there or its model is marked failed.
        ``admit``: a new request, which admission may turn away."""
        p = self._pending[rid]
        model = self.models[name]
        try:
            prompt = model.requests([p.row])[0]
        except Exception as exc:  # noqa: BLE001 - a row the prompt cannot take fails alone
            self._failed(rid, f"{name}: {type(exc).__name__}: {exc}", now)
            return False
        if not prompt:
            self.dispatcher.drop(rid)
            self.admission.forget(rid)
            self._pending.pop(rid)
            p.future.set_result(Outcome(rid, "ok", p.arrival_s, now, None, 1.0, 0, name,
                                        self.dispatcher.current, first_token_s=now))
            return False
        lane = self._lanes[name]
        problem = lane.check(prompt, model.max_new_tokens) or lane.over_budget(
            len(prompt), model.max_new_tokens)
        if problem:
            self._failed(rid, f"{name}: {problem}", now)
            return False
        failed = self.breaker.reason(name)
        if failed is not None:
            self._failed(rid, failed, now)
            return False
        if admit and self._turned_away(rid, name, len(prompt), model.max_new_tokens,
                                       p.arrival_s, p.future, self._later(rid, name)):
            self.dispatcher.drop(rid)
            self._pending.pop(rid)
            return False
        p.prompt, p.max_new, p.lane, p.first_token_s = prompt, model.max_new_tokens, name, None
        lane.scheduler.admit(rid, len(prompt), model.max_new_tokens, p.arrival_s)
        return True

    def _later(self, rid: int, name: str) -> list[tuple[str, int]]:
        """The stages after ``name`` in request ``rid``'s cascade, each (lane, budget)."""
        models = self.dispatcher.plan.gears[self.dispatcher.gear_of(rid)].cascade.models
        after = list(models[list(models).index(name) + 1:]) if name in models else []
        return [(m, self.models[m].max_new_tokens) for m in after]

    def _answered(self, rid: int, lane: str, gen: Generation, now: float) -> None:
        model = self.models[lane]
        self.tokens[lane] += gen.num_tokens
        certainty = gen.certainty(model.certainty_kind)
        stage, gear = self.dispatcher.stage_of(rid), self.dispatcher.gear_of(rid)
        nxt = self.dispatcher.finished(rid, certainty)
        self.admission.stage_ended(lane, nxt is not None)
        if nxt is not None:
            self.admission.lane_lengths(lane).add(gen.num_tokens, self._pending[rid].max_new)
            self._queue_on(rid, nxt, now)
            return
        p = self._pending.pop(rid)
        self.admission.answered(rid, lane, gen.num_tokens, p.max_new, now - p.arrival_s, now)
        value = model.value(gen.text, p.row)
        p.future.set_result(Outcome(rid, "ok", p.arrival_s, now, value, certainty, stage, lane,
                                    gear, first_token_s=p.first_token_s, generation=gen))

    def _failed(self, rid: int, message: str, now: float, status: Status = "error") -> None:
        self.dispatcher.drop(rid)
        super()._failed(rid, message, now, status)


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
        return model.output(rows, [], [])
    with DecodeServer(model.lm, max_running=max(1, max_running), stop=model.stop) as server:
        futures = [server.submit(prompts[i], model.max_new_tokens) for i in live]
        outcomes = [f.result() for f in futures]
    bad = [o for o in outcomes if o.status != "ok" or o.generation is None]
    if bad:
        raise ModelError(f"{model.name}: {len(bad)} of {len(live)} rows failed to generate: "
                         f"{bad[0].error}")
    return model.output(rows, live, [o.generation for o in outcomes])


def kv_tokens_in(lm: CausalLM, memory_bytes: int) -> int:
    """KV-cache token slots that fit in ``memory_bytes`` beside ``lm``'s weights."""
    weights = weight_bytes(lm.net)
    per_token = kv_bytes_per_token(lm)
    if memory_bytes < weights + per_token:
        raise EngineError(f"a memory budget of {memory_bytes / 2**20:.0f} MiB holds no KV cache "
                          f"beside the {weights / 2**20:.0f} MiB of weights; give more memory")
    return (memory_bytes - weights) // per_token


class GenerationEngine:
    """A ``CascadeServer`` behind the online engine's interface to SQL queries
    (``submit_many``): a served generating function's calls become requests of its plan;
    a chunk sent as bulk rows is served by the most accurate gear."""

    workers = "thread"

    def __init__(self, server: CascadeServer) -> None:
        self.server = server

    @property
    def plan(self) -> GenPlan:
        return self.server.plan

    def describe_serving(self, bulk_threshold: int, operator: str | None = None) -> str:
        return (f"served by a decode server, a lane per model: chunks of < {bulk_threshold} "
                "new inputs as requests whose gear follows the load, larger ones by gear 1")

    def submit_many(self, texts: Sequence, bulk: bool = False, operator: str | None = None
                    ) -> list[Future]:
        if operator is not None and operator != self.plan.operator:
            raise EngineError(f"this decode server serves {self.plan.operator}(), not "
                              f"{operator}()")
        gear = 0 if bulk else None
        return [self.server.submit_row(t, gear) for t in texts]

    def shutdown(self, drain: bool = True, timeout_s: float = 60.0) -> int:
        """Stop the server as ``Engine.shutdown`` does: with ``drain``, the submitted requests
        finish (up to ``timeout_s``); the rest end ``cancelled``. Returns how many were."""
        return self.server.shutdown(drain, timeout_s)


def _paced(arrival_s: Sequence[float] | np.ndarray, submit: Any, items: Sequence) -> list:
    """Call ``submit(*item)`` at each arrival time (relative to now); wait for every future."""
    t0 = time.monotonic()
    futures = []
    for t, item in zip(arrival_s, items, strict=True):
        delay = float(t) - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)
        futures.append(submit(*item))
    return [f.result() for f in futures]


def replay(server: DecodeServer, arrival_s: Sequence[float] | np.ndarray,
           prompts: Sequence[Sequence[int]], max_new: Sequence[int]) -> list[Outcome]:
    """Submit ``prompts`` at the trace's arrival times (relative to now) and wait for all."""
    if not (len(arrival_s) == len(prompts) == len(max_new)):
        raise EngineError("give one prompt and one max_new per arrival")
    return _paced(arrival_s, server.submit, [(p, int(m)) for p, m in
                                             zip(prompts, max_new, strict=True)])


def replay_rows(server: CascadeServer, arrival_s: Sequence[float] | np.ndarray,
                rows: Sequence) -> list[Outcome]:
    """Submit operator rows at the trace's arrival times (relative to now); wait for all."""
    if len(arrival_s) != len(rows):
        raise EngineError("give one row per arrival")
    return _paced(arrival_s, server.submit_row, [(r,) for r in rows])


def as_gen_run(outcomes: Sequence[Outcome], quality: Sequence[float],
               server: DecodeServer) -> GenRun:
    """A measured run of a generation plan in the simulator's terms: ``quality[i]`` scores
    request ``i``'s value; requests that failed are left out (count them from the
    outcomes)."""
    keep = [i for i, o in enumerate(outcomes) if o.status == "ok"]
    if not keep:
        raise EngineError("no request finished; nothing to measure")
    ok = [outcomes[i] for i in keep]
    if isinstance(server, CascadeServer):
        tokens, switches = dict(server.tokens), tuple(server.dispatcher.switches)
    else:
        tokens = {"": sum(o.generation.num_tokens for o in ok if o.generation is not None)}
        switches = ()
    return GenRun(np.array([o.arrival_s for o in ok]),
                  np.array([o.first_token_s for o in ok], dtype=np.float64),
                  np.array([o.completion_s for o in ok]), np.array([o.stage for o in ok]),
                  np.array([o.gear for o in ok]),
                  np.asarray(quality, dtype=np.float64)[keep],
                  tokens, {"all": server.passes}, {"all": server.prefill_passes},
                  server.busy_s, switches)


def as_run(outcomes: Sequence[Outcome], passes: int = 0, prefill_passes: int = 0,
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
