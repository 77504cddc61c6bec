"""One output rule for every command, found by the code (issue 41): every module of infer/
and train/ (and the demo family's build) with a `main` is imported, its parser is taken from
the call its main makes to `ArgumentParser.parse_args`, and every flag that names an output
(declared with s2d_jax.cli.args.add_output) is tried with the cases that must not write:

    is / contains / lies inside an input, "", ".", an existing path of the wrong kind, a
    path under a file, a place that cannot be written, a dir holding another tool's files

Each case ends in one `error:` line and exit 2 from the command's real `main`, with the
workspace byte-identical; where the case is valid for that kind of output (a shared cache
dir may hold other things), the parser accepts it. A new command whose main does not parse
with s2d_jax.cli.args.ArgumentParser, or a path-like flag declared without add_input/add_output,
fails `test_every_command_declares_its_paths`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import re

import pytest

import s2d_jax.cli.args
from s2d_jax.cli.args import ArgumentParser, input_arg, path_arg
from s2d_jax.errors import S2DError
from s2d_jax.io.outputs import CACHE, DIR, FILE, MARKER
from test_cli_fuzz import REPO, check_one_error, snapshot

# a flag whose name says it is a path: it must be declared as an input or an output
PATHLIKE = re.compile(r"^--(.*-)?(out|output|work|dir|report|save|export|cache|path|file|"
                      r"model|target|targets|draft|config|questions|prompts|script|points|"
                      r"wheel|heldout|engine|src|tokenizer|intermediate|corpus|configs)$")


class _Parsed(Exception):
    def __init__(self, parser):
        super().__init__("parsed")
        self.parser = parser


def _command_modules() -> list[str]:
    names = [f"{pkg}.{m.name}" for pkg in ("infer", "train")
             for m in pkgutil.iter_modules([os.path.join(REPO, pkg)]) if m.name != "args"]
    return [*names, "examples.demo_family.build"]


def _parser_of(module: str):
    """The parser `module.main` builds (None: the module is not a command)."""
    mod = importlib.import_module(module)
    if not callable(getattr(mod, "main", None)):
        return None
    original = ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)
    ArgumentParser.parse_args = capture
    try:
        mod.main(["--help"])
    except _Parsed as p:
        return p.parser
    except SystemExit:  # printed help through a parser that is not s2d_jax.cli.args'
        pytest.fail(f"{module}.main does not parse with s2d_jax.cli.args.ArgumentParser, so the "
                    f"output rule does not reach it")
    finally:
        ArgumentParser.parse_args = original
    pytest.fail(f"{module}.main returned without parsing its arguments")


COMMANDS = _command_modules()


def _variants(parser) -> list[tuple[list[str], list[argparse.ArgumentParser]]]:
    """([subcommand words], [parsers whose flags apply]) for every runnable command line."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [([], [parser])]
    out = []
    for name, sub in subs[0].choices.items():
        out += [([name, *words], [parser, *ps]) for words, ps in _variants(sub)]
    return out


def _declared(a) -> bool:
    return hasattr(a, "s2d_input") or hasattr(a, "s2d_output")


@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_declares_its_paths(module):
    parser = _parser_of(module)
    if parser is None:
        return  # a helper module of the package, not a command: nothing it could write
    for _, parsers in _variants(parser):
        for p in parsers:
            for a in p._actions:
                names = a.option_strings or [a.dest]
                # a flag with metavar NAME(S) names things, not paths (insertion's --target)
                takes_text = (a.type in (None, str) and a.nargs != 0 and not a.choices
                              and a.metavar not in ("NAME", "NAMES"))
                if a.type in (path_arg, input_arg) or (takes_text and any(PATHLIKE.match(n) for n in names)):
                    assert _declared(a), (
                        f"{module}: {names[0]} looks like a path but is declared with "
                        f"add_argument; use s2d_jax.cli.args.add_input or add_output so the output "
                        f"rule covers it")


def _fill(parsers, skip, ws) -> list[str]:
    """Values for every required flag (inputs as paths under ws/in/)."""
    argv = []
    for p in parsers:
        for a in p._actions:
            if a in skip or not a.option_strings or not a.required:
                continue
            argv += [a.option_strings[0], _value(a, ws)]
        for g in p._mutually_exclusive_groups:
            if g.required and not any(a in skip or a.required for a in g._group_actions):
                a = g._group_actions[0]
                argv += [a.option_strings[0], _value(a, ws)]
    return argv


def _value(a, ws) -> str:
    if hasattr(a, "s2d_input"):
        return _input_path(a, ws)
    if a.choices:
        return str(next(iter(a.choices)))
    return "1"


def _input_path(a, ws) -> str:
    d = ws / "in" / a.dest
    d.mkdir(parents=True, exist_ok=True)
    (d / "f.txt").write_text("keep me\n")
    return str(d)


CASES = ("is", "contains", "inside", "empty", "cwd", "wrong-kind", "under-a-file",
         "unwritable", "foreign-dir")
NEEDS_INPUT = ("is", "contains", "inside")


def _cases():
    """(module, subcommand words, output flag, case) for every output of every command;
    the input cases where the command has a path flag it reads."""
    out = []
    for module in COMMANDS:
        parser = _parser_of(module)
        if parser is None:
            continue
        for words, parsers in _variants(parser):
            reads = any(hasattr(a, "s2d_input") for p in parsers for a in p._actions)
            for p in parsers:
                for a in p._actions:
                    if not hasattr(a, "s2d_output"):
                        continue
                    flag = a.option_strings[0]
                    out += [pytest.param(module, words, flag, case,
                                         id=f"{' '.join([module, *words])} {flag} {case}")
                            for case in CASES if reads or case not in NEEDS_INPUT]
    return out


def _case_path(case, kind, inp, ws, replaces=False):
    """(the output's value, the error's keyword, or None where the case is valid);
    `replaces`: an output the command keeps up to date as its own (add_output's
    overwrite=True), which never asks for --overwrite."""
    if case == "is":
        return inp, "is the input"
    if case == "contains":
        return str(ws / "in"), None if kind == CACHE else "contains the input"
    if case == "inside":
        return os.path.join(inp, "sub"), "lies inside the input"
    if case == "empty":
        return "", "is empty"
    if case == "cwd":
        return ".", "is the current directory"
    if case == "wrong-kind":
        return ((str(ws / "a_dir"), "is a directory") if kind == FILE else
                (str(ws / "a_file"), "is a file, not a directory"))
    if case == "under-a-file":
        return str(ws / "a_file" / "out"), "is a file, not a directory"
    if case == "unwritable":  # /proc/self: not writable even for root
        return "/proc/self/s2d-out/x", "cannot be written"
    foreign = str(ws / "foreign")
    return foreign, {FILE: "is a directory", DIR: "did not write", CACHE: None}.get(
        kind, "will not replace it" if replaces else "already exists")


@pytest.fixture
def ws(tmp_path, monkeypatch):
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("precious\n")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "report.md").write_text("another tool's report\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("module,words,flag,case", _cases())
def test_no_output_escapes_the_rule(module, words, flag, case, ws, capsys):
    parser = _parser_of(module)
    parsers = dict((tuple(w), ps) for w, ps in _variants(parser))[tuple(words)]
    out_action = next(a for p in parsers for a in p._actions if flag in a.option_strings)
    inputs = [a for p in parsers for a in p._actions if hasattr(a, "s2d_input")]
    inp = inputs[0] if inputs else None  # the command's first path flag it reads
    inp_path = _input_path(inp, ws) if inp else str(ws / "in" / "none")
    value, keyword = _case_path(case, out_action.s2d_output[0], inp_path, ws,
                                out_action.s2d_output[1] is True)
    given = [inp.option_strings[0], inp_path] if inp else []
    argv = [*words, *_fill(parsers, {out_action, inp}, ws), *given, flag, value]
    before = snapshot(ws)
    if keyword is None:  # valid for this kind of output: the rule lets it through
        parser.parse_args(argv)
    else:
        with pytest.raises(SystemExit) as e:
            importlib.import_module(module).main(argv)
        check_one_error(e.value.code, capsys.readouterr().err, [flag, keyword])
    assert snapshot(ws) == before
    if inp:
        assert (ws / "in" / inp.dest / "f.txt").read_text() == "keep me\n"


def test_the_rule_runs_inside_parse_args(ws):
    """The rule is the parser's, not each command's: a bare parser with one input and one
    output refuses an output inside the input."""
    from s2d_jax.cli.args import add_input, add_output
    ap = ArgumentParser(prog="x")
    add_input(ap, "--model")
    add_output(ap, "--out")
    with pytest.raises(S2DError, match="lies inside the input --model"):
        ap.parse_args(["--model", "m", "--out", "m/config.json"])
    assert s2d_jax.cli.args.check_path_flags  # the one place it is applied
