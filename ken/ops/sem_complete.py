"""``sem_complete(context, endings) -> BIGINT``: which ending most likely continues the context.

Multiple choice by likelihood, as the LM evaluation harnesses score HellaSwag: ``endings``
holds one option per line; each is scored as the plain continuation of the context (no chat
template), ``log P(ending | context)`` divided by the ending's length in bytes (the
harnesses' ``acc_norm``); the value is the 0-based index of the best ending, the certainty
its probability among the endings. Contexts over 256 tokens keep their end; a row without
endings or with a blank context is NULL.

Evaluation sample (for planning): the first 300 items of HellaSwag validation
(``../shared/data/hellaswag``), accuracy.

>>> # session.sql("SELECT sem_complete(ctx, endings) = label FROM hellaswag")
"""

from __future__ import annotations

from pathlib import Path

from ken.errors import DataError
from ken.models.llm import ContinuationModel
from ken.models.model import DeviceConfig, Model
from ken.models.quality import EvalSample
from ken.models.resources import Resources, short_hash
from ken.ops.base import OpContext, Stage
from ken.ops.llm_operator import LLMOperator, stage_prefix
from ken.paths import shared_data_dir

SCORING = "v1-bytes"  # the scoring rule is part of the stage names
EVAL_ITEMS = 300
HELLASWAG_FILE = "hellaswag_val_even.txt"


def hellaswag_path(data_dir: Path | None = None) -> Path:
    return (data_dir or shared_data_dir()) / "hellaswag" / HELLASWAG_FILE


def load_hellaswag(limit: int | None = None, data_dir: Path | None = None
                   ) -> tuple[list[str], list[list[str]], list[int]]:
    """HellaSwag items: contexts, their 4 endings, and the gold ending's index (6 lines per
    item: context, gold index, 4 endings)."""
    path = hellaswag_path(data_dir)
    if not path.is_file():
        raise DataError(f"HellaSwag not found at {path} (set KEN_DATA_DIR)")
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise DataError(f"{path}: {len(lines)} lines is not 6 per item")
    contexts, endings, gold = [], [], []
    for at in range(0, len(lines), 6):
        if limit is not None and len(contexts) == limit:
            break
        try:
            label = int(lines[at + 1])
        except ValueError:
            raise DataError(f"{path}:{at + 2}: the gold index {lines[at + 1]!r} is not a "
                            "number") from None
        contexts.append(lines[at])
        endings.append(lines[at + 2: at + 6])
        gold.append(label)
    return contexts, endings, gold


def hellaswag_sample(limit: int = EVAL_ITEMS, data_dir: Path | None = None) -> EvalSample:
    contexts, endings, gold = load_hellaswag(limit, data_dir)
    rows = tuple((c, "\n".join(e)) for c, e in zip(contexts, endings, strict=True))
    return EvalSample(f"hellaswag-val-{len(rows)}", rows, tuple(gold), "accuracy")


def load_complete_stage(resources: Resources, device: DeviceConfig, name: str, lm_name: str
                        ) -> Model:
    return ContinuationModel(resources.causal_lm(lm_name, device), name, "sem-complete")


class SemComplete(LLMOperator):
    name = "sem_complete"
    num_columns = 2
    constants = ()
    output_type = "bigint"
    doc = "index of the ending (one per line of the second text) that best continues the first"
    #: how many HellaSwag items the evaluation sample holds
    eval_items = EVAL_ITEMS

    def llm_stage(self, lm_name: str, constants: tuple[str, ...]) -> Stage:
        name = f"{stage_prefix(self.name, lm_name)}[{short_hash(SCORING)}]"
        return Stage(name, load_complete_stage, (name, lm_name))

    def detail(self, constants: tuple[str, ...]) -> str:
        return ("endings scored by log-likelihood per byte; contexts cut to 256 tokens "
                "keeping the end")

    def eval_sample(self, ctx: OpContext) -> EvalSample | None:
        if not self.plannable():
            return None
        items = self.eval_items
        return ctx.resource(f"sem-complete-eval-{items}", lambda: hellaswag_sample(items))

    def plannable(self) -> bool:
        return hellaswag_path().is_file()

    def eval_description(self) -> str:
        state = "" if self.plannable() else f" (absent: not found at {hellaswag_path()})"
        return f"the first {self.eval_items} HellaSwag validation items{state}, accuracy"


OPERATOR = SemComplete
