"""The three built-ins with their real packaged models, served by one engine to 8 threads.

Each built-in gets a one-gear plan over the cascade its binding runs in-process (the test
does not profile or plan: that takes minutes per operator, see ``ken plan``); one engine on
one pool of devices then serves ``sentiment``, ``sem_filter`` and ``sem_match`` in one query
from 8 threads at once, and every thread gets the in-process answers. ``sem_match`` trains
its record matchers on Beer (the smallest entity-matching data set) from the shared data
folder, so the test skips without it.
"""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
from conftest import FAMILY_DEVICE, SMALL_FAMILY

import ken
from ken.ops.sem_filter import EVAL_PREDICATE
from ken.ops.sem_match import SemMatch, has_data
from ken.paths import shared_data_dir
from ken.policy.plan import GearPlan, RangeSchedule, Replica

pytestmark = pytest.mark.models
MATCH_DATASET = "Beer"  # the smallest entity-matching data set

TEXTS = [
    "I loved the new phone, the battery lasts for days",
    "worst customer service ever, never again",
    "the train was on time today",
    "Sony Bravia 40in LCD TV KDL-40S4100",
    "Sony KDL40S4100 40 inch Bravia LCD HDTV",
    "the update broke everything and support ignores me",
    "Canon PowerShot SD1100 IS digital camera silver",
    "Nikon Coolpix S210 8MP camera",
    "what a lovely afternoon in the park",
    "meh, it is fine I guess",
    "the package arrived broken and late",
    "Apple iPod nano 8GB black",
]

QUERY = (f"SELECT id, sentiment(a) AS mood, sem_filter(a, '{EVAL_PREDICATE}') AS negative, "
         "sem_match(a, b) AS same FROM t ORDER BY id")


def one_gear_plan(function: str, bound) -> GearPlan:  # noqa: ANN001 - a Bound
    """A plan whose one gear runs the binding's cascade, every model on ``cpu0``."""
    models = bound.cascade.models
    placement = tuple(Replica(m, ("cpu0",)) for m in models)
    return GearPlan(function, (0.0, 1e6), (bound.cascade,), placement,
                    (RangeSchedule(0, (1.0,) * len(models), (1,) * len(models)),),
                    (32,) * len(models), max_wait_s=0.01)


@pytest.fixture(scope="module")
def session(home):  # noqa: ANN001 - conftest's KEN_HOME with the small sentiment family
    if not has_data(MATCH_DATASET):
        pytest.skip(f"sem_match needs the entity-matching data, not found at "
                    f"{shared_data_dir()}")
    s = ken.connect(device=FAMILY_DEVICE, data=SMALL_FAMILY, home=home)
    s.register("sem_match", SemMatch(MATCH_DATASET))  # trains in seconds; the default in minutes
    b = TEXTS[3:] + TEXTS[:3]
    s.register_table("t", pa.table({"id": list(range(len(TEXTS))), "a": TEXTS, "b": b}))
    yield s
    s.close()


def test_one_engine_serves_all_three_builtins_to_eight_threads(session) -> None:  # noqa: ANN001
    s = session
    expected = s.sql(QUERY).fetchall()  # in-process: each binding's cascade
    assert len(expected) == len(TEXTS)
    assert {r[1] for r in expected} <= {"negative", "neutral", "positive"}
    assert {r[2] for r in expected} <= {True, False} and {r[3] for r in expected} <= {True,
                                                                                      False}
    for function, constants in (("sentiment", ()), ("sem_filter", (EVAL_PREDICATE,)),
                                ("sem_match", ())):
        s.use_plan(one_gear_plan(function, s.bind(function, constants)))
    s.serve(workers="thread", bulk_threshold=1)
    try:
        engines = {id(e) for e in s.engines.values()}
        assert set(s.engines) == {"sentiment", "sem_filter", "sem_match"} and len(engines) == 1
        explain = s.explain(QUERY)
        assert explain.count("served by the online engine") == 3
        results: list = [None] * 8
        errors: list = []

        def run(i: int) -> None:
            try:
                results[i] = s.sql(QUERY).fetchall()
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert all(r == expected for r in results)
        # the rows went through the engine (as bulk rows), not the in-process cascades
        stats = s.sql(QUERY).stats
        assert len(stats) == 3
        assert all(st.bulk_rows == len(TEXTS) and st.online_rows == 0 for st in stats.values())
    finally:
        s.stop_serving()
