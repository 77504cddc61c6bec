"""The cached-attention CPU kernel (s2d_jax/model/cpu_attention.cc): the same result as XLA's
blockwise attention (float32 and bfloat16 caches, the deferred writes' patched keys), each
query row bitwise independent of how many tokens share the call, and used on the decode
path only where the CPU kernels are built."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.config import ModelConfig
from s2d_jax.model import attention, small_matmul

pytestmark = pytest.mark.skipif(not small_matmul.built(),
                                reason="kernels not built here: " + small_matmul.status())

@pytest.fixture(autouse=True)
def _kernel_on_any_cpu():
    """The decode path takes the kernels by default only with AVX-512 (preferred()); here
    they are tested wherever they are built."""
    with small_matmul.forced():
        yield


# head_dim 72: one 64-wide vector pass and a scalar tail; 3 query heads per kv head
CFG = ModelConfig(vocab_size=100, hidden_size=216, intermediate_size=64, num_layers=3,
                  num_heads=6, num_kv_heads=2, head_dim=72)


def _inputs(dtype, B=2, T=5, S=40, seed=0):
    rng = np.random.default_rng(seed)
    shape = (CFG.num_layers, B, CFG.num_kv_heads, S, CFG.head_dim)
    kc = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
    vc = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
    q = jnp.asarray(rng.standard_normal((B, T, CFG.num_heads, CFG.head_dim), np.float32))
    new = tuple(jnp.asarray(rng.standard_normal((B, T, CFG.num_kv_heads, CFG.head_dim),
                                                np.float32)) for _ in range(2))
    # row 0 mid-cache, row 1 at the cache's end (its last tokens past it: dropped writes)
    positions = jnp.asarray([[7 + t for t in range(T)], [S - 2 + t for t in range(T)]],
                            jnp.int32)[:B]
    return q, kc, vc, positions, new


def _both(q, kc, vc, positions, new, layer=1):
    def run(patch):
        return jax.jit(lambda q, kc, vc, p, n: attention.cache_attention(
            q, kc, vc, jnp.int32(layer), p, CFG, 16, n if patch else None))
    kernel = {p: np.asarray(run(p)(q, kc, vc, positions, new)) for p in (True, False)}
    with small_matmul.disabled():
        xla = {p: np.asarray(run(p)(q, kc, vc, positions, new)) for p in (True, False)}
    return kernel, xla


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_matches_xlas_blockwise_attention(dtype):
    kernel, xla = _both(*_inputs(dtype))
    for patch in (True, False):
        np.testing.assert_allclose(kernel[patch], xla[patch], rtol=2e-5, atol=2e-5,
                                   err_msg=f"patch={patch}")
    assert np.abs(kernel[True] - kernel[False]).max() > 1e-3  # the patch changes the keys


def test_uneven_row_groups_match_xla():
    """One kv head and T = 1..32 query rows: with fewer kv heads than pool threads the
    kernel splits a head's rows into a group a thread, ceil-wise, so for some T (which ones
    depends on the pool's size, 3 to 16 threads) the last groups are short or empty."""
    cfg = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=64, num_layers=2,
                      num_heads=1, num_kv_heads=1, head_dim=64)
    rng = np.random.default_rng(0)
    shape = (cfg.num_layers, 1, 1, 64, cfg.head_dim)
    kc, vc = (jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(2))

    def call(q, kc, vc, p):
        return attention.cache_attention(q, kc, vc, jnp.int32(1), p, cfg, 16)
    for T in range(1, 33):
        q = jnp.asarray(rng.standard_normal((1, T, 1, cfg.head_dim), np.float32))
        positions = jnp.arange(20, 20 + T, dtype=jnp.int32)[None]
        kernel = np.asarray(jax.jit(call)(q, kc, vc, positions))
        with small_matmul.disabled():
            xla = np.asarray(jax.jit(call)(q, kc, vc, positions))
        np.testing.assert_allclose(kernel, xla, rtol=2e-5, atol=2e-5, err_msg=f"T={T}")


def test_each_row_is_bitwise_independent_of_the_rows_sharing_the_call():
    q, kc, vc, positions, new = _inputs(jnp.float32, B=1, T=8)
    call = jax.jit(lambda q, p, n: attention.cache_attention(q, kc, vc, jnp.int32(2), p, CFG,
                                                             16, n))
    full = np.asarray(call(q, positions, new))
    for t in range(8):  # token t alone, its own key patched in, the earlier ones from the cache
        cache_k = kc.at[2, 0, :, positions[0, :t]].set(jnp.moveaxis(new[0][0, :t], 0, 0))
        cache_v = vc.at[2, 0, :, positions[0, :t]].set(jnp.moveaxis(new[1][0, :t], 0, 0))
        alone = jax.jit(lambda q, kc, vc, p, n: attention.cache_attention(
            q, kc, vc, jnp.int32(2), p, CFG, 16, n))(
            q[:, t:t + 1], cache_k, cache_v, positions[:, t:t + 1],
            tuple(x[:, t:t + 1] for x in new))
        np.testing.assert_array_equal(np.asarray(alone)[0, 0], full[0, t], err_msg=f"t={t}")


def test_outside_the_kernel_the_blockwise_path_runs():
    q, kc, vc, positions, new = _inputs(jnp.float32)

    def lowered():  # a new function each time: the choice is made when it is traced
        return jax.jit(lambda q: attention.cache_attention(
            q, kc, vc, jnp.int32(0), positions, CFG, 16)).lower(q).as_text()

    assert "s2d_decode_attention" in lowered()
    with small_matmul.disabled():
        text = lowered()
    assert "s2d_decode_attention" not in text and "while" in text
