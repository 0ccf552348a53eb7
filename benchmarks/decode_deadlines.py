"""Deadline-aware decode batches (Apt-Serve's choice of joiners) against first come, first
served on ``sem_qa`` with SmolLM2-135M, and whether a hidden-state cache would pay here
(issue 37, item 3).

1. **Requests**: ``sem_qa(question, passage)`` on the first ``--rows`` HybridQA passage
   questions with the packaged SmolLM2-135M: each row's prompt tokens and the forward passes
   of its answer (the model answers each row once; cached in ``--out``).
2. **Token cost**: SmolLM2's prefill and decode passes timed on this machine and fitted
   (``ken.optimizer.tokens``; grid up to 512 prompt tokens, cached under KEN_HOME).
3. **Bursty arrivals**: windows of the Azure LLM code trace (one replay per ``--windows``
   start minute, ``--window-s`` long), each thinned at random to ``--requests`` arrivals and
   stretched so that its mean rate is ``load`` x the rate SmolLM2 sustains with FCFS
   continuous batching (found by simulation, all requests at once); the trace's bursts keep
   their shape. Each arrival asks for a random row.
4. **Simulated sweep**: at each of ``--loads``, every replay served by the decode simulator
   (same ``DecodeScheduler`` as the engine, passes timed by the token cost) with FCFS and with
   the deadline order, targets ``--ttft-s`` and ``--tbt-s`` (TGT target: TTFT target + TBT
   target per further token). Reported per point: median and min-max over the replays of
   goodput (share of requests meeting both), TTFT-only share, TTFT p95 and TGT p95.
5. **Engine**: ``--engine-replays`` of the ``--engine-load`` point replayed through the
   engine's ``DecodeServer`` (wall clock, real passes, answers run to their recorded length)
   in both orders, against the simulator on the same arrivals.
6. **Ablation**: the simulated sweep of the deadline order with its prefill cut
   (``trim_joiners``) or its decode-first check switched off (patched for the measurement).
7. **Hidden-state cache**: SmolLM2's KV bytes per token against a hidden-state cache's
   (Apt-Serve stores each layer's input hidden vector instead of its keys and values), the
   largest KV cache the runs could hold against this machine's memory, and the decode
   throughput the cost model gives for larger batches (what more rows in the same memory
   would buy).

Writes ``--out``/decode_deadlines.json and decode_deadlines.png.

    python benchmarks/decode_deadlines.py --out benchmarks/results/decode_deadlines
    # 2.6 min on 2 cores with the answers and the token cost cached; the first run answers
    # the 64 rows and times the passes first (about 4 min more while another job ran)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "decode_deadlines"
MODEL = "smollm2-135m"
ORDERS = ("fcfs", "deadline")


def spread(values: list[float]) -> dict[str, float]:
    """Median and range of a point's replays."""
    a = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max())}


def run_row(run, targets, requests: int) -> dict[str, float]:  # noqa: ANN001
    """What one replay found (``run``: a ``DecodeRun``)."""
    m = run.metrics()
    ttft_ok = (run.first_token_s - run.arrival_s) <= targets.ttft_s
    return {"goodput": run.goodput(targets, requests), "ttft_met": float(ttft_ok.sum() / requests),
            "ttft_p95_s": m.ttft_p95_ms / 1000, "tgt_p95_s": m.tgt_p95_ms / 1000,
            "finished": int(run.arrival_s.size)}


def summarise(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {k: spread([r[k] for r in rows]) for k in ("goodput", "ttft_met", "ttft_p95_s",
                                                       "tgt_p95_s")}


def sem_qa_rows(args: argparse.Namespace, reporter):  # noqa: ANN001, ANN201
    """The SmolLM2 ``sem_qa`` stage, its prompts (token ids) and each row's answer passes."""
    from ken.models.model import DeviceConfig
    from ken.models.resources import Resources
    from ken.ops.base import OpContext
    from ken.ops.sem_qa import SemQA
    from ken.optimizer.gen_planner import answer_sample

    device = DeviceConfig(threads=args.threads)
    op = SemQA()
    sample = op.eval_sample(OpContext(device, reporter=reporter))
    if sample is None:
        raise SystemExit("HybridQA is not in the shared data folder")
    sample = sample.subset(range(min(args.rows, len(sample))))
    model = op.stage(Resources(device), MODEL, ())
    prompts = model.requests(sample.texts)
    cache = args.out / f"rows-{model.name}-{len(sample)}.json"
    if cache.is_file():
        outputs = np.array(json.loads(cache.read_text())["output_tokens"])
    else:
        reporter.note(f"answering {len(sample)} sem_qa rows with {MODEL} (once, cached)...")
        stage, _ = answer_sample(model, sample, args.max_running)
        outputs = stage.output_tokens
        cache.write_text(json.dumps({"output_tokens": outputs.tolist()}))
    return model, prompts, outputs


def arrivals_for(trace_s: np.ndarray, minute: float, window_s: float, requests: int,
                 span_s: float, seed: int) -> np.ndarray:
    from ken.optimizer.gen_planner import trace_window

    return trace_window(trace_s, minute * 60.0, window_s, requests, span_s,
                        np.random.default_rng(seed))


def ablate(loads: list[float], deadline_run) -> list[dict]:  # noqa: ANN001
    """The deadline order with one of its steps switched off, for measurement only: the
    prefill never cut (``trim_joiners`` keeps every joiner), or never deferred for the running
    requests (``_decode_first`` always False)."""
    from unittest import mock

    from ken.policy import decoding

    def keep_all(joiners, cost, now):  # noqa: ANN001, ANN202
        return tuple(c.request_id for c in joiners)

    out = []
    for load in loads:
        row: dict = {"load": load}
        with mock.patch.object(decoding, "trim_joiners", keep_all):
            row["no_trim"] = deadline_run(load)
        with mock.patch.object(decoding.DecodeScheduler, "_decode_first",
                               lambda self, join, now: False):
            row["no_decode_first"] = deadline_run(load)
        out.append(row)
    return out


def hidden_cache_case(lm, cost, prompts: np.ndarray, outputs: np.ndarray,  # noqa: ANN001
                      max_running: int) -> dict:
    """Would Apt-Serve's hidden-state cache pay for SmolLM2 on this machine?"""
    from ken.optimizer.tokens import kv_bytes_per_token

    cfg = lm.net.config
    itemsize = next(lm.net.parameters()).element_size()
    kv = kv_bytes_per_token(lm)
    hidden = int(cfg.num_hidden_layers) * int(cfg.hidden_size) * itemsize
    longest = int((prompts + outputs).max())
    peak_kv = max_running * longest * kv  # padded cache, every row as long as the longest
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    width = int(np.median(prompts + outputs))
    throughput = {str(b): b / cost.decode_s(b, width) for b in (1, 4, 8, 16, 32)}
    return {
        "kv_bytes_per_token": kv, "hidden_bytes_per_token": hidden,
        "hidden_over_kv": hidden / kv,
        "layers": int(cfg.num_hidden_layers), "hidden_size": int(cfg.hidden_size),
        "attention_heads": int(cfg.num_attention_heads),
        "kv_heads": int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        "longest_request_tokens": longest, "max_running": max_running,
        "peak_kv_bytes": peak_kv, "weights_bytes": cost.weights_bytes,
        "machine_memory_bytes": memory, "peak_kv_share_of_memory": peak_kv / memory,
        "rows_memory_would_hold": int((memory - cost.weights_bytes) // (longest * kv)),
        "decode_tokens_per_s_by_batch": throughput, "decode_width_tokens": width,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the device")
    ap.add_argument("--requests", type=int, default=80, help="arrivals per simulated replay")
    ap.add_argument("--windows", default="5,10,20,30,50",
                    help="trace minutes the replays start at (one replay each, >= 3)")
    ap.add_argument("--window-s", type=float, default=180.0,
                    help="seconds of trace per replay (thinned to --requests arrivals)")
    ap.add_argument("--loads", default="0.4,0.7,1.0",
                    help="mean rates as a share of the rate FCFS sustains")
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--ttft-s", type=float, default=8.0, help="TTFT target (seconds)")
    ap.add_argument("--tbt-s", type=float, default=0.5,
                    help="time-between-tokens target (seconds per further token)")
    ap.add_argument("--engine-load", type=float, default=1.4)
    ap.add_argument("--engine-replays", type=int, default=3, help="0: simulation only")
    ap.add_argument("--engine-requests", type=int, default=20)
    args = ap.parse_args(argv)
    try:
        windows = [float(w) for w in args.windows.split(",") if w.strip()]
        loads = [float(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        ap.error("--windows and --loads take comma-separated numbers")
    if len(windows) < 3 or not loads or min(loads) <= 0:
        ap.error("give >= 3 --windows and positive --loads")
    if args.rows < 4 or args.requests < 2 or args.threads < 1 or args.max_running < 1:
        ap.error("--rows >= 4, --requests >= 2, --threads >= 1, --max-running >= 1")
    if args.engine_replays and not (1 <= args.engine_replays <= len(windows)
                                    and args.engine_requests >= 2 and args.engine_load > 0):
        ap.error("--engine-replays at most one per window, --engine-requests >= 2")

    from ken.engine.decode import DecodeServer, as_run, replay
    from ken.errors import KenError
    from ken.optimizer.decode_sim import simulate_decoding
    from ken.optimizer.tokens import load_or_measure_token_cost
    from ken.optimizer.workload import load_azure_trace
    from ken.policy.decoding import ServiceTargets
    from ken.progress import Reporter

    reporter = Reporter()
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        targets = ServiceTargets(args.ttft_s, args.tbt_s)
    except KenError as exc:
        ap.error(str(exc))
    model, token_prompts, outputs = sem_qa_rows(args, reporter)
    lm = model.lm
    prompts = np.array([len(p) for p in token_prompts])
    cost = load_or_measure_token_cost(lm, MODEL, lengths=(32, 128, 256, 512), reporter=reporter)
    all_at_once = simulate_decoding(cost, np.zeros(prompts.size), prompts, outputs,
                                    args.max_running)
    rate = prompts.size / float(all_at_once.completion_s.max())
    trace_s = load_azure_trace().arrival_s
    reporter.note(f"{MODEL} on sem_qa: prompts median {np.median(prompts):.0f} tokens (max "
                  f"{prompts.max()}), answers median {np.median(outputs):.0f} passes; "
                  f"FCFS sustains ~{rate:.2f} req/s; targets TTFT {targets.ttft_s:g} s, TBT "
                  f"{targets.tbt_s:g} s")

    def trace_for(k: int, load: float, requests: int) -> tuple[np.ndarray, np.ndarray]:
        t = arrivals_for(trace_s, windows[k], args.window_s, requests,
                         requests / (load * rate), seed=k)
        rows = np.random.default_rng(100 + k).integers(0, prompts.size, requests)
        return t, rows

    def simulated(load: float, order: str, max_running: int) -> dict:
        runs = []
        for k in range(len(windows)):
            t, rows = trace_for(k, load, args.requests)
            run = simulate_decoding(cost, t, prompts[rows], outputs[rows], max_running,
                                    order=order, targets=targets)  # type: ignore[arg-type]
            runs.append(run_row(run, targets, args.requests))
        return {"replays": runs, **summarise(runs)}

    sweep = []
    for load in loads:
        point: dict = {"load": load, "qps": load * rate}
        for order in ORDERS:
            point[order] = simulated(load, order, args.max_running)
            # what twice the rows per pass would give (the most a hidden-state cache could
            # add on a model whose hidden state is half its KV; here memory does not bind)
            point[f"{order}_x2_rows"] = simulated(load, order, 2 * args.max_running)
        sweep.append(point)
        reporter.note(f"  load {load:g}x ({load * rate:.2f} req/s): goodput FCFS "
                      f"{point['fcfs']['goodput']['median']:.0%}, deadline "
                      f"{point['deadline']['goodput']['median']:.0%}; TTFT p95 "
                      f"{point['fcfs']['ttft_p95_s']['median']:.1f} vs "
                      f"{point['deadline']['ttft_p95_s']['median']:.1f} s; with "
                      f"{2 * args.max_running} rows per pass: "
                      f"{point['fcfs_x2_rows']['goodput']['median']:.0%} and "
                      f"{point['deadline_x2_rows']['goodput']['median']:.0%}")

    ablation = ablate(loads, lambda load: simulated(load, "deadline", args.max_running))
    reporter.note("  deadline order without cutting prefills / without decoding first: " + ", "
                  .join(f"{a['load']:g}x {a['no_trim']['goodput']['median']:.0%} / "
                        f"{a['no_decode_first']['goodput']['median']:.0%}" for a in ablation))

    engine: dict = {}
    if args.engine_replays:
        n = args.engine_requests
        for order in ORDERS:
            measured, simulated = [], []
            for k in range(args.engine_replays):
                t, rows = trace_for(k, args.engine_load, n)
                reporter.note(f"  engine, {order}, replay {k + 1}/{args.engine_replays} "
                              f"({t[-1]:.0f} s of arrivals)...")
                server = DecodeServer(lm, args.max_running, ignore_eos=True, order=order,
                                      targets=targets, pass_cost=cost).start()
                outcomes = replay(server, t, [token_prompts[r] for r in rows], outputs[rows])
                server.shutdown()
                run = as_run(outcomes, server.passes, server.prefill_passes, server.busy_s)
                measured.append(run_row(run, targets, n))
                sim = simulate_decoding(cost, t, prompts[rows], outputs[rows],
                                        args.max_running, order=order, targets=targets)
                simulated.append(run_row(sim, targets, n))
            engine[order] = {"measured": {"replays": measured, **summarise(measured)},
                             "simulated": {"replays": simulated, **summarise(simulated)}}
            reporter.note(f"  engine {order}: goodput "
                          f"{engine[order]['measured']['goodput']['median']:.0%} measured, "
                          f"{engine[order]['simulated']['goodput']['median']:.0%} simulated")

    hidden = hidden_cache_case(lm, cost, prompts, outputs, args.max_running)
    result = {
        "setup": {k: str(v) for k, v in vars(args).items()},
        "model": MODEL, "operator": "sem_qa", "rows": int(prompts.size),
        "prompt_tokens": {"median": float(np.median(prompts)), "max": int(prompts.max())},
        "answer_passes": {"median": float(np.median(outputs)), "max": int(outputs.max())},
        "token_cost": json.loads(cost.to_json()), "fcfs_sustained_qps": rate,
        "targets": {"ttft_s": targets.ttft_s, "tbt_s": targets.tbt_s},
        "sweep": sweep, "ablation": ablation, "engine": engine, "hidden_cache": hidden,
        "wall_s": time.perf_counter() - started,
    }
    (args.out / "decode_deadlines.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "decode_deadlines.png")
    reporter.note(f"hidden-state cache: {hidden['hidden_bytes_per_token']} B/token against "
                  f"{hidden['kv_bytes_per_token']} B/token of KV ({hidden['hidden_over_kv']:.2f}x);"
                  f" peak KV {hidden['peak_kv_bytes'] / 2**20:.0f} MiB of "
                  f"{hidden['machine_memory_bytes'] / 2**30:.0f} GiB")
    reporter.note(f"wrote {args.out}/decode_deadlines.json and decode_deadlines.png in "
                  f"{result['wall_s'] / 60:.1f} min")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = [p["qps"] for p in result["sweep"]]
    colours = {"fcfs": "tab:red", "deadline": "tab:blue"}
    for order in ORDERS:
        for ax, key, scale in ((axes[0], "goodput", 100.0), (axes[1], "ttft_p95_s", 1.0)):
            med = [p[order][key]["median"] * scale for p in result["sweep"]]
            lo = [p[order][key]["min"] * scale for p in result["sweep"]]
            hi = [p[order][key]["max"] * scale for p in result["sweep"]]
            ax.plot(x, med, "o-", color=colours[order], label=f"{order} (simulated)")
            ax.fill_between(x, lo, hi, color=colours[order], alpha=0.15)
            eng = result["engine"].get(order)
            if eng:
                m = eng["measured"][key]
                qps = float(result["setup"]["engine_load"]) * result["fcfs_sustained_qps"]
                qps *= 0.99 if order == "fcfs" else 1.01  # side by side
                ax.errorbar([qps], [m["median"] * scale],
                            yerr=[[(m["median"] - m["min"]) * scale],
                                  [(m["max"] - m["median"]) * scale]],
                            fmt="s", mfc="none", color=colours[order],
                            label=f"{order} (engine, {result['setup']['engine_requests']} "
                                  "requests per replay)")
    t = result["targets"]
    axes[0].set_ylabel(f"requests meeting TTFT {t['ttft_s']:g} s and TGT (%)")
    axes[1].set_ylabel("TTFT p95 (s)")
    for ax in axes:
        ax.set_xlabel("request rate (req/s, Azure code trace windows, rate-scaled)")
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['model']} sem_qa: deadline-aware joiners vs FCFS "
                 "(median, band: min-max of replays)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
