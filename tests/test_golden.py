"""Golden-file tests of the SQL front-end: the rewrite of semantic calls and EXPLAIN.

In the manner of sqlglot's optimizer fixtures, the expected output lives in checked-in text
files, so a change of the rewrite or of EXPLAIN shows up as a readable diff:

- ``tests/golden/rewrite.sql``: cases of ``ken.sql.rewrite.rewrite``. Each case is a
  ``# title:`` line, the input query (one or more lines, ending with ``;``), then what the
  rewrite gives: the rewritten SQL (``rw.sql``, one line ending with ``;``) and one ``--`` line
  per call site (label, function, column arguments, constants, clauses), or
  ``-- no semantic calls``. Cases are separated by blank lines. The inputs are the file's own:
  to add a case, append a title and an input query and regenerate.
- ``tests/golden/explain/*.txt``: ``session.explain(query)`` (not ANALYZE) of the three README
  example queries, on the small fixed tables built here.

Every semantic function here is a deterministic stand-in (``tests/fakes.py``: hashes, no
weights), registered on a session with ``builtins=False``, so the output is the same on every
machine and no model is loaded: ``sentiment`` a two-stage cascade, ``sem_filter(text,
'predicate')`` and ``sem_match(a, b)`` boolean ``SemanticFunction`` s.

Regenerate the golden files (instead of comparing) with the environment variable
``KEN_UPDATE_GOLDEN=1``, then read the diff before checking it in::

    KEN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_golden.py
    git diff tests/golden

A mismatch fails with a unified diff of golden against actual and this command.

A few rewrite cases also get a differential check: the query run through the session (the
rewrite, the call sites, the cascade executor) gives the same rows as plain DuckDB calling
the stand-ins row by row as Python functions of the same names.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from fakes import FakeModel

import ken
from ken.models.cascade import Cascade
from ken.models.quality import EvalSample
from ken.ops.base import BoundSemantic, SemanticFunction
from ken.sql.rewrite import Rewritten, parse, rewrite

GOLDEN = Path(__file__).parent / "golden"
REWRITE_FILE = GOLDEN / "rewrite.sql"
EXPLAIN_DIR = GOLDEN / "explain"
UPDATE = os.environ.get("KEN_UPDATE_GOLDEN") == "1"
REGENERATE = ("KEN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q -p no:cacheprovider "
              "tests/test_golden.py")
BOOL = ("false", "true")

# -- the deterministic stand-ins ---------------------------------------------------------

SENTIMENT = Cascade(("sent-a", "sent-b"), (0.5,))
FILTER_THRESHOLD = 0.6
MATCH = Cascade(("pair-a", "pair-b"), (0.55,))


def filter_cascade(predicate: str) -> Cascade:
    """sem_filter's stand-in cascade for one predicate: two boolean stages whose names hold a
    hash of the predicate (as the real ``sim-l6[660d936a]`` do)."""
    key = hashlib.sha256(predicate.encode()).hexdigest()[:8]
    return Cascade((f"filter-a[{key}]", f"filter-b[{key}]"), (FILTER_THRESHOLD,))


def bind_filter(constants: tuple[str, ...]) -> BoundSemantic:
    cascade = filter_cascade(constants[0])
    return BoundSemantic("sem_filter", cascade, {m: FakeModel(m, BOOL) for m in cascade.models},
                         "boolean", calibrated=False, arguments=constants,
                         detail="deterministic stand-in")


def bind_match(_constants: tuple[str, ...]) -> BoundSemantic:
    return BoundSemantic("sem_match", MATCH,
                         {m: FakeModel(m, BOOL, num_inputs=2) for m in MATCH.models},
                         "boolean", calibrated=False, detail="deterministic stand-in")


def standin_session() -> ken.Session:
    """A session whose sentiment / sem_filter / sem_match are the stand-ins, with the tables."""
    s = ken.connect(builtins=False)
    sample = EvalSample("standin-tweets", tuple(t for t in TWEETS if t is not None),
                        tuple(brute_sentiment(t) for t in TWEETS if t is not None))
    s.register("sentiment", SENTIMENT, models={m: FakeModel(m) for m in SENTIMENT.models},
               sample=sample)
    s.register("sem_filter", SemanticFunction(
        "sem_filter", 1, ("predicate",), "boolean", bind_filter,
        doc="stand-in: a hash of (model, predicate, text)"))
    s.register("sem_match", SemanticFunction(
        "sem_match", 2, (), "boolean", bind_match, doc="stand-in: a hash of the pair"))
    for name, table in tables().items():
        s.register_table(name, table)
    return s


def brute_cascade(cascade: Cascade, models: list[FakeModel], row: object) -> str:
    """One row through a cascade by hand: stage by stage, max probability against the
    stage's threshold, the last stage answers."""
    for i, model in enumerate(models):
        prediction = model.predict([row], 1)
        last = i == len(models) - 1
        if last or float(prediction.probabilities[0].max()) >= cascade.thresholds[i]:
            return prediction.label_strings()[0]
    raise AssertionError("unreachable")


def brute_sentiment(text: str) -> str:
    return brute_cascade(SENTIMENT, [FakeModel(m) for m in SENTIMENT.models], text)


def brute_filter(text: str, predicate: str) -> bool:
    cascade = filter_cascade(predicate)
    models = [FakeModel(m, BOOL) for m in cascade.models]
    return brute_cascade(cascade, models, text) == "true"


def brute_match(a: str, b: str) -> bool:
    models = [FakeModel(m, BOOL, num_inputs=2) for m in MATCH.models]
    return brute_cascade(MATCH, models, (a, b)) == "true"


# -- the fixed tables ---------------------------------------------------------------------

TWEETS = [
    "@united my flight was delayed three hours and nobody at the gate told us anything, "
    "worst service ever",
    "@delta thanks for the upgrade, the crew was lovely and the snacks were great",
    "flight cancelled again. rebooked for tomorrow morning, no hotel voucher offered",
    "great flight",
    "delay delay delay",
    None,
    "@jetblue lost my bag on a direct flight, how is that even possible? still waiting for an "
    "update after two days",
    "the new lounge at terminal 4 is nice",
    "great flight",
    "@americanair the delay was announced after boarding, we sat on the tarmac for 90 minutes "
    "with no water",
    "meh",
    "@southwest friendly staff and an early arrival, what more could I want on a monday",
    "is anyone else stuck at ORD? weather delay, all flights grounded until further notice",
    "",
    "@united my flight was delayed three hours and nobody at the gate told us anything, "
    "worst service ever",
    "pizza at the airport food court was surprisingly good",
]
ABT = ["sony bravia 46 inch lcd tv kdl46v5100", "sony cyber-shot dsc-w120 camera",
       "Samsung 40 inch LCD HDTV LN40A550", "sony walkman nwz-e436f 4gb", "Canon PowerShot SD1100",
       None, "Sony headphones MDR-V6"]
BUY = ["Sony BRAVIA 46in LCD HDTV", "Sony Cybershot W120 digital camera", "Samsung LN40A550",
       "Sony NWZ-E436F Walkman 4GB MP3 player", "Panasonic Lumix DMC-FX35", "sony"]


def tables() -> dict[str, pa.Table]:
    return {
        "tweets": pa.table({
            "id": list(range(1, len(TWEETS) + 1)),
            "text": TWEETS,
            "label": [("negative", "neutral", "positive")[i % 3] for i in range(len(TWEETS))],
            "len": [None if t is None else len(t) for t in TWEETS],
        }),
        "abt": pa.table({"id": list(range(1, len(ABT) + 1)), "name": ABT}),
        "buy": pa.table({"id": list(range(101, 101 + len(BUY))), "name": BUY}),
    }


def brute_connection() -> duckdb.DuckDBPyConnection:
    """Plain DuckDB with the tables and the stand-ins as row-at-a-time Python functions of the
    same names (the constant argument of sem_filter is an ordinary argument here)."""
    con = duckdb.connect()
    for name, table in tables().items():
        con.register(name, table)
    con.create_function("sentiment", brute_sentiment, ["VARCHAR"], "VARCHAR")
    con.create_function("sem_filter", brute_filter, ["VARCHAR", "VARCHAR"], "BOOLEAN")
    con.create_function("sem_match", brute_match, ["VARCHAR", "VARCHAR"], "BOOLEAN")
    return con


# -- golden-file comparison ---------------------------------------------------------------


def check_golden(path: Path, actual: str, note: str = "") -> None:
    """Compare ``actual`` with the golden file (or rewrite it under KEN_UPDATE_GOLDEN=1);
    ``note`` is added to the failure message."""
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual, encoding="utf-8")
        return
    rel = path.relative_to(Path(__file__).parent.parent)
    if not path.exists():
        pytest.fail(f"golden file {rel} is missing; create it with\n  {REGENERATE}",
                    pytrace=False)
    expected = path.read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(difflib.unified_diff(
            expected.splitlines(keepends=True), actual.splitlines(keepends=True),
            fromfile=f"{rel} (golden)", tofile=f"{rel} (actual)"))
        pytest.fail(f"{rel} differs from the actual output{note}:\n{diff}\nIf the change is "
                    f"intended, regenerate the golden files and check the diff in:\n"
                    f"  {REGENERATE}", pytrace=False)


# -- tests/golden/rewrite.sql -------------------------------------------------------------


@dataclass
class Case:
    title: str
    comments: list[str]  # other "#" lines of the case, kept as written
    query_lines: list[str]
    expected: list[str]  # rewritten SQL and site lines; empty for a new case

    @property
    def query(self) -> str:
        return "\n".join(self.query_lines).rstrip().removesuffix(";")


def read_cases(text: str) -> tuple[list[str], list[Case]]:
    """The file's header comment (before the first case) and its cases."""
    header: list[str] = []
    cases: list[Case] = []
    for block in text.strip("\n").split("\n\n"):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines:
            continue
        if not any(line.startswith("# title:") for line in lines):
            if cases:
                raise ValueError(f"a case without '# title:' in {REWRITE_FILE}:\n{block}")
            header += [*lines, ""]
            continue
        title = next(line for line in lines if line.startswith("# title:"))
        comments = [line for line in lines if line.startswith("#") and line != title]
        body = [line for line in lines if not line.startswith("#")]
        end = next((i for i, line in enumerate(body) if line.rstrip().endswith(";")), None)
        if end is None:
            raise ValueError(f"the input of {title!r} does not end with ';'")
        cases.append(Case(title.removeprefix("# title:").strip(), comments, body[: end + 1],
                          body[end + 1:]))
    titles = [c.title for c in cases]
    duplicates = {t for t in titles if titles.count(t) > 1}
    if duplicates:
        raise ValueError(f"repeated case titles in {REWRITE_FILE}: {sorted(duplicates)}")
    return header, cases


def rewrite_query(s: ken.Session, query: str) -> Rewritten:
    statements = parse(query)
    assert len(statements) == 1, f"one statement per case: {query}"
    return rewrite(statements[0], s.operators, s.db.functions(), 0, "")


def expected_lines(rw: Rewritten) -> list[str]:
    def js(values: tuple[str, ...]) -> str:
        return json.dumps(list(values), ensure_ascii=False)

    lines = [rw.sql + ";"]
    lines += [f"-- {site.label}: {site.function} args={js(site.args)} "
              f"constants={js(site.constants)} clauses={js(site.clauses)}"
              for site in rw.sites] or ["-- no semantic calls"]
    return lines


def render_cases(header: list[str], cases: list[Case], s: ken.Session) -> str:
    out = list(header)
    for case in cases:
        out += [f"# title: {case.title}", *case.comments, *case.query_lines,
                *expected_lines(rewrite_query(s, case.query)), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def load_rewrite_cases() -> list[Case]:
    return read_cases(REWRITE_FILE.read_text(encoding="utf-8"))[1]


def test_rewrite_golden() -> None:
    s = standin_session()
    text = REWRITE_FILE.read_text(encoding="utf-8")
    header, cases = read_cases(text)
    assert cases, f"{REWRITE_FILE} holds no cases"
    actual = render_cases(header, cases, s)
    stale = [c.title for c, new in zip(cases, read_cases(actual)[1], strict=True)
             if c.expected != new.expected]
    check_golden(REWRITE_FILE, actual, f" (cases: {'; '.join(stale)})" if stale else "")


def test_rewrite_golden_covers_every_clause() -> None:
    """The fixture keeps covering what the README promises: a call in every kind of clause,
    two-column calls, constants, shared and separate sites, and a query with none."""
    _, cases = read_cases(REWRITE_FILE.read_text(encoding="utf-8"))
    s = standin_session()
    sites = [site for c in cases for site in rewrite_query(s, c.query).sites]
    clauses = {clause for site in sites for clause in site.clauses}
    assert {"SELECT", "WHERE", "JOIN ON", "GROUP BY", "HAVING", "ORDER BY"} <= clauses
    assert any(len(site.args) == 2 for site in sites)
    assert any(site.constants for site in sites)
    assert any(not rewrite_query(s, c.query).sites for c in cases)
    for case in cases:  # the file is in sync with itself: every case has its output
        assert case.expected, f"case {case.title!r} has no expected output; {REGENERATE}"


#: rewrite cases also checked against brute force (titles in tests/golden/rewrite.sql)
DIFFERENTIAL = [
    "SELECT call",
    "WHERE under AND, OR and NOT",
    "JOIN ON with a two-column call and a relational condition",
    "GROUP BY a semantic output",
    "HAVING",
    "dedup of f(t.x) and f(x)",
    "no semantic call",
]


def sort_key(row: tuple) -> tuple:
    return tuple((v is None, repr(v)) for v in row)


@pytest.mark.parametrize("title", DIFFERENTIAL)
def test_rewritten_query_equals_row_by_row_standins(title: str) -> None:
    cases = {c.title: c for c in load_rewrite_cases()}
    assert title in cases, f"no case titled {title!r} in {REWRITE_FILE}"
    query = cases[title].query
    ours = standin_session().sql(query).fetchall()
    brute = brute_connection().sql(query).fetchall()
    assert ours, f"{title}: the query returns no rows, so the check checks nothing"
    assert sorted(ours, key=sort_key) == sorted(brute, key=sort_key)


def test_qualified_and_bare_column_sites_share_answers() -> None:
    """The golden rewrite keeps ``f(t.x)`` and ``f(x)`` as two sites; at run time they share
    one memo, so each distinct input is still evaluated once per query."""
    query = {c.title: c for c in load_rewrite_cases()}["dedup of f(t.x) and f(x)"].query
    stats = standin_session().sql(query).stats
    assert set(stats) == {"s0", "s1"}
    distinct = len({t for t in TWEETS if t is not None})
    assert sum(st.distinct_evaluated for st in stats.values()) == distinct
    assert all(st.rows_in == len(TWEETS) for st in stats.values())


# -- tests/golden/explain/*.txt -----------------------------------------------------------

README_QUERIES = {
    "select-order-limit": "SELECT id, sentiment(text) AS mood FROM tweets WHERE len > 100 AND "
                          "text LIKE '%@%' ORDER BY id LIMIT 20",
    "filter-or-group-by": "SELECT sentiment(text) AS mood, count(*) AS n FROM tweets WHERE "
                          "len > 40 AND (sem_filter(text, 'complains about a delayed or "
                          "cancelled flight') OR text LIKE '%delay%') GROUP BY mood ORDER BY "
                          "n DESC",
    "cte-semantic-join": "WITH a AS (SELECT * FROM abt WHERE name LIKE '%sony%') SELECT "
                         "a.name, b.name FROM a JOIN buy b ON sem_match(a.name, b.name)",
}


@pytest.mark.parametrize("name", sorted(README_QUERIES))
def test_explain_golden(name: str) -> None:
    query = README_QUERIES[name]
    text = standin_session().explain(query)
    check_golden(EXPLAIN_DIR / f"{name}.txt", f"EXPLAIN {query}\n\n{text}\n")
