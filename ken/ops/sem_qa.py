"""``sem_qa(question, context) -> VARCHAR``: a short answer to a question from a passage.

Greedy generation (at most 24 new tokens, one line) with the prompt ``sem_qa/v1``
(``ken/ops/prompts.py``); questions over 64 tokens and passages over 448 tokens keep their
start. An answer that restates the question is cut back to what it adds
(``ken.ops.short_answer``: "Lisa Martin is the current pastor of ..." -> "Lisa Martin"). The
cascade escalates answers whose length-normalised sequence probability is below the
threshold.

Evaluation sample (for planning): HybridQA dev questions (``../shared/data/hybridqa``) with,
as context, the one linked Wikipedia passage of the question's table that contains the answer
(questions whose answer is in no passage, or in several, are left out); token F1 against the
answer, as in SQuAD. The questions were written for the table and its passages together, so
some are ambiguous from the passage alone: the sample ranks models, it is not HybridQA's score.

>>> # session.sql("SELECT sem_qa('Who founded the company?', description) FROM firms")
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from ken.errors import DataError
from ken.models.llm import GenerativeModel
from ken.models.model import DeviceConfig, Model
from ken.models.quality import EvalSample
from ken.models.resources import Resources, short_hash
from ken.ops.base import OpContext, Stage
from ken.ops.llm_operator import LLMOperator, stage_prefix
from ken.ops.prompts import SEM_QA
from ken.ops.short_answer import short_answer
from ken.paths import shared_data_dir

MAX_NEW_TOKENS = 24
EVAL_QUESTIONS = 150
#: what the stage does to the generated text (part of its name, so answers, profiles and
#: cached results from before the cut are not reused)
ANSWER_FORM = "short_answer/v1"


def hybridqa_dir(data_dir: Path | None = None) -> Path:
    return (data_dir or shared_data_dir()) / "hybridqa"


def hybridqa_passage_sample(limit: int = EVAL_QUESTIONS, data_dir: Path | None = None
                            ) -> EvalSample:
    """The first ``limit`` HybridQA dev questions whose answer is in exactly one passage
    linked from their table: rows ``(question, passage)``, references the answers."""
    folder = hybridqa_dir(data_dir)
    questions_path = folder / "dev_questions.json"
    tables_path = folder / "tables_with_passages.jsonl.gz"
    if not questions_path.is_file() or not tables_path.is_file():
        raise DataError(f"HybridQA not found in {folder} (needs dev_questions.json and "
                        "tables_with_passages.jsonl.gz; set KEN_DATA_DIR)")
    questions = json.loads(questions_path.read_text())
    wanted = {q["table_id"] for q in questions}
    passages: dict[str, list[str]] = {}
    with gzip.open(tables_path, "rt", encoding="utf-8") as f:
        for line in f:
            table = json.loads(line)
            if table["table_id"] in wanted:
                passages[table["table_id"]] = list(table.get("passages", {}).values())
    rows, answers = [], []
    for q in questions:
        answer = str(q["answer-text"]).strip()
        if not answer:
            continue
        holding = [p for p in passages.get(q["table_id"], []) if answer.lower() in p.lower()]
        if len(holding) == 1:
            rows.append((q["question"].strip(), holding[0]))
            answers.append(answer)
        if len(rows) == limit:
            break
    if not rows:
        raise DataError(f"no HybridQA question in {folder} has its answer in one passage")
    return EvalSample(f"hybridqa-passage-{len(rows)}", tuple(rows), tuple(answers),
                      "token_f1")


def answer_of(text: str, row: tuple[str, str]) -> str | None:
    """The stage's answer to ``row`` (question, context): the generated ``text`` without a
    restatement of the question (:func:`ken.ops.short_answer.short_answer`)."""
    return short_answer(text, row[0])


def load_qa_stage(resources: Resources, device: DeviceConfig, name: str, lm_name: str
                  ) -> Model:
    return GenerativeModel(resources.causal_lm(lm_name, device), SEM_QA, name, "sem-qa",
                           f"{SEM_QA.key}+{ANSWER_FORM}", MAX_NEW_TOKENS, stop=("\n",),
                           finish=answer_of, num_inputs=2)


class SemQA(LLMOperator):
    name = "sem_qa"
    num_columns = 2
    constants = ()
    output_type = "varchar"
    plan_kind = "generation"
    doc = "a short answer to the question (first text) from the passage (second text)"

    def llm_stage(self, lm_name: str, constants: tuple[str, ...]) -> Stage:
        name = f"{stage_prefix(self.name, lm_name)}[{short_hash(SEM_QA.key, ANSWER_FORM)}]"
        return Stage(name, load_qa_stage, (name, lm_name))

    def detail(self, constants: tuple[str, ...]) -> str:
        return (f"greedy, one line of <= {MAX_NEW_TOKENS} tokens, a restated question cut "
                f"({ANSWER_FORM}); {SEM_QA.describe_truncation()}")

    def eval_sample(self, ctx: OpContext) -> EvalSample | None:
        if not self.plannable():
            return None
        return ctx.resource("sem-qa-eval", hybridqa_passage_sample)

    def plannable(self) -> bool:
        return (hybridqa_dir() / "dev_questions.json").is_file()

    def eval_description(self) -> str:
        state = "" if self.plannable() else f" (absent: not found at {hybridqa_dir()})"
        return (f"HybridQA dev questions with the passage holding the answer{state}, "
                "token F1")


OPERATOR = SemQA
