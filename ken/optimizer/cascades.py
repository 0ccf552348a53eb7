"""Cascade scoring and search from profiles alone (DESIGN.md section 5.2).

A cascade is scored on the labelled sample by replaying each stage's recorded predictions and
certainties: no model runs here. ``evaluate`` scores one cascade row by row; ``pareto_cascades``
enumerates cheap-to-expensive model sequences and threshold grids, scores all threshold
combinations of a sequence at once with array broadcasting, and keeps the accuracy-vs-cost
Pareto set that the workload adapter walks from the most accurate to the cheapest cascade.

Both paths compute accuracy and cost with the same arithmetic in the same order, so a cascade
that ``pareto_cascades`` returns has exactly the metrics ``evaluate`` gives it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ken.errors import CascadeError, ProfileError
from ken.models.cascade import Cascade, escalates
from ken.models.certainty import CERTAINTY_FUNCTIONS
from ken.optimizer.pareto import pareto_front
from ken.optimizer.profile import Profile


@dataclass(frozen=True)
class CascadeMetrics:
    """How a cascade does on the labelled sample its profiles were measured on."""

    cascade: Cascade
    accuracy: float
    stage_fractions: tuple[float, ...]  # fraction of all rows reaching each stage; first is 1.0
    resolved_fractions: tuple[float, ...]  # fraction of all rows resolved at each stage; sums to 1
    cost_ms_per_row: float  # expected compute per input row, milliseconds
    num_rows: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_fractions", tuple(float(f) for f in self.stage_fractions))
        object.__setattr__(
            self, "resolved_fractions", tuple(float(f) for f in self.resolved_fractions)
        )
        k = self.cascade.num_stages
        if len(self.stage_fractions) != k or len(self.resolved_fractions) != k:
            raise CascadeError(
                f"metrics of a {k}-stage cascade need {k} stage and resolved fractions, got "
                f"{len(self.stage_fractions)} and {len(self.resolved_fractions)}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict; the cascade is nested in its own versioned JSON form."""
        return {
            "cascade": json.loads(self.cascade.to_json()),
            "description": self.cascade.describe(),
            "accuracy": self.accuracy,
            "stage_fractions": list(self.stage_fractions),
            "resolved_fractions": list(self.resolved_fractions),
            "cost_ms_per_row": self.cost_ms_per_row,
            "num_rows": self.num_rows,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CascadeMetrics:
        """Inverse of ``to_dict`` (``description`` is derived, so it is ignored)."""
        return cls(
            cascade=Cascade.from_json(json.dumps(data["cascade"])),
            accuracy=float(data["accuracy"]),
            stage_fractions=tuple(data["stage_fractions"]),
            resolved_fractions=tuple(data["resolved_fractions"]),
            cost_ms_per_row=float(data["cost_ms_per_row"]),
            num_rows=int(data["num_rows"]),
        )


# -- validation --------------------------------------------------------------------------------


def _profiles_for(profiles: Mapping[str, Profile], models: Iterable[str]) -> list[Profile]:
    """The profiles of ``models`` in order, checked to describe one and the same sample."""
    models = list(models)
    missing = [m for m in models if m not in profiles]
    if missing:
        available = ", ".join(sorted(profiles)) or "none"
        raise CascadeError(
            f"no profile for model {missing[0]!r}; profiles are available for: {available}. "
            f"Profile the model first (`ken profile`) or drop it from the cascade"
        )
    chosen = [profiles[m] for m in models]
    first_name, first = models[0], chosen[0]
    if first.num_rows == 0:
        raise ProfileError(f"profile of {first_name!r} has no sample rows; cannot score cascades")
    for name, profile in zip(models[1:], chosen[1:], strict=True):
        what = None
        if profile.sample_hash != first.sample_hash:
            what = f"sample hash {profile.sample_hash!r} vs {first.sample_hash!r}"
        elif profile.num_rows != first.num_rows:
            what = f"{profile.num_rows} rows vs {first.num_rows}"
        elif profile.metric != first.metric:
            what = f"quality metric {profile.metric!r} vs {first.metric!r}"
        elif (profile.label_names and first.label_names
              and tuple(profile.label_names) != tuple(first.label_names)):
            what = f"labels {profile.label_names} vs {first.label_names}"
        if what:
            raise ProfileError(
                f"profiles of {name!r} and {first_name!r} were measured on different samples "
                f"({what}); re-profile both models on the same sample"
            )
    return chosen


def _ms_per_row(profile: Profile, batch_size: int | None) -> float:
    """Per-row compute of a model at ``batch_size``, or at its own throughput-optimal size."""
    size = profile.best_batch_size() if batch_size is None else batch_size
    if size < 1:
        raise CascadeError(f"batch size must be at least 1, got {size}")
    return profile.ms_per_row(size)


# -- one cascade -------------------------------------------------------------------------------


def run_on_profiles(
    cascade: Cascade, profiles: Mapping[str, Profile]
) -> tuple[np.ndarray, np.ndarray]:
    """Quality of the cascade's answer per sample row and the 0-based stage that resolved it."""
    stages = _profiles_for(profiles, cascade.models)
    n = stages[0].num_rows
    quality = np.empty(n, dtype=np.float64)
    resolved_at = np.full(n, cascade.num_stages - 1, dtype=np.int64)
    active = np.ones(n, dtype=bool)
    for i, profile in enumerate(stages[:-1]):
        passed_on = cascade.escalates(i, profile.certainty(cascade.certainty))
        done = active & ~passed_on
        quality[done] = profile.quality[done]
        resolved_at[done] = i
        active &= passed_on
    quality[active] = stages[-1].quality[active]
    return quality, resolved_at


def evaluate(
    cascade: Cascade, profiles: Mapping[str, Profile], batch_size: int | None = None
) -> CascadeMetrics:
    """Accuracy, per-stage traffic and expected cost per row of ``cascade`` on the sample.

    Cost uses every model at ``batch_size``, or at its own ``best_batch_size()`` when None.
    """
    stages = _profiles_for(profiles, cascade.models)
    quality, resolved_at = run_on_profiles(cascade, profiles)
    n = stages[0].num_rows
    k = cascade.num_stages
    resolved_counts = np.bincount(resolved_at, minlength=k)
    # rows reaching stage j = rows resolved at j or later
    reach_counts = np.cumsum(resolved_counts[::-1])[::-1]
    cost = 0.0
    # keep this accumulation identical to _score_sequence so both give bit-identical costs
    for count, profile in zip(reach_counts, stages, strict=True):
        cost = cost + (float(count) / n) * _ms_per_row(profile, batch_size)
    # per-row qualities of 1/0 (accuracy) sum exactly in float64, as in _score_sequence
    total = float(quality.sum())
    return CascadeMetrics(
        cascade=cascade,
        accuracy=total / n,
        stage_fractions=tuple(float(c) / n for c in reach_counts),
        resolved_fractions=tuple(float(c) / n for c in resolved_counts),
        cost_ms_per_row=cost,
        num_rows=n,
    )


# -- search ------------------------------------------------------------------------------------


def threshold_grid(certainties: np.ndarray, grid_size: int) -> np.ndarray:
    """Up to ``grid_size`` distinct thresholds at quantiles of ``certainties``, ascending.

    Quantile levels are ``j / (grid_size + 1)`` for ``j = 1..grid_size`` (sample values, numpy's
    ``higher`` method). Each quantile value ``v`` becomes the midpoint between ``v`` and the next
    smaller certainty on the sample: that escalates exactly the rows with certainty ``< v``
    but does not sit on a sample value, so float noise in a recomputed certainty cannot flip a
    row. Thresholds escalating no row are dropped (that cascade equals a shorter one), and
    duplicates from tied certainties are merged. Every returned threshold escalates at least
    one row and resolves at least one.
    """
    cert = np.asarray(certainties, dtype=np.float64)
    if grid_size < 1 or cert.size == 0:
        return np.empty(0)
    levels = np.arange(1, grid_size + 1) / (grid_size + 1)
    values = np.quantile(cert, levels, method="higher")
    distinct = np.unique(cert)
    pos = np.searchsorted(distinct, values)  # values are sample values: exact positions
    pos = np.unique(pos[pos > 0])
    upper, lower = distinct[pos], distinct[pos - 1]
    mid = lower + (upper - lower) / 2
    # adjacent floats can round the midpoint onto ``lower``, which would change the partition
    return np.where(mid > lower, mid, upper)


def _score_sequence(
    quality: Sequence[np.ndarray], escalate: Sequence[np.ndarray], ms: Sequence[float], n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Summed per-row quality and cost per row of every threshold combination of a sequence.

    ``quality[i]`` is stage i's per-row quality (float64, n); ``escalate[i]`` (bool,
    grid_i x n) says which rows stage i passes on under each of its grid thresholds. Returns
    two arrays of shape ``(grid_0, ..., grid_{k-2})`` (C order = itertools.product order).
    """
    k = len(quality)
    if k == 1:
        return np.array(float(quality[0].sum())), np.array(0.0 + 1.0 * ms[0])
    shape = tuple(e.shape[0] for e in escalate)
    first = escalate[0].astype(np.float64)

    # Quality of a row that reaches stage 1, per threshold combination of stages 1..k-2,
    # built back to front: a stage keeps its own answer unless it escalates the row.
    tail = quality[-1]
    for i in range(k - 2, 0, -1):
        e = escalate[i].reshape((shape[i],) + (1,) * (tail.ndim - 1) + (n,))
        tail = np.where(e, tail, quality[i])
    # Stage 0 is folded in with one matrix product (for 1/0 qualities float64 sums are exact),
    # which saves materialising the full grid_0 x ... x n array.
    own = np.where(escalate[0], 0.0, quality[0]).sum(axis=1)
    later = first @ tail.reshape(-1, n).T.astype(np.float64)
    quality_sums = (own[:, None] + later).reshape(shape)

    # Same accumulation as evaluate(): cost = 0.0 + sum_j (reach_count_j / n) * ms_j.
    cost = np.full(shape, 0.0 + 1.0 * ms[0])
    passed = np.ones(n, dtype=bool)  # rows escalated by stages 1..j-1, per their thresholds
    for j in range(1, k):
        reach = np.rint(first @ passed.reshape(-1, n).T.astype(np.float64))
        reach = reach.reshape(shape[:j] + (1,) * (k - 1 - j))
        cost = cost + (reach / n) * ms[j]
        if j < k - 1:
            passed = passed[..., None, :] & escalate[j].reshape(
                (1,) * (passed.ndim - 1) + (shape[j], n)
            )
    return quality_sums, cost


def pareto_cascades(
    profiles: Mapping[str, Profile],
    max_stages: int = 3,
    grid_size: int = 16,
    certainty: str = "max_prob",
    batch_size: int | None = None,
) -> list[CascadeMetrics]:
    """The accuracy-vs-cost Pareto set of cascades over ``profiles``, cheapest first.

    Candidates are sequences of 1..``max_stages`` distinct models whose cost per row strictly
    increases along the sequence (models of equal cost never share a sequence), with each
    non-final stage's threshold from ``threshold_grid(certainty of that model, grid_size)``.
    Accuracy strictly increases along the result; the first entry is the cheapest single model
    and the last the most accurate candidate. Of candidates with identical accuracy and cost
    the one with fewer stages (then earlier in enumeration order) is kept.
    """
    if not profiles:
        raise CascadeError("no profiles given; profile at least one model first")
    if max_stages < 1:
        raise CascadeError(f"max_stages must be at least 1, got {max_stages}")
    if grid_size < 1:
        raise CascadeError(f"grid_size must be at least 1, got {grid_size}")
    if certainty not in CERTAINTY_FUNCTIONS:
        known = ", ".join(sorted(CERTAINTY_FUNCTIONS))
        raise CascadeError(f"unknown certainty {certainty!r}; use one of: {known}")

    names = sorted(profiles)
    checked = dict(zip(names, _profiles_for(profiles, names), strict=True))
    n = checked[names[0]].num_rows
    ms = {m: _ms_per_row(checked[m], batch_size) for m in names}
    by_cost = sorted(names, key=lambda m: (ms[m], m))
    quality = {m: np.asarray(checked[m].quality, dtype=np.float64) for m in names}
    grids: dict[str, np.ndarray] = {}
    escalate: dict[str, np.ndarray] = {}
    for m in names:
        cert = checked[m].certainty(certainty)
        grids[m] = threshold_grid(cert, grid_size)
        # built with the shared rule so search and engine escalate the same rows
        escalate[m] = np.array([escalates(cert, t) for t in grids[m]], dtype=bool).reshape(-1, n)

    sequences: list[tuple[str, ...]] = []
    quality_sums: list[np.ndarray] = []
    costs: list[np.ndarray] = []
    # shorter sequences first, so exact ties resolve to the simpler cascade
    for k in range(1, min(max_stages, len(names)) + 1):
        for seq in itertools.combinations(by_cost, k):
            if any(ms[a] >= ms[b] for a, b in itertools.pairwise(seq)):
                continue
            if any(grids[m].size == 0 for m in seq[:-1]):
                continue  # constant certainty: this model can only be a last stage
            counts, cost = _score_sequence(
                [quality[m] for m in seq], [escalate[m] for m in seq[:-1]],
                [ms[m] for m in seq], n,
            )
            sequences.append(seq)
            quality_sums.append(counts)
            costs.append(cost)

    sizes = [c.size for c in quality_sums]
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    # fractional qualities (balanced accuracy, token F1) are summed in another order here than
    # in evaluate(); rounding keeps cascades that are equal up to an ulp equal, so the
    # fewest-stages tie rule holds (1/0 qualities sum exactly either way)
    all_acc = np.round(np.concatenate([c.ravel() for c in quality_sums]) / n, 12)
    all_cost = np.concatenate([c.ravel() for c in costs])
    front = pareto_front(np.column_stack((all_acc, all_cost)))

    result = []
    for index in front:
        s = int(np.searchsorted(offsets, index, side="right") - 1)
        seq = sequences[s]
        combo = np.unravel_index(index - offsets[s], quality_sums[s].shape)
        thresholds = tuple(float(grids[m][c]) for m, c in zip(seq[:-1], combo, strict=True))
        result.append(evaluate(Cascade(seq, thresholds, certainty), checked, batch_size))
    return result
