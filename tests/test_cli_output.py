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
    assert main(["sql", "--db", str(tmp_path / "t.duckdb"), "SELECT * FROM [/nope]"]) == 2
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
