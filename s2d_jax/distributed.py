"""Running over many devices and hosts: joining a multi-host run, the `--mesh` flag, placing
a model's params on a mesh by the shared logical-axis rules, and per-device byte counts.

Multi-host: every process runs the same program; `maybe_initialize_distributed()` joins
the run when JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID are set (GPU
clusters, CPU tests), or when JAX_AUTO_DISTRIBUTED=1 asks JAX to discover the cluster
itself (TPU pods, SLURM). Each process then feeds only its own rows
(`jax.make_array_from_process_local_data` in train_step.global_batch).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from s2d_jax.config import ModelConfig
from s2d_jax.errors import S2DError
from s2d_jax.sharding import (CACHE_AXES, MESH_AXES, MeshConfig, check_divisible,
                              logical_to_sharding, make_mesh, spec)

COORDINATOR_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def maybe_initialize_distributed() -> bool:
    """Join a multi-host run when the coordinator env vars are set; no-op otherwise.

    Returns True when this process is part of an initialized multi-process run. Must run
    before anything queries devices (the backend starts with the first query).
    """
    given = [k for k in COORDINATOR_ENV if os.environ.get(k)]
    auto = os.environ.get("JAX_AUTO_DISTRIBUTED", "") not in ("", "0")
    if not given and not auto:
        return False
    if jax.distributed.is_initialized():
        return True
    if given and len(given) != len(COORDINATOR_ENV):
        missing = sorted(set(COORDINATOR_ENV) - set(given))
        raise S2DError(f"multi-host launch needs all of {', '.join(COORDINATOR_ENV)}; "
                       f"{', '.join(missing)} not set")
    if given:
        try:
            num, pid = int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"])
        except ValueError:
            raise S2DError("JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers")
        if not 0 <= pid < num:
            raise S2DError(f"JAX_PROCESS_ID={pid} is outside 0..{num - 1} "
                           f"(JAX_NUM_PROCESSES={num})")
        jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                                   num_processes=num, process_id=pid)
    else:  # TPU pod / SLURM: JAX reads the cluster from its environment
        jax.distributed.initialize()
    return True


def parse_mesh(text: str | None) -> MeshConfig | None:
    """'data=2,tensor=4' -> MeshConfig(data=2, fsdp=1, tensor=4); None/'' -> None."""
    if not text:
        return None
    sizes = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in MESH_AXES:
            raise S2DError(f"bad --mesh entry {part.strip()!r}; use AXIS=SIZE with AXIS in "
                           f"{', '.join(MESH_AXES)}, e.g. data=2,tensor=4")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise S2DError(f"mesh {name}={value} must be a positive integer")
        sizes[name] = size
    return MeshConfig(**sizes)


def build_mesh(mc: MeshConfig, cfgs: dict[str, ModelConfig], devices=None):
    """Check that the mesh fits the devices and splits every model evenly, then make it."""
    mesh = make_mesh(mc, devices)  # raises when the product is not the device count
    for what, cfg in cfgs.items():
        check_divisible(cfg, mc, what)
    return mesh


def param_shardings(cfg: ModelConfig, mesh):
    """Params-shaped tree of NamedShardings: heads, kv heads, mlp and vocab over `tensor`,
    embed over `fsdp` (the rules every part of s2d-jax shares)."""
    from s2d_jax.model import param_axes
    return logical_to_sharding(param_axes(cfg), mesh)


def cache_sharding(mesh):
    """KV cache [L, B, S, K, H]: rows over data x fsdp, kv heads over tensor."""
    return jax.sharding.NamedSharding(mesh, spec(CACHE_AXES))


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


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, mesh=None) -> tuple[int, int]:
    """(total, per-device) bytes of one model's K and V caches for `batch` rows."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    total = 2 * int(np.prod(shape, dtype=np.int64)) * np.dtype(cfg.dtype).itemsize
    if mesh is None:
        return total, total
    return total, 2 * sharded_bytes(shape, cfg.dtype, cache_sharding(mesh))


def stored_model_config(path: str) -> ModelConfig:
    """The ModelConfig of a params checkpoint or HF dir, without reading any weight."""
    from s2d_jax.checkpoint import is_params_checkpoint, read_params_config
    from s2d_jax.config import read_hf_config
    if not os.path.isdir(path):
        raise S2DError(f"model path {path} is not a directory; pass an HF model dir or a "
                       f"checkpoint written by `python -m infer.convert hf-to-orbax`")
    if is_params_checkpoint(path):
        return read_params_config(path)[0]
    return read_hf_config(path)
