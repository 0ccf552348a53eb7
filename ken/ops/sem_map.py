"""``sem_map(text, 'instruction') -> VARCHAR``: the LLM's answer to an instruction about a text.

Greedy generation (at most 48 new tokens) with the versioned prompt ``sem_map/v1``
(``ken/ops/prompts.py``); texts over 384 tokens keep their start. The cascade runs the
smaller LM first and escalates answers whose length-normalised sequence probability is below
the threshold. No built-in evaluation sample: register a copy with ``sample=`` to plan it.

>>> # session.sql("SELECT sem_map(review, 'Summarise in five words') FROM reviews")
"""

from __future__ import annotations

from ken.models.llm import GenerativeModel
from ken.models.model import DeviceConfig, Model
from ken.models.resources import Resources, short_hash
from ken.ops.base import Stage
from ken.ops.llm_operator import LLMOperator, stage_prefix
from ken.ops.prompts import SEM_MAP

MAX_NEW_TOKENS = 48


def load_map_stage(resources: Resources, device: DeviceConfig, name: str, lm_name: str,
                   instruction: str) -> Model:
    prompt = SEM_MAP.with_constants({"instruction": instruction})
    return GenerativeModel(resources.causal_lm(lm_name, device), prompt, name, "sem-map",
                           SEM_MAP.key, MAX_NEW_TOKENS)


class SemMap(LLMOperator):
    name = "sem_map"
    num_columns = 1
    constants = ("instruction",)
    output_type = "varchar"
    plan_kind = "generation"
    doc = "the LLM's answer to an instruction about the text (generated)"

    def llm_stage(self, lm_name: str, constants: tuple[str, ...]) -> Stage:
        name = f"{stage_prefix(self.name, lm_name)}[{short_hash(SEM_MAP.key, constants)}]"
        return Stage(name, load_map_stage, (name, lm_name, constants[0]))

    def detail(self, constants: tuple[str, ...]) -> str:
        return f"greedy, <= {MAX_NEW_TOKENS} new tokens; {SEM_MAP.describe_truncation()}"


OPERATOR = SemMap
