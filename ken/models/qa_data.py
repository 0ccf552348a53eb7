"""Readers for the MultiModalQA and HybridQA question-answering benchmarks (DESIGN.md s. 12).

Both readers return one :class:`QAData`: the questions (:class:`QAQuestion`), the passages
(:class:`Passage`) and tables (:class:`Table`) they are asked over, the files read and counts
per status and per question type. :func:`to_duckdb` loads the passages and table rows into
DuckDB, where a question becomes a query over them.

MultiModalQA (Talmor et al., ICLR 2021; github.com/allenai/multimodalqa, ``dataset/``) is read
from the official files ``MMQA_{split}.jsonl.gz``, ``MMQA_texts.jsonl.gz`` and
``MMQA_tables.jsonl.gz`` in a folder the user names, or, when those are not all there, from the
100-question slice ``MMQA_{split}_n100.jsonl.gz``, ``MMQA_texts_n100.jsonl.gz``,
``MMQA_tables_n100.jsonl.gz`` (same format; ``QAData.variant`` says which was read). Only the
passages and tables that the split's questions refer to are kept: the official texts file
holds the passages of every split (46 MB compressed), and is read line by line.

A question's type is ``metadata.type``, e.g. ``TextQ``, ``TableQ``, ``Compose(TextQ,TableQ)``.
In ``Compose(A,B)`` the hop B runs first and its answer goes into the question of hop A (so
``Compose(TextQ,TableQ)`` finds an entity in the table, then answers from a passage about it).

HybridQA (Chen et al., EMNLP Findings 2020; github.com/wenhuchen/HybridQA) is read from
``dev_questions.json`` and ``tables_with_passages.jsonl.gz`` (the layout of ``../shared/data``).
It has no question types; a question's type is where its answer lies, found as the official
``trace_answer.py`` does and as ``evaluate_script.py`` splits its scores: ``table`` (the answer
is a cell or a whole-word part of one), ``passage`` (it is in a passage linked from a cell),
``other`` (in neither: counts, sums, rephrased answers); ``unknown`` when its table is absent.

Statuses (:data:`STATUSES`): ``ok``; ``image`` (the question needs an image: counted, not
answered here); ``missing context`` (a passage or table of its supporting context, or the
table it asks, is not in the files read; ``QAQuestion.missing`` names them).

DuckDB tables written by :func:`to_duckdb` (names take an optional prefix)::

    questions(qid VARCHAR, question VARCHAR, qtype VARCHAR, status VARCHAR,
              modalities VARCHAR[], answers VARCHAR[], table_id VARCHAR,
              text_doc_ids VARCHAR[])
    passages(doc_id VARCHAR, title VARCHAR, url VARCHAR, text VARCHAR)
    table_rows(table_id VARCHAR, table_title VARCHAR, section_title VARCHAR,
               row_index INTEGER, header VARCHAR[], cells VARCHAR[], row_text VARCHAR)
    row_links(table_id VARCHAR, row_index INTEGER, column_index INTEGER,
              column_name VARCHAR, cell VARCHAR, link VARCHAR, doc_id VARCHAR)

``row_index`` counts a table's data rows from 0, without the header. ``row_text`` is the row
as "column: value; column: value" (empty cells left out). ``row_links`` has one row per link
of a cell: for HybridQA ``link`` is ``/wiki/Title`` and ``doc_id`` the passage of that id
(join ``passages`` for its text; copying the text into every link row would repeat 84 MB of
HybridQA passages); for MultiModalQA ``link`` is a Wikipedia URL and ``doc_id`` is the
passage with that URL when exactly one passage has it, else NULL (an article can have several
passages; join ``passages`` on ``url`` for all of them).

Example::

    data = read_mmqa("../shared/data/mmqa")      # the n100 slice when the full files are absent
    data.status_counts                           # {"ok": ..., "image": ..., "missing context": ...}
    to_duckdb(data, duckdb.connect())            # {"questions": 100, "passages": 925, ...}
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import duckdb
import pyarrow as pa

from ken.errors import DataError

OK = "ok"
IMAGE = "image"
MISSING = "missing context"
STATUSES = (OK, IMAGE, MISSING)

MMQA_FILES = ("MMQA_{split}.jsonl.gz", "MMQA_texts.jsonl.gz", "MMQA_tables.jsonl.gz")
MMQA_SLICE_FILES = ("MMQA_{split}_n100.jsonl.gz", "MMQA_texts_n100.jsonl.gz",
                    "MMQA_tables_n100.jsonl.gz")
HYBRIDQA_FILES = ("dev_questions.json", "tables_with_passages.jsonl.gz")
WIKI = "https://en.wikipedia.org"

_T = TypeVar("_T")


@dataclass(frozen=True)
class QAQuestion:
    """One question with its gold answer and the documents it is asked over.

    ``answers`` are the parts of the one gold answer (MultiModalQA list answers have several
    parts; HybridQA answers have one). ``intermediate_answers`` are the gold answers of the
    first hops of multi-hop questions (MultiModalQA only). ``supporting_context`` lists
    ``(doc_id, part)`` with part ``text``, ``table`` or ``image``.
    """

    qid: str
    question: str
    qtype: str
    modalities: tuple[str, ...]
    answers: tuple[str, ...]
    answer_modality: str
    text_doc_ids: tuple[str, ...]
    table_id: str | None
    image_doc_ids: tuple[str, ...] = ()
    intermediate_answers: tuple[tuple[str, ...], ...] = ()
    supporting_context: tuple[tuple[str, str], ...] = ()
    status: str = OK
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class Passage:
    """A Wikipedia passage (MultiModalQA: a section of an article; HybridQA: its intro)."""

    doc_id: str
    title: str
    url: str
    text: str


@dataclass(frozen=True, eq=False)
class Table:
    """A Wikipedia table: header names and rows of cell strings.

    ``links[r][c]`` are the link targets of cell ``rows[r][c]`` (HybridQA ``/wiki/X``,
    MultiModalQA URLs). ``passages`` maps each HybridQA link to its passage text (empty for
    MultiModalQA, whose passages are separate documents).
    """

    table_id: str
    title: str
    url: str
    section_title: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    links: tuple[tuple[tuple[str, ...], ...], ...]
    intro: str = ""
    section_text: str = ""
    passages: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}),
                                        repr=False)

    def row_text(self, index: int) -> str:
        """Row ``index`` as "column: value; column: value", empty cells left out."""
        parts = []
        for name, value in zip(self.header, self.rows[index], strict=False):
            if value.strip():
                parts.append(f"{name}: {value}" if name.strip() else value)
        return "; ".join(parts)


@dataclass(frozen=True, eq=False)
class QAData:
    """What a reader returns: questions, their documents, the files read and counts.

    ``variant`` is ``official`` or ``n100`` (MultiModalQA) or ``dev`` (HybridQA).
    """

    dataset: str
    variant: str
    directory: Path
    files: tuple[str, ...]
    questions: tuple[QAQuestion, ...] = field(repr=False)
    passages: Mapping[str, Passage] = field(repr=False)
    tables: Mapping[str, Table] = field(repr=False)
    status_counts: Mapping[str, int] = field(init=False)
    type_counts: Mapping[str, int] = field(init=False)

    def __post_init__(self) -> None:
        statuses = Counter(q.status for q in self.questions)
        object.__setattr__(self, "status_counts",
                           MappingProxyType({s: statuses.get(s, 0) for s in STATUSES}))
        types = Counter(q.qtype for q in self.questions)
        object.__setattr__(self, "type_counts", MappingProxyType(dict(sorted(types.items()))))

    def __len__(self) -> int:
        return len(self.questions)

    @property
    def answerable(self) -> tuple[QAQuestion, ...]:
        """The questions with status ``ok`` (text and table questions with all context)."""
        return tuple(q for q in self.questions if q.status == OK)


# --- reading files ----------------------------------------------------------------------------


def _jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line of a gzip-compressed JSON-lines file."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}, line {number}: not valid JSON ({err.msg}, column "
                                    f"{err.colno}); the file is damaged, fetch it again") from err
                if not isinstance(record, dict):
                    raise DataError(f"{path}, line {number}: expected a JSON object, found "
                                    f"{type(record).__name__}")
                yield number, record
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read it as gzip-compressed UTF-8 JSON lines ({err}); "
                        "fetch the file again") from err


def _field_error(where: str, err: Exception) -> DataError:
    what = f"missing field {err.args[0]!r}" if isinstance(err, KeyError) else str(err)
    return DataError(f"{where}: {what} (not the expected MultiModalQA/HybridQA format)")


def _parsed(path: Path, parse: Callable[[dict], _T]) -> Iterator[_T]:
    """``parse`` of each line of ``path``; a malformed record names the file and line."""
    for number, record in _jsonl(path):
        try:
            yield parse(record)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
            raise _field_error(f"{path}, line {number}", err) from err


def _folder(directory: str | Path, what: str, looked_for: Iterable[str]) -> Path:
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        raise DataError(f"{what} folder {folder} does not exist; pass the folder that holds "
                        f"{', '.join(looked_for)} (e.g. --data-dir)")
    return folder


# --- MultiModalQA -----------------------------------------------------------------------------


def _mmqa_paths(folder: Path, split: str) -> tuple[str, tuple[Path, ...]]:
    """The official files when all three are there, else the n100 slice, else a DataError."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", split):
        raise DataError(f"MultiModalQA split {split!r} is not a split name (dev, train, test)")
    choices = (("official", MMQA_FILES), ("n100", MMQA_SLICE_FILES))
    for variant, names in choices:
        paths = tuple(folder / name.format(split=split) for name in names)
        if all(p.is_file() for p in paths):
            return variant, paths
    wanted = [name.format(split=split) for _, names in choices for name in names]
    present = [name for name in wanted if (folder / name).is_file()]
    raise DataError(
        f"MultiModalQA files not found in {folder}: looked for "
        f"{', '.join(wanted[:3])} (official) or {', '.join(wanted[3:])} (100-question slice); "
        f"found {', '.join(present) if present else 'none of them'}. Download the official "
        "files from github.com/allenai/multimodalqa (dataset/) into that folder")


def _answer_texts(answers: Iterable[dict]) -> tuple[str, ...]:
    """Answer strings as the official evaluation takes them (``str`` of numbers too)."""
    return tuple(str(a["answer"]) for a in answers)


def _mmqa_question(record: dict) -> QAQuestion:
    meta = record["metadata"]
    answers = record.get("answers", [])  # the test split has none
    modalities = {a["modality"] for a in answers}
    return QAQuestion(
        qid=str(record["qid"]),
        question=str(record["question"]),
        qtype=str(meta["type"]),
        modalities=tuple(meta.get("modalities", ())),
        answers=_answer_texts(answers),
        answer_modality=next(iter(modalities)) if len(modalities) == 1 else "",
        text_doc_ids=tuple(meta.get("text_doc_ids", ())),
        table_id=meta.get("table_id") or None,
        image_doc_ids=tuple(meta.get("image_doc_ids", ())),
        intermediate_answers=tuple(_answer_texts(hop)
                                   for hop in meta.get("intermediate_answers", ())),
        supporting_context=tuple((str(s["doc_id"]), str(s["doc_part"]))
                                 for s in record.get("supporting_context", ())),
    )


def read_mmqa_questions(path: str | Path) -> tuple[QAQuestion, ...]:
    """The questions of one MultiModalQA questions file (e.g. to train on), without their
    documents; statuses are not checked."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"MultiModalQA questions file {path} does not exist")
    return tuple(_parsed(path, _mmqa_question))


def _mmqa_passage(record: dict) -> Passage:
    return Passage(str(record["id"]), str(record.get("title", "")), str(record.get("url", "")),
                   str(record["text"]))


def _mmqa_table(record: dict) -> Table:
    table = record["table"]
    rows = table["table_rows"]
    return Table(
        table_id=str(record["id"]),
        title=str(record.get("title", "")),
        url=str(record.get("url", "")),
        section_title=str(table.get("table_name", "")),
        header=tuple(str(h["column_name"]) for h in table["header"]),
        rows=tuple(tuple(str(cell["text"]) for cell in row) for row in rows),
        links=tuple(tuple(tuple(str(link["url"]) for link in cell.get("links", ()))
                          for cell in row) for row in rows),
    )


def _needs_image(q: QAQuestion) -> bool:
    return ("Image" in q.qtype or "image" in q.modalities
            or any(part == "image" for _, part in q.supporting_context))


def _mmqa_needed(q: QAQuestion) -> tuple[list[str], list[str]]:
    """``(passage ids, table ids)`` a text/table question needs: the passages and tables of
    its supporting context, and its table when it asks the table. (The other candidate
    passages in ``text_doc_ids`` are distractors: one absent does not stop an answer.)"""
    texts = [d for d, part in q.supporting_context if part == "text"]
    tables = [d for d, part in q.supporting_context if part == "table"]
    if "table" in q.modalities and q.table_id:
        tables.append(q.table_id)
    return list(dict.fromkeys(texts)), list(dict.fromkeys(tables))


def _with_status(q: QAQuestion, passages: Mapping[str, Passage],
                 tables: Mapping[str, Table]) -> QAQuestion:
    if _needs_image(q):
        return replace(q, status=IMAGE)
    texts, tabs = _mmqa_needed(q)
    missing = tuple([d for d in texts if d not in passages] + [t for t in tabs if t not in tables])
    return replace(q, status=MISSING if missing else OK, missing=missing)


def _referenced(questions: Iterable[QAQuestion]) -> set[str]:
    ids: set[str] = set()
    for q in questions:
        ids.update(q.text_doc_ids)
        ids.update(d for d, _ in q.supporting_context)
        if q.table_id:
            ids.add(q.table_id)
    return ids


def read_mmqa(directory: str | Path, split: str = "dev") -> QAData:
    """MultiModalQA ``split`` from ``directory`` (official files, else the n100 slice).

    Passages and tables that no question of the split refers to are skipped while reading.
    Raises :class:`DataError` naming the folder and files when they are not there, and the
    file and line of a malformed record.
    """
    folder = _folder(directory, "MultiModalQA", [n.format(split=split) for n in MMQA_FILES])
    variant, (questions_path, texts_path, tables_path) = _mmqa_paths(folder, split)
    raw = tuple(_parsed(questions_path, _mmqa_question))
    wanted = _referenced(raw)
    passages = {p.doc_id: p for p in _parsed(texts_path, _mmqa_passage) if p.doc_id in wanted}
    tables = {t.table_id: t for t in _parsed(tables_path, _mmqa_table) if t.table_id in wanted}
    questions = tuple(_with_status(q, passages, tables) for q in raw)
    return QAData("mmqa", variant, folder,
                  tuple(p.name for p in (questions_path, texts_path, tables_path)), questions,
                  MappingProxyType(passages), MappingProxyType(tables))


# --- HybridQA ---------------------------------------------------------------------------------


def _cell(cell: Any) -> tuple[str, tuple[str, ...]]:
    """A HybridQA cell ``[text, [links]]`` as ``(text, links)``."""
    text, links = cell
    return str(text), tuple(str(link) for link in links)


def _hybridqa_table(record: dict) -> Table:
    rows = [[_cell(c) for c in row] for row in record["data"]]
    return Table(
        table_id=str(record["table_id"]),
        title=str(record.get("title", "")),
        url=str(record.get("url", "")),
        section_title=str(record.get("section_title", "")),
        header=tuple(_cell(c)[0] for c in record["header"]),
        rows=tuple(tuple(text for text, _ in row) for row in rows),
        links=tuple(tuple(links for _, links in row) for row in rows),
        intro=str(record.get("intro", "")),
        section_text=str(record.get("section_text", "")),
        passages=MappingProxyType({str(k): str(v) for k, v in record.get("passages", {}).items()}),
    )


def _link_passage(link: str, text: str) -> Passage:
    title = link.removeprefix("/wiki/").replace("_", " ")
    return Passage(link, title, WIKI + link if link.startswith("/wiki/") else link, text)


def _padded_in(needle: str, haystack: str) -> bool:
    return needle == haystack or f" {needle} " in f" {haystack} "


def _answer_location(answer: str, table: Table) -> str:
    """``table``, ``passage`` or ``other``: where the answer is (official trace_answer rule:
    case-insensitive, a whole cell or a space-delimited part of a cell or linked passage)."""
    needle = answer.lower().strip()
    if not needle:
        return "other"
    if any(_padded_in(needle, cell.lower()) for row in table.rows for cell in row):
        return "table"
    linked = {link for row in table.links for links in row for link in links}
    if any(_padded_in(needle, text.lower())
           for link, text in table.passages.items() if link in linked):
        return "passage"
    return "other"


_HYBRID_MODALITIES = {"table": ("table",), "passage": ("table", "text"),
                      "other": ("table", "text"), "unknown": ("table", "text")}
_HYBRID_ANSWER_MODALITY = {"table": "table", "passage": "text", "other": "", "unknown": ""}


def _hybridqa_question(record: dict, tables: Mapping[str, Table]) -> QAQuestion:
    table_id = str(record["table_id"])
    answer = str(record["answer-text"])
    table = tables.get(table_id)
    where = _answer_location(answer, table) if table else "unknown"
    links = (tuple(dict.fromkeys(link for row in table.links for cell in row for link in cell))
             if table else ())
    return QAQuestion(
        qid=str(record["question_id"]),
        question=str(record["question"]),
        qtype=where,
        modalities=_HYBRID_MODALITIES[where],
        answers=(answer,),
        answer_modality=_HYBRID_ANSWER_MODALITY[where],
        text_doc_ids=links,
        table_id=table_id,
        supporting_context=((table_id, "table"),),
        status=OK if table else MISSING,
        missing=() if table else (table_id,),
    )


def _hybridqa_records(path: Path) -> list[dict]:
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}, line {err.lineno}: not valid JSON ({err.msg}); the file is "
                        "damaged, fetch it again") from err
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read it ({err})") from err
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise DataError(f"{path}: expected a JSON list of question objects")
    return records


def read_hybridqa(directory: str | Path) -> QAData:
    """HybridQA dev questions and all tables (with their linked passages) from ``directory``.

    A question whose table is not in the tables file has status ``missing context``.
    """
    folder = _folder(directory, "HybridQA", HYBRIDQA_FILES)
    questions_path, tables_path = (folder / name for name in HYBRIDQA_FILES)
    absent = [p.name for p in (questions_path, tables_path) if not p.is_file()]
    if absent:
        raise DataError(f"HybridQA files not found in {folder}: looked for "
                        f"{', '.join(HYBRIDQA_FILES)}; missing {', '.join(absent)}")
    records = _hybridqa_records(questions_path)
    tables = {t.table_id: t for t in _parsed(tables_path, _hybridqa_table)}
    passages: dict[str, Passage] = {}
    for table in tables.values():
        for link, text in table.passages.items():
            if link not in passages:
                passages[link] = _link_passage(link, text)
    questions = []
    for index, record in enumerate(records):
        try:
            questions.append(_hybridqa_question(record, tables))
        except (KeyError, TypeError, ValueError) as err:
            raise _field_error(f"{questions_path}, question {index}", err) from err
    return QAData("hybridqa", "dev", folder, HYBRIDQA_FILES, tuple(questions),
                  MappingProxyType(passages), MappingProxyType(tables))


# --- DuckDB -----------------------------------------------------------------------------------

_STRINGS = pa.list_(pa.string())


def _questions_arrow(data: QAData) -> pa.Table:
    qs = data.questions
    return pa.table({
        "qid": pa.array([q.qid for q in qs], pa.string()),
        "question": pa.array([q.question for q in qs], pa.string()),
        "qtype": pa.array([q.qtype for q in qs], pa.string()),
        "status": pa.array([q.status for q in qs], pa.string()),
        "modalities": pa.array([list(q.modalities) for q in qs], _STRINGS),
        "answers": pa.array([list(q.answers) for q in qs], _STRINGS),
        "table_id": pa.array([q.table_id for q in qs], pa.string()),
        "text_doc_ids": pa.array([list(q.text_doc_ids) for q in qs], _STRINGS),
    })


def _passages_arrow(data: QAData) -> pa.Table:
    ps = list(data.passages.values())
    return pa.table({
        "doc_id": pa.array([p.doc_id for p in ps], pa.string()),
        "title": pa.array([p.title for p in ps], pa.string()),
        "url": pa.array([p.url for p in ps], pa.string()),
        "text": pa.array([p.text for p in ps], pa.string()),
    })


def _rows_arrow(data: QAData) -> pa.Table:
    columns: dict[str, list] = {name: [] for name in (
        "table_id", "table_title", "section_title", "row_index", "header", "cells", "row_text")}
    for table in data.tables.values():
        header = list(table.header)
        for index, row in enumerate(table.rows):
            columns["table_id"].append(table.table_id)
            columns["table_title"].append(table.title)
            columns["section_title"].append(table.section_title)
            columns["row_index"].append(index)
            columns["header"].append(header)
            columns["cells"].append(list(row))
            columns["row_text"].append(table.row_text(index))
    types = {"row_index": pa.int32(), "header": _STRINGS, "cells": _STRINGS}
    return pa.table({name: pa.array(values, types.get(name, pa.string()))
                     for name, values in columns.items()})


def _link_doc_ids(data: QAData) -> Callable[[str], str | None]:
    """Maps a cell link to its passage id: HybridQA links are ids; MultiModalQA links are URLs
    and map to the one passage with that URL (None when several or none have it)."""
    if data.dataset == "hybridqa":
        return lambda link: link if link in data.passages else None
    by_url: dict[str, list[str]] = {}
    for p in data.passages.values():
        by_url.setdefault(p.url, []).append(p.doc_id)
    return lambda link: ids[0] if len(ids := by_url.get(link, [])) == 1 else None


def _links_arrow(data: QAData) -> pa.Table:
    doc_id = _link_doc_ids(data)
    columns: dict[str, list] = {name: [] for name in (
        "table_id", "row_index", "column_index", "column_name", "cell", "link", "doc_id")}
    for table in data.tables.values():
        for r, (row, row_links) in enumerate(zip(table.rows, table.links, strict=True)):
            for c, (cell, links) in enumerate(zip(row, row_links, strict=True)):
                for link in links:
                    columns["table_id"].append(table.table_id)
                    columns["row_index"].append(r)
                    columns["column_index"].append(c)
                    columns["column_name"].append(
                        table.header[c] if c < len(table.header) else "")
                    columns["cell"].append(cell)
                    columns["link"].append(link)
                    columns["doc_id"].append(doc_id(link))
    types = {"row_index": pa.int32(), "column_index": pa.int32()}
    return pa.table({name: pa.array(values, types.get(name, pa.string()))
                     for name, values in columns.items()})


def to_duckdb(data: QAData, con: duckdb.DuckDBPyConnection, *, prefix: str = ""
              ) -> dict[str, int]:
    """Create (or replace) the tables ``questions``, ``passages``, ``table_rows`` and
    ``row_links`` (each name prefixed with ``prefix``) in ``con``; returns their row counts.

    The schemas are in the module docstring.
    """
    if prefix and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prefix):
        raise DataError(f"table prefix {prefix!r} is not a plain SQL identifier "
                        "(letters, digits, underscores)")
    built = {"questions": _questions_arrow(data), "passages": _passages_arrow(data),
             "table_rows": _rows_arrow(data), "row_links": _links_arrow(data)}
    counts = {}
    for name, arrow in built.items():
        view = f"__ken_qa_{name}"
        con.register(view, arrow)
        try:
            con.execute(f'CREATE OR REPLACE TABLE "{prefix}{name}" AS SELECT * FROM "{view}"')
        finally:
            con.unregister(view)
        counts[prefix + name] = arrow.num_rows
    return counts
