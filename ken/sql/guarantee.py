"""Targets with guarantees in queries (issue 36, item 1): a call site whose cascade must meet
accuracy, precision or recall against an oracle stage with probability ``1 - delta``.

Set per operator in Python (``session.set_target('sem_filter', 'recall', 0.9, delta=0.05,
oracle=None)``) or for every call site in SQL (``SET ken_recall_target = 0.9``,
``ken_precision_target``, ``ken_accuracy_target``, ``SET ken_delta = 0.05``; ``RESET`` or
``= none`` removes it). A SQL target holds one metric: setting another replaces it.

Before a statement with a targeted call site runs:

1. The site's distinct inputs under the statement's relational conditions are listed: the
   population the guarantee is about (a superset of the inputs that reach the site when
   semantic conditions filter before it).
2. Up to ``PATH_ROWS`` of them, drawn uniformly, are answered by the stages before the oracle:
   their certainties set the threshold path (``quantile_path``; no oracle answer is involved).
3. ``sample_size`` of them, drawn uniformly and independently of the path's draw (so the
   sample is uniform over every input and the path tells nothing of it), are answered by
   every stage up to the oracle; the oracle's answers are those inputs' final answers (the
   query does not pay for them twice).
4. ``choose_thresholds`` picks the cheapest certified setting; the site runs that cascade on
   the remaining inputs, or the oracle alone when nothing cheaper is certified. When the
   sample would hold every input, the oracle answers every input instead.

The draw uses a fixed seed, so a query repeats exactly. The stages are the site's cascade, or
when it has one stage (e.g. ``sentiment``'s default, MiniLM-L6 alone) or the oracle is not in
it, every model the binding holds, cheapest first. A targeted site neither reads nor writes the
result cache (its answers depend on the sample); one on Ray or in the early-LIMIT and top-k
plans is not supported (an error, or those plans step aside).

A site an online engine serves samples nothing: its gear plan keeps the target when the
function was planned under it (``Session.plan`` with the target set certifies every cascade
its plans may serve, ``ken.optimizer.certified``) and every gear served is one of those
cascades (``served_guarantee``); otherwise the statement fails and says how to plan for it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from ken.errors import GuaranteeError, KenError
from ken.ops.base import Bound, OpContext, Operator, suggest
from ken.ops.sem_join import SemJoin
from ken.optimizer.certified import CertifiedCandidates
from ken.optimizer.guarantee import (
    DEFAULT_DELTA,
    POSITIVE,
    Guarantee,
    GuaranteeTarget,
    StageOutcomes,
    as_label,
    check_metric,
    choose_thresholds,
    quantile_path,
    sample_size,
)
from ken.sql.cost import distinct_inputs, site_scope
from ken.sql.execute import SiteRunner, StageCounter
from ken.sql.rewrite import CallSite, Rewritten

#: ``SET ken_recall_target = 0.9`` / ``ken_precision_target`` / ``ken_accuracy_target`` /
#: ``ken_delta`` / ``RESET ...``
SETTING = re.compile(r"^\s*(SET|RESET)\s+(?:SESSION\s+)?ken_(accuracy_target|precision_target|"
                     r"recall_target|delta)\s*(?:(?:=|TO)\s*'?([^'\s]*)'?)?\s*$", re.IGNORECASE)
#: inputs whose certainties (stages before the oracle) set the threshold path
PATH_ROWS = 200
#: the seed of the draws, so that a query repeats exactly
SEED = 0
#: the least positive share assumed when sizing a precision or recall sample
MIN_POSITIVE_SHARE = 0.05


# -- the session's targets ---------------------------------------------------------------------


@dataclass
class Targets:
    """A session's targets: per function (Python), and one for every call site (SQL)."""

    by_function: dict[str, GuaranteeTarget] = field(default_factory=dict)
    default: GuaranteeTarget | None = None
    delta: float = DEFAULT_DELTA  # what SQL targets use
    #: oracle-labelled inputs per sample (None: what ``sample_size`` says); any size keeps the
    #: guarantee, a smaller one falls back to the oracle more often
    sample_rows: int | None = None
    path_rows: int = PATH_ROWS  # inputs whose certainties set the threshold path
    #: per function planned under a target (``Session.plan``): the cascades certified for
    #: it, which are all its gear plans serve (``ken.optimizer.certified``)
    certified: dict[str, CertifiedCandidates] = field(default_factory=dict)

    def for_function(self, function: str) -> GuaranteeTarget | None:
        return self.by_function.get(function, self.default)

    def applies(self, rw: Rewritten) -> bool:
        return any(self.for_function(s.function) is not None for s in rw.sites)

    def set(self, operators: Mapping[str, Operator], function: str, metric: str,
            target: float, delta: float = DEFAULT_DELTA, oracle: str | None = None
            ) -> GuaranteeTarget:
        """The target of ``function`` (``Session.set_target``)."""
        name = function.lower()
        if name not in operators:
            raise KenError(f"no semantic function {function}() to set a target for."
                           f"{suggest(name, operators)}")
        chosen = GuaranteeTarget(metric, target, delta, oracle)
        check_metric(metric, operators[name].output_type)
        self.by_function[name] = chosen
        return chosen

    def statement(self, verb: str, name: str, value: str | None) -> pa.Table:
        """``SET ken_<metric>_target = x`` / ``SET ken_delta = x`` / ``RESET ...``."""
        name = name.lower()
        text = (value or "").strip().lower()
        clear = verb.upper() == "RESET" or text in ("none", "off")
        if verb.upper() == "SET" and not text:
            raise GuaranteeError(f"SET ken_{name} needs a value, e.g. SET ken_{name} = "
                                 f"{'0.05' if name == 'delta' else '0.9'} (or none)")
        number = None
        if not clear:
            try:
                number = float(text)
            except ValueError:
                raise GuaranteeError(f"SET ken_{name} takes a number (or none), not "
                                     f"{value!r}") from None
        if name == "delta":
            delta = DEFAULT_DELTA if number is None else number
            if self.default is not None:
                self.default = dataclasses.replace(self.default, delta=delta)  # validates
            else:
                GuaranteeTarget("accuracy", 1.0, delta)  # validates
            self.delta = delta
            return pa.table({"setting": ["ken_delta"], "value": [f"{self.delta:g}"]})
        metric = name.removesuffix("_target")
        if clear:
            if self.default is not None and self.default.metric == metric:
                self.default = None
        else:
            self.default = GuaranteeTarget(metric, number, self.delta)
        shown = (f"{self.default.metric} >= {self.default.target:g} (delta {self.delta:g})"
                 if self.default is not None else "none")
        return pa.table({"setting": [f"ken_{name}"], "value": [shown]})


# -- a targeted call site ----------------------------------------------------------------------


@dataclass(frozen=True)
class TargetRun:
    """What a target did at one call site (``Result.stats["targets"]``, EXPLAIN ANALYZE).

    ``inputs``: the site's distinct inputs; ``sample_rows``: inputs every stage up to the oracle
    answered (the oracle's answers kept); ``path_rows``: inputs the stages before the oracle
    answered to set the path; ``stage_calls``: model calls of those two, per model;
    ``all_oracle``: the oracle answered every input (sample and path would leave none);
    ``needed``: the sample the bound asked for; ``run_oracle_calls``: inputs that reached the
    oracle while the statement ran (after the sample)."""

    site: str
    sites: tuple[int, ...]  # the call sites' ids (sites of one bound operator share a sample)
    target: GuaranteeTarget
    oracle: str
    inputs: int
    needed: int
    sample_rows: int
    path_rows: int
    stage_calls: tuple[tuple[str, int], ...]
    guarantee: Guarantee | None = None
    all_oracle: bool = False
    run_oracle_calls: int = 0
    note: str = ""  # why nothing was sampled

    @property
    def oracle_calls(self) -> int:
        """Every oracle call the target cost or made: the sample and the escalated inputs."""
        return self.sample_rows + self.run_oracle_calls

    def line(self) -> str:
        head = f"target {self.site}: {self.target.metric} >= {self.target.target:g} against " \
               f"{self.oracle} (delta {self.target.delta:g})"
        if self.all_oracle:
            why = ("only the oracle meets a target of 1" if self.needed == 0 else
                   f"the bound needs a sample of {self.needed:,}")
            return (f"{head}: the oracle answered all {self.inputs:,} distinct inputs ({why})")
        if self.guarantee is None:
            return f"{head}: {self.note}"
        g = self.guarantee
        path = (f"; thresholds' path from {self.path_rows:,} inputs drawn apart"
                if self.path_rows else "")
        calls = ", ".join(f"{m} {c:,}" for m, c in self.stage_calls)
        if g.fell_back:
            verdict = (f"not met cheaper than the oracle on {g.sample_size:,} sampled inputs "
                       f"(the cheapest setting's bound {g.failed_bound:.3f}): the oracle "
                       "answered every input")
        elif not g.thresholds:
            verdict = "the oracle is the cascade's first stage: it answered every input"
        else:
            verdict = (f"met with {g.cascade.describe()} on {g.sample_size:,} sampled inputs, "
                       f"bound {g.lower_bound:.3f} (sample {g.estimate:.3f} on {g.trials:,})")
        return (f"{head}: {verdict}{path}; {self.oracle_calls:,} oracle calls in all "
                f"({self.sample_rows:,} for the sample, {self.run_oracle_calls:,} escalated "
                f"of {self.inputs - self.sample_rows:,} other inputs); sample and path calls: "
                f"{calls}")


def target_stages(bound: Bound, oracle: str | None) -> tuple[str, ...]:
    """The stages a target chooses thresholds for, up to and including the oracle."""
    cascade = tuple(bound.cascade.models)
    stages = cascade
    if len(cascade) < 2 or (oracle is not None and oracle not in cascade):
        stages = tuple(bound.models)
    if oracle is None:
        return stages
    if oracle not in stages:
        raise GuaranteeError(f"the oracle {oracle!r} is not a model of {bound.function}(); its "
                             f"models are: {', '.join(stages)}")
    return stages[: stages.index(oracle) + 1]


def site_inputs(con: Any, rw: Rewritten, site: CallSite) -> list:
    """The distinct non-NULL inputs of ``site`` under the relational conditions of its SELECT
    (the semantic ones dropped), in a fixed order."""
    scoped = site_scope(rw, site)
    if scoped is None:
        raise GuaranteeError(f"{site.call_sql()}: a target needs the call's inputs listed "
                             "before the statement runs, and this call has no SELECT scope")
    try:
        keys = distinct_inputs(con, scoped[0], site)
    except duckdb.Error as exc:
        raise GuaranteeError(f"{site.call_sql()}: a target needs the call's inputs listed "
                             f"before the statement runs, which failed here ({exc})") from None
    return sorted(set(keys), key=repr)


def _answers(bound: Bound, model: str, inputs: list, certainty: str, batch_size: int
             ) -> tuple[list, np.ndarray]:
    """One stage's values and certainties on ``inputs``."""
    if not inputs:
        return [], np.zeros(0)
    out = bound.models[model].predict(inputs, batch_size)
    return [as_label(v) for v in out.values], np.asarray(out.certainty(certainty), np.float64)


def prepare(con: Any, rw: Rewritten, runners: Sequence[SiteRunner], target: GuaranteeTarget,
            targets: Targets, ctx: OpContext) -> TargetRun:
    """Steps 1-4 of the module docstring for the call sites ``runners`` (one bound operator,
    one memo): the sample's oracle answers go into their memo and the sites run the chosen
    cascade."""
    first = runners[0]
    bound = first.bound
    label = f"{first.site.label} {first.site.call_sql()}"
    sites = tuple(r.site.id for r in runners)
    served = [r.engine for r in runners if r.engine is not None]
    if served:
        note = served_guarantee(label, first.site.function, served, target, targets)
        return TargetRun(label, sites, target, targets.certified[first.site.function].oracle,
                         0, 0, 0, 0, (), note=note)
    if not dataclasses.is_dataclass(bound) or not hasattr(bound, "models"):
        raise GuaranteeError(f"{label}: a target needs a cascade of the function's models; "
                             f"{first.site.function}() binds none")
    stages = target_stages(bound, target.oracle)
    oracle = stages[-1]
    certainty = bound.cascade.certainty
    population = list(dict.fromkeys(k for r in runners for k in site_inputs(con, rw, r.site)))
    if not population or len(stages) == 1:
        note = ("no input to answer" if not population else
                "the oracle is the cascade's first stage: it answers every input")
        if len(stages) == 1:
            _use_cascade(runners, (oracle,), ())
        return TargetRun(label, sites, target, oracle, len(population), 0, 0, 0, (), note=note)
    path_draw, sample_draw = (np.random.default_rng(SEED + k) for k in (0, 1))
    calls = {m: 0 for m in stages}
    # a target of 1 is met by the oracle alone: no path, no sample
    path_rows = min(targets.path_rows, len(population)) if target.target < 1.0 else 0
    path_keys = [population[i] for i in path_draw.choice(len(population), path_rows,
                                                         replace=False)]
    path_certs = []
    positive = 1.0
    for i, model in enumerate(stages[:-1]):
        values, cert = _answers(bound, model, path_keys, certainty, ctx.batch_size)
        calls[model] += len(path_keys)
        path_certs.append(cert)
        if i == 0 and values:
            positive = max(MIN_POSITIVE_SHARE, float(np.mean(np.array(values) == POSITIVE)))
    needed = targets.sample_rows or sample_size(target.metric, target.target, target.delta,
                                                positive_share=positive)
    every = needed == 0 or needed >= len(population)
    sample = population if every else [population[i] for i in sample_draw.choice(
        len(population), needed, replace=False)]
    outcomes = []
    for model in (oracle,) if every else stages:
        outcomes.append(_answers(bound, model, sample, certainty, ctx.batch_size))
        calls[model] += len(sample)
    guarantee = None
    if every:
        _use_cascade(runners, (oracle,), ())
    else:
        rows = StageOutcomes(stages, [v for v, _ in outcomes],
                             np.array([c for _, c in outcomes]), certainty)
        guarantee = choose_thresholds(
            rows, GuaranteeTarget(target.metric, target.target, target.delta, oracle),
            quantile_path(path_certs))
        _use_cascade(runners, guarantee.cascade.models, guarantee.cascade.thresholds)
    first.memo.update(zip(sample, bound.to_sql_values(outcomes[-1][0]), strict=True))
    first.stats.distinct_evaluated += len(sample)
    return TargetRun(label, sites, target, oracle, len(population), needed, len(sample),
                     path_rows, tuple((m, c) for m, c in calls.items() if c), guarantee, every)


def served_guarantee(label: str, function: str, engines: Sequence[Any],
                     target: GuaranteeTarget, targets: Targets) -> str:
    """The line of a targeted site an online engine serves: its gear plan keeps the target
    when the function was planned under it (or a stricter one) and every gear the engine
    serves now is one of the certified cascades; otherwise a ``GuaranteeError`` that says
    how to get there."""
    certified = targets.certified.get(function)
    how = (f"plan it under the target (session.set_target('{function}', "
           f"'{target.metric}', {target.target:g}) or SET ken_{target.metric}_target, then "
           "session.plan(...)), stop serving it (session.stop()), or remove the target")
    if certified is None:
        raise GuaranteeError(f"{label}: an online engine serves this function with a gear plan "
                             f"that was not planned under {target.describe()}; {how}")
    if not certified.covers(target):
        raise GuaranteeError(f"{label}: the served gear plan was planned under "
                             f"{certified.target.describe()}, which does not keep "
                             f"{target.describe()}; {how}")
    for engine in engines:
        plan = engine.plans.get(function)
        other = [c.describe() for c in (plan.cascades if plan is not None else ())
                 if c not in certified.cascades]
        if plan is None or other:
            raise GuaranteeError(f"{label}: the served gear plan runs cascades that were not "
                                 f"certified for {target.describe()} ({', '.join(other[:2])}): "
                                 f"it was set by hand or planned without the target; {how}")
    return f"served by its gear plan, {certified.describe()}"


def _use_cascade(runners: Sequence[SiteRunner], models: tuple[str, ...],
                 thresholds: tuple[float, ...]) -> None:
    """The sites run ``models`` with ``thresholds`` (their counters follow), without the
    result cache: a targeted site's answers depend on its sample."""
    for r in runners:
        bound = r.bound
        cascade = dataclasses.replace(bound.cascade, models=models, thresholds=thresholds)
        expected = {k: None for k in ("stage_fractions", "expected_accuracy", "cost_ms_per_row")
                    if hasattr(bound, k)}  # the profile's expectations were of another cascade
        r.bound = dataclasses.replace(bound, cascade=cascade, **expected)
        r.stats.stages = [StageCounter(m) for m in models]
        r.cache = None


def apply_targets(con: Any, rw: Rewritten, runners: Sequence[SiteRunner], targets: Targets,
                  operators: Mapping[str, Operator], ctx: OpContext) -> list[TargetRun]:
    """Prepare every targeted call site of ``rw`` (their functions registered on ``con``);
    sites of one bound operator share one sample."""
    groups: dict[int, list[SiteRunner]] = {}
    for r in runners:
        if targets.for_function(r.site.function) is not None:
            groups.setdefault(id(r.memo), []).append(r)
    out = []
    for group in groups.values():
        function = group[0].site.function
        target = targets.for_function(function)
        assert target is not None
        op = operators[function]
        if op.aggregate or isinstance(op, SemJoin):
            raise GuaranteeError(f"{function}() takes no target: targets apply to functions "
                                 "that answer each input on its own, not to aggregates or "
                                 "joins (whose plans answer some pairs without the models)")
        check_metric(target.metric, op.output_type)
        out.append(prepare(con, rw, group, target, targets, ctx))
    return out


def finished(runs: Sequence[TargetRun], runners: Sequence[SiteRunner]) -> list[TargetRun]:
    """The runs with the oracle calls the statement made after the sample."""
    out = []
    for run in runs:
        site_runners = [r for r in runners if r.site.id in run.sites]
        escalated = sum(s.input_rows for r in site_runners for s in r.stats.stages
                        if s.model == run.oracle)
        out.append(dataclasses.replace(run, run_oracle_calls=escalated))
    return out


def plan_lines(con: Any, rw: Rewritten, site: CallSite, targets: Targets,
               engine: Any = None) -> list[str]:
    """EXPLAIN's line for a targeted call site: the target and the sample it needs, or for a
    site ``engine`` serves, whether its gear plan keeps the target."""
    target = targets.for_function(site.function)
    if target is None:
        return []
    if engine is not None:
        try:
            line = served_guarantee(site.call_sql(), site.function, [engine], target, targets)
        except GuaranteeError as exc:
            line = f"the statement will fail: {exc}"
        return [f"target: {target.describe()}: {line}"]
    needed = targets.sample_rows or sample_size(target.metric, target.target, target.delta)
    against = target.oracle or "the last stage"
    head = (f"target: {target.metric} >= {target.target:g} against {against} (delta "
            f"{target.delta:g})")
    if needed == 0:
        return [f"{head}: only the oracle meets a target of 1; it answers every input"]
    try:
        inputs = f" of {len(site_inputs(con, rw, site)):,} distinct inputs"
    except GuaranteeError:
        inputs = ""
    what = ("oracle-labelled inputs" if target.metric == "accuracy" else
            f"inputs the {'cascade answers' if target.metric == 'precision' else 'oracle calls'}"
            " true (the sample is that over their share)")
    if targets.sample_rows:
        what = "inputs (session.targets.sample_rows)"
    return [f"{head}: needs a sample of {needed:,} {what}{inputs}, and the stages before the "
            f"oracle on up to {targets.path_rows} for the thresholds' path; the oracle answers "
            "every input when the sample would hold them all"]

