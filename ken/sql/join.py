"""How a query runs ``sem_join``'s pairs (issue 35, item 1).

A join condition ``sem_join(l.x, r.y, 'predicate')`` (in ``JOIN ... ON`` or ``WHERE``) is a
boolean function of a pair; DuckDB hands it every pair its join produces, and the call site's
memo answers each distinct pair once. Before the statement runs, this module finds the two
sides (the distinct values of each argument, read from its own table with the WHERE clause's
conjuncts on that table alone) and picks one of three plans:

- **nested loop**: every pair goes to the pair model (``n x m`` questions; exact).
- **blocking**: each left value is paired with its ``block_size`` most similar right values
  by MiniLM-L6 embeddings; other pairs are false without a model call (``n x block_size``
  questions). The recall this loses against the nested loop is estimated on a sample: for a
  few left values, the pairs in their block and a random sample of the pairs outside it are
  asked, and the true pairs outside are scaled up by the share sampled (a Horvitz-Thompson
  estimate).
- **per-side rewrite**: when the predicate compares one property of each side
  (``ken.ops.sem_join.side_rewrite``: "both ...", "neither ...", "the same <property>",
  "different / opposite <property>"), each distinct value of each side is asked once (``n +
  m`` questions) and a pair's value follows from its two sides. It is trusted only when it
  agrees with the pair model on a sample of pairs (half of them pairs it calls true, where
  it has some), asked before the statement runs; those answers stay in the memo.

``plan = "auto"`` (the default, ``session.operators["sem_join"].plan``) runs every pair when
there are at most ``nested_max``; else the rewrite when its check passes; else blocking when
its estimated recall reaches ``recall_target``; else every pair. A value that was not among a
side's values (a row the WHERE clause's other terms let through) is asked when it arrives, so
no plan answers a pair it knows nothing about. EXPLAIN lists each plan with the questions it
would ask; EXPLAIN ANALYZE and ``Result.stats["join"]`` say what ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
from sqlglot import exp

from ken.engine.batch import run_cascade
from ken.errors import SqlError
from ken.models.cascade import Cascade
from ken.models.resources import normalise_rows
from ken.ops.base import OpContext, shared_resources
from ken.ops.sem_join import PLANS, SemJoin, SideRewrite, side_rewrite, side_text
from ken.sql.execute import SiteRunner
from ken.sql.rewrite import CallSite, Rewritten, conjuncts
from ken.sql.shape import site_calls

#: blocking's recall sample: left values, and pairs asked outside each one's block
RECALL_LEFT = 8
RECALL_OUTSIDE = 8
#: the encoder blocking ranks right values by
BLOCK_ENCODER = "minilm-l6"
#: random pairs drawn at most (per check pair) while looking for pairs of each answer
CHECK_DRAWS = 200


@dataclass(frozen=True)
class JoinSides:
    """The two sides of one sem_join call site: per side, the SQL that lists its distinct
    argument values (as the site's function receives them)."""

    site: CallSite
    left: str  # table alias
    right: str
    left_sql: str
    right_sql: str


@dataclass
class JoinRun:
    """What one sem_join site's plan was and did (EXPLAIN ANALYZE, ``Result.stats["join"]``)."""

    site: str
    plan: str
    reason: str
    left_values: int
    right_values: int
    rewrite: str = ""  # the per-side form, when there is one
    side_questions: int = 0  # per-side questions asked (rewrite)
    check_agreed: int = 0
    check_pairs: int = 0
    block_size: int = 0
    recall: float | None = None  # blocking's estimated recall
    recall_pairs: int = 0  # pairs asked to estimate it
    recall_true: int = 0  # true pairs found by the sample
    pair_questions: int = 0  # filled in after the statement ran (the site's model calls)
    shortcut_pairs: int = 0  # pairs answered without the pair model

    @property
    def all_pairs(self) -> int:
        return self.left_values * self.right_values

    def line(self) -> str:
        head = (f"sem_join {self.site}: {self.plan} over {self.left_values:,} x "
                f"{self.right_values:,} values ({self.all_pairs:,} pairs): "
                f"{self.pair_questions:,} pair questions")
        parts = [head]
        if self.side_questions:
            parts.append(f"{self.side_questions:,} per-side questions ({self.rewrite})")
        if self.check_pairs:
            parts.append(f"the rewrite agreed with the pair model on {self.check_agreed} of "
                         f"{self.check_pairs} sampled pairs")
        if self.block_size:
            recall = ("unknown (no true pair in the sample)" if self.recall is None
                      else f"{self.recall:.0%}")
            parts.append(f"blocks of {self.block_size}; estimated recall {recall} from "
                         f"{self.recall_pairs} sampled pairs ({self.recall_true} true)")
        return "; ".join(parts) + f"; {self.reason}"


# ----------------------------------------------------------------------------- the sides


def _site_call(statement: exp.Expression, site: CallSite) -> exp.Anonymous | None:
    return next((a for a in statement.find_all(exp.Anonymous) if str(a.this) == site.udf_name),
                None)


def join_sides(rw: Rewritten, site: CallSite, columns_of: Callable[[str], set[str]]
               ) -> tuple[JoinSides | None, str]:
    """The sides of ``site``'s pairs in ``rw``, or None and why the site is not planned (then
    it runs as written: every pair DuckDB hands it). ``columns_of(source_sql)`` names the
    columns of a FROM item (lower case), to place unqualified columns. SqlError when both
    arguments read the same table."""
    asked: dict[str, set[str]] = {}  # each source's columns, asked of DuckDB once

    def columns(source: str) -> set[str]:
        if source not in asked:
            asked[source] = columns_of(source)
        return asked[source]

    s = rw.statement
    call = _site_call(s, site)
    if not isinstance(s, exp.Select) or call is None:
        return None, "the call is not in a plain SELECT"
    if call.find_ancestor(exp.Select) is not s:
        return None, "the call sits in a subquery"
    if not {"WHERE", "JOIN ON"} & set(site.clauses):
        return None, "outside WHERE and JOIN ON it answers the pairs it is given"
    if s.find(exp.Placeholder):
        return None, "the query has parameters"
    items = [s.args["from_"].this] if s.args.get("from_") is not None else []
    items += [j.this for j in s.args.get("joins") or []]
    sources: dict[str, exp.Expression] = {}
    for item in items:
        if not isinstance(item, exp.Table | exp.Subquery | exp.Values) or not item.alias_or_name:
            return None, ("a FROM item is not a named table, nor a subquery or VALUES list "
                          "with an alias")
        if site_calls(item, rw) or item.find(exp.Placeholder):
            return None, "a FROM item has semantic calls of its own"
        sources[item.alias_or_name.lower()] = item
    sides = []
    for arg in call.expressions:
        owners = {_owner(c, sources, columns) for c in arg.find_all(exp.Column)}
        if not owners:
            return None, f"the argument {arg.sql(dialect='duckdb')} reads no column"
        if None in owners or len(owners) > 1:
            return None, (f"the argument {arg.sql(dialect='duckdb')} does not read exactly one "
                          "table (qualify its columns, e.g. l.review)")
        sides.append(owners.pop())
    left, right = sides
    if left == right:
        raise SqlError(f"{site.call_sql()} is a join predicate over one side only: both "
                       f"arguments read {left}. sem_join compares a row of one table with a "
                       "row of another (or of the same table under two names: FROM t a JOIN "
                       "t b ON sem_join(a.text, b.text, ...)); for two columns of one row, "
                       "use sem_filter or sem_map on them")
    terms = conjuncts(s.args["where"].this) if s.args.get("where") is not None else []
    for join in s.args.get("joins") or []:
        if not join.side and join.args.get("on") is not None:  # inner joins only
            terms += conjuncts(join.args["on"])
    # the terms that read one table alone (and call no model), each with that table
    single = []
    for term in terms:
        owners = {_owner(c, sources, columns) for c in term.find_all(exp.Column)}
        if len(owners) == 1 and not site_calls(term, rw):
            single.append((term, owners.pop()))
    queries = []
    for alias, arg in zip(sides, call.expressions, strict=True):
        own = [t for t, owner in single if owner == alias]
        query = exp.select(exp.alias_(arg.copy(), "v")).distinct().from_(sources[alias].copy())
        if own:
            query = query.where(exp.and_(*[t.copy() for t in own]))
        queries.append(query.sql(dialect="duckdb"))
    return JoinSides(site, left, right, *queries), ""


def _owner(column: exp.Column, sources: dict[str, exp.Expression],
           columns_of: Callable[[str], set[str]]) -> str | None:
    """The FROM item a column belongs to (its alias, lower case), or None if unknown."""
    table = column.table.lower()
    if table:
        return table if table in sources else None
    name = column.name.lower()
    owners = [a for a, item in sources.items() if name in columns_of(item.sql(dialect="duckdb"))]
    if not owners and name in sources:  # a whole row: sem_join(l, r, ...)
        return name
    return owners[0] if len(owners) == 1 else None


# ------------------------------------------------------------------------------ the plans


class RewriteAnswers:
    """Answers every pair from its two sides' values (the per-side rewrite); a value not seen
    before is asked when it arrives."""

    def __init__(self, rewrite: SideRewrite, ask: Callable[[list[str]], dict[str, Any]],
                 left: dict[str, Any], right: dict[str, Any]) -> None:
        self.rewrite = rewrite
        self.ask = ask
        self.left = left
        self.right = right

    def answer(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], Any]:
        for values, side in ((self.left, 0), (self.right, 1)):
            missing = list(dict.fromkeys(k[side] for k in keys if k[side] not in values))
            if missing:
                values.update(self.ask(missing))
        return {k: self.rewrite.combine(self.left[k[0]], self.right[k[1]]) for k in keys}


class BlockAnswers:
    """False for a pair outside its left value's block, when both values were blocked; the
    other pairs are left to the pair model."""

    def __init__(self, blocks: set[tuple[str, str]], left: set[str], right: set[str]) -> None:
        self.blocks = blocks
        self.left = left
        self.right = right

    def answer(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], Any]:
        return {k: False for k in keys
                if k[0] in self.left and k[1] in self.right and k not in self.blocks}


def explain_lines(op: SemJoin, sides: JoinSides, n: int, m: int) -> list[str]:
    """EXPLAIN's lines for a planned site: each plan with the questions it would ask."""
    rewrite, why = side_rewrite(sides.site.constants[0])
    c = min(op.block_size, m)
    lines = [f"sem_join {sides.site.label}: {n:,} distinct {sides.left} values x {m:,} "
             f"distinct {sides.right} values ({n * m:,} pairs); plans:",
             f"  nested loop: {n * m:,} pair questions",
             f"  blocking: {n * c:,} pair questions (each {sides.left} value with its {c} most "
             f"similar {sides.right} values by {BLOCK_ENCODER}), plus up to "
             f"{RECALL_LEFT * RECALL_OUTSIDE} to estimate the recall it loses"]
    fit = op.trusted_fit(sides.site.constants[0])
    trusted = fit is not None
    if rewrite is not None:
        lines.append(f"  per-side rewrite ({rewrite.describe()}): {n + m:,} per-side "
                     "questions" + ("" if trusted else
                                    f", plus {op.check_pairs} pair questions to check it"))
    else:
        lines.append(f"  per-side rewrite: not possible: {why}")
    if op.plan != "auto":
        lines.append(f"  chosen: {op.plan} (set by sem_join's plan)")
    elif n * m <= op.nested_max:
        lines.append(f"  chosen: nested loop ({n * m:,} pairs, at most nested_max = "
                     f"{op.nested_max:,})")
    elif rewrite is not None and trusted:
        assert fit is not None
        lines.append(f"  chosen: per-side rewrite (trained on labelled pairs: {fit.describe()})")
    else:
        lines.append(f"  chosen when it runs: the rewrite if it agrees with the pair model on "
                     f"{op.check_agreement:.0%} of {op.check_pairs} sampled pairs, else "
                     f"blocking if its estimated recall is at least {op.recall_target:.0%}, "
                     "else the nested loop")
    return lines


@dataclass
class JoinPlanner:
    """Chooses and prepares the plan of one sem_join site (before its statement runs)."""

    op: SemJoin
    ctx: OpContext
    runner: SiteRunner
    sides: JoinSides
    left: list[str]
    right: list[str]
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def plan(self) -> JoinRun:
        op, n, m = self.op, len(self.left), len(self.right)
        if op.plan not in PLANS:
            raise SqlError(f"sem_join's plan must be one of {', '.join(PLANS)}, not "
                           f"{op.plan!r}")
        run = JoinRun(self.runner.site.label, "nested loop", "", n, m)
        rewrite, why_not = side_rewrite(self.runner.site.constants[0])
        if op.plan == "nested" or (op.plan == "auto" and n * m <= op.nested_max):
            run.reason = ("set by sem_join's plan" if op.plan == "nested" else
                          f"{n * m:,} pairs are at most nested_max = {op.nested_max:,}")
            return run
        if op.plan == "rewrite" and rewrite is None:
            raise SqlError(f"sem_join's plan is 'rewrite', but {why_not}")
        if rewrite is not None and op.plan in ("auto", "rewrite"):
            run.rewrite = rewrite.describe()
            fit = op.trusted_fit(self.predicate)
            if fit is not None:
                answers = self.side_answers(rewrite)
                run.side_questions = len(answers.left) + len(answers.right)
                run.plan = "per-side rewrite"
                head = ("" if fit.side_head is None else
                        f" (its per-side questions with a head over {fit.side_encoder} "
                        "embeddings)")
                run.reason = (f"trained on labelled pairs: on {fit.held_rows} held out, the "
                              f"rewrite{head} {fit.rewrite_trained:.0%} against the pair "
                              f"question's {fit.pair_trained:.0%} (balanced accuracy), so no "
                              "check")
                self.runner.shortcut = answers
                return run
            answers, agreed, asked = self.check_rewrite(rewrite)
            run.side_questions = len(answers.left) + len(answers.right)
            run.check_agreed, run.check_pairs = agreed, asked
            if op.plan == "rewrite" or (asked and agreed >= op.check_agreement * asked):
                run.plan = "per-side rewrite"
                run.reason = ("set by sem_join's plan" if op.plan == "rewrite" else
                              f"its check passed (at least {op.check_agreement:.0%} agreed)")
                self.runner.shortcut = answers
                return run
            run.reason = f"the rewrite's check failed (below {op.check_agreement:.0%} agreed); "
        elif op.plan == "auto":
            run.reason = f"no per-side rewrite: {why_not}; "
        blocks, recall, asked, found = self.blocks()
        run.block_size = min(op.block_size, m)
        run.recall, run.recall_pairs, run.recall_true = recall, asked, found
        if op.plan == "blocking" or recall is None or recall >= op.recall_target:
            run.plan = "blocking"
            run.reason += ("set by sem_join's plan" if op.plan == "blocking" else
                           f"estimated recall at least {op.recall_target:.0%}" if recall
                           is not None else "no true pair in the recall sample")
            self.runner.shortcut = BlockAnswers(blocks, set(self.left), set(self.right))
            return run
        run.block_size = 0
        run.reason += (f"blocking's estimated recall {recall:.0%} is below "
                       f"{op.recall_target:.0%}, so every pair is asked")
        return run

    # -- the rewrite ------------------------------------------------------------------------

    @property
    def predicate(self) -> str:
        return self.runner.site.constants[0]

    def ask_sides(self, rewrite: SideRewrite) -> Callable[[list[str]], dict[str, Any]]:
        stage = self.op.side_stage(rewrite, self.predicate)
        model = self.ctx.resource(f"join-side:{stage.name}:{self.ctx.device}",
                                  lambda: stage.build(shared_resources(self.ctx),
                                                      self.ctx.device))
        cascade = Cascade((stage.name,), ())

        def ask(values: list[str]) -> dict[str, Any]:
            texts = [side_text(v) for v in values]
            live = [i for i, t in enumerate(texts) if t and t.strip()]
            out: dict[str, Any] = {v: None for v in values}
            if live:  # under the site's lock: before the statement, or inside its call
                result = run_cascade(cascade, {stage.name: model},
                                     pa.array([texts[i] for i in live], pa.string()),
                                     self.runner.batch_size, name=f"{stage.name} per side")
                out.update((values[i], v) for i, v in zip(live, result.values, strict=True))
            return out

        return ask

    def side_answers(self, rewrite: SideRewrite) -> RewriteAnswers:
        """Every distinct value of both sides asked its per-side question."""
        ask = self.ask_sides(rewrite)
        with self.runner.lock:
            return RewriteAnswers(rewrite, ask, ask(self.left), ask(self.right))

    def check_rewrite(self, rewrite: SideRewrite) -> tuple[RewriteAnswers, int, int]:
        """The rewrite's answers, and how many of the sampled pairs the pair model agrees on
        (of how many)."""
        answers = self.side_answers(rewrite)
        sample = self.check_sample(answers)
        self.runner.ensure(sample)
        agreed = sum(self.runner.memo[k] == answers.answer([k])[k] for k in sample)
        return answers, agreed, len(sample)

    def check_sample(self, answers: RewriteAnswers) -> list[tuple[str, str]]:
        """Up to ``check_pairs`` distinct random pairs with a value: half of them pairs the
        rewrite calls true where it has enough of them, the rest any."""
        want = self.op.check_pairs
        n, m = len(self.left), len(self.right)
        true: list[tuple[str, str]] = []
        other: list[tuple[str, str]] = []
        seen: set[tuple[int, int]] = set()
        for _ in range(CHECK_DRAWS * want):
            if len(true) >= want // 2 and len(true) + len(other) >= want or len(seen) >= n * m:
                break
            i, j = int(self.rng.integers(n)), int(self.rng.integers(m))
            if (i, j) in seen:
                continue
            seen.add((i, j))
            key = (self.left[i], self.right[j])
            value = answers.answer([key])[key]
            if value is True and len(true) < want // 2:
                true.append(key)
            elif value is not None and len(other) < want - min(len(true), want // 2):
                other.append(key)
        return (true + other)[:want]

    # -- blocking ---------------------------------------------------------------------------

    def blocks(self) -> tuple[set[tuple[str, str]], float | None, int, int]:
        """Each left value's block of right values; the estimated recall (None: no true pair
        sampled), the pairs asked outside the blocks to estimate it, the true pairs found."""
        body = shared_resources(self.ctx).encoder(BLOCK_ENCODER, self.ctx.device)
        c = min(self.op.block_size, len(self.right))

        def embed(values: list[str]) -> np.ndarray:
            texts = [side_text(v) or "" for v in values]
            with self.runner.lock:
                return normalise_rows(body.features(texts, self.runner.batch_size))

        similar = embed(self.left) @ embed(self.right).T
        top = np.argsort(-similar, axis=1, kind="stable")[:, :c]
        blocks = {(self.left[i], self.right[j]) for i in range(len(self.left)) for j in top[i]}
        picked = self.rng.choice(len(self.left), min(RECALL_LEFT, len(self.left)),
                                 replace=False)
        inside, outside, weights = [], [], []
        for i in picked:
            inside += [(self.left[i], self.right[j]) for j in top[i]]
            rest = np.setdiff1d(np.arange(len(self.right)), top[i])
            if len(rest):
                chosen = self.rng.choice(rest, min(RECALL_OUTSIDE, len(rest)), replace=False)
                outside += [(self.left[i], self.right[j]) for j in chosen]
                weights += [len(rest) / len(chosen)] * len(chosen)
        self.runner.ensure(inside + outside)
        found_in = sum(self.runner.memo[k] is True for k in inside)
        found_out = [self.runner.memo[k] is True for k in outside]
        estimated_out = float(np.dot(found_out, weights)) if outside else 0.0
        total = found_in + estimated_out
        recall = found_in / total if total > 0 else None
        found = found_in + sum(found_out)
        return blocks, recall, len(outside), found


def distinct_values(sql: Callable[[str], pa.Table], query: str) -> list[str]:
    """The non-NULL values a side's query lists, in a stable order."""
    values = [v for v in sql(query).column(0).to_pylist() if v is not None]
    return sorted(set(values))

