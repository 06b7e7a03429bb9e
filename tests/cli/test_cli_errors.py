"""A mistyped command line gets one line that says what is wrong, not the usage page first
(serve's usage is 30 lines, and the line that mattered came last)."""

from __future__ import annotations

import pytest

from cp_runtime.cli.main import main
from cp_runtime.config import model_names


def _error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


@pytest.mark.parametrize("command", ["serve", "capacity", "compile"])
def test_an_unknown_model_is_one_line_naming_the_choices(command, capsys):
    err = _error([command, "--model", "llama-3"], capsys)
    assert err == (f"cp-runtime {command}: error: argument --model: unknown model 'llama-3'; "
                   f"choose from {', '.join(model_names())}\n")


def test_other_value_errors_are_one_line_too(capsys):
    err = _error(["serve", "--kv-cache-dtype", "int4"], capsys)
    assert err.startswith("cp-runtime serve: error: argument --kv-cache-dtype: invalid choice")
    assert err.count("\n") == 1 and "usage:" not in err


def test_unknown_arguments_are_named_by_their_subcommand(capsys):
    err = _error(["serve", "--modle", "tiny"], capsys)
    assert err == ("cp-runtime serve: error: unrecognized arguments: --modle tiny "
                   "(see `cp-runtime serve --help`)\n")
    err = _error([], capsys)
    assert err.startswith("cp-runtime: error: the following arguments are required: command")


def test_help_still_prints_the_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: cp-runtime serve ")
