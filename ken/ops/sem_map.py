"""``sem_map(text, 'instruction') -> VARCHAR``: the LLM's answer to an instruction about a text;
``sem_map(text, 'instruction' RETURNS INTEGER | DOUBLE | BOOLEAN)``: the answer as that type.

Greedy generation (at most 48 new tokens) with the versioned prompt ``sem_map/v1``
(``ken/ops/prompts.py``); texts over 384 tokens keep their start. The cascade runs the
smaller LM first and escalates answers whose length-normalised sequence probability is below
the threshold. No built-in evaluation sample: register a copy with ``sample=`` to plan it.

With ``RETURNS`` after the instruction (SQL rewrites ``'...' RETURNS INTEGER`` into the
constant ``'... RETURNS INTEGER'``, which may also be written so), the prompt
``sem_map_typed/v1`` asks for the answer in that form ("Answer with one whole number only",
"... yes or no only") in a few tokens, and the value is parsed from the answer: the first number
(digits, with thousands separators, or a number word up to twenty) for INTEGER and DOUBLE
(INTEGER: NULL unless whole), yes/no/true/false for BOOLEAN. An answer that does not parse is
NULL, so the column always has the asked type. ``RETURNS STRUCT(name VARCHAR, year INTEGER)``
asks for one JSON object with those keys (generation stops at its first ``}``) and gives a
STRUCT column: each field parsed as its type (NULL when absent or unparsable; the whole
record NULL when no field parses).

>>> # session.sql("SELECT sem_map(review, 'Summarise in five words') FROM reviews")
>>> # session.sql("SELECT sem_map(review, 'How many stars, 1 to 5?' RETURNS INTEGER) FROM reviews")
>>> # session.sql("SELECT sem_map(bio, 'Who and when?' RETURNS STRUCT(name VARCHAR, born INT)) "
>>> #             "FROM people")
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

from ken.errors import DataError
from ken.models.llm import GenerativeModel
from ken.models.model import DeviceConfig, Model
from ken.models.resources import Resources, short_hash
from ken.ops.base import (
    FIELD_NAME,
    Bound,
    OpContext,
    Stage,
    sql_type,
    struct_fields,
    struct_output_type,
)
from ken.ops.llm_operator import LLMOperator, stage_prefix
from ken.ops.prompts import SEM_MAP, SEM_MAP_TYPED

MAX_NEW_TOKENS = 48
#: what ``RETURNS`` may name -> (the SQL type, what the prompt asks for, new tokens at most)
RETURN_TYPES = {
    "integer": ("bigint", "Answer with one whole number only, in digits.", 12),
    "double": ("double", "Answer with one number only, in digits.", 16),
    "boolean": ("boolean", "Answer yes or no only.", 3),
    "varchar": ("varchar", "", MAX_NEW_TOKENS),
}
ALIASES = {"int": "integer", "bigint": "integer", "float": "double", "real": "double",
           "bool": "boolean", "text": "varchar"}
_RETURNS = re.compile(r"^(.*?)\s+RETURNS\s+(STRUCT\s*\((.*)\)|[A-Za-z]+)\s*$",
                      re.DOTALL | re.IGNORECASE)
#: how a STRUCT's prompt names each field's form, and the new tokens a field may take
FIELD_FORMS = {"integer": ("a whole number", 8), "double": ("a number", 10),
               "boolean": ("true or false", 4), "varchar": ("text", 24)}
STRUCT_MAX_NEW_TOKENS = 128
_PAIR = re.compile(r'"([A-Za-z_][A-Za-z0-9_]*)"\s*:\s*(?:"([^"]*)"|([^,}\n]+))')
_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty".split())}
_NUMBER = re.compile(r"(?P<digits>[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+)"
                     r"|\b(?P<word>" + "|".join(_WORDS) + r")\b", re.IGNORECASE)


def _kind(name: str) -> str:
    kind = name.lower()
    return ALIASES.get(kind, kind)


def split_returns(instruction: str) -> tuple[str, str]:
    """``'How many? RETURNS INT'`` -> ``('How many?', 'integer')``; ``'... RETURNS STRUCT(name
    VARCHAR, year INT)'`` -> ``('...', 'struct(name varchar, year integer)')``; no
    ``RETURNS``: varchar."""
    match = _RETURNS.match(instruction)
    if not match:
        return instruction, "varchar"
    if not match.group(1).strip():
        raise DataError("sem_map needs an instruction before RETURNS")
    if match.group(3) is not None:
        return match.group(1).strip(), struct_output_type(struct_spec(match.group(3)))
    kind = _kind(match.group(2))
    if kind == "struct":
        raise DataError("sem_map RETURNS STRUCT needs its fields: STRUCT(name VARCHAR, "
                        "year INTEGER)")
    if kind not in RETURN_TYPES:
        raise DataError(f"sem_map cannot return {match.group(2)!r}: use RETURNS INTEGER, "
                        "DOUBLE, BOOLEAN, VARCHAR or STRUCT(name TYPE, ...) of them")
    return match.group(1).strip(), kind


def struct_spec(body: str) -> tuple[tuple[str, str], ...]:
    """The ``(name, kind)`` fields of ``STRUCT(...)``'s body, each kind one of
    :data:`RETURN_TYPES` (DataError naming what is wrong)."""
    fields: list[tuple[str, str]] = []
    for part in body.split(","):
        words = part.split()
        if len(words) != 2 or not FIELD_NAME.fullmatch(words[0]):
            raise DataError(f"sem_map STRUCT fields are written NAME TYPE (a plain name, then "
                            f"INTEGER, DOUBLE, BOOLEAN or VARCHAR), not {part.strip()!r}")
        kind = _kind(words[1])
        if kind not in RETURN_TYPES:
            raise DataError(f"a sem_map STRUCT field cannot be {words[1]!r}: use INTEGER, "
                            "DOUBLE, BOOLEAN or VARCHAR")
        if words[0].lower() in {n.lower() for n, _ in fields}:
            raise DataError(f"sem_map STRUCT names the field {words[0]!r} twice")
        fields.append((words[0], kind))
    return tuple(fields)


def sql_output_type(instruction: str) -> str:
    """The output type ``instruction``'s ``RETURNS`` asks for (``bigint``, ``struct(name
    varchar, year bigint)``, ...)."""
    kind = split_returns(instruction)[1]
    fields = struct_fields(kind)
    if fields is None:
        return RETURN_TYPES[kind][0]
    return struct_output_type([(n, RETURN_TYPES[k][0]) for n, k in fields])


def parse_number(answer: str) -> float | None:
    """The first number of an answer: digits (``1,250``, ``-3.5``) or a word up to twenty."""
    match = _NUMBER.search(answer)
    if match is None:
        return None
    if match.group("digits"):
        return float(match.group("digits").replace(",", ""))
    return float(_WORDS[match.group("word").lower()])


def typed_value(kind: str, answer: str) -> Any:
    """The value of an answer as ``kind`` (see the module docstring); None if it does not
    parse."""
    answer = answer.strip()
    if kind == "varchar":
        return answer
    if kind == "boolean":
        first = re.findall(r"[a-z]+", answer.lower())[:1]
        return {"yes": True, "true": True, "no": False, "false": False}.get(
            first[0] if first else "")
    number = parse_number(answer)
    if number is None:
        return None
    if kind == "integer":
        return int(number) if number.is_integer() else None
    return number


def struct_value(fields: tuple[tuple[str, str], ...], answer: str) -> dict | None:
    """The record a JSON-object answer holds: each field's value parsed as its kind (NULL when
    absent or unparsable); None when no field of the answer could be read."""
    start = answer.find("{")
    if start < 0:
        return None
    text = answer[start:]
    found: dict[str, Any] = {}
    try:
        obj = json.loads(text if text.rstrip().endswith("}") else text + "}")
        if isinstance(obj, dict):
            found = {str(k).lower(): v for k, v in obj.items()}
    except ValueError:  # not JSON: read "key": value pairs one by one
        for key, quoted, bare in _PAIR.findall(text):
            found[key.lower()] = quoted if quoted else bare.strip()
    if not found:
        return None
    out: dict[str, Any] = {}
    for name, kind in fields:
        value = found.get(name.lower())
        if value is None or isinstance(value, (dict, list)):
            out[name] = None
        elif isinstance(value, bool):
            out[name] = value if kind == "boolean" else typed_value(kind, str(value).lower())
        else:
            out[name] = typed_value(kind, str(value))
    return out if any(v is not None for v in out.values()) else None


class StructAnswer:
    """``finish(answer, row)`` of a STRUCT stage (a picklable callable)."""

    def __init__(self, fields: tuple[tuple[str, str], ...]) -> None:
        self.fields = fields

    def __call__(self, answer: str, row: Any = None) -> Any:
        return struct_value(self.fields, answer)


class TypedAnswer:
    """``finish(answer, row)`` of a typed stage (a picklable callable)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, answer: str, row: Any = None) -> Any:
        return typed_value(self.kind, answer)


def load_map_stage(resources: Resources, device: DeviceConfig, name: str, lm_name: str,
                   instruction: str) -> Model:
    text, kind = split_returns(instruction)
    lm = resources.causal_lm(lm_name, device)
    if kind == "varchar":
        prompt = SEM_MAP.with_constants({"instruction": text})
        return GenerativeModel(lm, prompt, name, "sem-map", SEM_MAP.key, MAX_NEW_TOKENS)
    fields = struct_fields(kind)
    if fields is not None:
        form = ("Answer with one JSON object and nothing else, with the keys "
                + ", ".join(f'"{n}" ({FIELD_FORMS[k][0]})' for n, k in fields) + ".")
        max_new = min(STRUCT_MAX_NEW_TOKENS, 8 + sum(FIELD_FORMS[k][1] + 4 for _, k in fields))
        prompt = SEM_MAP_TYPED.with_constants({"instruction": text, "answer_form": form})
        return GenerativeModel(lm, prompt, name, "sem-map", SEM_MAP_TYPED.key, max_new,
                               stop=("}",), finish=StructAnswer(fields))
    _, form, max_new = RETURN_TYPES[kind]
    prompt = SEM_MAP_TYPED.with_constants({"instruction": text, "answer_form": form})
    return GenerativeModel(lm, prompt, name, "sem-map", SEM_MAP_TYPED.key, max_new,
                           stop=("\n",), finish=TypedAnswer(kind))


class SemMap(LLMOperator):
    name = "sem_map"
    num_columns = 1
    constants = ("instruction",)
    output_type = "varchar"
    plan_kind = "generation"
    doc = ("the LLM's answer to an instruction about the text (generated); "
           "'...' RETURNS INTEGER / DOUBLE / BOOLEAN / STRUCT(name TYPE, ...) for a typed "
           "answer")

    def llm_stage(self, lm_name: str, constants: tuple[str, ...]) -> Stage:
        split_returns(constants[0])  # a bad type fails at bind, before any model loads
        name = f"{stage_prefix(self.name, lm_name)}[{short_hash(SEM_MAP.key, constants)}]"
        return Stage(name, load_map_stage, (name, lm_name, constants[0]))

    def bind(self, ctx: OpContext, constants: tuple[str, ...]) -> Bound:
        bound = super().bind(ctx, constants)
        return replace(bound, output_type=sql_output_type(constants[0]))  # type: ignore[type-var]

    def detail(self, constants: tuple[str, ...]) -> str:
        kind = split_returns(constants[0])[1]
        if struct_fields(kind) is not None:
            return (f"returns {sql_type(sql_output_type(constants[0]))}: greedy JSON object, "
                    f"each field parsed (NULL when it does not parse); "
                    f"{SEM_MAP_TYPED.describe_truncation()}")
        if kind == "varchar":
            return f"greedy, <= {MAX_NEW_TOKENS} new tokens; {SEM_MAP.describe_truncation()}"
        return (f"returns {kind.upper()}: greedy, <= {RETURN_TYPES[kind][2]} new tokens, "
                f"parsed (NULL when the answer does not parse); "
                f"{SEM_MAP_TYPED.describe_truncation()}")


OPERATOR = SemMap
