"""``sem_extract(text, 'what to extract') -> VARCHAR``: a span of the text, NULL when absent.

Greedy generation (at most 24 new tokens, one line) with the prompt ``sem_extract/v1``
(``ken/ops/prompts.py``), which asks for the exact words or ``none``; answers meaning "not
there" become NULL. The value is always a span of the input text, in the text's own spelling,
or NULL: an answer is matched back to the text (``prompts.text_span``: the answer itself, or
the longest run of its words found in the text if that is at least half of them), and an
answer that is not in the text is NULL. Texts over 384 tokens keep their start. No built-in
evaluation sample: register a copy with ``sample=`` to plan it.

By default Qwen2.5-Coder-0.5B answers alone (``llms``): on ten obvious rows it extracted all
ten, while SmolLM2-135M, as a first stage, copied the whole sentence back, sure enough of it
that the cascade SmolLM2 -> Qwen got three of ten (``docs/results.md``, "Easy rows right"). Set
``session.operators["sem_extract"].llms = ("smollm2-135m", "qwen2.5-coder-0.5b")`` for the
cascade.

>>> # session.sql("SELECT sem_extract(bio, 'the person''s employer') FROM people")
"""

from __future__ import annotations

from ken.models.llm import GenerativeModel
from ken.models.model import DeviceConfig, Model
from ken.models.resources import Resources, short_hash
from ken.ops.base import Stage
from ken.ops.llm_operator import LLMOperator, stage_prefix
from ken.ops.prompts import SEM_EXTRACT, extracted_value

MAX_NEW_TOKENS = 24


def load_extract_stage(resources: Resources, device: DeviceConfig, name: str, lm_name: str,
                       what: str) -> Model:
    prompt = SEM_EXTRACT.with_constants({"what": what})
    return GenerativeModel(resources.causal_lm(lm_name, device), prompt, name, "sem-extract",
                           SEM_EXTRACT.key, MAX_NEW_TOKENS, stop=("\n",),
                           finish=extracted_value)


class SemExtract(LLMOperator):
    name = "sem_extract"
    num_columns = 1
    constants = ("what",)
    output_type = "varchar"
    plan_kind = "generation"
    doc = "the part of the text that says what is asked for (NULL when absent)"
    llms = ("qwen2.5-coder-0.5b",)

    def llm_stage(self, lm_name: str, constants: tuple[str, ...]) -> Stage:
        name = f"{stage_prefix(self.name, lm_name)}[{short_hash(SEM_EXTRACT.key, constants)}]"
        return Stage(name, load_extract_stage, (name, lm_name, constants[0]))

    def detail(self, constants: tuple[str, ...]) -> str:
        return (f"greedy, one line of <= {MAX_NEW_TOKENS} tokens, 'none' -> NULL; "
                f"{SEM_EXTRACT.describe_truncation()}")


OPERATOR = SemExtract
