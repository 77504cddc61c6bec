"""Stacked KV cache: k, v [layers, batch, max_len, kv_heads, head_dim] plus per-row lengths.

Slot index == absolute position, so rolling back rejected tokens only moves `lengths`;
attention masks keys by position (key slot <= query position), so stale slots past a row's
length are never read before they are overwritten.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from s2d_jax.config import ModelConfig


@struct.dataclass
class KVCache:
    k: jnp.ndarray  # [L, B, S, KV, Hd]
    v: jnp.ndarray  # [L, B, S, KV, Hd]
    lengths: jnp.ndarray  # [B] int32: tokens held per row

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def next_positions(self, num_tokens: int) -> jnp.ndarray:
        """Positions [B, num_tokens] that the next `num_tokens` tokens of each row occupy."""
        return self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]

    def with_lengths(self, lengths: jnp.ndarray) -> "KVCache":
        """Advance or roll back: only the lengths move, no data is copied."""
        return self.replace(lengths=lengths.astype(jnp.int32))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))
