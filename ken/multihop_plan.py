"""Planning the MultiModalQA pipeline's operators together (issue 16; the KEN paper's §5.4).

The pipeline (``ken.multihop``) runs, per question, ``question_type``, the retrieval hops of
its route, and then one reading call, ``text_qa`` or ``table_qa`` (the last hop's). The query
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

The certainty that decides an escalation is the LM's certainty on the question's reading
call (retrieval does not depend on the LMs, so it is exact).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ken import store
from ken.engine.calibrate import MIN_FIT_CALLS, Calibration, fit_calibration
from ken.engine.supervision import BatchRecord
from ken.errors import DataError, KenError, StoreError
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig, Model, ModelOutput, Output
from ken.models.qa_data import OK, QAData, QAQuestion
from ken.models.resources import Resources
from ken.multihop import (
    READERS,
    ROUTE_LABELS,
    ROUTES,
    Pipeline,
    RunReport,
    route_of,
    run_pipeline,
)
from ken.ops.base import Operator
from ken.ops.llm_operator import DEFAULT_LLMS, SHORT
from ken.ops.sem_qa import SemQA
from ken.optimizer.perf import Catalog, ModelPerf
from ken.optimizer.planner import PlannerSettings, plan_frontier
from ken.optimizer.profile import measure_batch_runtimes
from ken.optimizer.query import (
    PipelinePlan,
    PipelinePoint,
    PipelineSample,
    Target,
    choose_pipeline,
    evaluate_pipeline,
    spread_plans,
)
from ken.optimizer.simulator import sample_rows
from ken.optimizer.workload import Trace
from ken.paths import ken_home
from ken.policy.plan import Frontier, GearPlan
from ken.progress import Reporter
from ken.session import Session

#: the operators of the pipeline, in the order a question meets them
OPERATORS = ("question_type", READERS["text"], READERS["table"])
READING = OPERATORS[1:]
#: the LMs the reading operators choose from, cheapest first
LLMS = DEFAULT_LLMS
BATCH_SIZES = (1, 2, 4)
VERSION = 4  # bump when what measure() records changes (2: word-match retrieval, LLMs in bf16;
#              3: the word n-gram question-type classifier, one reading call per question;
#              4: retrieval by rarer words, answers cut of a restated question: new stage
#              names, so older files would name models the planner no longer knows)


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


def _restore_operators(session: Session, before: Mapping[str, Operator | None]) -> None:
    """Put the session's operators named in ``before`` back as they were (absent: removed)."""
    for name, op in before.items():
        if op is None:
            session.operators.pop(name, None)
        else:
            session.operators[name] = op
        session.forget(name)


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
    combos = assignments(llms)
    pipeline: Pipeline | None = None
    # the memoising stand-ins are the session's reading operators only while measuring
    before = {op: session.operators.get(op) for op in READING}
    with contextlib.ExitStack() as restore:
        restore.callback(_restore_operators, session, before)
        advance = restore.enter_context(reporter.task(
            f"answer {len(questions)} questions x {len(combos)} LM assignments",
            len(questions) * len(combos)))
        for text_lm, table_lm in combos:
            for op, lm in ((READERS["text"], text_lm), (READERS["table"], table_lm)):
                session.register(op, _Memo(lms[lm], op, caches[lm], log))
            # set up once (tables, question types); it calls the reading operators by name
            pipeline = pipeline or Pipeline(session, data, Reporter(quiet=True), type_model)
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
    assert pipeline is not None and pipeline.type_classifier is not None  # one assignment ran
    type_model = pipeline.type_classifier  # the classifier the questions were routed with
    texts = [q.question for q in questions]
    runtimes, _peak = measure_batch_runtimes(type_model, texts, BATCH_SIZES)
    perf["question_type"] = {"name": "question_type", "batch_sizes": list(BATCH_SIZES),
                             "runtime_s": [runtimes],
                             "memory_bytes": [type_model.spec.memory_bytes]}
    accuracy = float(np.mean([r == route_of(q.qtype) for r, q in
                              zip(routes, questions, strict=True)]))
    return Outcomes(data.dataset, data.files, tuple(llms), pipeline.type_model,
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
    entry = outcomes_entry(path)
    with _lock:
        if path.is_file() and not force:
            try:  # damaged outcomes are measured again
                store.ensure(entry)
                return Outcomes.from_json(path.read_text())
            except (StoreError, KenError, ValueError, KeyError, TypeError) as exc:
                if reporter is not None:
                    reporter.note(f"{exc}\n  -> measuring them again")
        outcomes = measure(session, data, llms, reporter, **(measure_options or {}))
        store.write_text(path, outcomes.to_json())
        store.seal(entry)
        return outcomes


def outcomes_entry(path: Path) -> store.Entry:
    """The store entry of measured QA outcomes (one JSON file, ``KEN_HOME/qa-plans``)."""
    return store.Entry(path.parent, f"the measured outcomes {path.name}",
                       "they are measured again on next use (tens of minutes)",
                       files=(path.name,), legacy=_adopt_outcomes)


def store_entries(home: Path) -> list[store.Entry]:
    """Every file of measured QA outcomes in ``home``."""
    return [outcomes_entry(path) for path in sorted((home / "qa-plans").glob("outcomes-*"))]


def _adopt_outcomes(entry: store.Entry) -> None:
    try:
        Outcomes.from_json(entry.main.read_text())
    except (OSError, KenError, ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"model store: {entry.main} is not a file of measured outcomes of this "
                         f"ken ({exc}). To fix it: {entry.fix}.") from None


# -- what the query optimizer needs -----------------------------------------------------------


def pipeline_inputs(outcomes: Outcomes) -> tuple[dict[str, Catalog], PipelineSample]:
    """Per operator a catalog over the questions, and the sample that scores a request by
    the LMs that resolved its hops (see the module docstring)."""
    perf = outcomes.model_perf()
    llms = outcomes.llms
    best = max(llms, key=lambda lm: np.mean([r[0] for r in outcomes.runs[_key(lm, lm)]]))
    n = len(outcomes.qids)
    ops = list(OPERATORS)
    # a question is read once, by the operator of its route's last hop
    routes = tuple((ops.index(READERS[ROUTES[r][-1]]),) for r in outcomes.routes)
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


#: thresholds of the two-stage reading cascades the planner chooses from
THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
#: questions arrive at LLM rates (< 1/s): gear plans meter the rate over this window (a
#: 0.1-s window would read 0 or 10/s), and the trace's peak is its busiest minute
RATE_WINDOW_S = 20.0


class PipelinePlanner:
    """Frontiers of gear plans for the pipeline's operators and the query optimizer's
    choice, on ``devices`` one-thread CPU workers for a stream of the labelled questions
    arriving on the Azure LLM trace (``duration_s`` around its busiest minute, whose rate is
    ``load`` x the questions/s that LLM-only sustains)."""

    def __init__(self, outcomes: Outcomes, devices: int = 2, memory_gb: float = 8.0,
                 duration_s: float = 600.0, load: float = 1.5, seed: int = 0,
                 trace: Trace | None = None) -> None:
        from ken.optimizer.workload import Hardware, fit_peak, load_azure_trace

        if devices < 1 or memory_gb <= 0 or duration_s <= 0 or load <= 0:
            raise KenError("devices >= 1, and memory_gb, duration_s and load > 0, please")
        self.outcomes = outcomes
        self.catalogs, self.sample = pipeline_inputs(outcomes)
        self.llms = outcomes.llms
        self.hardware = Hardware.cpu_workers(devices, int(memory_gb * 2**30))
        self.seed = seed
        large = self.llms[-1]
        visits = np.array([[k in r for k in range(len(OPERATORS))]
                           for r in self.sample.routes])
        seconds = sum(visits[:, k].mean() * min(
            self.catalogs[op].perf[model_name(op, large)].per_row_s(b) for b in BATCH_SIZES)
            for k, op in enumerate(OPERATORS) if op in READING)
        self.llm_only_qps = devices / seconds
        self.peak_qps = load * self.llm_only_qps
        if trace is None:
            full = load_azure_trace()
            trace = fit_peak(lambda f: full.rate_scaled(f).around_peak(duration_s),
                             self.peak_qps / full.qps_max(60.0), self.peak_qps, window_s=60.0)
        self.trace = trace
        self.rows = sample_rows(len(trace), self.sample.num_rows, seed)
        self._static: dict[tuple[str, str], GearPlan] = {}

    def operator_trace(self, op: str) -> Trace:
        """The arrivals of the questions whose route reaches ``op``."""
        k = OPERATORS.index(op)
        mask = np.array([k in self.sample.routes[r] for r in self.rows])
        if not mask.any():  # no question takes this hop: plan it for the whole stream
            return self.trace
        return Trace(self.trace.arrival_s[mask], f"{self.trace.name}-{op}")

    def frontier(self, op: str, cascades: Sequence[Cascade], num_ranges: int,
                 alternatives: bool = True) -> Frontier:
        """``op``'s frontier of gear plans over ``cascades``; with ``alternatives`` also every
        model of its catalog alone (``planner.one_gear_plans``), else those cascades only."""
        settings = PlannerSettings(num_ranges=num_ranges, max_rounds=4,
                                   rate_window_s=RATE_WINDOW_S, seed=self.seed,
                                   include_static=alternatives)
        return plan_frontier(op, cascades, self.catalogs[op], self.hardware,
                             self.operator_trace(op), qps_max=self.peak_qps,
                             settings=settings)[0]

    def static(self, op: str, cascade: Cascade) -> GearPlan:
        """The fastest plan (placement, batching) of one cascade at every load (planned once
        per operator and cascade)."""
        key = (op, cascade.to_json())
        if key not in self._static:
            self._static[key] = min(self.frontier(op, [cascade], 1, alternatives=False).plans,
                                    key=lambda p: p.predicted.p95_ms)
        return self._static[key]

    def type_plan(self) -> GearPlan:
        return self.static("question_type", Cascade(("question_type",)))

    def calibrate(self, log: Iterable[BatchRecord], source: str = "",
                  min_calls: int = MIN_FIT_CALLS) -> dict[str, Calibration]:
        """Plan and simulate with the reading LMs' runtimes as they were served: per reading
        operator, the engine's calls of its LMs in ``log`` are fitted against the runtimes
        :func:`measure` timed alone (``engine.calibrate.fit_calibration``: a factor per LM
        and batch size, and one after idle), and its catalog is scaled by them from now on.
        An LM with fewer than ``min_calls`` calls keeps its runtimes. The measured LMs
        ran one at a time with nothing else on the machine; served, two workers and each
        question's retrieval share the cores. Returns the calibrations applied, by operator.
        The planning trace is kept (it was scaled to the uncalibrated LLM-only rate)."""
        calls = tuple(log)
        applied = {}
        for op in READING:
            catalog = self.catalogs[op]
            fitted = fit_calibration([r for r in calls if r.model in catalog.perf], catalog,
                                     source, min_calls=min_calls)
            if fitted.fits:
                self.catalogs[op] = fitted.apply(catalog)
                applied[op] = fitted
        if applied:
            self._static.clear()  # planned with the old runtimes
        return applied

    def evaluate(self, plans: Sequence[GearPlan]) -> PipelinePoint:
        return evaluate_pipeline(plans, [self.catalogs[op] for op in OPERATORS], self.trace,
                                 self.sample, self.seed)

    def candidates(self, op: str, num_ranges: int = 4, max_plans: int = 6
                   ) -> list[GearPlan]:
        """A reading operator's candidate plans: its frontier of gear plans (single LMs and
        two-stage cascades at :data:`THRESHOLDS`, switched by load over ``num_ranges``
        ranges; at most ``max_plans``, spread over the frontier) and the static plan of each
        of those cascades (the frontier is planned for this operator alone; sharing the
        devices with the other operator can favour a static plan)."""
        cascades = first_stage_cascades(self.catalogs[op], op, self.llms, THRESHOLDS)
        adaptive = spread_plans(self.frontier(op, cascades, num_ranges).plans, max_plans)
        return adaptive + [self.static(op, c) for c in cascades]

    def choose(self, target: Target, num_ranges: int = 4, max_plans: int = 6
               ) -> PipelinePlan:
        """The combination of the reading operators' :meth:`candidates` that meets
        ``target`` (``choose_pipeline``: every combination simulated together)."""
        fronts: dict[str, Sequence[GearPlan]] = {"question_type": [self.type_plan()]}
        for op in READING:
            fronts[op] = self.candidates(op, num_ranges, max_plans)
        size = max(len(f) for f in fronts.values())
        return choose_pipeline(fronts, self.catalogs, self.trace, self.sample, target,
                               self.seed, max_plans=size)


def use_reading_plans(session: Session, plan: PipelinePlan) -> None:
    """Set ``plan``'s gear plans of the reading operators on ``session`` (what serving
    them and EXPLAIN use); the question type runs in each question's thread."""
    for p in plan.plans:
        if p.operator in READING:
            session.use_plan(p)


#: served calls an LM needs for its fit in a calibration stream (a reading call takes seconds:
#: a minute of the stream gives each LM tens of calls, not hundreds)
CALIBRATION_MIN_CALLS = 5
#: questions a calibration stream serves at most (a minute of the packaged LMs is about 40)
CALIBRATION_MAX_QUESTIONS = 100


def calibrate_on_stream(session: Session, planner: PipelinePlanner, pipeline: Pipeline,
                        questions: Sequence[QAQuestion], arrival_s: Sequence[float],
                        workers: str = "auto", memory_gb: float = 8.0,
                        reporter: Reporter | None = None) -> dict[str, Calibration]:
    """Serve the reading operators with the session's plans (no dropping, every call
    admitted), answer ``questions`` as they arrive at ``arrival_s``, and calibrate
    ``planner`` on the reading calls (:meth:`PipelinePlanner.calibrate`, with
    :data:`CALIBRATION_MIN_CALLS`). Returns the calibrations applied, by operator."""
    reporter = reporter or Reporter(quiet=True)
    if len(questions) != len(arrival_s) or not questions:
        raise KenError(f"give one arrival time per question, and at least one question "
                       f"({len(questions)} questions, {len(arrival_s)} times)")
    # every call is a model call: answers from the result cache would time nothing, and
    # answers stored now would be cache hits in the stream that is measured next
    cache_enabled, session.cache_enabled = session.cache_enabled, False
    session.serve(list(READING), workers=workers, threads_per_device=1, memory_gb=memory_gb,
                  admission="max_in_flight", replan=False)
    try:
        run_pipeline(session, pipeline.data, reporter=reporter, pipeline=pipeline,
                     stream=(questions, arrival_s))
        engines = {id(e): e for op, e in session.engines.items() if op in READING}
        log = [r for e in engines.values() for r in e.batch_log]
    finally:
        session.stop_serving()
        session.cache_enabled = cache_enabled
    span = float(arrival_s[-1]) - float(arrival_s[0])
    rate = f" at {(len(questions) - 1) / span:.3f}/s" if span > 0 else ""
    fitted = planner.calibrate(log, f"{len(questions)} questions served{rate}, "
                               f"{len(log)} calls", min_calls=CALIBRATION_MIN_CALLS)
    for op in READING:
        if op not in fitted:
            calls = {m: sum(r.model == m for r in log) for m in planner.catalogs[op].perf}
            reporter.note(f"{op}: no LM had {CALIBRATION_MIN_CALLS} calls to fit "
                          f"({', '.join(f'{m} {n}' for m, n in calls.items())}); it keeps "
                          "the runtimes measured alone")
    return fitted


def densest(arrival_s: np.ndarray, count: int) -> tuple[int, np.ndarray]:
    """The ``count`` consecutive arrivals that span the least time: their first index and
    their times from the first of them."""
    count = min(count, len(arrival_s))
    spans = arrival_s[count - 1:] - arrival_s[:len(arrival_s) - count + 1]
    start = int(np.argmin(spans))
    part = arrival_s[start:start + count]
    return start, part - part[0]


@dataclass(frozen=True)
class PlannedRun:
    plan: PipelinePlan
    predicted: PipelinePoint  # the simulator's prediction for the stream that was served
    report: RunReport
    explain: str
    arrival_s: tuple[float, ...]
    # the reading LMs' runtimes fitted on a served stream before planning, by operator
    calibration: Mapping[str, Calibration] = field(default_factory=dict)


def run_planned(session: Session, data: QAData, target: Target, stream: int = 40,
                devices: int = 2, memory_gb: float = 8.0, load: float = 1.5,
                duration_s: float = 600.0, reporter: Reporter | None = None,
                folder: Path | None = None, workers: str = "auto",
                type_model: Model | None = None, trace: Trace | None = None,
                calibration_s: float = 0.0) -> PlannedRun:
    """Plan the pipeline for ``target`` (:class:`PipelinePlanner`, from the cached
    :func:`measure` of ``data``), set the chosen gear plans on ``text_qa`` and
    ``table_qa``, serve them on the online engine and answer the ``stream`` questions of the
    planned trace that arrive closest together, as they arrive.

    ``calibration_s`` > 0: first serve that many seconds of questions, evenly spaced at the
    rate the most accurate LM alone sustains (as measured), with the plans chosen on the
    measured runtimes, fit the reading calls (:func:`calibrate_on_stream`) and plan again on
    the served runtimes.

    ``type_model`` replaces the question-type classifier and ``trace`` the Azure trace
    (tests)."""
    reporter = reporter or Reporter(quiet=True)
    if stream < 1:
        raise KenError(f"the stream needs at least one question, got {stream}")
    if not (math.isfinite(calibration_s) and calibration_s >= 0):
        raise KenError(f"calibration seconds must be a number >= 0, got {calibration_s}")
    session.operators["sem_qa"].llms = LLMS  # type: ignore[attr-defined]
    outcomes = load_or_measure(session, data, folder or (session.home or ken_home())
                               / "qa-plans", LLMS, reporter)
    planner = PipelinePlanner(outcomes, devices, memory_gb, duration_s, load, trace=trace)
    with reporter.task("plan the pipeline's operators together", 1) as advance:
        plan = planner.choose(target)
        advance(1)
    # registers the operators the plans are for (unless the session has its own)
    pipeline = Pipeline(session, data, reporter, type_model)
    use_reading_plans(session, plan)
    by_qid = {q.qid: q for q in data.questions}
    fitted: dict[str, Calibration] = {}
    if calibration_s > 0:
        wanted = calibration_s * planner.llm_only_qps
        count = (CALIBRATION_MAX_QUESTIONS if not math.isfinite(wanted)
                 else min(CALIBRATION_MAX_QUESTIONS, max(2, int(wanted))))
        rows = np.random.default_rng(planner.seed + 1).integers(0, len(outcomes.qids), count)
        reporter.note(f"calibrating the LMs' runtimes: {count} questions served first, at "
                      f"{planner.llm_only_qps:.3g}/s")
        fitted = calibrate_on_stream(
            session, planner, pipeline, [by_qid[outcomes.qids[r]] for r in rows],
            (np.arange(count) / planner.llm_only_qps).tolist(), workers, memory_gb, reporter)
        for op, cal in fitted.items():
            reporter.note(f"calibrated {op}: {cal.describe()}")
        if fitted:
            plan = planner.choose(target)
            use_reading_plans(session, plan)
    hop = pipeline.hop_table("", "", "")  # an empty hop, for EXPLAIN
    explain = session.explain(f"SELECT {READERS['text']}(q, context) AS text_answer, "
                              f"{READERS['table']}(q, context) AS table_answer FROM {hop}")
    start, arrivals = densest(planner.trace.arrival_s, stream)
    rows = planner.rows[start:start + len(arrivals)]
    questions = [by_qid[outcomes.qids[r]] for r in rows]
    predicted = evaluate_pipeline(plan.plans, [planner.catalogs[op] for op in OPERATORS],
                                  Trace(arrivals, "stream"), planner.sample, rows=rows)
    session.serve(list(READING), workers=workers, threads_per_device=1, memory_gb=memory_gb)
    try:
        report = run_pipeline(session, data, reporter=reporter, pipeline=pipeline,
                              stream=(questions, arrivals))
    finally:
        session.stop_serving()
    return PlannedRun(plan, predicted, report, explain, tuple(float(t) for t in arrivals),
                      fitted)


__all__ = ["LLMS", "OPERATORS", "Outcomes", "PipelinePlanner", "PlannedRun", "ROUTE_LABELS",
           "SHORT", "calibrate_on_stream", "load_or_measure", "measure", "pipeline_inputs",
           "first_stage_cascades", "run_planned", "use_reading_plans"]
