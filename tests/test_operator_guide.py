"""The example operator of docs/adding-an-operator.md, end to end and as written.

The guide shows ``examples/urgent_operator.py`` whole (the first test checks the copy is
exact) and a usage block, which the second test runs unchanged: register the operator on a
session, a SQL query, ``session.plan`` on it, ``session.serve()`` (worker processes built
from the stages' loaders), a served query, stop serving. Stand-in keyword models: seconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import ken
from ken.errors import KenError
from ken.models.model import DeviceConfig
from ken.ops.base import OpContext, Stage

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "adding-an-operator.md"
EXAMPLE = ROOT / "examples" / "urgent_operator.py"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


def usage_block() -> str:
    blocks = [b for b in python_blocks() if "from urgent_operator import" in b]
    assert len(blocks) == 1, "the guide has one usage block of the example operator"
    return blocks[0]


def test_the_guide_shows_the_example_module_whole() -> None:
    assert EXAMPLE.read_text() in python_blocks()


@pytest.fixture
def example(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setenv("KEN_HOME", str(tmp_path))  # profiles and plans of this test only
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))  # worker processes get this sys.path
    import urgent_operator

    return urgent_operator


def test_the_guide_example_runs_end_to_end(example, capsys) -> None:  # noqa: ANN001
    scope: dict = {}
    exec(compile(usage_block(), str(GUIDE), "exec"), scope)  # noqa: S102 - the guide's code
    urgent = [(1, "outage again, asap"), (2, "URGENT: the site is down")]
    assert scope["in_process"] == urgent
    # every gear of the plan answers these tickets alike, so the engine's answers are these
    assert scope["served"] == urgent
    session = scope["session"]
    assert session.plans["is_urgent"] is not None
    shown = capsys.readouterr().out
    assert "is_urgent" in shown and "gear plan" in shown


def test_stages_give_candidates_and_picklable_loaders(example) -> None:  # noqa: ANN001
    op = example.IsUrgent()
    ctx = OpContext(DeviceConfig())
    models = op.candidates(ctx, DeviceConfig(threads=2))
    assert list(models) == ["urgent-few", "urgent-many"]
    loaders = op.loaders(ctx, DeviceConfig(threads=2))
    assert list(loaders) == list(models)
    assert loaders["urgent-many"]().device == DeviceConfig(threads=2)
    bound = op.bind(ctx, ())
    assert bound.cascade.models == ("urgent-few", "urgent-many")
    assert bound.cascade.thresholds == (0.8,)
    assert "default threshold 0.8" in bound.describe()


def _load_named(resources, device, name):  # noqa: ANN001, ANN202
    import urgent_operator

    return urgent_operator.KeywordModel(name, ("x",), device)


def test_stage_mistakes_are_named(example) -> None:  # noqa: ANN001
    ctx = OpContext(DeviceConfig())

    class Broken(example.IsUrgent):
        declared: list = []

        def stages(self, ctx, constants):  # noqa: ANN001, ANN202
            return self.declared

    op = Broken()
    op.declared = [Stage("a", _load_named, ("a",)), Stage("a", _load_named, ("a",))]
    with pytest.raises(KenError, match="two stages are named 'a'"):
        op.candidates(ctx, ctx.device)
    op.declared = [Stage("a", _load_named, ("b",))]
    with pytest.raises(KenError, match="is_urgent\\(\\): the stage 'a' built a model named 'b'"):
        op.bind(ctx, ())
    op.declared = [Stage("a", lambda resources, device: None)]
    with pytest.raises(KenError, match="cannot be sent to a worker process"):
        op.loaders(ctx, ctx.device)
    op.declared = ["a"]
    with pytest.raises(KenError, match="must return Stage objects"):
        op.candidates(ctx, ctx.device)
    assert ken.Operator().loaders(ctx, ctx.device) is None  # no stages: thread workers
