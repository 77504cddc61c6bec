"""Stacked KV cache: k, v [layers, batch, kv_heads, max_len, head_dim] plus per-row lengths.

Slot index == absolute position, so rolling back rejected tokens only moves `lengths`;
attention masks keys by position (key slot <= query position), so stale slots past a row's
length are never read before they are overwritten.

Why kv_heads before the slots: attention contracts each kv head's [slots, head_dim] block
with its queries, a batched matmul over (batch, kv head). Stored [.., slots, kv_heads, ..]
the CPU backend transposed every layer's whole K and V buffer on every decode step to get
there (SmolLM2-135M, 30 layers, 1280 slots: ~20% of a target step).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from s2d_jax.config import ModelConfig
from s2d_jax.parallel.memory import cache_shape


@struct.dataclass
class KVCache:
    k: jnp.ndarray  # [L, B, KV, S, Hd]
    v: jnp.ndarray  # [L, B, KV, S, Hd]
    lengths: jnp.ndarray  # [B] int32: tokens held per row

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def next_positions(self, num_tokens: int) -> jnp.ndarray:
        """Positions [B, num_tokens] that the next `num_tokens` tokens of each row occupy."""
        return self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]

    def with_lengths(self, lengths: jnp.ndarray) -> "KVCache":
        """Advance or roll back: only the lengths move, no data is copied."""
        return self.replace(lengths=lengths.astype(jnp.int32))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = cache_shape(cfg, batch, max_len)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))
