"""``ken demo``: the newcomer's tour of the whole pipeline on the packaged models and data.

Prepare the model family, profile it, show the cascade frontier and the gear-plan frontier
(PNG), pick a plan for an accuracy target, EXPLAIN and run a semantic SQL query through the
online engine, then replay a fresh bursty trace through the engine with the static cascade a
user would pick on the planning trace and with ken's plan matched to it (the fastest of its
frontier at least as accurate on the replayed rows), three times each, and compare. Last, the LLM
operators: a ``sem_qa`` and a ``sem_extract`` query, HellaSwag by ``sem_complete``, and one
generating model served with continuous against static batching, simulated and measured.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from ken.demo_tables import load_demo_tables
from ken.engine.decode import DecodeServer, as_run, replay
from ken.engine.replay import plot_replay, replay_rounds
from ken.errors import DataError
from ken.models import family
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig
from ken.ops.base import shared_resources
from ken.ops.sem_complete import load_hellaswag
from ken.ops.sem_qa import hybridqa_passage_sample
from ken.optimizer.baselines import gear_accuracy, matched_plan, served_accuracy, static_plans
from ken.optimizer.cascades import evaluate, pareto_cascades
from ken.optimizer.decode_sim import simulate_decoding
from ken.optimizer.plan_context import one_cascade_context
from ken.optimizer.planner import PlannerSettings, pareto_plans, planning_context
from ken.optimizer.planning import (
    default_peak_qps,
    held_out_window,
    planning_inputs,
    planning_trace,
)
from ken.optimizer.plotting import plot_frontier
from ken.optimizer.profile import load_or_run_profile
from ken.optimizer.simulator import simulate
from ken.optimizer.tokens import load_or_measure_token_cost, random_prompts
from ken.optimizer.workload import Hardware
from ken.progress import Reporter
from ken.report import (
    batching_table,
    console,
    frontier_table,
    latency_table,
    models_table,
    print_gear_plans,
)
from ken.session import Session, connect

REPLAYS = 3  # step 6 serves each system this many times, interleaved


def run_demo(args: argparse.Namespace) -> int:
    reporter = Reporter(args.quiet)
    source = args.data or family.default_data(args.data_dir).source
    if args.quick:
        sized = (args.train_rows, args.test_rows) != (6000, 1500)  # given on the command line
        data = family.FamilyData(source, *((args.train_rows, args.test_rows) if sized
                                           else (800, 400)), data_dir=args.data_dir)
        batch_sizes: tuple[int, ...] = (1, 8, 32)
        query_rows, plan_s, replay_s = 300, 30.0, 10.0
    else:
        data = family.FamilyData(source, args.train_rows, args.test_rows,
                                 data_dir=args.data_dir)
        batch_sizes = (1, 2, 4, 8, 16, 32, 64, 128)  # the sizes the session reuses
        query_rows, plan_s, replay_s = 1000, 60.0, 15.0
    device = DeviceConfig(threads=args.threads)
    worker = DeviceConfig(threads=1)  # each of the engine's 2 CPU devices runs 1 thread
    out = Path(args.out)
    started = time.perf_counter()
    # the demo's own result cache, empty at the start, so that every run tours the same work
    cache = out / "results.sqlite"
    for stale in out.glob("results.sqlite*"):
        stale.unlink()

    console.rule("1. the packaged model family (prepared on first use, then cached)")
    cards = family.prepare(data, device, reporter=reporter)
    sample = family.heldout_sample(data)
    models = {c.name: family.load_model(c, worker, data=data) for c in cards}

    console.rule(f"2. profiles on {len(sample)} held-out tweets ({worker.label}, one of the "
                 "engine's two devices)")
    profiles = {}
    for name, model in models.items():
        with reporter.task(f"profile {name}", len(batch_sizes) + 1) as advance:
            profiles[name] = load_or_run_profile(model, sample, batch_sizes,
                                                 on_step=lambda _s: advance(1))
    del models  # the engine's workers load their own copies
    console.print(models_table(cards, list(profiles.values())))

    console.rule("3. the cascade frontier (accuracy vs compute per row, from profiles alone)")
    front = pareto_cascades(profiles, max_stages=3, grid_size=16, batch_size=32)
    console.print(frontier_table(front, "Pareto cascades (cost at batch 32)"))
    accurate = max(profiles, key=lambda n: (evaluate(Cascade((n,)), profiles, 32).accuracy, n))
    alone = evaluate(Cascade((accurate,)), profiles, batch_size=32)
    best = max(front, key=lambda m: m.accuracy)
    console.print(f"most accurate: {best.cascade.describe()} — {best.accuracy:.1%} at "
                  f"{best.cost_ms_per_row:.1f} ms/row; the most accurate single model, "
                  f"{accurate}: {alone.accuracy:.1%} at {alone.cost_ms_per_row:.1f} ms/row")

    # the session's in-process work (binding, EXPLAIN) uses the workers' 1-thread profiles
    with connect(device=worker, data=data, reporter=reporter, cache=cache) as session:
        session.sentiment_cascade = best.cascade
        console.rule("4. the gear-plan frontier for 2 CPU devices on a bursty trace")
        # a target between the best single model and the best cascade: a single model cannot
        # reach it, and the most accurate cascade is too slow for the bursts
        target = (alone.accuracy + best.accuracy) / 2
        plan, statics, catalog, window = _gear_plans(session, profiles, target, plan_s,
                                                     replay_s, out)
        session_frontier = session.frontiers["sentiment"]

        console.rule("5. semantic SQL served by the online engine: EXPLAIN, then the query")
        load = session.serve(workers="process")["sentiment"]
        console.print(f"engine: {load.workers} workers loaded and warmed up their models in "
                      f"{load.total_s:.1f} s")
        load_demo_tables(session, num_rows=query_rows)
        session.sql("CREATE TABLE replies AS SELECT * FROM tweets UNION ALL "
                    "SELECT id + 100000, text, label, len FROM tweets WHERE id % 4 = 0")
        query = ("SELECT sentiment(text) AS mood, count(*) AS n, "
                 "round(avg(CASE WHEN sentiment(text) = label THEN 1 ELSE 0 END), 3) AS agree "
                 "FROM replies WHERE len > 60 GROUP BY mood ORDER BY n DESC")
        console.print(query, markup=False, highlight=False)
        console.print(session.explain(query), markup=False, highlight=False)
        t0 = time.perf_counter()
        result = session.sql(query)
        console.print(str(result), markup=False, highlight=False)
        first_s = time.perf_counter() - t0
        console.print(f"the batch query took {first_s:.1f} s through the engine")
        t0 = time.perf_counter()
        again = session.sql(query)
        again_s = time.perf_counter() - t0
        hits = sum(st.cache_hits for st in again.stats.values() if hasattr(st, "cache_hits"))
        same = ("the same" if sorted(again.fetchall()) == sorted(result.fetchall())
                else "a DIFFERENT")
        console.print(f"run again: {again_s:.2f} s ({first_s / max(again_s, 1e-9):.0f}x faster), "
                      f"{hits:,} answers from the result cache and no model call, {same} "
                      f"result (`ken cache stats --path {cache}`)", highlight=False)
        session.stop_serving()

        console.rule(f"6. a {replay_s:.0f}-s bursty trace through the engine, {REPLAYS} times: "
                     "ken against the static cascade a user would pick on the planning trace")
        loaders = session.operators["sentiment"].loaders(session.ctx, worker)
    _compare(session_frontier, statics, catalog, window, target, loaders, sample, out,
             reporter)

    console.rule("7. LLM operators: answers from SQL, a HellaSwag cascade, continuous batching")
    _llm_step(args, reporter, cache)
    console.print(f"demo finished in {time.perf_counter() - started:.0f} s; figures in {out}/")
    return 0


def _gear_plans(session: Session, profiles, target: float, duration_s: float,  # noqa: ANN001
                replay_s: float, out: Path) -> tuple:
    """Plan the sentiment function for an accuracy target on a bursty trace; the static
    cascades (each alone at every load, placed and scheduled by ken) for comparison; and the
    held-out ``replay_s`` window of the same arrival process that step 6 replays."""
    catalog, cascades = planning_inputs(profiles)
    peak = default_peak_qps(catalog, cascades, 2)
    trace = planning_trace("gamma", peak, duration_s, seed=0)
    console.print(f"planning trace: {len(trace)} requests over {trace.duration_s:.0f} s "
                  f"(Gamma arrivals, CV 4), 1-s peak {trace.qps_max():g} qps = 1.5x what the "
                  "most accurate cascade sustains on the 2 devices")
    settings = PlannerSettings(num_ranges=8)
    # the demo's 2 CPU workers (served below with CPU loaders), on a GPU machine too
    session.plan("accuracy >= 0", trace=trace, peak_qps=peak, settings=settings, devices=2)
    frontier = session.frontiers["sentiment"]
    # pick on the held-out accuracy of the gears each plan uses on this trace: a short trace
    # samples too few rows for its row accuracy to tell plans 0.5 points apart
    served = [gear_accuracy(p, catalog, simulate(p, catalog, trace).range_index[0])
              for p in frontier.plans]
    ok = [i for i, a in enumerate(served) if a >= target]
    if ok:
        k = min(ok, key=lambda i: frontier.plans[i].predicted.p95_ms)
        goal = f"accuracy >= {target:.1%}"
    else:
        k = max(range(len(served)), key=lambda i: served[i])
        goal = f"accuracy >= {target:.1%}, out of reach: the most accurate plan"
    plan = frontier.plans[k]
    session.use_plan(plan)
    ctx = planning_context("sentiment", cascades, catalog, Hardware.cpu_workers(2, 4 * 2**30),
                           trace, peak, settings)
    # every candidate cascade alone at all loads, none thinned out
    statics = static_plans(one_cascade_context(ctx, cascades))
    shown = pareto_plans(statics)
    png = plot_frontier(frontier, out / "gear-plan-frontier.png",
                        title=f"sentiment gear plans: 2 x cpu-1t, Gamma trace, peak {peak:g} "
                              "qps (crosses: static cascades)",
                        extra_points=[(f"static {len(p.cascades[0].models)}-model",
                                       p.predicted.p95_ms, p.predicted.accuracy) for p in shown])
    print_gear_plans(frontier, plan, catalog)
    console.print(f"plan {k} picked for '{goal}' (halfway between the most accurate single "
                  f"model and the most accurate cascade); the held-out accuracy of the gears it "
                  f"serves this trace with: {served[k]:.1%}", highlight=False)
    for line in plan.describe():
        console.print(f"  {line}", highlight=False, markup=False)
    console.print(f"wrote {png}", highlight=False)
    return plan, statics, catalog, held_out_window("gamma", peak, duration_s, replay_s)


def _compare(frontier, statics, catalog, trace, target: float, loaders,  # noqa: ANN001
             sample, out: Path, reporter: Reporter) -> None:
    """Replay a fresh window of bursty arrivals through the engine, by the out-of-sample rule
    of ``benchmarks/e2e.py``: the static cascade a user would pick on the planning trace for
    the target (the fastest there at least that accurate), against ken's matched plan (the
    fastest frontier plan on the planning trace at least as accurate as it on the replayed
    rows, its one-gear alternatives included); each served ``REPLAYS`` times, interleaved.
    ``trace``: a held-out window of the planning trace's arrival process."""
    ok = [p for p in statics if p.predicted.accuracy >= target]
    static = (min(ok, key=lambda p: p.predicted.p95_ms) if ok
              else max(statics, key=lambda p: p.predicted.accuracy))
    goal = served_accuracy(static, catalog, trace)
    candidates = frontier.all_plans  # the frontier and the one-gear plans beside it
    k = matched_plan(candidates, goal, catalog, trace)
    plan = candidates[k] if k is not None else frontier.plans[-1]
    same = plan.serves_like(static)
    console.print(f"{len(trace)} requests over {trace.duration_s:.0f} s (the planning trace's "
                  f"arrival process drawn again: same mean rate, another seed), 1-s "
                  f"peak {trace.qps_max():g} qps. Static cascade picked on the planning trace "
                  f"for accuracy >= {target:.1%}: {static.cascades[0].describe()}; ken's "
                  "matched plan (the fastest of its frontier and the one-gear plans beside it "
                  "at least as accurate on these "
                  f"rows): {'that same plan' if same else plan.headline()}", highlight=False)
    if not same:
        for line in plan.describe():
            console.print(f"  {line}", highlight=False, markup=False)
    systems = [("ken gear plan", plan)] + ([] if same else [("static cascade", static)])
    # every request served (no admission control), so both systems' latency and accuracy
    # cover the same rows
    runs = replay_rounds([p for _, p in systems], loaders, trace, sample, REPLAYS,
                         reporter=reporter, workers="process", admission="max_in_flight")
    measured, rows = {}, []
    for (name, p), served in zip(systems, runs, strict=True):
        measured[name] = [s.replay.result.metrics(0, p) for s in served]
        rows += [(f"{name}, replay {r}", m) for r, m in enumerate(measured[name], 1)]
        plot_replay(served[-1].replay, p, out / f"replay-{name.split()[0]}.png",
                    title=f"{name}: measured (last replay)")
    medians = {name: float(np.median([m.p95_ms for m in ms])) for name, ms in measured.items()}
    simulated = {name: simulate(p, catalog, trace).metrics(0, p).p95_ms for name, p in systems}
    accuracy = {name: float(np.median([m.accuracy for m in ms])) for name, ms in measured.items()}
    console.print(latency_table("measured on the engine (2 worker processes x 1 thread)", rows,
                                "system"))
    if same:
        console.print(f"ken's frontier serves the static cascade itself at this accuracy: "
                      f"p95 {medians['ken gear plan']:.0f} ms (median of {REPLAYS} replays; "
                      f"simulated {simulated['ken gear plan']:.0f} ms). "
                      f"Latency plots in {out}/", highlight=False)
        return
    ratios = [b.p95_ms / a.p95_ms
              for a, b in zip(measured["ken gear plan"], measured["static cascade"], strict=True)]
    console.print(f"p95, median of {REPLAYS} replays: ken {medians['ken gear plan']:.0f} ms, "
                  f"static cascade {medians['static cascade']:.0f} ms; the static cascade's p95 "
                  f"is {np.median(ratios):.2f}x ken's (per replay: "
                  f"{', '.join(f'{x:.2f}x' for x in ratios)}). Every request was served (none "
                  f"turned away); accuracy, rows answered correctly of the same {len(trace)} "
                  f"requests, median of the replays: ken {accuracy['ken gear plan']:.1%}, static "
                  f"cascade {accuracy['static cascade']:.1%} (ken's gears follow the load each "
                  f"replay meets, so its accuracy moves between replays). Simulated p95 of "
                  f"this window (profiled runtimes): ken {simulated['ken gear plan']:.0f} ms, "
                  f"static cascade {simulated['static cascade']:.0f} ms. Latency plots in "
                  f"{out}/",
                  highlight=False)


def _llm_step(args: argparse.Namespace, reporter: Reporter, cache: Path | bool = False
              ) -> None:
    """SmolLM2-135M (packaged) answers from SQL; with ``--with-qwen`` the LLM operators run
    the cascade SmolLM2 -> Qwen2.5-Coder-0.5B (fetched on first use, 478 MB), and
    ``sem_extract`` its default, Qwen alone."""
    llms = ("smollm2-135m", "qwen2.5-coder-0.5b") if args.with_qwen else ("smollm2-135m",)
    if not args.with_qwen:
        console.print("LLMs: SmolLM2-135M-Instruct alone (`ken demo --with-qwen` adds "
                      "Qwen2.5-Coder-0.5B as a second stage: a 478 MB download and ~2 min "
                      "of conversion on first use)", highlight=False)
    with connect(device=DeviceConfig(threads=args.threads), reporter=reporter,
                 cache=cache) as session:
        for name in ("sem_qa", "sem_extract", "sem_complete"):
            if not (args.with_qwen and name == "sem_extract"):  # its default: Qwen alone
                session.operators[name].llms = llms
        try:
            qa = hybridqa_passage_sample(limit=3)
            contexts, endings, gold = load_hellaswag(limit=6 if args.quick else 12)
        except DataError as exc:
            console.print(f"skipped the LLM queries: {exc}", highlight=False)
        else:
            _llm_queries(session, qa, contexts, endings, gold)
        lm = shared_resources(session.ctx).causal_lm("smollm2-135m")
    # continuous batching of one generating model: 16 requests, simulated and measured
    cost = load_or_measure_token_cost(lm, "smollm2-135m", batches=(1, 4), lengths=(32, 128),
                                      reporter=reporter)
    rng = np.random.default_rng(0)
    n = 8 if args.quick else 16
    arrivals = np.cumsum(rng.exponential(0.6, n)) - 0.6
    arrivals[0] = 0.0
    prompt_len = rng.integers(16, 96, n)
    out_len = rng.integers(4, 20, n)
    prompts = [random_prompts(lm, 1, int(k), rng)[0] for k in prompt_len]
    rows = []
    for mode in ("continuous", "static"):
        sim = simulate_decoding(cost, arrivals, prompt_len, out_len, 8, mode=mode).metrics()
        server = DecodeServer(lm, 8, mode=mode, ignore_eos=True).start()
        outcomes = replay(server, arrivals, prompts, out_len)
        server.shutdown()
        got = as_run(outcomes, server.passes, server.prefill_passes, server.busy_s).metrics()
        rows.append((mode, sim, got))
    console.print(batching_table(f"SmolLM2-135M serving {n} generating requests (Poisson, "
                                 "~1.7 req/s), 1 device, up to 8 rows per pass", rows))
    console.print("continuous batching lets new requests join between forward passes; static "
                  "batching makes them wait for the running batch. The simulator charges the "
                  "fitted cost of each pass (prefill per prompt length, decode per batch); the "
                  "engine runs them.", highlight=False)


def _llm_queries(session: Session, qa, contexts, endings, gold) -> None:  # noqa: ANN001
    session.register_table("passages", pa.table({
        "question": [q for q, _ in qa.inputs], "passage": [p[:1200] for _, p in qa.inputs],
        "gold": [str(a) for a in qa.references]}))
    session.register_table("hellaswag", pa.table({
        "ctx": contexts, "endings": ["\n".join(e) for e in endings], "label": gold}))
    for query in ("SELECT question, sem_qa(question, passage) AS answer, gold FROM passages",
                  "SELECT sem_extract(passage, 'a year') AS year, left(passage, 60) AS passage "
                  "FROM passages",
                  "SELECT count(*) AS items, avg(CASE WHEN sem_complete(ctx, endings) = label "
                  "THEN 1.0 ELSE 0 END) AS accuracy FROM hellaswag"):
        console.print(query, markup=False, highlight=False)
        t0 = time.perf_counter()
        result = session.sql(query)
        console.print(str(result), markup=False, highlight=False)
        console.print(f"({time.perf_counter() - t0:.1f} s)", highlight=False)
    console.print(session.explain("SELECT sem_qa(question, passage) FROM passages"),
                  markup=False, highlight=False)
