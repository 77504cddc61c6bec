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


# --- whole executables (compile_cache.compiled): a second start neither traces nor compiles

# one process: a streamed greedy decode of the demo target (Decoder.generate ->
# serving.run_streamed -> compile_cache.compiled), reporting the executables it read or
# wrote and which of the decode functions JAX traced
DECODE = """
import json, sys
import s2d_jax
import jax
from s2d_jax import compile_cache
traced = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: traced.append(kw.get("fun_name")) if name.endswith("trace_duration") else None)
cfg, params, _ = s2d_jax.load_model(sys.argv[1])
dec = s2d_jax.Decoder(cfg, params, method=sys.argv[3])
out = dec.generate([[1, 5, 9, 12]], max_new_tokens=int(sys.argv[2]), chunk_rounds=2,
                   on_chunk=lambda s: None)
print(json.dumps({**compile_cache._stats, "ids": out[0]["token_ids"],
                  "traced": [f for f in traced if f in ("_prefill", "_decode_loop", "_split_draft")]}))
"""


def _decode(cache, method="ar"):
    env = {**os.environ, "S2D_COMPILE_CACHE": str(cache), "PYTHONPATH": ROOT}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", DECODE, os.path.join(ROOT, "models", "demo",
                          "target-s"), "6", method], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_start_reads_the_executables_without_tracing_and_a_change_compiles(tmp_path):
    cache = tmp_path / "xla"
    first = _decode(cache)
    assert first["misses"] == 3 and first["hits"] == 0, first  # prefill, split, chunk
    assert set(first["traced"]) >= {"_prefill", "_decode_loop"}, first
    folder = cache / compile_cache.machine_key() / compile_cache.EXECUTABLES
    assert len(os.listdir(folder)) == 3

    again = _decode(cache)
    assert again["hits"] == 3 and again["misses"] == 0, again
    assert again["traced"] == [], again  # nothing traced, nothing lowered or compiled
    assert again["ids"] == first["ids"]  # the same program's tokens

    other = _decode(cache, method="lookup")  # another setting: another chain, compiled anew
    assert other["misses"] >= 1 and other["ids"] == first["ids"], other  # lossless

    for name in os.listdir(folder):  # a damaged entry is compiled anew, not trusted
        (folder / name).write_bytes(b"not an executable")
    damaged = _decode(cache)
    assert damaged["misses"] == 3 and damaged["ids"] == first["ids"], damaged


def test_the_key_changes_with_everything_that_changes_the_program(monkeypatch):
    import functools

    import jax
    import jax.numpy as jnp

    from s2d_jax.model import small_matmul

    @functools.partial(jax.jit, static_argnames=("k",))
    def f(x, *, k):
        return x * k

    x = jnp.ones((4, 3), jnp.float32)
    key = compile_cache.executable_key(f, (x,), {"k": 2})
    assert key == compile_cache.executable_key(f, (jnp.zeros((4, 3)),), {"k": 2})  # values: no
    changed = [compile_cache.executable_key(f, (x,), {"k": 3}),             # a static argument
               compile_cache.executable_key(f, (jnp.ones((4, 4)),), {"k": 2}),  # a shape
               compile_cache.executable_key(f, (x.astype(jnp.bfloat16),), {"k": 2})]  # a dtype
    with small_matmul.disabled():  # the CPU kernels' choice a decode program is traced under
        changed.append(compile_cache.executable_key(f, (x,), {"k": 2}))
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
    changed.append(compile_cache.executable_key(f, (x,), {"k": 2}))
    monkeypatch.undo()
    monkeypatch.setattr(compile_cache, "_SOURCE", ["another source"])  # this package's code
    changed.append(compile_cache.executable_key(f, (x,), {"k": 2}))
    monkeypatch.undo()
    precision = "bfloat16" if jax.config.jax_default_matmul_precision != "bfloat16" else "highest"
    with jax.default_matmul_precision(precision):  # JAX's trace-time settings
        changed.append(compile_cache.executable_key(f, (x,), {"k": 2}))
    assert [c == key for c in changed] == [False] * len(changed)
    assert len(set(changed)) == len(changed), changed
    assert compile_cache.executable_key(f, (x,), {"k": 2}) == key


def test_the_trace_state_it_keys_on_exists():
    # a renamed scope variable would silently leave the key: name them here
    import importlib
    for module, names in compile_cache.TRACE_STATE.items():
        mod = importlib.import_module(module)
        for name in names:
            assert hasattr(mod, name), (module, name)
    for module, name in compile_cache.FFI_PROVIDERS.values():
        assert callable(getattr(importlib.import_module(module), name))


def test_executables_follow_the_cache_setting(tmp_path, monkeypatch):
    import jax
    import jax.numpy as jnp
    f = jax.jit(lambda x: x + 1)
    monkeypatch.setenv("S2D_COMPILE_CACHE", "0")
    assert compile_cache.compiled(f, jnp.ones(3))(jnp.ones(3)).tolist() == [2.0] * 3
    monkeypatch.setenv("S2D_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "users"))  # the user's own
    compile_cache.compiled(f, jnp.ones(3))
    assert not os.path.exists(tmp_path / compile_cache.machine_key() / compile_cache.EXECUTABLES)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    first = compile_cache.compiled(f, jnp.ones(3))
    assert len(os.listdir(tmp_path / compile_cache.machine_key() / compile_cache.EXECUTABLES)) == 1
    assert compile_cache.compiled(f, jnp.zeros(3)) is first  # a later call: no disk read
    monkeypatch.setenv("S2D_COMPILE_CACHE", str(tmp_path / "other"))  # another folder: its own
    assert compile_cache.compiled(f, jnp.ones(3)) is not first
    assert len(os.listdir(tmp_path / "other" / compile_cache.machine_key()
                          / compile_cache.EXECUTABLES)) == 1


def test_an_executable_failing_at_its_first_dispatch_is_compiled_anew(tmp_path, monkeypatch):
    """XLA:CPU once loaded an executable that failed at dispatch ("Function wrapped_slice
    not found"): that call compiles the program anew and runs it, and drops the entry."""
    import jax
    import jax.numpy as jnp
    monkeypatch.setenv("S2D_COMPILE_CACHE", str(tmp_path))
    f = jax.jit(lambda x: x * 2)
    compile_cache.compiled(f, jnp.ones(3))  # written
    folder = tmp_path / compile_cache.machine_key() / compile_cache.EXECUTABLES
    assert len(os.listdir(folder)) == 1
    compile_cache._LOADED.clear()

    class Broken:
        def __call__(self, *a):
            raise RuntimeError("INTERNAL: Error dispatching computation: Function "
                               "wrapped_slice.3 not found (type id: 1)")

    monkeypatch.setattr(compile_cache, "_read_executable", lambda path: Broken())
    run = compile_cache.compiled(f, jnp.ones(3))
    assert run(jnp.arange(3.0)).tolist() == [0.0, 2.0, 4.0]
    assert os.listdir(folder) == []  # the bad entry is gone; the next process writes one
    assert run(jnp.ones(3)).tolist() == [2.0] * 3
    other = compile_cache._Checked(Broken(), str(folder / "x"), lambda: None)
    other._exe = type("Fails", (), {"__call__": lambda self, *a: 1 / 0})()
    with pytest.raises(ZeroDivisionError):  # any other error is the program's own
        other(jnp.ones(3))

