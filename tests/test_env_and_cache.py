"""What the project reads from the environment and its cache is checked like a flag (issue
41): S2D_JAX_CACHE set but empty, holding an unexpanded $VAR, relative or a file, and
S2D_SMALL_MATMUL with a value that is neither on nor off, are one error line (exit 2) and
create nothing; `~` in S2D_JAX_CACHE is expanded; S2D_SMALL_MATMUL=off turns the kernels
off; a truncated kernel library in the cache is rebuilt instead of crashing the process
with SIGBUS."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from s2d_jax import env
from s2d_jax.errors import S2DError
from test_cli_fuzz import REPO, check_one_error, snapshot

GENERATE = [sys.executable, "-m", "s2d_jax.cli.main", "generate", "--target",
            os.path.join(REPO, "models", "demo", "target-s"), "--method", "ar", "--prompt", "hi",
            "--max-new-tokens", "2", "--chat-template", "none"]


def _run(cmd, env_over, cwd):
    e = {**os.environ, **env_over}
    return subprocess.run(cmd, env=e, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value,keyword", [("", "set but empty"),
                                           ("$S2D_NO_SUCH_VAR/cache", "unexpanded $VAR"),
                                           ("relative/cache", "relative path"),
                                           ("FILE", "is a file")])
def test_a_bad_cache_root_is_refused_by_the_library(tmp_path, monkeypatch, value, keyword):
    (tmp_path / "FILE").write_text("x")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("S2D_NO_SUCH_VAR", raising=False)
    monkeypatch.setenv("S2D_JAX_CACHE", str(tmp_path / value) if value == "FILE" else value)
    with pytest.raises(S2DError, match=keyword.replace("$", r"\$")):
        env.cache_root()
    assert sorted(os.listdir(tmp_path)) == ["FILE"]  # no ./kernels, no ./~


def test_a_tilde_is_expanded_not_made_a_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("S2D_JAX_CACHE", "~/cache")
    assert env.cache_root() == str(tmp_path / "home" / "cache")
    assert env.smollm2_dir() == str(tmp_path / "home" / "cache" / env.SMOLLM2_NAME)
    assert not os.path.exists(tmp_path / "~")


@pytest.mark.parametrize("value,on", [("1", True), ("on", True), ("TRUE", True), ("0", False),
                                      ("off", False), ("No", False)])
def test_small_matmul_switch_reads_every_spelling(monkeypatch, value, on):
    monkeypatch.setenv("S2D_SMALL_MATMUL", value)
    assert env.small_matmul_enabled() is on


# one CLI run in the fast set: the reader's every refusal is checked in-process above (CI time)
@pytest.mark.parametrize("over,keyword", [
    ({"S2D_SMALL_MATMUL": "maybe"}, "S2D_SMALL_MATMUL"),
    pytest.param({"S2D_JAX_CACHE": ""}, "set but empty", marks=pytest.mark.slow),
    pytest.param({"S2D_JAX_CACHE": "rel/x"}, "relative path", marks=pytest.mark.slow)])
def test_a_cli_run_with_a_bad_variable_is_one_error_line(tmp_path, over, keyword):
    before = snapshot(tmp_path)
    r = _run(GENERATE, over, tmp_path)
    check_one_error(r.returncode, r.stderr, [keyword])
    assert snapshot(tmp_path) == before


def test_the_engine_default_target_reads_the_checked_root(tmp_path):
    r = _run([sys.executable, "-m", "s2d_jax.cli.main", "data-engine", "--work",
              str(tmp_path / "w")],
             {"S2D_JAX_CACHE": "$S2D_NO_SUCH_VAR/x"}, REPO)
    check_one_error(r.returncode, r.stderr, ["S2D_JAX_CACHE", "unexpanded"])
    assert not os.path.exists(tmp_path / "w")


def test_a_truncated_kernel_library_is_rebuilt_not_loaded(tmp_path):
    """An interrupted copy of the cache leaves a short library next to its checksum: the
    next decode notices, rebuilds (here with a stand-in compiler that copies the intact
    library, to keep the test fast) and decodes with the kernel."""
    from s2d_jax.model import small_matmul
    real = small_matmul.build()  # the intact library, in the user's cache
    cache = tmp_path / "cache"
    kernels = cache / "kernels"
    kernels.mkdir(parents=True)
    name = os.path.basename(real)
    shutil.copy(real, kernels / name)
    shutil.copy(real + ".sha256", kernels / (name + ".sha256"))
    with open(kernels / name, "r+b") as f:  # the copy stopped half-way
        f.truncate(os.path.getsize(real) // 3)
    fake_cxx = tmp_path / "cxx"
    fake_cxx.write_text(f"#!/bin/sh\n# the last two arguments are -o OUT\nfor a; do out=$a; "
                        f"done\ncp {real} \"$out\"\n")
    fake_cxx.chmod(0o755)
    code = ("from s2d_jax.model import small_matmul as m; import jax.numpy as jnp;"
            "import s2d_jax.model.small_matmul as sm; print(m.built());"
            "x = jnp.ones((2, 8)); w = jnp.ones((8, 16));"
            "print(float(sm.matmul(x, w, 'kn', 1).sum()))")
    r = _run([sys.executable, "-c", code], {"S2D_JAX_CACHE": str(cache), "CXX": str(fake_cxx),
                                             "JAX_PLATFORMS": "cpu"}, REPO)
    assert r.returncode == 0, r.stderr[-2000:]  # no SIGBUS (-7)
    assert "does not match its checksum" in r.stderr and "rebuilding" in r.stderr
    assert r.stdout.split() == ["True", "256.0"], r.stdout
    assert os.path.getsize(kernels / name) == os.path.getsize(real)


@pytest.mark.parametrize("flags,value,default_on", [({"avx2", "fma"}, None, False),
                                                    ({"avx2", "avx512f"}, None, True),
                                                    ({"avx2", "fma"}, "1", True),
                                                    ({"avx2", "avx512f"}, "0", False)])
def test_the_cpu_kernels_are_the_default_only_where_they_pay(monkeypatch, flags, value, default_on):
    """Unset, S2D_SMALL_MATMUL leaves the decode path on XLA's dots on a CPU without AVX-512
    (the kernels measured slower there); set on, it forces them; set off, never."""
    from s2d_jax.model import small_matmul
    monkeypatch.setattr(small_matmul, "cpu_flags", lambda: set(flags))
    if value is None:
        monkeypatch.delenv("S2D_SMALL_MATMUL", raising=False)
    else:
        monkeypatch.setenv("S2D_SMALL_MATMUL", value)
    small_matmul.preferred.cache_clear()
    small_matmul._load.cache_clear()
    try:
        reason = small_matmul.preferred()
        assert (reason is None) == (default_on or value == "0"), reason
        if small_matmul.built() and value != "0":
            assert small_matmul.usable(2) is default_on
            with small_matmul.forced():
                assert small_matmul.usable(2)
        if value == "0":
            assert not small_matmul.usable(2) and not small_matmul.built()
    finally:
        small_matmul.preferred.cache_clear()
        small_matmul._load.cache_clear()


def test_libtpu_kept_apart_is_found_and_a_wrong_path_is_one_error(monkeypatch, tmp_path):
    """S2D_LIBTPU_PATH (.ci/run's libtpu outside the environment) becomes the compiler's
    TPU_LIBRARY_PATH for --topology; naming no file is one error and sets nothing."""
    from s2d_jax.errors import S2DError
    from s2d_jax.parallel import topology
    # set, then deleted: monkeypatch then removes what prepare() sets (a delenv of an unset
    # name records nothing, and later tests' children would compile with the empty file)
    monkeypatch.setenv("TPU_LIBRARY_PATH", "")
    monkeypatch.delenv("TPU_LIBRARY_PATH")
    monkeypatch.setenv("S2D_LIBTPU_PATH", str(tmp_path / "missing.so"))
    with pytest.raises(S2DError, match="S2D_LIBTPU_PATH=.* is no file"):
        topology.prepare("v5e:2x2")
    assert "TPU_LIBRARY_PATH" not in os.environ
    lib = tmp_path / "libtpu.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("S2D_LIBTPU_PATH", str(lib))
    for name in ("TPU_SKIP_MDS_QUERY", "TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS",
                 "ALLOW_MULTIPLE_LIBTPU_LOAD"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after the test
    topology.prepare("v5e:2x2")
    assert os.environ["TPU_LIBRARY_PATH"] == str(lib)
