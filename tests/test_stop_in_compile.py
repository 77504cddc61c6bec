"""SIGTERM / Ctrl-C end a CLI within seconds even inside an XLA compile (errors.cli_main
exits at once after a real signal): Python runs a signal's handler on the main thread between bytecodes only, so
without it a stop waits for the compile to finish (tens of seconds for SmolLM2 here)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from s2d_jax.errors import HARD_STOP_S

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# prints COMPILING as XLA starts each compile (a Lowered's .compile), then runs the code
_HOOK = """
import sys, jax.stages
_compile = jax.stages.Lowered.compile
def compile(self, *a, **k):
    print("COMPILING", file=sys.stderr, flush=True)
    return _compile(self, *a, **k)
jax.stages.Lowered.compile = compile
"""


def _stop_at_compile(code: str, sig, tmp_path) -> tuple[int, str, float]:
    """Run `code` (after _HOOK), send `sig` at its first compile -> (rc, stderr, seconds
    from the signal to the exit)."""
    env = {**os.environ, "S2D_COMPILE_CACHE": str(tmp_path / "xla")}  # empty: compiles
    # SIGINT at its default in the child: a shell's background job (CI run with `&`) starts
    # with it ignored, and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen([sys.executable, "-c", _HOOK + code], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("COMPILING"):
            break
    time.sleep(0.3)  # inside XLA by now
    proc.send_signal(sig)
    sent = time.perf_counter()
    rest = proc.stderr.read()
    proc.wait(timeout=120)
    return proc.returncode, "".join(lines) + rest, time.perf_counter() - sent


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_stop_inside_a_long_compile_ends_the_cli_within_seconds(tmp_path, sig):
    # 600 chained matmuls: ~45 s of XLA compile on a loaded 2-core machine, >5 s on any
    code = """
import jax, jax.numpy as jnp
from s2d_jax.errors import cli_main
@cli_main
def main(argv=None):
    def f(x):
        for i in range(600):
            x = jnp.sin(x) @ x + i
        return x
    jax.jit(f).lower(jnp.ones((8, 8))).compile()
main()
"""
    rc, err, took = _stop_at_compile(code, sig, tmp_path)
    # (jaxlib lets the signal unwind its compile; XLA's threads compile on, and exiting
    # beside them segfaulted: -11)
    assert rc == 130, err[-2000:]
    assert sum(line.startswith("error: interrupted") for line in err.splitlines()) == 1, err
    assert took < HARD_STOP_S + 3, took


def test_sigterm_during_generates_compile_ends_it(tmp_path):
    code = """
from infer.generate import main
main(["--target", "models/demo/target-l", "--draft", "models/demo/draft", "--method", "s2d",
      "--prompt", "ROMEO:", "--max-new-tokens", "8"])
"""
    rc, err, took = _stop_at_compile(code, signal.SIGTERM, tmp_path)
    assert rc == 130, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith(("error:", "\nerror:"))
              or "error: interrupted" in line]
    assert len(errors) == 1 and "interrupted" in errors[0], err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert took < HARD_STOP_S + 3, took
