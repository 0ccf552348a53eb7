"""`ken sql` prints values and errors as text: Rich markup in them is neither parsed nor
rendered (a value like '[/x]' used to crash the printer)."""

from __future__ import annotations

import pytest

from ken.cli import main


def test_markup_in_values_and_errors_is_printed_as_text(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("KEN_HOME", str(tmp_path))
    query = "SELECT '[/x]' AS a, '[link=http://x]y[/link]' AS b, '[bold]z' AS c"
    assert main(["sql", "--db", str(tmp_path / "t.duckdb"), query]) == 0
    out = capsys.readouterr().out
    assert "[/x]" in out and "[link=http://x]y[/link]" in out and "[bold]z" in out
    assert main(["sql", "--db", str(tmp_path / "t.duckdb"), "SELECT * FROM [/nope]"]) == 1
    assert "[/nope]" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["models", "prepare", "--train-rows", "-5"],
    ["models", "prepare", "--threads", "0"],
    ["models", "prepare", "--test-rows", "many"],
    ["cascades", "--grid", "0"],
])
def test_bad_numbers_are_usage_errors_before_anything_runs(argv, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    assert "error: argument" in err and argv[-1] in err


def test_exit_codes_tell_usage_errors_from_failures_and_bugs(tmp_path, monkeypatch,
                                                             capsys) -> None:
    monkeypatch.setenv("KEN_HOME", str(tmp_path))
    assert main(["hybridqa", "--limit", "0"]) == 2  # a malformed command line
    assert "--limit must be at least 1" in capsys.readouterr().err
    assert main(["sql", "--db", str(tmp_path / "t.duckdb"), "SELECT nope()"]) == 1  # a failure

    def broken(args) -> int:  # a bug inside a command: one line, no traceback
        raise ZeroDivisionError("division by zero [x]")

    import ken.cli

    parser = ken.cli.build_parser
    monkeypatch.setattr(ken.cli, "build_parser", lambda: _with_func(parser(), broken))
    assert main(["sql", "SELECT 1"]) == 70
    err = capsys.readouterr().err
    assert "internal error: ZeroDivisionError: division by zero [x]" in err
    assert "Traceback" not in err and "--debug" in err
    assert main(["--debug", "sql", "SELECT 1"]) == 70
    assert "Traceback" in capsys.readouterr().err


def _with_func(parser, func):
    parser.set_defaults(func=func)
    for action in parser._subparsers._group_actions:  # every subcommand runs ``func``
        for sub in action.choices.values():
            sub.set_defaults(func=func)
    return parser


HOSTILE = ["[/x]", "[link=http://evil]click[/link]", "[bold red]boom", "\x1b[2J\x1b]8;;http://x\x07",
           "'); DROP TABLE t; --", "<|im_start|>system", "ünïcode ✈ \u202e", "{0} %s \\N"]


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_strings_through_the_cli(value, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("KEN_HOME", str(tmp_path))
    db = str(tmp_path / "t.duckdb")
    literal = "'" + value.replace("'", "''") + "'"
    assert main(["sql", "--db", db, f"CREATE TABLE t AS SELECT {literal} AS v"]) == 0
    assert main(["sql", "--db", db, "SELECT v, length(v) AS n FROM t"]) == 0
    out = capsys.readouterr().out
    assert str(len(value)) in out and "\x1b" not in out  # control codes are shown escaped
    name = '"' + value.replace('"', '""') + '"'
    assert main(["sql", "--db", db, f"SELECT * FROM {name}"]) == 1  # the name is in the error
    err = capsys.readouterr().err
    assert "Traceback" not in err and "\x1b" not in err and "does not exist" in err
    assert main(["sql", "--db", db, "SELECT count(*) AS rows FROM t"]) == 0  # t is still there
    assert "1" in capsys.readouterr().out


def test_progress_lines_print_names_as_text() -> None:
    import io

    from rich.console import Console

    from ken.progress import Reporter

    out = io.StringIO()
    reporter = Reporter(console=Console(file=out, width=200))
    reporter.note("trained on [/x] (table '[bold]t')")
    with reporter.task("pair-l3[abt-buy.name]: features", 2) as advance:
        advance(2)
    text = out.getvalue()
    assert "trained on [/x] (table '[bold]t')" in text and "pair-l3[abt-buy.name]" in text


def test_data_dir_reaches_every_operator_through_the_family_data(tmp_path) -> None:
    """`--data-dir` is where the family's held-out rows are read from, also when an operator
    (the sentiment operator of `ken plan`) reads them."""
    import argparse

    from ken.cli import family_args, family_data
    from ken.errors import DataError

    parser = argparse.ArgumentParser()
    family_args(parser)
    data = family_data(parser.parse_args(["--data", "sentiment140", "--data-dir",
                                          str(tmp_path)]))
    assert data.data_dir == tmp_path
    with pytest.raises(DataError, match=str(tmp_path)):
        data.splits()
    assert data.with_members("mpnet-base").data_dir == tmp_path
