"""Time the decode simulator on a fixed synthetic trace (best of 5 runs).

    python benchmarks/sim_speed.py                      # this checkout
    git worktree add /tmp/old d577377~1                 # the loop before the shared core
    PYTHONPATH=/tmp/old python benchmarks/sim_speed.py  # the same inputs on that code
"""

from __future__ import annotations

import time

import numpy as np

from ken.optimizer.decode_sim import simulate_decoding
from ken.optimizer.tokens import TokenCost


def main() -> None:
    cost = TokenCost("m", "hw", (), (), (0.01, 0.002, 1e-4), (0.02, 0.003, 2e-5), 1000, 64)
    rng = np.random.default_rng(0)
    n = 3000
    arrivals = np.cumsum(rng.exponential(0.2, n))
    prompts, outputs = rng.integers(10, 200, n), rng.integers(1, 8, n)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        run = simulate_decoding(cost, arrivals, prompts, outputs, 8)
        best = min(best, time.perf_counter() - started)
    print(f"simulate_decoding: {n} requests, {run.passes} passes, best of 5: {best:.3f} s")


if __name__ == "__main__":
    main()
