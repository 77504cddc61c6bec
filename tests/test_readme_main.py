"""The README's main command (its first line after `pip install ... &&`): it fetches the real
model and runs S2D on it with the committed draft pack. The default run never downloads:
it checks the command's shape and runs the README's offline demo command; the slow test
runs the real command's generation when the model has been fetched."""

import os
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_text() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read().split("## Two commands on a fresh machine", 1)[1]


def readme_main_commands() -> list[str]:
    block = readme_text().split("```bash", 1)[1]
    first_line = block.split("```", 1)[0].strip().splitlines()[0]
    parts = [p.strip() for p in first_line.split("&&")]
    assert parts[0].startswith("pip install -e"), parts[0]  # CI has installed already
    return parts[1:]


def run_cli(argv: list[str]) -> str:
    argv = [os.path.expanduser(a) for a in argv]  # as the shell expands ~/...
    out = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True,
                         text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout + out.stderr


def test_readme_main_command_fetches_then_runs_s2d_with_the_committed_draft():
    fetch, generate = readme_main_commands()
    assert fetch == "python -m infer.fetch_smollm2"
    argv = shlex.split(generate)
    assert argv[:3] == ["python", "-m", "infer.generate"] and "s2d" in argv
    from s2d_jax.env import resolve_model
    draft = resolve_model(argv[argv.index("--draft") + 1])  # a name, found from any directory
    assert os.path.isfile(os.path.join(draft, "s2d_draft_pack.json"))  # the committed pack
    assert os.path.samefile(draft, os.path.join(ROOT, "models", "smollm2-draft"))


def test_readme_is_short():
    """The README stays a front page (issue 44): detail goes to docs/."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 120


def test_readme_offline_demo_command_runs_s2d_on_the_committed_demo_family():
    line = readme_text().split("Offline, the demo family runs the same machinery:", 1)[1]
    argv = shlex.split(line.split("`", 2)[1])
    assert "models/demo/draft" in argv  # the committed family, no download
    text = run_cli(argv)
    assert " tokens per call" in text and "drafted " in text


@pytest.mark.slow
def test_readme_main_command_runs_s2d_on_the_real_model():
    from infer.fetch_smollm2 import model_paths

    if not os.path.isfile(os.path.join(model_paths()[1], "config.json")):
        pytest.skip("SmolLM2-135M-Instruct not fetched; run python -m infer.fetch_smollm2")
    text = run_cli(shlex.split(readme_main_commands()[1]))
    assert " tokens per call" in text and "drafted " in text
