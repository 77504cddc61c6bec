"""Argument parsing shared by the entry points (`infer/`, `train/`): the parser class,
list flags, range checks of numeric flags (finite floats only), the `[NAME=]PATH` target
syntax and `--fake-devices`' setting (the flags shared by several commands are defined
once in s2d_jax/cli/flags.py).

Every check raises a one-line S2DError naming the flag and the fix, which `cli_main`
prints as `error: ...` (argparse's own errors would print a usage block instead).

Numbers go through the validators the Python API uses (s2d_jax/validate.py): every `int`
flag must fit int32, every `float` flag must be finite. Every path flag is declared with
`add_input` or `add_output`; the parser then applies the output rule
(s2d_jax/io/outputs.check_outputs: an output is never, contains or lies inside an input,
is never empty, `.`, a file where a dir is meant, or unwritable) to the parsed flags
before the command does any work, so a command cannot forget it.
"""

from __future__ import annotations

import argparse
import math
import os
import re

from s2d_jax import validate
from s2d_jax.config import finite_float
# the gamma check lives beside max_gamma (the library's benchmark uses it too)
from s2d_jax.decode.defaults import check_gamma  # noqa: F401
from s2d_jax.errors import S2DError
from s2d_jax.readers import expand_path


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and each flag's default after its help unless the
    help already says it or there is none to show (unset, or a switch that is off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = any(action.default is v for v in (None, False, argparse.SUPPRESS))  # not 0
        if "default" in text.lower() or unset or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


PYTHON_M = "python -m "
# entry point module (infer.generate) -> the name it runs under now (`s2d generate`); set by
# s2d_jax/cli/main.py for the duration of one subcommand
INVOKED_AS: dict[str, str] = {}


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors are one-line S2DErrors (cli_main prints them),
    whose --help shows defaults (HelpFormatter), and which reads negative number lists
    such as `--costs -1,2` as values, not options."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        # `python -m infer.X` as the entry point names itself; `s2d X` while the s2d command
        # runs it (s2d_jax/cli/main.py), so usage lines and errors show the command typed
        prog = kwargs.get("prog") or ""
        if prog.startswith(PYTHON_M):
            kwargs["prog"] = INVOKED_AS.get(prog[len(PYTHON_M):], prog)
        super().__init__(*args, **kwargs)
        # argparse's own pattern (-1, -.5) misses lists and exponents; no flag starts with
        # a digit, so anything like -1,2 or -1e-3 is a value
        self._negative_number_matcher = re.compile(r"^-[\d.][\d.,eE+-]*$")

        # every int flag fits int32 and every float flag is finite (s2d_jax/validate.py)
        self.register("type", int, bounded_int)
        self.register("type", float, finite_number)

    def error(self, message):
        raise S2DError(f"{message}; see {self.prog} --help")

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        check_path_flags(self, ns)
        return ns


def _chosen_parsers(parser: argparse.ArgumentParser, ns) -> list:
    """The parser and, for each subcommand level, the subparser the user chose."""
    out = [parser]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            chosen = a.choices.get(getattr(ns, a.dest, None) or "")
            if chosen is not None:
                out += _chosen_parsers(chosen, ns)
    return out


def path_flags(parser: argparse.ArgumentParser, ns=None) -> list[argparse.Action]:
    """The actions declared by add_input / add_output (of the chosen subcommand, with a
    namespace; of every subcommand without)."""
    parsers = _chosen_parsers(parser, ns) if ns is not None else _all_parsers(parser)
    return [a for p in parsers for a in p._actions
            if hasattr(a, "s2d_input") or hasattr(a, "s2d_output")]


def _all_parsers(parser) -> list:
    out = [parser]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in dict.fromkeys(a.choices.values()):
                out += _all_parsers(sub)
    return out


def check_path_flags(parser: argparse.ArgumentParser, ns) -> None:
    """The output rule over the parsed path flags (see the module docstring)."""
    from s2d_jax.io.outputs import DIR, Output, check_outputs
    inputs, outputs = {}, []
    for a in path_flags(parser, ns):
        value, flag = getattr(ns, a.dest, None), a.option_strings[0] if a.option_strings \
            else a.dest
        if value is None:
            continue
        if hasattr(a, "s2d_input"):
            inputs[flag] = a.s2d_input(value)
        else:
            kind, overwrite = a.s2d_output
            replace = (overwrite if isinstance(overwrite, bool) else
                       bool(getattr(ns, overwrite, False)) if overwrite else False)
            outputs.append(Output(flag, value, kind, replace,
                                  "this run" if overwrite is True else "--overwrite",
                                  owner=parser.prog if kind == DIR else ""))
    if outputs:
        check_outputs(outputs, inputs)
    ns.s2d_prog = parser.prog  # the owner files_dir marks a DIR output with


MODEL_FLAGS = ("--target", "--draft")


def _paths_as_given(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def add_input(container, *flags, paths=_paths_as_given, **kw) -> argparse.Action:
    """A flag naming something the command reads (a model, a data file, a config): outputs
    may not touch it. `paths(value)` -> its path(s) (e.g. NAME=PATH specs' paths). A model
    flag (--target, --draft) also takes a model's name (model_arg), any other a file the
    project ships from any directory (input_arg)."""
    kw.setdefault("type", model_arg if flags[0] in MODEL_FLAGS else input_arg)
    action = container.add_argument(*flags, **kw)
    action.s2d_input = paths
    return action


def add_output(container, *flags, kind: str = "file", overwrite: str | bool | None = None,
               **kw) -> argparse.Action:
    """A flag naming something the command writes. kind: outputs.FILE, DIR (a dir of
    files, marked as this command's), CACHE (a shared dir) or a model dir kind (HF_DIR,
    CHECKPOINT, DRAFT_PACK: replaced whole, only with the `overwrite` switch's dest set;
    overwrite=True: a dir the command keeps up to date as its own, as a checkpoint dir,
    replaced whenever it carries the kind's marker)."""
    kw.setdefault("type", path_arg)
    action = container.add_argument(*flags, **kw)
    action.s2d_output = (kind, overwrite)
    return action


def comma_paths(text: str) -> tuple[str, ...]:
    """'a.json,b.txt' -> the paths of a comma-separated input file-list flag (empty items
    dropped, shipped files found from any directory: input_arg); also add_input's `paths`
    of such a flag."""
    return tuple(input_arg(p) for p in text.split(",") if p)


def target_paths(specs) -> list[str]:
    """add_input's `paths` of `[NAME=]PATH` target flags."""
    return list(parse_targets([specs] if isinstance(specs, str) else list(specs)).values())


def bounded_int(text: str) -> int:
    """argparse `type` of every int flag: an integer that fits int32."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    try:
        return validate.integer(value, "it", lo=-validate.INT32_MAX - 1)
    except S2DError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def finite_number(text: str) -> float:
    """argparse `type=` for float flags: NaN and inf are refused (one line via `error`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; give a finite "
                                         f"value")
    return value


def model_arg(text: str) -> str:
    """argparse `type` of model flags: a path, or a name of s2d_jax.env.MODEL_NAMES
    (`smollm2`, `smollm2-draft`) found from any directory."""
    from s2d_jax.env import resolve_model
    return resolve_model(text)


def model_or_input_arg(text: str) -> str:
    """argparse `type` of a model flag that also takes a shipped file (aot's --target /
    --draft: a model's name, or a path such as configs/models/x.yaml found from any
    directory)."""
    from s2d_jax.env import MODEL_NAMES
    return model_arg(text) if text in MODEL_NAMES else input_arg(text)


def input_arg(text: str) -> str:
    """argparse `type` of input path flags: path_arg, and a relative path that does not
    exist here but names a file the project ships (data/..., configs/...) is that file
    (s2d_jax.env.resolve_input), so the defaults work from any directory."""
    from s2d_jax.env import resolve_input
    return resolve_input(text)


def path_arg(text: str) -> str:
    """argparse `type` of every path flag: `~` and `$VARS` expanded (readers.expand_path)."""
    return expand_path(text)


def check_models_exist(models) -> None:
    """Each (flag, path) of a model flag exists (None: not given): checked before anything
    loads, so a missing --target is named as itself, not as the tokenizer directory or
    config that happens to be read from it first."""
    from s2d_jax.env import MODEL_NAMES, SMOLLM2_NAME
    for flag, path in models:
        if path is not None and not os.path.exists(path):  # a dir, or a .gguf file
            if path.endswith(SMOLLM2_NAME):  # the name `smollm2`, not fetched yet
                raise S2DError(f"{flag} smollm2 is not fetched yet ({path}); run `s2d "
                               f"fetch` first")
            raise S2DError(f"{flag} {path} does not exist; pass an HF model dir, a params "
                           f"checkpoint, a .gguf file or a model name: "
                           f"{', '.join(MODEL_NAMES)}")


def check_at_least(args, minimums: dict[str, float]) -> None:
    """Refuse `args.<dest>` below its minimum (None = unset, allowed); NaN is refused too."""
    for dest, lo in minimums.items():
        v = getattr(args, dest)
        if v is not None and not v >= lo:
            raise S2DError(f"--{dest.replace('_', '-')} must be >= {lo:g}, got {v}")


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    validate.sampling(temperature, top_p, top_k, prefix="--")


def parse_floats(text: str, flag: str = "value", nonempty: bool = False) -> list[float]:
    """'0.6,0.4,0' -> [0.6, 0.4, 0.0]; empty items are skipped."""
    try:
        vals = [finite_float(float(x), flag) for x in text.split(",") if x.strip()]
    except ValueError:
        raise S2DError(f"{flag} {text!r} is not comma-separated numbers, e.g. 0.6,0.4,0")
    if nonempty and not vals:
        raise S2DError(f"{flag} is empty; give comma-separated numbers, e.g. 0.6,0.4,0")
    return vals


def parse_ints(text: str, flag: str = "value", minimum: int | None = None) -> list[int]:
    """'6,9,12' -> [6, 9, 12]; with `minimum`, at least one value and none below it."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = None
    if vals is None or (minimum is not None and (not vals or min(vals) < minimum)):
        kind = "integers" if minimum is None else f"integers >= {minimum}"
        raise S2DError(f"{flag} {text!r} is not comma-separated {kind}, e.g. 6,9,12")
    return vals


def parse_targets(specs: list[str], flag: str = "--target") -> dict[str, str]:
    """['l=models/demo/target-l', 'ckpt/vicuna'] -> {'l': ..., 'vicuna': 'ckpt/vicuna'}."""
    targets = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(spec)), spec
        if not name or not path:
            raise S2DError(f"bad {flag} {spec!r}; use PATH or NAME=PATH")
        if name in targets:
            raise S2DError(f"target name {name!r} given twice; name them NAME=PATH")
        targets[name] = model_arg(path)
    return targets


def fake_cpu_devices(n: int) -> None:
    """Make the CPU backend show `n` devices. XLA reads the flag when the backend starts
    (the first device query), so call this before anything touches jax.devices()."""
    if n < 0:
        raise S2DError(f"--fake-devices must be >= 0 (0 = the real devices), got {n}")
    if n:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={n}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
