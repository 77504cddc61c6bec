"""Deviceless H100 compiles in a child process: JAX's CUDA plugin (jax-cuda12-plugin and
-pjrt, no CUDA libraries, no GPU) installed either in the environment or, as .ci/run does,
in a folder of its own named by S2D_CUDA_PLUGIN_PATH (in the environment every CLI would
print the plugin's CUDA warnings)."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_DIR = os.environ.get("S2D_CUDA_PLUGIN_PATH", "")


def _in_environment() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def available() -> bool:
    return _in_environment() or os.path.isdir(os.path.join(PLUGIN_DIR, "jax_plugins",
                                                           "xla_cuda12"))


needs_plugin = pytest.mark.skipif(
    not available(), reason="JAX's CUDA plugin is not installed (bash .ci/run installs it in "
                            "~/.cache/s2d-jax; or pip install --no-deps jax-cuda12-plugin "
                            "jax-cuda12-pjrt of jax's version: no GPU needed)")


def run(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that sees the plugin; asserts it exited 0."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if PLUGIN_DIR and not _in_environment():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PLUGIN_DIR, ROOT,
                                                        env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
