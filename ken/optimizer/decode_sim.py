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
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ken.errors import SimulationError
from ken.models.cascade import Cascade
from ken.optimizer.tokens import TokenCost
from ken.policy.decoding import DecodeScheduler, Mode
from ken.policy.generating import GenDispatcher, pick_lane
from ken.policy.metrics import PlanMetrics, latency_percentiles
from ken.policy.plan import GenPlan, single_gear


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
        return _run_metrics(
            self.arrival_s, self.first_token_s, self.completion_s, self.busy_s,
            int(self.output_tokens.sum()), accuracy=math.nan, passes=self.passes,
            prefill_passes=self.prefill_passes,
            time_per_token_ms=float(np.median(per_token)) if per_token.size else 0.0)


def _run_metrics(arrival_s: np.ndarray, first_token_s: np.ndarray, completion_s: np.ndarray,
                 busy_s: float, tokens: int, accuracy: float, gear_switches: int = 0,
                 **known: Any) -> PlanMetrics:
    """The metrics of a generating run on one device from its per-request times (seconds):
    TTFT and TGT (the request latency) percentiles, span, throughput and utilisation, with
    the ``known`` fields its caller has (passes, escalated share, ...)."""
    ttft = (first_token_s - arrival_s) * 1000.0
    tgt = (completion_s - arrival_s) * 1000.0
    span = float(completion_s.max() - arrival_s.min()) if tgt.size else 0.0
    p50, p95, p99 = latency_percentiles(tgt)
    ttft_p50, ttft_p95, ttft_p99 = latency_percentiles(ttft)
    return PlanMetrics(
        p50_ms=p50, p95_ms=p95, p99_ms=p99, mean_ms=float(tgt.mean()),
        num_requests=int(tgt.size), duration_s=span,
        utilisation=(("device", busy_s / span if span > 0 else 0.0),),
        ttft_p50_ms=ttft_p50, ttft_p95_ms=ttft_p95, ttft_p99_ms=ttft_p99,
        tokens_per_s=tokens / span if span > 0 else 0.0, accuracy=accuracy,
        gear_switches=gear_switches, **known)


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
        return _run_metrics(
            self.arrival_s, self.first_token_s, self.completion_s, self.busy_s,
            sum(self.tokens.values()), accuracy=float(self.quality.mean()) if n else 0.0,
            accuracy_se=float(self.quality.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0,
            escalated=float(np.mean(self.stage > 0)) if n else 0.0,
            passes=sum(self.passes.values()), prefill_passes=sum(self.prefill_passes.values()),
            gear_switches=len(self.switches))


def _check_trace(arrivals: np.ndarray, rows: np.ndarray, num_rows: int) -> None:
    if rows.shape != arrivals.shape:
        raise SimulationError("give one row per arrival")
    if arrivals.size and (not np.all(np.isfinite(arrivals)) or np.any(np.diff(arrivals) < 0)):
        raise SimulationError("arrivals must be finite and sorted")
    if rows.size and (rows.min() < 0 or rows.max() >= num_rows):
        raise SimulationError(f"rows must index the {num_rows} sample rows")


def simulate_gen_plan(plan: GenPlan, costs: Mapping[str, TokenCost],
                      stages: Mapping[str, StageRows], arrival_s: Sequence[float] | np.ndarray,
                      rows: Sequence[int] | np.ndarray) -> GenRun:
    """Serve the trace with ``plan`` on one device, each pass charged by ``costs``."""
    models = plan.models
    missing = [m for m in models if m not in costs or m not in stages]
    if missing:
        raise SimulationError(f"no token cost or stage rows for {missing}")
    arrivals = np.asarray(arrival_s, dtype=np.float64)
    rows = np.asarray(rows, dtype=np.int64)
    _check_trace(arrivals, rows, min(len(stages[m].prompt_tokens) for m in models))
    n = arrivals.size
    lanes = {m: DecodeScheduler(plan.max_running, plan.kv_budget_tokens, plan.mode)
             for m in models}
    for m in models:
        st = stages[m]
        too_long = [int(r) for r in set(rows.tolist())
                    if not lanes[m].fits(int(st.prompt_tokens[r]), int(st.output_tokens[r]))]
        if too_long:
            raise SimulationError(f"{m}: rows {sorted(too_long)[:5]} never fit the KV budget "
                                  f"of {plan.kv_budget_tokens} tokens")
    disp = GenDispatcher(plan)
    first, done = np.full(n, np.nan), np.full(n, np.nan)
    stage_of, gear_of = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    quality = np.zeros(n)
    made = np.zeros(n, dtype=np.int64)
    tokens = dict.fromkeys(models, 0)
    passes = dict.fromkeys(models, 0)
    prefills = dict.fromkeys(models, 0)
    t, i, busy = 0.0, 0, 0.0

    def enter(rid: int, m: str) -> None:
        st = stages[m]
        r = rows[rid]
        made[rid] = 0
        lanes[m].admit(rid, int(st.prompt_tokens[r]), int(st.output_tokens[r]),
                       float(arrivals[rid]))

    while i < n or disp.load:
        while i < n and arrivals[i] <= t:
            enter(i, disp.admit(i, t))
            gear_of[i] = disp.gear_of(i)
            i += 1
        k = pick_lane([lanes[m].oldest() for m in models])
        if k is None:
            t = max(t, float(arrivals[i]))  # idle until the next arrival
            continue
        m = models[k]
        sched, st, cost = lanes[m], stages[m], costs[m]
        step = sched.next_step()
        if step is None:
            raise SimulationError(f"lane {m} holds requests but has no pass; this is a bug")
        ids = step.request_ids
        if step.kind == "prefill":
            dt = cost.prefill_s(len(ids), int(st.prompt_tokens[rows[list(ids)]].max()))
            prefills[m] += 1
        else:
            dt = cost.decode_s(len(ids), sched.width())
        t += dt
        busy += dt
        passes[m] += 1
        finished = []
        for rid in ids:
            if st.output_tokens[rows[rid]] > made[rid]:
                made[rid] += 1
                tokens[m] += 1
            if step.kind == "prefill":
                first[rid] = t
            if made[rid] >= st.output_tokens[rows[rid]]:
                finished.append(rid)
        sched.step_done(step, finished)
        for rid in finished:
            stage = disp.stage_of(rid)
            nxt = disp.finished(rid, float(st.certainty[rows[rid]]))
            if nxt is not None:
                enter(rid, nxt)
                continue
            done[rid] = t
            stage_of[rid] = stage
            quality[rid] = st.quality[rows[rid]]
    if n and np.isnan(done).any():
        raise SimulationError("some requests were never answered; this is a bug")
    return GenRun(arrivals.copy(), first, done, stage_of, gear_of, quality, tokens, passes,
                  prefills, busy, tuple(disp.switches))


def simulate_decoding(cost: TokenCost, arrival_s: Sequence[float] | np.ndarray,
                      prompt_tokens: Sequence[int] | np.ndarray,
                      output_tokens: Sequence[int] | np.ndarray, max_running: int,
                      kv_budget_tokens: int | None = None, mode: Mode = "continuous"
                      ) -> DecodeRun:
    """Serve the requests through ``DecodeScheduler`` with passes timed by ``cost`` (one
    model: a one-gear plan whose sample rows are the requests)."""
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
    run = simulate_gen_plan(plan, {"model": cost}, {"model": stage}, arrivals, np.arange(n))
    if run.tokens["model"] != int(outputs.sum()):
        raise SimulationError("some requests did not get all their tokens; this is a bug")
    return DecodeRun(arrivals.copy(), run.first_token_s, run.completion_s, prompts.copy(),
                     outputs.copy(), run.passes["model"], run.prefill_passes["model"],
                     run.busy_s)
