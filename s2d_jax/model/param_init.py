"""Random params, their shapes and their shardings, read off the parameter table.

Plain functions of `params.PARAMS`: each row says its path, logical axes (hence shape and
sharding) and init; nothing here restates them.

The random draw keeps the keys the earlier Flax Linen modules derived (so a seed gives
the same model as before, bit for bit: the demo family is trained from a seeded init):
a top-level row's key folds in its 1-based creation count, a layer row's folds in
("layers", its 1-based position among the layer rows) into that layer's share of
`split(key, num_layers)`; each fold is one SHA-1 of those items (Flax's `LazyRng`).
"""

from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from s2d_jax.config import ModelConfig
from s2d_jax.model.params import LAYER_PARAMS, Param, active_params, shape_of
from s2d_jax.parallel.mesh import logical_to_mesh_sharding


def _fold_in(key: jax.Array, *items) -> jax.Array:
    """`key` with the SHA-1 of `items` (strings, non-negative ints) folded in."""
    digest = hashlib.sha1()
    for x in items:
        digest.update(x.encode() if isinstance(x, str)
                      else x.to_bytes((x.bit_length() + 7) // 8, "big"))
    return jax.random.fold_in(key, jnp.uint32(int.from_bytes(digest.digest()[:4], "big")))


def _draw(row: Param, cfg: ModelConfig, key: jax.Array, std: float) -> jnp.ndarray:
    """One tensor of `row` (one layer's slice for a stacked row): normal(std), drawn in
    float32, or ones, in cfg.param_dtype."""
    shape, dtype = shape_of(row, cfg), jnp.dtype(cfg.param_dtype)
    if row.init == "ones":
        return jnp.ones(shape, dtype)
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "std"))
def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> dict:
    """Random params (normal(std) matrices, unit norms) in `cfg.param_dtype`: a plain dict.

    Jitted so that one compile builds every tensor (eagerly, each draw compiles its own;
    it also keeps the draws bitwise what they were under the Linen init)."""
    top = [p for p in active_params(cfg) if not p.stacked]
    params = {row.path: _draw(row, cfg, _fold_in(key, n), std) for n, row in enumerate(top, 1)}
    layer_keys = jax.random.split(key, cfg.num_layers)
    params["layers"] = {
        row.name: jax.vmap(lambda k, row=row, n=n: _draw(row, cfg, _fold_in(k, "layers", n), std))(
            layer_keys)
        for n, row in enumerate(LAYER_PARAMS, 1)}
    return params


def abstract_params(cfg: ModelConfig) -> dict:
    """Param shapes/dtypes as ShapeDtypeStructs, with no memory allocated."""
    return jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))


@functools.lru_cache(maxsize=64)
def logical_param_specs(cfg: ModelConfig) -> dict:
    """Params-shaped tree of PartitionSpecs of logical axis names: each row's axes, with
    "layers" in front for the stacked rows."""
    specs: dict = {}
    for row in active_params(cfg):
        if row.stacked:
            specs.setdefault("layers", {})[row.name] = P("layers", *row.axes)
        else:
            specs[row.path] = P(*row.axes)
    return specs


def param_shardings(cfg: ModelConfig, mesh):
    """Params-shaped tree of NamedShardings from the one rule table (`mesh.RULES`)."""
    return logical_to_mesh_sharding(logical_param_specs(cfg), mesh)
