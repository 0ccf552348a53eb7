"""Python's collector in a serving process (``ken.engine.collector``, issue 38): a worker
freezes what it loaded for its life; the engine's process freezes what is loaded while an
engine or decode server serves, and gives it back to the collector when the last one stops,
so a closed server's models are collected as before.

The engine's process is checked in a fresh interpreter: ``gc.freeze`` is process-wide, and
this test run's own process may hold engines that other tests left running."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from fakes import FreezeCount

from ken.engine.workers import ProcessRunner

TESTS = Path(__file__).parent


def test_a_worker_freezes_what_it_loaded_for_its_life() -> None:
    runner = ProcessRunner("cpu0", {"a": functools.partial(FreezeCount, "a")})
    try:
        runner.start()
        values, _, _ = runner.run("a", ["x", "y"], timeout_s=60.0)
    finally:
        runner.close()
    # the imports and the model: tens of thousands of objects no full collection walks
    assert int(values[0]) > 10_000, values


SERVING = """
import gc, weakref
import fakes
from ken.engine import collector
from ken.engine.decode import DecodeServer
from ken.engine.serving import Engine
from ken.models.cascade import Cascade
from ken.policy.plan import GearPlan, RangeSchedule, Replica

def plan(name):
    return GearPlan("op", (0.0, 1e6), (Cascade((name,)),), (Replica(name, ("cpu0",)),),
                    (RangeSchedule(0, (1.0,), (1,)),), (4,), max_wait_s=0.005)

model = fakes.FakeModel("a")
model.me = model  # a cycle: only the collector frees it
ref = weakref.ref(model)
assert gc.get_freeze_count() == 0 and collector.holders() == 0

engine = Engine(plan("a"), {"a": model}, workers="thread", drain_on_sigterm=False)
engine.start()
assert engine.submit("row").result(timeout=30).status == "ok"
# what was loaded is frozen while the engine serves: no collection walks it
# (gc.get_objects lists the three generations a collection walks, not the frozen objects)
assert gc.get_freeze_count() > 0 and collector.holders() == 1
assert not any(o is model for o in gc.get_objects())

# a model a swapped-in plan adds is frozen once loaded
other = fakes.FakeModel("b")
engine.swap_plan(plan("b"), {"b": other})
assert engine.submit("row").result(timeout=30).model == "b"
assert not any(o is other for o in gc.get_objects())
del other

# garbage is collected, not frozen, when another server starts
class Cycle:
    pass
junk = Cycle()
junk.me = junk
gone = weakref.ref(junk)
del junk
lm = fakes.GatedLM()
server = DecodeServer(lm, 2).start()  # a second server of the process
assert collector.holders() == 2
assert gone() is None, "garbage in a cycle was frozen rather than collected"
engine.shutdown()
assert gc.get_freeze_count() > 0 and collector.holders() == 1  # the decode server serves
server.shutdown()
assert gc.get_freeze_count() == 0 and collector.holders() == 0
server.shutdown()  # twice is harmless
assert collector.holders() == 0

del model, engine
gc.collect()
assert ref() is None, "a closed engine's model in a cycle was never collected"

# a process that froze objects itself keeps them frozen after ken's servers stop
gc.freeze()
mine = gc.get_freeze_count()
server = DecodeServer(lm, 2).start()
server.shutdown()
assert mine > 0 and gc.get_freeze_count() > 0.9 * mine  # (frozen objects still die)
print("ok")
"""


def test_a_server_freezes_what_is_loaded_while_it_serves_and_gives_it_back_when_it_stops(
        ) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    done = subprocess.run([sys.executable, "-c", SERVING], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
