"""``sem_agg(text, 'instruction') -> VARCHAR``, an aggregate: one answer over a group's texts.

``SELECT movie, sem_agg(review, 'What do the reviews praise?') FROM reviews GROUP BY movie``
(or over the whole table without ``GROUP BY``). The front end passes the group's values to the
call as one JSON list (``list_sort(list(text))``: sorted, so the same group gives the same
answer, and equal groups are answered once), and an LM answers the instruction by
**hierarchical reduction**: the texts are packed into blocks of at most ``FAN_IN`` texts and
``BLOCK_TOKENS`` tokens (each text cut to ``TEXT_TOKENS`` tokens, keeping its start); each
block is answered with the prompt ``sem_agg_leaf/v1``; while a group has more than one partial
answer, they are packed the same way and combined with ``sem_agg_reduce/v1``. A group of n
texts takes about ``n / FAN_IN`` leaf calls and ``n / FAN_IN**2 + ...`` combining calls,
batched across the groups of a chunk. NULL and blank texts are left out; a group with none
gives NULL. The certainty, which a cascade escalates on, is the final answer's mean token
probability.

By default Qwen2.5-Coder-0.5B answers alone (``llms``), as for ``sem_choice``: on the
evaluation sample (40 groups of 6 held-out tweets) SmolLM2-135M named the group's label in 12
(it called every group positive, at chance) and its certainty did not tell right answers from
wrong (0.47 / 0.48), Qwen in 21 (4.0 and 3.4 groups per second on 2 threads; ``docs/results.md``,
"sem_agg").

Evaluation sample (for planning): groups of ``EVAL_GROUP`` held-out tweets of the default family
with one sentiment label each, the instruction :data:`EVAL_INSTRUCTION`, quality
``label_named`` (the answer names the group's label and no other).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ken.errors import DataError
from ken.models import family
from ken.models.llm import GenerativeModel, truncate_ids
from ken.models.model import DeviceConfig, Model, ModelSpec, Output
from ken.models.quality import EvalSample
from ken.models.resources import CausalLM, Resources, short_hash
from ken.ops.base import OpContext, Stage
from ken.ops.llm_operator import LLMOperator, stage_prefix
from ken.ops.prompts import SEM_AGG_LEAF, SEM_AGG_REDUCE

FAN_IN = 8  # texts (or partial answers) per call at most
BLOCK_TOKENS = 640  # tokens of texts per call at most
TEXT_TOKENS = 96  # each text cut to this many tokens (its start kept)
MAX_NEW_TOKENS = 48
EVAL_GROUP = 6
EVAL_GROUPS = 40
EVAL_INSTRUCTION = ("What is the overall sentiment of these texts? Answer with one word: "
                    "positive, negative or neutral.")


def group_texts(row: Any) -> list[str] | None:
    """The texts of one group from the JSON list the front end passes (NULL and blank values
    left out; a value that is not text is written as JSON); None for a NULL group."""
    if row is None:
        return None
    values = json.loads(row) if isinstance(row, str) else row
    if not isinstance(values, list):
        raise DataError(f"sem_agg receives a group's values as a list, got {type(values)}")
    out = []
    for v in values:
        if v is None:
            continue
        text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        if text.strip():
            out.append(" ".join(text.split()))
    return out


def pack(texts: Sequence[str], sizes: Sequence[int], fan_in: int = FAN_IN,
         budget: int = BLOCK_TOKENS) -> list[list[int]]:
    """Indices of ``texts`` in consecutive blocks of at most ``fan_in`` texts and ``budget``
    tokens (``sizes``: each text's tokens; a text over the budget is a block alone)."""
    blocks: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        if current and (len(current) >= fan_in or used + size > budget):
            blocks.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        blocks.append(current)
    return blocks


class ReduceModel(Model):
    """One answer per group of texts by hierarchical reduction (see the module docstring).

    ``calls`` counts the LM calls (prompts answered) since the model was built, ``levels``
    the deepest reduction seen: what EXPLAIN ANALYZE and the tests read.
    """

    def __init__(self, lm: CausalLM, instruction: str, name: str, fan_in: int = FAN_IN,
                 budget: int = BLOCK_TOKENS) -> None:
        if fan_in < 2 or budget < 2 * TEXT_TOKENS:
            # each level must at least halve a group's items, or the reduction never ends
            raise DataError(f"sem_agg needs a fan-in of at least 2 and a block budget of at "
                            f"least {2 * TEXT_TOKENS} tokens, got {fan_in} and {budget}")
        self.lm = lm
        self.device = lm.device
        self.fan_in = fan_in
        self.budget = budget
        constants = {"instruction": instruction}
        self.leaf = GenerativeModel(lm, SEM_AGG_LEAF.with_constants(constants), name + "-leaf",
                                    "sem-agg", SEM_AGG_LEAF.key, MAX_NEW_TOKENS)
        self.combine = GenerativeModel(lm, SEM_AGG_REDUCE.with_constants(constants),
                                       name + "-reduce", "sem-agg", SEM_AGG_REDUCE.key,
                                       MAX_NEW_TOKENS)
        self.calls = 0
        self.levels = 0
        spec = self.leaf.spec
        key = short_hash(spec.fingerprint, self.combine.spec.fingerprint, fan_in, budget,
                         TEXT_TOKENS)
        self.spec = ModelSpec(name, "sem-agg", spec.backend, spec.source, spec.num_params,
                              spec.memory_bytes, spec.max_tokens, (), f"{name}-{key}")

    def _cut(self, text: str) -> tuple[str, int]:
        ids = self.lm.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > TEXT_TOKENS:
            ids = truncate_ids(ids, TEXT_TOKENS, "right")
            text = self.lm.tokenizer.decode(ids).strip()
        return text, len(ids)

    def _round(self, model: GenerativeModel, groups: list[list[str]], batch_size: int
               ) -> tuple[list[list[str]], list[float]]:
        """One level: every group's items packed into blocks, each block answered; the new
        items per group (its block answers) and the certainty of each group's last answer."""
        blocks: list[tuple[int, str]] = []
        for g, items in enumerate(groups):
            cut = [self._cut(t) for t in items]
            for block in pack([c[0] for c in cut], [c[1] for c in cut], self.fan_in,
                              self.budget):
                blocks.append((g, "\n".join(f"{n}. {cut[i][0]}"
                                            for n, i in enumerate(block, 1))))
        out = model.predict([b for _, b in blocks], batch_size)  # every group has a block
        self.calls += len(blocks)
        answers: list[list[str]] = [[] for _ in groups]
        sure = [1.0] * len(groups)
        for (g, _), value, c in zip(blocks, out.values, out.scores, strict=True):
            text = " ".join(str(value or "").split())
            if text:
                answers[g].append(text)
            sure[g] = float(c)
        return answers, sure

    def predict(self, texts: Sequence, batch_size: int = 8) -> Output:
        n = len(texts)
        values: list[Any] = [None] * n
        certainty = np.ones(n)
        groups = {i: g for i, g in enumerate(group_texts(t) for t in texts) if g}
        level = 0
        model = self.leaf
        while groups:
            order = list(groups)
            answers, sure = self._round(model, [groups[i] for i in order], batch_size)
            level += 1
            groups = {}
            for i, items, c in zip(order, answers, sure, strict=True):
                if len(items) > 1:
                    groups[i] = items
                elif items:
                    values[i], certainty[i] = items[0], c
            model = self.combine
        self.levels = max(self.levels, level)
        return Output(values, certainty)


def load_agg_stage(resources: Resources, device: DeviceConfig, name: str, lm_name: str,
                   instruction: str) -> Model:
    return ReduceModel(resources.causal_lm(lm_name, device), instruction, name)


class SemAgg(LLMOperator):
    name = "sem_agg"
    num_columns = 1
    constants = ("instruction",)
    output_type = "varchar"
    doc = "one answer to the instruction over a group's texts (an aggregate; LLM, by reduction)"
    record_columns = True
    aggregate = True
    llms = ("qwen2.5-coder-0.5b",)
    eval_constants = (EVAL_INSTRUCTION,)

    def llm_stage(self, lm_name: str, constants: tuple[str, ...]) -> Stage:
        instruction = constants[0]
        if not isinstance(instruction, str) or not instruction.strip():
            raise DataError("sem_agg needs an instruction, e.g. 'What do the reviews praise?'")
        key = short_hash(SEM_AGG_LEAF.key, SEM_AGG_REDUCE.key, instruction, FAN_IN,
                         BLOCK_TOKENS, TEXT_TOKENS, MAX_NEW_TOKENS)
        name = f"{stage_prefix(self.name, lm_name)}[{key}]"
        return Stage(name, load_agg_stage, (name, lm_name, instruction))

    def detail(self, constants: tuple[str, ...]) -> str:
        return (f"hierarchical reduction: at most {FAN_IN} texts and {BLOCK_TOKENS} tokens per "
                f"call (each text cut to {TEXT_TOKENS}), so a group of n texts takes about "
                f"n/{FAN_IN} calls, then n/{FAN_IN ** 2}, ... to combine; prompts "
                f"{SEM_AGG_LEAF.key}, {SEM_AGG_REDUCE.key}")

    def eval_sample(self, ctx: OpContext) -> EvalSample:
        sample = family.heldout_sample(ctx.data or family.default_data())
        by_label: dict[str, list[str]] = {}
        for text, label in zip(sample.texts, sample.labels, strict=True):
            by_label.setdefault(sample.label_names[int(label)], []).append(text)
        inputs, refs = [], []
        for k in range(EVAL_GROUPS):
            label = sorted(by_label)[k % len(by_label)]
            texts = by_label[label]
            start = (k // len(by_label)) * EVAL_GROUP
            if start + EVAL_GROUP > len(texts):
                break
            inputs.append(json.dumps(sorted(texts[start:start + EVAL_GROUP])))
            refs.append(label)
        return EvalSample(f"{sample.name}-groups{EVAL_GROUP}", tuple(inputs), tuple(refs),
                          "label_named")

    def plannable(self) -> bool:
        return True

    def eval_description(self) -> str:
        return (f"groups of {EVAL_GROUP} held-out texts of one sentiment label from the "
                f"default family ({EVAL_INSTRUCTION!r}); quality: the answer names the "
                "group's label and no other")


OPERATOR = SemAgg
