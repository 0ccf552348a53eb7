"""The engine's log of recent arrivals and answers (``ken.engine.dispatch.TimeLog``): the
newest rows per operator, in time order, against a plain list; a full log holds no more
memory than an empty one."""

from __future__ import annotations

import tracemalloc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ken.engine.dispatch import TimeLog

steps = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 3), st.integers(1, 4)),
                 max_size=60)


@settings(max_examples=200, deadline=None)
@given(steps, st.integers(1, 7), st.integers(0, 40))
def test_the_log_keeps_the_newest_rows_of_each_key_in_time_order(ops, capacity, since) -> None:  # noqa: ANN001
    log = TimeLog(capacity, 2)
    kept: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}
    t = 0.0
    for key, dt, times in ops:
        t += dt
        log.add(key, (t, -t), times)
        kept[key] = (kept[key] + [(t, -t)] * times)[-capacity:]
    for key, rows in kept.items():
        want = [r for r in rows if r[0] >= since]
        got = log.since(key, float(since))
        assert got.shape == (len(want), 2) and [tuple(r) for r in got.tolist()] == want
    assert log.since("unseen", 0.0).shape == (0, 2)


def test_a_full_log_holds_no_more_than_an_empty_one() -> None:
    log = TimeLog(200_000, 1)
    log.add("sentiment", (0.0,))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(400_000):  # twice round the ring, one row at a time
        log.add("sentiment", (float(i),))
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 100_000  # bytes: nothing per row (a deque of tuples: about 20 MB)
    assert np.array_equal(log.since("sentiment", 399_990.0)[:, 0], np.arange(399_990, 400_000))
