"""Every entry point's --help: a one-line help per flag and the default of every flag that
has one (s2d_jax/cli/args.py HelpFormatter), rendered without error."""

import argparse
import importlib
import pathlib

import pytest

import s2d_jax.cli.args

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLIS = sorted(f"{p.parent.name}.{p.stem}" for d in ("infer", "train")
              for p in (ROOT / d).glob("*.py")
              if p.stem not in ("__init__", "args") and "def main(" in p.read_text())


class _Parsed(Exception):
    """Raised in place of parsing, to hand the built parser back."""


def _parsers(module) -> list[argparse.ArgumentParser]:
    """The CLI's parser and its sub-commands' parsers, as its main builds them."""
    seen = []

    def grab(self, *args, **kwargs):
        seen.append(self)
        raise _Parsed

    mp = pytest.MonkeyPatch()
    mp.setattr(s2d_jax.cli.args.ArgumentParser, "parse_args", grab)
    mp.setattr(s2d_jax.cli.args.ArgumentParser, "parse_known_args", grab)
    try:
        with pytest.raises(_Parsed):
            module.main(["--help"])
    finally:
        mp.undo()
    parsers = list(seen)
    for p in seen:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                parsers += list(a.choices.values())
    return parsers


def test_every_cli_is_checked():
    assert {"infer.generate", "infer.chat", "infer.bench", "train.soft"} <= set(CLIS)


@pytest.mark.parametrize("name", CLIS)
def test_help_shows_a_line_and_the_default_of_every_flag(name, capsys):
    module = importlib.import_module(name)
    for parser in _parsers(module):
        for a in parser._actions:
            if not a.option_strings or a.dest == "help":
                continue
            flag = a.option_strings[-1]
            assert a.help and a.help.strip(), f"{name} {flag} has no help"
            line = parser._get_formatter()._get_help_string(a) % {**vars(a), "prog": parser.prog}
            if not any(a.default is v for v in (None, False, argparse.SUPPRESS)):  # 0 counts
                assert "default" in line.lower(), f"{name} {flag}: no default in {line!r}"
    with pytest.raises(SystemExit) as e:  # the real --help renders and exits 0
        module.main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out
