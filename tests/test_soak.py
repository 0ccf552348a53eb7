"""The 5-minute soak (issue 38, item 4): not in the default run (``pytest -m soak``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.soak
@pytest.mark.models
def test_five_minutes_of_serving_lose_nothing_and_grow_nothing(tmp_path: Path) -> None:
    """``benchmarks/soak.py --minutes 5``: the classifier plan and a generating function
    served together with bursts, worker kills and plan swaps; every request has an outcome,
    and memory, open files and threads do not grow after the warm-up."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes",
                           "5", "--kill-every-s", "60", "--replan-every-s", "90",
                           "--burst-every-s", "45", "--quiet", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["lost"] == 0 and result["outcomes"] == result["requests"]
    assert result["worker_restarts"] >= 4
    assert any("plan swap" in e["event"] for e in result["events"])
    goals = result["goals"]
    assert goals["rss_growth_under_50mb"], result["rss_growth_mb"]
    assert goals["no_growth_in_open_files"], result["open_files_growth"]
    assert goals["no_growth_in_threads"], result["threads_growth"]
