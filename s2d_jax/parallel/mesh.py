"""Mesh construction and the one logical-axis -> mesh-axis rule table.

Training and inference both place params, optimizer state, caches and batches through
`RULES`, so a parameter is split the same way wherever it lives.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh, PartitionSpec as P

from s2d_jax.config import ModelConfig
from s2d_jax.errors import S2DError

MESH_AXES = ("data", "fsdp", "tensor")

# The one logical-axis -> mesh-axis rule table, as Flax `logical_axis_rules`: a mesh axis
# (or tuple of them, or None = replicated) per logical name. Params, optimizer state,
# KV caches and batches are all placed through it.
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("cache_seq", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
    ("norm", None),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)


def make_mesh(mc: MeshConfig, devices=None) -> Mesh:
    devices = devices if devices is not None else jax.devices()
    n = math.prod(mc.shape)
    if n != len(devices):
        raise S2DError(
            f"mesh data={mc.data} x fsdp={mc.fsdp} x tensor={mc.tensor} = {n} devices, but "
            f"{len(devices)} are available; set mesh sizes whose product is {len(devices)}")
    return with_auto_axes(jax.make_mesh(mc.shape, MESH_AXES, devices=devices))


def with_auto_axes(mesh: Mesh | None) -> Mesh | None:
    """The same mesh with Auto axes: the model relies on GSPMD propagation from in/out
    shardings; under jax>=0.7's default Explicit axes its embedding gather has no
    resolvable output sharding."""
    if mesh is None:
        return None
    return Mesh(mesh.devices, mesh.axis_names,
                axis_types=(jax.sharding.AxisType.Auto,) * mesh.devices.ndim)


def partition_spec(logical: tuple) -> P:
    """Mesh PartitionSpec of an array whose axes have the logical names `logical`."""
    import flax.linen as nn  # here: a one-device run never imports flax (~0.2 s)
    return nn.logical_to_mesh_axes(logical, RULES)


def logical_to_mesh_sharding(logical_specs, mesh: Mesh):
    """A pytree of logical PartitionSpecs (e.g. `nn.get_partition_spec` of boxed params)
    -> the same tree of NamedShardings on `mesh`."""
    import flax.linen as nn
    return nn.logical_to_mesh_sharding(logical_specs, mesh, RULES)


def check_divisible(cfg: ModelConfig, mc: MeshConfig, what: str = "model") -> None:
    """Refuse a tensor/fsdp axis that does not divide the dimensions it splits."""
    dims = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    for name, size in dims.items():
        if size % mc.tensor:
            raise S2DError(f"mesh tensor={mc.tensor} does not divide {what}.{name}={size}; "
                           f"choose a tensor size dividing it")
    if cfg.hidden_size % mc.fsdp:
        raise S2DError(f"mesh fsdp={mc.fsdp} does not divide {what}.hidden_size="
                       f"{cfg.hidden_size}; choose an fsdp size dividing it")
