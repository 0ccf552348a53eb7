"""Multi-hop question answering over passages and tables: ``ken mmqa`` and ``ken hybridqa``.

The questions, passages and table rows of MultiModalQA or HybridQA (``ken.models.qa_data``)
are loaded into the session's DuckDB tables (``questions``, ``passages``, ``table_rows``,
``row_links``), and each question is answered by semantic SQL over them, one question at a
time (so each has its own latency):

- **question type** (MultiModalQA): ``question_type(question)``, a word n-gram classifier
  (``ken.models.ngram``: TF-IDF and a logistic regression) fitted on the text and table
  questions of MultiModalQA that are not evaluated (``MMQA_train.jsonl.gz`` when the folder
  has it, else the other dev questions), picks the
  route: ``TextQ`` (a passage), ``TableQ`` (the table), ``Compose(TextQ,TableQ)`` (the table,
  then a passage about its answer), ``Compose(TableQ,TextQ)`` (a passage, then the table).
  Comparisons and intersections are learnt as the single hop of their first part
  (:func:`route_of`); questions that need images are not answered;
- **retrieval**: the question's candidate passages (its ``text_doc_ids``) or its table's rows
  are ranked by the words they share with the question plus ``sem_similarity(question,
  candidate)`` (``ken.models.retrieval``);
- **reading**: ``text_qa(question, passage)`` answers from the best passage,
  ``table_qa(question, rows)`` from the table title and its three best rows (both are
  ``sem_qa`` under their own names unless the session registers them, so the query optimizer
  can give each its own gear plan: ``ken.multihop_plan``);
- **the hops**: a compose route retrieves twice and reads once: the second hop ranks its
  candidates by the question plus the first hop's bridge (the best table row, or the best
  passage's title), and the reader answers the question from the bridge and the second hop's
  context. Feeding the first hop's *answer* into the second question instead (as
  ImplicitDecomp does with its trained modules) let the small reader answer the whole
  question at the first hop (a year, a role) rather than name the bridge: F1 34.5 against
  36.1 on n100's 62 questions.

HybridQA questions have no type: the question's table rows are ranked by the words they share
with the question (cells, linked titles, linked passages) and ``sem_similarity``
(``ken.models.retrieval``), and ``sem_qa`` reads the table title, the best row and the
sentences of its linked passages that share most words with the question.

Scoring follows the official evaluations (``ken.models.qa_metric``). Image questions and
questions whose context is missing are counted and not answered (their status says why).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ken import store
from ken.engine.deadlines import within
from ken.errors import DataError, EngineBusy, RequestDropped
from ken.models import retrieval
from ken.models.model import Model
from ken.models.ngram import NgramClassifier, fit_ngram_classifier
from ken.models.qa_data import OK, QAData, QAQuestion, read_mmqa_questions, to_duckdb
from ken.models.qa_metric import ScoreRow, Summary, score, summarise
from ken.progress import Reporter
from ken.session import Session

#: the hops of each route, in the order they run
ROUTES: dict[str, tuple[str, ...]] = {
    "TextQ": ("text",),
    "TableQ": ("table",),
    "Compose(TextQ,TableQ)": ("table", "text"),
    "Compose(TableQ,TextQ)": ("text", "table"),
}
OTHER = "other"
ROUTE_LABELS = tuple(ROUTES)  # what the question-type classifier predicts
TABLE_ROWS = 3  # rows of the table the table hop reads
#: rows of the table the HybridQA reader sees, best first: with Qwen2.5-Coder-0.5B reading, F1
#: on the first 150 dev questions was 38.3 with one row, 34.6 with two, 33.5 with three (the
#: gold answer was in the context of 63%, 67% and 70%: more rows distract the small reader)
HYBRID_ROWS = 1
#: characters of context the HybridQA reader sees: the table title and rows first, then
#: linked-passage sentences up to this many in all (at least 300 of them); ``sem_qa`` keeps the
#: start of a context over 448 tokens, about 1,800 characters of English
HYBRID_CONTEXT_CHARS = 1600

_TEXT_CANDIDATES = """
SELECT p.doc_id, p.title, p.text,
       sem_similarity(h.q, p.title || '. ' || p.text) AS score
FROM {hop} h JOIN questions q ON q.qid = h.qid
     JOIN passages p ON list_contains(q.text_doc_ids, p.doc_id)
ORDER BY p.doc_id
"""
_TABLE_CANDIDATES = """
SELECT r.table_title, r.row_index, r.row_text,
       sem_similarity(h.q, r.table_title || '. ' || r.row_text) AS score
FROM {hop} h JOIN questions q ON q.qid = h.qid
     JOIN table_rows r ON r.table_id = q.table_id
ORDER BY r.row_index
"""
_HYBRID_ROWS = """
SELECT r.table_id, r.row_index, r.table_title, r.row_text,
       sem_similarity(h.q, r.row_text) AS score
FROM {hop} h JOIN questions q ON q.qid = h.qid
     JOIN table_rows r ON r.table_id = q.table_id
ORDER BY r.row_index
"""
_TABLE_LINKS = """
SELECT l.row_index, p.title, p.text
FROM row_links l JOIN passages p ON p.doc_id = l.doc_id
WHERE l.table_id = $table_id
ORDER BY l.row_index, l.column_index
"""
#: the function that reads each kind of hop: MultiModalQA's text and table hops are two
#: operators (copies of ``sem_qa`` unless the session registers its own), so that each can be
#: planned and served on its own; HybridQA reads a row and its passages with ``sem_qa``
READERS = {"text": "text_qa", "table": "table_qa", "hybrid": "sem_qa"}


def route_of(qtype: str) -> str:
    """The route that answers a gold question type (what the classifier learns to predict).

    Comparisons and intersections (``Compare(TableQ,...)``, ``Intersect(TableQ,TextQ)``) take
    the single hop of their first text or table part: one of the compared items is often
    the answer. Types that need an image are ``other``: they are not answered."""
    if qtype in ROUTES:
        return qtype
    if "Image" in qtype:
        return OTHER
    parts = [p for p in ("TableQ", "TextQ") if p in qtype]
    return min(parts, key=qtype.index) if parts else OTHER


@dataclass(frozen=True)
class Answered:
    """One question's run: what the pipeline did and how it scored."""

    qid: str
    question: str
    qtype: str  # gold type (HybridQA: where the answer is)
    route: str  # the route the pipeline took
    status: str  # ok | image | missing context | dropped | rejected | error (answer_stream)
    predicted: str | None
    gold: tuple[str, ...]
    em: float
    f1: float
    latency_s: float
    hops: tuple[str, ...] = ()  # HybridQA: the answer; MultiModalQA: the bridge of each hop
    #                             but the last (a table row, a passage title)
    context: str = ""  # the last hop's retrieved context (shortened)
    #: a gold answer appears in the last hop's whole context (case and spacing ignored):
    #: retrieval's recall, whatever the reader made of it
    answer_in_context: bool = False
    reason: str = ""  # dropped, rejected, error: why (where the engine dropped a hop)


@dataclass(frozen=True)
class RunReport:
    dataset: str
    variant: str
    files: tuple[str, ...]
    models: tuple[str, ...]
    answers: tuple[Answered, ...]
    summary: Summary
    type_accuracy: float | None  # MultiModalQA: the question-type classifier on these
    seconds: float

    def to_json(self) -> str:
        return json.dumps({
            "dataset": self.dataset, "variant": self.variant, "files": list(self.files),
            "models": list(self.models), "seconds": self.seconds,
            "type_accuracy": self.type_accuracy, "summary": _summary_dict(self.summary),
            "questions": [asdict(a) for a in self.answers]}, indent=1)


def _summary_dict(summary: Summary) -> dict:
    em_se, f1_se = summary.standard_errors()
    return {"em": summary.em, "f1": summary.f1, "em_se": em_se, "f1_se": f1_se,
            "scored": summary.scored,
            "statuses": dict(summary.statuses),
            "by_type": {t: asdict(s) for t, s in summary.by_type.items()}}


# -- the question-type operator ----------------------------------------------------------------


def training_questions(data: QAData) -> tuple[QAQuestion, ...]:
    """Questions to train the question-type classifier on: the text and table questions of
    ``MMQA_train.jsonl.gz`` when the folder has it, else of the dev questions that are not in
    ``data``."""
    train = data.directory / "MMQA_train.jsonl.gz"
    questions: tuple[QAQuestion, ...] = ()
    if train.is_file():
        questions = read_mmqa_questions(train)
    elif data.variant != "official" and (data.directory / "MMQA_dev.jsonl.gz").is_file():
        evaluated = {q.qid for q in data.questions}
        questions = tuple(q for q in read_mmqa_questions(data.directory / "MMQA_dev.jsonl.gz")
                          if q.qid not in evaluated)
    questions = tuple(q for q in questions if route_of(q.qtype) != OTHER)
    if questions:
        return questions
    raise DataError(f"the question-type classifier needs questions it is not evaluated on: "
                    f"put MMQA_train.jsonl.gz in {data.directory}")


def question_type_model(train: Sequence[QAQuestion], reporter: Reporter) -> NgramClassifier:
    """A word n-gram classifier over :data:`ROUTE_LABELS` fitted on ``train`` (seconds; not
    cached). It routes better than the MiniLM-L6 + logistic head it replaced: 5-fold
    cross-validated route accuracy 0.78 against 0.70 on the 1,439 dev questions outside n100."""
    labels = [ROUTE_LABELS.index(route_of(q.qtype)) for q in train]
    with reporter.task(f"question types: fitting on {len(train):,} questions", 1) as advance:
        model = fit_ngram_classifier("question-type", [q.question for q in train], labels,
                                     ROUTE_LABELS, family="question-type")
        advance(1)
    reporter.note(f"question types: cross-validated route accuracy {model.cv_accuracy:.3f} "
                  f"on the training questions")
    return model


# -- the pipeline ------------------------------------------------------------------------------


class Pipeline:
    """Answers questions of one data set with the session's operators (see the module)."""

    def __init__(self, session: Session, data: QAData, reporter: Reporter,
                 type_model: Model | None = None) -> None:
        self.session = session
        self.data = data
        self.reporter = reporter
        counts = to_duckdb(data, session.con)
        reporter.note(f"loaded {data.dataset} ({data.variant}): "
                      + ", ".join(f"{n:,} {t}" for t, n in counts.items()))
        if data.dataset == "mmqa":
            model = type_model or question_type_model(training_questions(data), reporter)
            if tuple(model.spec.labels) != ROUTE_LABELS:
                raise DataError(f"a question-type model predicts {ROUTE_LABELS}, not "
                                f"{model.spec.labels}")
            session.register("question_type", model)
            self.type_model = model.name
            self.type_classifier: Model | None = model
            for function in (READERS["text"], READERS["table"]):
                if function not in session.operators:
                    session.register(function, session.operators["sem_qa"])
        else:
            self.type_model = ""
            self.type_classifier = None

    @property
    def models(self) -> tuple[str, ...]:
        names = [self.type_model] if self.type_model else []
        readers = ((READERS["text"], READERS["table"]) if self.data.dataset == "mmqa"
                   else (READERS["hybrid"],))
        for function in ("sem_similarity", *readers):
            names.extend(self.session.bind(function, ()).cascade.models)
        return tuple(dict.fromkeys(names))

    @staticmethod
    def _hop_name() -> str:
        """The one-row table of the hop being answered: one per thread, so that questions
        can be answered from several threads at once (``answer_stream``)."""
        return f"hop_{threading.get_ident()}"

    def hop_table(self, qid: str, q: str, context: str = "") -> str:
        """Register this thread's one-row hop table; returns its name."""
        name = self._hop_name()
        self.session.register_table(name, pa.table({"qid": [qid], "q": [q],
                                                    "context": [context]}))
        return name

    def _read(self, kind: str, qid: str, q: str, context: str) -> str | None:
        if not context.strip():  # nothing retrieved: no answer
            return None
        hop = self.hop_table(qid, q, context)
        return self.session.sql(f"SELECT {READERS[kind]}(q, context) AS answer FROM {hop}"
                                ).fetchall()[0][0]

    def _candidates(self, query: str, qid: str, q: str) -> list[tuple]:
        """The rows ``query`` returns for the hop question ``q`` (in the query's order; the
        hops rank them with ``retrieval.rank``)."""
        hop = self.hop_table(qid, q)
        return self.session.sql(query.replace("{hop}", hop)).fetchall()

    def text_hop(self, qid: str, query: str) -> tuple[str, str]:
        """The question's passage (title and text) that shares most words with ``query`` and
        is most similar to it, and its title ("" when the question has none)."""
        rows = self._candidates(_TEXT_CANDIDATES, qid, query)
        if not rows:
            return "", ""
        best = retrieval.rank(query, [
            retrieval.Candidate(f"{title}. {text}", (), float(sim or 0.0))
            for _doc, title, text, sim in rows])[0]
        _doc, title, text, _sim = rows[best]
        return f"{title}. {text}", title

    def table_hop(self, qid: str, query: str) -> tuple[str, str]:
        """The table title and its :data:`TABLE_ROWS` rows that share most words with
        ``query`` and are most similar to it, and the best row ("" when there is no table)."""
        rows = self._candidates(_TABLE_CANDIDATES, qid, query)
        if not rows:
            return "", ""
        best = retrieval.rank(query, [retrieval.Candidate(text, (), float(sim or 0.0))
                                      for _title, _i, text, sim in rows])[:TABLE_ROWS]
        return f"{rows[0][0]}.\n" + "\n".join(rows[i][2] for i in best), rows[best[0]][2]

    def hybrid_hop(self, qid: str, q: str) -> tuple[str | None, str]:
        """Rank the question's table rows by shared words (cells, linked titles, linked
        passages) and embedding similarity (``ken.models.retrieval``); the reader sees the
        table title, the best :data:`HYBRID_ROWS` rows and the sentences of their linked
        passages that share most words with the question (the best row's first), up to
        :data:`HYBRID_CONTEXT_CHARS`."""
        rows = self._candidates(_HYBRID_ROWS, qid, q)
        if not rows:
            return None, ""
        table_id, title = rows[0][0], rows[0][2]
        linked: dict[int, list[tuple[str, str]]] = {}
        for row_index, ptitle, text in self.session.sql(
                _TABLE_LINKS, params={"table_id": table_id}).fetchall():
            linked.setdefault(row_index, []).append((ptitle or "", text or ""))
        candidates = [retrieval.Candidate(
            f"{row_text} {' '.join(t for t, _ in linked.get(row_index, []))}",
            tuple(text for _, text in linked.get(row_index, [])), float(sim or 0.0))
            for _tid, row_index, _title, row_text, sim in rows]
        best = retrieval.rank(q, candidates)[:HYBRID_ROWS]
        head = "\n".join([f"{title}.", *(f"{rows[i][3]}." for i in best)])
        evidence = retrieval.best_sentences(
            q, [text for i in best for _, text in linked.get(rows[i][1], [])],
            max(300, HYBRID_CONTEXT_CHARS - len(head)))
        context = f"{head}\n{evidence}".strip()
        return self._read("hybrid", qid, q, context), context

    def mmqa_hops(self, q: QAQuestion, route: str) -> tuple[str | None, str, list[str]]:
        """Retrieve along ``route``'s hops, then read once: each hop after the first ranks its
        candidates by the question plus what the hop before found (the best table row, or the
        best passage's title: the bridge entity, e.g. the film of a filmography row), and the
        reader answers the question from the bridge and the last hop's context. Returns the
        answer, the reader's context and each hop's bridge."""
        bridge, context, hops = "", "", []
        kinds = ROUTES[route]
        for i, kind in enumerate(kinds):
            query = q.question if not bridge else f"{q.question} {bridge}"
            run: Callable[[str, str], tuple[str, str]] = (
                self.text_hop if kind == "text" else self.table_hop)
            context, bridge = run(q.qid, query)
            if i < len(kinds) - 1:
                hops.append(bridge)
        if hops and hops[-1]:
            context = f"{hops[-1]}\n{context}"
        return self._read(kinds[-1], q.qid, q.question, context), context, hops

    def route(self, q: QAQuestion) -> str:
        if self.data.dataset != "mmqa":
            return "row+passages"
        return self._candidates("SELECT question_type(q) FROM {hop}", q.qid, q.question)[0][0]

    def answer(self, q: QAQuestion) -> Answered:
        if q.status != OK:
            return Answered(q.qid, q.question, q.qtype, "", q.status, None, q.answers, 0.0,
                            0.0, 0.0)
        started = time.perf_counter()
        route = self.route(q)
        hops: list[str] = []
        context = ""
        answer: str | None = None
        if self.data.dataset != "mmqa":
            answer, context = self.hybrid_hop(q.qid, q.question)
            hops.append(answer or "")
        else:  # the type model predicts one of ROUTES (checked when it is registered)
            answer, context, hops = self.mmqa_hops(q, route)
        latency = time.perf_counter() - started
        em, f1 = score(answer, q.answers, style=self.data.dataset)  # the styles are named so
        return Answered(q.qid, q.question, q.qtype, route, OK, answer, q.answers, em, f1,
                        latency, tuple(hops), context[:300], contains_answer(context, q.answers))


def contains_answer(context: str, answers: Sequence[str]) -> bool:
    """Whether a non-blank gold answer appears in ``context`` (case and spacing ignored)."""
    text = " ".join(context.lower().split())
    return any(a.strip() and " ".join(a.lower().split()) in text for a in answers)


def retrieval_summary(answers: Sequence[Answered]) -> tuple[float, float] | None:
    """Over the answered questions: the share whose context held a gold answer, and the
    reader's F1 (percent) on those; None when none was answered."""
    ok = [a for a in answers if a.status == OK]
    if not ok:
        return None
    held = [a for a in ok if a.answer_in_context]
    return len(held) / len(ok), (100.0 * float(np.mean([a.f1 for a in held])) if held else 0.0)


def run_pipeline(session: Session, data: QAData, limit: int | None = None,
                 reporter: Reporter | None = None, type_model: Model | None = None,
                 pipeline: Pipeline | None = None,
                 stream: tuple[Sequence[QAQuestion], Sequence[float]] | None = None,
                 budget_s: float | None = None) -> RunReport:
    """Answer the first ``limit`` questions of ``data`` (all by default), one at a time, and
    score them; or, with ``stream=(questions, arrival_s)``, answer those questions as they
    arrive (:func:`answer_stream`).

    ``budget_s`` (with ``stream``): each question's end-to-end latency budget
    (:func:`answer_stream`). ``type_model`` replaces the trained question-type classifier
    (MultiModalQA);
    ``pipeline`` is one already set up on ``session``."""
    reporter = reporter or Reporter(quiet=True)
    started = time.perf_counter()
    pipeline = pipeline or Pipeline(session, data, reporter, type_model)
    if stream is not None:
        answered = answer_stream(pipeline, stream[0], stream[1], reporter,
                                 budget_s=budget_s)
    else:
        questions = data.questions[:limit] if limit else data.questions
        answered = []
        with reporter.task(f"answer {len(questions)} {data.dataset} questions",
                           len(questions)) as advance:
            for q in questions:
                answered.append(pipeline.answer(q))
                advance(1)
    rows = [ScoreRow(a.qid, a.qtype, a.status, a.gold, a.predicted) for a in answered]
    typed = [a for a in answered if a.route in ROUTE_LABELS]
    type_accuracy = (float(np.mean([a.route == route_of(a.qtype) for a in typed]))
                     if typed else None)
    return RunReport(data.dataset, data.variant, data.files, pipeline.models, tuple(answered),
                     summarise(rows, style=data.dataset), type_accuracy,
                     time.perf_counter() - started)


#: the status of a question whose hop an engine's dropping policy dropped (``answer_stream``)
DROPPED = "dropped"
#: ... whose hop the online engine kept turning away (admission: over capacity, ``EngineBusy``)
REJECTED = "rejected"
#: ... whose hop's model call failed, or whose server stopped (``ModelCallFailed``,
#: ``ServingStopped``)
FAILED = "error"


def answer_stream(pipeline: Pipeline, questions: Sequence[QAQuestion],
                  arrival_s: Sequence[float], reporter: Reporter | None = None,
                  max_threads: int = 64, budget_s: float | None = None) -> list[Answered]:
    """Answer ``questions[i]`` when it arrives at ``arrival_s[i]`` seconds from now, each in
    its own thread (so the served operators batch the calls of questions in flight); a
    question's latency runs from its arrival to its answer.

    ``budget_s``: each question's end-to-end deadline is its arrival plus ``budget_s``; every
    hop's served calls carry it (``ken.engine.deadlines.within``), so an engine served with a
    dropping policy (``session.serve(dropping=...)``) drops a hop that can no longer make it,
    and the question ends at once with status ``dropped`` and the drop's ``reason`` (not
    scored, like image questions: ``summary.statuses`` counts them). Each call is its own
    request to the engine, with no route ahead (SQL calls do not say which hops follow).
    A question whose call the engine kept turning away ends ``rejected``, one whose model
    call failed or whose server stopped ``error``, each with the reason; the other questions
    go on."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    if len(questions) != len(arrival_s):
        raise DataError(f"{len(questions)} questions for {len(arrival_s)} arrival times")
    reporter = reporter or Reporter(quiet=True)
    start = time.perf_counter()
    start_monotonic = time.monotonic()

    def run(i: int) -> Answered:
        q = questions[i]
        try:
            if budget_s is None:
                a = pipeline.answer(q)
            else:
                with within(start_monotonic + arrival_s[i] + budget_s):
                    a = pipeline.answer(q)
        except EngineBusy as exc:  # this question's outcome, not the stream's
            status = (DROPPED if isinstance(exc, RequestDropped) else
                      REJECTED if type(exc) is EngineBusy else FAILED)
            return Answered(q.qid, q.question, q.qtype, "", status, None, q.answers, 0.0, 0.0,
                            time.perf_counter() - start - arrival_s[i], reason=str(exc))
        if a.status != OK:
            return a
        return dataclasses.replace(a, latency_s=time.perf_counter() - start - arrival_s[i])

    with ThreadPoolExecutor(max_threads) as pool, \
            reporter.task(f"answer a stream of {len(questions)} questions",
                          len(questions)) as advance:
        futures = []
        for i, t in enumerate(arrival_s):
            wait = start + t - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            future = pool.submit(run, i)
            future.add_done_callback(lambda _f: advance(1))
            futures.append(future)
        return [f.result() for f in futures]


def write_report(report: RunReport, out: Path) -> Path:
    """Write the per-question JSON to ``out`` (atomically)."""
    return store.write_text(out / f"{report.dataset}-{report.variant}.json", report.to_json())
