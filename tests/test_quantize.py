"""int8 / int4 (weight-only) and w8a8 quantization: error bounds, packing, memory, the int8
matmul of w8a8, and the quantized params running unchanged through model.py (scan slicing,
layer ranges, tied/untied head)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.model import transformer as model
from s2d_jax.config import ModelConfig
from s2d_jax.errors import S2DError
from s2d_jax.model.quantize import (QuantizedWeight, _pack_int4, _unpack_int4, params_nbytes,
                              quantize_params, quantize_weight)
from tiny_models import numpy_params

CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=64)


def test_int4_pack_roundtrip_covers_every_value():
    vals = np.arange(-8, 8, dtype=np.int8)
    q = jnp.asarray(np.stack([vals, vals[::-1]], axis=1).reshape(16, 2))  # [in=16, out=2]
    packed = _pack_int4(q)
    assert packed.dtype == jnp.uint8 and packed.shape == (8, 2)
    np.testing.assert_array_equal(np.asarray(_unpack_int4(packed)), np.asarray(q))


@pytest.mark.parametrize("bits,group", [(8, 0), (4, 16), (4, 64)])
def test_error_is_within_half_a_step_of_its_group(bits, group):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 64, 4, 8)).astype(np.float32)  # [L, D | N, H] like wq
    w[0, :, 1, 3] = 0.0  # an all-zero output channel must survive (scale fallback)
    qw = quantize_weight(jnp.asarray(w), 1, bits, group, n_lead=1)
    deq = np.asarray(qw.astype(jnp.float32))
    assert deq.shape == w.shape
    g = 64 if group == 0 else group
    # Independent bound: half a quantization step of each (input group, output channel).
    grouped = np.abs(w).reshape(2, 64 // g, g, 32).max(axis=2, keepdims=True)
    step = grouped / (127 if bits == 8 else 7)
    bound = np.broadcast_to(step / 2, (2, 64 // g, g, 32)).reshape(w.shape) * (1 + 1e-5)
    err = np.abs(deq - w)
    assert (err <= bound + 1e-7).all(), float((err - bound).max())
    assert (deq[0, :, 1, 3] == 0).all()
    # Not trivially exact: the rounding really happened.
    assert err.max() > (1e-4 if bits == 8 else 1e-2)


@pytest.mark.parametrize("tied", [pytest.param(False, marks=pytest.mark.slow), True])
def test_memory_and_storage_sizes(tied):
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    params = numpy_params(cfg)
    full = params_nbytes(params)
    shapes = model.param_shapes(cfg)
    n_quant = sum(np.prod(shapes["layers"][k]) for k in
                  ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    n_quant += 0 if tied else np.prod(shapes["lm_head"])
    rest = full - 4 * n_quant  # float32 bytes that stay unquantized (embed, norms)
    for mode, per_weight in (("int8", 1.0), ("int4", 0.5)):
        qp = quantize_params(params, mode, group=32)
        qbytes = params_nbytes(qp)
        scales = sum(x.scale.nbytes for x in jax.tree.leaves(
            qp, is_leaf=lambda x: isinstance(x, QuantizedWeight)) if isinstance(x, QuantizedWeight))
        assert qbytes == rest + per_weight * n_quant + scales, (mode, qbytes)
        # One float32 scale per output channel (int8) or per 32 input rows (int4).
        if mode == "int4":
            assert scales == 4 * n_quant / 32
        assert scales < (0.05 if mode == "int8" else 0.13) * 4 * n_quant
        print(f"{mode} tied={tied}: {full} -> {qbytes} bytes ({qbytes / full:.2f}x)")
    with pytest.raises(S2DError, match="unknown quantization"):
        quantize_params(params, "int3")
    with pytest.raises(S2DError, match="group"):
        quantize_weight(jnp.ones((6, 4)), 1, 4, 4)


def split_forward(params, cfg, tokens):
    """The logits of layers [0, 1) then [1, L), each range its own program (an exit's path)."""
    h = model.embed_tokens(params, cfg, tokens)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    h1, _ = model.run_layers(params, cfg, h, pos, 0, 1)
    h2, _ = model.run_layers(params, cfg, h1, pos, 1, cfg.num_layers)
    return np.asarray(model.lm_logits(params, cfg, h2))


def assert_equal_but_for_rounding_flips(split, whole):
    """w8a8 rounds every activation to int8, a step function: the split and the whole
    forward are different XLA programs whose float32 states differ in the last bit (1e-7
    here; which elements depends on fusion and the CPU's vector paths), and where such a
    bit falls on a rounding boundary one int8 activation moves by one step. That happened
    on an Intel Xeon at seed 2 and here at 5 of 40 seeds: at most 0.42% of max |logit|,
    <= 6% of logits moved by > 1e-4. A wrong slice moves ~100% of them by ~80%."""
    err = np.abs(split - whole)
    scale = np.abs(whole).max()
    assert err.max() <= 0.02 * scale, (err.max(), scale)
    assert (err > 1e-4).mean() <= 0.25, (err > 1e-4).mean()


# untied is slow (CI time); the tied case runs the same path in the fast set
@pytest.mark.parametrize("tied", [pytest.param(False, marks=pytest.mark.slow), True])
def test_quantized_params_run_through_the_model(tied):
    """Forward (scan over stacked QuantizedWeight leaves), a layer range, and the greedy
    agreement with full precision on teacher-forced random tokens."""
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    params = numpy_params(cfg, seed=2)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (8, 24)),
                         jnp.int32)
    fwd = jax.jit(lambda p, t: model.forward(p, cfg, t)[0])
    ref = np.asarray(fwd(params, tokens))
    agreement = {}
    for mode in ("int8", "int4", "w8a8"):
        qp = quantize_params(params, mode, group=32)
        out = np.asarray(fwd(qp, tokens))
        rel = np.abs(out - ref).max() / np.abs(ref).max()
        agreement[mode] = float((out.argmax(-1) == ref.argmax(-1)).mean())
        print(f"{mode} tied={tied}: max |logit error| / max |logit| = {rel:.4f}")
        assert rel < {"int8": 0.04, "int4": 0.4, "w8a8": 0.08}[mode], (mode, rel)
        assert rel > 0  # the quantized model really is a different model
        # A layer range of a quantized stack is a slice too (sorted-draft exits).
        split = split_forward(qp, cfg, tokens)
        if mode != "w8a8":
            np.testing.assert_allclose(split, out, atol=1e-4)
        else:
            assert_equal_but_for_rounding_flips(split, out)
    print(f"greedy agreement vs full precision (tied={tied}): {agreement}")
    assert agreement["int8"] >= 0.95 and agreement["int4"] >= 0.6, agreement
    assert agreement["w8a8"] >= 0.9, agreement


@pytest.mark.parametrize("name,n_in_axes,shape", [("w_gate", 1, (32, 48)),
                                                  ("wo", 2, (4, 8, 32))])
def test_w8a8_matmul_is_an_int8_product_within_its_rounding(name, n_in_axes, shape):
    """QuantizedWeight.matmul multiplies int8 by int8 into int32 (checked in the jaxpr) and
    stays within the error of rounding both operands (an independent numpy bound)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal((3, 5) + shape[:n_in_axes]).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero row must survive (scale fallback)
    qw = quantize_weight(jnp.asarray(w), n_in_axes, 8, act_bits=8)
    y = np.asarray(jax.jit(qw.matmul)(jnp.asarray(x)))
    n_in = int(np.prod(shape[:n_in_axes]))
    x2, w2 = x.reshape(15, n_in), w.reshape(n_in, -1)
    ref = (x2 @ w2).reshape(y.shape)
    assert y.shape == (3, 5) + shape[n_in_axes:]
    # |x w - x' w'| <= |x| |w - w'| + |x - x'| |w'| with half-step errors of each scale.
    dx = np.abs(x2).max(1, keepdims=True) / 127 / 2
    dw = np.abs(w2).max(0, keepdims=True) / 127 / 2
    bound = (np.abs(x2) @ np.broadcast_to(dw, w2.shape) + dx * np.abs(w2).sum(0)
             + dx * dw * n_in).reshape(y.shape)
    assert (np.abs(y - ref) <= bound * 1.001 + 1e-6).all()
    assert np.abs(y - ref).max() > 1e-5 and (y[0, 0] == 0).all()
    jaxpr = str(jax.make_jaxpr(qw.matmul)(jnp.asarray(x)))
    assert "preferred_element_type=int32" in jaxpr and "i8[" in jaxpr


@pytest.mark.parametrize("seed", [5, 25])
def test_w8a8_layer_range_holds_where_last_bits_flip_a_rounding(seed):
    """Seeds where, on this AMD CPU too, the split and whole w8a8 forwards round one
    activation differently (the Intel failure at seed 2): exact equality fails, the
    rounding-flip bound holds, and a wrong slice (layers [0, 2) after layer 0) is caught."""
    cfg = dataclasses.replace(CFG, tie_word_embeddings=True)
    qp = quantize_params(numpy_params(cfg, seed=seed), "w8a8", group=32)
    tokens = jnp.asarray(np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, (8, 24)),
                         jnp.int32)
    whole = np.asarray(jax.jit(lambda p, t: model.forward(p, cfg, t)[0])(qp, tokens))
    assert_equal_but_for_rounding_flips(split_forward(qp, cfg, tokens), whole)
    h = model.embed_tokens(qp, cfg, tokens)
    pos = jnp.broadcast_to(jnp.arange(24), tokens.shape)
    h1, _ = model.run_layers(qp, cfg, h, pos, 0, 1)
    wrong, _ = model.run_layers(qp, cfg, h1, pos, 0, 2)
    with pytest.raises(AssertionError):
        assert_equal_but_for_rounding_flips(np.asarray(model.lm_logits(qp, cfg, wrong)), whole)
