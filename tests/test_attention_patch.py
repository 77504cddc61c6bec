"""XLA's cached attention with the call's own keys patched in (`new_kv`, used on GPU/TPU
and on CPUs without the kernels): a position given twice in one call holds the later key,
as the cache write leaves it. It counted both once; a ladder round's draft catch-up pads a
row's window by repeating a position, and the draft's cache then held keys computed from
the padding (0.009 off a fresh prefill, tests/test_lookup.py's cache test on that path)."""

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax.config import ModelConfig
from s2d_jax.model import attention, small_matmul

CFG = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)


def test_a_repeated_position_holds_the_later_key():
    rng = np.random.default_rng(0)
    L, B, K, S, H, T = 2, 2, CFG.num_kv_heads, 12, CFG.head_dim, 4
    kc, vc = (jnp.asarray(rng.standard_normal((L, B, K, S, H), np.float32)) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((B, T, CFG.num_heads, H), np.float32))
    new = tuple(jnp.asarray(rng.standard_normal((B, T, K, H), np.float32)) for _ in range(2))
    # row 0: distinct positions; row 1: its last two entries repeat position 6 (padding)
    positions = jnp.asarray([[3, 4, 5, 6], [5, 6, 6, 6]], jnp.int32)
    with small_matmul.disabled():
        got = jax.jit(lambda q, kc, vc, n: attention.cache_attention(
            q, kc, vc, jnp.int32(1), positions, CFG, 8, n))(q, kc, vc, new)
    # reference: write the new keys in order (the later write wins), then attend
    kw, vw = np.array(kc[1]), np.array(vc[1])  # [B, K, S, H]
    for b in range(B):
        for t in range(T):
            kw[b, :, positions[b, t]] = new[0][b, t]
            vw[b, :, positions[b, t]] = new[1][b, t]
    mask = np.arange(S)[None, None, :] <= np.asarray(positions)[:, :, None]  # [B, T, S]
    want = attention.attention(q, jnp.einsum("BKSH->BSKH", kw), jnp.einsum("BKSH->BSKH", vw),
                               jnp.asarray(mask), CFG)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_one_query_row_per_kv_head_matches_the_reference():
    """T x G = 1 (an AR step without grouped queries) takes the row twice on XLA's path:
    the same attention as the reference, patched key included."""
    cfg = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=4, head_dim=16)
    rng = np.random.default_rng(1)
    L, B, K, S, H = 2, 2, 4, 12, 16
    kc, vc = (jnp.asarray(rng.standard_normal((L, B, K, S, H), np.float32)) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((B, 1, 4, H), np.float32))
    new = tuple(jnp.asarray(rng.standard_normal((B, 1, K, H), np.float32)) for _ in range(2))
    positions = jnp.asarray([[3], [9]], jnp.int32)
    for patch in (False, True):
        with small_matmul.disabled():
            got = jax.jit(lambda q, kc, vc: attention.cache_attention(
                q, kc, vc, jnp.int32(0), positions, cfg, 8, new if patch else None))(q, kc, vc)
        kw, vw = np.array(kc[0]), np.array(vc[0])
        if patch:
            for b in range(B):
                kw[b, :, positions[b, 0]], vw[b, :, positions[b, 0]] = new[0][b, 0], new[1][b, 0]
        mask = np.arange(S)[None, None, :] <= np.asarray(positions)[:, :, None]
        want = attention.attention(q, jnp.einsum("BKSH->BSKH", kw), jnp.einsum("BKSH->BSKH", vw),
                                   jnp.asarray(mask), cfg)
        assert got.shape == (B, 1, 4, H)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
