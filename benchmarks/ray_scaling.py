"""Scaling out on Ray (issue 20, item 5): measured on this machine, predicted up to 64 nodes.

Three parts, one run:

- *router*: how many requests per second one engine (one router: ken's dispatcher in one
  Python process) pushes through Ray actors when the model costs nothing (the stand-in model
  of ``tests/fakes.py``; batches of up to 64 rows): ``--flood`` requests submitted at once,
  with 1, 2 and 4 actors. That rate bounds a cluster served by one router.
- *measured*: the packaged sentiment family (MiniLM-L3, MiniLM-L6, SmolLM2-135M) profiled on
  one thread and planned for one node of one CPU worker with the hop to an actor charged per
  batch (``measure_hop_s``, rounded up to 0.5 ms as ``ken plan --ray`` does); the middle plan
  of that frontier is copied onto 1, 2 and 4 workers (``ken.optimizer.scale.replicate_plan``)
  and served by Ray actors (one CPU each; Ray is told this machine has 4 CPUs, so 4 actors
  share its 2 cores) to Poisson arrivals at 0.5x, 1x and 2x the copies' peak rate for
  ``--seconds`` each. Per run: p50/p95, answered per second, and the simulator's prediction
  of the same plan on the same arrivals.
- *simulated*: the KEN artifact's measured V100 runtimes of five BERT classifiers (accuracies
  synthetic, see ``ken.optimizer.artifact``) planned for one node of 8 GPUs on the Azure trace
  whose busiest second holds ``--node-peak`` requests (``ken plan --trace azure``), with the
  measured hop; a spread of the frontier's plans copied onto 1 to 64 nodes
  (``replicate_plan``) and simulated on n nodes' traffic (``cluster_trace``): all nodes
  bursting at once (with the measured hop, without it, and with 4x it: a slower network
  between nodes) and nodes whose bursts are independent (random shifts; also with every
  batch trigger of the plan at 1 row, to see what the node plan's triggers cost there).

Writes benchmarks/results/ray_scaling/ray_scaling.json and ray_scaling.png.

    python benchmarks/ray_scaling.py                    # ~8 minutes with prepared models
    python benchmarks/ray_scaling.py --part simulated   # again, keeping the measured parts
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the stand-in models; Ray actors get this path too
import fakes  # noqa: E402

from ken.engine.ray_runner import import_ray, measure_hop_s  # noqa: E402
from ken.engine.replay import replay  # noqa: E402
from ken.engine.serving import Engine  # noqa: E402
from ken.models import family  # noqa: E402
from ken.models.cascade import Cascade  # noqa: E402
from ken.models.model import DeviceConfig  # noqa: E402
from ken.optimizer.artifact import bert_profiles, v100_hardware  # noqa: E402
from ken.optimizer.cascades import pareto_cascades  # noqa: E402
from ken.optimizer.perf import Catalog  # noqa: E402
from ken.optimizer.planner import PlannerSettings, plan_frontier  # noqa: E402
from ken.optimizer.planning import (  # noqa: E402
    default_peak_qps,
    family_profiles,
    planning_inputs,
    planning_trace,
)
from ken.optimizer.scale import cluster_trace, replicate_plan  # noqa: E402
from ken.optimizer.simulator import SimResult, simulate  # noqa: E402
from ken.optimizer.workload import Hardware, poisson_trace  # noqa: E402
from ken.policy.plan import GearPlan, PlanMetrics, RangeSchedule, Replica  # noqa: E402
from ken.progress import Reporter  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "ray_scaling"
ACTORS = (1, 2, 4)
LOADS = (0.5, 1.0, 2.0)
NODES = (1, 2, 4, 8, 16, 32, 64)
BURSTS = ("same", "independent")
MAIN = "same bursts, hop measured"
INDEPENDENT = "independent bursts, hop measured"


def with_hop(hardware: Hardware, hop_s: float) -> Hardware:
    return Hardware(tuple(dataclasses.replace(d, dispatch_s=hop_s) for d in hardware.devices))


def answered_per_s(result: SimResult) -> float:
    """Requests answered per second from the first arrival to the last answer."""
    return len(result.arrival_s) / float(result.completion_s.max() - result.arrival_s.min())


def metrics_row(m: PlanMetrics, per_s: float) -> dict:
    return {"p50_ms": m.p50_ms, "p95_ms": m.p95_ms, "p99_ms": m.p99_ms,
            "accuracy": m.accuracy, "answered_per_s": per_s, "requests": m.num_requests}


# -- the router ---------------------------------------------------------------------------------


def flood_plan(devices: int) -> GearPlan:
    """The stand-in model on ``devices`` workers, batches of up to 64 rows, no wait."""
    return GearPlan("op", (0.0, 1e9), (Cascade(("a",)),),
                    tuple(Replica("a", (f"cpu{i}",)) for i in range(devices)),
                    (RangeSchedule(0, (1.0 / devices,) * devices, (1,) * devices),),
                    (64,) * devices, max_wait_s=1e-4)


def router_part(reporter: Reporter, requests: int) -> dict:
    out = {}
    for n in ACTORS:
        sources = {"a": functools.partial(fakes.FakeModel, "a")}
        with Engine(flood_plan(n), sources, workers="ray", admission="max_in_flight",
                    max_in_flight=10 * requests) as engine:
            engine.submit("warm").result()
            t0 = time.perf_counter()
            futures = [engine.submit(f"row {i}") for i in range(requests)]
            submitted = time.perf_counter() - t0
            outcomes = [f.result() for f in futures]
            wall = time.perf_counter() - t0
            rows = [r.rows for r in engine.batch_log][1:]  # the warm-up row first
        ok = sum(o.status == "ok" for o in outcomes)
        out[str(n)] = {"requests": requests, "ok": ok, "wall_s": wall, "submit_s": submitted,
                  "answered_per_s": ok / wall, "batches": len(rows),
                  "mean_batch_rows": float(np.mean(rows)) if rows else None}
        reporter.note(f"router, {n} actor(s): {ok / wall:,.0f} requests/s "
                      f"({len(rows)} batches, {np.mean(rows):.1f} rows each)")
    return out


# -- measured on this machine -------------------------------------------------------------------


def measured_part(reporter: Reporter, hop_s: float, seconds: float, plan_s: float,
                  seed: int) -> dict:
    data, cards, sample, profiles = family_profiles(reporter)
    device = DeviceConfig(threads=1)
    catalog, cascades = planning_inputs(profiles)
    node = with_hop(Hardware.cpu_workers(1, 4 * 2**30), hop_s)
    peak = default_peak_qps(catalog, cascades, 1)
    frontier, _ = plan_frontier("sentiment", cascades, catalog, node,
                                planning_trace("poisson", peak, plan_s, seed=seed),
                                settings=PlannerSettings(num_ranges=4, seed=seed),
                                reporter=reporter)
    usable = [p for p in frontier.plans if p.predicted.p95_ms < 1000.0]
    plan = usable[len(usable) // 2]
    charged = catalog.with_overhead(hop_s)
    loaders = {c.name: functools.partial(family.load_model, c, device, None, data)
               for c in cards if c.name in {r.model for r in plan.placement}}
    out: dict = {"node_plan": {"gears": [f"{lo:g}-{hi:g} qps: {plan.cascades[c].describe()}"
                                         for lo, hi, c in plan.gears()],
                               "placement": [r.label() for r in plan.placement],
                               "peak_qps": plan.qps_max,
                               "predicted": plan.predicted.to_dict()},
                 "runs": {}}
    reporter.note(f"node plan: {'; '.join(out['node_plan']['gears'])}; peak "
                  f"{plan.qps_max:g} qps, predicted p95 {plan.predicted.p95_ms:.0f} ms")
    for n in ACTORS:
        big = replicate_plan(plan, n)
        runs = out["runs"][str(n)] = {}
        with Engine(big, loaders, workers="ray", admission="max_in_flight",
                    max_in_flight=100_000) as engine:
            for load in LOADS:
                trace = poisson_trace(load * big.qps_max, seconds, seed=seed)
                rep = replay(engine, trace, sample, seed=seed)
                sim = simulate(big, charged, trace, seed)
                runs[f"{load:g}"] = {
                    "offered_qps": load * big.qps_max,
                    "measured": metrics_row(rep.result.metrics(0, big),
                                            answered_per_s(rep.result)),
                    "simulated": metrics_row(sim.metrics(0, big), answered_per_s(sim)),
                    "status": rep.status_counts(), "max_send_lag_s": rep.max_send_lag_s}
                m, s = runs[f"{load:g}"]["measured"], runs[f"{load:g}"]["simulated"]
                reporter.note(f"{n} actor(s), {load:g}x peak ({load * big.qps_max:.0f} qps): "
                              f"measured p95 {m['p95_ms']:.0f} ms, {m['answered_per_s']:.0f}/s;"
                              f" simulated p95 {s['p95_ms']:.0f} ms, "
                              f"{s['answered_per_s']:.0f}/s")
    return out


# -- simulated past this machine ----------------------------------------------------------------


def simulated_part(reporter: Reporter, hop_s: float, node_peak: float, plans_kept: int,
                   grid: int, ranges: int, seed: int) -> dict:
    profiles = bert_profiles(num_rows=4000, seed=seed)
    catalog = Catalog.from_profiles(profiles)
    cascades = [m.cascade for m in pareto_cascades(profiles, grid_size=grid, batch_size=1)]
    node = with_hop(v100_hardware(8, per_node=8), hop_s)
    # what `ken plan --trace azure` plans on: the Azure code trace rate-scaled until its
    # busiest second holds node_peak arrivals (all 8,819 requests then fall in ~3 s)
    node_trace = planning_trace("azure", node_peak, 60.0)
    t0 = time.perf_counter()
    frontier, stats = plan_frontier(
        "bert", cascades, catalog, node, node_trace,
        settings=PlannerSettings(num_ranges=ranges, seed=seed, include_static=False,
                                 placement_scoring="estimate", screen=2,
                                 min_accuracy_step=0.003),
        reporter=reporter)
    planning_s = time.perf_counter() - t0
    idx = np.unique(np.linspace(0, len(frontier) - 1, plans_kept).round().astype(int))
    chosen = [frontier.plans[i] for i in idx]
    reporter.note(f"V100 node plan: {len(cascades)} cascades, {len(frontier)} frontier plans "
                  f"in {planning_s:.0f} s on {len(node_trace)} requests "
                  f"({node_trace.duration_s:.1f} s, 1-s peak {node_trace.qps_max():.0f}/s); "
                  f"simulating {len(chosen)} of them "
                  f"on {NODES[0]}-{NODES[-1]} nodes")
    hops = {"none": 0.0, "measured": hop_s, "4x measured": 4 * hop_s}
    out: dict = {"node_peak_qps": node_trace.qps_max(), "node_requests": len(node_trace),
                 "node_trace_s": node_trace.duration_s, "candidate_cascades": len(cascades),
                 "planning_s": planning_s, "frontier_plans": len(frontier),
                 "node_frontier": [{"p95_ms": p.predicted.p95_ms,
                                    "accuracy": p.predicted.accuracy} for p in frontier.plans],
                 "hops_ms": {k: 1000 * v for k, v in hops.items()}, "plans": []}
    traces = {(n, b): cluster_trace(node_trace, n, b, seed) for n in NODES for b in BURSTS}
    for plan in chosen:
        row: dict = {"gears": [f"{lo:g}-{hi:g} qps: {plan.cascades[c].describe()}"
                               for lo, hi, c in plan.gears()],
                     "replicas_per_node": len(plan.placement),
                     "node_predicted": plan.predicted.to_dict(), "by_nodes": {}}
        for n in NODES:
            big = replicate_plan(plan, n)
            cell: dict = {}
            row["by_nodes"][n] = cell
            # every batch trigger at 1 row: what the node plan's triggers cost on smoother
            # cluster traffic (independent bursts)
            eager = dataclasses.replace(big, ranges=tuple(
                dataclasses.replace(rs, min_queue=(1,) * len(rs.min_queue))
                for rs in big.ranges))
            runs = [(f"{b} bursts, hop {name}", big, b, hop) for b in BURSTS
                    for name, hop in hops.items() if b == "same" or name == "measured"]
            runs.append((f"{INDEPENDENT}, batch triggers at 1 row", eager, "independent",
                         hop_s))
            for key, served, bursts, hop in runs:
                trace = traces[n, bursts]
                t1 = time.perf_counter()
                m = simulate(served, catalog.with_overhead(hop), trace, seed).metrics(0, served)
                cell[key] = {"p95_ms": m.p95_ms, "p99_ms": m.p99_ms, "accuracy": m.accuracy,
                             "requests": len(trace), "offered_peak_qps": trace.qps_max(),
                             "simulate_s": time.perf_counter() - t1}
        out["plans"].append(row)
        one, last = row["by_nodes"][1][MAIN], row["by_nodes"][NODES[-1]]
        reporter.note(f"  plan at {one['accuracy']:.1%}: p95 {one['p95_ms']:.1f} ms on 1 node;"
                      f" {NODES[-1]} nodes: {last[MAIN]['p95_ms']:.1f} ms (same bursts), "
                      f"{last[INDEPENDENT]['p95_ms']:.1f} ms at "
                      f"{last[INDEPENDENT]['accuracy']:.1%} (independent)")
    return out


# -- plot ---------------------------------------------------------------------------------------


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    ax = axes[0]
    runs = out["measured"]["runs"]
    xs = np.arange(len(ACTORS))
    for j, (what, style) in enumerate((("measured", "tab:blue"), ("simulated", "tab:gray"))):
        ax.bar(xs + (j - 0.5) * 0.38, [runs[str(n)]["2"][what]["answered_per_s"] for n in ACTORS],
               0.38, color=style, label=f"{what}, answered/s at 2x peak")
    ax.set_xticks(xs, [f"{n} actor{'s' if n > 1 else ''}" for n in ACTORS])
    ax.set_ylabel("requests answered per second")
    router = max(r["answered_per_s"] for r in out["router"].values())
    ax.set_title(f"this machine (2 cores); one router alone: {router:,.0f}/s", fontsize=10)
    ax.legend(fontsize=7)
    ax = axes[1]
    sim = out["simulated"]
    for n in NODES:
        pts = sorted((p["by_nodes"][n][INDEPENDENT]["p95_ms"],
                      p["by_nodes"][n][INDEPENDENT]["accuracy"]) for p in sim["plans"])
        ax.plot(*zip(*pts, strict=True), "o-", ms=3, label=f"{n} node{'s' if n > 1 else ''}")
    ax.set_xscale("log")
    ax.set_xlabel("predicted p95 (ms)")
    ax.set_ylabel("accuracy (synthetic)")
    ax.set_title("node plans on n nodes x 8 V100s, nodes' bursts independent", fontsize=10)
    ax.legend(fontsize=7)
    ax = axes[2]
    for i, p in enumerate(sim["plans"]):
        color = f"C{i}"
        acc = p["by_nodes"][1][MAIN]["accuracy"]
        ax.plot(NODES, [p["by_nodes"][n][MAIN]["p95_ms"] for n in NODES], "o-",
                color=color, ms=3, label=f"{acc:.1%} (measured hop)")
        ax.plot(NODES, [p["by_nodes"][n]["same bursts, hop none"]["p95_ms"] for n in NODES],
                ":", color=color)
        ax.plot(NODES, [p["by_nodes"][n]["same bursts, hop 4x measured"]["p95_ms"]
                        for n in NODES], "--", color=color, lw=0.8)
    bound = out["router_bound_nodes"]
    if bound < NODES[-1]:
        ax.axvline(max(bound, 1), color="black", lw=1)
        ax.annotate(" one router's limit", (max(bound, 1), ax.get_ylim()[1] * 0.9), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes of 8 V100s")
    ax.set_ylabel("predicted p95 (ms)")
    ax.set_title("all nodes burst at once; dotted: no hop, dashed: 4x the hop", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flood", type=int, default=20_000, help="router part: requests")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured part: per run")
    ap.add_argument("--plan-s", type=float, default=60.0, help="measured part: planning trace")
    ap.add_argument("--node-peak", type=float, default=3800.0,
                    help="simulated part: one node's peak rate (the planner benchmark's "
                         "7,600/s on 16 V100s, halved)")
    ap.add_argument("--plans", type=int, default=5, help="simulated part: plans kept")
    ap.add_argument("--grid", type=int, default=24, help="simulated part: thresholds/stage")
    ap.add_argument("--ranges", type=int, default=20, help="simulated part: |Q|")
    ap.add_argument("--part", choices=("all", "simulated"), default="all",
                    help="'simulated': only the 1-64 node predictions (no Ray, no models)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    if args.flood < 100 or args.seconds <= 0 or args.node_peak <= 0 or args.plans < 1:
        ap.error("--flood must be >= 100 and --seconds, --node-peak, --plans > 0")
    reporter = Reporter(args.quiet)
    started = time.perf_counter()
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    if args.part == "all":
        ray = import_ray()
        # 4 logical CPUs on this 2-core machine, so that 4 one-CPU actors can be placed
        ray.init(num_cpus=max(ACTORS), include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)
        measured_hop = measure_hop_s()
        out["ray"] = ray.__version__
    else:
        previous = json.loads((args.out / "ray_scaling.json").read_text())
        measured_hop = previous["measured_hop_ms"] / 1000
        out |= {k: previous[k] for k in ("ray", "router", "measured")}
    hop_s = math.ceil(measured_hop / 5e-4) * 5e-4  # as RayCluster.hardware rounds it
    out |= {"measured_hop_ms": 1000 * measured_hop, "planned_hop_ms": 1000 * hop_s}
    reporter.note(f"hop to an actor: {1000 * measured_hop:.2f} ms (planned with "
                  f"{1000 * hop_s:.1f} ms)")
    if args.part == "all":
        out["router"] = router_part(reporter, args.flood)
        out["measured"] = measured_part(reporter, hop_s, args.seconds, args.plan_s, args.seed)
        ray.shutdown()
    out["simulated"] = simulated_part(reporter, hop_s, args.node_peak, args.plans, args.grid,
                                      args.ranges, args.seed)
    router_qps = max(r["answered_per_s"] for r in out["router"].values())
    out["router_bound_nodes"] = router_qps / args.node_peak
    reporter.note(f"one router: {router_qps:,.0f} requests/s = the peak of "
                  f"{out['router_bound_nodes']:.2f} nodes of 8 V100s at {args.node_peak:g}/s")
    out["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ray_scaling.json").write_text(json.dumps(out, indent=1, default=float))
    plot(out, args.out / "ray_scaling.png")
    reporter.note(f"wrote {args.out / 'ray_scaling.json'} and ray_scaling.png "
                  f"({out['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
