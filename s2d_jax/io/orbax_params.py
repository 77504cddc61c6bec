"""Params checkpoints with orbax: this project's own model format.

A params checkpoint is a self-describing directory:
    s2d_config.json   {"format": "s2d-jax-params", "version": 1, "model": ModelConfig fields,
                       "extra": {...}}   (extra: e.g. a draft's "s2d_exits")
    params/           orbax StandardCheckpointer item holding the params pytree
    tokenizer.model, tokenizer_config.json, ...   (optional) copied from the source model
Restoring takes target shardings, so each shard is read straight onto its devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np

from s2d_jax.config import ModelConfig, build, first_layers, stored_dtype, with_dtype
from s2d_jax.errors import S2DError
from s2d_jax.io.atomic import atomic_output_dir
from s2d_jax.io.outputs import CHECKPOINT
from s2d_jax.io.tokenizer import tokenizer_files
from s2d_jax.model.params import param_shapes
from s2d_jax.readers import read_json

SIDECAR = "s2d_config.json"
PARAMS_ITEM = "params"
FORMAT, VERSION = "s2d-jax-params", 1


def is_params_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, SIDECAR))


def save_params(out_dir: str, params: dict, cfg: ModelConfig, extra: dict | None = None,
                overwrite: bool = False, tokenizer_dir: str | None = None) -> None:
    """Write params (numpy or jax arrays, any sharding) + the config sidecar, atomically,
    plus the tokenizer files of `tokenizer_dir` (so the dir is a complete model)."""
    tok_files = tokenizer_files(tokenizer_dir, required=True)
    cfg = dataclasses.replace(cfg, param_dtype=stored_dtype(params["embed"].dtype))
    sidecar = {"format": FORMAT, "version": VERSION, "model": dataclasses.asdict(cfg),
               "extra": dict(extra or {})}
    json.dumps(sidecar)  # fail before writing anything if extra is not JSON
    with atomic_output_dir(out_dir, overwrite, CHECKPOINT) as tmp:
        import orbax.checkpoint as ocp  # here: its import is ~0.5 s that HF loads skip
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(os.path.join(tmp, PARAMS_ITEM), params)
        ckptr.wait_until_finished()
        ckptr.close()
        with open(os.path.join(tmp, SIDECAR), "w") as f:
            json.dump(sidecar, f, indent=2)
        for path in tok_files:
            shutil.copy2(path, tmp)


def read_params_config(ckpt_dir: str) -> tuple[ModelConfig, dict]:
    path = os.path.join(ckpt_dir, SIDECAR)
    if not os.path.isfile(path):
        raise S2DError(f"{ckpt_dir} has no {SIDECAR}; pass a dir written by save_params")
    sidecar = read_json(path, "checkpoint sidecar")
    if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT \
            or not isinstance(sidecar.get("model"), dict):
        raise S2DError(f"{path} is not an s2d-jax params sidecar; re-create the checkpoint")
    return build(ModelConfig, sidecar["model"], "model"), dict(sidecar.get("extra") or {})


def _stored_tree(ckptr, item: str, cfg: ModelConfig, ckpt_dir: str):
    """The orbax metadata of the stored params, S2DError unless it matches `cfg`'s shapes."""
    try:
        stored = ckptr.metadata(item).item_metadata.tree
    except Exception as e:  # orbax raises assorted types for a missing/damaged item
        raise S2DError(f"cannot read the params in {item} ({type(e).__name__}); "
                       f"re-create the checkpoint")
    stored_shapes = jax.tree.map(lambda m: tuple(m.shape), stored)
    if stored_shapes != param_shapes(cfg):  # plain nested dicts: structure and shapes
        raise S2DError(f"params in {ckpt_dir} do not match its {SIDECAR} (shapes differ); "
                       f"re-create the checkpoint")
    return stored


def restore_params(ckpt_dir: str, num_layers: int | None = None, dtype=None, shardings=None,
                   host: bool = False) -> tuple[ModelConfig, dict, dict]:
    """(cfg, params, extra) from a params checkpoint.

    `shardings`: params-shaped tree of Shardings (or ShapeDtypeStructs with `.sharding`) for
    the returned cfg; default: one local device, or numpy arrays if `host`. `num_layers`
    reads only the first N layers; `dtype` as `config.with_dtype`.
    """
    cfg, extra = read_params_config(ckpt_dir)
    item = os.path.join(os.path.abspath(ckpt_dir), PARAMS_ITEM)
    import orbax.checkpoint as ocp
    ckptr = ocp.StandardCheckpointer()
    stored = _stored_tree(ckptr, item, cfg, ckpt_dir)
    cfg = first_layers(cfg, num_layers, ckpt_dir)
    cfg = with_dtype(cfg, dtype, stored["embed"].dtype)
    shapes = param_shapes(cfg)
    if host or shardings is None:
        # host: the CPU backend (present on every host) so numpy views need no copy
        device = jax.local_devices(backend="cpu")[0] if host else jax.local_devices()[0]
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), shapes,
                                 is_leaf=_is_shape)

    def target(shape, meta, sharding):
        sharding = getattr(sharding, "sharding", sharding)
        cast = cfg.param_dtype if dtype is not None else meta.dtype
        return jax.ShapeDtypeStruct(shape, cast, sharding=sharding)

    abstract = jax.tree.map(target, shapes, stored, shardings, is_leaf=_is_shape)
    # strict=False lets the layer axis be truncated; all other shapes were checked above.
    params = ckptr.restore(item, abstract, strict=num_layers is None)
    ckptr.close()
    if host:
        params = jax.tree.map(np.asarray, params)
    return cfg, params, extra


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)
