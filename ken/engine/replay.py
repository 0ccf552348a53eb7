"""Open-loop trace replay through the online engine (issue 5, part).

``replay`` submits one labelled sample row per trace arrival at the arrival's time (it does not
wait for answers: open loop), then collects every outcome. Request ``i`` uses the same sample
row as in the simulator (``sample_rows``), so a replay and a simulation of the same plan and
trace can be compared request by request; the result is a ``SimResult`` so both are summarised
by the same code (``.metrics(0, plan)``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ken.engine.hindsight import Hindsight
from ken.engine.outcome import Outcome
from ken.engine.request_path import PathLog, PathSummary, where_time_went
from ken.engine.serving import Engine
from ken.engine.supervision import BatchRecord, LoadReport
from ken.models.datasets import LabelledSample
from ken.models.quality import EvalSample
from ken.optimizer.simulator import SimResult, sample_rows
from ken.optimizer.workload import Trace
from ken.policy.plan import GearPlan
from ken.progress import QUIET, Reporter


@dataclass(frozen=True, eq=False)
class Replay:
    """Outcomes of a replay plus how late the sender was against the trace."""

    result: SimResult  # arrival/completion, answer quality, stage and gear per request
    outcomes: tuple[Outcome, ...] = field(repr=False)
    max_send_lag_s: float = 0.0  # worst delay of a submit behind its trace time
    # CPU seconds this process (the sender, the engine's scheduler and its pipes to the
    # workers) used during the replay: cores the devices' workers did not get
    host_cpu_s: float = 0.0
    #: the sample row each request asked (``sample_rows(seed)``'s, or the ``rows`` given)
    rows: np.ndarray | None = field(default=None, repr=False)

    def status_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.outcomes:
            out[o.status] = out.get(o.status, 0) + 1
        return out

    def to_json(self, plan: GearPlan, paths: PathSummary | None = None,
                seen: Hindsight | None = None) -> str:
        """The metrics, outcomes and requests; ``paths``: where their time went; ``seen``:
        the simulator fed the replay's own batch times (``hindsight``)."""
        m = self.result.metrics(0, plan)
        return json.dumps({
            "metrics": m.to_dict(), "status": self.status_counts(),
            "paths": None if paths is None else paths.to_dict(),
            "hindsight": None if seen is None else seen.to_dict(),
            "max_send_lag_s": self.max_send_lag_s, "host_cpu_s": self.host_cpu_s,
            "gear_switches": [list(s) for s in self.result.gear_switches[0]],
            "requests": [{"arrival_s": o.arrival_s, "completion_s": o.completion_s,
                          "status": o.status, "stage": o.stage, "gear": o.gear,
                          "model": o.model} for o in self.outcomes],
        })


def replay(engine: Engine, trace: Trace, sample: EvalSample | LabelledSample, seed: int = 0,
           reporter: Reporter = QUIET, rows: np.ndarray | None = None) -> Replay:
    """Send ``trace``'s arrivals through a started ``engine`` (see the module docstring);
    each answer is scored by the sample's quality metric (a failed request scores 0).
    ``rows``: the sample row of each request, instead of ``sample_rows(seed)``'s."""
    if isinstance(sample, LabelledSample):
        sample = sample.as_eval()
    texts = sample.inputs
    n = len(trace)
    if rows is None:
        rows = sample_rows(n, len(texts), seed)
    elif len(rows) != n:
        raise ValueError(f"rows gives {len(rows)} sample rows for {n} requests")
    arrivals = trace.arrival_s
    futures = []
    lag = 0.0
    cpu = time.process_time()
    start = time.monotonic()
    with reporter.task(f"replay {trace.name}", n) as advance:
        for i in range(n):
            delay = start + arrivals[i] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                lag = max(lag, -delay)
            futures.append(engine.submit(texts[rows[i]]))
            advance(1)
    outcomes = tuple(f.result() for f in futures)
    host_cpu_s = time.process_time() - cpu
    ok = np.array([o.status == "ok" for o in outcomes])
    asked = sample.subset(rows)
    quality = asked.quality([o.value if o.status == "ok" else None for o in outcomes])
    result = SimResult(
        arrival_s=np.array([o.arrival_s for o in outcomes]),
        completion_s=np.array([o.completion_s for o in outcomes]),
        quality=np.where(ok, quality, 0.0)[None, :],
        stage=np.array([o.stage if o.stage is not None else -1 for o in outcomes])[None, :],
        range_index=np.array([o.gear if o.gear is not None else -1 for o in outcomes])[None, :],
        gear_switches=(tuple(engine.gear_switches),),
        device_busy_s=(),
        batches=0,
        stage_rows=(),
    )
    return Replay(result, outcomes, lag, host_cpu_s, np.asarray(rows))


@dataclass(frozen=True, eq=False)
class Served:
    """What ``serve_trace`` measured: the replay, the model load, every model call, and
    where the requests' time went."""

    replay: Replay
    load: LoadReport
    batch_log: tuple[BatchRecord, ...]
    #: where the answered requests' time went (``request_path``; None: none answered)
    paths: PathSummary | None = None
    #: the engine's path log (``hindsight`` sets the replay against the simulator fed its
    #: own batch times)
    path_log: PathLog | None = field(default=None, repr=False)


def serve_trace(plan: GearPlan, models: Mapping[str, Any], trace: Trace,
                sample: EvalSample | LabelledSample, seed: int = 0, reporter: Reporter = QUIET,
                **engine_options: Any) -> Served:
    """Start an ``Engine(plan, models, **engine_options)``, replay ``trace`` through it and
    shut it down (also when the replay fails)."""
    with Engine(plan, models, **engine_options) as engine:
        rep = replay(engine, trace, sample, seed=seed, reporter=reporter)
    assert engine.load_report is not None
    return Served(rep, engine.load_report, tuple(engine.batch_log),
                  where_time_went(rep.outcomes, engine.path_log), engine.path_log)


def replay_rounds(plans: Sequence[GearPlan], models: Mapping[str, Any], trace: Trace,
                  sample: EvalSample | LabelledSample, rounds: int, seed: int = 0,
                  reporter: Reporter = QUIET, **engine_options: Any) -> list[list[Served]]:
    """``serve_trace`` of every plan, ``rounds`` times, interleaved (each round serves every
    plan once, in order), so that the machine's drifts reach every plan alike; per plan, its
    replays in round order. Compare plans on the median and spread of their replays."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    out: list[list[Served]] = [[] for _ in plans]
    for r in range(rounds):
        for k, plan in enumerate(plans):
            reporter.note(f"replay round {r + 1}/{rounds}, plan {k + 1}/{len(plans)}")
            out[k].append(serve_trace(plan, models, trace, sample, seed=seed,
                                      reporter=reporter, **engine_options))
    return out


def plot_replay(rep: Replay, plan: GearPlan, path: str | Path, title: str = "") -> Path:
    """Latency over time (one dot per request), measured QPS, and gear switches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = rep.result
    t = r.arrival_s - r.arrival_s.min()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    ax.scatter(t, r.latency_s * 1000, s=2, alpha=0.5)
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms)")
    for when, _a, b in r.gear_switches[0]:
        ax.axvline(when - r.arrival_s.min(), color="red", lw=0.5, alpha=0.6)
        ax.annotate(f"g{b}", (when - r.arrival_s.min(), ax.get_ylim()[1]), fontsize=6,
                    color="red")
    bins = np.arange(0, t.max() + 1.0, 1.0)
    ax2.hist(t, bins=bins, color="gray")
    ax2.set_ylabel("requests / s")
    ax2.set_xlabel("time (s)")
    m = r.metrics(0, plan)
    ax.set_title(title or f"accuracy {m.accuracy:.1%}, p50 {m.p50_ms:.0f} ms, "
                          f"p95 {m.p95_ms:.0f} ms, {m.gear_switches} gear switches", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
