"""The hop to a Ray actor against a local worker's pipe (issue 20, item 3).

Times one batch call of a stand-in model (``tests/fakes.py``: answers at once) through each
runner the engine has, on this machine, idle: a thread (no hop), a worker process (a pipe), a
Ray actor on a local Ray (the router-to-actor hop the planner charges per batch on a cluster,
``Device.dispatch_s``), and ``ray_runner.measure_hop_s`` itself (the figure ``ken plan --ray``
records). Median and p95 over ``--calls`` calls at batch sizes 1, 8 and 64.

Writes benchmarks/results/ray_hop/ray_hop.json and ray_hop.png.

    python benchmarks/ray_hop.py          # ~1 minute
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the stand-in models; workers get this path too
import fakes  # noqa: E402

from ken.engine.ray_runner import RayRunner, ensure_ray, measure_hop_s  # noqa: E402
from ken.engine.workers import ProcessRunner, ThreadRunner  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "ray_hop"


def time_calls(runner: object, rows: int, calls: int) -> list[float]:
    texts = [f"row {i}" for i in range(rows)]
    runner.run("a", texts)  # type: ignore[attr-defined]
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        runner.run("a", texts)  # type: ignore[attr-defined]
        out.append(time.perf_counter() - started)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.calls < 10:
        ap.error("--calls must be at least 10")
    ray = ensure_ray()
    loader = functools.partial(fakes.FakeModel, "a")
    runners = {"thread": ThreadRunner("cpu0", {"a": loader()}),
               "process": ProcessRunner("cpu0", {"a": loader}),
               "ray actor": RayRunner("cpu0", {"a": loader})}
    out: dict = {"calls": args.calls, "ray": ray.__version__, "runners": {}}
    try:
        for r in runners.values():
            r.start()
        for name, r in runners.items():
            out["runners"][name] = {}
            for rows in (1, 8, 64):
                s = np.array(time_calls(r, rows, args.calls)) * 1000
                out["runners"][name][rows] = {"p50_ms": float(np.median(s)),
                                              "p95_ms": float(np.percentile(s, 95))}
                print(f"{name:>10}, {rows:>2} rows: p50 {np.median(s):.3f} ms, "
                      f"p95 {np.percentile(s, 95):.3f} ms")
    finally:
        for r in runners.values():
            r.close()
    out["measure_hop_s_ms"] = 1000 * measure_hop_s(calls=args.calls)
    print(f"measure_hop_s (what ken plan --ray records, before rounding up to 0.5 ms): "
          f"{out['measure_hop_s_ms']:.3f} ms")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ray_hop.json").write_text(json.dumps(out, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    width = 0.25
    for i, (name, by_rows) in enumerate(out["runners"].items()):
        xs = np.arange(3) + (i - 1) * width
        ax.bar(xs, [by_rows[r]["p50_ms"] for r in (1, 8, 64)], width, label=name)
    ax.set_xticks(range(3), ["1 row", "8 rows", "64 rows"])
    ax.set_ylabel("one batch call, median (ms)")
    ax.set_title("stand-in model: the runner's own cost per batch", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "ray_hop.png", dpi=120)
    print(f"wrote {args.out / 'ray_hop.json'} and ray_hop.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
