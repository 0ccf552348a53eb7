"""Reliability of the online engine (issue 19, items 4 and 5; DESIGN.md section 14).

Measures what docs/reliability.md reports, in one run:

- *overload*: the packaged sentiment family (MiniLM-L3, MiniLM-L6, SmolLM2-135M), profiled on
  one thread, planned for 2 CPU workers x 1 thread on Poisson arrivals (the peak `ken plan`
  uses by default: 1.5x what the most accurate cascade sustains); the middle plan of the
  frontier is served in worker processes to Poisson arrivals at ``--overload`` (10) times the
  plan's peak rate for ``--overload-s`` seconds, twice: with the default admission (sized to
  the plan: its predicted p99 is the latency target) and with the old default
  (``admission="max_in_flight"``, ``max_in_flight=10000``). Per run: admitted p50/p99 beside
  the target, rejected share, how fast a rejection comes back.
- *worker SIGKILL*: the same plan at its peak rate for ``--kill-s`` seconds while a worker is
  SIGKILLed every ``--kill-every-s`` seconds (the devices in turn): requests without exactly
  one outcome (lost), outcomes per status.
- *stuck batch* and *crashing model*: stand-in models (``tests/fakes.py``) in worker processes
  with the engine's defaults (deadline max(10x profiled, 2 s); one retry; 3 crashes in a
  row mark a model failed): a batch stuck once (time until the retry on a fresh worker
  answers it), a model stuck for ever (time until its rows get the error), and a model whose
  every call kills its worker (time to the first error, restarts, time until later requests
  fail at once).
- *SIGTERM*: a process serving stand-in requests at 100/s (from one thread; outcomes printed
  by the futures' callbacks) is sent SIGTERM: requests sent, outcomes, lost, exit status.
- *a generating function* (issue 38; ``--generation-only`` runs this part alone, ~2 minutes):
  SmolLM2-135M on a decode server (4 rows a pass, prompts of 16-64 tokens, 4-12 new tokens),
  its peak the rate at which the decode simulator has it 80% busy (its token cost, measured
  once per machine) and its latency target the simulated p99 there, flooded at
  ``--overload`` x that peak for ``--overload-s`` with admission by capacity and without it
  (what is left 30 s after the last arrival is cancelled); stand-in LMs (``tests/fakes.py``)
  whose every pass raises, or that hang after answering; SIGTERM to a program whose serving
  manager serves a stand-in generating function at 100 requests/s. A decode server runs in
  ken's process, so there is no worker to SIGKILL: its kill is SIGTERM's row.

Writes benchmarks/results/reliability/reliability.json and reliability.png (admitted latency
over time in both overload runs; the fault timings against their goals).

    python benchmarks/reliability.py          # ~6 minutes with cached models and profiles
    python benchmarks/reliability.py --replicas-only   # stand-ins on two replicas, ~20 s
    python benchmarks/reliability.py --generation-only # the generating function, ~2 min
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ken.engine.outcome import Outcome
from ken.engine.replay import Replay, replay
from ken.engine.serving import Engine
from ken.models import family
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig
from ken.optimizer.planner import PlannerSettings, plan_frontier
from ken.optimizer.planning import (
    default_peak_qps,
    family_profiles,
    planning_inputs,
    planning_trace,
)
from ken.optimizer.workload import Hardware, poisson_trace
from ken.policy.plan import GearPlan, PlanMetrics, RangeSchedule, Replica
from ken.progress import Reporter

RESULTS = Path(__file__).parent / "results" / "reliability"
TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the stand-in models; worker processes get this path too
import fakes  # noqa: E402

GOALS = {"admitted_p99_over_target": 2.0, "crash_error_s": 5.0, "lost": 0}


# -- overload and SIGKILL on the packaged models ------------------------------------------------


def latency_ms(outcomes: list[Outcome], status: str) -> np.ndarray:
    return np.array([1000 * o.latency_s for o in outcomes if o.status == status])


def summary(rep: Replay, target_s: float, wall_s: float) -> dict:
    return outcome_summary(list(rep.outcomes), rep.status_counts(), target_s, wall_s,
                           rep.max_send_lag_s)


def outcome_summary(outcomes: list[Outcome], status: dict[str, int], target_s: float,
                    wall_s: float, max_send_lag_s: float | None) -> dict:
    ok = latency_ms(outcomes, "ok")
    rejected = latency_ms(outcomes, "rejected")
    def pct(a: np.ndarray, q: float) -> float | None:
        return float(np.percentile(a, q)) if a.size else None

    return {
        "requests": len(outcomes), "status": status,
        "rejected_share": rejected.size / len(outcomes),
        "admitted_p50_ms": pct(ok, 50), "admitted_p99_ms": pct(ok, 99),
        "admitted_max_ms": pct(ok, 100),
        "admitted_p99_over_target": pct(ok, 99) / (1000 * target_s) if ok.size else None,
        "rejection_p50_ms": pct(rejected, 50), "rejection_p99_ms": pct(rejected, 99),
        "served_per_s": ok.size / wall_s, "wall_s": wall_s,
        "max_send_lag_s": max_send_lag_s,
    }


def overload_run(plan: GearPlan, loaders: dict, sample: object, qps: float, seconds: float,
                 seed: int, reporter: Reporter, **options: object) -> tuple[Replay, float]:
    trace = poisson_trace(qps, seconds, seed=seed)
    with Engine(plan, loaders, workers="process", **options) as engine:
        t0 = time.perf_counter()
        rep = replay(engine, trace, sample, seed=seed, reporter=reporter)
        wall = time.perf_counter() - t0
    return rep, wall


def sigkill_run(plan: GearPlan, loaders: dict, sample: object, qps: float, seconds: float,
                every_s: float, seed: int) -> dict:
    """Arrivals at ``qps`` while a worker is SIGKILLed every ``every_s`` seconds."""
    texts = list(sample.texts)
    rng = np.random.default_rng(seed)
    futures: list[Future] = []
    kills = []
    with Engine(plan, loaders, workers="process") as engine:
        devices = sorted(engine.pids())
        t0 = time.monotonic()
        next_kill = every_s
        i = 0
        while (now := time.monotonic() - t0) < seconds:
            if now >= next_kill:
                device = devices[len(kills) % len(devices)]
                pid = engine.pids()[device]
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    kills.append((round(now, 2), device))
                next_kill += every_s
            futures.append(engine.submit(texts[int(rng.integers(len(texts)))]))
            i += 1
            time.sleep(max(0.0, t0 + i / qps - time.monotonic()))
        done_by = time.monotonic() + 120.0
        while not all(f.done() for f in futures) and time.monotonic() < done_by:
            time.sleep(0.05)
        lost = sum(not f.done() for f in futures)
        restarts, attempts = engine.worker_restarts, engine.failed_attempts
    outcomes = [f.result() for f in futures if f.done()]
    status: dict[str, int] = {}
    for o in outcomes:
        status[o.status] = status.get(o.status, 0) + 1
    return {"requests": len(futures), "kills": kills, "lost": lost,
            "distinct_outcomes": len({o.request_id for o in outcomes}), "status": status,
            "worker_restarts": restarts, "failed_attempts": attempts,
            "errors": sorted({o.error for o in outcomes if o.error})[:3]}


# -- stand-in faults ---------------------------------------------------------------------------


def stand_in_plan(model: str, min_queue: int = 1) -> GearPlan:
    """``model`` alone on cpu0, profiled at 10 ms a batch of up to 4 rows (deadline: the
    2 s floor)."""
    return GearPlan("op", (0.0, 1e6), (Cascade((model,)),), (Replica(model, ("cpu0",)),),
                    (RangeSchedule(0, (1.0,), (min_queue,)),), (4,), max_wait_s=0.005,
                    predicted=PlanMetrics(1.0, 25.0, 45.0, 50.0, 25.0, 1000, 0, 10.0),
                    batch_runtime_s=((0.01,) * 4,))


def replicas_sigkill_run(qps: float, seconds: float, every_s: float, seed: int) -> dict:
    """``sigkill_run`` on stand-ins: ``SlowModel`` a (10 ms a batch of <= 4 rows) on two
    replicas, cpu0 and cpu1, in worker processes (target 50 ms): how much of the offered load
    admission turns away while a killed worker reloads (admission across replicas)."""
    plan = GearPlan("op", (0.0, 1e6), (Cascade(("a",)),),
                    (Replica("a", ("cpu0",)), Replica("a", ("cpu1",))),
                    (RangeSchedule(0, (0.5, 0.5), (1, 1)),), (4, 4), max_wait_s=0.005,
                    predicted=PlanMetrics(1.0, 25.0, 45.0, 50.0, 25.0, 1000, 0, 10.0),
                    batch_runtime_s=((0.01,) * 4, (0.01,) * 4))
    sample = SimpleNamespace(texts=[f"row {i}" for i in range(500)])
    out = sigkill_run(plan, {"a": functools.partial(fakes.SlowModel, "a", 0.01)}, sample,
                      qps, seconds, every_s, seed)
    out["rejected_share"] = out["status"].get("rejected", 0) / out["requests"]
    return out


def stuck_runs(tmp: Path) -> dict:
    flag = tmp / "hung-once"
    flag.unlink(missing_ok=True)
    once = {"a": functools.partial(fakes.HangingModel, "a", flag=str(flag))}
    with Engine(stand_in_plan("a", min_queue=4), once) as engine:
        deadline_s = engine.deadline.seconds(0.01)
        t0 = time.monotonic()
        outcomes = [f.result(timeout=120) for f in [engine.submit(f"row {i}")
                                                    for i in range(4)]]
        retried_s = time.monotonic() - t0
        assert {o.status for o in outcomes} == {"ok"}, outcomes
    always = {"a": functools.partial(fakes.HangingModel, "a")}
    with Engine(stand_in_plan("a", min_queue=4), always) as engine:
        t0 = time.monotonic()
        outcomes = [f.result(timeout=120) for f in [engine.submit(f"row {i}")
                                                    for i in range(4)]]
        error_s = time.monotonic() - t0
        error = outcomes[0].error
        assert {o.status for o in outcomes} == {"error"}, outcomes
    return {"deadline_s": deadline_s, "stuck_once_answered_by_retry_s": retried_s,
            "stuck_for_ever_error_s": error_s, "error": error}


def failure_timings(submit: Callable[[str], Future], rows: int = 12) -> dict:
    """Submit ``rows`` requests to a model that always fails: seconds to the first error and
    to the last, then how long one more request takes to fail (once the model is marked
    failed)."""
    t0 = time.monotonic()
    futures = [submit(f"row {i}") for i in range(rows)]
    first = futures[0].result(timeout=120)
    first_s = time.monotonic() - t0
    outcomes = [f.result(timeout=120) for f in futures]
    all_s = time.monotonic() - t0
    t1 = time.monotonic()
    late = submit("after it was marked failed").result(timeout=120)
    late_s = time.monotonic() - t1
    return {"first_error_s": first_s, "all_errors_s": all_s, "rows": len(outcomes),
            "status": sorted({o.status for o in outcomes}),
            "later_request_error_ms": 1000 * late_s, "late_status": late.status,
            "first_error": first.error, "marked_failed": late.error}


def crash_run() -> dict:
    sources = {"a": functools.partial(fakes.CrashingModel, "a")}
    with Engine(stand_in_plan("a"), sources) as engine:
        out = failure_timings(engine.submit)
        out["worker_restarts"] = engine.worker_restarts
    return out


SERVER = """
import functools, sys, threading, time
sys.path.insert(0, {tests!r})
import fakes
from ken.engine.serving import Engine
from ken.models.cascade import Cascade
from ken.policy.plan import GearPlan, RangeSchedule, Replica

plan = GearPlan("op", (0.0, 1e6), (Cascade(("a",)),), (Replica("a", ("cpu0",)),),
                (RangeSchedule(0, (1.0,), (1,)),), (4,), max_wait_s=0.005)
lock = threading.Lock()

def report(i, future):
    with lock:
        print(f"outcome {{i}} {{future.result().status}}", flush=True)

engine = Engine(plan, {{"a": functools.partial(fakes.SlowModel, "a", 0.05)}})
engine.start()
print("ready", flush=True)
i = 0
while True:
    future = engine.submit(f"row {{i}}")
    future.add_done_callback(functools.partial(report, i))
    with lock:
        print(f"sent {{i}}", flush=True)
    i += 1
    time.sleep(0.01)
"""


def sigterm_run(after_s: float, server: str = SERVER) -> dict:
    """SIGTERM to ``server`` (a program that prints what it sends and each outcome) after
    ``after_s`` seconds of serving."""
    proc = subprocess.Popen([sys.executable, "-c", server.format(tests=str(TESTS))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lines = [proc.stdout.readline()]
    t0 = time.monotonic()
    while time.monotonic() - t0 < after_s:
        lines.append(proc.stdout.readline())
    sent_before = sum(line.startswith("sent") for line in lines)
    proc.send_signal(signal.SIGTERM)
    t1 = time.monotonic()
    out, err = proc.communicate(timeout=120)
    exit_s = time.monotonic() - t1
    lines += out.splitlines()
    sent = [int(w[1]) for line in lines if len(w := line.split()) == 2 and w[0] == "sent"]
    outcomes: dict[int, list[str]] = {}
    for line in lines:
        w = line.split()
        if len(w) == 3 and w[0] == "outcome":
            outcomes.setdefault(int(w[1]), []).append(w[2])
    status: dict[str, int] = {}
    for s in outcomes.values():
        status[s[0]] = status.get(s[0], 0) + 1
    return {"sent": len(sent), "sent_before_sigterm": sent_before,
            "lost": sum(i not in outcomes for i in sent),
            "duplicated": sum(len(s) > 1 for s in outcomes.values()),
            "sent_before_and_answered_ok": sum(outcomes.get(i) == ["ok"]
                                               for i in sent[:sent_before]),
            "status": status, "exit_status": proc.returncode, "sigterm_to_exit_s": exit_s,
            "tracebacks": err.count("Traceback")}


# -- a generating function (decode server) ------------------------------------------------------


def decode_peak(cost: object, prompts: list, max_new: np.ndarray, max_running: int,
                seed: int) -> tuple[float, float]:
    """The rate at which the decode server is 80% busy on these requests, and the p99 the
    decode simulator predicts there (the latency target, as a plan's predicted p99 is):
    bisection on Poisson arrivals over 60 s, passes timed by the model's token cost."""
    from ken.optimizer.decode_sim import simulate_decoding

    def run(rate: float):  # noqa: ANN202
        arrivals = poisson_trace(rate, 60.0, seed=seed).arrival_s
        n = arrivals.size
        rows = np.arange(n) % len(prompts)
        return simulate_decoding(cost, arrivals, [len(prompts[r]) for r in rows],  # type: ignore[arg-type]
                                 max_new[rows], max_running), arrivals

    lo, hi = 0.1, 200.0
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        sim, arrivals = run(mid)
        busy = sim.busy_s / max(float(sim.completion_s.max() - arrivals[0]), 1e-9)
        lo, hi = (mid, hi) if busy < 0.8 else (lo, mid)
    sim, arrivals = run(lo)
    return lo, float(np.percentile(sim.completion_s - arrivals, 99))


def paced(server: object, qps: float, seconds: float, prompts: list, max_new: np.ndarray,
          seed: int) -> tuple[list[Future], float]:
    """Submit Poisson arrivals at ``qps`` for ``seconds`` (prompts in turn); the futures and
    the send time."""
    arrivals = poisson_trace(qps, seconds, seed=seed).arrival_s
    futures = []
    t0 = time.monotonic()
    for i, t in enumerate(arrivals):
        delay = float(t) - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)
        futures.append(server.submit(prompts[i % len(prompts)],  # type: ignore[attr-defined]
                                     int(max_new[i % len(prompts)])))
    return futures, time.monotonic() - t0


def decode_overload(lm: object, cost: object, target_s: float, qps: float, seconds: float,
                    prompts: list, max_new: np.ndarray, seed: int, admission: str) -> dict:
    """SmolLM2 on a decode server flooded at ``qps``; with ``admission="none"`` the requests
    left 30 s after the last arrival are cancelled (the queue would take minutes)."""
    from ken.engine.decode import DecodeServer

    server = DecodeServer(lm, 4, ignore_eos=True, pass_cost=cost,  # type: ignore[arg-type]
                          latency_target_s=target_s, admission=admission).start()  # type: ignore[arg-type]
    futures, wall = paced(server, qps, seconds, prompts, max_new, seed)
    done_by = time.monotonic() + 30.0
    while time.monotonic() < done_by and not all(f.done() for f in futures):
        time.sleep(0.1)
    cancelled = server.shutdown(drain=False)
    outcomes = [f.result(timeout=60) for f in futures]
    status = {s: sum(o.status == s for o in outcomes) for s in sorted({o.status
                                                                      for o in outcomes})}
    row = outcome_summary(outcomes, status, target_s, wall, None)
    row.update(cancelled_after_30s=cancelled, lost=len(futures) - len(
        {o.request_id for o in outcomes}), admission=admission, offered_qps=qps)
    return row


def decode_faults() -> dict:
    """Stand-in LMs (``tests/fakes.py``): every pass raises (time to the first and the last
    error of 12 requests; a later request), and a model that answered and then hangs (time
    until its request's error, by the default pass deadline)."""
    from ken.engine.decode import CascadeServer

    lm = fakes.GatedLM()
    lm.gate.set()

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("an illegal memory access")

    lm.net.forward = broken
    with CascadeServer({"g": fakes.StandInGenerator(lm)}, fakes.gen_plan()) as server:
        crash = failure_timings(server.submit_row)
    lm = fakes.GatedLM()
    lm.gate.set()
    server = CascadeServer({"g": fakes.StandInGenerator(lm)}, fakes.gen_plan()).start()
    try:
        for i in range(6):
            server.submit_row(f"row {i}").result(timeout=60)
        lm.gate.clear()
        t0 = time.monotonic()
        stuck = server.submit_row("this one hangs").result(timeout=120)
        stuck_s = time.monotonic() - t0
    finally:
        lm.gate.set()
    return {"crash": crash, "stuck": {"error_s": stuck_s, "status": stuck.status,
                                      "error": stuck.error}}


GEN_SERVER = """
import functools, os, signal, sys, threading, time
from types import SimpleNamespace
sys.path.insert(0, {tests!r})
import fakes
from ken.engine.manager import ServingManager
from ken.ops.base import OpContext

lm = fakes.GatedLM()
lm.gate.set()
inner = lm.net.forward

def slow(*args, **kwargs):
    time.sleep(0.004)
    return inner(*args, **kwargs)

lm.net.forward = slow
model = fakes.StandInGenerator(lm)
manager = ServingManager({{"gen": SimpleNamespace(eval_constants=())}}, OpContext(),
                         lambda name, constants: SimpleNamespace(models={{"g": model}}))
manager.set_plan("gen", fakes.gen_plan())
manager.serve()
engine = manager.engine_for("gen", ())
lock = threading.Lock()

def report(i, future):
    with lock:
        print(f"outcome {{i}} {{future.result().status}}", flush=True)

print("ready", flush=True)
i = 0
while True:
    future = engine.submit_many([f"row {{i}}"])[0]
    future.add_done_callback(functools.partial(report, i))
    with lock:
        print(f"sent {{i}}", flush=True)
    i += 1
    time.sleep(0.01)
"""


def generation_runs(overload: float, seconds: float, seed: int, reporter: Reporter) -> dict:
    """Overload, SIGTERM, stuck and crash for a generating function (issue 38)."""
    from ken.ops.base import shared_resources
    from ken.optimizer.tokens import load_or_measure_token_cost, random_prompts
    from ken.session import connect

    out: dict = {}
    faults = decode_faults()
    out.update(faults)
    reporter.note(f"generating, every pass fails: first error after "
                  f"{faults['crash']['first_error_s']:.2f} s, all 12 after "
                  f"{faults['crash']['all_errors_s']:.2f} s, later requests in "
                  f"{faults['crash']['later_request_error_ms']:.1f} ms; a pass that hangs: "
                  f"error after {faults['stuck']['error_s']:.2f} s")
    out["sigterm"] = sigterm_run(3.0, GEN_SERVER)
    reporter.note(f"generating, SIGTERM: {out['sigterm']['sent']} sent, "
                  f"{out['sigterm']['lost']} lost, status {out['sigterm']['status']}, exit "
                  f"{out['sigterm']['exit_status']} after {out['sigterm']['sigterm_to_exit_s']:.2f}"
                  " s")
    with connect(device=DeviceConfig(threads=1)) as session:
        lm = shared_resources(session.ctx).causal_lm("smollm2-135m")
    cost = load_or_measure_token_cost(lm, "smollm2-135m", reporter=reporter)
    rng = np.random.default_rng(seed)
    prompts = [random_prompts(lm, 1, int(k), rng)[0] for k in rng.integers(16, 64, 64)]
    max_new = rng.integers(4, 12, len(prompts))
    peak, target_s = decode_peak(cost, prompts, max_new, 4, seed)
    out["decode_plan"] = {"model": "smollm2-135m", "max_running": 4, "peak_qps": peak,
                          "latency_target_ms": 1000 * target_s}
    reporter.note(f"generating: SmolLM2-135M, 4 rows a pass, 80% busy at {peak:.1f} qps "
                  f"(token cost), simulated p99 there (the target) {1000 * target_s:.0f} ms")
    out["overload"] = {}
    for admission in ("target", "none"):
        row = decode_overload(lm, cost, target_s, overload * peak, seconds, prompts, max_new,
                              seed, admission)
        out["overload"][admission] = row
        reporter.note(f"  {overload:g}x overload, admission={admission}: admitted p99 "
                      f"{row['admitted_p99_ms']:.0f} ms ({row['admitted_p99_over_target']:.2f}x"
                      f"), rejected {row['rejected_share']:.1%}, cancelled after 30 s "
                      f"{row['cancelled_after_30s']}, lost {row['lost']}")
    return out


# -- plot --------------------------------------------------------------------------------------


def plot(runs: dict[str, Replay], target_ms: float, faults: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (name, rep), color in zip(runs.items(), ("tab:blue", "tab:red"), strict=False):
        ok = [o for o in rep.outcomes if o.status == "ok"]
        t0 = min(o.arrival_s for o in rep.outcomes)
        ax.scatter([o.arrival_s - t0 for o in ok], [1000 * o.latency_s for o in ok], s=2,
                   alpha=0.4, color=color, label=name)
    ax.axhline(target_ms, color="black", lw=1, ls="--", label=f"target {target_ms:.0f} ms")
    ax.axhline(2 * target_ms, color="gray", lw=1, ls=":", label="2x target")
    ax.set_yscale("log")
    ax.set_xlabel("arrival (s)")
    ax.set_ylabel("admitted latency (ms)")
    ax.set_title("10x the plan's peak rate", fontsize=10)
    ax.legend(fontsize=7, markerscale=4)
    names = list(faults)
    ax2.barh(names, [faults[n][0] for n in names], color="tab:green")
    for i, n in enumerate(names):
        goal = faults[n][1]
        if goal is not None:
            ax2.plot([goal, goal], [i - 0.4, i + 0.4], color="black", lw=1.5)
        ax2.annotate(f"{faults[n][0]:.2f} s", (faults[n][0], i), fontsize=7,
                     xytext=(3, -3), textcoords="offset points")
    ax2.set_xlabel("seconds (black: goal)")
    ax2.set_title("time to retry or error", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--overload", type=float, default=10.0,
                    help="offered rate over the plan's peak rate (default 10)")
    ap.add_argument("--overload-s", type=float, default=15.0)
    ap.add_argument("--kill-s", type=float, default=20.0)
    ap.add_argument("--kill-every-s", type=float, default=4.0)
    ap.add_argument("--plan-s", type=float, default=60.0, help="planning trace (s)")
    ap.add_argument("--ranges", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--generation-only", action="store_true",
                    help="only a generating function's overload, SIGTERM, stuck and crash "
                         "runs (~2 minutes; written to generation.json)")
    ap.add_argument("--replicas-only", action="store_true",
                    help="only the SIGKILL run on two stand-in replicas at 300 qps for 16 s "
                         "(~20 s; printed, nothing written)")
    args = ap.parse_args()
    reporter = Reporter(args.quiet)
    if args.replicas_only:
        run = replicas_sigkill_run(300.0, 16.0, args.kill_every_s, args.seed)
        print(json.dumps({k: run[k] for k in ("requests", "kills", "lost", "status",
                                              "worker_restarts", "rejected_share")}))
        return 0
    started = time.perf_counter()
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    reporter.note("a generating function (decode server)")
    out["generation"] = generation_runs(args.overload, args.overload_s, args.seed, reporter)
    if args.generation_only:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "generation.json").write_text(json.dumps(out, indent=1, default=float))
        reporter.note(f"wrote {args.out / 'generation.json'} "
                      f"({time.perf_counter() - started:.0f} s)")
        return 0

    # the faults on stand-in models first: they need no models and take a minute
    reporter.note("stuck batches (stand-in model, default deadline)")
    with tempfile.TemporaryDirectory() as tmp:
        out["stuck"] = stuck_runs(Path(tmp))
    reporter.note(f"  stuck once: answered by the retry after "
                  f"{out['stuck']['stuck_once_answered_by_retry_s']:.2f} s; stuck for ever: "
                  f"error after {out['stuck']['stuck_for_ever_error_s']:.2f} s (deadline "
                  f"{out['stuck']['deadline_s']:.1f} s)")
    out["crash"] = crash_run()
    reporter.note(f"always crashing model: first error after {out['crash']['first_error_s']:.2f}"
                  f" s, all 12 rows after {out['crash']['all_errors_s']:.2f} s, "
                  f"{out['crash']['worker_restarts']} restarts; later requests fail in "
                  f"{out['crash']['later_request_error_ms']:.1f} ms")
    out["sigterm"] = sigterm_run(3.0)
    reporter.note(f"SIGTERM: {out['sigterm']['sent']} sent, {out['sigterm']['lost']} lost, "
                  f"status {out['sigterm']['status']}, exit {out['sigterm']['exit_status']}")

    data, cards, sample, profiles = family_profiles(reporter)
    device = DeviceConfig(threads=1)
    catalog, cascades = planning_inputs(profiles)
    peak = default_peak_qps(catalog, cascades, 2)
    trace = planning_trace("poisson", peak, args.plan_s, seed=args.seed)
    frontier, _ = plan_frontier("sentiment", cascades, catalog,
                                Hardware.cpu_workers(2, 4 * 2**30), trace,
                                settings=PlannerSettings(num_ranges=args.ranges,
                                                         seed=args.seed), reporter=reporter)
    usable = [p for p in frontier.plans if p.predicted.p95_ms < 1000.0]
    plan = usable[len(usable) // 2]
    target_s = plan.latency_target_s()
    assert plan.batch_runtime_s and target_s is not None
    loaders = {c.name: functools.partial(family.load_model, c, device, None, data)
               for c in cards if c.name in {r.model for r in plan.placement}}
    out["plan"] = {"gears": [f"{lo:g}-{hi:g} qps: {plan.cascades[c].describe()}"
                             for lo, hi, c in plan.gears()],
                   "placement": [r.label() for r in plan.placement],
                   "peak_qps": plan.qps_max, "predicted": plan.predicted.to_dict(),
                   "latency_target_ms": 1000 * target_s}
    reporter.note(f"plan: {'; '.join(out['plan']['gears'])} on "
                  f"{', '.join(out['plan']['placement'])}; predicted p99 (the target) "
                  f"{1000 * target_s:.0f} ms at up to {plan.qps_max:g} qps")

    qps = args.overload * plan.qps_max
    runs: dict[str, Replay] = {}
    out["overload"] = {"offered_qps": qps}
    for name, options in (("admission sized to the plan (default)", {}),
                          ("max_in_flight=10000 (old default)",
                           {"admission": "max_in_flight", "max_in_flight": 10_000})):
        reporter.note(f"overload, {name}: {qps:.0f} qps for {args.overload_s:g} s")
        rep, wall = overload_run(plan, loaders, sample, qps, args.overload_s, args.seed,
                                 reporter, **options)
        runs[name] = rep
        row = out["overload"][name] = summary(rep, target_s, wall)
        reporter.note(f"  admitted p50 {row['admitted_p50_ms']:.0f} ms, p99 "
                      f"{row['admitted_p99_ms']:.0f} ms ({row['admitted_p99_over_target']:.2f}x"
                      f" the target), rejected {row['rejected_share']:.1%}")

    reporter.note(f"worker SIGKILL every {args.kill_every_s:g} s at {plan.qps_max:g} qps")
    out["sigkill"] = sigkill_run(plan, loaders, sample, plan.qps_max, args.kill_s,
                                 args.kill_every_s, args.seed)
    reporter.note(f"  {out['sigkill']['requests']} requests, {len(out['sigkill']['kills'])} "
                  f"kills, {out['sigkill']['lost']} lost, status {out['sigkill']['status']}")

    out["goals"] = GOALS
    out["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reliability.json").write_text(json.dumps(out, indent=1, default=float))
    faults = {"stuck once -> answered by retry": (
                  out["stuck"]["stuck_once_answered_by_retry_s"], None),
              "stuck for ever -> error": (out["stuck"]["stuck_for_ever_error_s"], None),
              "always crashes -> first error": (out["crash"]["first_error_s"],
                                                GOALS["crash_error_s"]),
              "always crashes -> all 12 rows failed": (out["crash"]["all_errors_s"],
                                                       GOALS["crash_error_s"])}
    plot(runs, 1000 * target_s, faults, args.out / "reliability.png")
    reporter.note(f"wrote {args.out / 'reliability.json'} and reliability.png "
                  f"({out['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
