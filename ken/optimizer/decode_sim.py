"""Simulation of a generating model serving a trace, one forward pass at a time.

The same ``DecodeScheduler`` as the engine's decode loop (``ken.engine.decode``) decides each
pass; a ``TokenCost`` says how long it takes. Request ``i`` of the trace has a prompt of
``prompt_tokens[i]`` tokens and generates ``output_tokens[i]`` (the trace's ContextTokens and
GeneratedTokens, usually scaled to what the model serves here): its first token comes out of
the prefill pass it joins (TTFT), its last out of its last decode pass (TGT, the total
generation time, arrival to last token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ken.errors import SimulationError
from ken.optimizer.simulator import latency_percentiles
from ken.optimizer.tokens import TokenCost
from ken.policy.decoding import DecodeScheduler, Mode


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

    def metrics(self) -> DecodeMetrics:
        ttft = (self.first_token_s - self.arrival_s) * 1000.0
        tgt = (self.completion_s - self.arrival_s) * 1000.0
        gen = self.output_tokens > 1
        per_token = ((self.completion_s[gen] - self.first_token_s[gen])
                     / (self.output_tokens[gen] - 1) * 1000.0)
        span = float(self.completion_s.max() - self.arrival_s.min())
        ttft_p50, ttft_p95, ttft_p99 = latency_percentiles(ttft)
        tgt_p50, tgt_p95, tgt_p99 = latency_percentiles(tgt)
        return DecodeMetrics(
            requests=int(self.arrival_s.size),
            ttft_p50_ms=ttft_p50, ttft_p95_ms=ttft_p95, ttft_p99_ms=ttft_p99,
            tgt_p50_ms=tgt_p50, tgt_p95_ms=tgt_p95, tgt_p99_ms=tgt_p99,
            time_per_token_ms=float(np.median(per_token)) if per_token.size else 0.0,
            tokens_per_s=float(self.output_tokens.sum() / span) if span > 0 else 0.0,
            passes=self.passes, prefill_passes=self.prefill_passes,
            utilisation=self.busy_s / span if span > 0 else 0.0)


@dataclass(frozen=True)
class DecodeMetrics:
    """Latency of generating requests: TTFT (to the first token) and TGT (to the last)."""

    requests: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    tgt_p50_ms: float
    tgt_p95_ms: float
    tgt_p99_ms: float
    time_per_token_ms: float  # median over requests of (last - first token) / (tokens - 1)
    tokens_per_s: float  # generated tokens over the run's span
    passes: int
    prefill_passes: int
    utilisation: float  # share of the span the model was running a pass


def simulate_decoding(cost: TokenCost, arrival_s: Sequence[float] | np.ndarray,
                      prompt_tokens: Sequence[int] | np.ndarray,
                      output_tokens: Sequence[int] | np.ndarray, max_running: int,
                      kv_budget_tokens: int | None = None, mode: Mode = "continuous"
                      ) -> DecodeRun:
    """Serve the requests through ``DecodeScheduler`` with passes timed by ``cost``."""
    arrivals = np.asarray(arrival_s, dtype=np.float64)
    prompts = np.asarray(prompt_tokens, dtype=np.int64)
    outputs = np.asarray(output_tokens, dtype=np.int64)
    n = arrivals.size
    if prompts.shape != (n,) or outputs.shape != (n,):
        raise SimulationError("give one prompt length and one output length per arrival")
    if n and (not np.all(np.isfinite(arrivals)) or np.any(np.diff(arrivals) < 0)
              or prompts.min() < 1 or outputs.min() < 0):
        raise SimulationError("arrivals must be finite and sorted, prompts >= 1 token, outputs "
                              ">= 0 tokens")
    sched = DecodeScheduler(max_running, kv_budget_tokens, mode)
    first = np.full(n, np.nan)
    done = np.full(n, np.nan)
    made = np.zeros(n, dtype=np.int64)  # tokens generated so far per request
    t, i, passes, prefills, busy = 0.0, 0, 0, 0, 0.0
    while i < n or sched.load:
        while i < n and arrivals[i] <= t:
            sched.admit(i, int(prompts[i]), int(outputs[i]))
            i += 1
        step = sched.next_step()
        if step is None:
            t = max(t, float(arrivals[i]))  # idle until the next arrival
            continue
        ids = step.request_ids
        if step.kind == "prefill":
            dt = cost.prefill_s(len(ids), int(prompts[list(ids)].max()))
            prefills += 1
        else:
            dt = cost.decode_s(len(ids), sched.width())
        t += dt
        busy += dt
        passes += 1
        finished = []
        for rid in ids:
            if outputs[rid] > made[rid]:
                made[rid] += 1
            if step.kind == "prefill":
                first[rid] = t
            if made[rid] >= outputs[rid]:
                finished.append(rid)
                done[rid] = t
        sched.step_done(step, finished)
    if n and (np.isnan(done).any() or np.any(made != outputs)):
        raise SimulationError("some requests did not get all their tokens; this is a bug")
    return DecodeRun(arrivals.copy(), first, done, prompts.copy(), outputs.copy(), passes,
                     prefills, busy)
