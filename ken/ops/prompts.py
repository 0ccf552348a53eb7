"""Every prompt the LLM operators send, versioned, in one place.

A prompt's version is part of its models' names and fingerprints, so changing a template
means bumping its version: profiles and plans made with the old text are then not reused.

A :class:`ChatPrompt` turns a row (one text, or a tuple of texts for several columns) into
the token ids of a one-turn chat in the model's template. Each column is cut to at most
``max_tokens`` tokens from the side the operator says (EXPLAIN says so); a NULL or blank
column the prompt needs gives no prompt, and the row the SQL value NULL.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ken.errors import DataError
from ken.models.data_text import defuse
from ken.models.generation import chat_prompt
from ken.models.llm import truncate_ids
from ken.models.resources import CausalLM


@dataclass(frozen=True)
class ChatPrompt:
    """A versioned chat template with ``{column}`` and ``{constant}`` fields."""

    name: str
    version: str
    template: str
    columns: tuple[str, ...]  # the row's texts, in SQL argument order
    truncate: tuple[str, ...]  # per column: "right" (keep the start) or "left" (keep the end)
    max_tokens: tuple[int, ...]  # per column
    system: str | None = None
    constants: tuple[tuple[str, str], ...] = field(default=())

    @property
    def key(self) -> str:
        return f"{self.name}/{self.version}"

    def with_constants(self, values: Mapping[str, str]) -> ChatPrompt:
        """This prompt with its constant fields (e.g. the instruction) filled in."""
        for name, value in values.items():
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{self.name}'s {name} must be a non-empty string")
        return ChatPrompt(self.name, self.version, self.template, self.columns, self.truncate,
                          self.max_tokens, self.system, tuple(sorted(values.items())))

    def describe_truncation(self) -> str:
        parts = [f"{c} cut to {n} tokens from the {'end' if side == 'right' else 'start'}"
                 for c, side, n in zip(self.columns, self.truncate, self.max_tokens,
                                       strict=True)]
        return f"prompt {self.key}; " + ", ".join(parts)

    def __call__(self, lm: CausalLM, row: Any) -> list[int] | None:
        texts = row if isinstance(row, (tuple, list)) else (row,)
        if len(texts) != len(self.columns):
            raise DataError(f"{self.name} takes {len(self.columns)} texts per row, got "
                            f"{len(texts)}")
        tok = lm.tokenizer
        fields = {name: defuse(value, tok) for name, value in self.constants}
        for column, text, side, limit in zip(self.columns, texts, self.truncate,
                                             self.max_tokens, strict=True):
            if not isinstance(text, str) or not text.strip():
                return None
            text = defuse(text.strip(), tok)  # row text cannot open a turn of the chat
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) > limit:
                text = tok.decode(truncate_ids(ids, limit, side)).strip()
            fields[column] = text
        return chat_prompt(lm, self.template.format(**fields), self.system)


SEM_MAP = ChatPrompt(
    "sem_map", "v1",
    "{instruction}\n\nText: {text}",
    ("text",), ("right",), (384,))

SEM_FILTER_CHOICE = ChatPrompt(
    "sem_filter_choice", "v1",
    "Text: {text}\n\nStatement: {predicate}.\nIs the statement true of the text?\n- yes\n- no\n"
    "Answer with the option only.",
    ("text",), ("right",), (256,),
    system="You judge statements about texts. Reply with exactly one of the options given.")

#: sem_join's pair question (``ken/ops/sem_join.py``): the two sides, then the predicate
SEM_JOIN = ChatPrompt(
    "sem_join", "v1",
    "Text A: {left}\n\nText B: {right}\n\nStatement: {predicate}.\nIs the statement true of "
    "text A and text B?\n- yes\n- no\nAnswer with the option only.",
    ("left", "right"), ("right", "right"), (192, 192),
    system="You judge statements about pairs of texts. Reply with exactly one of the options "
           "given.")

SEM_MAP_TYPED = ChatPrompt(
    "sem_map_typed", "v1",
    "{instruction}\n\nText: {text}\n\n{answer_form}",
    ("text",), ("right",), (384,))

SEM_EXTRACT = ChatPrompt(
    "sem_extract", "v1",
    "From the text below, extract {what}. Answer with the exact words from the text and "
    "nothing else. If the text does not mention it, answer: none\n\nText: {text}",
    ("text",), ("right",), (384,))

SEM_QA = ChatPrompt(
    "sem_qa", "v1",
    "Read the passage and answer the question with a short answer (a few words, taken from "
    "the passage).\n\nPassage: {context}\n\nQuestion: {question}",
    ("question", "context"), ("right", "right"), (64, 448))

SEM_CHOICE = ChatPrompt(
    "sem_choice", "v2",
    "Text: {text}\n\nWhich one of these options describes the text?\n{options}\nAnswer with "
    "the option only.",
    ("text",), ("right",), (256,),
    system="You classify texts. Reply with exactly one of the options given.")


SEM_SCORE = ChatPrompt(
    "sem_score", "v1",
    "Text: {text}\n\n{rubric}\nRate the text on the scale from {lo} to {hi}. Answer with "
    "the number only.",
    ("text",), ("right",), (256,),
    system="You rate texts. Reply with exactly one whole number on the scale given.")

#: sem_agg's prompts (``ken/ops/sem_agg.py``): a block of numbered texts, then a block of
#: numbered partial answers; the texts are cut and packed by the operator, not here
SEM_AGG_LEAF = ChatPrompt(
    "sem_agg_leaf", "v1",
    "Texts:\n{texts}\n\n{instruction}\nAnswer briefly, about all the texts together.",
    ("texts",), ("right",), (1024,),
    system="You answer an instruction about a list of texts.")

SEM_AGG_REDUCE = ChatPrompt(
    "sem_agg_reduce", "v1",
    "Partial answers, each about one part of a list of texts:\n{texts}\n\nCombine them into "
    "one brief answer to this instruction about the whole list: {instruction}",
    ("texts",), ("right",), (1024,),
    system="You combine partial answers into one answer.")


def option_list(options: tuple[str, ...]) -> str:
    """The options as the choice prompts list them: one per line, each after a dash."""
    return "\n".join(f"- {o}" for o in options)


#: answers that mean "not in the text" for sem_extract (compared lower-cased, without a
#: final full stop)
NONE_ANSWERS = frozenset({"", "none", "n/a", "na", "not mentioned", "nothing",
                          "unknown"})


def extracted_value(answer: str, row: Any = None) -> str | None:
    """sem_extract's SQL value of an answer: None when the model says it is absent; else, when
    the row's text is given, the span of that text the answer names (:func:`text_span`), or
    None when the answer is not in the text."""
    answer = answer.strip().strip('"').strip()
    if answer.lower().rstrip(".") in NONE_ANSWERS:
        return None
    if row is None:
        return answer
    text = row[0] if isinstance(row, (tuple, list)) else row
    return text_span(answer, text) if isinstance(text, str) else None


_WORD = re.compile(r"\w+", re.UNICODE)


def text_span(answer: str, text: str) -> str | None:
    """The part of ``text`` that ``answer`` quotes, in the text's own spelling: the answer
    itself when it occurs in the text (ignoring case and a final full stop); else the longest
    run of the answer's words that occurs in the text word for word, if it covers at least half
    of the answer's words (``"Berlin, Germany"`` in "I moved to Berlin" gives ``"Berlin"``);
    else None (the answer is not in the text)."""
    for candidate in (answer, answer.rstrip(".").strip()):
        if candidate:
            at = text.lower().find(candidate.lower())
            if at >= 0:
                return text[at:at + len(candidate)]
    words = [m.group().lower() for m in _WORD.finditer(answer)]
    spans = list(_WORD.finditer(text))
    lowered = [m.group().lower() for m in spans]
    best, where = 0, -1
    for i in range(len(lowered)):
        for j in range(len(words)):
            k = 0
            while i + k < len(lowered) and j + k < len(words) and lowered[i + k] == words[j + k]:
                k += 1
            if k > best:
                best, where = k, i
    if not words or best == 0 or 2 * best < len(words):
        return None
    return text[spans[where].start():spans[where + best - 1].end()]
