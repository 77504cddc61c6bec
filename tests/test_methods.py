"""The one table of methods (s2d_jax/decode/methods.py): no module outside it compares a
method's name or restates a list of methods (it asks the table's named properties), each
default is defined once, and the table's rows say what each method needs."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from s2d_jax.decode.methods import METHODS, TABLE, methods_where, proposer
from s2d_jax.errors import S2DError

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLE_MODULE = "s2d_jax/decode/methods.py"
SCANNED = ("s2d_jax", "infer", "train")
NAMES = set(METHODS)

# (file, source line stripped): why a method's name must stay there. Empty: none must. (The
# bench's labels are parsed in one place, runner.kind_method; the AR run's label is
# methods.BASELINE.) An entry that no longer matches fails too.
ALLOWED: dict[tuple[str, str], str] = {}


def _is_name(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES


def _names_in(node) -> int:
    """How many method names a literal holds (a str, or a tuple / list / set of them)."""
    if _is_name(node):
        return 1
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return sum(_is_name(e) for e in node.elts)
    return 0


def method_name_uses(root: pathlib.Path) -> list[tuple[str, int, str]]:
    """(file, line, source line) of every comparison with a method's name (==, !=, in, not
    in) and every literal that restates two or more method names (a tuple, list, set or
    dict keys: a second table), outside the table module."""
    found = []
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == TABLE_MODULE:
                continue
            source = path.read_text()
            lines = source.splitlines()
            for node in ast.walk(ast.parse(source, filename=rel)):
                hit = False
                if isinstance(node, ast.Compare):
                    hit = any(_names_in(x) for x in [node.left, *node.comparators])
                elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                    hit = _names_in(node) >= 2
                elif isinstance(node, ast.Dict):
                    hit = sum(_is_name(k) for k in node.keys if k is not None) >= 2
                if hit:
                    found.append((rel, node.lineno, lines[node.lineno - 1].strip()))
    return sorted(set(found))


def test_no_method_name_is_compared_outside_the_table():
    found = method_name_uses(ROOT)
    unexplained = [f"{f}:{n}: {text}" for f, n, text in found if (f, text) not in ALLOWED]
    assert not unexplained, ("compare the table's named properties (decode/methods.py: "
                             "proposer(method).needs_draft, ...), not method names:\n"
                             + "\n".join(unexplained))
    stale = [k for k in ALLOWED if k not in {(f, text) for f, _, text in found}]
    assert not stale, f"allow-list entries that no longer match: {stale}"


def test_the_check_finds_each_kind_of_use(tmp_path):
    """It must be able to fail: each planted form is found, a table lookup is not."""
    pkg = tmp_path / "s2d_jax"
    pkg.mkdir()
    (pkg / "planted.py").write_text(
        'def f(method, kinds):\n'
        '    if method == "ar":\n'                       # 2
        '        pass\n'
        '    if method in ("sd", "self"):\n'             # 4
        '        pass\n'
        '    if "s2d" not in kinds:\n'                   # 6
        '        pass\n'
        '    order = ["ar", "sd", "s2d"]\n'              # 8
        '    exits = {"ar": (), "ladder": (1,)}\n'       # 9
        '    from s2d_jax.decode.methods import proposer\n'
        '    return proposer(method).needs_draft, order, exits\n')
    assert [n for _, n, _ in method_name_uses(tmp_path)] == [2, 4, 6, 8, 9]


def test_each_default_is_defined_once():
    """DEFAULT_GAMMA's value is not restated as a gamma default (`gamma ... = 4`,
    `--gamma ... default=4`) anywhere in the code."""
    restated = re.compile(r"gamma\w*\s*(:\s*int\s*)?=\s*4\b|\"--gamma\".*default=4\b")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if restated.search(line)]
    assert not found, "use methods.DEFAULT_GAMMA:\n" + "\n".join(found)


def test_the_table_rows():
    assert METHODS[0] == "ar" and not proposer("ar").proposes
    assert methods_where(needs_draft=True) == ("sd", "s2d", "ladder")
    assert methods_where(lookup=True) == ("lookup", "ladder")
    assert methods_where(single_exit=True) == ("sd", "self")
    assert [m for m, p in TABLE.items() if p.escalates] == ["s2d", "ladder"]
    assert [m for m, p in TABLE.items() if p.calibrated] == ["s2d", "lookup", "ladder"]
    assert proposer("ar").default_gamma == 0 and proposer("lookup").default_gamma == 4
    with pytest.raises(S2DError, match="unknown method 'medusa'; use one of ar, sd"):
        proposer("medusa")
