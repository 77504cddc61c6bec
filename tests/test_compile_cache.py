"""The persistent compilation cache (s2d_jax/compile_cache.py): a second process reads a
program from disk without compiling it, a changed setting compiles anew, and programs are
kept apart per machine and jaxlib version; `s2d cache` reports and clears it."""

import json
import os
import subprocess
import sys

import pytest

from s2d_jax import compile_cache
from s2d_jax.errors import S2DError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# one process: import s2d_jax (which turns the cache on), compile a program, report what
# JAX's cache did (its own monitoring events) and which folder it used
PROBE = """
import json, sys
import s2d_jax
import jax, jax.numpy as jnp
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
f = jax.jit(lambda x: jnp.tanh(x @ x.T) * float(sys.argv[1]))
f(jnp.ones((32, 32))).block_until_ready()
print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses"),
                  "dir": jax.config.jax_compilation_cache_dir}))
"""


def _probe(cache, scale="2.0", xla_flags=None):
    env = {**os.environ, "S2D_COMPILE_CACHE": str(cache), "PYTHONPATH": ROOT}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    out = subprocess.run([sys.executable, "-c", PROBE, scale], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _programs(cache):
    return sorted(name for _, _, names in os.walk(cache) for name in names
                  if "jit__lambda" in name)


def test_a_second_process_reads_the_program_and_a_changed_setting_compiles_anew(tmp_path):
    cache = tmp_path / "xla"
    first = _probe(cache)
    assert first["misses"] >= 1 and first["hits"] == 0, first
    assert first["dir"] == os.path.join(str(cache), compile_cache.machine_key())
    written = _programs(cache)
    assert len(written) == 1, written

    again = _probe(cache)
    assert again["misses"] == 0 and again["hits"] >= 1, again  # read, not compiled
    assert _programs(cache) == written

    # another program (a constant changed) and other XLA flags: JAX's key differs
    other = _probe(cache, scale="3.0")
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true"
    changed = _probe(cache, xla_flags=flags)
    assert other["misses"] == 1, other  # only the changed program (ones(): read again)
    assert changed["misses"] >= 1 and changed["hits"] == 0, changed
    assert len(_programs(cache)) == 3


def test_the_cache_is_off_with_0(tmp_path):
    env = {**os.environ, "S2D_COMPILE_CACHE": "0", "PYTHONPATH": ROOT}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", PROBE, "2.0"], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1])["dir"] is None


def test_another_jaxlib_or_machine_gets_its_own_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("S2D_COMPILE_CACHE", str(tmp_path))
    here = compile_cache.program_dir()
    assert os.path.dirname(here) == str(tmp_path)
    monkeypatch.setattr(compile_cache.importlib.metadata, "version", lambda _: "0.0.1")
    assert compile_cache.program_dir() != here
    monkeypatch.undo()
    monkeypatch.setenv("S2D_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setattr(compile_cache.platform, "processor", lambda: "another-cpu")
    assert compile_cache.program_dir() != here


@pytest.mark.parametrize("value, message", [("relative/dir", "absolute path"),
                                            ("", "absolute path")])
def test_a_bad_setting_is_one_error(monkeypatch, value, message):
    monkeypatch.setenv("S2D_COMPILE_CACHE", value)
    with pytest.raises(S2DError, match=message):
        compile_cache.cache_dir()
    assert compile_cache.enable() is None  # the commands run on, uncached


def test_s2d_cache_reports_and_clears(tmp_path, monkeypatch, capsys):
    from s2d_jax.cli.main import main
    monkeypatch.setenv("S2D_COMPILE_CACHE", str(tmp_path))
    folder = tmp_path / compile_cache.machine_key()
    folder.mkdir()
    (folder / "jit_f-abc-cache").write_bytes(b"x" * 2048)
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path}: 1 files" in out and compile_cache.machine_key() in out, out
    assert main(["cache", "--clear"]) == 0
    assert "cleared" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []
    monkeypatch.setenv("S2D_COMPILE_CACHE", "off")
    assert main(["cache"]) == 0
    assert "off" in capsys.readouterr().out
