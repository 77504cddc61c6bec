"""The README's architecture table lists every module of s2d_jax in its package's row: a new
module that is not listed (or a listed one that is gone) fails here."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def table_rows(readme: str) -> dict[str, set[str]]:
    """package dir ('' for s2d_jax/ itself) -> the `file` names in its row's last column."""
    rows = {}
    for line in readme.splitlines():
        m = re.match(r"\| (\d+) \| `(s2d_jax/|[a-z_]+/)`[^|]*\|(.*)\|\s*$", line)
        if m:
            package = "" if m.group(2) == "s2d_jax/" else m.group(2).rstrip("/")
            rows[package] = set(re.findall(r"`([\w.]+)`", m.group(3)))
    return rows


def modules_on_disk(root: pathlib.Path) -> dict[str, set[str]]:
    found = {}
    for path in sorted((root / "s2d_jax").rglob("*")):
        if path.suffix not in (".py", ".cc") or path.name == "__init__.py":
            continue
        package = path.parent.relative_to(root / "s2d_jax").as_posix()
        found.setdefault("" if package == "." else package, set()).add(path.name)
    return found


def test_every_module_is_in_the_readme_table_and_no_other():
    rows = table_rows((ROOT / "README.md").read_text(encoding="utf-8"))
    disk = modules_on_disk(ROOT)
    assert set(rows) == set(disk), f"packages: README {sorted(rows)}, disk {sorted(disk)}"
    problems = [f"{pkg or 's2d_jax'}: missing {sorted(disk[pkg] - rows[pkg])}, "
                f"gone {sorted(rows[pkg] - disk[pkg])}" for pkg in disk if rows[pkg] != disk[pkg]]
    assert not problems, "update README.md's architecture table: " + "; ".join(problems)


def test_the_check_notices_a_module_missing_from_the_table(tmp_path):
    (tmp_path / "s2d_jax" / "model").mkdir(parents=True)
    for name in ("errors.py", "model/params.py", "model/new_thing.py"):
        (tmp_path / "s2d_jax" / name).write_text("")
    readme = "| 0 | `s2d_jax/` base | `errors.py` |\n| 2 | `model/` the model | `params.py` |\n"
    disk, rows = modules_on_disk(tmp_path), table_rows(readme)
    assert rows == {"": {"errors.py"}, "model": {"params.py"}}
    assert disk["model"] - rows["model"] == {"new_thing.py"}
