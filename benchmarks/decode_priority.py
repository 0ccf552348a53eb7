"""A classifier's tail beside a generating function on the same cores, with the decode server
at normal and at background CPU priority (issue 38: the soak's calm windows).

The soak's setup (``benchmarks/soak.py``): the packaged sentiment family planned for 2 CPU
workers x 1 thread on Poisson arrivals; ``--plan fast`` serves the fastest frontier plan
(the one whose target the soak misses beside a decode server), ``--plan main`` the middle one;
SmolLM2-135M on a decode server in this process, a short answer every ``--gen-every-s``. The
decode server's share of the cores is measured alone first (as the soak does), and the
classifier is offered Poisson arrivals at each ``--loads`` x the plan's peak on what the decode
server leaves. Each round serves, for ``--seconds`` each and in alternating order:

- ``none``: the classifier alone (no generations);
- ``normal``: with the generations, the decode server at normal priority (the default);
- ``background``: the same, ``cpu_priority="background"`` (its passes on spare cores only).

Per condition: the classifier's answered p50/p95/p99 and the requests turned away; the
generations' latency (arrival to last token) p50 and max. Medians over ``--rounds``.

    python benchmarks/decode_priority.py --out DIR                  # ~6 min
    python benchmarks/decode_priority.py --loads 0.8,1.2 --out DIR  # and past the peak
    python benchmarks/decode_priority.py --workers thread --out DIR # thread workers

The classifier's workers are processes unless ``--workers thread`` (threads in this process,
beside the decode server's pass thread: they need the GIL to run a batch).

Writes DIR/decode_priority.json and DIR/decode_priority.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from soak import decode_share, plans_to_serve  # noqa: E402 - the soak's setup

from ken.engine.decode import DecodeServer  # noqa: E402
from ken.engine.serving import Engine  # noqa: E402
from ken.models.model import DeviceConfig  # noqa: E402
from ken.ops.base import shared_resources  # noqa: E402
from ken.optimizer.tokens import random_prompts  # noqa: E402
from ken.progress import Reporter  # noqa: E402
from ken.session import connect  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "decode_priority"
CONDITIONS = ("none", "normal", "background")


def serve_condition(engine: Engine, servers: dict, condition: str, rate: float,
                    texts: list, prompts: list, args: argparse.Namespace,
                    rng: np.random.Generator) -> dict:
    """``args.seconds`` of Poisson classifier arrivals at ``rate``, with a generation every
    ``args.gen_every_s`` on the condition's decode server (none for ``none``)."""
    server = servers.get(condition)
    futures, gens = [], []
    t0 = time.monotonic()
    arrival = next_gen = 0.0
    while (now := time.monotonic() - t0) < args.seconds:
        if server is not None and now >= next_gen:
            gens.append(server.submit(prompts[int(rng.integers(len(prompts)))],
                                      int(rng.integers(4, 12))))
            next_gen += args.gen_every_s
        if now >= arrival:
            futures.append(engine.submit(texts[int(rng.integers(len(texts)))]))
            arrival += rng.exponential(1.0 / rate)
        until = min(arrival, next_gen) if server is not None else arrival
        time.sleep(max(0.0, until - (time.monotonic() - t0)))
    outcomes = [f.result() for f in futures]
    generated = [g.result() for g in gens]
    ms = [1000 * o.latency_s for o in outcomes if o.status == "ok"]
    gen_ms = [1000 * o.latency_s for o in generated if o.status == "ok"]
    return {"condition": condition, "requests": len(outcomes), "answered": len(ms),
            "turned_away": sum(o.status == "rejected" for o in outcomes),
            "other": sum(o.status not in ("ok", "rejected") for o in outcomes),
            "p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95)),
            "p99_ms": float(np.percentile(ms, 99)),
            "generations": len(generated), "generations_answered": len(gen_ms),
            "gen_p50_ms": float(np.percentile(gen_ms, 50)) if gen_ms else None,
            "gen_max_ms": max(gen_ms) if gen_ms else None}


def run(args: argparse.Namespace, reporter: Reporter) -> dict:
    main, fast, loaders, sample, _, _ = plans_to_serve(reporter, args.seed)
    plan = fast if args.plan == "fast" else main
    target_ms = 1000 * (plan.latency_target_s() or float("nan"))
    with connect(device=DeviceConfig(threads=1)) as session:
        lm = shared_resources(session.ctx).causal_lm("smollm2-135m")
    rng = np.random.default_rng(args.seed)
    prompts = [random_prompts(lm, 1, int(k), rng)[0] for k in rng.integers(16, 64, 32)]
    servers = {p: DecodeServer(lm, 4, ignore_eos=True, cpu_priority=p).start()
               for p in ("normal", "background")}
    try:
        for server in servers.values():  # the shapes of the first passes, off the clock
            for _ in range(args.warm_generations):
                server.submit(prompts[int(rng.integers(len(prompts)))],
                              int(rng.integers(4, 12))).result()
        share = decode_share(servers["normal"], prompts, args, rng)
        reporter.note(f"serving {plan.headline()}; target p99 {target_ms:.0f} ms; the decode "
                      f"server takes {share:.1%} of the plan's cores at one generation every "
                      f"{args.gen_every_s:g} s")
        texts = list(sample.texts)
        rows = []
        with Engine(plan, loaders, workers=args.workers, admission=args.admission) as engine:
            for _ in range(args.warm_requests):
                engine.submit(texts[0]).result()
            for load in args.loads:
                rate = load * plan.qps_max * (1.0 - share)
                for r in range(args.rounds):
                    order = CONDITIONS if r % 2 == 0 else CONDITIONS[::-1]
                    for condition in order:
                        row = serve_condition(engine, servers, condition, rate, texts,
                                              prompts, args, rng)
                        row.update(load=load, rate_qps=rate, round=r)
                        rows.append(row)
                        reporter.note(f"load {load:g} ({rate:.1f} qps) round {r} "
                                      f"{condition}: p99 {row['p99_ms']:.1f} ms, "
                                      f"generation p50 {row['gen_p50_ms'] or 0:.0f} ms")
    finally:
        for server in servers.values():
            server.shutdown()
    return {"args": {k: str(v) for k, v in vars(args).items()}, "plan": plan.headline(),
            "target_p99_ms": target_ms, "peak_qps": plan.qps_max, "decode_share": share,
            "rows": rows, "summary": summarise(rows, args.loads, target_ms)}


def summarise(rows: list[dict], loads: list[float], target_ms: float) -> list[dict]:
    """Medians over the rounds per load and condition, and the range of each."""
    out = []
    for load in loads:
        for condition in CONDITIONS:
            rs = [r for r in rows if r["load"] == load and r["condition"] == condition]
            entry: dict = {"load": load, "condition": condition, "rounds": len(rs)}
            for key in ("p50_ms", "p95_ms", "p99_ms", "gen_p50_ms", "gen_max_ms",
                        "turned_away", "requests"):
                vals = [r[key] for r in rs if r[key] is not None]
                entry[key] = float(np.median(vals)) if vals else None
                entry[f"{key}_range"] = [min(vals), max(vals)] if vals else None
            entry["p99_over_target"] = (entry["p99_ms"] / target_ms
                                        if entry["p99_ms"] is not None else None)
            out.append(entry)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r["load"] for r in result["rows"]})
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = {"none": "0.5", "normal": "tab:red", "background": "tab:blue"}
    for i, condition in enumerate(CONDITIONS):
        for j, load in enumerate(loads):
            rs = [r for r in result["rows"] if r["condition"] == condition and r["load"] == load]
            x = j + (i - 1) * 0.22
            ax[0].scatter([x] * len(rs), [r["p99_ms"] for r in rs], color=colors[condition],
                          label=condition if j == 0 else None)
            gen = [r["gen_p50_ms"] for r in rs if r["gen_p50_ms"] is not None]
            if gen:
                ax[1].scatter([x] * len(gen), gen, color=colors[condition],
                              label=condition if j == 0 else None)
    ax[0].axhline(result["target_p99_ms"], color="k", lw=0.8, label="the plan's target")
    ax[0].axhline(2 * result["target_p99_ms"], color="k", lw=0.8, ls="--", label="2x")
    ax[0].set_ylabel("classifier p99 (ms)")
    ax[1].set_ylabel("generation latency p50 (ms)")
    for a in ax:
        a.set_xticks(range(len(loads)), [f"{x:g}x" for x in loads])
        a.set_xlabel("load (x the plan's peak on the cores the decode server leaves)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"{result['plan']} ({result['args'].get('workers', 'process')} workers): a "
                 "decode server beside it at normal and at background priority", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", choices=("fast", "main"), default="fast")
    ap.add_argument("--loads", default="0.8",
                    help="comma-separated loads, x the plan's peak on what the decode "
                         "server leaves (default 0.8, the soak's)")
    ap.add_argument("--workers", choices=("process", "thread"), default="process",
                    help="the classifier's workers: processes (default), or threads in this "
                         "process beside the decode server (they need the GIL to run a batch)")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen-every-s", type=float, default=2.0)
    ap.add_argument("--admission", choices=("plan", "max_in_flight"), default="plan",
                    help="the classifier engine's admission (default plan, as the soak)")
    ap.add_argument("--warm-generations", type=int, default=30)
    ap.add_argument("--warm-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.loads = [float(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--loads must be comma-separated numbers, not {args.loads!r}")
    if not args.loads or any(x <= 0 for x in args.loads):
        ap.error("--loads needs at least one load, each > 0")
    if args.seconds <= 0 or args.rounds < 1 or args.gen_every_s <= 0:
        ap.error("--seconds and --gen-every-s must be > 0, --rounds >= 1")
    reporter = Reporter(args.quiet)
    started = time.perf_counter()
    result = run(args, reporter)
    result["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_priority.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "decode_priority.png")
    for s in result["summary"]:
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v)
                          for k, v in s.items() if not k.endswith("_range")}))
    print(f"wrote {args.out}/decode_priority.json and .png in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
