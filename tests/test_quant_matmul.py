"""The block-quantized small matmul with float32 activations (s2d_jax/model/quant_matmul.cc):
for the Q8_0, Q4_0 and Q4_1 layouts of quantize.QuantizedWeight, the kernel reading the
quantized layer in place equals dequantize-then-matmul, each row bitwise whatever the row
count, a planted wrong scale is caught by the same comparison, and a quantized model decodes
through it. (The int8-activation kernel, the default on AVX-512 VNNI CPUs, has
tests/test_quant_dot8.py.)"""

import dataclasses
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
from s2d_jax.bench.ggml_quantize import FORMATS, quantize_blocks, quantize_model

pytestmark = pytest.mark.skipif(not small_matmul.built(),
                                reason="kernel not built here: " + small_matmul.status())


@pytest.fixture(autouse=True)
def _kernel_on_any_cpu():
    with small_matmul.forced(), small_matmul.quant_activations("float"):
        yield


def _weight(fmt, L=3, K=96, N=211, seed=0, group=32):
    # N = 211: tiles of 128, 64, 32 and 16 columns and a 3-column scalar tail, mixed
    # differently at each row count (the widest tile narrows with the rows), so that every
    # path meets every other in some row
    w = np.random.default_rng(seed).standard_normal((L, K, N)).astype(np.float32)
    return quantize_blocks(w, 1, fmt, group, n_lead=1)


def _call():
    return jax.jit(lambda x, w, i: small_matmul.matmul(
        x, small_matmul.StackedWeight(w, i), "kn", 1))


def _dequantized_matmul(x, w, layer):
    """The reference: the weight dequantized (astype), then a float64 matmul."""
    deq = np.asarray(w.astype(jnp.float32)[layer], np.float64)
    return np.asarray(x, np.float64) @ deq


def _close(out, ref, K):
    """Float32 rounding of a K-long sum of the same float32 products."""
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6 * np.abs(ref).max() * K ** 0.5)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kernel_equals_dequantize_then_matmul_bitwise_per_row(fmt):
    w = _weight(fmt)
    assert small_matmul.serves(w) and small_matmul.serves(small_matmul.StackedWeight(w, 0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((11, 96), np.float32))
    call = _call()
    alone = np.stack([np.asarray(call(x[r:r + 1], w, jnp.int32(2)))[0] for r in range(11)])
    for m in list(range(1, 9)) + [11]:  # one pass up to 8 rows, then a second of 3
        out = np.asarray(call(x[:m], w, jnp.int32(2)))
        assert out.dtype == np.float32 and out.shape == (m, 211)
        np.testing.assert_array_equal(out, alone[:m], err_msg=f"{fmt} M={m}")
        _close(out, _dequantized_matmul(x[:m], w, 2), 96)
    # the same products as the float32 kernel on the dequantized weight: bit for bit
    deq = w.astype(jnp.float32)
    np.testing.assert_array_equal(alone, np.asarray(call(x, deq, jnp.int32(2))))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_planted_wrong_scale_is_caught(fmt):
    w = _weight(fmt)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 96), np.float32))
    ref = _dequantized_matmul(x, w, 1)
    _close(np.asarray(_call()(x, w, jnp.int32(1))), ref, 96)
    # one block's scale (layer 1, input rows 32..63) doubled, in the scalar tail (column
    # 209) or a vector tile (column 5); the layer the kernel must not read changed freely
    for col in (209, 5):
        bad = w.replace(scale=w.scale.at[1, 1, 0, col].multiply(2.0).at[0].multiply(3.0))
        with pytest.raises(AssertionError):
            _close(np.asarray(_call()(x, bad, jnp.int32(1))), ref, 96)
    # a kernel reading the wrong layer's blocks is caught as well
    with pytest.raises(AssertionError):
        _close(np.asarray(_call()(x, w, jnp.int32(0))), ref, 96)


@pytest.mark.parametrize("group", [6, 48, 96])
def test_other_groups_and_two_contracted_axes(group):
    """Groups other than 32 (any even divisor of the input dim; 96: all of it), and wo [N, H | D] contracted over both
    axes, plain (unstacked: an lm_head) and stacked."""
    rng = np.random.default_rng(3)
    wo = jnp.asarray(rng.standard_normal((2, 4, 24, 40), np.float32))  # [L, N, H, D]
    for qw in [quantize_blocks(wo, 2, fmt, group, n_lead=1) for fmt in FORMATS]:
        attn = jnp.asarray(rng.standard_normal((1, 3, 4, 24), np.float32))
        out = small_matmul.matmul(attn, small_matmul.StackedWeight(qw, jnp.int32(1)), "kn", 2)
        ref = jnp.einsum("BTNH,NHD->BTD", attn, qw.astype(jnp.float32)[1])
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
        one = jax.tree.map(lambda a: a[0], qw)
        one = one.replace(shape=qw.shape)
        plain = small_matmul.matmul(attn, one, "kn", 2)
        np.testing.assert_allclose(plain, jnp.einsum("BTNH,NHD->BTD", attn, one.astype(jnp.float32)),
                                   rtol=1e-5, atol=1e-5)


def _cfg(tie=False):
    return ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=tie,
                       dtype="float32", param_dtype="float32")


def _quantized(cfg, fmt):
    return quantize_model(model.init_params(cfg, jax.random.key(0)), fmt)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_model_forward_on_the_kernel_matches_the_dequantized_path(fmt):
    cfg = _cfg()
    params = _quantized(cfg, fmt)
    toks = jnp.array([[5, 17, 42, 7]], jnp.int32)
    pos = jnp.arange(4, dtype=jnp.int32)[None] + 3
    cache = init_cache(cfg, 1, 32)

    def step(p, c):
        return model.forward(p, cfg, toks, pos, c)[0]

    hlo = jax.jit(step).lower(params, cache).as_text()
    # every layer matrix and the untied head read as stored
    assert hlo.count("s2d_quant_matmul") >= 7 + 1, hlo.count("s2d_quant_matmul")
    with small_matmul.disabled():
        xla = jax.jit(lambda p, c: step(p, c))(params, cache)
    np.testing.assert_allclose(jax.jit(step)(params, cache), xla, rtol=2e-4, atol=2e-4)


def test_speculative_greedy_on_a_q4_1_target_equals_its_own_ar(monkeypatch):
    """The quantized target is the model a user has: speculative decoding's greedy output
    equals that model's AR, token for token (the kernel's rows do not depend on how many
    share a verify window)."""
    from s2d_jax.decode.serving import Decoder
    from test_engine import CFG, PROMPTS, target_params

    traced = []  # the quantized matmuls traced into the decode programs
    real = small_matmul._quant_call
    monkeypatch.setattr(small_matmul, "_quant_call", lambda *a: traced.append(1) or real(*a))
    params = quantize_model(target_params(), "Q4_1")
    draft = dict(params, layers=jax.tree.map(lambda x: x[:2], params["layers"]))
    dcfg = dataclasses.replace(CFG, num_layers=2)
    ar = Decoder(CFG, params, method="ar")
    sd = Decoder(CFG, params, method="sd", draft_cfg=dcfg, draft_params=draft, exits=(2,), gamma=3)
    want = ar.generate(PROMPTS[:1], max_new_tokens=24, eos_id=-1)
    assert len(traced) >= 7
    got = sd.generate(PROMPTS[:1], max_new_tokens=24, eos_id=-1, thresholds=[0.3])
    assert got[0]["token_ids"] == want[0]["token_ids"]
    assert got[0]["stats"]["mean_accepted_tokens"] > 1.05, got[0]["stats"]  # windows ran


@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("g++"),
                    reason="x86-64 instruction-set levels, built with g++")
# x86-64-v3 (AVX2: widen16's two halves) where this CPU's own build is AVX-512; the SSE2
# baseline (its scalar widening, unfused multiply-adds) is slow (CI time)
@pytest.mark.parametrize("march", [
    pytest.param("x86-64-v3", marks=pytest.mark.slow),  # a second build of the kernels (~30 s)
    pytest.param("x86-64", marks=pytest.mark.slow)])
def test_rows_stay_bitwise_when_built_for_older_cpus(tmp_path, march):
    cxx = tmp_path / "cxx"  # the same command with the older level last (the last -march wins)
    cxx.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} "$@" -march={march}\n')
    cxx.chmod(0o755)
    env = dict(os.environ, S2D_JAX_CACHE=str(tmp_path / "cache"), CXX=str(cxx))
    test = "tests/test_quant_matmul.py::test_kernel_equals_dequantize_then_matmul_bitwise_per_row"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "3 passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-500:]
    assert len(list((tmp_path / "cache").rglob("*.so"))) == 1  # built here, with the override
