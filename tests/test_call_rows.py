"""benchmarks/call_rows.py's pairings on made-up batches whose residuals follow their rows or
their moment: each pairing must see the one it is built to see, and nothing else."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from call_rows import Residual, same_moment, same_row, same_rows, size_r2, summarise  # noqa: E402


def replay(row_seed: int, value, n: int = 400, seed: int = 0) -> list[Residual]:
    """``n`` batches, alternating devices, 10 ms apart on each device, of one or two rows
    drawn by ``row_seed``; each residual ``value(rows, moment)``."""
    rows = np.random.default_rng(100 + row_seed).integers(0, 60, size=(n, 2))
    out = []
    for k in range(n):
        size = 1 + k % 2
        r = tuple(sorted({int(x) for x in rows[k, :size]}))
        out.append(Residual(value(r, k), r, 0.005 * k, f"cpu{k % 2}", len(r)))
    return out


ROW = np.random.default_rng(1).normal(size=60)  # each row's own slowness
MOMENT = np.random.default_rng(2).normal(size=400)  # each moment's


def by_row(rows, _k):
    return float(max(ROW[list(rows)]))


def by_moment(_rows, k):
    return float(MOMENT[k])


@pytest.mark.parametrize("value,rows_corr,moment_corr,row_corr", [
    (by_row, 1.0, None, 1.0),  # same rows deviate alike, other rows at that moment do not
    (by_moment, 1.0, 1.0, None),  # whatever runs at a moment deviates alike
])
def test_each_pairing_sees_what_it_is_built_to_see(value, rows_corr, moment_corr, row_corr):
    a, a2, b = replay(0, value), replay(0, value), replay(1, value)
    assert same_rows(a, a2)["correlation"] == pytest.approx(rows_corr)
    moment = same_moment(a, b)["correlation"]
    row = same_row(a, b)["correlation"]
    assert same_moment(a, b)["pairs"] > 100 and same_row(a, b)["pairs"] > 20
    if moment_corr is None:
        assert abs(moment) < 0.3
    else:
        assert moment == pytest.approx(moment_corr)
    if row_corr is None:
        assert abs(row) < 0.3
    else:
        assert row == pytest.approx(row_corr)


def test_same_row_leaves_out_batches_at_nearly_the_same_moment():
    a = [Residual(1.0, (3,), 0.0, "cpu0", 1), Residual(2.0, (4,), 5.0, "cpu0", 1)]
    b = [Residual(1.5, (3,), 0.5, "cpu1", 1), Residual(0.0, (4,), 1.0, "cpu1", 1)]
    assert same_row(a, b)["pairs"] == 1  # row 3 only 0.5 s apart
    assert same_row(a, b, apart_s=0.1)["pairs"] == 2


def test_size_r2_is_one_where_the_residual_is_the_log_of_the_longest_row():
    sizes = np.arange(1, 61, dtype=float)
    rng = np.random.default_rng(3)
    res = []
    for _ in range(200):
        rows = tuple(sorted(int(x) for x in rng.choice(60, size=2, replace=False)))
        res.append(Residual(float(np.log(sizes[list(rows)].max())), rows, 0.0, "cpu0", 2))
    assert size_r2(res, sizes)[2] == pytest.approx(1.0)
    assert size_r2(res, sizes[::-1].copy())[2] < 0.5


def test_summarise_pairs_replays_by_their_row_seeds():
    runs = [{"row_seed": s, "residuals": replay(s, by_row)} for s in (0, 1, 0, 1)]
    out = summarise(runs)
    assert len(out["same_rows"]) == 2 and len(out["same_moment"]) == 4
    assert out["same_rows_median"] == pytest.approx(1.0)
    assert abs(out["same_moment_median"]) < 0.3


def test_same_moment_pairs_only_the_nearest_batch_of_the_same_device_size_and_other_rows():
    a = [Residual(1.0, (1,), 1.000, "cpu0", 1)]
    near = Residual(2.0, (2,), 1.003, "cpu0", 1)
    for b, pairs in [
        ([near], 1),
        ([near._replace(formed_s=1.005)], 0),  # beyond 4 ms
        ([near._replace(device="cpu1")], 0),  # another device
        ([near._replace(rows=(2, 3), size=2)], 0),  # another size
        ([near._replace(rows=(1,))], 0),  # the same rows: not "other rows"
        # the nearest is the earlier one, 2 ms before (the later one, 4.5 ms after, is not)
        ([near._replace(formed_s=0.998), near._replace(formed_s=1.0045)], 1),
    ]:
        assert same_moment(a, b)["pairs"] == pairs, b
    # the nearest of two batches is taken, and only it: two pairs from a's two batches
    a2 = a + [Residual(3.0, (4,), 2.0, "cpu0", 1)]
    b2 = [near, Residual(0.0, (5,), 1.999, "cpu0", 1), Residual(9.0, (6,), 2.0035, "cpu0", 1)]
    assert same_moment(a2, b2)["pairs"] == 2
