"""The operator interface: everything the rest of KEN needs to know about a semantic operator.

An operator (``sentiment``, ``sem_filter``, ``sem_match``, ``sem_classify``, or one a user
registers) is an :class:`Operator`. It gives

- its SQL signature: ``num_columns`` text arguments, then ``constants`` (string literals bound
  per call site, e.g. a predicate) and an ``output_type`` (VARCHAR, BOOLEAN, DOUBLE, BIGINT,
  or a STRUCT of them: ``struct(name varchar, year bigint)``);
- ``bind(ctx, constants)``: the runnable :class:`Bound` operator for one call site, a
  :class:`~ken.models.cascade.Cascade` plus the models it names and how their values become SQL
  values, with a one-line ``describe()`` for EXPLAIN;
- ``stages(ctx, constants)``: the models it runs, each a :class:`Stage` (the model's name and a
  picklable way to build it), declared once; from them the base class derives ``bind`` (a
  cascade of the stages with a default threshold), ``candidates(ctx, device)`` (the models to
  profile) and ``loaders(ctx, device)`` (what the online engine's worker processes call), and
  checks the stages' names and picklability in one place;
- ``eval_sample(ctx)``: the labelled evaluation sample with its per-row quality metric, which
  profiles (and so the cascade search and the planner) are measured on, or None when the
  operator cannot be planned;
- ``store_entries(home)``: the model-store entries of what it trained, for ``ken store``.

The SQL front-end, the profiler, the planner, the engine and EXPLAIN reach operators only
through this interface, and the :class:`OpContext` gives operators what they need of the
session (device, model store, data, progress reporter, a cache of loaded models).
"""

from __future__ import annotations

import copy
import difflib
import functools
import pickle
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from ken import store
from ken.errors import DataError, KenError, ModelError
from ken.models.cascade import Cascade
from ken.models.model import BOOLEAN_LABELS, DeviceConfig, Model
from ken.models.quality import EvalSample
from ken.models.resources import Resources
from ken.progress import QUIET, Reporter

SQL_TYPES = {"varchar": "VARCHAR", "boolean": "BOOLEAN", "double": "DOUBLE", "bigint": "BIGINT"}
#: a STRUCT output type's field name
FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def struct_output_type(fields: Sequence[tuple[str, str]]) -> str:
    """The output type of a STRUCT of ``(name, scalar type)`` fields:
    ``struct(name varchar, year bigint)``."""
    return "struct(" + ", ".join(f"{name} {kind}" for name, kind in fields) + ")"


def struct_fields(output_type: str) -> tuple[tuple[str, str], ...] | None:
    """The ``(name, scalar type)`` fields of a STRUCT output type; None for a scalar type."""
    if not (output_type.startswith("struct(") and output_type.endswith(")")):
        return None
    fields = []
    for part in output_type[len("struct("):-1].split(","):
        name, _, kind = part.strip().partition(" ")
        fields.append((name, kind.strip()))
    return tuple(fields)


def is_output_type(output_type: str) -> bool:
    """One of :data:`SQL_TYPES`, or a STRUCT of them with distinct plain field names."""
    if output_type in SQL_TYPES:
        return True
    fields = struct_fields(output_type)
    return (bool(fields) and all(FIELD_NAME.fullmatch(n) and k in SQL_TYPES for n, k in fields)
            and len({n.lower() for n, _ in fields}) == len(fields))


def sql_type(output_type: str) -> str:
    """The SQL spelling of an output type (``BIGINT``, ``STRUCT("name" VARCHAR, ...)``)."""
    fields = struct_fields(output_type)
    if fields is None:
        return SQL_TYPES[output_type]
    return "STRUCT(" + ", ".join(f'"{n}" {SQL_TYPES[k]}' for n, k in fields) + ")"


def to_sql_value(value: Any, output_type: str) -> Any:
    """One model value as a SQL value of ``output_type``; None stays NULL.

    Classifiers of boolean operators predict the labels ``"false"`` / ``"true"``; they become
    ``False`` / ``True``. Anything else that does not fit the type is a ``DataError``.
    """
    if value is None:
        return None
    fields = struct_fields(output_type)
    if fields is not None:
        if not isinstance(value, dict):
            raise DataError(f"a model value does not fit the operator's type "
                            f"{sql_type(output_type)}: {value!r} is not a record")
        return {name: to_sql_value(value.get(name), kind) for name, kind in fields}
    try:
        if output_type == "varchar":
            return value if isinstance(value, str) else str(value)
        if output_type == "boolean":
            if isinstance(value, str):
                if value in BOOLEAN_LABELS:
                    return value == "true"
                raise ValueError(f"the label {value!r}; boolean models predict "
                                 f"{BOOLEAN_LABELS}")
            return bool(value)
        if output_type == "double":
            return float(value)
        if output_type == "bigint":
            return int(value)
    except (TypeError, ValueError) as exc:
        raise DataError(f"a model value does not fit the operator's type "
                        f"{SQL_TYPES[output_type]}: {exc}") from None
    raise DataError(f"unknown output type {output_type!r}; use one of {sorted(SQL_TYPES)}")


def check_output_type(output_type: str) -> None:
    if not is_output_type(output_type):
        raise KenError(f"output type must be one of {sorted(SQL_TYPES)} (or a STRUCT of "
                       f"them), not {output_type!r}")


def quote_argument(text: str, limit: int = 60) -> str:
    """A constant argument as a one-line SQL string literal, shortened for EXPLAIN."""
    one_line = " ".join(text.split())
    if len(one_line) > limit:
        one_line = one_line[: limit - 3] + "..."
    return "'" + one_line.replace("'", "''") + "'"


class Bound(Protocol):
    """A semantic operator bound to its constant arguments, ready to run on columns."""

    function: str
    cascade: Cascade
    models: Mapping[str, Model]
    output_type: str

    def describe(self) -> str: ...

    def to_sql_values(self, values: Sequence[Any]) -> list[Any]: ...


@dataclass(frozen=True)
class ClassifierBinding:
    """A cascade whose values are the SQL values (e.g. ``sentiment``'s labels)."""

    function: str
    cascade: Cascade
    models: Mapping[str, Model]
    output_type: str = "varchar"
    calibrated: bool = True
    stage_fractions: tuple[float, ...] | None = None  # expected, from the profile
    expected_accuracy: float | None = None
    cost_ms_per_row: float | None = None  # expected model time per distinct input (profile)
    trained: str = ""  # Trained.describe() when the user trained the operator

    def describe(self) -> str:
        text = f"cascade {self.cascade.describe()} [{self.cascade.certainty}]"
        if self.expected_accuracy is not None:
            text += f", profiled accuracy {self.expected_accuracy:.1%}"
        return f"{text}; {self.trained}" if self.trained else text

    def to_sql_values(self, values: Sequence[Any]) -> list[Any]:
        return [to_sql_value(v, self.output_type) for v in values]


@dataclass(frozen=True, eq=False)
class BoundSemantic:
    """A semantic function bound to its constant arguments: a cascade and the models it runs.

    ``models`` holds at least every model the cascade names (read-only). ``calibrated`` says
    whether thresholds and probabilities were fitted on labelled data for this operator;
    EXPLAIN shows ``uncalibrated`` otherwise. ``detail`` is a short note for EXPLAIN (how it
    was calibrated, or why it fell back to defaults).

    >>> # bound = bind_sem_filter("complains about a flight delay", Resources())
    >>> # result = run_cascade(bound.cascade, bound.models, table["text"])
    >>> # keep = bound.to_sql_values(result.values)  # [True, False, None, ...]
    """

    function: str
    cascade: Cascade
    models: Mapping[str, Model] = field(repr=False)
    output_type: str
    calibrated: bool
    arguments: tuple[str, ...] = ()
    detail: str = ""

    def __post_init__(self) -> None:
        if not is_output_type(self.output_type):
            raise ModelError(f"output type must be one of {sorted(SQL_TYPES)} (or a STRUCT of "
                             f"them), not {self.output_type!r}")
        missing = [m for m in self.cascade.models if m not in self.models]
        if missing:
            raise ModelError(f"{self.function}: the cascade names {missing} but only "
                             f"{sorted(self.models)} are bound")
        if self.output_type == "boolean":
            for name in self.cascade.models:
                labels = tuple(self.models[name].spec.labels)
                if labels and labels != BOOLEAN_LABELS:
                    raise ModelError(f"{self.function}: model {name} predicts {labels}, a "
                                     f"boolean operator needs {BOOLEAN_LABELS}")
        # a read-only view: bound operators are shared between call sites and queries
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))

    def describe(self) -> str:
        """One line for EXPLAIN: the call, the cascade with its thresholds, calibration."""
        args = ", ".join(quote_argument(a) for a in self.arguments)
        head = f"{self.function}({args})" if args else self.function
        state = "calibrated" if self.calibrated else "uncalibrated"
        text = f"{head}: {self.cascade.describe()} [{self.cascade.certainty}], {state}"
        return f"{text}; {self.detail}" if self.detail else text

    def to_sql_values(self, values: Sequence[Any]) -> list[Any]:
        """The cascade's values as SQL values (``"true"`` -> ``True``); NULL stays NULL."""
        if hasattr(values, "to_pylist"):
            values = values.to_pylist()  # an Arrow array
        return [to_sql_value(v, self.output_type) for v in values]


class OpContext:
    """What operators get from the session: where models run and are stored, the data to
    train or sample from, progress reporting, and a cache of heavy objects (loaded models)
    made once even when several threads ask at once. A session owns one; no global state."""

    def __init__(self, device: DeviceConfig | None = None, home: Path | None = None,
                 data: Any = None, reporter: Reporter = QUIET, batch_size: int = 32,
                 chooser: Chooser | None = None) -> None:
        self.device = device or DeviceConfig(threads=2)
        self.chooser = chooser
        self.home = home
        self.data = data
        self.reporter = reporter
        self.batch_size = batch_size
        self.lock = threading.RLock()  # making a resource may make other resources
        self._resources: dict[str, Any] = {}

    def has_resource(self, key: str) -> bool:
        with self.lock:
            return key in self._resources

    def resource(self, key: str, make: Callable[[], Any]) -> Any:
        with self.lock:
            if key not in self._resources:
                self._resources[key] = make()
            return self._resources[key]

    def choose_cascade(self, op: Operator, cascade: Cascade | None = None) -> ChosenCascade:
        """The cascade ``op`` runs: ``cascade`` if given (scored by the chooser when there is
        one), else the chooser's default from the operator's profiles."""
        if self.chooser is not None:
            return self.chooser(op, self, cascade)
        if cascade is None:
            raise KenError(f"{op.name}() has no cascade chosen and this context has no "
                           "cascade chooser; set one (e.g. session.sentiment_cascade)")
        return ChosenCascade(cascade)


def shared_resources(ctx: OpContext) -> Resources:
    """The pretrained networks (MiniLM encoders, SmolLM2) that sem_filter, sem_match and
    sem_classify share, loaded once per session and device (``ken.models.resources``)."""
    return ctx.resource("semantic-resources",
                        lambda: Resources(ctx.device, ctx.home, ctx.reporter))


@dataclass(frozen=True)
class ChosenCascade:
    """The cascade a bound operator runs, with what its profile expects of it (if known)."""

    cascade: Cascade
    stage_fractions: tuple[float, ...] | None = None
    accuracy: float | None = None
    cost_ms_per_row: float | None = None  # expected model time per row, all stages


#: ``chooser(operator, ctx, user_cascade_or_None) -> ChosenCascade``: how a session picks an
#: operator's default cascade from profiles (the optimizer's job; set by the session)
Chooser = Callable[["Operator", "OpContext", Cascade | None], ChosenCascade]


@dataclass(frozen=True)
class Stage:
    """One model an operator runs, declared without loading it.

    ``name`` is the model's name, what cascades, profiles, gear plans and EXPLAIN call it, so it
    must be known before the model is built and be unique per behaviour (put a hash of what
    changes the outputs into it). ``load(resources, device, *args)`` builds the model on
    ``device``, taking heavy networks from ``resources`` (a :class:`Resources`): a
    **module-level** function with plain ``args``, so that the stage pickles and a worker
    process builds it with its own ``Resources`` (no lambdas, closures, bound methods or
    loaded models).

    >>> # Stage("kw-small", load_keyword_model, ("delay",))
    """

    name: str
    load: Callable[..., Model]
    args: tuple[Any, ...] = ()

    def build(self, resources: Resources, device: DeviceConfig) -> Model:
        """The model, built on ``device``; a model of another name is an error."""
        model = self.load(resources, device, *self.args)
        if model.name != self.name:
            raise KenError(f"the stage {self.name!r} built a model named {model.name!r}; a "
                           "stage's name must be the name of the model it builds")
        return model


def load_in_worker(stage: Stage, home: Path | None, device: DeviceConfig) -> Model:
    """Build ``stage`` in a worker process, on its own networks (what :meth:`Operator.loaders`
    sends, as a ``functools.partial``)."""
    return stage.build(Resources(device, home), device)


class Operator:
    """A SQL-callable semantic operator (see the module docstring).

    Subclass it, set the SQL signature (``name``, ``num_columns``, ``constants``,
    ``output_type``), and declare the models with ``stages``: ``bind``, ``candidates`` and
    ``loaders`` follow from them. Add ``eval_sample`` and ``plannable`` to make it plannable,
    and override ``bind`` where a call site needs more than a cascade of the stages (a
    calibration, a trained model, a cascade chosen from profiles).
    """

    name: str = ""
    num_columns: int = 1
    constants: tuple[str, ...] = ()
    output_type: str = "varchar"
    doc: str = ""
    #: constants the evaluation sample is for (profiles of an operator with constants are
    #: measured on these, e.g. sem_filter's evaluation predicate)
    eval_constants: tuple[str, ...] = ()
    #: SQL passes the column arguments as JSON text (``to_json``), so that a struct or a whole
    #: row arrives as an object and a text as a JSON string (``ken.models.records.as_record``)
    record_columns: bool = False
    #: an aggregate (``sem_agg``): SQL passes each group's values of the column argument as one
    #: sorted list (``list_sort(list(x))``, as JSON text with ``record_columns``), and the
    #: operator answers once per group
    aggregate: bool = False
    #: the escalation threshold between the stages of the default binding (uncalibrated;
    #: planning chooses thresholds on the evaluation sample)
    threshold: float = 0.5
    #: how a plan serves it (``ken.policy.plan``): "gear" — its stages answer rows in batches
    #: (GearPlan: gears by request rate) — or "generation" — its stages generate text token by
    #: token in a decode server (GenPlan: gears by requests in the system)
    plan_kind: str = "gear"

    def stages(self, ctx: OpContext, constants: tuple[str, ...]) -> Sequence[Stage] | None:
        """The models that answer calls with ``constants``, cheapest first: the default
        binding's cascade, and (for ``eval_constants``) the candidates the planner profiles
        and the worker processes load. None: the operator binds its own models (override
        ``bind``) and is served by thread workers."""
        return None

    def detail(self, constants: tuple[str, ...]) -> str:
        """What EXPLAIN says about the default binding's calls (prompt version, truncation)."""
        return ""

    def binding_key(self) -> tuple:
        """The settings a binding depends on beside its constants (e.g. an LLM operator's
        ``llms``): a session binds again when they change."""
        return ()

    def bind(self, ctx: OpContext, constants: tuple[str, ...]) -> Bound:
        """The call site's cascade: every stage in order, escalating below ``threshold``."""
        stages = self.declared_stages(ctx, constants)
        if stages is None:
            raise KenError(f"{self.name}() declares no stages; override stages() or bind()")
        models = self.build_stages(stages, ctx, ctx.device)
        cascade = Cascade(tuple(models), (self.threshold,) * (len(models) - 1))
        note = self.detail(constants)
        if len(models) > 1:
            note = (f"{note}; " if note else "") + (
                f"default threshold {self.threshold:g}; plan it for a calibrated cascade")
        return BoundSemantic(self.name, cascade, models, self.output_type, calibrated=False,
                             arguments=constants, detail=note)

    def declared_stages(self, ctx: OpContext, constants: tuple[str, ...],
                        for_workers: bool = False) -> list[Stage] | None:
        """``stages(ctx, constants)``, checked: stages with distinct non-empty names, and with
        ``for_workers``, each one picklable."""
        stages = self.stages(ctx, constants)
        if stages is None:
            return None
        stages = list(stages)
        seen: set[str] = set()
        for stage in stages:
            if not isinstance(stage, Stage):
                raise KenError(f"{self.name}(): stages() must return Stage objects, not "
                               f"{type(stage).__name__}")
            if not isinstance(stage.name, str) or not stage.name:
                raise KenError(f"{self.name}(): a stage has no name; name it as its model")
            if stage.name in seen:
                raise KenError(f"{self.name}(): two stages are named {stage.name!r}; stage "
                               "names name models in cascades and plans, so they must differ")
            seen.add(stage.name)
            if for_workers:
                try:
                    pickle.dumps(stage)
                except (pickle.PicklingError, AttributeError, TypeError) as exc:
                    raise KenError(
                        f"{self.name}(): the stage {stage.name!r} cannot be sent to a worker "
                        f"process ({exc}); its load must be a module-level function and its "
                        "args plain values (no lambda, closure, bound method or loaded "
                        "model)") from None
        return stages

    def build_stages(self, stages: Sequence[Stage], ctx: OpContext, device: DeviceConfig
                     ) -> dict[str, Model]:
        """The stages' models on ``device``, by name, on the session's shared networks."""
        resources = shared_resources(ctx)
        try:
            return {stage.name: stage.build(resources, device) for stage in stages}
        except KenError as exc:
            if type(exc) is not KenError:
                raise
            raise KenError(f"{self.name}(): {exc}") from None

    def eval_sample(self, ctx: OpContext) -> EvalSample | None:
        """The labelled sample profiles are measured on (None: the operator cannot be
        planned)."""
        return None

    def plannable(self) -> bool:
        """Whether the operator can be profiled and planned (cheap: loads nothing)."""
        return False

    def profiles(self, ctx: OpContext, threads: int) -> Mapping[str, Any] | None:
        """Profiles measured elsewhere (e.g. on other hardware, or an artifact), by model;
        None (the default): the planner measures ``candidates`` on ``eval_sample``."""
        return None

    def eval_description(self) -> str:
        """Which data the evaluation sample comes from (for EXPLAIN and `ken plan`)."""
        return "no evaluation sample"

    def candidates(self, ctx: OpContext, device: DeviceConfig) -> Mapping[str, Model]:
        """The models to profile, loaded on ``device``: the stages for ``eval_constants``
        (without stages: the models of the operator bound to them, on the session's
        device)."""
        stages = self.declared_stages(ctx, self.eval_constants)
        if stages is None:
            return dict(self.bind(ctx, self.eval_constants).models)
        return self.build_stages(stages, ctx, device)

    def loaders(self, ctx: OpContext, device: DeviceConfig
                ) -> Mapping[str, Callable[[], Model]] | None:
        """Picklable loaders of the candidate models on ``device`` (a CPU device of some
        threads, or a GPU as a worker process that owns one sees it: ``cuda:0``), from the
        stages for ``eval_constants``; None (no stages): the engine serves the operator with
        thread workers."""
        stages = self.declared_stages(ctx, self.eval_constants, for_workers=True)
        if stages is None:
            return None
        return {stage.name: functools.partial(load_in_worker, stage, ctx.home, device)
                for stage in stages}

    def train(self, ctx: OpContext, data: Any, **options: Any) -> Any:
        """Train or calibrate the operator on a user's labelled rows (a
        ``ken.ops.training.TrainingData``); returns a ``Trained`` record. Operators that learn
        nothing from labels say so."""
        raise KenError(f"{self.name}() cannot be trained on labels; the trainable built-ins "
                       "are sentiment, sem_filter, sem_match, sem_classify and sem_join")

    def store_entries(self, home: Path) -> list[tuple[str, store.Entry]]:
        """What this operator keeps in the model store at ``home`` (trained or prepared
        state), each entry with a kind label for ``ken store`` (none by default)."""
        return []

    @property
    def arity(self) -> int:
        return self.num_columns + len(self.constants)

    def signature(self) -> str:
        args = [f"text{i + 1}" if self.num_columns > 1 else "text"
                for i in range(self.num_columns)]
        args += [f"'{c}'" for c in self.constants]
        return f"{self.name}({', '.join(args)}) -> {SQL_TYPES[self.output_type]}"

    def check(self) -> None:
        check_output_type(self.output_type)
        if not self.name.isidentifier():
            raise KenError(f"{self.name!r} is not a valid SQL function name")
        if self.num_columns < 1:
            raise KenError(f"{self.name}() needs at least one column argument")

    def renamed(self, name: str) -> Operator:
        """This operator under another SQL name (``session.register("mood", op)``)."""
        clone = copy.copy(self)
        clone.name = name
        return clone


class SemanticFunction(Operator):
    """An operator made from a bind callable: ``binder(constants) -> Bound`` (not plannable).

    >>> # session.register("mood", SemanticFunction("mood", 1, (), "varchar",
    >>> #                  lambda _c: ClassifierBinding("mood", cascade, models)))
    """

    def __init__(self, name: str, num_columns: int, constants: tuple[str, ...],
                 output_type: str, binder: Callable[[tuple[str, ...]], Bound],
                 doc: str = "") -> None:
        self.name = name
        self.num_columns = num_columns
        self.constants = tuple(constants)
        self.output_type = output_type
        self.binder = binder
        self.doc = doc
        self.check()

    def bind(self, ctx: OpContext, constants: tuple[str, ...]) -> Bound:
        return self.binder(constants)


class ModelOperator(Operator):
    """A user's model or cascade as an operator: its values are the SQL values.

    With an evaluation ``sample`` (an :class:`EvalSample`) it can be profiled and planned like
    a built-in: the candidates are ``models`` and the cascade search chooses among them.
    """

    def __init__(self, name: str, cascade: Cascade, models: Mapping[str, Model],
                 output_type: str = "varchar", sample: EvalSample | None = None) -> None:
        missing = [m for m in cascade.models if m not in models]
        if missing:
            raise KenError(f"the cascade of {name}() uses {missing}, which models= lacks")
        self.name = name
        self.cascade = cascade
        self.models = dict(models)
        self.output_type = output_type
        self.num_columns = self.models[cascade.models[0]].spec.num_inputs
        self.sample = sample
        self.doc = f"cascade {cascade.describe()}"
        self.check()

    def bind(self, ctx: OpContext, constants: tuple[str, ...]) -> Bound:
        return ClassifierBinding(self.name, self.cascade, self.models, self.output_type)

    def eval_sample(self, ctx: OpContext) -> EvalSample | None:
        return self.sample

    def plannable(self) -> bool:
        return self.sample is not None

    def eval_description(self) -> str:
        return (f"the sample given to register() ({self.sample.name}, {len(self.sample)} rows)"
                if self.sample is not None else "no evaluation sample")

    def candidates(self, ctx: OpContext, device: DeviceConfig) -> Mapping[str, Model]:
        return dict(self.models)


def suggest(name: str, candidates: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest candidate, or nothing."""
    close = difflib.get_close_matches(name.lower(), sorted(set(candidates)), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""
