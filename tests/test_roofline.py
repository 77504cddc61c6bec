"""infer.aot --roofline's parts on tiny shapes: the per-round HLO bytes (hlo_traffic.py)
count a loop's body times its trip count (XLA's own cost analysis counts it once), every
method's round moves at least its minimum (weights + caches once per call), more work
moves more bytes, and the printed bound says it is one."""

import re

import jax
import jax.numpy as jnp
import pytest

from s2d_jax.config import ModelConfig
from s2d_jax.decode.aot import GenerateSetup, compile_generate, round_bytes
from s2d_jax.decode.hlo_traffic import round_traffic, type_bytes
from s2d_jax.decode.roofline import (RoundBound, device_bandwidth, expected_tokens,
                                     format_roofline, minimum_round_bytes)
from s2d_jax.errors import S2DError

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def test_a_loop_counts_its_body_times_its_trip_count():
    """Three rounds, each a 10-layer scan over stacked 256 x 256 weights: a round reads all
    10 layers (XLA's cost analysis of the module reports about one)."""
    def rounds(w, x):
        def layer(h, wl):
            return jnp.tanh(h @ wl), None
        return jax.lax.while_loop(lambda c: c[0] < 3,
                                  lambda c: (c[0] + 1, jax.lax.scan(layer, c[1], w)[0]),
                                  (0, x))[1]
    w = jax.ShapeDtypeStruct((10, 256, 256), jnp.float32)
    x = jax.ShapeDtypeStruct((1, 256), jnp.float32)
    compiled = jax.jit(rounds).lower(w, x).compile(FAST)
    t = round_traffic(compiled.as_text(), [])
    weights = 10 * 256 * 256 * 4
    assert weights <= t.lo == t.hi < 1.2 * weights
    assert compiled.cost_analysis()["bytes accessed"] < weights / 2
    assert t.guessed_loops == 0


def test_type_bytes_of_arrays_and_tuples():
    assert type_bytes("bf16[8,128]{1,0}") == 2048
    assert type_bytes("(s32[], f32[2,3]{1,0}, pred[4])") == 4 + 24 + 4


# A round loop as the TPU compiler writes it (trimmed from a v5e:2x2 compile): the
# matmul's kOutput fusion takes the whole weight stack and slices one layer in a nested
# kLoop fusion, its activation and result lie in VMEM (S(1)), the next weight is prefetched
# by a copy-start into VMEM, and a small weight stays in VMEM across rounds.
TPU_ROUND = """HloModule tpu_round

%slice_layer (p0: bf16[4,2048,512], p1: s32[]) -> bf16[2048,512] {
  %p0 = bf16[4,2048,512]{2,1,0:T(8,128)(2,1)} parameter(0)
  %p1 = s32[]{:T(128)} parameter(1)
  %zero = s32[]{:T(128)} constant(0)
  %ds = bf16[1,2048,512]{2,1,0:T(8,128)(2,1)} dynamic-slice(%p0, %p1, %zero, %zero), dynamic_slice_sizes={1,2048,512}
  ROOT %b = bf16[2048,512]{1,0:T(8,128)(2,1)} bitcast(%ds)
}

%matmul (q0: bf16[4,2048,512], q1: s32[], q2: bf16[1,2048]) -> bf16[1,512] {
  %q0 = bf16[4,2048,512]{2,1,0:T(8,128)(2,1)} parameter(0)
  %q1 = s32[]{:T(128)} parameter(1)
  %q2 = bf16[1,2048]{1,0:T(1,128)(2,1)S(1)} parameter(2)
  %layer = bf16[2048,512]{1,0:T(8,128)(2,1)} fusion(%q0, %q1), kind=kLoop, calls=%slice_layer
  ROOT %dot = bf16[1,512]{1,0:T(1,128)(2,1)S(1)} dot(%q2, %layer), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%head (h0: bf16[512,2048], h1: bf16[1,512]) -> bf16[1,2048] {
  %h0 = bf16[512,2048]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %h1 = bf16[1,512]{1,0:T(1,128)(2,1)S(1)} parameter(1)
  ROOT %d = bf16[1,2048]{1,0:T(1,128)(2,1)S(1)} dot(%h1, %h0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (c: (s32[], bf16[4,2048,512], bf16[512,2048], bf16[1,2048], bf16[256,2048])) -> (s32[], bf16[4,2048,512], bf16[512,2048], bf16[1,2048], bf16[256,2048]) {
  %c = (s32[]{:T(128)}, bf16[4,2048,512]{2,1,0:T(8,128)(2,1)}, bf16[512,2048]{1,0:T(8,128)(2,1)}, bf16[1,2048]{1,0:T(1,128)(2,1)S(1)}, bf16[256,2048]{1,0:T(8,128)(2,1)S(1)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%c), index=0
  %w = bf16[4,2048,512]{2,1,0:T(8,128)(2,1)} get-tuple-element(%c), index=1
  %wh = bf16[512,2048]{1,0:T(8,128)(2,1)} get-tuple-element(%c), index=2
  %x = bf16[1,2048]{1,0:T(1,128)(2,1)S(1)} get-tuple-element(%c), index=3
  %kept = bf16[256,2048]{1,0:T(8,128)(2,1)S(1)} get-tuple-element(%c), index=4
  %cs = (bf16[512,2048]{1,0:T(8,128)(2,1)S(1)}, bf16[512,2048]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%wh)
  %mm = bf16[1,512]{1,0:T(1,128)(2,1)S(1)} fusion(%w, %i, %x), kind=kOutput, calls=%matmul
  %cd = bf16[512,2048]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  %y = bf16[1,2048]{1,0:T(1,128)(2,1)S(1)} fusion(%cd, %mm), kind=kOutput, calls=%head
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  ROOT %t = (s32[]{:T(128)}, bf16[4,2048,512]{2,1,0:T(8,128)(2,1)}, bf16[512,2048]{1,0:T(8,128)(2,1)}, bf16[1,2048]{1,0:T(1,128)(2,1)S(1)}, bf16[256,2048]{1,0:T(8,128)(2,1)S(1)}) tuple(%next, %w, %wh, %y, %kept)
}

%cond (k: (s32[], bf16[4,2048,512], bf16[512,2048], bf16[1,2048], bf16[256,2048])) -> pred[] {
  %k = (s32[]{:T(128)}, bf16[4,2048,512]{2,1,0:T(8,128)(2,1)}, bf16[512,2048]{1,0:T(8,128)(2,1)}, bf16[1,2048]{1,0:T(1,128)(2,1)S(1)}, bf16[256,2048]{1,0:T(8,128)(2,1)S(1)}) parameter(0)
  %n = s32[]{:T(128)} get-tuple-element(%k), index=0
  %limit = s32[]{:T(128)} constant(4)
  ROOT %lt = pred[]{:T(512)} compare(%n, %limit), direction=LT
}

ENTRY %main (e: (s32[], bf16[4,2048,512], bf16[512,2048], bf16[1,2048], bf16[256,2048])) -> (s32[], bf16[4,2048,512], bf16[512,2048], bf16[1,2048], bf16[256,2048]) {
  %e = (s32[]{:T(128)}, bf16[4,2048,512]{2,1,0:T(8,128)(2,1)}, bf16[512,2048]{1,0:T(8,128)(2,1)}, bf16[1,2048]{1,0:T(1,128)(2,1)S(1)}, bf16[256,2048]{1,0:T(8,128)(2,1)S(1)}) parameter(0)
  ROOT %loop = (s32[]{:T(128)}, bf16[4,2048,512]{2,1,0:T(8,128)(2,1)}, bf16[512,2048]{1,0:T(8,128)(2,1)}, bf16[1,2048]{1,0:T(1,128)(2,1)S(1)}, bf16[256,2048]{1,0:T(8,128)(2,1)S(1)}) while(%e), condition=%cond, body=%body
}
"""


def test_the_walk_reads_a_tpu_round_as_hbm_traffic():
    """What the round moves in HBM: one layer of the weight stack (its slice, taken inside
    a nested fusion) and the prefetched head (the copy-start's read); activations, results
    and the prefetched copy live in VMEM, and the weight kept there across rounds is
    reported beside, not counted. (Before: the whole stack, the VMEM operands and results,
    and no prefetch: 8 MiB + 2 MiB + ... instead of 4 MiB.)"""
    t = round_traffic(TPU_ROUND, [])
    layer = head = 2048 * 512 * 2
    assert layer + head <= t.lo == t.hi < layer + head + 64, t.ops  # + the scalar counter
    assert t.on_chip == 256 * 2048 * 2 + 2048 * 2  # the kept weight and the activation
    assert t.guessed_loops == 0


def _round(method, exits, gamma):
    target = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=1024)
    setup = GenerateSetup.make(target, target, exits, 1, 512, 16, gamma, method)
    compiled = compile_generate(setup, None, FAST)[0]
    return RoundBound(method, round_bytes(compiled, setup), minimum_round_bytes(setup), gamma)


@pytest.mark.slow
def test_every_method_moves_at_least_its_minimum_and_more_work_more_bytes():
    """AR and SD at gamma 2 (S2D's escalation bounds: the 70B test in test_infer_aot.py)."""
    ar, sd = _round("ar", (), 1), _round("sd", (2,), 2)
    for r in (ar, sd):
        assert 0 < r.traffic.lo <= r.traffic.hi
        assert r.traffic.lo >= r.minimum[0] > 0 and r.traffic.hi >= r.minimum[1]
        assert r.traffic.guessed_loops == 0  # the attention's block loop: 2 blocks of 256
    assert sd.minimum[0] > ar.minimum[0] and sd.traffic.lo > ar.traffic.hi  # + 2 draft steps
    lines = format_roofline([ar, sd], device_bandwidth("h100-80gb"), "h100-80gb", [0.25])
    assert "LOWER BOUND" in lines[0] and "not a measurement" in lines[0]
    times = [float(x) for x in re.findall(r"([\d.]+) ms", "\n".join(lines))]
    assert len(times) == 2 and all(t > 0 for t in times)
    assert any(line.strip().startswith("Lemma 3.1 speedup bound at acceptance 0.25")
               for line in lines)


def test_bandwidths_and_expected_tokens():
    assert device_bandwidth("h100-80gb") == 3.35e12
    assert device_bandwidth("tpu-v5e-16gb") == 819e9
    assert device_bandwidth("24") is None and device_bandwidth("24", 1e12) == 1e12
    with pytest.raises(S2DError, match="--bandwidth must be a positive"):
        device_bandwidth("h100-80gb", float("nan"))
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(0.5, 2) == 1.75
