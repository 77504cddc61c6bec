"""Per-device byte counts of sharded pytrees and KV caches (what an AOT report adds up)."""

from __future__ import annotations

import jax
import numpy as np

from s2d_jax.config import ModelConfig
from s2d_jax.parallel.mesh import cache_sharding


def sharded_bytes(shape, dtype, sharding) -> int:
    """Bytes one device holds of an array of `shape` placed with `sharding` (the largest
    shard: uneven splits are padded to the largest)."""
    shard = sharding.shard_shape(tuple(shape)) if sharding is not None else tuple(shape)
    return int(np.prod(shard, dtype=np.int64)) * np.dtype(dtype).itemsize


def tree_bytes_per_device(tree) -> int:
    """Bytes one device holds of a pytree of arrays / ShapeDtypeStructs with shardings."""
    return sum(sharded_bytes(x.shape, x.dtype, getattr(x, "sharding", None))
               for x in jax.tree.leaves(tree))


def tree_bytes(tree) -> int:
    return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def cache_shape(cfg: ModelConfig, batch: int, max_len: int) -> tuple[int, ...]:
    """Shape of one of a KV cache's K and V arrays (model/kvcache.py), laid out as
    mesh.CACHE_AXES names its axes."""
    return (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, mesh=None) -> tuple[int, int]:
    """(total, per-device) bytes of one model's K and V caches for `batch` rows."""
    shape = cache_shape(cfg, batch, max_len)
    total = 2 * int(np.prod(shape, dtype=np.int64)) * np.dtype(cfg.dtype).itemsize
    if mesh is None:
        return total, total
    return total, 2 * sharded_bytes(shape, cfg.dtype, cache_sharding(mesh))


def addressable_bytes(tree, device) -> int:
    """Bytes of a pytree of jax arrays actually resident on `device`."""
    n = 0
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            if s.device == device:
                n += int(np.prod(s.data.shape, dtype=np.int64)) * x.dtype.itemsize
    return n
