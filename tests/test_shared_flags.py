"""One name, one definition (issue 44): every flag that two commands of `s2d` share is
defined once in s2d_jax/cli/flags.py, and every command's parser (as its main builds it,
subcommands included) carries exactly that definition: type, default, help, choices, nargs,
metavar and action. A difference is allowed only where the table declares it as a Variant
of that command, with its reason. The comparer is shown to catch planted differences."""

from __future__ import annotations

import argparse
import collections
import inspect
import os

import pytest

from s2d_jax.cli import flags
from s2d_jax.cli.args import ArgumentParser
from s2d_jax.cli.main import SUBCOMMANDS
from test_output_rule import _parser_of, _variants

FIELDS = ("type", "default", "help", "choices", "nargs", "metavar", "action")


def signature(action: argparse.Action) -> dict:
    return {"type": action.type, "default": action.default, "help": action.help,
            "choices": tuple(action.choices) if action.choices is not None else None,
            "nargs": action.nargs, "metavar": action.metavar, "action": type(action).__name__}


def command_flags() -> dict[str, dict[str, argparse.Action]]:
    """'generate' / 'convert hf-to-hf' (s2d's words) -> option string -> its action, for
    every command line of every SUBCOMMANDS parser."""
    out = {}
    for name, (module, _) in SUBCOMMANDS.items():
        for words, parsers in _variants(_parser_of(module)):
            out[" ".join([name, *words])] = {
                o: a for p in parsers for a in p._actions for o in a.option_strings
                if o not in ("-h", "--help")}
    return out


def _definition(name: str, command: str) -> dict:
    """The signature flags.py defines for `name` in `command`, built on a scratch parser."""
    return signature(flags.add(ArgumentParser(prog="scratch"), name, command))


def differences(commands: dict[str, dict[str, argparse.Action]]) -> list[str]:
    """Every way the shared flags of `commands` break the rule, one line each."""
    users = collections.defaultdict(dict)
    for command, actions in commands.items():
        for option, action in actions.items():
            users[option][command] = action
    problems = []
    for option, uses in sorted(users.items()):
        if len(uses) < 2:
            continue
        if option not in flags.FLAGS:
            problems.append(f"{option} is in {sorted(uses)} but not defined in "
                            f"s2d_jax/cli/flags.py: define it once there (or rename one)")
            continue
        for command, action in sorted(uses.items()):
            base = command.split()[0]
            if getattr(action, "s2d_flag", None) != (option, base):
                problems.append(f"{command} {option}: not added by flags.add(parser, "
                                f"{option!r}, {base!r})")
            got, want = signature(action), _definition(option, base)
            problems += [f"{command} {option}: {f} {got[f]!r}, its definition's {want[f]!r} "
                         f"(declare a Variant of {base!r} in s2d_jax/cli/flags.py if intended)"
                         for f in FIELDS if got[f] != want[f]]
    return problems


@pytest.fixture(scope="module")
def commands():
    return command_flags()


def test_every_shared_flag_has_one_definition(commands):
    assert differences(commands) == []


def test_the_table_declares_only_what_commands_use(commands):
    """Each definition is shared by two command lines at least; each variant names a command
    that uses the flag and says why it differs."""
    used = collections.defaultdict(set)
    for command, actions in commands.items():
        for option in actions:
            used[option].add(command)
    for name, flag in flags.FLAGS.items():
        assert len(used[name]) >= 2, f"{name} is used by {sorted(used[name])} only"
        bases = {c.split()[0] for c in used[name]}
        for command, v in flag.variants.items():
            assert command in bases, f"{name}: variant of {command!r}, which does not use it"
            assert v.why.strip() and v.kw, f"{name}: variant of {command!r} without a reason"


@pytest.mark.parametrize("field, value", [("default", 0.9), ("help", "nucleus mass"),
                                          ("metavar", "P"), ("type", str)])
def test_a_planted_difference_is_reported(commands, monkeypatch, field, value):
    action = commands["chat"]["--top-p"]
    monkeypatch.setattr(action, field, value)
    found = differences(commands)
    assert len(found) == 1 and found[0].startswith(f"chat --top-p: {field} "), found


def test_an_undeclared_variant_or_an_own_definition_is_reported(commands, monkeypatch):
    commands = dict(commands)  # the module's parsers stay as built (monkeypatch undoes the rest)
    # a command whose flag differs where the table declares no variant for it
    monkeypatch.setattr(commands["generate"]["--max-new-tokens"], "default", 256)  # chat's
    # a flag two commands define each on their own
    for command in ("bench", "calibrate"):
        ap = ArgumentParser(prog=command)
        commands[command] = {**commands[command],
                             "--warmup-prompts": ap.add_argument("--warmup-prompts", type=int)}
    found = differences(commands)
    assert any(f.startswith("generate --max-new-tokens: default 256") for f in found), found
    assert any(f.startswith("--warmup-prompts is in ['bench', 'calibrate'] but not defined")
               for f in found), found
    assert len(found) == 2, found


def test_an_own_copy_of_a_shared_flag_is_reported(commands):
    """A command that re-declares a shared flag by hand, even identically, is not using the
    one definition (the next edit of the table would leave it behind)."""
    ap = ArgumentParser(prog="copy")
    want = flags.FLAGS["--seed"].keywords("chat")
    copy = ap.add_argument("--seed", **want)
    found = differences({**commands, "chat": {**commands["chat"], "--seed": copy}})
    assert found == ["chat --seed: not added by flags.add(parser, '--seed', 'chat')"]


def test_the_api_and_the_commands_share_defaults():
    """The Python API prompts and stops as the commands do by default (the chat template's
    fallback is one function, s2d_jax.data.prompts.resolve_template, for all of them)."""
    import s2d_jax
    api = inspect.signature(s2d_jax.generate).parameters
    assert api["chat_template"].default == flags.FLAGS["--chat-template"].kw["default"]
    assert api["max_new_tokens"].default == flags.FLAGS["--max-new-tokens"].kw["default"]


def test_calibrate_defaults_are_the_librarys(commands):
    """infer.calibrate's shared flags default to the library's CalibrateOptions (the API
    calibrates as the command does)."""
    import dataclasses

    from s2d_jax.bench.calibration import CalibrateOptions
    library = {f.name: f.default for f in dataclasses.fields(CalibrateOptions)
               if f.default is not dataclasses.MISSING}
    checked = []
    for option, action in commands["calibrate"].items():
        dest = option[2:].replace("-", "_")
        if option in flags.FLAGS and dest in library:
            value = library[dest]
            value = ",".join(map(str, value)) if isinstance(value, tuple) else value
            assert action.default == value, (option, action.default, value)
            checked.append(option)
    assert {"--questions", "--max-prompts", "--repeats", "--dtype"} <= set(checked)


def test_old_spellings_still_work():
    """bench's --targets and --self-exit, the names before the one definition, still parse
    (the test above keeps them out of every other command)."""
    from infer.bench import parse_args
    old = parse_args(["--targets", "t=models/demo/target-s", "--self-exit", "2",
                      "--methods", "ar"])
    new = parse_args(["--target", "t=models/demo/target-s", "--exit", "2", "--methods", "ar"])
    assert (old.targets, old.self_exit) == (new.targets, new.self_exit) == (
        ["t=models/demo/target-s"], 2)


def test_default_input_files_are_found_from_any_directory(commands, tmp_path, monkeypatch):
    """A default such as --questions data/demo_questions.jsonl names a file the project
    ships: it is found outside the clone's root too (s2d_jax/env.py shipped_file)."""
    from s2d_jax.cli.args import model_arg
    monkeypatch.chdir(tmp_path)
    checked = 0
    for command, actions in commands.items():
        for option, a in actions.items():
            if (not hasattr(a, "s2d_input") or not isinstance(a.default, str) or not a.default
                    or a.type is model_arg):  # models by name: s2d_jax.env.MODEL_NAMES
                continue
            value = a.type(a.default) if callable(a.type) else a.default
            paths = a.s2d_input(value)
            for path in [paths] if isinstance(paths, str) else paths:
                assert os.path.isabs(path) and os.path.isfile(path), (command, option, path)
                checked += 1
    assert checked >= 8  # bench's and calibrate's questions, the engine's files, ...
