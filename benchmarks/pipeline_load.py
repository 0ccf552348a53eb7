"""Deadlines through a pipeline under load: no dropping, reactive dropping and ken's proactive
dropping (PARD) in SIMULATION (issue 37, item 1).

The policies are ``ken.policy.dropping`` (``none``: never drop; ``reactive``: drop a request
only once it is already past its end-to-end deadline, FIFO queues; ``proactive``: drop it as
soon as ``now + predicted time of this and the remaining stages > deadline``, queues ordered by
remaining budget with PARD's adaptive LBF/HBF priority), run by the discrete-event simulator
(``simulate_many(deadline_s=..., dropping=...)``) on arrivals of the Azure LLM code trace
(its inter-arrival gaps in order, repeated as needed for ``--duration-s``, scaled so their
mean rate is ``load`` x what the pipeline sustains; the bursts keep their shape). Ablations (not in
``--quick``): ``proactive-fifo``, ``proactive-lbf`` and ``proactive-hbf`` drop proactively
but serve queues in arrival order, always least budget first or always most budget first
(what the adaptive priority adds); ``proactive-d0.3`` widens the adaptive priority's
narrowest band from 0.1 to 0.3.

1. **QA-like pipeline** (``qa``): the shape of the MultiModalQA/HybridQA question stream that
   ``ken/multihop_plan.py`` plans — a question-type classifier, then a text hop, a table hop or
   both, then one reading call — built from the measured V100 BERT profiles of
   ``../shared/data/ken-artifact/`` (tiny, small, medium; BERT-large as the reader, the
   expensive stage, on 4 GPUs). ``PipelinePlanner`` needs the measured QA outcomes (every
   question answered by every LM assignment: tens of minutes of CPU LMs), which are not
   available offline, so this pipeline's stages and placement are fixed by hand and answer
   quality (F1) is not reported.
   ``qa-cascade``: the same pipeline with a cascaded reader (BERT-base on two GPUs answers the
   rows it is sure of, the 40% it is least sure of go on to BERT-large on two more), to
   compare ``proactive`` (the forecast follows the cascade: a batch at BERT-large is charged
   BERT-large, the reader's time includes the measured share of escalations) with
   ``proactive-first-model`` (every reader batch charged BERT-base, the forecast before
   session 28).
2. **64-GPU cluster** (``cluster``): a four-stage pipeline of the V100 profiles (BERT-tiny ->
   BERT-base -> BERT-large -> BERT-small, every request through all four) on 64 V100s, the
   GPUs split so that the stages' profiled capacities are as even as whole GPUs allow — the
   scale of PARD's evaluation.

3. **Joint allocation** (``allocation``, issue 37 item 2): a three-task pipeline (detect:
   BERT tiny/mini/small; classify: small/medium/base/large; tag: tiny/small/medium; every
   request through detect and classify, 60% also through tag) on ``--gpus`` V100s with a
   ``--alloc-slo-ms`` SLO. Three allocations, each re-solved for the demand of each point and
   served by the simulator (``ken.optimizer.allocation.serve_allocation``: hosted variants as
   one-gear plans, paths as routes) on Poisson arrivals: ``joint (Loki)`` (``allocate``: the
   pipeline's MILP), ``per-operator`` (pipeline-agnostic, Proteus-style: the GPUs split by what
   each task's most accurate variant needs, each task maximising its own accuracy within a
   third of the SLO, variants taken independently per task; ``per-operator, proportional SLO``
   splits the SLO by each task's most accurate variant's time per row) and ``most accurate only``
   (serve what the most accurate variants can, turn the rest away). 1x is the most demand the
   most accurate variants serve within the SLO on all GPUs. A path's accuracy is the product of
   its variants' single accuracies (the artifact catalog's, ``ARTIFACT_ACCURACY``; independent
   tasks): quality per request counts late and turned-away requests as 0.

5. **Re-solved online** (``online``, issue 37 item 2): the allocation case's pipeline and GPUs
   on a step in demand (``--online-phase-s`` seconds at 1x, then 3x, then 1x again; Poisson),
   served by the simulator through ``ken.optimizer.reallocation``: an allocation fixed for the
   planned demand (1x), one fixed for the peak (3x), Loki's controller (re-solved every
   ``--online-every-s`` seconds for 1.1x an EWMA, weight 0.5, of the demand measured so far;
   at a change the requests inside the pipeline take a path of the new allocation from where
   they are), the same controller closed over the backlog (``online + backlog``: at each
   period's start, inside the simulation, it reads the requests queued or in service in the
   pipeline and solves for 1.1 x (the EWMA + that backlog / ``--online-drain-s``, default one
   period); ``simulate_closed_loop``), the same read ``ONLINE_CHECKS`` (4) times a period, which
   re-solves at once inside a period when the backlog asks for a quarter more demand (``online
   + backlog, read every ...``), and an oracle that solves each period for its own
   measured demand in advance. Per system: quality per request (late and turned away = 0), the
   share on time, and both per period; the MILPs' count and time; for the closed loop the
   backlog it read at each period's start. The online engine serves the same allocations and
   controllers in ``benchmarks/allocation_engine.py`` (a CPU pipeline, beside its simulation).

"What the pipeline sustains" (1x) is the highest rate (bisection up to its profiled capacity:
the smallest over stages of the stage's rows per second at full batches on all its replicas,
divided by the share of requests that visit it) at which serving every request, no dropping,
answers 95% of them within the deadline on these arrivals. The trace is very bursty (its
busiest second holds 26x its mean rate), so on the QA pipeline's short window this is far below
the profiled capacity; the cluster's longer window sustains its capacity.

Per point: goodput (answers within the deadline per second of the trace), drop
rate, late rate (answered after the deadline), wasted model seconds (device seconds spent on
requests dropped later or answered late) and where the drops happened.

4. **Measured on the engine** (``engine``): the same policies on the online engine
   (``Engine(..., dropping=...)``: the same ``PipelineDropper`` on the wall clock, its stage
   gates on the operators' dispatchers) serving a two-operator pipeline of the packaged
   sentiment models on this CPU, one worker process per device: ``detect`` (MiniLM-L3 on
   ``cpu0``) then ``classify`` (MiniLM-L6 on ``cpu1``), every request through both, each hop
   submitted when the previous one answered, with the request's end-to-end deadline
   (``--engine-deadline-ms``) and the rest of its route. The texts are the family's held-out
   tweets; arrivals the Azure trace's gaps as above, ``--engine-duration-s`` per point, at
   1x..3x what the pipeline sustains *in simulation* (the bisection above, on the profiles);
   one engine per policy serves the loads in turn. Per point the engine's
   ``deadline_metrics()`` (goodput, drop rate, late rate, wasted model seconds: the measured
   wall time of each batch, shared by its rows) beside the simulator's prediction for the same
   plans, trace and rows. Admission is ``max_in_flight`` (no latency-target rejections), so
   the policies alone decide what is dropped. The policies: ``none``, ``reactive``,
   ``proactive`` (its forecast scaled by the measured speed of each stage's recent batches)
   and ``proactive-profiled`` (the same on the calibrated profiles alone).
   ``--engine-busy-cores N`` keeps N busy loops running from after the calibration to the
   end: a machine busier than when its runtimes were measured.

Writes ``--out``/pipeline_load.json and pipeline_load.png.

    python benchmarks/pipeline_load.py --out benchmarks/results/pipeline_load
    python benchmarks/pipeline_load.py --quick   # under a minute: fewer requests
    python benchmarks/pipeline_load.py --cases engine --out benchmarks/results/pipeline_engine
        # about 3.5 minutes: the packaged models served on 2 worker processes
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "pipeline_load"
POLICIES = ("none", "reactive", "proactive", "proactive-profiled", "proactive-first-model",
            "proactive-fifo", "proactive-lbf", "proactive-hbf", "proactive-d0.3")
#: the policies the engine case serves (``DropPolicy.named``)
ENGINE_POLICIES = ("none", "reactive", "proactive", "proactive-profiled")
LOADS = (1.0, 1.5, 2.0, 3.0)
#: the online case's closed loop read the backlog this many times a period (one variant)
ONLINE_CHECKS = 4


def stage_plan(name: str, model: str, devices: list[str], max_batch: int, max_wait_s: float):  # noqa: ANN201
    from ken.models.cascade import Cascade
    from ken.policy.plan import GearPlan, RangeSchedule, Replica

    n = len(devices)
    model = f"bert-{model}"
    return GearPlan(name, (0.0, 1e9), (Cascade((model,)),),
                    tuple(Replica(model, (d,)) for d in devices),
                    (RangeSchedule(0, (1.0 / n,) * n, (1,) * n),), (max_batch,) * n,
                    max_wait_s=max_wait_s)


def capacity_qps(catalog, plans, visits: list[float]) -> tuple[float, list[float]]:  # noqa: ANN001
    """The pipeline's profiled capacity and each stage's (rows/s at full batches; for a
    cascade, the least over its models of their rows/s over the share of rows reaching
    them, on the catalog's rows)."""
    per_stage = []
    for p in plans:
        cascade = p.cascade_of(0)
        reach = catalog.stage_fractions(cascade)
        rates = []
        for m, share in zip(cascade.models, reach, strict=True):
            reps = p.replicas_of(m)
            r = p.placement[reps[0]]
            table = catalog.perf_on(r.model, r.devices).runtime_table(1, p.max_batch[reps[0]])
            rates.append(len(reps) * p.max_batch[reps[0]] / table[-1] / max(share, 1e-9))
        per_stage.append(min(rates))
    return min(c / v for c, v in zip(per_stage, visits, strict=True) if v > 0), per_stage


def qa_pipeline(catalog):  # noqa: ANN001, ANN201
    """question type -> text hop and/or table hop -> reader; routes by question kind."""
    plans = [stage_plan("question_type", "tiny", ["gpu0"], 32, 0.002),
             stage_plan("text_hop", "small", ["gpu0"], 32, 0.002),
             stage_plan("table_hop", "medium", ["gpu0"], 32, 0.002),
             stage_plan("reader", "large", [f"gpu{i}" for i in range(1, 5)], 8, 0.002)]
    kinds = {(0, 1, 3): 0.4, (0, 2, 3): 0.3, (0, 1, 2, 3): 0.3}  # text, table, both
    return plans, kinds


def qa_cascade_pipeline(catalog, escalated: float = 0.4):  # noqa: ANN001, ANN201
    """The QA-like pipeline with a cascaded reader: BERT-base on gpu1-2 answers the rows it is
    sure of, the ``escalated`` share it is least sure of (on the catalog's rows) goes on to
    BERT-large on gpu3-4."""
    from ken.models.cascade import Cascade
    from ken.policy.plan import GearPlan, RangeSchedule, Replica

    plans, kinds = qa_pipeline(catalog)
    base, large = "bert-base", "bert-large"
    threshold = float(np.quantile(catalog.certainty(base), escalated))
    cascade = Cascade((base, large), (threshold,))
    placement = (Replica(base, ("gpu1",)), Replica(base, ("gpu2",)),
                 Replica(large, ("gpu3",)), Replica(large, ("gpu4",)))
    plans[-1] = GearPlan("reader", (0.0, 1e9), (cascade,), placement,
                         (RangeSchedule(0, (0.5, 0.5, 0.5, 0.5), (1, 1, 1, 1)),),
                         (8, 8, 8, 8), max_wait_s=0.002)
    return plans, kinds


def cluster_pipeline(catalog, gpus: int = 64):  # noqa: ANN001, ANN201
    """tiny -> base -> large -> small on ``gpus`` V100s, split by profiled per-GPU rates."""
    stages = [("detect", "tiny", 32), ("classify", "base", 16), ("rerank", "large", 8),
              ("tag", "small", 32)]
    rate = []
    for _, model, b in stages:
        table = catalog.perf_on(f"bert-{model}", ("gpu0",)).runtime_table(1, b)
        rate.append(b / table[-1])
    need = np.array([1.0 / r for r in rate])
    count = np.maximum(1, np.floor(gpus * need / need.sum())).astype(int)
    while count.sum() < gpus:  # hand the rest to the stage with the lowest capacity
        count[int(np.argmin(count * np.array(rate)))] += 1
    plans, first = [], 0
    for (name, model, b), c in zip(stages, count.tolist(), strict=True):
        plans.append(stage_plan(name, model, [f"gpu{first + i}" for i in range(c)], b, 0.002))
        first += c
    return plans, {(0, 1, 2, 3): 1.0}


def arrivals(gaps: np.ndarray, duration_s: float, qps: float):  # noqa: ANN201
    """``duration_s`` of arrivals at mean rate ``qps`` with the Azure trace's gaps (in its
    order, repeated as needed), scaled."""
    from ken.optimizer.workload import Trace

    n = max(2, int(round(duration_s * qps)))
    g = np.resize(gaps, n - 1)
    a = np.concatenate([[0.0], np.cumsum(g)])
    return Trace(a * ((n - 1) / qps / a[-1]), f"azure-code x{qps:.0f}qps")


def on_time_share(catalog, plans, routes, gaps, duration_s, qps, deadline_s, seed) -> float:  # noqa: ANN001
    from ken.optimizer.simulator import sample_rows, simulate_many
    from ken.policy.dropping import DropPolicy

    trace = arrivals(gaps, duration_s, qps)
    rows = sample_rows(len(trace), catalog.num_rows, seed)
    res = simulate_many(plans, [catalog] * len(plans), trace, seed, routes=routes, rows=rows,
                        deadline_s=deadline_s, dropping=DropPolicy.named("none"))
    m = res.deadline_metrics()
    return m.on_time / m.requests


def sustained_qps(catalog, plans, routes, gaps, duration_s, cap, deadline_s, seed,  # noqa: ANN001
                  share: float = 0.95, steps: int = 8) -> float:
    """The highest rate (bisection between 0 and the profiled capacity) at which serving
    every request (no dropping) answers ``share`` of them within the deadline."""
    lo, hi = 0.0, cap
    if on_time_share(catalog, plans, routes, gaps, duration_s, hi, deadline_s, seed) >= share:
        return hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        ok = on_time_share(catalog, plans, routes, gaps, duration_s, mid, deadline_s, seed)
        lo, hi = (mid, hi) if ok >= share else (lo, mid)
    return lo


def metric_fields(m) -> dict:  # noqa: ANN001
    """A point's figures from ``DeadlineMetrics`` (simulated or measured)."""
    return {"goodput_qps": m.goodput_qps, "on_time": m.on_time, "drop_rate": m.drop_rate,
            "late_rate": m.late_rate, "wasted_model_s": m.wasted_device_s,
            "model_s": m.device_s, "wasted_share": m.wasted_share,
            "drops_by_stage": dict(m.drops_by_stage)}


def run_case(name: str, catalog, plans, kinds: dict, gaps: np.ndarray, duration_s: float,  # noqa: ANN001
             deadline_s: float, loads: list[float], policies: list[str], seed: int) -> dict:
    from ken.optimizer.simulator import sample_rows, simulate_many
    from ken.policy.dropping import DropPolicy

    rng = np.random.default_rng(seed)
    route_list = list(kinds)
    num_rows = catalog.num_rows
    routes = [route_list[i] for i in rng.choice(len(route_list), num_rows,
                                                p=list(kinds.values()))]
    visits = [sum(p for r, p in kinds.items() if k in r) for k in range(len(plans))]
    cap, per_stage = capacity_qps(catalog, plans, visits)
    sustained = sustained_qps(catalog, plans, routes, gaps, duration_s, cap, deadline_s, seed)
    out = {"pipeline": name, "stages": [
        {"name": p.operator, "model": " -> ".join(p.cascade_of(0).models),
         "replicas": len(p.placement),
         "max_batch": p.max_batch[0], "capacity_qps": c, "visit_share": v}
        for p, c, v in zip(plans, per_stage, visits, strict=True)],
        "routes": {"-".join(plans[k].operator for k in r): s for r, s in kinds.items()},
        "capacity_qps": cap, "sustained_qps": sustained, "deadline_s": deadline_s,
        "duration_s": duration_s, "points": []}
    policy_of = {"none": DropPolicy.named("none"), "reactive": DropPolicy.named("reactive"),
                 "proactive": DropPolicy.named("proactive"),
                 "proactive-profiled": DropPolicy.named("proactive-profiled"),
                 "proactive-first-model": DropPolicy.named("proactive-first-model"),
                 "proactive-fifo": DropPolicy("proactive", "fcfs"),
                 "proactive-lbf": DropPolicy("proactive", "lbf"),
                 "proactive-hbf": DropPolicy("proactive", "hbf"),
                 "proactive-d0.3": DropPolicy("proactive", "adaptive", delta_min=0.3)}
    for load in loads:
        trace = arrivals(gaps, duration_s, load * sustained)
        rows = sample_rows(len(trace), num_rows, seed)
        for pol in policies:
            t0 = time.perf_counter()
            res = simulate_many(plans, [catalog] * len(plans), trace, seed, routes=routes,
                                rows=rows, deadline_s=deadline_s, dropping=policy_of[pol])
            m = res.deadline_metrics()
            answered = ~np.isnan(res.completion_s)
            lat = res.latency_s[answered] * 1000.0
            point = {"load": load, "policy": pol, "requests": len(trace),
                     "offered_qps": len(trace) / trace.duration_s, **metric_fields(m),
                     "p95_answered_ms": float(np.percentile(lat, 95)) if lat.size else None,
                     "sim_s": time.perf_counter() - t0}
            out["points"].append(point)
            print(f"{name} {load:>3}x {pol:>14}: goodput {m.goodput_qps:8.1f}/s "
                  f"drop {m.drop_rate:6.1%} late {m.late_rate:6.1%} wasted "
                  f"{m.wasted_device_s:8.2f} of {m.device_s:8.2f} model s  "
                  f"({point['sim_s']:.1f} s)", flush=True)
    return out


#: the allocation case: each task's variants (BERT sizes of the V100 artifact)
ALLOC_TASKS = (("detect", ("tiny", "mini", "small")),
               ("classify", ("small", "medium", "base", "large")),
               ("tag", ("tiny", "small", "medium")))
#: its route classes: every request through detect and classify, 60% also through tag
ALLOC_ROUTES = {(0, 1, 2): 0.6, (0, 1): 0.4}
ALLOC_BATCHES = (1, 4, 8, 16, 32)
ALLOC_LOADS = (0.5, 1.0, 1.5, 2.0, 3.0)


def allocation_problem(catalog, demand: float, gpus: int, slo_s: float,  # noqa: ANN001, ANN201
                       only_best: bool = False):
    """The allocation case as a ``ken.optimizer.allocation`` problem: variants' per-GPU
    throughput from the V100 profiles, single accuracies the artifact catalog's
    (``ARTIFACT_ACCURACY``), a path's accuracy the product of its variants' (independent
    tasks, Loki's assumption)."""
    from ken.optimizer.allocation import AllocationProblem, Variant
    from ken.optimizer.artifact import ARTIFACT_ACCURACY

    variants = []
    for _, models in ALLOC_TASKS:
        vs = []
        for m in models:
            table = catalog.perf_on(f"bert-{m}", ("gpu0",)).runtime_table(1, max(ALLOC_BATCHES))
            vs.append(Variant(f"bert-{m}", ARTIFACT_ACCURACY[m],
                              {b: b / table[b] for b in ALLOC_BATCHES}))
        if only_best:
            vs = [max(vs, key=lambda v: v.accuracy)]
        variants.append(tuple(vs))
    routes = tuple(ALLOC_ROUTES)
    accuracy = {}
    for r, route in enumerate(routes):
        for combo in itertools.product(*(variants[k] for k in route)):
            accuracy[(r, tuple(v.name for v in combo))] = float(
                np.prod([v.accuracy for v in combo]))
    return AllocationProblem(tuple(t for t, _ in ALLOC_TASKS), tuple(variants), routes,
                             tuple(ALLOC_ROUTES.values()), accuracy, demand, gpus, slo_s)


def per_operator_allocation(catalog, demand: float, gpus: int, slo_s: float,  # noqa: ANN001, ANN201
                            budget: str = "even"):
    """Pipeline-agnostic accuracy scaling (Proteus-style): the GPUs split among the tasks in
    proportion to what their most accurate variants need, then each task alone maximises its
    own accuracy for the demand that reaches it within its share of the SLO (``budget``:
    ``"even"``, a third each; ``"proportional"``, in proportion to the most accurate variant's
    time for one row, the better-informed split); requests take each task's variants
    independently."""
    from ken.optimizer.allocation import Allocation, AllocationProblem, allocate

    whole = allocation_problem(catalog, demand, gpus, slo_s)
    visits = [sum(s for r, s in zip(whole.routes, whole.shares, strict=True) if k in r)
              for k in range(len(whole.operators))]
    best = [max(vs, key=lambda v: v.accuracy) for vs in whole.variants]
    need = np.array([v * demand / max(b.qps.values()) for v, b in zip(visits, best,
                                                                       strict=True)])
    count = np.maximum(1, np.floor(gpus * need / need.sum())).astype(int)
    while count.sum() > gpus:
        count[int(np.argmax(count))] -= 1
    while count.sum() < gpus:
        count[int(np.argmax(need / count))] += 1
    hosts, task_share = {}, []
    if budget == "even":
        weights = np.ones(len(best))
    else:
        weights = np.array([v.batch_latency_s(min(v.qps)) for v in best])
    for k, vs in enumerate(whole.variants):
        per_task_slo = slo_s * weights[k] / weights.sum()  # its share of the end-to-end SLO
        alone = AllocationProblem((whole.operators[k],), (vs,), ((0,),), (1.0,),
                                  {(0, (v.name,)): v.accuracy for v in vs},
                                  demand * visits[k], int(count[k]), per_task_slo)
        got = allocate(alone)
        for (_, name), hb in got.hosts.items():
            hosts[(k, name)] = hb
        task_share.append({names[0]: share for (_, names), share in got.shares.items()})
    shares = {}
    for r, (route, share) in enumerate(zip(whole.routes, whole.shares, strict=True)):
        for combo in itertools.product(*(task_share[k].items() for k in route)):
            frac = share * float(np.prod([f for _, f in combo]))
            if frac > 1e-12:
                shares[(r, tuple(n for n, _ in combo))] = frac
    quality = sum(f * whole.accuracy[p] for p, f in shares.items())
    return whole, Allocation(hosts, shares, float(quality), float(sum(shares.values())),
                             "per-operator")


def run_allocation_case(catalog, gpus: int, slo_s: float, duration_s: float,  # noqa: ANN001
                        loads: list[float], seed: int) -> dict:
    """Joint (Loki) against per-operator and most-accurate-only allocations, each served by
    the simulator (``serve_allocation``: its hosted variants as one-gear plans, its paths as
    routes) on Poisson arrivals at each demand; 1x = the most demand the most accurate
    variants serve within the SLO on all GPUs (bisection on Loki's step 1)."""
    from ken.optimizer.allocation import allocate, serve_allocation
    from ken.optimizer.simulator import simulate_many
    from ken.optimizer.workload import poisson_trace

    base = one_x_demand(catalog, gpus, slo_s)
    devices = [f"gpu{i}" for i in range(gpus)]
    out = {"pipeline": f"allocation-{gpus}gpu", "tasks": [
        {"task": t, "variants": list(m)} for t, m in ALLOC_TASKS],
        "routes": {"-".join(ALLOC_TASKS[k][0] for k in r): s for r, s in
                   ALLOC_ROUTES.items()},
        "slo_s": slo_s, "one_x_qps": base, "duration_s": duration_s, "points": []}
    for load in loads:
        demand = load * base
        rng = np.random.default_rng(seed)
        trace = poisson_trace(demand, duration_s, seed)
        systems = {}
        t0 = time.perf_counter()
        joint_problem = allocation_problem(catalog, demand, gpus, slo_s)
        systems["joint (Loki)"] = (joint_problem, allocate(joint_problem))
        best_problem = allocation_problem(catalog, demand, gpus, slo_s, only_best=True)
        systems["most accurate only"] = (best_problem, allocate(best_problem))
        systems["per-operator"] = per_operator_allocation(catalog, demand, gpus, slo_s)
        systems["per-operator, proportional SLO"] = per_operator_allocation(
            catalog, demand, gpus, slo_s, budget="proportional")
        solve_s = time.perf_counter() - t0
        for name, (problem, alloc) in systems.items():
            served = serve_allocation(problem, alloc, devices)
            picks = served.draw(problem, alloc, len(trace), rng)
            kept = picks >= 0
            point = {"load": load, "demand_qps": demand, "system": name, "step": alloc.step,
                     "workers": alloc.workers_used, "predicted_quality": alloc.quality,
                     "predicted_served": alloc.served, "solve_s": solve_s,
                     "hosts": {f"{problem.operators[k]}:{n}": list(hb)
                               for (k, n), hb in sorted(alloc.hosts.items())}}
            quality = np.zeros(len(trace))
            on_time = np.zeros(len(trace), dtype=bool)
            if kept.any():
                from ken.optimizer.workload import Trace

                sub = Trace(trace.arrival_s[kept], trace.name)
                res = simulate_many(served.plans, [catalog] * len(served.plans), sub, seed,
                                    routes=served.routes, rows=picks[kept].tolist())
                lat = res.latency_s
                ok = lat <= slo_s
                idx = np.flatnonzero(kept)
                on_time[idx] = ok
                acc = np.array([problem.accuracy[served.paths[j]] for j in picks[kept]])
                quality[idx] = np.where(ok, acc, 0.0)
                point["p95_ms"] = float(np.percentile(lat, 95) * 1000.0)
            point["goodput_qps"] = float(on_time.sum() / duration_s)
            point["on_time"] = float(on_time.mean())
            point["quality"] = float(quality.mean())  # late and turned away count 0
            out["points"].append(point)
            print(f"allocation {load:>3}x ({demand:7.0f} q/s) {name:>30}: predicted quality "
                  f"{alloc.quality:.3f} ({alloc.served:.0%} served, {alloc.workers_used} "
                  f"GPUs), simulated {point['quality']:.3f} with {point['on_time']:.1%} on "
                  f"time, p95 {point.get('p95_ms', float('nan')):.0f} ms", flush=True)
    return out


ONLINE_LOADS = (1.0, 3.0, 1.0)  # the online case's demand in each phase


def run_online_case(catalog, gpus: int, slo_s: float, phase_s: float, every_s: float,  # noqa: ANN001
                    seed: int, drops: tuple[str, ...] = ("none", "proactive"),
                    drain_s: float | None = None) -> dict:
    """Allocations fixed for 1x and for the peak, re-solved online (EWMA; open loop and
    closed over the backlog) and by an oracle, served by the simulator on a step in demand
    (``ken.optimizer.reallocation``)."""
    from ken.optimizer.reallocation import (
        ClosedLoop,
        Resolving,
        Solver,
        fixed_schedule,
        measured_rates,
        online_schedule,
        periods_of,
        schedule_for,
        serve_schedule,
        simulate_closed_loop,
        simulate_schedule,
    )
    from ken.optimizer.workload import Trace, poisson_trace
    from ken.policy.dropping import DropPolicy

    base = one_x_demand(catalog, gpus, slo_s)
    parts = [poisson_trace(load * base, phase_s, seed + k).arrival_s + k * phase_s
             for k, load in enumerate(ONLINE_LOADS)]
    trace = Trace(np.concatenate(parts), "step")
    duration = phase_s * len(ONLINE_LOADS)
    devices = [f"gpu{i}" for i in range(gpus)]
    resolving = Resolving(every_s=every_s)
    periods = periods_of(trace.arrival_s, duration, every_s)

    def problem_for(demand: float):  # noqa: ANN202
        return allocation_problem(catalog, demand, gpus, slo_s)

    started = time.perf_counter()
    systems = {
        "fixed for 1x": fixed_schedule(problem_for(base), periods, every_s),
        f"fixed for {max(ONLINE_LOADS):g}x": fixed_schedule(
            problem_for(max(ONLINE_LOADS) * base), periods, every_s),
        f"online (EWMA, every {every_s:g} s)": online_schedule(problem_for, trace, duration,
                                                               base, resolving),
        "oracle (each period's own demand)": schedule_for(
            problem_for, measured_rates(trace.arrival_s, periods, every_s), every_s),
    }
    solve_s = time.perf_counter() - started
    # decided inside each run, so one schedule per dropping policy; one cache of solves
    control, solver = ClosedLoop(resolving, drain_s), Solver(problem_for)
    systems[f"online + backlog (drain {control.drain:g} s)"] = control
    urgent = ClosedLoop(resolving, drain_s, checks=ONLINE_CHECKS)
    systems[f"online + backlog, read every {urgent.check_s:g} s"] = urgent
    out = {"pipeline": f"online-{gpus}gpu", "slo_s": slo_s, "one_x_qps": base,
           "phase_s": phase_s, "loads": list(ONLINE_LOADS), "every_s": every_s,
           "alpha": resolving.alpha, "headroom": resolving.headroom,
           "drain_s": control.drain, "requests": len(trace), "solve_s": solve_s,
           "checks": ONLINE_CHECKS,
           "milps": sum(len(s.allocations) for s in systems.values()
                        if not isinstance(s, ClosedLoop)),
           "systems": []}
    for (name, schedule), drop in itertools.product(systems.items(), drops):
        t0 = time.perf_counter()
        policy = None if drop == "none" else DropPolicy.named(drop)
        extra = {}
        if isinstance(schedule, ClosedLoop):
            got = simulate_closed_loop(schedule, solver, base, devices, catalog, trace,
                                       duration, slo_s, seed, policy)
            schedule, run = got.schedule, got.run
            extra = {"backlog": list(got.backlog), "restarts": got.restarts}
        else:
            served = serve_schedule(schedule, devices)
            run = simulate_schedule(schedule, served, catalog, trace, slo_s, seed, policy)
        phases = []
        for k in range(len(ONLINE_LOADS)):
            mine = (trace.arrival_s >= k * phase_s) & (trace.arrival_s < (k + 1) * phase_s)
            phases.append({"load": ONLINE_LOADS[k], "quality": float(run.quality[mine].mean()),
                           "on_time": float(run.on_time[mine].mean())})
        row = {"system": name, "dropping": drop, "quality": float(run.quality.mean()),
               "on_time": float(run.on_time.mean()),
               "turned_away": float((run.path < 0).mean()), "moved": int(run.moved.sum()),
               "allocations": len(set(schedule.which)), "changes": schedule.changes,
               "demands": list(schedule.demands), "phases": phases,
               "per_period": run.per_period(schedule.periods),
               "period_s": schedule.period_s,
               "predicted_quality": [schedule.allocations[a].quality for a in schedule.which],
               **extra, "sim_s": time.perf_counter() - t0}
        out["systems"].append(row)
        by_phase = ", ".join(f"{p['quality']:.3f}" for p in phases)
        print(f"online {name:>36}, dropping {drop:>9}: quality {row['quality']:.3f}, "
              f"{row['on_time']:.1%} on time ({by_phase} by phase), "
              f"{row['allocations']} allocations, {row['changes']} changes, {row['moved']} "
              f"requests moved" + (f", backlog up to {max(extra['backlog'])}, "
                                   f"{extra['restarts']} restarts" if extra else ""),
              flush=True)
    out["closed_loop_milps"], out["closed_loop_solve_s"] = len(solver.solved), solver.seconds
    return out


def one_x_demand(catalog, gpus: int, slo_s: float) -> float:  # noqa: ANN001
    """1x: the most demand the most accurate variants serve within the SLO on all GPUs
    (bisection on Loki's step 1)."""
    from ken.optimizer.allocation import allocate

    lo, hi = 1.0, 1e6
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        ok = allocate(allocation_problem(catalog, mid, gpus, slo_s)).step == "hardware"
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo


ENGINE_STAGES = (("detect", "minilm-l3", "cpu0"), ("classify", "minilm-l6", "cpu1"))


def engine_plans(catalog, max_batch: int):  # noqa: ANN001, ANN201
    """One single-model plan per stage, with the profiled runtimes the engine's dropper
    reads (``ken.engine.deadlines.stage_profile``) and the simulator charges."""
    from ken.models.cascade import Cascade
    from ken.policy.plan import GearPlan, RangeSchedule, Replica

    plans = []
    for op, model, device in ENGINE_STAGES:
        table = catalog.perf_on(model, device).runtime_table(1, max_batch)
        plans.append(GearPlan(op, (0.0, 1e9), (Cascade((model,)),), (Replica(model, (device,)),),
                              (RangeSchedule(0, (1.0,), (1,)),), (max_batch,),
                              max_wait_s=0.002, batch_runtime_s=(tuple(table[1:]),)))
    return plans


def serve_pipeline(engine, texts: list[str], arrival_s: np.ndarray, budget_s: float,  # noqa: ANN001
                   ops: list[str], tag: str) -> float:
    """Offer the requests at their arrival times (engine clock from now), each hop submitted
    when the previous one answered, with its end-to-end deadline and the rest of its route;
    returns once every request has its last outcome. Returns the start (engine clock)."""
    import queue
    import threading

    left = [len(texts)]
    cond = threading.Condition()
    forward: queue.Queue = queue.Queue()

    def finished() -> None:
        with cond:
            left[0] -= 1
            cond.notify_all()

    def on_outcome(i: int, hop: int, deadline: float):  # noqa: ANN202
        def done(fut) -> None:  # noqa: ANN001
            if fut.result().status == "ok" and hop + 1 < len(ops):
                forward.put((i, hop + 1, deadline))
            else:
                finished()
        return done

    def submit(i: int, hop: int, deadline: float) -> None:
        fut = engine.submit(texts[i], ops[hop], deadline_s=deadline, route=ops[hop + 1:],
                            job=(tag, i))
        fut.add_done_callback(on_outcome(i, hop, deadline))

    def forwarder() -> None:  # later hops, off the scheduler thread
        while (item := forward.get()) is not None:
            submit(*item)

    thread = threading.Thread(target=forwarder, daemon=True)
    thread.start()
    t0 = engine.clock.now() + 0.05
    for i, a in enumerate(arrival_s.tolist()):
        wait = t0 + a - engine.clock.now()
        if wait > 0:
            time.sleep(wait)
        submit(i, 0, t0 + a + budget_s)
    with cond:
        cond.wait_for(lambda: left[0] == 0, timeout=120)
    forward.put(None)
    thread.join(5)
    return t0


def _spin() -> None:  # a busy loop (``--engine-busy-cores``)
    while True:
        pass


def run_engine_case(gaps: np.ndarray, duration_s: float, deadline_s: float,  # noqa: ANN001
                    loads: list[float], policies: list[str], max_batch: int, seed: int,
                    calibrate: bool = True, busy_cores: int = 0) -> dict:
    """The measured part (see the module docstring, item 4); ``busy_cores`` busy loops run
    from after the calibration to the end."""
    import multiprocessing as mp

    spinners = [mp.get_context("spawn").Process(target=_spin, daemon=True)
                for _ in range(busy_cores)]
    try:
        return _engine_case(gaps, duration_s, deadline_s, loads, policies, max_batch, seed,
                            calibrate, spinners)
    finally:
        for p in spinners:
            if p.is_alive():
                p.kill()
                p.join(5)


def _engine_case(gaps: np.ndarray, duration_s: float, deadline_s: float,  # noqa: ANN001
                 loads: list[float], policies: list[str], max_batch: int, seed: int,
                 calibrate: bool, spinners: list) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from e2e import family_setup

    from ken.engine.serving import Engine
    from ken.models import family
    from ken.models.model import DeviceConfig
    from ken.optimizer.perf import Catalog
    from ken.optimizer.simulator import sample_rows, simulate_many
    from ken.policy.dropping import DropPolicy
    from ken.progress import Reporter

    sample, models, loaders, profiles = family_setup(
        family.FamilyData("mixed", 6000, 1500), DeviceConfig(threads=1), "process",
        Reporter(quiet=True))
    del models
    catalog = Catalog.from_profiles(profiles)
    calibration = None
    if calibrate:  # what ``ken plan`` does by default: profiles fitted to serving calls
        from ken.engine.calibrate import measure_calibration
        from ken.optimizer.workload import Hardware

        used = {m: loaders[m] for _, m, _ in ENGINE_STAGES}
        calibration = measure_calibration(catalog, used, sample,
                                          Hardware.cpu_workers(2, 4 * 10**9), seconds=8.0,
                                          workers="process")
        catalog = calibration.apply(catalog)
        print(f"engine: calibrated runtimes, {calibration.describe()}", flush=True)
    for p in spinners:  # a machine busier than the calibration saw
        p.start()
    if spinners:
        print(f"engine: {len(spinners)} busy loop(s) running from now on", flush=True)
    plans = engine_plans(catalog, max_batch)
    routes = [(0, 1)] * catalog.num_rows
    cap, per_stage = capacity_qps(catalog, plans, [1.0, 1.0])
    sustained = sustained_qps(catalog, plans, routes, gaps, duration_s, cap, deadline_s, seed)
    ops = [p.operator for p in plans]
    out = {"pipeline": "engine-cpu", "stages": [
        {"name": op, "model": m, "device": d, "max_batch": max_batch, "capacity_qps": c}
        for (op, m, d), c in zip(ENGINE_STAGES, per_stage, strict=True)],
        "capacity_qps": cap, "sustained_qps": sustained, "deadline_s": deadline_s,
        "duration_s": duration_s, "workers": "process (1 torch thread each)",
        "busy_cores": len(spinners),
        "calibration": None if calibration is None else calibration.describe(),
        "points": []}
    traces = {load: arrivals(gaps, duration_s, load * sustained) for load in loads}
    for pol in policies:
        policy = DropPolicy.named(pol)
        engine = Engine(plans, loaders, workers="process", threads_per_device=1,
                        admission="max_in_flight", drain_on_sigterm=False, dropping=policy)
        engine.start()
        try:
            for text in sample.texts[:20]:  # warm the workers (no deadline: not counted)
                for op in ops:
                    engine.submit(text, op).result(timeout=30)
            for load in loads:
                trace = traces[load]
                rows = sample_rows(len(trace), catalog.num_rows, seed)
                texts = [sample.texts[r] for r in rows]
                t_wall = time.perf_counter()
                t0 = serve_pipeline(engine, texts, trace.arrival_s, deadline_s, ops,
                                    f"{pol}-{load}")
                m = engine.deadline_metrics(since_s=t0 - 1e-6)
                wall = time.perf_counter() - t_wall
                sim = simulate_many(plans, [catalog] * len(plans), trace, seed,
                                    routes=routes, rows=rows.tolist(), deadline_s=deadline_s,
                                    dropping=policy).deadline_metrics()
                point = {"load": load, "policy": pol, "requests": len(trace),
                         "offered_qps": len(trace) / trace.duration_s, **metric_fields(m),
                         "ended": m.requests, "wall_s": wall,
                         "loadavg_1min": os.getloadavg()[0],  # the machine is shared
                         "simulated": {"goodput_qps": sim.goodput_qps,
                                       "drop_rate": sim.drop_rate, "late_rate": sim.late_rate,
                                       "wasted_model_s": sim.wasted_device_s,
                                       "model_s": sim.device_s}}
                out["points"].append(point)
                print(f"engine {load:>3}x {pol:>10}: goodput {m.goodput_qps:6.1f}/s (sim "
                      f"{sim.goodput_qps:6.1f}) drop {m.drop_rate:6.1%} ({sim.drop_rate:6.1%}) "
                      f"late {m.late_rate:6.1%} ({sim.late_rate:6.1%}) wasted "
                      f"{m.wasted_device_s:6.2f} of {m.device_s:6.2f} model s "
                      f"({sim.wasted_device_s:6.2f} of {sim.device_s:6.2f})  [{wall:.1f} s, "
                      f"load {os.getloadavg()[0]:.1f}]",
                      flush=True)
                time.sleep(1.2)  # the forecast's 1-s windows forget this load
        finally:
            engine.shutdown(drain=True, timeout_s=10)
    return out


def compare(case: dict) -> dict:
    """Proactive against reactive at each load: goodput ratio, wasted-time ratio."""
    by = {(p["load"], p["policy"]): p for p in case["points"]}
    rows = {}
    for load in sorted({p["load"] for p in case["points"]}):
        pro, rea = by.get((load, "proactive")), by.get((load, "reactive"))
        if pro is None or rea is None:
            continue
        rows[str(load)] = {
            "goodput_vs_reactive": pro["goodput_qps"] / rea["goodput_qps"]
            if rea["goodput_qps"] else None,
            "wasted_vs_reactive": pro["wasted_model_s"] / rea["wasted_model_s"]
            if rea["wasted_model_s"] else None}
    return rows


def label_axes(row, xlabel: str, ylabels: tuple[str, ...]) -> None:  # noqa: ANN001
    for ax, what in zip(row, ylabels, strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(what, fontsize=8)
        ax.grid(alpha=0.3)


def plot_allocation(row, case: dict) -> None:  # noqa: ANN001
    systems = sorted({p["system"] for p in case["points"]})
    for name in systems:
        pts = [p for p in case["points"] if p["system"] == name]
        x = [p["load"] for p in pts]
        row[0].plot(x, [p["goodput_qps"] for p in pts], "o-", label=name)
        row[1].plot(x, [p["quality"] for p in pts], "o-", label=name)
        row[2].plot(x, [p["predicted_quality"] for p in pts], "o-", label=name)
    label_axes(row, "demand (x what the most accurate variants serve)",
               ("goodput (answers in time / s)",
                "quality per request (simulated; late, dropped = 0)",
                "quality the allocation predicts"))
    row[0].set_title(f"{case['pipeline']} (1x = {case['one_x_qps']:.0f} q/s, SLO "
                     f"{case['slo_s'] * 1000:.0f} ms)", fontsize=9, loc="left")
    row[0].legend(fontsize=8)


def plot_online(row, case: dict) -> None:  # noqa: ANN001
    names = list(dict.fromkeys(sys_["system"] for sys_ in case["systems"]))
    for sys_ in case["systems"]:
        period_s = sys_.get("period_s", case["every_s"])
        t = [(p["period"] + 0.5) * period_s for p in sys_["per_period"]]
        label = f"{sys_['system']}, dropping {sys_['dropping']}"
        style = dict(color=f"C{names.index(sys_['system'])}", marker=".",
                     linestyle="-" if sys_["dropping"] == "none" else "--")
        row[0].plot(t, [p["quality"] for p in sys_["per_period"]], label=label, **style)
        row[1].plot(t, [100 * p["on_time"] for p in sys_["per_period"]], label=label, **style)
        if sys_["dropping"] == "none":
            row[2].plot(t, [d / case["one_x_qps"] for d in sys_["demands"]],
                        label=sys_["system"], **style)
    label_axes(row, "time (s)", ("quality per request (late, turned away = 0)",
                                 "on time (%)", "demand solved for (x 1x)"))
    row[0].set_title(f"{case['pipeline']}: demand {case['loads']} x {case['one_x_qps']:.0f} "
                     f"q/s, {case['phase_s']:g} s each", fontsize=9, loc="left")
    row[0].legend(fontsize=7)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    fig, axes = plt.subplots(len(cases), 3, figsize=(13, 3.6 * len(cases)), squeeze=False)
    for row, case in zip(axes, cases, strict=True):
        if case["pipeline"].startswith("allocation"):
            plot_allocation(row, case)
            continue
        if case["pipeline"].startswith("online"):
            plot_online(row, case)
            continue
        for pol in POLICIES:
            pts = [p for p in case["points"] if p["policy"] == pol]
            if not pts:
                continue
            x = [p["load"] for p in pts]
            row[0].plot(x, [p["goodput_qps"] for p in pts], "o-", label=pol)
            row[1].plot(x, [100 * p["drop_rate"] for p in pts], "o-", label=pol)
            row[2].plot(x, [p["wasted_model_s"] for p in pts], "o-", label=pol)
        title = f"{case['pipeline']} (1x = {case['sustained_qps']:.0f} q/s, deadline " \
                f"{case['deadline_s'] * 1000:.0f} ms)"
        for ax, what in zip(row, ("goodput (answers in time / s)", "drop rate (%)",
                                  "wasted model seconds"), strict=True):
            ax.set_xlabel("load (x what the pipeline sustains)")
            ax.set_ylabel(what)
            ax.grid(alpha=0.3)
        row[0].set_title(title, fontsize=9, loc="left")
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quick", action="store_true", help="fewer requests: under a minute")
    ap.add_argument("--duration-s", type=float, default=None,
                    help="seconds of arrivals per point (default 30 QA / 4 cluster; quick: "
                         "10 / 1.5)")
    ap.add_argument("--loads", default=",".join(map(str, LOADS)))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--qa-deadline-ms", type=float, default=300.0)
    ap.add_argument("--cluster-deadline-ms", type=float, default=400.0)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--cases", default="qa,cluster,allocation,online")
    ap.add_argument("--alloc-slo-ms", type=float, default=200.0)
    ap.add_argument("--online-phase-s", type=float, default=None,
                    help="seconds of each demand phase of the online case (default 20; "
                         "quick: 6)")
    ap.add_argument("--online-every-s", type=float, default=2.0,
                    help="the online controller's re-solve period")
    ap.add_argument("--online-drain-s", type=float, default=None,
                    help="the closed-loop controller solves for the backlog / this many "
                         "seconds on top of the EWMA (default: one re-solve period)")
    ap.add_argument("--engine-deadline-ms", type=float, default=300.0)
    ap.add_argument("--engine-duration-s", type=float, default=None,
                    help="seconds of arrivals per engine point (default 6; quick: 4)")
    ap.add_argument("--engine-max-batch", type=int, default=8)
    ap.add_argument("--engine-profiles-only", action="store_true",
                    help="plan the engine case on the raw profiles (no serving calibration)")
    ap.add_argument("--engine-busy-cores", type=int, default=0,
                    help="after the calibration, keep this many busy-looping processes "
                         "running while the engine case serves: a machine busier than "
                         "when its runtimes were measured")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.engine_busy_cores < 0:
        ap.error("--engine-busy-cores must be >= 0")

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ken.optimizer.artifact import bert_catalog
    from ken.optimizer.workload import load_azure_trace

    loads = [float(x) for x in args.loads.split(",")]
    policies = args.policies.split(",")
    if args.quick:
        policies = [p for p in policies if not p.startswith("proactive-")]
    catalog = bert_catalog(num_rows=2000,
                           models=("tiny", "mini", "small", "medium", "base", "large"))
    gaps = np.diff(load_azure_trace().arrival_s)
    started = time.perf_counter()
    cases = []
    for case in args.cases.split(","):
        if case == "qa":
            plans, kinds = qa_pipeline(catalog)
            d = args.duration_s or (10.0 if args.quick else 30.0)
            cases.append(run_case("qa", catalog, plans, kinds, gaps, d,
                                  args.qa_deadline_ms / 1000, loads, policies, args.seed))
        elif case == "qa-cascade":
            plans, kinds = qa_cascade_pipeline(catalog)
            d = args.duration_s or (10.0 if args.quick else 30.0)
            cases.append(run_case("qa-cascade", catalog, plans, kinds, gaps, d,
                                  args.qa_deadline_ms / 1000, loads, policies, args.seed))
        elif case == "cluster":
            plans, kinds = cluster_pipeline(catalog, args.gpus)
            d = args.duration_s or (1.5 if args.quick else 4.0)
            cases.append(run_case(f"cluster-{args.gpus}gpu", catalog, plans, kinds, gaps, d,
                                  args.cluster_deadline_ms / 1000, loads, policies,
                                  args.seed))
        elif case == "engine":
            d = args.engine_duration_s or (4.0 if args.quick else 6.0)
            cases.append(run_engine_case(gaps, d, args.engine_deadline_ms / 1000, loads,
                                         [p for p in policies if p in ENGINE_POLICIES],
                                         args.engine_max_batch, args.seed,
                                         not args.engine_profiles_only,
                                         busy_cores=args.engine_busy_cores))
        elif case == "online":
            cases.append(run_online_case(catalog, args.gpus, args.alloc_slo_ms / 1000,
                                         args.online_phase_s or (6.0 if args.quick else 20.0),
                                         args.online_every_s, args.seed,
                                         drain_s=args.online_drain_s))
        elif case == "allocation":
            d = args.duration_s or (1.0 if args.quick else 3.0)
            cases.append(run_allocation_case(catalog, args.gpus, args.alloc_slo_ms / 1000, d,
                                             list(ALLOC_LOADS), args.seed))
        else:
            ap.error(f"unknown case {case!r}")
    for c in cases:
        if not c["pipeline"].startswith(("allocation", "online")):
            c["proactive_vs_reactive"] = compare(c)
    result = {"command": "python benchmarks/pipeline_load.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "quick": args.quick,
        "seconds": time.perf_counter() - started, "cases": cases}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline_load.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "pipeline_load.png")
    for c in cases:
        if "proactive_vs_reactive" in c:
            print(c["pipeline"], "proactive vs reactive:",
                  json.dumps(c["proactive_vs_reactive"]))
    print(f"wrote {args.out}/pipeline_load.json and .png in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
