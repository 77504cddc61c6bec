"""Per-device byte counts of sharded arrays and pytrees (what an AOT report adds up; the KV
cache's own shape and count live in model/kvcache.py)."""

from __future__ import annotations

import jax
import numpy as np


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


def addressable_bytes(tree, device) -> int:
    """Bytes of a pytree of jax arrays actually resident on `device`."""
    n = 0
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            if s.device == device:
                n += int(np.prod(s.data.shape, dtype=np.int64)) * x.dtype.itemsize
    return n
