"""Simulation of a generating model serving a trace, one forward pass at a time.

The same ``DecodeScheduler`` as the engine's decode loop (``ken.engine.decode``) decides each
pass; a ``TokenCost`` says how long it takes. Request ``i`` of the trace has a prompt of
``prompt_tokens[i]`` tokens and generates ``output_tokens[i]`` (the trace's ContextTokens and
GeneratedTokens, usually scaled to what the model serves here): its first token comes out of
the prefill pass it joins (TTFT), its last out of its last decode pass (TGT, the total
generation time, arrival to last token).

``simulate_gen_plan`` serves a load-gear plan of generating cascades (``ken.policy.generating``)
the way the engine's decode server does: one lane per model on the device, the lane holding
the earliest request runs the next pass, and a request whose answer is not certain enough
joins the next model's lane. What each model does with each row (prompt and answer lengths,
the answer's certainty and quality) comes from running the models on a sample
(``StageRows``); request ``i`` of a trace asks for row ``rows[i]``. For a cascade, TTFT is the
first token of the answer the user gets (the resolving stage's): earlier stages' answers are
not streamed, as they may be replaced.

The plan runs on the event loop of ``ken.optimizer.sim_core`` as one runner (``_DecodeServer``)
whose work is a forward pass on the one device, charged by ``TokenCost``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ken.errors import PolicyError, SimulationError
from ken.models.cascade import Cascade
from ken.optimizer.sim_core import EventLoop, Record, run_metrics
from ken.optimizer.tokens import TokenCost
from ken.policy.decoding import DecodeScheduler, DecodeStep, Mode, Order, ServiceTargets
from ken.policy.generating import GenDispatcher, pick_lane
from ken.policy.metrics import PlanMetrics
from ken.policy.plan import GenPlan, single_gear
from ken.policy.scheduling import VirtualClock

_DEVICE = "device"  # the one device a generation plan is served on


@dataclass(frozen=True, eq=False)
class DecodeRun:
    """Per-request times (seconds) and token counts of one run, simulated or measured."""

    arrival_s: np.ndarray = field(repr=False)
    first_token_s: np.ndarray = field(repr=False)
    completion_s: np.ndarray = field(repr=False)
    prompt_tokens: np.ndarray = field(repr=False)
    output_tokens: np.ndarray = field(repr=False)
    passes: int = 0
    prefill_passes: int = 0
    busy_s: float = 0.0

    def metrics(self) -> PlanMetrics:
        """Latency and throughput (no quality: ``accuracy`` is NaN)."""
        gen = self.output_tokens > 1
        per_token = ((self.completion_s[gen] - self.first_token_s[gen])
                     / (self.output_tokens[gen] - 1) * 1000.0)
        return run_metrics(
            self.arrival_s, self.completion_s, ((_DEVICE, self.busy_s),), math.nan, 0,
            first_token_s=self.first_token_s, tokens=int(self.output_tokens.sum()),
            passes=self.passes, prefill_passes=self.prefill_passes,
            time_per_token_ms=float(np.median(per_token)) if per_token.size else 0.0)

    def meets(self, targets: ServiceTargets) -> np.ndarray:
        """Per request: first token within ``targets.ttft_s`` of arrival and the last within
        ``targets.tgt_s(tokens)`` (the TTFT target plus a TBT target per further token)."""
        return meets_targets(self.arrival_s, self.first_token_s, self.completion_s,
                             self.output_tokens, targets)

    def goodput(self, targets: ServiceTargets, requests: int | None = None) -> float:
        """Share of the requests that met both targets (``meets``); ``requests``: how many
        were sent, when some failed and are not in the run (they count as missed)."""
        total = self.arrival_s.size if requests is None else requests
        if total < self.arrival_s.size:
            raise SimulationError(f"{self.arrival_s.size} requests ran but only {total} "
                                  "were sent")
        return float(self.meets(targets).sum() / total) if total else 0.0


def meets_targets(arrival_s: np.ndarray, first_token_s: np.ndarray, completion_s: np.ndarray,
                  output_tokens: np.ndarray, targets: ServiceTargets) -> np.ndarray:
    """Which requests met their TTFT and TGT targets (``DecodeRun.meets``)."""
    ttft = np.asarray(first_token_s, np.float64) - arrival_s
    tgt = np.asarray(completion_s, np.float64) - arrival_s
    return (ttft <= targets.ttft_s) & (tgt <= targets.tgt_s(np.asarray(output_tokens)))


@dataclass(frozen=True, eq=False)
class StageRows:
    """One model on each row of a sample: prompt and answer lengths in its tokens, its
    answer's certainty and quality (e.g. token F1 against the reference)."""

    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    certainty: np.ndarray
    quality: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.prompt_tokens)
        for name in ("prompt_tokens", "output_tokens", "certainty", "quality"):
            value = np.asarray(getattr(self, name))
            if value.shape != (n,):
                raise SimulationError(f"StageRows.{name} needs {n} values, one per row")
            object.__setattr__(self, name, value)
        if n and (self.prompt_tokens.min() < 1 or self.output_tokens.min() < 0):
            raise SimulationError("prompts need >= 1 token and answers >= 0 tokens")


@dataclass(frozen=True, eq=False)
class GenRun:
    """Per-request times (seconds), resolving stage, gear and answer quality of one run of a
    generation plan, simulated or measured; token and pass counts per model."""

    arrival_s: np.ndarray = field(repr=False)
    first_token_s: np.ndarray = field(repr=False)  # of the answer returned
    completion_s: np.ndarray = field(repr=False)
    stage: np.ndarray = field(repr=False)  # 0-based stage that answered
    gear: np.ndarray = field(repr=False)
    quality: np.ndarray = field(repr=False)
    tokens: dict[str, int] = field(default_factory=dict)  # generated, per model
    passes: dict[str, int] = field(default_factory=dict)
    prefill_passes: dict[str, int] = field(default_factory=dict)
    busy_s: float = 0.0
    switches: tuple[tuple[float, int, int], ...] = ()

    def metrics(self) -> PlanMetrics:
        n = int(self.quality.size)
        return run_metrics(
            self.arrival_s, self.completion_s, ((_DEVICE, self.busy_s),),
            float(self.quality.mean()) if n else 0.0, len(self.switches),
            first_token_s=self.first_token_s, tokens=sum(self.tokens.values()),
            accuracy_se=float(self.quality.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0,
            escalated=float(np.mean(self.stage > 0)) if n else 0.0,
            passes=sum(self.passes.values()), prefill_passes=sum(self.prefill_passes.values()))


def _check_trace(arrivals: np.ndarray, rows: np.ndarray, num_rows: int) -> None:
    if rows.shape != arrivals.shape:
        raise SimulationError("give one row per arrival")
    if arrivals.size and (not np.all(np.isfinite(arrivals)) or np.any(np.diff(arrivals) < 0)):
        raise SimulationError("arrivals must be finite and sorted")
    if rows.size and (rows.min() < 0 or rows.max() >= num_rows):
        raise SimulationError(f"rows must index the {num_rows} sample rows")


def simulate_gen_plan(plan: GenPlan, costs: Mapping[str, TokenCost],
                      stages: Mapping[str, StageRows], arrival_s: Sequence[float] | np.ndarray,
                      rows: Sequence[int] | np.ndarray, order: Order = "fcfs",
                      targets: ServiceTargets | None = None) -> GenRun:
    """Serve the trace with ``plan`` on one device, each pass charged by ``costs``.
    ``order`` and ``targets``: how each lane's ``DecodeScheduler`` orders joiners (the
    deadline order estimates passes with the same ``costs``)."""
    models = plan.models
    missing = [m for m in models if m not in costs or m not in stages]
    if missing:
        raise SimulationError(f"no token cost or stage rows for {missing}")
    arrivals = np.asarray(arrival_s, dtype=np.float64)
    rows = np.asarray(rows, dtype=np.int64)
    _check_trace(arrivals, rows, min(len(stages[m].prompt_tokens) for m in models))
    n = arrivals.size
    record = Record(arrivals.copy(), 1)
    server = _DecodeServer(plan, costs, stages, rows, record, order, targets)
    loop = EventLoop([server], [(0,)] * n, VirtualClock(), record)
    loop.run()
    return GenRun(record.arrival_s, np.asarray(record.first_token_s, np.float64),
                  np.asarray(record.completion_s, np.float64),
                  np.asarray(record.stage[0], np.int64), np.asarray(record.gear[0], np.int64),
                  np.asarray(record.quality[0], np.float64), server.tokens, server.passes,
                  server.prefills, loop.device_busy_s.get(_DEVICE, 0.0),
                  tuple(server.dispatcher.switches))


def simulate_decoding(cost: TokenCost, arrival_s: Sequence[float] | np.ndarray,
                      prompt_tokens: Sequence[int] | np.ndarray,
                      output_tokens: Sequence[int] | np.ndarray, max_running: int,
                      kv_budget_tokens: int | None = None, mode: Mode = "continuous",
                      order: Order = "fcfs", targets: ServiceTargets | None = None
                      ) -> DecodeRun:
    """Serve the requests through ``DecodeScheduler`` with passes timed by ``cost`` (one
    model: a one-gear plan whose sample rows are the requests); ``order="deadline"`` with
    ``targets``: Apt-Serve's choice of joiners (``ken.policy.decoding``)."""
    arrivals = np.asarray(arrival_s, dtype=np.float64)
    prompts = np.asarray(prompt_tokens, dtype=np.int64)
    outputs = np.asarray(output_tokens, dtype=np.int64)
    n = arrivals.size
    if prompts.shape != (n,) or outputs.shape != (n,):
        raise SimulationError("give one prompt length and one output length per arrival")
    plan = single_gear("decode", Cascade(("model",)), max_running, kv_budget_tokens, mode)
    try:
        stage = StageRows(prompts, outputs, np.ones(n), np.zeros(n))
    except SimulationError as exc:
        raise SimulationError(f"arrivals must be finite and sorted, prompts >= 1 token, "
                              f"outputs >= 0 tokens ({exc})") from None
    run = simulate_gen_plan(plan, {"model": cost}, {"model": stage}, arrivals, np.arange(n),
                            order, targets)
    if run.tokens["model"] != int(outputs.sum()):
        raise SimulationError("some requests did not get all their tokens; this is a bug")
    return DecodeRun(arrivals.copy(), run.first_token_s, run.completion_s, prompts.copy(),
                     outputs.copy(), run.passes["model"], run.prefill_passes["model"],
                     run.busy_s)


@dataclass(frozen=True, eq=False)
class _Pass:
    """One forward pass of a lane (``width``: the lane's batch width as it started)."""

    model: str
    step: DecodeStep
    width: int
    devices: tuple[str, ...] = (_DEVICE,)


class _DecodeServer:
    """A generation plan on one device as a ``Runner`` of the event loop: a lane per model,
    one forward pass at a time. New requests wait for the pass in flight; once it ends (a
    deadline at that instant, so after every request that arrived by then) they are admitted
    and the lane holding the earliest request runs the next pass."""

    def __init__(self, plan: GenPlan, costs: Mapping[str, TokenCost],
                 stages: Mapping[str, StageRows], rows: np.ndarray, record: Record,
                 order: Order = "fcfs", targets: ServiceTargets | None = None) -> None:
        self.models, self.costs, self.stages, self.rows = plan.models, costs, stages, rows
        try:
            self.lanes = {m: DecodeScheduler(plan.max_running, plan.kv_budget_tokens,
                                             plan.mode, order, targets, costs[m])
                          for m in self.models}
        except PolicyError as exc:
            raise SimulationError(str(exc)) from None
        for m in self.models:
            st = stages[m]
            too_long = [int(r) for r in set(rows.tolist()) if not self.lanes[m].fits(
                int(st.prompt_tokens[r]), int(st.output_tokens[r]))]
            if too_long:
                raise SimulationError(f"{m}: rows {sorted(too_long)[:5]} never fit the KV "
                                      f"budget of {plan.kv_budget_tokens} tokens")
        self.dispatcher = GenDispatcher(plan)
        self.record = record
        self.tokens = dict.fromkeys(self.models, 0)  # generated, per model
        self.passes = dict.fromkeys(self.models, 0)
        self.prefills = dict.fromkeys(self.models, 0)
        self._made = np.zeros(rows.size, dtype=np.int64)  # tokens of the current stage
        self._waiting: list[int] = []  # arrived, not yet admitted
        self._free_s = 0.0  # when the device is free (the last pass ended)
        self._running = False
        self._next_pass_s: float | None = None

    def _enter(self, rid: int, m: str) -> None:
        st, r = self.stages[m], self.rows[rid]
        self._made[rid] = 0
        self.lanes[m].admit(rid, int(st.prompt_tokens[r]), int(st.output_tokens[r]),
                            float(self.record.arrival_s[rid]))

    def arrive(self, request_id: int, now: float) -> tuple[()]:
        self._waiting.append(request_id)
        if not self._running and self._next_pass_s is None:
            self._next_pass_s = max(now, self._free_s)
        return ()

    def next_deadline(self) -> float | None:
        return self._next_pass_s

    def expire(self, now: float) -> list[_Pass]:
        """Admit the requests that arrived, then start the next pass (if any lane has one)."""
        self._next_pass_s = None
        disp, gear = self.dispatcher, self.record.gear[0]
        for rid in self._waiting:
            self._enter(rid, disp.admit(rid, now))
            gear[rid] = disp.gear_of(rid)
        self._waiting.clear()
        k = pick_lane([self.lanes[m].oldest() for m in self.models])
        if k is None:
            return []
        m = self.models[k]
        sched = self.lanes[m]
        step = sched.next_step(now)
        if step is None:
            raise SimulationError(f"lane {m} holds requests but has no pass; this is a bug")
        self._running = True
        self.passes[m] += 1
        if step.kind == "prefill":
            self.prefills[m] += 1
        return [_Pass(m, step, sched.width())]

    def runtime_s(self, p: _Pass, now: float) -> float:
        ids, cost = p.step.request_ids, self.costs[p.model]
        if p.step.kind == "prefill":
            longest = int(self.stages[p.model].prompt_tokens[self.rows[list(ids)]].max())
            return cost.prefill_s(len(ids), longest)
        return cost.decode_s(len(ids), p.width)

    def complete(self, p: _Pass, now: float) -> tuple[tuple[()], list[int]]:
        """Each request of the pass made a token; those done with their stage escalate or
        are answered."""
        m, st, rows, made = p.model, self.stages[p.model], self.rows, self._made
        first = self.record.first_token_s
        finished = []
        for rid in p.step.request_ids:
            if st.output_tokens[rows[rid]] > made[rid]:
                made[rid] += 1
                self.tokens[m] += 1
            if p.step.kind == "prefill":
                first[rid] = now
            if made[rid] >= st.output_tokens[rows[rid]]:
                finished.append(rid)
        self.lanes[m].step_done(p.step, finished, now)
        answered = []
        for rid in finished:
            stage = self.dispatcher.stage_of(rid)
            nxt = self.dispatcher.finished(rid, float(st.certainty[rows[rid]]))
            if nxt is not None:
                self._enter(rid, nxt)
                continue
            self.record.stage[0][rid] = stage
            self.record.quality[0][rid] = float(st.quality[rows[rid]])
            answered.append(rid)
        self._running, self._free_s, self._next_pass_s = False, now, now
        return (), answered

    def freed(self, devices: tuple[str, ...], now: float) -> tuple[()]:
        return ()  # the only runner on its device
