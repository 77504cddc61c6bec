"""Params checkpoints with orbax, and `load_model`: the one loading entry point of every CLI.

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
import orbax.checkpoint as ocp

from s2d_jax.config import DTYPES, ModelConfig, build, read_hf_config
from s2d_jax.errors import S2DError
from s2d_jax.io.atomic import atomic_output_dir
from s2d_jax.io.outputs import CHECKPOINT
from s2d_jax.model.params import param_shapes
from s2d_jax.readers import expand_path, read_json

SIDECAR = "s2d_config.json"
PARAMS_ITEM = "params"
FORMAT, VERSION = "s2d-jax-params", 1


def normalize_dtype(dtype) -> str:
    """'bfloat16' / jnp.bfloat16 / np.float32 ... -> one of config.DTYPES, else S2DError."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in DTYPES:
        raise S2DError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return name


# chat_template.jinja / .json: where transformers >= 4.43 saves the chat template
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")


def tokenizer_files(directory: str | None, required: bool = False) -> list[str]:
    """Paths of the tokenizer files in `directory` (checkpoints carry them along)."""
    if directory is None:
        return []
    found = [os.path.join(directory, f) for f in TOKENIZER_FILES
             if os.path.isfile(os.path.join(directory, f))]
    if required and not has_tokenizer(directory):
        raise S2DError(f"no tokenizer files in {directory} (expected tokenizer.model or "
                       f"tokenizer.json); pass a tokenizer directory")
    return found


def has_tokenizer(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, f))
               for f in ("tokenizer.model", "tokenizer.json"))


def is_params_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, SIDECAR))


def checkpoint_kind(path: str) -> str:
    """'gguf' (a .gguf file), 'params' (orbax params checkpoint), 'draft-pack' (a draft
    without its target's shared weights, `io.draft_pack`) or 'hf' (HF model dir);
    S2DError for anything else. The one place that tells the model formats apart."""
    if str(path).lower().endswith(".gguf"):
        return "gguf"
    if not os.path.isdir(path):
        raise S2DError(f"model path {path} is not a directory; pass an HF model dir, a "
                       f"checkpoint written by `python -m infer.convert hf-to-orbax` or a "
                       f".gguf file")
    if is_params_checkpoint(path):
        return "params"
    if os.path.isfile(os.path.join(path, "s2d_draft_pack.json")):  # io.draft_pack
        return "draft-pack"
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    raise S2DError(f"{path} holds neither {SIDECAR} (params checkpoint) nor config.json "
                   f"(HF model); pass a model directory")


def save_params(out_dir: str, params: dict, cfg: ModelConfig, extra: dict | None = None,
                overwrite: bool = False, tokenizer_dir: str | None = None) -> None:
    """Write params (numpy or jax arrays, any sharding) + the config sidecar, atomically,
    plus the tokenizer files of `tokenizer_dir` (so the dir is a complete model)."""
    tok_files = tokenizer_files(tokenizer_dir, required=True)
    dtype = np.dtype(params["embed"].dtype).name
    if dtype in DTYPES:
        cfg = dataclasses.replace(cfg, param_dtype=dtype)
    sidecar = {"format": FORMAT, "version": VERSION, "model": dataclasses.asdict(cfg),
               "extra": dict(extra or {})}
    json.dumps(sidecar)  # fail before writing anything if extra is not JSON
    with atomic_output_dir(out_dir, overwrite, CHECKPOINT) as tmp:
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


def restore_params(ckpt_dir: str, num_layers: int | None = None, dtype=None, shardings=None,
                   host: bool = False) -> tuple[ModelConfig, dict, dict]:
    """(cfg, params, extra) from a params checkpoint.

    `shardings`: params-shaped tree of Shardings (or ShapeDtypeStructs with `.sharding`) for
    the returned cfg; default: one local device, or numpy arrays if `host`. `num_layers`
    reads only the first N layers; `dtype` casts (and sets cfg.dtype and param_dtype).
    """
    cfg, extra = read_params_config(ckpt_dir)
    item = os.path.join(os.path.abspath(ckpt_dir), PARAMS_ITEM)
    ckptr = ocp.StandardCheckpointer()
    try:
        stored = ckptr.metadata(item).item_metadata.tree
    except Exception as e:  # orbax raises assorted types for a missing/damaged item
        raise S2DError(f"cannot read the params in {item} ({type(e).__name__}); "
                       f"re-create the checkpoint")
    want = param_shapes(cfg)
    stored_shapes = jax.tree.map(lambda m: tuple(m.shape), stored)
    if stored_shapes != want:  # plain nested dicts of tuples: structure and shapes
        raise S2DError(f"params in {ckpt_dir} do not match its {SIDECAR} (shapes differ); "
                       f"re-create the checkpoint")
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise S2DError(f"num_layers={num_layers} is outside 1..{cfg.num_layers} "
                           f"(the layers in {ckpt_dir})")
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    if dtype is not None:
        dtype = normalize_dtype(dtype)
        cfg = dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype)
    shapes = param_shapes(cfg)
    if host or shardings is None:
        # host: the CPU backend (present on every host) so numpy views need no copy
        device = jax.local_devices(backend="cpu")[0] if host else jax.local_devices()[0]
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), shapes,
                                 is_leaf=_is_shape)

    def target(shape, meta, sharding):
        sharding = getattr(sharding, "sharding", sharding)
        return jax.ShapeDtypeStruct(shape, dtype or meta.dtype, sharding=sharding)

    abstract = jax.tree.map(target, shapes, stored, shardings, is_leaf=_is_shape)
    # strict=False lets the layer axis be truncated; all other shapes were checked above.
    params = ckptr.restore(item, abstract, strict=num_layers is None)
    ckptr.close()
    if host:
        params = jax.tree.map(np.asarray, params)
    return cfg, params, extra


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def load_model(path: str, num_layers: int | None = None, dtype=None, shardings=None
               ) -> tuple[ModelConfig, dict, dict]:
    """(cfg, params, extra) from an HF model dir, a params checkpoint dir or a GGUF file.

    num_layers: keep the first N decoder layers (draft init from a target). dtype: cast the
    params and use it as compute dtype too (cfg.dtype = cfg.param_dtype = dtype); default
    keeps the stored dtype. shardings: params-shaped tree of Shardings for the returned cfg
    (e.g. `model.transformer.param_shardings(cfg, mesh)`); default one local device.
    extra: non-ModelConfig settings such as a draft's `s2d_exits`.
    """
    from s2d_jax.io import gguf, hf  # both import this module: import them when called

    path = expand_path(path)
    kind = checkpoint_kind(path)
    if kind == "gguf":
        return gguf.load_gguf(path, num_layers, dtype, shardings)
    if kind == "params":
        return restore_params(path, num_layers, dtype, shardings)
    if kind == "draft-pack":
        raise S2DError(f"{path} is a draft pack: it lacks the weights it shares with its "
                       f"target; pass it as --draft next to its target (load_draft), or "
                       f"make a full model with python -m infer.convert unpack-draft")
    return hf.load_hf(path, num_layers, dtype, shardings)


def stored_model_config(path: str) -> ModelConfig:
    """The ModelConfig of a params checkpoint, HF dir or GGUF file, reading no weight."""
    from s2d_jax.io import gguf  # gguf imports this module: import it when called

    kind = checkpoint_kind(path)
    if kind == "gguf":
        return gguf.read_gguf_config(path)
    if kind == "params":
        return read_params_config(path)[0]
    if kind == "draft-pack":
        from s2d_jax.io.draft_pack import read_pack_config
        return read_pack_config(path)[0]
    return read_hf_config(path)
