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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from ken.errors import PolicyError

Mode = Literal["continuous", "static"]


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

    @property
    def final_length(self) -> int:
        return self.prompt_tokens + self.max_new

    @property
    def length(self) -> int:
        return self.prompt_tokens + self.fed


class DecodeScheduler:
    """Which requests the next forward pass runs (see the module docstring)."""

    def __init__(self, max_running: int, kv_budget_tokens: int | None = None,
                 mode: Mode = "continuous") -> None:
        if max_running < 1:
            raise PolicyError(f"max_running must be >= 1, got {max_running}")
        if kv_budget_tokens is not None and kv_budget_tokens < 1:
            raise PolicyError(f"kv_budget_tokens must be >= 1, got {kv_budget_tokens}")
        if mode not in ("continuous", "static"):
            raise PolicyError(f"unknown batching mode {mode!r}; use continuous or static")
        self.max_running = max_running
        self.kv_budget_tokens = kv_budget_tokens
        self.mode = mode
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

    def next_step(self) -> DecodeStep | None:
        """The next forward pass, or None when nothing is running or may join."""
        if self._joining:
            raise PolicyError("the previous prefill has not been reported done")
        join = self._joiners()
        if join:
            self._joining = join
            return DecodeStep("prefill", join)
        if self._running:
            return DecodeStep("decode", tuple(self._running))
        return None

    def step_done(self, step: DecodeStep, finished: Iterable[int]) -> None:
        """``step`` ran; ``finished`` are the requests it completed (they leave the batch)."""
        self.steps += 1
        if step.kind == "prefill":
            if step.request_ids != self._joining:
                raise PolicyError("step_done got a prefill that was not the one scheduled")
            for rid in step.request_ids:
                self._running[rid] = self._requests[rid]
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
