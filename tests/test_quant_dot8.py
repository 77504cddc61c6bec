"""The int8-activation block-quantized matmul (s2d_jax/model/quant_dot8.cc): for the Q8_0,
Q4_0 and Q4_1 layouts, the kernel equals the same arithmetic done in numpy (activations
rounded to int8 per block of 32, integer sums, scaled per group), each row bitwise whatever
the row count and whichever path (VNNI tile or scalar tail) computed its column; it stays
within the activation rounding of dequantize-then-matmul; a planted wrong scale is caught;
and speculative greedy on a quantized target still equals its AR."""

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

from s2d_jax.bench.ggml_quantize import FORMATS, quantize_blocks, quantize_model
from s2d_jax.errors import S2DError
from s2d_jax.model import small_matmul

pytestmark = pytest.mark.skipif(not small_matmul.built(),
                                reason="kernel not built here: " + small_matmul.status())


@pytest.fixture(autouse=True)
def _int8_activations_on_any_cpu():
    with small_matmul.forced(), small_matmul.quant_activations("int8"):
        yield


def _weight(fmt, L=3, K=128, N=211, seed=0):
    # N = 211: three 64-column VNNI tiles and a 19-column scalar tail
    w = np.random.default_rng(seed).standard_normal((L, K, N)).astype(np.float32)
    return quantize_blocks(w, 1, fmt, 32, n_lead=1)


def _call():
    return jax.jit(lambda x, w, i: small_matmul.matmul(
        x, small_matmul.StackedWeight(w, i), "kn", 1))


def _int8_reference(x, w, layer):
    """What the kernel computes, in numpy: x per block of 32 as round(x * 127 / amax) with
    scale amax / 127, then the dequantized weight against those values, in float64."""
    x = np.asarray(x, np.float32)
    M, K = x.shape
    blocks = x.reshape(M, K // 32, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(blocks * inv)  # float32 product, rounded half to even
    assert np.abs(xq).max() <= 127
    dx = (amax / np.float32(127)).astype(np.float32)
    xd = (xq.astype(np.float64) * dx).reshape(M, K)
    return xd @ np.asarray(w.astype(jnp.float32)[layer], np.float64)


def _close(out, ref, K):
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6 * np.abs(ref).max() * K ** 0.5)


def test_int8_is_the_default_where_the_tiles_are_vnni(monkeypatch):
    with small_matmul.quant_activations("float"):
        assert small_matmul.activation_mode() == "float"
    assert small_matmul.activation_mode() == "int8"  # the fixture's choice
    hlo = jax.jit(lambda x, w: small_matmul.matmul(x, w, "kn", 1)).lower(
        jnp.ones((2, 128)), jax.tree.map(lambda a: a[0], _weight("Q4_1"))).as_text()
    assert "s2d_quant_dot8" in hlo and "s2d_quant_matmul" not in hlo
    monkeypatch.setattr(small_matmul, "_activations", [None])  # no choice made: the default
    monkeypatch.delenv("S2D_QUANT_ACTIVATIONS", raising=False)
    flags = small_matmul.cpu_flags()
    assert small_matmul.activation_mode() == ("int8" if {"avx512_vnni", "avx512bw"} <= flags
                                              else "float")
    monkeypatch.setattr(small_matmul, "cpu_flags", lambda: {"avx512f", "avx512bw"})
    assert small_matmul.activation_mode() == "float"  # no VNNI: the float kernel
    monkeypatch.setenv("S2D_QUANT_ACTIVATIONS", "int8")
    assert small_matmul.activation_mode() == "int8"
    monkeypatch.setenv("S2D_QUANT_ACTIVATIONS", "int4")
    with pytest.raises(S2DError, match="neither int8 nor float"):
        small_matmul.activation_mode()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kernel_equals_the_int8_arithmetic_bitwise_per_row(fmt):
    w = _weight(fmt)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((11, 128), np.float32))
    call = _call()
    alone = np.stack([np.asarray(call(x[r:r + 1], w, jnp.int32(2)))[0] for r in range(11)])
    for m in list(range(1, 9)) + [11]:  # row chunks of 4 per tile pass, and their remainders
        out = np.asarray(call(x[:m], w, jnp.int32(2)))
        assert out.dtype == np.float32 and out.shape == (m, 211)
        np.testing.assert_array_equal(out, alone[:m], err_msg=f"{fmt} M={m}")
    _close(alone, _int8_reference(x, w, 2), 128)
    # against float activations, within int8 rounding: each activation off by at most half
    # a step (amax / 254), so a sum by at most sum |w| amax / 254 per block
    deq = np.asarray(w.astype(jnp.float32)[2], np.float64)
    xf = np.asarray(x, np.float64)
    amax = np.abs(xf.reshape(11, 4, 32)).max(-1)
    bound = np.einsum("mb,bkn->mn", amax / 254, np.abs(deq).reshape(4, 32, 211)) + 1e-5
    err = np.abs(alone - xf @ deq)
    assert (err <= bound).all() and err.max() > 0, (err / bound).max()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tile_and_scalar_columns_agree_bitwise(fmt):
    """Columns 128..191 are a VNNI tile in the 211-column call and scalar columns in a call on
    columns 128..210 only (83 columns: one tile, then the tail): the same bits."""
    w = _weight(fmt)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 128), np.float32))
    full = np.asarray(_call()(x, w, jnp.int32(0)))
    cut = w.replace(q=w.q[..., 150:], scale=w.scale[..., 150:],
                    offset=None if w.offset is None else w.offset[..., 150:],
                    shape=(w.shape[0], 61))
    part = np.asarray(_call()(x, cut, jnp.int32(0)))  # 61 columns: all scalar
    np.testing.assert_array_equal(part, full[:, 150:])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_planted_wrong_scale_is_caught(fmt):
    w = _weight(fmt)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 128), np.float32))
    ref = _int8_reference(x, w, 1)
    _close(np.asarray(_call()(x, w, jnp.int32(1))), ref, 128)
    for col in (209, 5):  # the scalar tail, a VNNI tile
        bad = w.replace(scale=w.scale.at[1, 1, 0, col].multiply(2.0).at[0].multiply(3.0))
        with pytest.raises(AssertionError):
            _close(np.asarray(_call()(x, bad, jnp.int32(1))), ref, 128)
    with pytest.raises(AssertionError):  # the wrong layer read
        _close(np.asarray(_call()(x, w, jnp.int32(0))), ref, 128)


def test_groups_not_whole_blocks_take_the_float_kernel():
    w = quantize_blocks(np.random.default_rng(5).standard_normal((1, 96, 64)).astype(np.float32),
                        1, "Q4_1", 48, n_lead=1)
    hlo = _call().lower(jnp.ones((1, 96)), w, jnp.int32(0)).as_text()
    assert "s2d_quant_matmul" in hlo and "s2d_quant_dot8" not in hlo


@pytest.mark.parametrize("fmt,gamma", [("Q4_1", 3), ("Q8_0", 3), ("Q4_1", 9)])
def test_speculative_greedy_on_a_quantized_target_equals_its_own_ar(fmt, gamma):
    """gamma 9: 4 prompts x 10-token verify windows, 40 rows, past MAX_ROWS."""
    from s2d_jax.decode.serving import Decoder
    from test_engine import CFG, PROMPTS, target_params

    params = quantize_model(target_params(), fmt)
    draft = dict(params, layers=jax.tree.map(lambda x: x[:2], params["layers"]))
    dcfg = dataclasses.replace(CFG, num_layers=2)
    prompts = PROMPTS if gamma > 3 else PROMPTS[:2]
    ar = Decoder(CFG, params, method="ar")
    want = ar.generate(prompts, max_new_tokens=24, eos_id=-1)
    sd = Decoder(CFG, params, method="sd", draft_cfg=dcfg, draft_params=draft, exits=(2,),
                 gamma=gamma)
    got = sd.generate(prompts, max_new_tokens=24, eos_id=-1, thresholds=[0.3])
    for g, a in zip(got, want):
        assert g["token_ids"] == a["token_ids"]
    assert got[0]["stats"]["mean_accepted_tokens"] > 1.05, got[0]["stats"]


@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("g++"),
                    reason="x86-64 instruction-set levels, built with g++")
@pytest.mark.slow  # a second build of the kernels (~45 s)
def test_a_build_without_vnni_computes_the_same(tmp_path):
    """Built for x86-64-v3 (AVX2, no VNNI), every column takes the scalar path: the same
    arithmetic tests pass there, and its outputs equal this build's bit for bit."""
    w = _weight("Q4_1")
    x = np.random.default_rng(6).standard_normal((5, 128)).astype(np.float32)
    native = np.asarray(_call()(jnp.asarray(x), w, jnp.int32(1)))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "native.npy", native)
    cxx = tmp_path / "cxx"  # the same command with the older level last (the last -march wins)
    cxx.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} "$@" -march=x86-64-v3\n')
    cxx.chmod(0o755)
    env = dict(os.environ, S2D_JAX_CACHE=str(tmp_path / "cache"), CXX=str(cxx))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tests = [f"tests/test_quant_dot8.py::{t}" for t in (
        "test_kernel_equals_the_int8_arithmetic_bitwise_per_row",
        "test_tile_and_scalar_columns_agree_bitwise")]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "6 passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-500:]
    assert len(list((tmp_path / "cache").rglob("*.so"))) == 1  # built there, with the override
    script = ("import sys, numpy as np, jax.numpy as jnp; sys.path.insert(0, 'tests'); "
              "import test_quant_dot8 as t; from s2d_jax.model import small_matmul as sm\n"
              "with sm.forced(), sm.quant_activations('int8'):\n"
              f"    y = t._call()(jnp.asarray(np.load('{tmp_path}/x.npy')), t._weight('Q4_1'), 1)\n"
              f"np.save('{tmp_path}/old.npy', np.asarray(y))")
    run = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    np.testing.assert_array_equal(np.load(tmp_path / "old.npy"), native)


def test_weights_sharing_an_input_take_one_call_with_the_same_bits():
    """q / k / v (and gate / up) as one call: x quantized once, each weight's columns the
    same bits as its own call, whatever the formats mixed; a quantized block takes two such
    calls (q, k, v; gate, up) and single ones for wo and w_down."""
    from s2d_jax.model import transformer as model
    from s2d_jax.model.kvcache import init_cache
    rng = np.random.default_rng(7)
    ws = [quantize_blocks(rng.standard_normal((3, 128, n)).astype(np.float32), 1, f, 32, n_lead=1)
          for n, f in [(211, "Q4_1"), (64, "Q8_0"), (96, "Q4_0")]]
    x = jnp.asarray(rng.standard_normal((5, 128)).astype(np.float32))
    at = lambda w: small_matmul.StackedWeight(w, jnp.int32(1))
    assert small_matmul.shares_input([at(w) for w in ws]) is False  # indices not one array
    shared = jax.jit(lambda x, ws: small_matmul.matmul_shared(x, [at(w) for w in ws], 1))(x, ws)
    for got, w in zip(shared, ws):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(_call()(x, w, jnp.int32(1))))
    cfg = dataclasses.replace(__import__("test_engine").CFG)
    params = quantize_model(__import__("test_engine").target_params(), "Q4_1")
    hlo = jax.jit(lambda p, c: model.forward(p, cfg, jnp.ones((1, 2), jnp.int32),
                                             jnp.array([[3, 4]], jnp.int32), c)[0]).lower(
        params, init_cache(cfg, 1, 16)).as_text()
    assert hlo.count("@s2d_quant_dot8_shared(") == 2, hlo.count("dot8_shared")


def test_verify_windows_past_32_rows_stay_on_the_int8_kernel():
    """A batch's verify windows (here 6 rows x 8 tokens = 48) round their activations as
    the AR steps do: block-quantized weights take up to MAX_QUANT_ROWS rows on the kernel,
    float ones (and float activations) keep MAX_ROWS."""
    from s2d_jax.model import transformer as model
    from s2d_jax.model.kvcache import init_cache
    from test_engine import CFG, target_params
    w = _weight("Q4_1")
    assert small_matmul.usable(48, w) and not small_matmul.usable(48)
    assert not small_matmul.usable(small_matmul.MAX_QUANT_ROWS + 1, w)
    with small_matmul.quant_activations("float"):
        assert not small_matmul.usable(48, w)
    params = quantize_model(target_params(), "Q4_1")
    toks = jnp.ones((6, 8), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (6, 8))
    hlo = jax.jit(lambda p, c: model.forward(p, CFG, toks, pos, c)[0]).lower(
        params, init_cache(CFG, 6, 16)).as_text()
    assert "@s2d_quant_dot8_shared(" in hlo and "@s2d_quant_dot8(" in hlo  # layers, head
