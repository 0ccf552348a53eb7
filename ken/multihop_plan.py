"""Planning the MultiModalQA pipeline's operators together (issue 16; the KEN paper's §5.4).

The pipeline (``ken.multihop``) runs, per question, ``question_type`` and then one or two
reading hops, ``text_qa`` and/or ``table_qa`` in the order of the question's route. The query
optimizer gives each reading operator a gear plan (a cascade of LMs per load range, placement
and batching) so that the *whole pipeline* meets the user's target (``f1 >= x`` or
``p95 <= t`` ms per question), simulating the operators together on the shared devices.

What the planner knows comes from the labelled questions themselves (:func:`measure`):

- **outcomes**: every question is answered with every assignment of LMs to the two reading
  operators (smol/smol, smol/qwen, qwen/smol, qwen/qwen; identical calls run once), keeping
  each hop's answer and certainty and the question's EM/F1. A request of the simulated stream
  is one of these questions; its F1 is looked up for the LMs that resolved its hops
  (:class:`PipelineSample`), so cascades are scored by the answers they would give;
- **performance**: each LM's runtime per batch of reading calls (1, 2, 4 rows) on the
  questions' own hop inputs, and the question-type model's, on one-thread CPU workers.

The certainty that decides an escalation at a hop is the LM's certainty on that hop's input
in the run where the other reading operator used the most accurate LM: exact for first hops;
for a second hop, its input may differ with the LM that answered the first hop.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ken.errors import DataError
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig, Model, ModelOutput, Output
from ken.models.qa_data import OK, QAData
from ken.models.resources import Resources
from ken.multihop import (
    READERS,
    ROUTE_LABELS,
    ROUTES,
    Pipeline,
    question_type_model,
    route_of,
    training_questions,
)
from ken.ops.llm_operator import DEFAULT_LLMS, SHORT
from ken.ops.sem_qa import SemQA
from ken.optimizer.perf import Catalog, ModelPerf
from ken.optimizer.profile import measure_batch_runtimes
from ken.optimizer.query import PipelineSample
from ken.progress import Reporter
from ken.session import Session

#: the operators of the pipeline, in the order a question meets them
OPERATORS = ("question_type", READERS["text"], READERS["table"])
READING = OPERATORS[1:]
#: the LMs the reading operators choose from, cheapest first
LLMS = DEFAULT_LLMS
BATCH_SIZES = (1, 2, 4)
VERSION = 1  # bump when what measure() records changes


def model_name(operator: str, lm: str) -> str:
    """The name of ``lm`` answering ``operator`` (``text_qa-qwen05[…]``): the same name
    the session's ``text_qa``/``table_qa`` give their stages, so plans apply to them."""
    return SemQA().renamed(operator).stage_name(lm, ())  # type: ignore[attr-defined]


class _Memo(Model):
    """A reading operator's LM that answers each distinct input once (shared cache across
    assignments) and logs the calls of the question being answered."""

    def __init__(self, model: Model, operator: str, cache: dict, log: list) -> None:
        self.model, self.operator, self.cache, self.log = model, operator, cache, log
        self.spec, self.device = model.spec, model.device

    def predict(self, texts: Sequence, batch_size: int = 8) -> ModelOutput:
        rows = [tuple(t) for t in texts]
        new = list(dict.fromkeys(r for r in rows if r not in self.cache))
        if new:
            out = self.model.predict(new, batch_size)
            for row, value, score in zip(new, out.values, out.certainty(), strict=True):
                self.cache[row] = (value, float(score))
        answers = [self.cache[r] for r in rows]
        self.log.extend((self.operator, r, v, s) for r, (v, s) in zip(rows, answers,
                                                                        strict=True))
        return Output([v for v, _ in answers], np.array([s for _, s in answers]))


@dataclass(frozen=True)
class Outcomes:
    """What :func:`measure` records (see the module docstring); JSON-serialisable."""

    dataset: str
    files: tuple[str, ...]
    llms: tuple[str, ...]
    type_model: str
    qids: tuple[str, ...]  # the answerable questions (status ok), in order
    qtypes: tuple[str, ...]
    routes: tuple[str, ...]  # the route the question-type model picked
    # assignment "lm_text,lm_table" -> per question: [f1, em, predicted,
    #   {operator: [value, certainty]}]
    runs: Mapping[str, tuple]
    perf: Mapping[str, dict]  # model name -> ModelPerf fields
    type_accuracy: float
    seconds: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Outcomes:
        raw = json.loads(text)
        for key in ("files", "llms", "qids", "qtypes", "routes"):
            raw[key] = tuple(raw[key])
        raw["runs"] = {k: tuple(v) for k, v in raw["runs"].items()}
        return cls(**raw)

    def model_perf(self) -> dict[str, ModelPerf]:
        return {m: ModelPerf(**{k: (tuple(tuple(r) for r in v) if k == "runtime_s" else v)
                                for k, v in p.items()}) for m, p in self.perf.items()}


def assignments(llms: Sequence[str]) -> list[tuple[str, str]]:
    return list(itertools.product(llms, repeat=2))


def _key(text: str, table: str) -> str:
    return f"{text},{table}"


def sem_qa_stage(lm: str, resources: Resources) -> Model:
    """The ``sem_qa`` model of ``lm`` (what the reading operators run)."""
    return SemQA().stage(resources, lm, ())


def measure(session: Session, data: QAData, llms: Sequence[str] = LLMS,
            reporter: Reporter | None = None, threads: int = 1,
            stage: Callable[[str, Resources], Model] = sem_qa_stage,
            type_model: Model | None = None) -> Outcomes:
    """Answer ``data``'s answerable questions with every assignment of ``llms`` to the two
    reading operators, and time the LMs and the question-type model on ``threads``-thread
    workers (see the module docstring). ``stage`` makes an LM's reading model and
    ``type_model`` replaces the trained question-type classifier (tests use stand-ins)."""
    reporter = reporter or Reporter(quiet=True)
    if data.dataset != "mmqa":
        raise DataError("the pipeline planner is for MultiModalQA (question types and hops)")
    started = time.perf_counter()
    questions = [q for q in data.questions if q.status == OK]
    if not questions:
        raise DataError(f"no answerable question in {data.directory}")
    resources = Resources(session.ctx.device, session.ctx.home)
    lms = {lm: stage(lm, resources) for lm in llms}
    caches: dict[str, dict] = {lm: {} for lm in llms}
    log: list = []
    runs: dict[str, list] = {}
    routes: list[str] = []
    type_name = ""
    combos = assignments(llms)
    with reporter.task(f"answer {len(questions)} questions x {len(combos)} LM assignments",
                       len(questions) * len(combos)) as advance:
        for text_lm, table_lm in combos:
            for op, lm in ((READERS["text"], text_lm), (READERS["table"], table_lm)):
                session.register(op, _Memo(lms[lm], op, caches[lm], log))
            pipeline = Pipeline(session, data, Reporter(quiet=True), type_model)
            type_name = pipeline.type_model
            rows = []
            for i, q in enumerate(questions):
                log.clear()
                a = pipeline.answer(q)
                if len(routes) < len(questions):
                    routes.append(a.route)
                elif routes[i] != a.route:
                    raise DataError(f"the question-type model routed {q.qid} two ways")
                calls = {op: [value, score] for op, _row, value, score in log}
                rows.append([a.f1, a.em, a.predicted, calls])
                advance(1)
            runs[_key(text_lm, table_lm)] = rows
    perf = {}
    timing = Resources(DeviceConfig(threads=threads), session.ctx.home)
    for lm in llms:
        inputs = list(caches[lm])
        model = stage(lm, timing)
        with reporter.task(f"time {SHORT.get(lm, lm)} on reading calls", len(BATCH_SIZES)) \
                as advance:
            runtimes, _peak = measure_batch_runtimes(model, inputs, BATCH_SIZES,
                                                     on_step=lambda _s: advance(1))
        # the weights (the process's peak memory counts every model loaded so far)
        for op in READING:
            perf[model_name(op, lm)] = {"name": model_name(op, lm),
                                        "batch_sizes": list(BATCH_SIZES),
                                        "runtime_s": [runtimes],
                                        "memory_bytes": [model.spec.memory_bytes]}
    if type_model is None:  # the trained classifier, its encoder on the timing workers
        typing = question_type_model(session, training_questions(data), reporter)
        type_model = type(typing)(typing.spec, timing.encoder("minilm-l6"), typing.head)
    texts = [q.question for q in questions]
    runtimes, _peak = measure_batch_runtimes(type_model, texts, BATCH_SIZES)
    perf["question_type"] = {"name": "question_type", "batch_sizes": list(BATCH_SIZES),
                             "runtime_s": [runtimes],
                             "memory_bytes": [type_model.spec.memory_bytes]}
    accuracy = float(np.mean([r == route_of(q.qtype) for r, q in
                              zip(routes, questions, strict=True)]))
    return Outcomes(data.dataset, data.files, tuple(llms), type_name,
                    tuple(q.qid for q in questions), tuple(q.qtype for q in questions),
                    tuple(routes), {k: tuple(v) for k, v in runs.items()}, perf, accuracy,
                    time.perf_counter() - started)




def outcomes_path(folder: Path, data: QAData, llms: Sequence[str]) -> Path:
    key = hashlib.sha256(repr((VERSION, data.files, str(data.directory), tuple(llms),
                               data.variant)).encode()).hexdigest()[:12]
    return folder / f"outcomes-{data.dataset}-{key}.json"


_lock = threading.Lock()


def load_or_measure(session: Session, data: QAData, folder: Path,
                    llms: Sequence[str] = LLMS, reporter: Reporter | None = None,
                    force: bool = False, measure_options: Mapping[str, Any] | None = None
                    ) -> Outcomes:
    """:func:`measure` (with ``measure_options``), cached as JSON in ``folder`` (keyed by
    the data files and LMs)."""
    path = outcomes_path(folder, data, llms)
    with _lock:
        if path.is_file() and not force:
            return Outcomes.from_json(path.read_text())
        outcomes = measure(session, data, llms, reporter, **(measure_options or {}))
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{time.monotonic_ns()}.tmp")
        tmp.write_text(outcomes.to_json())
        tmp.replace(path)
        return outcomes


# -- what the query optimizer needs -----------------------------------------------------------


def pipeline_inputs(outcomes: Outcomes) -> tuple[dict[str, Catalog], PipelineSample]:
    """Per operator a catalog over the questions, and the sample that scores a request by
    the LMs that resolved its hops (see the module docstring)."""
    perf = outcomes.model_perf()
    llms = outcomes.llms
    best = max(llms, key=lambda lm: np.mean([r[0] for r in outcomes.runs[_key(lm, lm)]]))
    n = len(outcomes.qids)
    ops = list(OPERATORS)
    routes = tuple(tuple(ops.index(READERS[kind]) for kind in ROUTES[r]) for r in
                   outcomes.routes)
    routes = tuple((0, *r) for r in routes)
    catalogs = {"question_type": Catalog(
        {"question_type": perf["question_type"]},
        {"question_type": np.ones(n)}, {"question_type": np.ones(n)})}
    for op in READING:
        quality, certainty = {}, {}
        for lm in llms:
            key = _key(lm, best) if op == READERS["text"] else _key(best, lm)
            rows = outcomes.runs[key]
            name = model_name(op, lm)
            quality[name] = np.array([r[0] for r in rows])
            certainty[name] = np.array([r[3][op][1] if op in r[3] else 1.0 for r in rows])
        catalogs[op] = Catalog({m: perf[m] for m in quality}, quality, certainty,
                               f"{outcomes.dataset}-{n}")
    f1 = {}
    for (text_lm, table_lm) in assignments(llms):
        for i, row in enumerate(outcomes.runs[_key(text_lm, table_lm)]):
            used = {READERS["text"]: text_lm, READERS["table"]: table_lm}
            models = tuple("question_type" if k == 0 else model_name(ops[k], used[ops[k]])
                           for k in routes[i])
            f1[(i, models)] = float(row[0])
    return catalogs, PipelineSample(tuple(ops), routes, f1)


def first_stage_cascades(catalog: Catalog, operator: str, llms: Sequence[str],
                         thresholds: Sequence[float]) -> list[Cascade]:
    """Single-LM cascades and two-stage ``llms[0] -> llms[-1]`` cascades at ``thresholds``."""
    names = [model_name(operator, lm) for lm in llms]
    cascades = [Cascade((m,)) for m in names]
    cascades += [Cascade((names[0], names[-1]), (float(t),)) for t in thresholds]
    return [c for c in cascades if all(m in catalog.perf for m in c.models)]


__all__ = ["LLMS", "OPERATORS", "Outcomes", "ROUTE_LABELS", "SHORT", "load_or_measure",
           "measure", "pipeline_inputs", "first_stage_cascades"]
