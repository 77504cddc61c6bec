"""Imports in s2d_jax/ only point down the package ranks (the layout in README.md):

    errors, config, readers, validate, env < parallel < model < io < data < decode < train, server < bench < calibration < cli < s2d_jax/__init__.py

Every import statement counts, including those inside functions (a lazy import is still a
dependency). s2d_jax never imports the entry points (`infer`, top-level `train`) or
`examples`. A violation fails naming the file, the line and the import.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import pathlib
import re
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "s2d_jax"
RANKS = {"errors": 0, "config": 0, "readers": 0, "validate": 0, "env": 0, "compile_cache": 0, "parallel": 1, "model": 2, "io": 3, "data": 4,
         "decode": 5, "train": 6, "server": 6, "bench": 7,
         "calibration": 8, "cli": 9}
TOP = max(RANKS.values()) + 1  # s2d_jax/__init__.py: the public API imports any package
FORBIDDEN = ("infer", "train", "examples")  # top-level entry points and the demo pipeline


def _unit(parts: tuple[str, ...]) -> str | None:
    """'s2d_jax.decode.engine' parts -> 'decode'; the bare package -> None."""
    return parts[1] if len(parts) > 1 else None


def _imported_modules(node: ast.AST, module_parts: tuple[str, ...], is_init: bool) -> list[str]:
    """Absolute dotted names an Import / ImportFrom node pulls in (relative ones resolved)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level == 0:
        base = node.module or ""
    else:  # relative: drop the module itself (not for a package __init__), then level-1 more
        pkg = module_parts if is_init else module_parts[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ((node.module,) if node.module else ()))
    # `from s2d_jax import decode` imports the subpackage s2d_jax.decode
    if base == PACKAGE:
        return [f"{PACKAGE}.{a.name}" for a in node.names]
    return [base]


def layering_violations(root: pathlib.Path) -> list[str]:
    """'path:line: import ... (why)' for every import in root/s2d_jax that points up."""
    problems = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root)
        parts = tuple(rel.with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        if is_init:
            parts = parts[:-1]
        own = _unit(parts)
        if own is None:
            rank = TOP
        elif own in RANKS:
            rank = RANKS[own]
        else:
            problems.append(f"{rel}:1: {own} has no rank; add it to RANKS in "
                            f"tests/test_layering.py and to the README's layer list")
            continue
        source = path.read_text()
        tree = ast.parse(source, filename=str(rel))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported_modules(node, parts, is_init):
                head = name.split(".")
                text = ast.get_source_segment(source, node) or name
                if head[0] in FORBIDDEN:
                    problems.append(f"{rel}:{node.lineno}: {text.strip()} (s2d_jax must not "
                                    f"import the entry points or examples)")
                elif head[0] == PACKAGE:
                    dep = _unit(tuple(head))
                    dep_rank = TOP if dep is None else RANKS.get(dep)
                    if dep_rank is not None and dep_rank > rank and dep != own:
                        problems.append(f"{rel}:{node.lineno}: {text.strip()} ({own or PACKAGE}"
                                        f" ranks below {dep or PACKAGE})")
    return problems


def test_s2d_jax_imports_only_point_down():
    problems = layering_violations(ROOT)
    assert not problems, "upward imports:\n" + "\n".join(problems)


def _tree(tmp_path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


CLEAN = {"s2d_jax/__init__.py": "def f():\n    from s2d_jax.bench import runner\n",
         "s2d_jax/errors.py": "",
         "s2d_jax/model/__init__.py": "",
         "s2d_jax/model/transformer.py": "from s2d_jax.parallel import mesh\nimport numpy\n",
         "s2d_jax/decode/engine.py": "from s2d_jax.model import transformer\n"
                                     "from . import state\nfrom ..io import checkpoint\n"}


@pytest.mark.parametrize("rel, text, expect", [
    ("s2d_jax/model/bad.py", "import os\nfrom s2d_jax.decode.engine import generate\n",
     "s2d_jax/model/bad.py:2: from s2d_jax.decode.engine import generate"),
    ("s2d_jax/io/bad.py", "def load():\n    import s2d_jax.train.loop\n",
     "s2d_jax/io/bad.py:2: import s2d_jax.train.loop"),
    ("s2d_jax/parallel/bad.py", "from ..model import transformer\n",
     "s2d_jax/parallel/bad.py:1: from ..model import transformer"),
    ("s2d_jax/config.py", "from s2d_jax import decode\n",
     "s2d_jax/config.py:1: from s2d_jax import decode"),
    ("s2d_jax/bench/bad.py", "def f():\n    from s2d_jax.cli.args import parse_targets\n",
     "s2d_jax/bench/bad.py:2: from s2d_jax.cli.args import parse_targets"),
    ("s2d_jax/decode/bad.py", "import train.soft\n", "s2d_jax/decode/bad.py:1: import train.soft"),
    ("s2d_jax/data/bad.py", "from examples.demo_family import bpe\n",
     "s2d_jax/data/bad.py:1: from examples.demo_family import bpe"),
    ("s2d_jax/model/bad.py", "import s2d_jax\n", "s2d_jax/model/bad.py:1: import s2d_jax"),
])
def test_checker_names_each_violation(tmp_path, rel, text, expect):
    root = _tree(tmp_path, CLEAN)
    assert layering_violations(root) == []  # the clean tree passes: downward and same-package
    _tree(tmp_path, {rel: text})
    problems = layering_violations(root)
    assert len(problems) == 1 and problems[0].startswith(expect), problems


def test_checker_rejects_an_unranked_package(tmp_path):
    root = _tree(tmp_path, {**CLEAN, "s2d_jax/unranked/api.py": ""})
    assert [p for p in layering_violations(root) if "unranked has no rank" in p]


def test_real_tree_is_the_one_checked():
    # guard against a vacuous pass: the walk sees the real packages
    seen = {p.relative_to(ROOT / PACKAGE).parts[0] for p in (ROOT / PACKAGE).rglob("*.py")}
    assert {"decode", "model", "io", "bench", "errors.py", "__init__.py"} <= seen
    assert os.path.isfile(ROOT / PACKAGE / "decode" / "engine.py")


# --- every third-party import is declared in pyproject.toml --------------------------------

# the project's packages and the tests' own helper modules (tests/*.py import each other)
LOCAL = ({"s2d_jax", "infer", "train", "examples", "__future__"}
         | {p.stem for p in (ROOT / "tests").glob("*.py")})


# the distribution of a module named otherwise, for where it is not installed (an extra's)
NOT_INSTALLED = {"llama_cpp": "llama-cpp-python"}  # infer.peer_bench, the `peer` extra


def _dist(requirement: str) -> str:
    name = re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, set[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    groups = {"core": {_dist(r) for r in project["dependencies"]}}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        groups[extra] = {_dist(r) for r in reqs}
    return groups


def _third_party_imports(folder: str):
    """(file, line, top-level module, at module level?) of every non-local, non-stdlib import."""
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text())
        module_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in LOCAL or top in sys.stdlib_module_names:
                    continue
                yield path.relative_to(ROOT), node.lineno, top, id(node) in module_level


@pytest.mark.parametrize("folder, allowed_groups", [
    ("s2d_jax", ("core", "bench")), ("infer", ("core", "bench", "peer")),
    ("train", ("core", "bench")),
    ("examples", ("core", "bench")), ("tests", ("core", "bench", "test"))])
def test_every_import_is_declared(folder, allowed_groups):
    """Module-level imports of the library and CLIs need only the core install (torch and
    matplotlib stay optional: imported inside the functions that use them)."""
    groups = _declared()
    dists = importlib.metadata.packages_distributions()
    problems = []
    for rel, line, top, at_module_level in _third_party_imports(folder):
        provided = {_dist(d) for d in dists.get(top, [NOT_INSTALLED.get(top, top)])}
        need = ("core",) if at_module_level and folder != "tests" else allowed_groups
        if not provided & set().union(*(groups.get(g, set()) for g in need)):
            problems.append(f"{rel}:{line}: import {top} (distribution {sorted(provided)}) is "
                            f"not in pyproject.toml's {' / '.join(need)} dependencies")
    assert not problems, "\n".join(problems)


def test_core_install_has_no_torch_or_matplotlib():
    assert not {"torch", "matplotlib"} & _declared()["core"]


# --- no file-level import cycle ----------------------------------------------------------

def _module_file(root: pathlib.Path, dotted: str) -> pathlib.Path | None:
    """root/a/b.py or root/a/b/__init__.py for 'a.b', else None (not a module of the tree)."""
    base = root.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _import_targets(root: pathlib.Path, node, parts: tuple[str, ...], is_init: bool):
    """Files of the tree that one Import / ImportFrom node loads: `from p import m` names the
    module p.m when there is one, else p itself (m is a name defined in p)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        modules = _imported_modules(node, parts, is_init)
        # `from s2d_jax import decode, io`: _imported_modules already named the subpackages
        base = PACKAGE if modules == [f"{PACKAGE}.{a.name}" for a in node.names] \
            else modules[0]
        names = [f"{base}.{a.name}" if _module_file(root, f"{base}.{a.name}") else base
                 for a in node.names]
    return {f for f in (_module_file(root, n) for n in names) if f is not None}


def import_graph(root: pathlib.Path, package: str = PACKAGE) -> dict:
    """{file: {imported file: first line}} over root/package, imports inside functions too
    (a lazy import is still a dependency). A package's __init__ is an edge only where it is
    named: it runs before any of its modules, so it cannot close a circle between them."""
    graph = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root)
        parts = tuple(rel.with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        parts = parts[:-1] if is_init else parts
        edges = graph.setdefault(rel, {})
        for node in ast.walk(ast.parse(path.read_text(), filename=str(rel))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _import_targets(root, node, parts, is_init):
                    target = target.relative_to(root)
                    if target != rel:
                        edges.setdefault(target, node.lineno)
    return graph


def import_cycles(root: pathlib.Path, package: str = PACKAGE) -> list[str]:
    """'a.py:3 -> b.py:7 -> a.py' (file:line of each import) for each circle of files that
    import each other the search meets: at least one line whenever there is a circle."""
    graph = import_graph(root, package)
    cycles, done = [], set()
    for start in sorted(graph):
        stack, on_path = [(start, iter(sorted(graph[start])))], [start]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.pop()
                done.add(node)
            elif child in on_path:
                loop = on_path[on_path.index(child):] + [child]
                cycles.append(" -> ".join(f"{a}:{graph[a][b]}" for a, b in zip(loop, loop[1:]))
                              + f" -> {child}")
            elif child not in done:
                stack.append((child, iter(sorted(graph.get(child, ())))))  # () outside
                on_path.append(child)
    return cycles


def test_no_file_level_import_cycle():
    graph = import_graph(ROOT)
    assert pathlib.Path("s2d_jax/io/hf.py") in graph[pathlib.Path("s2d_jax/io/checkpoint.py")]
    cycles = import_cycles(ROOT)
    assert not cycles, "files that import each other (give each role its own file):\n" + \
        "\n".join(cycles)


@pytest.mark.parametrize("files, expect", [
    ({"s2d_jax/io/a.py": "from s2d_jax.io.b import f\n",
      "s2d_jax/io/b.py": "def f():\n    from s2d_jax.io import a\n"},
     ["s2d_jax/io/a.py:1 -> s2d_jax/io/b.py:2 -> s2d_jax/io/a.py"]),
    ({"s2d_jax/io/a.py": "from . import b\n", "s2d_jax/io/b.py": "import s2d_jax.model.c\n",
      "s2d_jax/model/c.py": "def f():\n    from ..io.a import x\n"},
     ["s2d_jax/io/a.py:1 -> s2d_jax/io/b.py:1 -> s2d_jax/model/c.py:2 -> s2d_jax/io/a.py"]),
])
def test_cycle_checker_finds_a_planted_cycle(tmp_path, files, expect):
    clean = {"s2d_jax/__init__.py": "def f():\n    from s2d_jax.io import a\n",
             "s2d_jax/io/__init__.py": "", "s2d_jax/model/__init__.py": "",
             "s2d_jax/io/a.py": "from s2d_jax.io.b import f\n",
             "s2d_jax/io/b.py": "import os\nfrom s2d_jax import model\n\ndef f():\n    pass\n",
             "s2d_jax/model/c.py": "from s2d_jax.io import b\n"}
    root = _tree(tmp_path, clean)
    assert import_cycles(root) == []  # downward, lazy and package imports alone: no circle
    _tree(tmp_path, files)
    assert import_cycles(root) == expect


# --- commands (infer/, train/) call the library, not each other ----------------------------

COMMANDS = ("infer", "train")
SHARED_COMMAND_MODULES: set = set()  # (their shared parsing is s2d_jax/cli/args.py)


def command_imports(root: pathlib.Path) -> list[tuple[str, int, str]]:
    """(file, line, module) of every import of another command module by a command file
    (infer/*.py, train/*.py; infer.args excepted), including imports inside functions."""
    found = []
    for folder in COMMANDS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            own = ".".join(rel.with_suffix("").parts)
            tree = ast.parse(path.read_text(), filename=str(rel))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    # `from infer import bench` imports the module infer.bench
                    names = ([f"{node.module}.{a.name}" for a in node.names]
                             if node.module in COMMANDS else [node.module])
                else:  # a relative import stays inside its own command folder
                    names = [f"{folder}.<relative>"] if isinstance(node, ast.ImportFrom) else []
                for name in names:
                    if (name.split(".")[0] in COMMANDS and name != own
                            and name not in SHARED_COMMAND_MODULES):
                        found.append((rel.as_posix(), node.lineno, name))
    return found


def test_commands_do_not_import_each_other():
    """A command parses arguments, calls the library and prints: logic another command
    needs belongs in s2d_jax (not a command's main(argv) whose report is read back)."""
    problems = [f"{rel}:{line}: imports {name} (move what it needs into s2d_jax)"
                for rel, line, name in command_imports(ROOT)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("rel, text, expect", [
    ("infer/bad.py", "def f():\n    from infer import calibrate\n", "infer.calibrate"),
    ("train/bad.py", "import infer.bench\n", "infer.bench"),
    ("infer/bad.py", "from train.soft import main\n", "train.soft"),
])
def test_command_import_checker_names_each_violation(tmp_path, rel, text, expect):
    root = _tree(tmp_path, {"infer/ok.py": "from s2d_jax.cli.args import path_arg\nimport s2d_jax\n",
                            "train/ok.py": "from s2d_jax.cli import args\n"})
    assert command_imports(root) == []  # the shared argument helpers and the library pass
    _tree(tmp_path, {rel: text})
    assert [(r, name) for r, _, name in command_imports(root)] == [(rel, expect)]
