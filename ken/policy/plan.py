"""Gear plans and the frontier (DESIGN.md section 4): the offline phase's output.

A ``GearPlan`` says, for one semantic operator: which cascade to run in each QPS range, where
each model's replicas live (``placement``), and per range how each model's rows are split over
its replicas (``shares``) and how many rows a replica's queue must hold before it runs a batch
(``min_queue``), plus the maximum time a row may wait for that. ``predicted`` holds what the
simulator measured for the plan, and ``batch_runtime_s`` the profiled runtimes the simulator
charged for each replica's batches (the online engine derives batch deadlines and its
admission limit from them). A ``Frontier`` is a list of Pareto-optimal plans sorted by
latency. All are frozen and round-trip through versioned JSON.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from ken import store
from ken.errors import PlanError
from ken.models.cascade import Cascade
from ken.policy.decoding import Mode
from ken.policy.metrics import PlanMetrics

PLAN_SCHEMA_VERSION = 1


def _check_version(data: Any, what: str) -> None:
    if not isinstance(data, Mapping):
        raise PlanError(f"not a {what} JSON object (got {type(data).__name__})")
    if data.get("schema_version") != PLAN_SCHEMA_VERSION:
        raise PlanError(f"unsupported {what} schema version {data.get('schema_version')!r}; "
                        f"this KEN reads version {PLAN_SCHEMA_VERSION} — re-run `ken plan`")


class Plan:
    """A plan of one semantic function, whatever its stages do: cascades chosen by the load.

    Two kinds share this interface, one JSON format (``kind`` names which) and one ``load``:
    ``GearPlan`` (classifier stages, gears by request rate, replicas placed on devices and
    batched by queue triggers) and ``GenPlan`` (generating stages, gears by the requests in
    the system, one decode server with a lane per model). The rest of ken asks a plan for what
    it needs through this interface and the kind's name; only this module tests the type.
    """

    # every kind has ``operator`` (the function's name), ``cascades`` (a cascade per gear) and
    # ``predicted`` (what its simulation found, None when it was not simulated)
    kind: ClassVar[str]
    predicted: PlanMetrics | None

    @property
    def models(self) -> tuple[str, ...]:
        """Every model of the plan, in order of first use."""
        return tuple(dict.fromkeys(m for c in self.cascades for m in c.models))

    def describe(self) -> list[str]:
        """Human-readable lines (EXPLAIN, ``ken plan``): prediction, gears, serving."""
        raise NotImplementedError

    def gear_lines(self) -> list[str]:
        """One line per gear: the load it serves and its cascade."""
        raise NotImplementedError

    def summary(self) -> str:
        """The gears on one line (for messages)."""
        return "; ".join(self.gear_lines())

    def headline(self) -> str:
        """How many gears, keyed by what load, served where (EXPLAIN's first line)."""
        raise NotImplementedError

    def _gears_word(self, n: int) -> str:
        return f"{n} gear{'s' if n != 1 else ''}"

    def latency_target_s(self) -> float | None:
        """The latency the plan promises (its predicted p99), None when it was not
        simulated."""
        return None if self.predicted is None else self.predicted.p99_ms / 1000.0

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _from_dict(cls, data: Mapping[str, Any]) -> Plan:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """A plan of the kind ``data`` holds (``Plan.from_dict``), or of this class's kind
        (``GearPlan.from_dict``: a file of the other kind is an error that says so)."""
        _check_version(data, "plan")
        # files written before plans carried their kind: a gear plan has QPS edges, a
        # generation plan load gears
        kind = data.get("kind") or ("gear" if "qps_edges" in data else
                                    "generation" if "gears" in data else None)
        if kind is None:
            raise PlanError("malformed plan JSON: it names no kind and has neither the QPS "
                            "edges of a gear plan nor the gears of a generation plan")
        found = PLAN_KINDS.get(kind)
        if found is None:
            raise PlanError(f"unknown plan kind {kind!r}; this KEN reads "
                            f"{', '.join(sorted(PLAN_KINDS))}")
        if cls is not Plan and found is not cls:
            raise PlanError(f"this is a {kind} plan, not a {cls.kind} plan; read plans of any "
                            "kind with ken.Plan.load(path)")
        return found._from_dict(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise PlanError(f"a plan file must be JSON: {exc}") from None

    def save(self, path: str | Path) -> Path:
        return _write(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(_read(path, "no plan file at {path}; `ken replay` writes one "
                                   "(ken-replay/plan.json), or pick one from a `ken plan` "
                                   "frontier"))


@dataclass(frozen=True)
class Replica:
    """One copy of ``model`` on ``devices`` (several devices: tensor-parallel)."""

    model: str
    devices: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices or len(set(self.devices)) != len(self.devices):
            raise PlanError(f"replica of {self.model!r} needs distinct devices, "
                            f"got {self.devices}")

    @property
    def degree(self) -> int:
        return len(self.devices)

    def label(self) -> str:
        return f"{self.model}@{'+'.join(self.devices)}"


@dataclass(frozen=True)
class RangeSchedule:
    """Scheduling policy of one QPS range, with one entry per replica of the placement.

    ``shares[r]``: fraction of replica ``r``'s model's rows routed to ``r`` (0 if unused);
    ``min_queue[r]``: rows queued before ``r`` runs a batch; ``feasible``: the invocation
    scheduler found no device busier than 1 s per s at this range's top rate.
    """

    cascade: int
    shares: tuple[float, ...]
    min_queue: tuple[int, ...]
    feasible: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "shares", tuple(float(s) for s in self.shares))
        object.__setattr__(self, "min_queue", tuple(int(q) for q in self.min_queue))
        if len(self.shares) != len(self.min_queue):
            raise PlanError("a range schedule needs one share and one queue length per replica")
        if any(q < 1 for q in self.min_queue) or not all(
                math.isfinite(s) and s >= 0 for s in self.shares):
            raise PlanError("queue lengths must be >= 1 and shares finite and >= 0")


@dataclass(frozen=True)
class GearPlan(Plan):
    """How to serve one classifier operator at every request rate (see the module
    docstring)."""

    kind: ClassVar[str] = "gear"

    operator: str
    qps_edges: tuple[float, ...]
    cascades: tuple[Cascade, ...]
    placement: tuple[Replica, ...]
    ranges: tuple[RangeSchedule, ...]
    max_batch: tuple[int, ...]  # per replica: the largest batch it runs
    max_wait_s: float = 0.05
    alpha: float = 8.0
    rate_window_s: float = 0.1
    predicted: PlanMetrics | None = None
    provenance: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    # per replica: profiled seconds of a batch of 1, 2, ..., max_batch rows (the table the
    # simulator charges, ``ModelPerf.runtime_table``); empty when the plan was made without
    # profiles (by hand, or written before plans carried runtimes)
    batch_runtime_s: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        for name in ("qps_edges", "cascades", "placement", "ranges", "max_batch", "provenance"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "batch_runtime_s",
                           tuple(tuple(float(t) for t in row) for row in self.batch_runtime_s))
        object.__setattr__(self, "qps_edges", tuple(float(e) for e in self.qps_edges))
        where = f"gear plan of {self.operator!r}"
        edges = self.qps_edges
        if len(edges) < 2 or edges[0] != 0 or not all(map(math.isfinite, edges)) \
                or any(b <= a for a, b in itertools.pairwise(edges)):
            raise PlanError(f"{where}: QPS edges must start at 0 and increase, got {edges}")
        if len(self.ranges) != len(edges) - 1:
            raise PlanError(f"{where}: {len(edges) - 1} QPS ranges but {len(self.ranges)} "
                            "range schedules")
        if not self.cascades:
            raise PlanError(f"{where}: no cascades")
        n_rep = len(self.placement)
        if len(self.max_batch) != n_rep or any(b < 1 for b in self.max_batch):
            raise PlanError(f"{where}: need a max batch >= 1 per replica")
        placed = {r.model for r in self.placement}
        for i, rs in enumerate(self.ranges):
            if not 0 <= rs.cascade < len(self.cascades):
                raise PlanError(f"{where}: range {i} names cascade {rs.cascade}, but the plan "
                                f"has {len(self.cascades)}")
            if len(rs.shares) != n_rep:
                raise PlanError(f"{where}: range {i} has {len(rs.shares)} shares for "
                                f"{n_rep} replicas")
            missing = set(self.cascades[rs.cascade].models) - placed
            if missing:
                raise PlanError(f"{where}: range {i} uses {sorted(missing)} with no replica")
        if self.batch_runtime_s and (
                len(self.batch_runtime_s) != n_rep
                or any(len(row) != b for row, b in zip(self.batch_runtime_s, self.max_batch,
                                                       strict=True))
                or not all(math.isfinite(t) and t > 0 for row in self.batch_runtime_s
                           for t in row)):
            raise PlanError(f"{where}: batch runtimes need one row per replica with a positive "
                            "runtime for every batch size up to its max batch")
        kinds = {c.certainty for c in self.cascades}
        if len(kinds) > 1:
            raise PlanError(f"{where}: all cascades of a plan must use one certainty function, "
                            f"got {sorted(kinds)}")
        if not all(math.isfinite(v) and v > 0
                   for v in (self.max_wait_s, self.alpha, self.rate_window_s)):
            raise PlanError(f"{where}: max_wait_s, alpha and rate_window_s must be finite "
                            "and > 0")

    # -- lookups -----------------------------------------------------------------------------

    @property
    def qps_max(self) -> float:
        return self.qps_edges[-1]

    @property
    def certainty(self) -> str:
        return self.cascades[0].certainty

    @property
    def num_ranges(self) -> int:
        return len(self.ranges)

    def cascade_of(self, range_index: int) -> Cascade:
        return self.cascades[self.ranges[range_index].cascade]

    def replicas_of(self, model: str) -> list[int]:
        return [i for i, r in enumerate(self.placement) if r.model == model]

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d for r in self.placement for d in r.devices))

    @property
    def feasible(self) -> bool:
        return all(r.feasible for r in self.ranges)

    def batch_seconds(self, replica: int, rows: int) -> float | None:
        """Profiled seconds of a batch of ``rows`` rows on ``replica`` (beyond its max batch:
        the per-row cost of the largest batch); None when the plan carries no runtimes."""
        if not self.batch_runtime_s:
            return None
        table = self.batch_runtime_s[replica]
        if rows <= len(table):
            return table[max(rows, 1) - 1]
        return table[-1] / len(table) * rows

    def with_predicted(self, metrics: PlanMetrics) -> GearPlan:
        return GearPlan(self.operator, self.qps_edges, self.cascades, self.placement,
                        self.ranges, self.max_batch, self.max_wait_s, self.alpha,
                        self.rate_window_s, metrics, self.provenance, self.batch_runtime_s)

    def gears(self) -> list[tuple[float, float, int]]:
        """Consecutive ranges with the same cascade merged: ``(lo_qps, hi_qps, cascade)``."""
        out: list[tuple[float, float, int]] = []
        for i, rs in enumerate(self.ranges):
            lo, hi = self.qps_edges[i], self.qps_edges[i + 1]
            if out and out[-1][2] == rs.cascade:
                out[-1] = (out[-1][0], hi, rs.cascade)
            else:
                out.append((lo, hi, rs.cascade))
        return out

    def gear_lines(self) -> list[str]:
        return [f"{lo:g}-{hi:g} qps: {self.cascades[c].describe()}" for lo, hi, c in self.gears()]

    def serving_key(self) -> str:
        """What this plan serves, as text: its JSON without what it predicted or where it
        came from (two planning paths can reach one plan and simulate it with different
        seeds)."""
        return replace(self, predicted=None, provenance=()).to_json()

    def serves_like(self, other: GearPlan) -> bool:
        """Whether ``other`` serves exactly as this plan does: the same gears, placement,
        schedules and triggers (``serving_key``)."""
        return self.serving_key() == other.serving_key()

    def headline(self) -> str:
        return (f"{self._gears_word(len(self.gears()))} over 0-{self.qps_max:g} qps on "
                f"{', '.join(self.devices)}")

    def describe(self) -> list[str]:
        """Human-readable lines: gears, placement, batch triggers, prediction."""
        lines = []
        p = self.predicted
        if p is not None:
            lines.append(f"predicted: accuracy {p.accuracy:.1%}, p50 {p.p50_ms:.1f} ms, "
                         f"p95 {p.p95_ms:.1f} ms, p99 {p.p99_ms:.1f} ms "
                         f"({p.num_requests} simulated requests)")
        lines += self.gear_lines()
        lines.append("placement: " + ", ".join(r.label() for r in self.placement))
        edges = self.qps_edges
        triggers = []
        for i, rs in enumerate(self.ranges):
            used = [f"{self.placement[r].label()} q>={q}" for r, q in enumerate(rs.min_queue)
                    if rs.shares[r] > 0 and q > 1]
            if used:
                triggers.append(f"{edges[i]:g}-{edges[i + 1]:g} qps: " + ", ".join(used))
        lines.append(f"batch triggers (max wait {self.max_wait_s * 1000:g} ms): "
                     + ("; ".join(triggers) if triggers else "queue >= 1 everywhere"))
        if not self.feasible:
            bad = [f"{edges[i]:g}-{edges[i + 1]:g}" for i, r in enumerate(self.ranges)
                   if not r.feasible]
            lines.append(f"overloaded at: {', '.join(bad)} qps (no schedule keeps every device "
                         "under 1 s of work per s)")
        return lines

    # -- JSON --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "kind": self.kind,
            "operator": self.operator,
            "qps_edges": list(self.qps_edges),
            "cascades": [json.loads(c.to_json()) for c in self.cascades],
            "placement": [{"model": r.model, "devices": list(r.devices)}
                          for r in self.placement],
            "ranges": [{"cascade": r.cascade, "shares": list(r.shares),
                        "min_queue": list(r.min_queue), "feasible": r.feasible}
                       for r in self.ranges],
            "max_batch": list(self.max_batch),
            "max_wait_s": self.max_wait_s,
            "alpha": self.alpha,
            "rate_window_s": self.rate_window_s,
            "predicted": None if self.predicted is None else self.predicted.to_dict(),
            "provenance": dict(self.provenance),
            "batch_runtime_s": [list(row) for row in self.batch_runtime_s],
        }

    @classmethod
    def _from_dict(cls, data: Mapping[str, Any]) -> GearPlan:
        try:
            return cls(
                operator=str(data["operator"]),
                qps_edges=tuple(data["qps_edges"]),
                cascades=tuple(Cascade.from_json(json.dumps(c)) for c in data["cascades"]),
                placement=tuple(Replica(r["model"], tuple(r["devices"]))
                                for r in data["placement"]),
                ranges=tuple(RangeSchedule(int(r["cascade"]), tuple(r["shares"]),
                                           tuple(r["min_queue"]), bool(r["feasible"]))
                             for r in data["ranges"]),
                max_batch=tuple(int(b) for b in data["max_batch"]),
                max_wait_s=float(data["max_wait_s"]),
                alpha=float(data["alpha"]),
                rate_window_s=float(data["rate_window_s"]),
                predicted=None if data.get("predicted") is None
                else PlanMetrics.from_dict(data["predicted"]),
                provenance=tuple(sorted((str(k), str(v))
                                        for k, v in data.get("provenance", {}).items())),
                batch_runtime_s=tuple(tuple(row) for row in data.get("batch_runtime_s", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed gear plan JSON: {exc!r}") from exc


@dataclass(frozen=True)
class GenGear:
    """A cascade and the load (requests in the system) below which it serves new requests."""

    cascade: Cascade
    max_load: float = math.inf


@dataclass(frozen=True)
class GenPlan(Plan):
    """How to serve one generating operator at every load: gears, most accurate first, each
    a cascade of causal LMs with the load (requests running + queued, at any stage) below
    which it serves new requests (``ken.policy.generating`` dispatches them)."""

    kind: ClassVar[str] = "generation"
    operator: str
    gears: tuple[GenGear, ...]
    max_running: int = 8  # rows per decode pass of a lane
    kv_budget_tokens: int | None = None  # per lane; None: bounded by max_running only
    hysteresis: float = 0.5
    mode: Mode = "continuous"
    predicted: PlanMetrics | None = None  # what the planner's simulation found

    def __post_init__(self) -> None:
        object.__setattr__(self, "gears", tuple(self.gears))
        if not self.gears:
            raise PlanError("a generation plan needs at least one gear")
        edges = [g.max_load for g in self.gears]
        if not math.isinf(edges[-1]):
            raise PlanError("the last gear must serve any load (max_load = inf)")
        rising = all(a < b for a, b in zip(edges[:-1], edges[1:], strict=True))
        if any(e <= 0 for e in edges) or not rising:
            raise PlanError(f"gear edges must be positive and increasing, got {edges}")
        if not 0 < self.hysteresis <= 1:
            raise PlanError(f"hysteresis must be in (0, 1], got {self.hysteresis}")
        if self.max_running < 1:
            raise PlanError(f"max_running must be >= 1, got {self.max_running}")
        if self.mode not in ("continuous", "static"):
            raise PlanError(f"unknown batching mode {self.mode!r}; use continuous or static")

    @property
    def cascades(self) -> tuple[Cascade, ...]:
        """The cascade of each gear."""
        return tuple(g.cascade for g in self.gears)

    def headline(self) -> str:
        return (f"{self._gears_word(len(self.gears))} by load (requests running + queued), "
                f"{self.max_running} rows per pass")

    def gear_lines(self) -> list[str]:
        lines, lower = [], 0.0
        for g in self.gears:
            upper = "inf" if math.isinf(g.max_load) else f"{g.max_load:g}"
            lines.append(f"load [{lower:g}, {upper}): {g.cascade.describe()}")
            lower = g.max_load
        return lines

    def describe(self) -> list[str]:
        lines = []
        p = self.predicted
        if p is not None:
            ttft = "" if p.ttft_p95_ms is None else f"TTFT p95 {p.ttft_p95_ms / 1000:.2f} s, "
            lines.append(f"predicted: quality {p.accuracy:.1%}, {ttft}TGT p50 "
                         f"{p.tgt_p50_ms / 1000:.2f} s, p95 {p.tgt_p95_ms / 1000:.2f} s, p99 "
                         f"{p.tgt_p99_ms / 1000:.2f} s ({p.num_requests} simulated requests)")
        lines += self.gear_lines()
        kv = "" if self.kv_budget_tokens is None else f", KV {self.kv_budget_tokens} tokens"
        lines.append(f"decode server: a lane per model, {self.mode} batching of up to "
                     f"{self.max_running} rows{kv}; back to a more accurate gear below "
                     f"{self.hysteresis:g} x its edge")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": PLAN_SCHEMA_VERSION, "kind": self.kind, "operator": self.operator,
            "gears": [{"cascade": json.loads(g.cascade.to_json()),
                       "max_load": None if math.isinf(g.max_load) else g.max_load}
                      for g in self.gears],
            "max_running": self.max_running, "kv_budget_tokens": self.kv_budget_tokens,
            "hysteresis": self.hysteresis, "mode": self.mode,
            "predicted": None if self.predicted is None else self.predicted.to_dict()}

    @classmethod
    def _from_dict(cls, data: Mapping[str, Any]) -> GenPlan:
        try:
            gears = tuple(GenGear(Cascade.from_json(json.dumps(g["cascade"])),
                                  math.inf if g["max_load"] is None else float(g["max_load"]))
                          for g in data["gears"])
            kv = data["kv_budget_tokens"]
            # "function": what files written before the plan kinds shared one format call it
            operator = data["operator"] if "operator" in data else data["function"]
            return cls(str(operator), gears,
                       int(data["max_running"]), None if kv is None else int(kv),
                       float(data["hysteresis"]), data["mode"],
                       None if data.get("predicted") is None
                       else PlanMetrics.from_dict(data["predicted"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed generation plan JSON: {exc!r}") from exc


def single_gear(operator: str, cascade: Cascade, max_running: int = 8,
                kv_budget_tokens: int | None = None, mode: Mode = "continuous") -> GenPlan:
    """A plan that always serves ``cascade`` (a static cascade, or one model)."""
    return GenPlan(operator, (GenGear(cascade),), max_running, kv_budget_tokens, mode=mode)


#: the plan kinds, by the name their JSON carries
PLAN_KINDS: dict[str, type[Plan]] = {GearPlan.kind: GearPlan, GenPlan.kind: GenPlan}


@dataclass(frozen=True)
class Frontier:
    """Pareto-optimal gear plans of one operator, sorted by predicted p95 latency.

    ``alternatives`` are the one-gear plans a user could pick by hand (each candidate cascade
    and each single model served alone at every load) that the Pareto cut dropped because a
    gear plan beat them on the planning trace; kept, sorted the same way, because on another
    window a gear plan may shift down more than it did there, and then the plain cascade is
    the one at least as accurate (``baselines.matched_plan`` draws from ``all_plans``).
    ``pick`` chooses among ``plans`` only."""

    operator: str
    plans: tuple[GearPlan, ...]
    provenance: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    alternatives: tuple[GearPlan, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plans", tuple(self.plans))
        object.__setattr__(self, "alternatives", tuple(self.alternatives))
        if not self.plans:
            raise PlanError(f"frontier of {self.operator!r} is empty")
        for what, plans in (("plans", self.plans), ("alternatives", self.alternatives)):
            if any(p.predicted is None for p in plans):
                raise PlanError(f"every plan on a frontier needs predicted metrics ({what})")
            lat = [p.predicted.p95_ms for p in plans]  # type: ignore[union-attr]
            if lat != sorted(lat):
                raise PlanError(f"frontier {what} must be sorted by predicted p95 latency")

    @property
    def all_plans(self) -> tuple[GearPlan, ...]:
        """The plans and the alternatives, sorted by predicted p95 latency."""
        return tuple(sorted((*self.plans, *self.alternatives),
                            key=lambda p: p.predicted.p95_ms))  # type: ignore[union-attr]

    @property
    def one_gear(self) -> tuple[GearPlan, ...]:
        """The plans and alternatives that serve one cascade at every load (what re-planning
        falls back on at once, ``GearReplan.stopgap``)."""
        return tuple(p for p in self.all_plans if len(set(p.cascades)) == 1)

    def __len__(self) -> int:
        return len(self.plans)

    def points(self) -> list[tuple[float, float]]:
        """``(p95_ms, accuracy)`` per plan."""
        return [(p.predicted.p95_ms, p.predicted.accuracy)  # type: ignore[union-attr]
                for p in self.plans]

    def pick(self, min_accuracy: float | None = None,
             max_p95_ms: float | None = None) -> GearPlan:
        """The fastest plan with ``accuracy >= min_accuracy``, or the most accurate plan with
        ``p95 <= max_p95_ms`` (exactly one target)."""
        if (min_accuracy is None) == (max_p95_ms is None):
            raise PlanError("give exactly one target: min_accuracy or max_p95_ms")
        pts = self.points()
        if min_accuracy is not None:
            ok = [i for i, (_, a) in enumerate(pts) if a >= min_accuracy]
            if not ok:
                best = max(a for _, a in pts)
                raise PlanError(f"no plan reaches accuracy {min_accuracy:.1%}; the most "
                                f"accurate plan on the frontier reaches {best:.1%}")
            return self.plans[min(ok, key=lambda i: pts[i][0])]
        ok = [i for i, (lat, _) in enumerate(pts) if lat <= max_p95_ms]  # type: ignore[operator]
        if not ok:
            fastest = min(lat for lat, _ in pts)
            raise PlanError(f"no plan has p95 <= {max_p95_ms:g} ms; the fastest plan on the "
                            f"frontier has p95 {fastest:.1f} ms")
        return self.plans[max(ok, key=lambda i: (pts[i][1], -pts[i][0]))]

    def to_json(self) -> str:
        return json.dumps({"schema_version": PLAN_SCHEMA_VERSION, "operator": self.operator,
                           "plans": [p.to_dict() for p in self.plans],
                           "alternatives": [p.to_dict() for p in self.alternatives],
                           "provenance": dict(self.provenance)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Frontier:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"not a frontier JSON file: {exc}") from exc
        _check_version(data, "frontier")
        try:
            return cls(str(data["operator"]),
                       tuple(GearPlan.from_dict(p) for p in data["plans"]),
                       tuple(sorted((str(k), str(v))
                                    for k, v in data.get("provenance", {}).items())),
                       tuple(GearPlan.from_dict(p) for p in data.get("alternatives", [])))
        except (KeyError, TypeError, AttributeError) as exc:
            raise PlanError(f"malformed frontier JSON (is it a gear plan file?): {exc!r}") \
                from exc

    def save(self, path: str | Path) -> Path:
        return _write(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Frontier:
        return cls.from_json(_read(path, "no frontier file at {path}; create one with "
                                   "`ken plan`"))


def _write(path: str | Path, text: str) -> Path:
    """Write a plan file atomically: a reader sees the old file or the new one, never half."""
    return store.write_text(path, text)


def _read(path: str | Path, missing: str) -> str:
    """The file's text; ``missing`` (with ``{path}``) is the error when there is none."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(missing.format(path=path))
    return path.read_text()
