"""The TPU decode programs' cached attention kernel (model/tpu_attention.py), run in Pallas's
interpreter on this CPU: the same attention as the XLA-ops path for steps and verify
windows over several cache blocks (the grid steps past a row's last block re-point at it and
compute nothing), grouped and ungrouped heads, new keys attended before or after their
write, repeated positions and a 16-bit cache; and the engine's greedy output unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_gpu_attention import _case

from s2d_jax.model import attention, decode_scope, tpu_attention


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    # 128-slot grid steps: the 384-slot caches below span three of them
    monkeypatch.setattr(tpu_attention, "MAX_SLOTS", 128)


def _both(q, kc, vc, layer, pos, cfg, new_kv):
    with decode_scope.fused_attention(False):
        want = attention.cache_attention(q, kc, vc, jnp.int32(layer), pos, cfg, 64, new_kv)
    with decode_scope.fused_attention("tpu"):
        got = attention.cache_attention(q, kc, vc, jnp.int32(layer), pos, cfg, 64, new_kv)
    return np.asarray(got, np.float32), np.asarray(want, np.float32)


@pytest.mark.parametrize("heads,kv,positions,with_new", [
    (4, 2, [[5, 6, 7], [130, 131, 132]], True),    # a verify window, rows in different blocks
    (4, 4, [[0], [383]], True),                    # steps at the first and the last slot
    (4, 4, [[0], [383]], False),                   # ... their keys written before
    (8, 2, [[64, 64, 65, 66, 67]], True),          # a catch-up window repeating a position
    (2, 1, [[127, 128]], False),                   # a window across a grid step's edge
])
def test_the_kernel_attends_as_the_xla_ops_do(heads, kv, positions, with_new):
    cfg, q, kc, vc, pos, new = _case(heads, kv, positions, S=384)
    new_kv = new if with_new else None
    got, want = _both(q, kc, vc, 1, pos, cfg, new_kv)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # and it read the layer asked for: another layer's cache answers differently
    other, _ = _both(q, kc, vc, 2, pos, cfg, new_kv)
    assert np.max(np.abs(other - want)) > 1e-2


def test_slots_past_a_rows_position_are_not_attended():
    """Garbage (inf) in the grid step past the batch's last position's: not computed (a
    masked inf would still make 0 * inf = nan in the probabilities' matmul)."""
    cfg, q, kc, vc, pos, new = _case(4, 2, [[150, 151], [20, 21]], S=384)
    poison = jnp.arange(384)[None, None, None, :, None] >= 256
    kc, vc = (jnp.where(poison, jnp.inf, x) for x in (kc, vc))
    got, want = _both(q, kc, vc, 0, pos, cfg, new)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_a_bf16_cache_is_read_as_the_query_computes():
    cfg, q, kc, vc, pos, new = _case(4, 2, [[200, 201]], dtype=jnp.bfloat16, S=384)
    got, want = _both(q.astype(jnp.bfloat16), kc, vc, 0, pos, cfg, new)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_it_serves_only_lane_sized_blocks_and_decode_rows():
    kc = jnp.zeros((1, 1, 1, 384, 8))
    assert tpu_attention.usable(kc, 5 * 8)
    assert not tpu_attention.usable(kc, tpu_attention.MAX_ROWS + 1)  # a prefill's rows
    assert not tpu_attention.usable(jnp.zeros((1, 1, 1, 192, 8)), 4)  # 64-slot steps


def test_greedy_decoding_is_unchanged_with_the_kernel(monkeypatch):
    from test_engine import NEW, PROMPTS, make_decoder, reference
    calls = []
    real = tpu_attention.cache_softmax
    monkeypatch.setattr(tpu_attention, "cache_softmax",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    dec = make_decoder("s2d", (1, 2, 3), 3)
    jax.clear_caches()  # the scope is read when a program is traced
    try:
        with decode_scope.fused_attention("tpu"):
            out = dec.generate(PROMPTS, max_new_tokens=NEW, max_len=128, eos_id=-1,
                               thresholds=[0.3] * 3)
    finally:
        jax.clear_caches()  # no later test reuses the interpreted kernel's programs
    assert calls, "the kernel was not traced"
    for p, o in zip(PROMPTS, out):
        assert o["token_ids"] == reference(tuple(p)), p
