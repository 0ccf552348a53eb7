"""MultiModalQA / HybridQA readers (ken.models.qa_data) and their scoring (ken.models.qa_metric).

The fixtures under tests/fixtures/{mmqa,hybridqa} are hand-made in the official formats (their
make_fixture.py scripts write them). The tests on the real files read ../shared/data and skip
when it is absent.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import duckdb
import numpy as np
import pytest

from ken.errors import DataError
from ken.models.qa_data import IMAGE, MISSING, OK, read_hybridqa, read_mmqa, to_duckdb
from ken.models.qa_metric import ScoreRow, normalise_mmqa, rows_for, score, summarise
from ken.paths import shared_data_dir

FIXTURES = Path(__file__).parent / "fixtures"
MMQA = FIXTURES / "mmqa"
HYBRIDQA = FIXTURES / "hybridqa"
MMQA_FILES = ("MMQA_dev.jsonl.gz", "MMQA_texts.jsonl.gz", "MMQA_tables.jsonl.gz")


def _by_qid(data):
    return {q.qid: q for q in data.questions}


# --- MultiModalQA fixture ---------------------------------------------------------------------


def test_mmqa_fixture_counts() -> None:
    data = read_mmqa(MMQA)
    assert (data.dataset, data.variant, data.files) == ("mmqa", "official", MMQA_FILES)
    assert len(data) == 9
    assert dict(data.status_counts) == {OK: 7, IMAGE: 1, MISSING: 1}
    assert dict(data.type_counts) == {
        "Compare(TableQ,Compose(TableQ,TextQ))": 1, "Compose(TableQ,TextQ)": 1,
        "Compose(TextQ,TableQ)": 1, "ImageQ": 1, "Intersect(TableQ,TextQ)": 1, "TableQ": 2,
        "TextQ": 2}
    assert len(data.answerable) == 7
    # the passage no question refers to is skipped; the missing one was never in the file
    assert sorted(data.passages) == ["txt_harbour", "txt_rossi", "txt_train"]
    assert list(data.tables) == ["tab_rossi"]


def test_mmqa_fixture_questions() -> None:
    qs = _by_qid(read_mmqa(MMQA))
    assert qs["q_text"].answers == ("Turin",) and qs["q_text"].answer_modality == "text"
    assert qs["q_table_year"].answers == ("1972",)  # a JSON number, as str() like the official
    assert qs["q_intersect"].answers == ("The Quiet Harbour", "Night Train to Lyon")
    compare = qs["q_compare"]
    assert compare.intermediate_answers == (("Night Train to Lyon",), ("The Glass Garden",))
    assert compare.supporting_context == (("tab_rossi", "table"), ("txt_train", "text"))
    assert compare.modalities == ("table", "text") and compare.table_id == "tab_rossi"
    assert qs["q_image"].status == IMAGE and qs["q_image"].image_doc_ids == ("img_garden",)
    missing = qs["q_missing"]
    assert (missing.status, missing.missing) == (MISSING, ("txt_garden",))
    assert missing.text_doc_ids[-1] == "txt_garden"


def test_mmqa_fixture_table_and_passage() -> None:
    data = read_mmqa(MMQA)
    table = data.tables["tab_rossi"]
    assert (table.title, table.section_title) == ("Maria Rossi", "Filmography")
    assert table.header == ("Year", "Title", "Role", "Notes")
    assert table.rows[1] == ("1965", "Night Train to Lyon", "Claire", "Golden Lion")
    assert table.links[0][1] == ("https://en.wikipedia.org/wiki/The_Quiet_Harbour",)
    assert table.row_text(0) == "Year: 1961; Title: The Quiet Harbour; Role: Anna"
    passage = data.passages["txt_harbour"]
    assert passage.title == "The Quiet Harbour" and "Tomas Berg" in passage.text


def _copy(names: dict[str, str], target: Path) -> Path:
    target.mkdir()
    for source, name in names.items():
        shutil.copy(MMQA / source, target / name)
    return target


def test_mmqa_reads_the_n100_slice_when_official_files_are_absent(tmp_path: Path) -> None:
    # as in ../shared/data/mmqa: the full dev questions but only the slice's contexts
    folder = _copy({"MMQA_dev.jsonl.gz": "MMQA_dev_n100.jsonl.gz",
                    "MMQA_texts.jsonl.gz": "MMQA_texts_n100.jsonl.gz",
                    "MMQA_tables.jsonl.gz": "MMQA_tables_n100.jsonl.gz"}, tmp_path / "slice")
    shutil.copy(MMQA / "MMQA_dev.jsonl.gz", folder / "MMQA_dev.jsonl.gz")
    data = read_mmqa(folder)
    assert data.variant == "n100"
    assert data.files == ("MMQA_dev_n100.jsonl.gz", "MMQA_texts_n100.jsonl.gz",
                          "MMQA_tables_n100.jsonl.gz")
    assert dict(data.status_counts) == {OK: 7, IMAGE: 1, MISSING: 1}


# --- HybridQA fixture -------------------------------------------------------------------------


def test_hybridqa_fixture() -> None:
    data = read_hybridqa(HYBRIDQA)
    assert (data.dataset, data.variant) == ("hybridqa", "dev")
    assert len(data) == 4 and len(data.tables) == 2 and len(data.passages) == 3
    assert dict(data.status_counts) == {OK: 3, IMAGE: 0, MISSING: 1}
    assert dict(data.type_counts) == {"other": 1, "passage": 1, "table": 1, "unknown": 1}
    qs = _by_qid(data)
    assert (qs["h_table"].qtype, qs["h_passage"].qtype, qs["h_other"].qtype) == (
        "table", "passage", "other")
    assert qs["h_passage"].answers == ("Tomas Berg",)
    assert qs["h_passage"].text_doc_ids == ("/wiki/The_Quiet_Harbour", "/wiki/Night_Train_to_Lyon")
    missing = qs["h_missing"]
    assert (missing.status, missing.missing, missing.text_doc_ids) == (
        MISSING, ("Nowhere_Cup_0",), ())
    table = data.tables["Maria_Rossi_0"]
    assert table.header == ("Year", "Title", "Role")
    assert table.links[1] == ((), ("/wiki/Night_Train_to_Lyon",), ())
    assert "Golden Lion" in table.passages["/wiki/Night_Train_to_Lyon"]
    passage = data.passages["/wiki/The_Quiet_Harbour"]
    assert passage.title == "The Quiet Harbour"
    assert passage.url == "https://en.wikipedia.org/wiki/The_Quiet_Harbour"


# --- DuckDB -----------------------------------------------------------------------------------


def test_mmqa_to_duckdb() -> None:
    con = duckdb.connect()
    counts = to_duckdb(read_mmqa(MMQA), con)
    assert counts == {"questions": 9, "passages": 3, "table_rows": 3, "row_links": 3}
    for name, n in counts.items():
        assert con.execute(f"SELECT count(*) FROM {name}").fetchone()[0] == n
    # a TableQ as a query: the row of the question's table whose Role is Claire
    title = con.execute("""
        SELECT r.cells[2] FROM questions q JOIN table_rows r USING (table_id)
        WHERE q.qid = 'q_table' AND list_contains(r.cells, 'Claire')""").fetchall()
    assert title == [("Night Train to Lyon",)]
    # a Compose(TextQ,TableQ) hop: the row's link leads to the passage with the answer
    text = con.execute("""
        SELECT p.text FROM table_rows r
        JOIN row_links l ON l.table_id = r.table_id AND l.row_index = r.row_index
        JOIN passages p ON p.doc_id = l.doc_id
        WHERE r.row_text LIKE '%Role: Anna%'""").fetchall()
    assert len(text) == 1 and "Genoa" in text[0][0]
    assert con.execute("SELECT answers FROM questions WHERE qid = 'q_intersect'").fetchone() == (
        ["The Quiet Harbour", "Night Train to Lyon"],)


def test_hybridqa_to_duckdb_with_prefix() -> None:
    con = duckdb.connect()
    counts = to_duckdb(read_hybridqa(HYBRIDQA), con, prefix="hy_")
    assert counts == {"hy_questions": 4, "hy_passages": 3, "hy_table_rows": 4,
                      "hy_row_links": 3}
    rows = con.execute("""
        SELECT l.column_name, l.cell, p.text FROM hy_row_links l
        JOIN hy_table_rows r USING (table_id, row_index)
        JOIN hy_passages p ON p.doc_id = l.doc_id
        WHERE r.cells[3] = 'Anna'""").fetchall()
    assert len(rows) == 1 and rows[0][:2] == ("Title", "The Quiet Harbour")
    assert "Tomas Berg" in rows[0][2]
    with pytest.raises(DataError, match="prefix"):
        to_duckdb(read_hybridqa(HYBRIDQA), con, prefix="x; DROP")


# --- errors -----------------------------------------------------------------------------------


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist.*MMQA_dev.jsonl.gz"):
        read_mmqa(tmp_path / "nowhere")
    with pytest.raises(DataError, match="does not exist.*dev_questions.json"):
        read_hybridqa(tmp_path / "nowhere")


def test_empty_folder_names_the_files(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        read_mmqa(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message
    for name in (*MMQA_FILES, "MMQA_dev_n100.jsonl.gz", "MMQA_texts_n100.jsonl.gz",
                 "MMQA_tables_n100.jsonl.gz"):
        assert name in message
    with pytest.raises(DataError, match="tables_with_passages.jsonl.gz"):
        read_hybridqa(tmp_path)


def _write_gz(path: Path, lines: list[str]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    folder = _copy({name: name for name in MMQA_FILES}, tmp_path / "broken")
    with gzip.open(MMQA / "MMQA_texts.jsonl.gz", "rt", encoding="utf-8") as f:
        texts = f.read().splitlines()
    _write_gz(folder / "MMQA_texts.jsonl.gz", [texts[0], '{"id": "x", "text": ', *texts[1:]])
    with pytest.raises(DataError, match=r"MMQA_texts.jsonl.gz, line 2: not valid JSON"):
        read_mmqa(folder)
    _write_gz(folder / "MMQA_texts.jsonl.gz", [*texts, '{"title": "no id or text"}'])
    with pytest.raises(DataError, match=r"MMQA_texts.jsonl.gz, line 5: missing field 'id'"):
        read_mmqa(folder)
    (folder / "MMQA_texts.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match="MMQA_texts.jsonl.gz: cannot read it"):
        read_mmqa(folder)


def test_hybridqa_malformed_questions(tmp_path: Path) -> None:
    folder = tmp_path / "hy"
    shutil.copytree(HYBRIDQA, folder)
    (folder / "dev_questions.json").write_text('[\n{"question_id": "a",\n')
    with pytest.raises(DataError, match=r"dev_questions.json, line 3: not valid JSON"):
        read_hybridqa(folder)
    (folder / "dev_questions.json").write_text(json.dumps([{"question_id": "a"}]))
    with pytest.raises(DataError, match=r"question 0: missing field"):
        read_hybridqa(folder)


def test_question_whose_table_is_missing(tmp_path: Path) -> None:
    folder = _copy({name: name for name in MMQA_FILES}, tmp_path / "no_table")
    _write_gz(folder / "MMQA_tables.jsonl.gz", [])
    data = read_mmqa(folder)
    qs = _by_qid(data)
    assert qs["q_table"].status == MISSING and qs["q_table"].missing == ("tab_rossi",)
    assert qs["q_text"].status == OK  # a text question does not need the table
    assert dict(data.status_counts) == {OK: 1, IMAGE: 1, MISSING: 7}


# --- the real files (../shared/data) ----------------------------------------------------------


def _shared(name: str, file: str) -> Path:
    folder = shared_data_dir() / name
    if not (folder / file).is_file():
        pytest.skip(f"{name} not found at {folder} (../shared/data or $KEN_DATA_DIR)")
    return folder


def test_real_mmqa_n100_slice() -> None:
    data = read_mmqa(_shared("mmqa", "MMQA_dev_n100.jsonl.gz"))
    # the folder has the full MMQA_dev.jsonl.gz but not the full texts/tables: the slice is read
    assert data.variant == "n100" and len(data) == 100
    assert len(data.passages) == 925 and len(data.tables) == 30
    # ../shared/data/README.md says 63 text/table questions with all context; the files have
    # 62 (every question whose type or modalities name no image), all with complete context
    assert dict(data.status_counts) == {OK: 62, IMAGE: 38, MISSING: 0}
    assert data.type_counts["TableQ"] == 30 and data.type_counts["TextQ"] == 18
    assert data.type_counts["Compose(TextQ,TableQ)"] == 12
    con = duckdb.connect()
    assert to_duckdb(data, con)["table_rows"] == 414


def test_real_hybridqa() -> None:
    data = read_hybridqa(_shared("hybridqa", "tables_with_passages.jsonl.gz"))
    assert len(data) == 1218 and len(data.tables) == 2141
    assert dict(data.status_counts) == {OK: 1218, IMAGE: 0, MISSING: 0}
    # the official dev_reference.json splits these 495 table / 703 passage / 20 in neither;
    # one answer is in its passage there but not in this passage text
    assert dict(data.type_counts) == {"other": 21, "passage": 702, "table": 495}


# --- scoring ----------------------------------------------------------------------------------


def test_normalise_mmqa() -> None:
    assert normalise_mmqa("The Jean-Paul Awards, 1,000 two") == "jean paul awards 1000.0 2.0"
    assert normalise_mmqa("3.5") == "3.5" and normalise_mmqa("$5") == "5.0"


def test_score_single_answers() -> None:
    assert score("the Eiffel Tower", ["Eiffel tower"]) == (1.0, 1.0)
    # {ben, piazza, actor} vs {ben, piazza}: P 2/3, R 1, F1 0.8
    assert score("Ben Piazza actor", ["Ben Piazza"]) == (0.0, 0.8)
    assert score("Jean-Paul", ["Jean Paul"]) == (1.0, 1.0)  # hyphens split tokens
    assert score("Paris", "Paris") == (1.0, 1.0)  # a plain string gold is one span


def test_score_numbers() -> None:
    assert score("2,000", ["2000"]) == (1.0, 1.0)
    assert score("two", ["2"]) == (1.0, 1.0)
    # {12.0, km} vs {12.0}: P 1/2, R 1, F1 2/3, rounded to 0.67 as the official script does
    assert score("12 km", ["12"]) == (0.0, 0.67)
    # the gold number is missing from the prediction: 0 despite the shared "km"
    assert score("13 km", ["12 km"]) == (0.0, 0.0)


def test_score_lists() -> None:
    gold = ["Kick Buttowski", "Slugterra"]
    assert score(["Slugterra", "kick buttowski"], gold) == (1.0, 1.0)  # order does not matter
    # one of two gold spans found: (1 + 0) / 2
    assert score(["Slugterra"], gold) == (0.0, 0.5)
    assert score("Slugterra", gold) == (0.0, 0.5)
    # an extra span counts as a 0: (1 + 1 + 0) / 3
    assert score(["Slugterra", "Kick Buttowski", "Phineas"], gold) == (0.0, 0.67)
    # years: 1998 and 2001 align, 2005 matches no number: (1 + 1) / max(4, 3)
    assert score(["1998", "2001", "2005"], ["1999", "1998", "2002", "2001"]) == (0.0, 0.5)
    # spans are sets of tokens in the MultiModalQA F1, multisets in HybridQA's
    assert score("cat cat", ["cat"]) == (0.0, 1.0)
    assert score("cat cat", ["cat"], style="hybridqa") == pytest.approx((0.0, 2 / 3))


def test_score_missing_predictions() -> None:
    for predicted in (None, "", "   ", [], [""]):
        assert score(predicted, ["Turin"]) == (0.0, 0.0)
        assert score(predicted, ["Turin"], style="hybridqa") == (0.0, 0.0)


def test_score_hybridqa_style() -> None:
    # SQuAD: [cat, sat] vs [cat, sat, down]: P 1, R 2/3, F1 0.8
    assert score("the cat sat", ["cat sat down"], style="hybridqa") == pytest.approx((0.0, 0.8))
    assert score("Paris", ["Lyon", "paris"], style="hybridqa") == (1.0, 1.0)
    assert score(["Blue", "Rovers"], ["Blue Rovers"], style="hybridqa") == (1.0, 1.0)
    assert score("Jean-Paul", ["Jean Paul"], style="hybridqa") == (0.0, 0.0)


def test_score_rejects_bad_input() -> None:
    with pytest.raises(DataError, match="style"):
        score("a", ["a"], style="squad2")
    with pytest.raises(DataError, match="gold"):
        score("a", [])


def test_summarise_fixture() -> None:
    predictions = {
        "q_text": "Turin",                                   # 1, 1
        "q_table": "night train to lyon",                    # 1, 1
        "q_table_year": "in 1972",                           # 0, 0.67
        # q_compose_table_text: no prediction                # 0, 0
        "q_compose_text_table": "Genoa, Italy",              # 0, 0.67
        "q_intersect": ["Night Train to Lyon"],              # 0, 0.5
        "q_compare": "Night Train to Lyon",                  # 1, 1
        "q_image": "red",                                    # not scored: image
    }
    rows = rows_for(read_mmqa(MMQA).questions, predictions)
    summary = summarise(rows)
    assert summary.scored == 7
    assert summary.em == pytest.approx(100 * 3 / 7)
    assert summary.f1 == pytest.approx(100 * 4.84 / 7)
    assert dict(summary.statuses) == {OK: 7, IMAGE: 1, MISSING: 1}
    assert summary.by_type["TableQ"].count == 2
    assert summary.by_type["TableQ"].em == pytest.approx(50.0)
    assert summary.by_type["TableQ"].f1 == pytest.approx(83.5)
    assert "ImageQ" not in summary.by_type
    assert summary.scores["q_intersect"] == (0.0, 0.5)
    everything = summarise(rows, score_all=True)
    assert everything.scored == 9 and everything.em == pytest.approx(100 * 4 / 9)
    assert everything.by_type["ImageQ"].em == 100.0
    assert summarise([]).scored == 0 and summarise([]).em == 0.0


def test_summarise_hybridqa_rows() -> None:
    rows = [ScoreRow("a", "table", OK, ("Night Train to Lyon",), "Night Train to Lyon"),
            ScoreRow("b", "passage", OK, ("Tomas Berg",), "Berg"),
            ScoreRow("c", "unknown", MISSING, ("Blue Rovers",), None)]
    summary = summarise(rows, style="hybridqa")
    # b: [berg] vs [tomas, berg]: P 1, R 1/2, F1 2/3
    assert summary.em == pytest.approx(50.0)
    assert summary.f1 == pytest.approx(100 * (1 + 2 / 3) / 2)
    assert dict(summary.statuses) == {OK: 2, IMAGE: 0, MISSING: 1}
    # standard errors: sample std of the per-question scores / sqrt(2), in percent
    em_se, f1_se = summary.standard_errors()
    assert em_se == pytest.approx(100 * np.std([1.0, 0.0], ddof=1) / np.sqrt(2))
    assert f1_se == pytest.approx(100 * np.std([1.0, 2 / 3], ddof=1) / np.sqrt(2))
    assert summarise(rows[:1], style="hybridqa").standard_errors() == (0.0, 0.0)
