"""Planning load-gear plans of generating operators with token-level cost.

Inputs: what each model does with each row of a sample (``StageRows``: prompt and answer
lengths, certainty, quality), each model's ``TokenCost`` (prefill and decode passes timed on
this device) and a planning trace (arrival times and the row each request asks for).

1. ``cascade_candidates``: every model alone and every ordered pair ``small -> large`` with
   thresholds at quantiles of the small model's certainty; each scored on the sample (mean
   quality) and by its work per row (a row's share of full decode passes, ``row_work_s``);
   only the candidates that no other beats on both are kept.
2. ``plan_generation``: every plan of up to ``max_gears`` candidates, most accurate first,
   with load edges from a grid, served on the planning windows by ``simulate_gen_plan`` (the
   decode server's policy on a virtual clock, each pass charged its token cost); the most
   accurate plan whose latency metric (TGT p95 by default) meets the target in every window
   wins.
3. ``plan_generating``: the whole of it for an operator and a ``Target`` (what
   ``session.plan`` and ``ken plan`` run for a generating function): a latency bound
   (``p95``/``tgt_p95``: total generation time, ``ttft_p95``: time to first token) takes the
   most accurate plan within it, a quality floor the fastest plan (TGT p95) that reaches it.

Load is counted in requests in the system (running plus queued, ``ken.policy.generating``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ken.errors import PlanningError
from ken.models.cascade import Cascade
from ken.optimizer.decode_sim import StageRows, simulate_gen_plan
from ken.optimizer.pareto import pareto_front
from ken.optimizer.tokens import TokenCost
from ken.policy.metrics import PlanMetrics
from ken.policy.plan import GenGear, GenPlan

if TYPE_CHECKING:
    from ken.models.llm import GenerativeModel
    from ken.models.quality import EvalSample
    from ken.ops.base import OpContext, Operator
    from ken.optimizer.query import Target

DEFAULT_EDGES = (2, 4, 8, 16, 32, 64)
METRICS = ("tgt_p95_ms", "tgt_p99_ms", "ttft_p95_ms", "ttft_p99_ms", "tgt_p50_ms",
           "ttft_p50_ms")


@dataclass(frozen=True)
class GenCandidate:
    """A cascade with its mean quality on the sample and its work per row (seconds)."""

    cascade: Cascade
    quality: float
    work_s: float
    escalated: float = 0.0  # share of rows the first stage passes on


@dataclass(frozen=True)
class GenChoice:
    """A plan and what the simulator measured for it on the planning trace."""

    plan: GenPlan
    metrics: PlanMetrics


def answer_sample(model: GenerativeModel, sample: EvalSample, batch_size: int = 8,
                  on_batch: Callable[[int], None] | None = None) -> tuple[StageRows, list]:
    """What ``model`` does with each row of ``sample``: prompt tokens, forward passes of its
    answer (its tokens, plus one for an end-of-sequence token), certainty and quality; and
    the answers' values. Every row must have a prompt; ``on_batch(rows)`` after each batch."""
    from ken.models.generation import generate

    prompts = model.requests(sample.texts)
    live = [i for i, p in enumerate(prompts) if p]
    if len(live) != len(prompts):
        raise PlanningError(f"{len(prompts) - len(live)} rows of {sample.name} have no prompt "
                            "(NULL or blank); plan on rows that do")
    gens = generate(model.lm, prompts, model.max_new_tokens, model.stop,
                    batch_size=batch_size, on_batch=on_batch)
    out = model.output(sample.texts, live, gens)
    passes = [g.num_tokens + (g.finish == "eos") for g in gens]
    return StageRows(np.array([len(p) for p in prompts]), np.array(passes),
                     np.asarray(out.scores, dtype=float),
                     np.asarray(sample.quality(out.values), dtype=float)), list(out.values)


def trace_window(arrival_s: np.ndarray, start_s: float, duration_s: float, requests: int,
                 span_s: float, rng: np.random.Generator) -> np.ndarray:
    """``requests`` arrivals thinned at random from ``[start_s, start_s + duration_s)`` of a
    trace and stretched to ``span_s`` seconds: the window's bursts at a rate this machine
    serves."""
    t = arrival_s[(arrival_s >= start_s) & (arrival_s < start_s + duration_s)]
    if t.size < requests:
        raise PlanningError(f"the trace holds {t.size} < {requests} arrivals in "
                            f"[{start_s:g}, {start_s + duration_s:g}) s")
    keep = np.sort(rng.choice(t, requests, replace=False))
    return (keep - start_s) * span_s / duration_s


def row_work_s(cost: TokenCost, stage: StageRows, max_running: int) -> np.ndarray:
    """Each row's share of full passes: its prompt in a prefill of ``max_running`` such
    prompts, and one decode pass per further token beside ``max_running - 1`` others."""
    b = max_running
    prompt, out = stage.prompt_tokens, stage.output_tokens
    prefill = np.array([cost.prefill_s(b, int(p)) for p in prompt]) / b
    decode = np.array([max(int(o) - 1, 0) * cost.decode_s(b, int(p + o)) for p, o in
                       zip(prompt, out, strict=True)]) / b
    return prefill + decode


def cascade_candidates(models: Sequence[str], stages: Mapping[str, StageRows],
                       costs: Mapping[str, TokenCost], max_running: int = 8,
                       quantiles: int = 9) -> list[GenCandidate]:
    """Single models and ``small -> large`` pairs (see the module docstring), Pareto-kept."""
    if not models:
        raise PlanningError("no model to plan with")
    work = {m: row_work_s(costs[m], stages[m], max_running) for m in models}
    found = [GenCandidate(Cascade((m,)), float(stages[m].quality.mean()),
                          float(work[m].mean())) for m in models]
    for small, large in itertools.combinations(models, 2):
        cert = stages[small].certainty
        levels = np.unique(np.quantile(cert, np.linspace(0.1, 0.9, quantiles)))
        for t in levels:
            up = cert < t
            quality = np.where(up, stages[large].quality, stages[small].quality).mean()
            cost = (work[small] + np.where(up, work[large], 0.0)).mean()
            found.append(GenCandidate(Cascade((small, large), (float(t),)), float(quality),
                                      float(cost), float(up.mean())))
    return pareto(found)


def pareto(found: Sequence[GenCandidate]) -> list[GenCandidate]:
    """Candidates no other beats on both quality (higher) and work (lower), most accurate
    first."""
    front = pareto_front([(c.quality, c.work_s) for c in found])
    # candidates equal up to rounding (qualities summed in another order) count once: the first
    unique: dict[tuple, GenCandidate] = {}
    for c in (found[i] for i in sorted(front)):
        unique.setdefault((round(c.quality, 9), round(c.work_s, 12)), c)
    return sorted(unique.values(), key=lambda c: (-c.quality, c.work_s))


def candidate_plans(function: str, candidates: Sequence[GenCandidate], max_gears: int = 3,
                    edges: Sequence[float] = DEFAULT_EDGES, max_running: int = 8,
                    kv_budget_tokens: int | None = None) -> list[GenPlan]:
    """Every plan of 1..``max_gears`` candidates (most accurate first) and increasing edges."""
    ordered = sorted(candidates, key=lambda c: (-c.quality, c.work_s))
    plans = []
    for k in range(1, max_gears + 1):
        for subset in itertools.combinations(ordered, k):
            for cut in itertools.combinations(sorted(set(edges)), k - 1):
                gears = tuple(GenGear(c.cascade, float(e)) for c, e in
                              zip(subset, (*cut, np.inf), strict=True))
                plans.append(GenPlan(function, gears, max_running, kv_budget_tokens))
    return plans


def plan_generation(function: str, candidates: Sequence[GenCandidate],
                    costs: Mapping[str, TokenCost], stages: Mapping[str, StageRows],
                    arrival_s: Sequence[float] | np.ndarray, rows: Sequence[int] | np.ndarray,
                    target_ms: float, metric: str = "tgt_p95_ms", max_gears: int = 3,
                    edges: Sequence[float] = DEFAULT_EDGES, max_running: int = 8,
                    kv_budget_tokens: int | None = None,
                    more_traces: Sequence[tuple[np.ndarray, np.ndarray]] = ()
                    ) -> tuple[GenChoice | None, list[GenChoice]]:
    """The most accurate plan whose simulated ``metric`` meets ``target_ms`` on the planning
    trace (None if none does), and every plan simulated. With ``more_traces`` (more
    ``(arrivals, rows)`` windows), a plan's ``metric`` is its worst over the windows and its
    quality the mean: a plan must meet the target in every burst pattern it was planned on."""
    if metric not in METRICS:
        raise PlanningError(f"unknown latency metric {metric!r}; use one of {METRICS}")
    if not target_ms > 0:
        raise PlanningError(f"the latency target must be > 0 ms, got {target_ms}")
    traces = [(arrival_s, rows), *more_traces]

    def score(plan: GenPlan) -> PlanMetrics:
        runs = [simulate_gen_plan(plan, costs, stages, a, r).metrics() for a, r in traces]
        worst = max(runs, key=lambda m: getattr(m, metric))
        return replace(worst, accuracy=float(np.mean([m.accuracy for m in runs])))

    tried = [GenChoice(p, score(p))
             for p in candidate_plans(function, candidates, max_gears, edges, max_running,
                                      kv_budget_tokens)]
    return most_accurate_within(tried, metric, target_ms), tried


def most_accurate_within(tried: Sequence[GenChoice], metric: str, bound_ms: float
                         ) -> GenChoice | None:
    """The most accurate plan whose ``metric`` is within ``bound_ms`` (ties: the faster, then
    the one with fewer gears); None if none is."""
    ok = [c for c in tried if getattr(c.metrics, metric) <= bound_ms]
    return max(ok, key=lambda c: (round(c.metrics.accuracy, 9), -getattr(c.metrics, metric),
                                  -len(c.plan.gears)), default=None)


def frontier(choices: Sequence[GenChoice], metric: str = "tgt_p95_ms") -> list[GenChoice]:
    """The plans no other beats on both ``metric`` (lower) and quality (higher), fastest
    first."""
    front = pareto_front([(c.metrics.accuracy, getattr(c.metrics, metric)) for c in choices])
    return [choices[i] for i in front]


#: the simulated metric each latency bound of a ``Target`` reads (``Target.latency``)
TARGET_METRICS = {"p95": "tgt_p95_ms", "tgt_p95": "tgt_p95_ms", "ttft_p95": "ttft_p95_ms"}


def choose(operator: str, tried: Sequence[GenChoice], target: Target) -> GenChoice:
    """The plan of ``tried`` (simulated choices) that ``target`` asks for: the most accurate
    within a latency bound, or the fastest (TGT p95) that reaches a quality floor; a
    ``PlanningError`` that names the closest plan when none does."""
    if not tried:
        raise PlanningError(f"no generation plan of {operator}() to choose from")
    if target.min_accuracy is not None:
        ok = [c for c in tried if c.metrics.accuracy >= target.min_accuracy]
        if not ok:
            best = max(tried, key=lambda c: c.metrics.accuracy)
            raise PlanningError(
                f"no plan of {operator}() reaches quality {target.min_accuracy:.1%}; the most "
                f"accurate simulated reaches {best.metrics.accuracy:.1%} "
                f"({best.plan.summary()})")
        return min(ok, key=lambda c: (c.metrics.tgt_p95_ms, -c.metrics.accuracy,
                                      len(c.plan.gears)))
    metric = TARGET_METRICS[target.latency or "p95"]
    best = most_accurate_within(tried, metric, target.max_latency_ms)
    if best is None:
        fastest = min(tried, key=lambda c: getattr(c.metrics, metric))
        raise PlanningError(
            f"no plan of {operator}() keeps {target.describe()}; the fastest simulated has "
            f"{getattr(fastest.metrics, metric) / 1000:.1f} s "
            f"({fastest.plan.summary()}); ask for more time or a lower rate")
    return best


def plan_generating(op: Operator, ctx: OpContext, target: Target, qps: float,
                    rows: int = 64, requests: int = 120, arrival_s: np.ndarray | None = None,
                    max_running: int = 8, seed: int = 0) -> GenChoice:
    """Plan a generating operator for online requests at a mean rate of ``qps``: its models
    answer the first ``rows`` rows of its evaluation sample (cached in ``ctx`` for the
    session), their passes are timed (cached under KEN_HOME), and the plans of
    ``plan_generation`` are simulated on up to three 20-minute windows of ``arrival_s``
    (default: the Azure code trace), each thinned to ``requests`` arrivals and stretched to a
    mean of ``qps``, each request asking for a random sample row; a plan's latency is its
    worst over the windows. Returns the plan ``target`` asks for (``choose``), its
    ``predicted`` metrics set."""
    from ken.models.llm import GenerativeModel
    from ken.optimizer.tokens import load_or_measure_token_cost
    from ken.optimizer.workload import load_azure_trace

    if not qps > 0 or rows < 2 or requests < 2:
        raise PlanningError(f"plan {op.name}() with a request rate qps > 0 (got {qps}), "
                            f"rows >= 2 and requests >= 2")
    models = dict(op.candidates(ctx, ctx.device))
    if not models or not all(isinstance(m, GenerativeModel) for m in models.values()):
        raise PlanningError(f"{op.name}() does not generate text; generation plans are for "
                            "sem_qa, sem_map and sem_extract")
    sample = op.eval_sample(ctx)
    if sample is None:
        raise PlanningError(f"{op.name}() has no evaluation sample here to plan with "
                            f"({op.eval_description()})")
    sample = sample.subset(range(min(rows, len(sample))))
    stages: dict[str, StageRows] = {}
    costs: dict[str, TokenCost] = {}
    key = sample.content_hash
    keys = {name: f"gen-answers:{name}:{key}" for name in models}
    new = [name for name in models if not ctx.has_resource(keys[name])]
    message = (f"planning {op.name}(): {len(new)} LM(s) answer {len(sample)} evaluation rows "
               "(minutes, once per session)" if new else "")
    with ctx.reporter.long_work(message) if new else contextlib.nullcontext():
        for name, model in models.items():
            def answer(m: GenerativeModel = model, name: str = name) -> StageRows:
                with ctx.reporter.task(f"{name} answers {len(sample)} rows",
                                       len(sample)) as advance:
                    return answer_sample(m, sample, max_running, advance)[0]

            stages[name] = ctx.resource(keys[name], answer)
    for name, model in models.items():  # timed once per machine (a bar while it measures)
        costs[name] = load_or_measure_token_cost(
            model.lm, Path(model.lm.source).name, home=ctx.home, reporter=ctx.reporter)
    if arrival_s is None:
        arrival_s = load_azure_trace().arrival_s
    arrival_s = np.asarray(arrival_s, dtype=np.float64)
    if arrival_s.size < requests:
        raise PlanningError(f"the trace holds {arrival_s.size} < {requests} arrivals")
    rng = np.random.default_rng(seed)
    first, end = float(arrival_s[0]), float(arrival_s[-1])
    traces = []
    for k in range(3):  # up to 3 windows of 20 minutes (different bursts), each thinned to qps
        start = first + 1200.0 * k
        duration = min(1200.0, end - start + 1e-9)
        if k and np.count_nonzero((arrival_s >= start) & (arrival_s < start + duration)
                                  ) < requests:
            break
        traces.append((trace_window(arrival_s, start, duration, requests, requests / qps,
                                    rng), rng.integers(0, len(sample), requests)))
    candidates = cascade_candidates(list(models), stages, costs, max_running)
    (arrivals, asked), *more = traces
    # a plan's latency is its worst window by the metric the target bounds
    metric = TARGET_METRICS[target.latency or "p95"]
    _, tried = plan_generation(op.name, candidates, costs, stages, arrivals, asked, math.inf,
                               metric, max_running=max_running, more_traces=more)
    best = choose(op.name, tried, target)
    return GenChoice(replace(best.plan, predicted=best.metrics), best.metrics)
