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

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from s2d_jax.config import ModelConfig
from s2d_jax.parallel.memory import sharded_bytes
from s2d_jax.parallel.mesh import logical_to_mesh_sharding

# The logical axes of K and V, which `parallel/mesh.py`'s rules map to the mesh.
CACHE_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")


def cache_shape(cfg: ModelConfig, batch: int, max_len: int) -> tuple[int, ...]:
    """Shape of one of a KV cache's K and V arrays, in the order CACHE_AXES names."""
    return (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)


def cache_sharding(mesh):
    """KV cache [L, B, K, S, H] on `mesh`: rows over data x fsdp, kv heads over tensor."""
    return logical_to_mesh_sharding(P(*CACHE_AXES), mesh)


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, mesh=None) -> tuple[int, int]:
    """(total, per-device) bytes of one model's K and V caches for `batch` rows."""
    shape = cache_shape(cfg, batch, max_len)
    total = 2 * int(np.prod(shape, dtype=np.int64)) * np.dtype(cfg.dtype).itemsize
    if mesh is None:
        return total, total
    return total, 2 * sharded_bytes(shape, cfg.dtype, cache_sharding(mesh))


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


def write_slots(k_buf, v_buf, layer, positions, k, v):
    """K/V buffers [L, B, K, S, H] with k, v [B, T, K, H] written to layer `layer` at slots
    == positions [B, T] (slots past the cache are skipped), in place.

    Two forms of one scatter, by the platform the program is compiled for. On TPU every
    index but the head dim is explicit (the scatter's window is H alone): with K and H as
    its window the compiler lays the cache out heads-minor for the write ({4,2,3,1,0}),
    and where the kv heads a device holds are no multiple of its 8-row tiles (Vicuna-13B
    at tensor=4: 10) the attention's blocks want slots-minor ({4,3,2,1,0}), so it copied
    the whole cache between the two twice per layer (62.5 of the AR round's 69.3 GiB,
    docs/distributed.md). Elsewhere the K-and-H window stays: XLA:CPU runs a bf16 scatter
    through f32 and the H-window form costs 8x there, and the H100's program was checked
    free of relayouts in this form (tests/test_gpu_relayouts.py)."""
    return jax.lax.platform_dependent(k_buf, v_buf, layer, positions, k, v,
                                      tpu=_write_heads_explicit, default=_write_rows)


def _write_rows(k_buf, v_buf, layer, positions, k, v):
    """write_slots with the window [K, H]: one scatter index per (row, token)."""
    B, T = positions.shape
    bidx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    return (k_buf.at[layer, bidx, :, positions].set(k.astype(k_buf.dtype), mode="drop"),
            v_buf.at[layer, bidx, :, positions].set(v.astype(v_buf.dtype), mode="drop"))


def _write_heads_explicit(k_buf, v_buf, layer, positions, k, v):
    """write_slots with the window [H]: one scatter index per (row, kv head, token)."""
    B, T, K, _ = k.shape
    bi = jnp.arange(B)[:, None, None]
    ki = jnp.arange(K)[None, :, None]
    kt, vt = (jnp.swapaxes(x, 1, 2) for x in (k, v))  # [B, K, T, H]: the cache's order
    pos = positions[:, None, :]
    return (k_buf.at[layer, bi, ki, pos].set(kt.astype(k_buf.dtype), mode="drop"),
            v_buf.at[layer, bi, ki, pos].set(vt.astype(v_buf.dtype), mode="drop"))


def write_layers(cache: KVCache, start: int, k: jnp.ndarray, v: jnp.ndarray,
                 positions: jnp.ndarray) -> KVCache:
    """Write keys/values k, v [L', B, T, K, H] of layers [start, start + L') at positions
    [L', B, T] or [B, T] (slots past the cache, e.g. max_len, are skipped), in place."""
    L, B, T, K, _ = k.shape
    li = jnp.arange(start, start + L)[:, None, None, None]
    bi = jnp.arange(B)[None, :, None, None]
    ki = jnp.arange(K)[None, None, :, None]
    pos = jnp.broadcast_to(positions, k.shape[:3])[:, :, None, :]
    # Every index but the head dim is explicit, so the scatter's window is H alone. With
    # K and H as its window (`.at[li, bi, :, pos]`), the TPU compiler laid the draft cache
    # out [B, L, S, K, H] for the scatter, against the attention's [L, B, K, S, H], and
    # copied both draft caches whole at each S2D draft step's cond (12 copies, 0.56 GiB a
    # round for the 70B target's 12-layer draft on v5p; tests/test_tpu_aot.py).
    kt, vt = (jnp.swapaxes(x, 2, 3) for x in (k, v))  # [L', B, K, T, H]: the cache's order
    return cache.replace(k=cache.k.at[li, bi, ki, pos].set(kt.astype(cache.k.dtype), mode="drop"),
                         v=cache.v.at[li, bi, ki, pos].set(vt.astype(cache.v.dtype), mode="drop"))


def ordered_after(x: jnp.ndarray, *writes: jnp.ndarray) -> tuple[jnp.ndarray, ...]:
    """The new keys/values `writes` (floating) as values XLA can only compute after x (each plus a
    zero it cannot fold: min(isnan(x's first element), 0)). Why: a write of new K/V after
    reads of the cache that x depends on (a layer's attention) must not be scheduled
    before them, or XLA copies the whole cache to keep the version the read needs; an
    optimization_barrier did not survive XLA:CPU's passes as an ordering. The dependence
    rides on the written values, not on the cache: a no-op write of one cache slot (the
    previous way) made XLA:CPU rewrite the whole cache every draft step, its read of the
    slot inside the update's fusion keeping it from updating in place (0.5 ms for an
    8-layer 1280-slot cache, 2.4 ms for 30 layers, measured)."""
    zero = jnp.minimum(jnp.isnan(x.reshape(-1)[0]).astype(jnp.float32), 0.0)
    return tuple(w + zero.astype(w.dtype) for w in writes)
