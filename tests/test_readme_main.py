"""The README's main command (its first line after `pip install ... &&`) runs S2D on the
committed demo family and prints the round statistics."""

import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_main_commands() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    block = text.split("## Two commands on a fresh machine", 1)[1].split("```bash", 1)[1]
    first_line = block.split("```", 1)[0].strip().splitlines()[0]
    parts = [p.strip() for p in first_line.split("&&")]
    assert parts[0].startswith("pip install -e"), parts[0]  # CI has installed already
    return parts[1:]


def test_readme_main_command_runs_s2d_on_the_committed_demo_family(tmp_path):
    cmds = readme_main_commands()
    assert cmds and all(c.startswith("python -m ") for c in cmds)
    for cmd in cmds:
        argv = shlex.split(cmd)
        assert "models/demo/draft" in argv  # the committed family, no download
        out = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True,
                             text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert out.returncode == 0, out.stderr[-2000:]
        assert "MAT" in out.stdout + out.stderr and "exits" in out.stdout + out.stderr
