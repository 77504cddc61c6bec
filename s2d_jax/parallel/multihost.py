"""Running over many hosts and devices: joining a multi-host run and the `--mesh` flag.

Multi-host: every process runs the same program; `maybe_initialize_distributed()` joins
the run when JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID are set (GPU
clusters, CPU tests), or when JAX_AUTO_DISTRIBUTED=1 asks JAX to discover the cluster
itself (TPU pods, SLURM). Each process then feeds only its own rows
(`jax.make_array_from_process_local_data` in train_step.global_batch).
"""

from __future__ import annotations

import os

import jax

from s2d_jax.config import ModelConfig
from s2d_jax.errors import S2DError
from s2d_jax.parallel.mesh import MESH_AXES, MeshConfig, check_divisible, make_mesh

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
