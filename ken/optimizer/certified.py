"""Gear plans that keep a target in every gear (issue 36): the planner's candidate cascades,
each certified against an accuracy, precision or recall target on the operator's profile
sample.

A query with a target chooses its cascade's thresholds on a sample of its own inputs
(``ken.sql.guarantee``). A served function cannot do that per query: its gear plan was made
offline, and which gear answers a request depends on the load. So the target is kept where
the plan is made. When a function is planned under a target (``Session.set_target`` or ``SET
ken_<metric>_target`` before ``Session.plan``), its candidate cascades are replaced by these:

1. The profile sample (the rows every model of the function answered, which the planner's
   accuracies come from) is split once, by a fixed seed, into path rows and test rows.
2. Every model sequence the planner may serve, cheapest first, that ends at the oracle (the
   target's, or the function's costliest model) and has at most ``max_stages`` stages, gets a
   threshold path from the certainties of its stages before the oracle on the path rows
   (``quantile_path``: no oracle answer involved), and is tested on the test rows by
   fixed-sequence testing of exact Clopper-Pearson bounds (``certified_settings``) at
   ``delta / K`` for the ``K`` sequences with a stage before the oracle (Bonferroni). Every
   setting a test passes is a candidate (fixed-sequence testing certifies all of them
   together); a setting whose first stage answers every row is that model alone.
3. The oracle alone is always a candidate (it meets any target against itself).

With probability at least ``1 - delta`` over the profile sample, every candidate meets the
target on inputs distributed as that sample is, so every gear of every plan built from them
does, and so does any mix of gears the engine serves: accuracy is an average over requests,
precision and recall averages weighted by each gear's positives, and each term is at least
the target. The planner must then serve nothing else: ``PlannerSettings.only_candidates``
keeps single models off the frontier unless they are certified, and re-planning online
(``GearReplan``) draws from the same candidates. The candidates are thinned to the
(accuracy on the labels, cost) Pareto set, which keeps the guarantee (any subset does).

What it does not cover: inputs unlike the profile sample (the statement is about that
sample's distribution; a query's own target samples its own inputs instead).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ken.errors import GuaranteeError
from ken.models.cascade import Cascade
from ken.optimizer.cascades import evaluate
from ken.optimizer.guarantee import (
    DEFAULT_STEPS,
    GuaranteeTarget,
    StageOutcomes,
    as_label,
    certified_settings,
    quantile_path,
)
from ken.optimizer.pareto import pareto_front
from ken.optimizer.profile import Profile

#: the seed of the split into path and test rows, so a plan repeats exactly
SEED = 0


@dataclass(frozen=True)
class CertifiedCandidates:
    """The candidate cascades a function is planned from under ``target`` (its oracle named),
    each certified on ``test_rows`` profile rows (``path_rows`` more set the paths) with
    ``sequences`` model sequences sharing ``target.delta``. ``bounds``: each cascade's lower
    bound (1.0 for the oracle alone). ``asked_oracle``: the oracle the user named (None: the
    default, the costliest model)."""

    target: GuaranteeTarget
    cascades: tuple[Cascade, ...]
    bounds: tuple[float, ...]
    test_rows: int
    path_rows: int
    sequences: int
    asked_oracle: str | None = None

    @property
    def oracle(self) -> str:
        assert self.target.oracle is not None
        return self.target.oracle

    @property
    def oracle_only(self) -> bool:
        """Nothing cheaper than the oracle was certified: it is the only candidate."""
        return all(c.models == (self.oracle,) for c in self.cascades)

    def covers(self, target: GuaranteeTarget) -> bool:
        """Whether plans from these candidates keep ``target``: the same metric and oracle, a
        target at most this one's, a delta at least this one's."""
        oracle_ok = target.oracle in (None, self.oracle) if self.asked_oracle is None \
            else target.oracle == self.asked_oracle
        return (target.metric == self.target.metric and oracle_ok
                and target.target <= self.target.target + 1e-12
                and target.delta >= self.target.delta - 1e-12)

    def describe(self) -> str:
        """One line for EXPLAIN and the serving log."""
        head = (f"every gear certified: {self.target.metric} >= {self.target.target:g} against "
                f"{self.oracle} (delta {self.target.delta:g}) on {self.test_rows:,} profile rows "
                f"({self.path_rows:,} more set the thresholds' paths), {self.sequences} model "
                f"sequence(s) tested at delta/{max(self.sequences, 1)}")
        if self.oracle_only:
            return f"{head}: nothing cheaper than the oracle met it; the oracle answers every row"
        shown = ", ".join(c.describe() for c in self.cascades[:3])
        more = f" and {len(self.cascades) - 3} more" if len(self.cascades) > 3 else ""
        return f"{head}: {len(self.cascades)} candidate cascade(s): {shown}{more}"


def profile_values(profile: Profile) -> tuple:
    """Each sample row's answer: the recorded values, else a classifier's top label."""
    if profile.values:
        return tuple(as_label(v) for v in profile.values)
    if not profile.label_names or profile.scores.ndim != 2:
        raise GuaranteeError(f"the profile of {profile.model} records no answers per row; "
                             "re-profile it to plan under a target")
    labels = np.asarray(profile.label_names, dtype=object)
    return tuple(as_label(v) for v in labels[np.argmax(profile.scores, axis=1)])


def _cost(profile: Profile) -> float:
    return profile.ms_per_row(profile.best_batch_size())


def certify_candidates(profiles: Mapping[str, Profile], target: GuaranteeTarget,
                       max_stages: int = 3, certainty: str = "max_prob",
                       steps: int = DEFAULT_STEPS, seed: int = SEED) -> CertifiedCandidates:
    """The certified candidates of the module docstring, from one function's ``profiles``
    (one per model, on one sample)."""
    if not profiles:
        raise GuaranteeError("no profiles to certify cascades on")
    if max_stages < 1:
        raise GuaranteeError(f"max_stages must be at least 1, got {max_stages}")
    by_cost = sorted(profiles, key=lambda m: (_cost(profiles[m]), m))
    oracle = target.oracle or by_cost[-1]
    if oracle not in profiles:
        raise GuaranteeError(f"the oracle {oracle!r} is not a model of this function; its "
                             f"models are: {', '.join(by_cost)}")
    n = profiles[oracle].num_rows
    if any(p.num_rows != n for p in profiles.values()):
        raise GuaranteeError("the models' profiles hold different numbers of rows; re-profile "
                             "them on one sample")
    if n < 2:
        raise GuaranteeError(f"a profile sample of {n} row(s) cannot certify anything")
    order = np.random.default_rng(seed).permutation(n)
    path_idx, test_idx = order[: n // 2], order[n // 2:]
    values = {m: profile_values(profiles[m]) for m in by_cost}
    certs = {m: profiles[m].certainty(certainty) for m in by_cost}
    cheaper = by_cost[: by_cost.index(oracle)]
    sequences = [(*combo, oracle) for r in range(1, max_stages)
                 for combo in itertools.combinations(cheaper, r)]
    resolved = GuaranteeTarget(target.metric, target.target, target.delta, oracle)
    each = GuaranteeTarget(target.metric, target.target,
                           target.delta / max(len(sequences), 1), oracle)
    found: dict[Cascade, float] = {Cascade((oracle,), (), certainty): 1.0}
    for seq in sequences:
        path = quantile_path([certs[m][path_idx] for m in seq[:-1]], steps)
        outcomes = StageOutcomes(seq, tuple(tuple(values[m][i] for i in test_idx) for m in seq),
                                 np.array([certs[m][test_idx] for m in seq]), certainty)
        for thresholds, bound in certified_settings(outcomes, each, path):
            cascade = _truncated(seq, thresholds, certainty)
            found[cascade] = max(bound, found.get(cascade, 0.0))
    cascades = list(found)
    metrics = [evaluate(c, profiles) for c in cascades]
    front = pareto_front([(m.accuracy, m.cost_ms_per_row) for m in metrics])
    kept = [cascades[i] for i in front]
    return CertifiedCandidates(resolved, tuple(kept), tuple(found[c] for c in kept),
                               len(test_idx), len(path_idx), len(sequences), target.oracle)


def _truncated(models: tuple[str, ...], thresholds: tuple[float, ...], certainty: str
               ) -> Cascade:
    """The cascade a setting runs: a stage whose threshold is ``-inf`` answers every row that
    reaches it, so the stages after it are dropped."""
    for i, t in enumerate(thresholds):
        if t == -np.inf:
            return Cascade(models[: i + 1], thresholds[:i], certainty)
    return Cascade(models, thresholds, certainty)
