"""The small-matmul CPU kernel (s2d_jax/model/small_matmul.cc): each row computed the same
way whatever the row count (bitwise), equal to a float64 reference within float32
rounding, layer picked from a stack in place, used on the decode path, and a clear
fallback to XLA's dots where it cannot be built."""

import os
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.config import ModelConfig
from s2d_jax.model import small_matmul
from s2d_jax.model import transformer as model
from s2d_jax.model.kvcache import init_cache

pytestmark = pytest.mark.skipif(not small_matmul.built(),
                                reason="kernel not built here: " + small_matmul.status())


@pytest.fixture(autouse=True)
def _kernel_on_any_cpu():
    """The decode path takes the kernels by default only with AVX-512 (preferred()); here
    they are tested wherever they are built."""
    with small_matmul.forced():
        yield


def _weights(layout, dtype, L=3, K=70, N=83, seed=0):
    # K, N not multiples of the kernel's 16/32-wide tiles: the tails are exercised too
    rng = np.random.default_rng(seed)
    shape = (L, K, N) if layout == "kn" else (L, N, K)
    return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


def _reference(x, w, layout, layer):
    w = np.asarray(w[layer].astype(jnp.float32), np.float64)
    return np.asarray(x, np.float64) @ (w if layout == "kn" else w.T)


@pytest.mark.parametrize("dtype,K,N", [(jnp.float32, 70, 83), (jnp.bfloat16, 70, 83),
                                       (jnp.float32, 90, 83), (jnp.float32, 70, 48),
                                       (jnp.bfloat16, 70, 48)])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_rows_are_bitwise_independent_of_the_row_count(layout, dtype, K, N):
    # K = 90: "nk" sums two 32-wide chunks, a 16-wide one and a scalar tail. N = 48: "kn"
    # sums every column in the scalar tail at 1-4 rows (64-wide tiles) and 32 of them in a
    # vector tile at 5-8 rows: equal only if both fuse their multiply-adds alike (on AMD
    # Zen 4, GCC fused the tile's and not the tail's until the kernels made it explicit)
    w = _weights(layout, dtype, K=K, N=N)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((20, K), np.float32))
    call = jax.jit(lambda x, w, i: small_matmul.matmul(
        x, small_matmul.StackedWeight(w, i), layout, 1))
    alone = np.stack([np.asarray(call(x[r:r + 1], w, 2))[0] for r in range(20)])
    for m in list(range(1, 9)) + [13, 20]:  # one pass over the weights up to 8 rows, then more
        out = np.asarray(call(x[:m], w, 2))
        assert out.dtype == np.float32 and out.shape == (m, N)
        np.testing.assert_array_equal(out, alone[:m], err_msg=f"M={m}")
    ref = _reference(x, w, layout, 2)
    assert np.abs(alone - ref).max() <= 1e-5 * np.abs(ref).max() * K ** 0.5


def test_multi_axis_contraction_and_plain_weights():
    """wo [N, H, D] contracted over two axes; a plain (unstacked) weight is layer 0."""
    rng = np.random.default_rng(2)
    wo = jnp.asarray(rng.standard_normal((4, 3, 5, 16), np.float32))  # [L, N, H, D]
    attn = jnp.asarray(rng.standard_normal((2, 3, 3, 5), np.float32))  # [B, T, N, H]
    out = small_matmul.matmul(attn, small_matmul.StackedWeight(wo, jnp.int32(1)), "kn", 2)
    np.testing.assert_allclose(out, jnp.einsum("BTNH,NHD->BTD", attn, wo[1]), rtol=1e-5, atol=1e-5)
    plain = small_matmul.matmul(attn, wo[3], "kn", 2)
    np.testing.assert_allclose(plain, jnp.einsum("BTNH,NHD->BTD", attn, wo[3]), rtol=1e-5, atol=1e-5)


def _tiny(tie):
    return ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=tie,
                       dtype="float32", param_dtype="float32")


@pytest.mark.parametrize("tie", [True, False])
def test_decode_forward_uses_the_kernel_and_matches_xla(tie):
    cfg = _tiny(tie)
    params = model.init_params(cfg, jax.random.key(0))
    toks = jnp.array([[5, 17, 42, 7]], jnp.int32)
    pos = jnp.arange(4, dtype=jnp.int32)[None] + 3

    def step(p, c):
        return model.forward(p, cfg, toks, pos, c)[0]

    cache = init_cache(cfg, 1, 32)
    hlo = jax.jit(step).lower(params, cache).as_text()
    assert hlo.count("s2d_small_matmul_kn") >= 1  # the layer scan's projections
    assert ("s2d_small_matmul_nk" in hlo) == tie  # a tied head reads the embedding as [V, D]
    with small_matmul.disabled():
        xla_hlo = jax.jit(lambda p, c: step(p, c)).lower(params, cache).as_text()
        xla = jax.jit(lambda p, c: step(p, c))(params, cache)
    assert "s2d_small_matmul" not in xla_hlo
    np.testing.assert_allclose(jax.jit(step)(params, cache), xla, rtol=1e-4, atol=1e-4)
    # training (no cache) never takes the kernel: it has no gradient
    assert "s2d_small_matmul" not in jax.jit(lambda p: model.forward(p, cfg, toks)[0]).lower(params).as_text()


def test_fallback_without_a_compiler_says_so_and_decodes(tmp_path):
    code = (
        "import jax, jax.numpy as jnp\n"
        "from s2d_jax.config import ModelConfig\n"
        "from s2d_jax.model import small_matmul, transformer as model\n"
        "from s2d_jax.model.kvcache import init_cache\n"
        "cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,"
        " num_heads=2, num_kv_heads=1, head_dim=16, dtype='float32', param_dtype='float32')\n"
        "p = model.init_params(cfg, jax.random.key(0))\n"
        "f = jax.jit(lambda p, c: model.forward(p, cfg, jnp.ones((1, 2), jnp.int32), None, c)[0])\n"
        "assert 's2d_small_matmul' not in f.lower(p, init_cache(cfg, 1, 8)).as_text()\n"
        "print(f(p, init_cache(cfg, 1, 8)).shape, small_matmul.status())\n")
    env = dict(os.environ, S2D_JAX_CACHE=str(tmp_path), CXX=str(tmp_path / "no-such-compiler"))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "(1, 2, 64) XLA dots (kernel not built" in run.stdout
    assert run.stderr.count("note: the small-matmul CPU kernel is not built") == 1
    assert not list(tmp_path.rglob("*.so"))  # no half-built library left


def test_int8_weight_only_matches_its_dequantized_weight():
    """A per-channel int8 weight (quantize 'int8'): int8 read by the kernel, scaled after."""
    from s2d_jax.model.quantize import quantize_weight

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((3, 40, 6, 8), np.float32))  # [L, D, N, H] like wq
    qw = quantize_weight(w, 1, bits=8, n_lead=1)
    x = jnp.asarray(rng.standard_normal((1, 5, 40), np.float32))
    call = jax.jit(lambda x, qw, i: small_matmul.matmul(x, small_matmul.StackedWeight(qw, i), "kn", 1))
    out = call(x, qw, jnp.int32(2))
    assert out.shape == (1, 5, 6, 8) and small_matmul.serves(qw)
    ref = jnp.einsum("BTD,DNH->BTNH", x, qw.astype(jnp.float32)[2])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(call(x[:, :1], qw, jnp.int32(2))), np.asarray(out[:, :1]))
    assert not small_matmul.serves(quantize_weight(w, 1, bits=8, n_lead=1, act_bits=8))  # w8a8


V3_ADDS = "avx512f" in small_matmul.cpu_flags()


@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("g++"),
                    reason="x86-64 instruction-set levels, built with g++")
# the SSE2 baseline build is slow (CI time); x86-64-v3 (AVX2, FMA) checks the same rows. On a
# CPU without AVX-512 the native build is the AVX2 one, whose rows this run's own tests check,
# so the v3 build is in the slow set there too (CI time: 34 s on a Zen 3)
@pytest.mark.parametrize("march", [pytest.param("x86-64-v3", marks=() if V3_ADDS else pytest.mark.slow),
                                   pytest.param("x86-64", marks=pytest.mark.slow)])
def test_rows_stay_bitwise_when_built_for_older_cpus(tmp_path, march):
    """The kernels as -march=native builds them on an AVX2 CPU (x86-64-v3: FMA, 16 lanes as
    two 8-lane halves) and on one without FMA (x86-64: unfused multiply-adds, 4 x 4 lanes):
    the row tests of both kernels pass on each build (run here, a subset of this CPU)."""
    cxx = tmp_path / "cxx"  # the same command with the older level last (the last -march wins)
    cxx.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} "$@" -march={march}\n')
    cxx.chmod(0o755)
    env = dict(os.environ, S2D_JAX_CACHE=str(tmp_path / "cache"), CXX=str(cxx))
    tests = ["tests/test_small_matmul.py::test_rows_are_bitwise_independent_of_the_row_count",
             "tests/test_cpu_attention.py::test_each_row_is_bitwise_independent_of_the_rows_sharing_the_call",
             "tests/test_cpu_attention.py::test_uneven_row_groups_match_xla"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "12 passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-500:]
    assert len(list((tmp_path / "cache").rglob("*.so"))) == 1  # built here, with the override
