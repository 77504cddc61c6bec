"""The GPU decode programs' cached attention kernel (model/gpu_attention.py), run in Pallas's
interpreter on this CPU: the same attention as the XLA-ops path for steps and verify
windows, grouped and ungrouped heads, new keys attended before or after their write,
repeated positions and a 16-bit cache; and the engine's greedy output unchanged with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.config import ModelConfig
from s2d_jax.model import attention, decode_scope, gpu_attention

KEYS = jax.random.split(jax.random.key(3), 6)


def _case(num_heads, num_kv_heads, positions, dtype=jnp.float32, S=192, L=3, H=32):
    cfg = ModelConfig(vocab_size=64, hidden_size=num_heads * H, intermediate_size=64,
                      num_layers=L, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      max_position_embeddings=S)
    pos = jnp.asarray(positions, jnp.int32)
    B, T = pos.shape
    q = jax.random.normal(KEYS[0], (B, T, num_heads, H))
    kc, vc = (jax.random.normal(k, (L, B, num_kv_heads, S, H)).astype(dtype) for k in KEYS[1:3])
    new = tuple(jax.random.normal(k, (B, T, num_kv_heads, H)) for k in KEYS[3:5])
    return cfg, q, kc, vc, pos, new


@pytest.mark.parametrize("heads,kv,positions,with_new", [
    (4, 2, [[5, 6, 7], [130, 131, 132]], True),    # a verify window, grouped queries
    (4, 4, [[0], [191]], True),                    # steps at the first and the last slot
    (4, 4, [[0], [191]], False),                   # ... their keys written before
    (8, 2, [[64, 64, 65, 66, 67]], True),          # a catch-up window repeating a position
    (2, 1, [[63, 64]], False),                     # a window across a block edge
])
def test_the_kernel_attends_as_the_xla_ops_do(heads, kv, positions, with_new):
    cfg, q, kc, vc, pos, new = _case(heads, kv, positions)
    new_kv = new if with_new else None
    with decode_scope.fused_attention(False):
        want = attention.cache_attention(q, kc, vc, jnp.int32(1), pos, cfg, 64, new_kv)
    with decode_scope.fused_attention(True):
        got = attention.cache_attention(q, kc, vc, jnp.int32(1), pos, cfg, 64, new_kv)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    # and it read the layer asked for: another layer's cache answers differently
    with decode_scope.fused_attention(True):
        other = attention.cache_attention(q, kc, vc, jnp.int32(2), pos, cfg, 64, new_kv)
    assert np.max(np.abs(np.asarray(other) - np.asarray(want))) > 1e-2


def test_a_bf16_cache_is_read_as_the_query_computes():
    cfg, q, kc, vc, pos, new = _case(4, 2, [[40, 41]], dtype=jnp.bfloat16)
    q = q.astype(jnp.bfloat16)
    with decode_scope.fused_attention(False):
        want = attention.cache_attention(q, kc, vc, jnp.int32(0), pos, cfg, 64, new)
    with decode_scope.fused_attention(True):
        got = attention.cache_attention(q, kc, vc, jnp.int32(0), pos, cfg, 64, new)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_it_serves_only_what_fits_on_chip():
    kc = jnp.zeros((1, 1, 1, 128, 8))
    assert gpu_attention.usable(kc, 5 * 8)
    assert not gpu_attention.usable(kc, gpu_attention.MAX_ROWS + 1)  # a prefill's rows
    assert not gpu_attention.usable(jnp.zeros((1, 1, 1, 100, 8)), 4)  # slots off its step


@pytest.mark.parametrize("method,exits,gamma", [
    ("s2d", (1, 2, 3), 3), pytest.param("ar", (), 0, marks=pytest.mark.slow)])
def test_greedy_decoding_is_unchanged_with_the_kernel(method, exits, gamma, monkeypatch):
    from test_engine import NEW, PROMPTS, make_decoder, reference
    calls = []
    real = gpu_attention.cache_softmax
    monkeypatch.setattr(gpu_attention, "cache_softmax",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    dec = make_decoder(method, exits, gamma)
    jax.clear_caches()  # the scope is read when a program is traced
    try:
        with decode_scope.fused_attention(True):
            out = dec.generate(PROMPTS, max_new_tokens=NEW, max_len=64, eos_id=-1,
                               thresholds=[0.3] * len(exits) if exits else None)
    finally:
        jax.clear_caches()  # no later test reuses the interpreted kernel's programs
    assert calls, "the kernel was not traced"
    for p, o in zip(PROMPTS, out):
        assert o["token_ids"] == reference(tuple(p)), (method, p)


def test_gpu_programs_alone_get_the_gpu_compiler_options():
    """engine's decode programs: GPU_COMPILER_OPTIONS (one-pass GEMMs) for a top-level call
    on GPU devices; a plain jit on other devices and inside another trace (JAX refuses
    compiler options on a nested jit: the server's eval_shape of a prefill)."""
    import types

    from s2d_jax.decode import engine
    program = engine.prefill

    def chain_on(platform):
        device = types.SimpleNamespace(platform=platform)
        return types.SimpleNamespace(mesh=types.SimpleNamespace(
            devices=np.array([device], dtype=object)))
    x = jnp.ones(3)
    assert program._for((x,), {"chain": chain_on("gpu")}) is program._gpu
    assert program._for((x,), {"chain": chain_on("tpu")}) is program._plain
    assert program._for((x,), {"chain": types.SimpleNamespace(mesh=None)}) is program._plain
    seen = []
    jax.eval_shape(lambda y: seen.append(program._for((y,), {"chain": chain_on("gpu")})) or y, x)
    assert seen == [program._plain]
