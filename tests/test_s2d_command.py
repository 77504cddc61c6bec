"""`s2d SUBCOMMAND` (s2d_jax/cli/main.py) reaches every entry point of infer/ and train/ (found
by the code: a new command module without a subcommand fails here), prints its table for
--help and refuses an unknown subcommand with one error line."""

from __future__ import annotations

import pytest

from s2d_jax.cli import main as s2d
from test_output_rule import COMMANDS, _parser_of


def test_every_entry_point_is_a_subcommand():
    modules = {m for m in COMMANDS if not m.startswith("examples.") and _parser_of(m)}
    assert modules == {m for m, _ in s2d.SUBCOMMANDS.values()}


def test_help_lists_them_and_an_unknown_one_is_refused(capsys):
    assert s2d.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in s2d.SUBCOMMANDS)
    assert s2d.main(["genrate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown subcommand 'genrate'")


def test_a_subcommand_runs_its_entry_point(capsys):
    with pytest.raises(SystemExit) as e:
        s2d.main(["generate", "--max-new-tokens", "0", "--target", "x", "--prompt", "hi"])
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, usage", [
    (["generate", "--help"], "usage: s2d generate "),
    (["convert", "hf-to-hf", "--help"], "usage: s2d convert hf-to-hf "),
    (["train", "--help"], "usage: s2d train "),
])
def test_usage_names_the_command_as_typed(capsys, argv, usage):
    """`s2d X --help` says `s2d X`; the same entry point run as `python -m` says that, also
    after an s2d run in the same process."""
    with pytest.raises(SystemExit):
        s2d.main(argv)
    assert capsys.readouterr().out.startswith(usage)
    module = s2d.entry_module(s2d.SUBCOMMANDS[argv[0]][0])
    with pytest.raises(SystemExit):
        module.main(argv[1:])
    entry = s2d.SUBCOMMANDS[argv[0]][0]
    assert capsys.readouterr().out.startswith(
        f"usage: python -m {entry}{usage[len('usage: s2d ') + len(argv[0]):]}")


def test_an_error_names_the_command_as_typed(capsys):
    with pytest.raises(SystemExit) as e:
        s2d.main(["bench", "--target", "t=x", "--max-new-tokens", "many"])
    assert e.value.code == 2
    assert "see s2d bench --help" in capsys.readouterr().err
