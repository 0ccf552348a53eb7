"""Continuous batching of generation (iteration-level scheduling), shared by the simulator and
the online engine's decode loop — the same rule on a virtual or a wall clock.

A generating model serves requests one forward pass (a *step*) at a time. At each step
boundary the scheduler says what the next pass is:

- a *prefill* of waiting requests that may join (first come, first served): it runs their
  prompts and yields each one's first token;
- otherwise a *decode* pass over every running request (one more token each).

In ``continuous`` mode requests join whenever there is room (at most ``max_running`` running,
and the padded KV cache within ``kv_budget_tokens``); in ``static`` mode a new group joins only
when the running batch is empty (request-level batching, the baseline). The KV cache is
left-padded (``ken.models.generation.DecodeBatch``), so its size is rows x the longest row:
a join is admitted only if, at the end of every running and joining request's token budget,
``rows x max(prompt + max_new)`` stays within the budget — no request is ever preempted.

The caller reports each step's finished requests (``step_done``); load is the requests
running plus queued.

**Order of the joiners.** ``order="fcfs"`` (the default) lets waiting requests join in arrival
order and stops at the first one that does not fit. ``order="deadline"`` composes each prefill
the way Apt-Serve (SIGMOD 2025) does, for requests with latency targets (``ServiceTargets``:
a time to first token and a time between tokens per served function):

- *Value*: a waiting request's value is its pending time (``now`` minus its arrival: what
  serving it now takes off the sum of pending times, the paper's eq. 5) if its TTFT deadline
  can still be met (``now`` plus its prefill alone, by ``cost``, is within it), and it is
  demoted below every such request once it cannot (the paper's SLO-aware fallback) — it still
  joins when no request that can meet its deadline is left for the room.
- *Joiners*: the paper picks the set of most value under the cache memory by a greedy on value
  per unit of memory (a 2-approximation of the knapsack). Our KV cache is padded, so every row
  costs the same ``width`` slots: for a given width the greedy by value per memory is the
  greedy by value, and it is optimal (the most valuable requests whose row fits the width, as
  many as the budget and ``max_running`` leave room for). ``choose_joiners`` tries every width
  the joiners can set and keeps the best set, so the choice is the exact optimum of the
  objective (``joiner_value``), not an approximation.
- *Prefill size*: a prefill's rows get their first token when the whole pass ends, and on a
  CPU a pass costs about its tokens, so a big prefill can make every joiner miss a deadline
  each would meet alone. With a ``cost`` estimate, ``trim_joiners`` drops joiners (those past
  their deadline anyway first, then the ones with the latest deadline) until every joiner
  that can meet its deadline does; the dropped ones wait for the next prefill. (Apt-Serve's
  value ignores the pass time: on its GPUs a prefill's time grows little with its rows.)
- *Prefill or decode*: inserting a prefill stalls the running requests for its duration. With
  a ``cost`` estimate the scheduler counts the running requests whose total-generation-time
  deadline (``ServiceTargets.tgt_s``) holds if they decode now but breaks if the prefill goes
  first, against the joiners whose TTFT deadline holds now but breaks after one more decode
  pass; it decodes first only when more requests would be lost by the prefill (the paper's
  comparison of the urgency of the waiting and the running queue, counted in deadlines).

The policy reads no clock: the caller passes ``now`` (virtual in the simulator, the wall
clock in the engine) to ``next_step`` and ``step_done``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import numpy as np

from ken.errors import PolicyError

Mode = Literal["continuous", "static"]
Order = Literal["fcfs", "deadline"]
ORDERS: tuple[Order, ...] = ("fcfs", "deadline")


@dataclass(frozen=True)
class ServiceTargets:
    """Latency targets of a served function: the first token within ``ttft_s`` of arrival,
    then a token every ``tbt_s`` on average — the last one by ``tgt_s(tokens)``."""

    ttft_s: float
    tbt_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tbt_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise PolicyError(f"ServiceTargets.{name} must be a finite number of seconds "
                                  f"> 0, got {value!r}")

    def tgt_s(self, tokens: int | np.ndarray) -> float | np.ndarray:
        """Total generation time target (arrival to last token) of an answer of ``tokens``
        (a count, or an array of counts: the targets of each)."""
        if isinstance(tokens, np.ndarray):
            return self.ttft_s + self.tbt_s * np.maximum(tokens.astype(np.int64) - 1, 0)
        return self.ttft_s + self.tbt_s * max(0, tokens - 1)


class PassCost(Protocol):
    """Seconds a forward pass takes (``ken.optimizer.tokens.TokenCost`` is one)."""

    def prefill_s(self, batch: int, tokens: int) -> float: ...

    def decode_s(self, batch: int, width: int) -> float: ...


@dataclass(frozen=True)
class Candidate:
    """A waiting request as ``choose_joiners`` and ``trim_joiners`` see it: its row's final
    length (prompt plus token budget: its KV-cache row once done), its pending time, whether
    its TTFT deadline can still be met, its prompt length and that deadline."""

    request_id: int
    final_tokens: int
    pending_s: float
    meetable: bool
    prompt_tokens: int = 1
    ttft_deadline_s: float = math.inf


def joiner_value(chosen: Iterable[Candidate]) -> tuple[float, int, float, int]:
    """The objective of a set of joiners, compared as a tuple: first the pending time of those
    that can meet their deadline (Apt-Serve's value), then how many they are (a request that
    just arrived has waited 0 s but still gains from joining), then the same two for those that
    cannot (demoted: they matter only between sets equal on the first two)."""
    chosen = list(chosen)
    ok = [c.pending_s for c in chosen if c.meetable]
    late = [c.pending_s for c in chosen if not c.meetable]
    return math.fsum(ok), len(ok), math.fsum(late), len(late)


def _rank(c: Candidate, position: int) -> tuple[bool, float, int]:
    return (not c.meetable, -c.pending_s, position)


def choose_joiners(candidates: Sequence[Candidate], rows: int, longest: int, max_running: int,
                   kv_budget_tokens: int | None) -> tuple[int, ...]:
    """The joiners of most ``joiner_value`` that fit beside ``rows`` running requests whose
    longest final row is ``longest`` tokens: at most ``max_running`` rows in all and, with a
    budget, ``rows x width`` within it once every row is done (``width``: the longest final
    row). Exact: for each width a joiner can set, the most valuable candidates that fit it, as
    many as there is room for; the best over widths (ties: fewer cache slots, then the smaller
    width). Returns the request ids in the order of ``candidates`` (arrival order)."""
    ranked = sorted(range(len(candidates)), key=lambda k: _rank(candidates[k], k))
    widths = sorted({longest, *(c.final_tokens for c in candidates if c.final_tokens > longest)})
    if kv_budget_tokens is None:
        widths = widths[-1:]  # no budget: the widest admits everyone, at no cost in room
    best: tuple[tuple[float, int, float, int], int] | None = None
    best_pick: list[int] = []
    for width in widths:
        room = max_running - rows
        if kv_budget_tokens is not None:
            room = min(room, kv_budget_tokens // max(width, 1) - rows)
        if room <= 0:
            continue
        pick = [k for k in ranked if candidates[k].final_tokens <= width][:room]
        if not pick:
            continue
        used = max([longest, *(candidates[k].final_tokens for k in pick)])
        score = (joiner_value(candidates[k] for k in pick), -(rows + len(pick)) * used)
        if best is None or score > best:
            best, best_pick = score, pick
    return tuple(candidates[k].request_id for k in sorted(best_pick))


def trim_joiners(joiners: Sequence[Candidate], cost: PassCost, now: float
                 ) -> tuple[int, ...]:
    """Drop joiners while the prefill of them all would make one that can meet its TTFT
    deadline alone miss it (a prefill's rows get their first token when the whole pass
    ends): first a joiner past its deadline anyway (the longest prompt: it lengthens the
    pass most), else the one with the latest deadline (it can best wait for the next
    prefill). The dropped ones stay queued. Returns the ids kept, in the given order."""
    kept = list(joiners)
    while len(kept) > 1:
        end = now + cost.prefill_s(len(kept), max(c.prompt_tokens for c in kept))
        if all(not c.meetable or end <= c.ttft_deadline_s for c in kept):
            break
        late = [c for c in kept if not c.meetable]
        if late:
            drop = max(late, key=lambda c: (c.prompt_tokens, c.request_id))
        else:
            drop = max(kept, key=lambda c: (c.ttft_deadline_s, c.request_id))
        kept.remove(drop)
    return tuple(c.request_id for c in kept)


@dataclass(frozen=True)
class DecodeStep:
    """One forward pass: a prefill of joining requests or a decode of the running ones."""

    kind: Literal["prefill", "decode"]
    request_ids: tuple[int, ...]


@dataclass
class _Request:
    prompt_tokens: int
    max_new: int
    arrival_s: float = 0.0  # when it came to the operator (orders lanes: ``pick_lane``)
    fed: int = 0  # tokens in the cache after the prompt (one per decode pass)
    first_token_s: float | None = None  # when its prefill ended (``step_done``'s ``now``)

    @property
    def final_length(self) -> int:
        return self.prompt_tokens + self.max_new

    @property
    def length(self) -> int:
        return self.prompt_tokens + self.fed


class DecodeScheduler:
    """Which requests the next forward pass runs (see the module docstring)."""

    def __init__(self, max_running: int, kv_budget_tokens: int | None = None,
                 mode: Mode = "continuous", order: Order = "fcfs",
                 targets: ServiceTargets | None = None, cost: PassCost | None = None) -> None:
        """``order``: how waiting requests join a prefill (see the module docstring);
        ``"deadline"`` needs ``targets``. ``cost``: pass times the deadline order estimates
        with (None: passes count as instant, so only the choice of joiners changes)."""
        if max_running < 1:
            raise PolicyError(f"max_running must be >= 1, got {max_running}")
        if kv_budget_tokens is not None and kv_budget_tokens < 1:
            raise PolicyError(f"kv_budget_tokens must be >= 1, got {kv_budget_tokens}")
        if mode not in ("continuous", "static"):
            raise PolicyError(f"unknown batching mode {mode!r}; use continuous or static")
        if order not in ORDERS:
            raise PolicyError(f"unknown decode order {order!r}; use {' or '.join(ORDERS)}")
        if order == "deadline" and not isinstance(targets, ServiceTargets):
            raise PolicyError("order='deadline' needs targets=ServiceTargets(ttft_s, tbt_s)")
        self.max_running = max_running
        self.kv_budget_tokens = kv_budget_tokens
        self.mode = mode
        self.order = order
        self.targets = targets
        self.cost = cost
        self._waiting: deque[int] = deque()
        self._requests: dict[int, _Request] = {}
        self._running: dict[int, _Request] = {}  # insertion order = batch row order
        self._joining: tuple[int, ...] = ()
        self.steps = 0

    # -- state ------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def load(self) -> int:
        """Requests running plus queued (what the forward passes still have to serve)."""
        return len(self._running) + len(self._waiting)

    def width(self) -> int:
        """Padded cache length a decode pass attends over (the longest running row)."""
        return max((r.length for r in self._running.values()), default=0)

    def kv_tokens(self) -> int:
        """Padded KV cache size now, in token slots (rows x width)."""
        return len(self._running) * self.width()

    def oldest(self) -> float | None:
        """Arrival time of the earliest request running or queued here (None: idle)."""
        return min((r.arrival_s for r in self._requests.values()), default=None)

    def fits(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        """Whether one such request could ever run (alone) within the KV budget."""
        budget = self.kv_budget_tokens
        return budget is None or prompt_tokens + max_new_tokens <= budget

    # -- events -----------------------------------------------------------------------------

    def admit(self, request_id: int, prompt_tokens: int, max_new_tokens: int,
              arrival_s: float = 0.0) -> None:
        """Queue a request (first come, first served); ``arrival_s``: when it came to the
        operator (an escalated request keeps its first arrival)."""
        if request_id in self._requests:
            raise PolicyError(f"request {request_id} was already admitted")
        if prompt_tokens < 1 or max_new_tokens < 0:
            raise PolicyError(f"request {request_id}: needs >= 1 prompt token and "
                              f"max_new_tokens >= 0 (got {prompt_tokens}, {max_new_tokens})")
        if not self.fits(prompt_tokens, max_new_tokens):
            raise PolicyError(f"request {request_id}: {prompt_tokens} prompt + {max_new_tokens} "
                              f"new tokens exceed the KV budget of {self.kv_budget_tokens} tokens")
        self._requests[request_id] = _Request(prompt_tokens, max_new_tokens, arrival_s)
        self._waiting.append(request_id)

    def next_step(self, now: float | None = None) -> DecodeStep | None:
        """The next forward pass, or None when nothing is running or may join. ``now``: the
        caller's clock (the deadline order needs it)."""
        if self._joining:
            raise PolicyError("the previous prefill has not been reported done")
        if self.order == "deadline":
            if now is None or not math.isfinite(now):
                raise PolicyError(f"order='deadline' needs the time: next_step(now=...), "
                                  f"got {now!r}")
            join = self._deadline_joiners(now)
            if join and self._running and self._decode_first(join, now):
                join = ()
            if join:
                chosen = set(join)
                self._waiting = deque(r for r in self._waiting if r not in chosen)
        else:
            join = self._joiners()
        if join:
            self._joining = join
            return DecodeStep("prefill", join)
        if self._running:
            return DecodeStep("decode", tuple(self._running))
        return None

    def step_done(self, step: DecodeStep, finished: Iterable[int],
                  now: float | None = None) -> None:
        """``step`` ran; ``finished`` are the requests it completed (they leave the batch).
        ``now``: when it ended (a prefill's joiners got their first token then)."""
        self.steps += 1
        if step.kind == "prefill":
            if step.request_ids != self._joining:
                raise PolicyError("step_done got a prefill that was not the one scheduled")
            for rid in step.request_ids:
                req = self._requests[rid]
                req.first_token_s = now
                self._running[rid] = req
            self._joining = ()
        else:
            for rid in step.request_ids:
                req = self._running.get(rid)
                if req is None:
                    raise PolicyError(f"request {rid} is not running")
                req.fed += 1
        for rid in finished:
            if self._running.pop(rid, None) is None:
                raise PolicyError(f"request {rid} finished but was not running")
            del self._requests[rid]

    def drop_running(self) -> list[int]:
        """Remove the running requests and the prefill in flight (their pass failed); queued
        requests stay queued."""
        out = list(dict.fromkeys([*self._running, *self._joining]))
        for rid in out:
            del self._requests[rid]
        self._running.clear()
        self._joining = ()
        return out

    def clear(self) -> list[int]:
        """Remove every request, running, joining or queued (their model failed)."""
        out = list(dict.fromkeys([*self._running, *self._joining, *self._waiting]))
        self._requests.clear()
        self._running.clear()
        self._waiting.clear()
        self._joining = ()
        return out

    # -- what the queue costs ---------------------------------------------------------------

    def completion_s(self, now: float, cost: PassCost,
                     new: tuple[int, int] | None = None,
                     tokens: Callable[[int], int] | None = None,
                     horizon_s: float = math.inf, new_arrival_s: float | None = None,
                     new_id: int | None = None, max_passes: int = 20_000) -> float:
        """When the requests here are done if passes take what ``cost`` says: this
        scheduler's own rule run forward on a copy, from ``now`` (a pass boundary). With
        ``new`` (prompt tokens, max new tokens): when a request queued now would be done
        (it arrived at ``new_arrival_s``, default ``now``; its id ``new_id``, default one
        above every id here: the id a later request gets); else when the last one here is.
        ``tokens(max_new)``: how many tokens a request with that budget is expected to
        generate (default: all of them; answers that stop early make the estimate an upper
        bound). Past ``horizon_s`` from ``now``, or after ``max_passes`` passes, the run
        stops and returns ``math.inf`` (admission needs to know only whether a target is
        met)."""
        if self._joining:
            raise PolicyError("completion_s is asked at a pass boundary, not during a prefill")
        probe = new_id if new_id is not None and new_id not in self._requests else \
            max(self._requests, default=-1) + 1
        copy = DecodeScheduler(self.max_running, self.kv_budget_tokens, self.mode,
                               self.order, self.targets, self.cost)
        copy._requests = {rid: replace(r) for rid, r in self._requests.items()}
        copy._running = {rid: copy._requests[rid] for rid in self._running}
        copy._waiting = deque(self._waiting)
        goal = {}  # tokens each request generates in all
        made = {}  # tokens it has so far (a prefill yields the first)
        for rid, r in copy._requests.items():  # (a running request past its expected
            # tokens is still charged the next pass: a request ends only after a pass)
            made[rid] = min(r.max_new, 1 + r.fed) if rid in copy._running else 0
            goal[rid] = r.max_new if tokens is None else min(r.max_new, tokens(r.max_new))
        if new is not None:
            copy.admit(probe, new[0], new[1], now if new_arrival_s is None else new_arrival_s)
            made[probe] = 0
            goal[probe] = new[1] if tokens is None else min(new[1], tokens(new[1]))
        elif not copy._requests:
            return now
        t = now
        for _ in range(max_passes):
            if not copy._requests:
                return t
            step = copy.next_step(t)
            if step is None:
                raise PolicyError("a scheduler with requests has no pass; this is a bug")
            ids = step.request_ids
            if step.kind == "prefill":
                t += cost.prefill_s(len(ids), max(copy._requests[r].prompt_tokens
                                                  for r in ids))
            else:
                t += cost.decode_s(len(ids), copy.width())
            finished = []
            for rid in ids:
                if goal[rid] > made[rid]:
                    made[rid] += 1
                if made[rid] >= goal[rid]:
                    finished.append(rid)
            copy.step_done(step, finished, t)
            if new is not None and probe in finished:
                return t
            if t - now > horizon_s:
                return math.inf
        return t if not copy._requests else math.inf

    # -- internals --------------------------------------------------------------------------

    def _joiners(self) -> tuple[int, ...]:
        if not self._waiting or (self.mode == "static" and self._running):
            return ()
        rows = len(self._running)
        longest = max((r.final_length for r in self._running.values()), default=0)
        budget = self.kv_budget_tokens
        join: list[int] = []
        for rid in self._waiting:
            if rows + len(join) >= self.max_running:
                break
            longest_with = max(longest, self._requests[rid].final_length)
            if budget is not None and (rows + len(join) + 1) * longest_with > budget:
                break  # first come, first served: later requests do not overtake
            longest = longest_with
            join.append(rid)
        for _ in join:
            self._waiting.popleft()
        return tuple(join)

    def _deadline_joiners(self, now: float) -> tuple[int, ...]:
        """Apt-Serve's choice of joiners (``choose_joiners``); they stay queued."""
        if not self._waiting or (self.mode == "static" and self._running):
            return ()
        cands = [self._candidate(rid, now) for rid in self._waiting]
        longest = max((r.final_length for r in self._running.values()), default=0)
        join = choose_joiners(cands, len(self._running), longest, self.max_running,
                              self.kv_budget_tokens)
        if self.cost is None or len(join) < 2:
            return join
        chosen = set(join)
        return trim_joiners([c for c in cands if c.request_id in chosen], self.cost, now)

    def _candidate(self, rid: int, now: float) -> Candidate:
        req, targets = self._requests[rid], self.targets
        assert targets is not None  # checked in __init__
        alone = self.cost.prefill_s(1, req.prompt_tokens) if self.cost is not None else 0.0
        deadline = req.arrival_s + targets.ttft_s
        return Candidate(rid, req.final_length, max(0.0, now - req.arrival_s),
                         now + alone <= deadline, req.prompt_tokens, deadline)

    def _decode_first(self, join: tuple[int, ...], now: float) -> bool:
        """Whether to decode the running requests before the prefill of ``join`` (which then
        stays queued): more running requests would miss their TGT deadline because
        of the prefill than joiners would miss their TTFT deadline by one decode pass."""
        cost, targets = self.cost, self.targets
        if cost is None or targets is None:
            return False
        joiners = [self._requests[r] for r in join]
        prefill = cost.prefill_s(len(joiners), max(r.prompt_tokens for r in joiners))
        rows = len(self._running)
        decode_now = cost.decode_s(rows, self.width())
        widest = max(self.width(), max(r.prompt_tokens for r in joiners))
        decode_after = cost.decode_s(rows + len(joiners), widest)
        lost_by_prefill = 0
        for req in self._running.values():
            if req.first_token_s is not None and (
                    req.first_token_s > req.arrival_s + targets.ttft_s):
                continue  # already missed its target: nothing to save
            left = max(0, req.max_new - 1 - req.fed)  # decode passes still to run
            deadline = req.arrival_s + targets.tgt_s(req.max_new)
            if now + left * decode_now <= deadline < now + prefill + left * decode_after:
                lost_by_prefill += 1
        lost_by_waiting = sum(
            now + prefill <= r.arrival_s + targets.ttft_s < now + decode_now + prefill
            for r in joiners)
        return lost_by_prefill > lost_by_waiting
