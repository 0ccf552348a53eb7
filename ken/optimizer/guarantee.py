"""Cascade thresholds with a statistical guarantee against an oracle stage (issue 36, item 1).

A target says: the cascade's **accuracy** (agreement with the oracle), or for a boolean
operator its **precision** or **recall** of the positive value ``"true"``, measured against the
answers of an oracle stage (by default the cascade's last), is at least ``target`` with
probability at least ``1 - delta`` over the sample the thresholds are chosen on. The metric is
over the rows the cascade answers (the population the sample is drawn from), not over a
labelled benchmark: the oracle defines what is right.

The procedure
-------------
1. **A path fixed before any oracle label is seen.** Candidate threshold settings of the
   stages before the oracle are ordered from the safest to the cheapest
   (:class:`ThresholdPath`). The default path (:func:`quantile_path`) is one-dimensional for
   any number of stages: at step ``j`` of ``m`` every stage answers the rows whose certainty
   is among the top ``j/m`` share of that stage's certainties on unlabelled rows (the
   operator's profile rows, or the pool's), and escalates the rest. Every stage's threshold
   falls along the path, so each step sends a subset of the previous step's rows on to every
   later stage: the path is ordered from the most to the least expensive for any per-row
   costs of the stages. The path depends on certainties of rows other than the labelled
   sample's, never on oracle answers; that is what makes the hypotheses below fixed.
2. **An exact one-sided bound per step.** On ``n`` rows drawn uniformly from the population,
   each step's metric is a binomial proportion: accuracy over all ``n`` rows; precision over
   the rows the cascade answers positive; recall over the rows the oracle calls positive
   (conditionally on how many there are, these are i.i.d. draws from the population restricted
   to them, so the count is conditionally binomial). The lower confidence bound is
   Clopper-Pearson's at level ``delta``: the ``p`` at which ``P(Binomial(trials, p) >=
   successes) = delta``, the quantile ``Beta(delta; k, trials - k + 1)``; it is exact
   (never below its level), and for a fixed sample size no valid bound for a binomial
   proportion is much tighter, which is why it is used rather than a Hoeffding or
   normal-approximation bound.
3. **Fixed-sequence testing.** The steps are tested in path order; the chosen setting is the
   last one that passes (bound ``>= target``) before the first that fails. The setting it
   returns misses the target only if the first step whose true metric is below the target
   passed its test, which has probability at most ``delta``: no union bound over the steps is
   needed, so a long path costs no confidence. When the first step fails, nothing cheaper
   than the oracle is certified: the result says so (``fell_back``) and the oracle answers
   every row.

Rows drawn without replacement (a query samples distinct inputs) make the counts
hypergeometric, which is more concentrated than the binomial: the bound stays valid and
becomes conservative (``tests/test_guarantee.py`` checks the miss rate both ways).

What it is based on: the published descriptions of LOTUS's approximate semantic operators with
precision/recall guarantees (Patel et al., 2024: proxy/oracle cascades whose thresholds are set
on an oracle-labelled sample, there with normal-approximation bounds and a union bound over the
candidate thresholds for precision) and of BARGAIN (Zeighami, Shankar and Parameswaran, 2025:
thresholds tested in order from the safest with exact or betting-style bounds and
fixed-sequence testing, which is what makes its guarantees tighter). The papers are not on this
machine; this module follows those descriptions and LOTUS's open-source threshold code, not the
papers' text. It does not implement BARGAIN's adaptive sampling (sampling only among the rows
a candidate setting answers): one uniform sample serves every step here, which also gives the
query its first answers.

The sample size is set by the bound (:func:`sample_size`): the smallest ``n`` at which a
setting whose true metric is ``target + margin`` passes its test with probability ``power``
(0.9 by default).

>>> import numpy as np
>>> rows = StageOutcomes(("small", "big"), (("a", "b", "a", "a"), ("a", "b", "b", "a")),
...                      np.array([[0.9, 0.8, 0.3, 0.7], [1.0, 1.0, 1.0, 1.0]]))
>>> path = quantile_path([np.array([0.9, 0.8, 0.3, 0.7])], steps=4)
>>> choose_thresholds(rows, GuaranteeTarget("accuracy", 0.5, 0.2), path).fell_back
False
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from ken.errors import GuaranteeError
from ken.models.cascade import Cascade, escalates
from ken.models.certainty import CERTAINTY_FUNCTIONS
from ken.models.model import BOOLEAN_LABELS

METRICS = ("accuracy", "precision", "recall")
#: the positive value of a boolean operator (precision and recall are of this value)
POSITIVE = BOOLEAN_LABELS[1]
DEFAULT_DELTA = 0.05
#: steps of the default path: finer steps cost no confidence (fixed-sequence testing)
DEFAULT_STEPS = 40
#: the probability with which a setting ``margin`` above the target passes (``sample_size``)
DEFAULT_POWER = 0.9


def default_margin(target: float) -> float:
    """How far above ``target`` a setting's true metric is assumed when sizing the sample:
    0.05, or half the distance to 1 for targets above 0.9."""
    return min(0.05, (1.0 - target) / 2)


# -- the target --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GuaranteeTarget:
    """``metric >= target`` against ``oracle`` (a model name; None: the last stage), with
    probability at least ``1 - delta``."""

    metric: str
    target: float
    delta: float = DEFAULT_DELTA
    oracle: str | None = None

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise GuaranteeError(f"unknown target metric {self.metric!r}; use one of: "
                                 f"{', '.join(METRICS)}")
        target, delta = float(self.target), float(self.delta)
        if not 0.0 < target <= 1.0:
            raise GuaranteeError(f"a {self.metric} target must be in (0, 1], got {self.target}"
                                 " (e.g. 0.9 for 90%)")
        if not 0.0 < delta < 1.0:
            raise GuaranteeError(f"delta (the allowed probability of missing the target) must "
                                 f"be in (0, 1), got {self.delta} (e.g. 0.05)")
        if self.oracle is not None and not (isinstance(self.oracle, str) and self.oracle):
            raise GuaranteeError(f"the oracle must be a model name or None, got {self.oracle!r}")
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "delta", delta)

    def describe(self) -> str:
        """``recall >= 0.90 against smollm2-135m (delta 0.05)``."""
        against = self.oracle or "the last stage"
        return f"{self.metric} >= {self.target:.2f} against {against} (delta {self.delta:g})"


def check_metric(metric: str, output_type: str) -> None:
    """Precision and recall are of the positive value of a boolean operator; accuracy is for
    any operator whose stages answer with labels."""
    if metric not in METRICS:
        raise GuaranteeError(f"unknown target metric {metric!r}; use one of: "
                             f"{', '.join(METRICS)}")
    if metric != "accuracy" and output_type != "boolean":
        raise GuaranteeError(f"a {metric} target needs a boolean operator (precision and "
                             f"recall are of the value true); this one returns {output_type}: "
                             "set an accuracy target instead")


# -- what the stages answer --------------------------------------------------------------------


def as_label(value: Any) -> Any:
    """A stage's value as a label: booleans as ``"true"`` / ``"false"``, the rest as is."""
    if isinstance(value, bool | np.bool_):
        return BOOLEAN_LABELS[int(bool(value))]
    return value


@dataclass(frozen=True, eq=False)
class StageOutcomes:
    """What a cascade's stages (cheapest first) answer on some rows: each row's value and
    certainty per stage (``certainties``: stages x rows, as ``certainty_of`` computes them
    with the cascade's ``certainty`` kind). ``ms_per_row``: each stage's cost per row
    (optional; only reported)."""

    models: tuple[str, ...]
    values: tuple[tuple[Any, ...], ...] = field(repr=False)
    certainties: np.ndarray = field(repr=False)
    certainty: str = "max_prob"
    ms_per_row: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        models = tuple(self.models)
        values = tuple(tuple(as_label(v) for v in stage) for stage in self.values)
        cert = np.asarray(self.certainties, dtype=np.float64)
        if not models:
            raise GuaranteeError("a guarantee needs at least one stage")
        if len(set(models)) != len(models):
            raise GuaranteeError(f"stages must be distinct models: {models}")
        n = len(values[0]) if values else 0
        if len(values) != len(models) or any(len(v) != n for v in values):
            raise GuaranteeError(f"values of {len(values)} stages for {len(models)} models, or "
                                 "stages with different numbers of rows")
        if cert.shape != (len(models), n):
            raise GuaranteeError(f"certainties must be stages x rows = {(len(models), n)}, "
                                 f"got {cert.shape}")
        if np.isnan(cert).any():
            raise GuaranteeError("a certainty is NaN; the stages' scores are damaged")
        if self.certainty not in CERTAINTY_FUNCTIONS:
            raise GuaranteeError(f"unknown certainty {self.certainty!r}; use one of: "
                                 f"{', '.join(sorted(CERTAINTY_FUNCTIONS))}")
        if self.ms_per_row and len(self.ms_per_row) != len(models):
            raise GuaranteeError(f"{len(self.ms_per_row)} per-row costs for "
                                 f"{len(models)} stages")
        object.__setattr__(self, "models", models)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "certainties", cert)
        object.__setattr__(self, "ms_per_row", tuple(float(c) for c in self.ms_per_row))

    @property
    def num_rows(self) -> int:
        return len(self.values[0])

    def take(self, rows: Sequence[int] | np.ndarray) -> StageOutcomes:
        """The outcomes of ``rows`` (indices, in that order)."""
        index = np.asarray(rows, dtype=np.int64)
        return StageOutcomes(self.models,
                             tuple(tuple(stage[i] for i in index) for stage in self.values),
                             self.certainties[:, index], self.certainty, self.ms_per_row)

    def oracle_stage(self, oracle: str | None) -> int:
        """The index of ``oracle`` among the stages (None: the last)."""
        if oracle is None:
            return len(self.models) - 1
        if oracle not in self.models:
            raise GuaranteeError(f"the oracle {oracle!r} is not a stage of this cascade; its "
                                 f"stages are: {', '.join(self.models)}")
        return self.models.index(oracle)


# -- the path ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThresholdPath:
    """Threshold settings of the stages before the oracle, from the safest (most rows sent on)
    to the cheapest: ``thresholds[j][i]`` is stage ``i``'s threshold at step ``j``. Every
    stage's threshold is non-increasing along the path. ``levels``: the share of rows each
    step was built to let every stage answer (informative)."""

    thresholds: tuple[tuple[float, ...], ...]
    levels: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        steps = tuple(tuple(float(t) for t in step) for step in self.thresholds)
        object.__setattr__(self, "thresholds", steps)
        object.__setattr__(self, "levels", tuple(float(v) for v in self.levels))
        if not steps:
            raise GuaranteeError("a threshold path needs at least one step")
        width = len(steps[0])
        if any(len(step) != width for step in steps):
            raise GuaranteeError("every step of a threshold path needs one threshold per stage "
                                 "before the oracle")
        grid = np.array(steps, dtype=np.float64).reshape(len(steps), width)
        if np.isnan(grid).any():
            raise GuaranteeError("a threshold path holds NaN")
        if (np.diff(grid, axis=0) > 0).any():
            raise GuaranteeError("a threshold path must go from the safest setting to the "
                                 "cheapest: no stage's threshold may rise along it")
        if self.levels and len(self.levels) != len(steps):
            raise GuaranteeError("one level per step of the path")

    @property
    def num_steps(self) -> int:
        return len(self.thresholds)

    @property
    def width(self) -> int:
        """Thresholds per step: the stages before the oracle."""
        return len(self.thresholds[0])

    def array(self) -> np.ndarray:
        return np.array(self.thresholds, dtype=np.float64).reshape(self.num_steps, self.width)


def quantile_path(certainties: Sequence[np.ndarray] | np.ndarray,
                  steps: int = DEFAULT_STEPS) -> ThresholdPath:
    """The default path for the stages whose certainties on unlabelled rows are given (one
    array per stage before the oracle, cheapest first): at step ``j`` (1..``steps``) each
    stage's threshold is the certainty of its ``ceil(j/steps * rows)``-th most certain row, so
    it answers (at least) the top ``j/steps`` share of them; the last step answers every row at
    the first stage. Steps that repeat the previous setting are dropped. The rows must not be
    the labelled sample's (use the operator's profile rows or the whole pool): the path has to
    be fixed before the oracle's answers are looked at."""
    if steps < 1:
        raise GuaranteeError(f"a path needs at least one step, got {steps}")
    stages = [np.sort(np.asarray(c, dtype=np.float64))[::-1] for c in certainties]
    if not stages:  # the oracle is the first stage: one step, nothing before it
        return ThresholdPath(((),), (1.0,))
    if any(s.size == 0 for s in stages):
        raise GuaranteeError("a threshold path needs the certainties of at least one row per "
                             "stage")
    if any(np.isnan(s).any() for s in stages):
        raise GuaranteeError("a certainty is NaN; the stages' scores are damaged")
    rows: list[tuple[float, ...]] = []
    levels: list[float] = []
    for j in range(1, steps + 1):
        level = j / steps
        step = tuple(-math.inf if j == steps else float(s[math.ceil(level * s.size) - 1])
                     for s in stages)
        if rows and step == rows[-1]:
            continue
        rows.append(step)
        levels.append(level)
    return ThresholdPath(tuple(rows), tuple(levels))


# -- the bound ---------------------------------------------------------------------------------


def clopper_pearson_lower(successes: np.ndarray | int, trials: np.ndarray | int,
                          delta: float) -> np.ndarray:
    """One-sided exact lower confidence bound at level ``delta`` for a binomial proportion:
    the ``p`` with ``P(Binomial(trials, p) >= successes) = delta`` (0 when there is no
    success; 0 too for no trials: nothing is known)."""
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    if (k < 0).any() or (k > n).any():
        raise GuaranteeError("successes must be between 0 and the number of trials")
    out = np.zeros(np.broadcast(k, n).shape)
    k, n = np.broadcast_to(k, out.shape), np.broadcast_to(n, out.shape)
    some = k > 0
    out[some] = stats.beta.ppf(delta, k[some], n[some] - k[some] + 1)
    return out


def _minimum_successes(trials: np.ndarray, target: float, delta: float) -> np.ndarray:
    """Per number of trials, the fewest successes whose lower bound reaches ``target``
    (``trials + 1`` where none does), by bisection on the (increasing) bound."""
    low = np.zeros(trials.shape, dtype=np.int64)  # bound(low) < target (0 gives bound 0)
    high = trials + 1  # a sentinel above every count
    while (high - low > 1).any():
        mid = (low + high) // 2
        passes = np.zeros(mid.shape, dtype=bool)
        valid = mid <= trials
        passes[valid] = clopper_pearson_lower(mid[valid], trials[valid], delta) >= target
        high = np.where(passes, mid, high)
        low = np.where(passes, low, mid)
    return high


def pass_probability(trials: int | np.ndarray, true_metric: float, target: float,
                     delta: float) -> np.ndarray:
    """The probability that a setting whose true metric is ``true_metric`` passes the test
    (lower bound >= ``target``) on ``trials`` i.i.d. rows."""
    n = np.atleast_1d(np.asarray(trials, dtype=np.int64))
    need = _minimum_successes(n, target, delta)
    return stats.binom.sf(need - 1, n, true_metric)


def sample_size(metric: str, target: float, delta: float = DEFAULT_DELTA,
                margin: float | None = None, power: float = DEFAULT_POWER,
                positive_share: float = 1.0, max_rows: int | None = None) -> int:
    """Oracle-labelled rows a target needs: the smallest ``n`` at which a setting whose true
    metric is ``target + margin`` (``default_margin`` when None) passes its test with
    probability ``power``. For precision and recall the proportion is over the positive rows
    (the cascade's or the oracle's), so ``n`` is the positives needed over
    ``positive_share``, the share of rows that are positive (e.g. the oracle's share on the
    profile). 0 for a target of 1: only the oracle meets it, so no sample is needed. At most
    ``max_rows`` (the rows there are), when given."""
    GuaranteeTarget(metric, target, delta)  # validates
    if not 0.0 < power < 1.0:
        raise GuaranteeError(f"power must be in (0, 1), got {power}")
    if not 0.0 < positive_share <= 1.0:
        raise GuaranteeError(f"the positive share must be in (0, 1], got {positive_share}")
    if target >= 1.0:
        return 0
    margin = default_margin(target) if margin is None else float(margin)
    if not 0.0 < margin <= 1.0 - target:
        raise GuaranteeError(f"the margin must be in (0, {1.0 - target:g}] for a target of "
                             f"{target:g}, got {margin}")
    true_metric = target + margin
    start, chunk, limit = 1, 256, 10_000_000
    while start <= limit:
        n = np.arange(start, start + chunk, dtype=np.int64)
        hits = np.flatnonzero(pass_probability(n, true_metric, target, delta) >= power)
        if hits.size:
            trials = int(n[hits[0]])
            rows = trials if metric == "accuracy" else math.ceil(trials / positive_share)
            return rows if max_rows is None else min(rows, max_rows)
        start += chunk
        chunk *= 2
    raise GuaranteeError(f"no sample of up to {limit:,} rows certifies {metric} >= {target} "
                         f"with margin {margin}")


# -- choosing thresholds -----------------------------------------------------------------------


@dataclass(frozen=True)
class Guarantee:
    """The thresholds a target chose, and what the sample showed of them.

    ``models``: the cascade's stages up to the oracle (stages after it are not run: the metric
    is against the oracle). ``thresholds``: one per stage before the oracle (``inf`` for all
    when ``fell_back``: nothing cheaper than the oracle was certified, so it answers every
    row). ``estimate`` and ``lower_bound``: the metric on the sample at those thresholds and
    its ``1 - delta`` lower bound (both 1 for the oracle alone). ``trials``: the rows that
    proportion is over. ``answered_shares``: the share of sample rows each stage answers.
    ``oracle_calls``: oracle answers the choice cost (one per sample row). ``failed_bound``:
    the bound of the first setting that failed (None when every setting passed).
    """

    metric: str
    target: float
    delta: float
    oracle: str
    oracle_stage: int
    models: tuple[str, ...]
    certainty: str
    sample_size: int
    oracle_calls: int
    thresholds: tuple[float, ...]
    estimate: float
    lower_bound: float
    trials: int
    answered_shares: tuple[float, ...]
    fell_back: bool
    steps_passed: int
    path_steps: int
    failed_bound: float | None = None
    cost_ms_per_row: float | None = None

    @property
    def cascade(self) -> Cascade:
        """The cascade to run: the oracle alone when it fell back."""
        if self.fell_back or not self.thresholds:
            return Cascade((self.oracle,), (), self.certainty)
        return Cascade(self.models, self.thresholds, self.certainty)

    @property
    def oracle_share(self) -> float:
        """Share of rows the oracle answers (on the sample)."""
        return self.answered_shares[-1]

    def describe(self) -> str:
        """One line for EXPLAIN."""
        head = (f"{self.metric} >= {self.target:g} against {self.oracle} "
                f"(delta {self.delta:g}), {self.sample_size} rows sampled, "
                f"{self.oracle_calls} oracle calls")
        if self.fell_back:
            why = (f"the cheapest setting's bound was {self.failed_bound:.3f}"
                   if self.failed_bound is not None else "no setting to test")
            return f"{head}: not met cheaper than the oracle ({why}); the oracle answers every row"
        return (f"{head}: met with {self.cascade.describe()}, bound {self.lower_bound:.3f} "
                f"(sample {self.estimate:.3f} on {self.trials} rows); "
                f"{self.oracle_share:.0%} of rows reach the oracle")

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "target": self.target, "delta": self.delta,
                "oracle": self.oracle, "oracle_stage": self.oracle_stage,
                "models": list(self.models), "certainty": self.certainty,
                "sample_size": self.sample_size, "oracle_calls": self.oracle_calls,
                "thresholds": [t if math.isfinite(t) else str(t) for t in self.thresholds],
                "estimate": self.estimate, "lower_bound": self.lower_bound,
                "trials": self.trials, "answered_shares": list(self.answered_shares),
                "fell_back": self.fell_back, "steps_passed": self.steps_passed,
                "path_steps": self.path_steps, "failed_bound": self.failed_bound,
                "cost_ms_per_row": self.cost_ms_per_row, "cascade": self.cascade.describe()}


def answering_stage(certainties: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Per setting (rows of ``thresholds``: one threshold per stage before the oracle) and
    row (columns of ``certainties``: those stages' certainties), the stage that answers it:
    the first whose certainty does not escalate it (the cascade's one rule), else the oracle
    (index ``thresholds.shape[1]``)."""
    steps, width = thresholds.shape
    n = certainties.shape[1]
    stage = np.full((steps, n), width, dtype=np.int64)
    open_ = np.ones((steps, n), dtype=bool)
    for i in range(width):
        answers = open_ & ~escalates(certainties[i][None, :], thresholds[:, i][:, None])
        stage[answers] = i
        open_ &= ~answers
    return stage


def metric_counts(metric: str, answers: np.ndarray, oracle: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Successes and trials of ``metric`` per setting: ``answers`` (settings x rows) and
    ``oracle`` (rows) as labels. Accuracy: agreements over all rows; precision: oracle
    positives among the rows answered positive; recall: rows answered positive among the
    oracle's positives."""
    if metric == "accuracy":
        agree = answers == oracle[None, :]
        return agree.sum(axis=1), np.full(answers.shape[0], answers.shape[1])
    said = answers == POSITIVE
    truth = (oracle == POSITIVE)[None, :]
    both = (said & truth).sum(axis=1)
    if metric == "precision":
        return both, said.sum(axis=1)
    return both, np.broadcast_to(truth.sum(axis=1), both.shape).copy()


def _labels(outcomes: StageOutcomes, upto: int, metric: str) -> np.ndarray:
    """The values of stages ``0..upto`` as an object array (stages x rows), checked to be
    booleans for precision and recall."""
    values = np.empty((upto + 1, outcomes.num_rows), dtype=object)
    for i in range(upto + 1):
        values[i, :] = outcomes.values[i]
    if metric != "accuracy":
        seen = set(values.ravel().tolist())
        other = sorted(map(str, seen - set(BOOLEAN_LABELS)))
        if other:
            raise GuaranteeError(f"a {metric} target needs a boolean operator (values "
                                 f"{BOOLEAN_LABELS}); the stages answered {other[:5]}: set an "
                                 "accuracy target instead")
    return values


@dataclass(frozen=True)
class _PathTest:
    """Every setting of a path tested on a sample: ``stage`` (settings x rows) answers each
    row, ``successes`` / ``trials`` / ``bounds`` per setting, ``first_failure`` the index of
    the first setting whose bound is below the target (the number of settings when none)."""

    oracle: int
    grid: np.ndarray
    stage: np.ndarray
    successes: np.ndarray
    trials: np.ndarray
    bounds: np.ndarray
    first_failure: int


def _test_path(outcomes: StageOutcomes, target: GuaranteeTarget, path: ThresholdPath,
               oracle: int, values: np.ndarray) -> _PathTest:
    """The fixed-sequence test of ``path`` on the sample ``outcomes`` (``oracle`` > 0)."""
    if path.width != oracle:
        raise GuaranteeError(f"the path sets {path.width} thresholds per step, but "
                             f"{oracle} stage(s) come before the oracle "
                             f"{outcomes.models[oracle]!r}")
    n = outcomes.num_rows
    grid = path.array()
    stage = answering_stage(outcomes.certainties[:oracle], grid)
    answers = values[stage, np.arange(n)[None, :]]
    successes, trials = metric_counts(target.metric, answers, values[oracle])
    bounds = clopper_pearson_lower(successes, trials, target.delta)
    passed = bounds >= target.target
    first_failure = int(np.argmin(passed)) if not passed.all() else len(passed)
    return _PathTest(oracle, grid, stage, successes, trials, bounds, first_failure)


def _checked_sample(outcomes: StageOutcomes, target: GuaranteeTarget
                    ) -> tuple[int, np.ndarray]:
    """The oracle's stage index and the stages' values up to it (refusing an empty sample)."""
    if outcomes.num_rows == 0:
        raise GuaranteeError("the sample is empty: a guarantee needs oracle-labelled rows "
                             "(sample_size() says how many)")
    oracle = outcomes.oracle_stage(target.oracle)
    return oracle, _labels(outcomes, oracle, target.metric)


def certified_settings(outcomes: StageOutcomes, target: GuaranteeTarget, path: ThresholdPath
                       ) -> list[tuple[tuple[float, ...], float]]:
    """Every setting of ``path`` the fixed-sequence test certifies on ``outcomes``, safest
    first, each with its lower bound: the settings before the first that fails. Fixed-sequence
    testing controls the chance that *any* of them misses the target at ``delta`` (a miss
    needs the first setting whose true metric is below the target to pass), so all of them
    hold together, and a planner may use any of them. Empty when the oracle is the first stage
    or the first setting fails."""
    oracle, values = _checked_sample(outcomes, target)
    if oracle == 0:
        return []
    test = _test_path(outcomes, target, path, oracle, values)
    return [(tuple(float(t) for t in test.grid[j]), float(test.bounds[j]))
            for j in range(test.first_failure)]


def choose_thresholds(outcomes: StageOutcomes, target: GuaranteeTarget,
                      path: ThresholdPath) -> Guarantee:
    """The cheapest setting of ``path`` certified to meet ``target`` on the sample
    ``outcomes`` (rows drawn uniformly from the population the cascade will answer, every
    stage up to the oracle run on each), by fixed-sequence testing of the exact lower bounds;
    the oracle alone (``fell_back``) when the first setting already fails. See the module
    docstring for why this holds with probability ``1 - delta``."""
    oracle, values = _checked_sample(outcomes, target)
    n = outcomes.num_rows
    models = outcomes.models[: oracle + 1]
    costs = outcomes.ms_per_row[: oracle + 1] if outcomes.ms_per_row else ()
    common = dict(metric=target.metric, target=target.target, delta=target.delta,
                  oracle=outcomes.models[oracle], oracle_stage=oracle, models=models,
                  certainty=outcomes.certainty, sample_size=n, oracle_calls=n,
                  path_steps=path.num_steps)

    def oracle_alone(failed: float | None, passed: int) -> Guarantee:
        shares = (0.0,) * oracle + (1.0,)
        return Guarantee(**common, thresholds=(math.inf,) * oracle, estimate=1.0,
                         lower_bound=1.0, trials=n, answered_shares=shares,
                         fell_back=oracle > 0, steps_passed=passed, failed_bound=failed,
                         cost_ms_per_row=_cost(shares, costs))

    if oracle == 0:
        return oracle_alone(None, 0)
    test = _test_path(outcomes, target, path, oracle, values)
    first_failure = test.first_failure
    failed = (float(test.bounds[first_failure]) if first_failure < len(test.bounds)
              else None)
    if first_failure == 0:
        return oracle_alone(failed, 0)
    j = first_failure - 1
    shares = tuple(float(np.mean(test.stage[j] == i)) for i in range(oracle + 1))
    return Guarantee(**common, thresholds=tuple(float(t) for t in test.grid[j]),
                     estimate=float(test.successes[j] / test.trials[j]),
                     lower_bound=float(test.bounds[j]), trials=int(test.trials[j]),
                     answered_shares=shares, fell_back=False, steps_passed=first_failure,
                     failed_bound=failed, cost_ms_per_row=_cost(shares, costs))


def _cost(answered: Sequence[float], ms_per_row: Sequence[float]) -> float | None:
    """Expected model time per row: each stage's cost times the share of rows reaching it."""
    if not ms_per_row:
        return None
    reach = np.cumsum(np.asarray(answered, dtype=np.float64)[::-1])[::-1]
    return float(np.dot(reach, np.asarray(ms_per_row, dtype=np.float64)))
