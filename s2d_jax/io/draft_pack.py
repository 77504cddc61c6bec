"""Draft packs: a sorted draft stored without the weights it shares with its target.

A draft made of the target's first layers shares the target's (tied) embedding and LM
head; storing them again would cost more than the draft's own layers (SmolLM2-135M: 28 M
embedding parameters vs 3.5 M per layer). A pack holds only the draft's layers and final
norm, int8 (symmetric, one scale per output channel) or bfloat16, and a fingerprint of the
embedding it was trained against, so it can only be completed with that target's:

    s2d_draft_pack.json   {"format", "version", "model": ModelConfig, "extra": {s2d_exits,
                           s2d_head_vocab, ...}, "weights", "embed_sha256", "target"}
    weights.safetensors   layers.<name> (+ layers.<name>.scale for int8), final_norm

`load_draft(path, target)` is the one loader of a `--draft` argument: a pack is completed
with the target's shared weights, anything else goes through `load_model`; either way a
sub-vocabulary head stored as `s2d_head_vocab` becomes params["head_ids"].
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from s2d_jax.config import ModelConfig, build
from s2d_jax.errors import S2DError
from s2d_jax.io.atomic import atomic_output_dir
from s2d_jax.io.outputs import DRAFT_PACK
from s2d_jax.model.params import param_shapes
from s2d_jax.readers import expand_path, read_json

PACK_SIDECAR = "s2d_draft_pack.json"
PACK_WEIGHTS = "weights.safetensors"
PACK_FORMAT, PACK_VERSION = "s2d-jax-draft-pack", 1
WEIGHT_FORMATS = ("int8", "bfloat16")
# Axes each layer matrix contracts over (its input); int8 keeps one scale per output.
CONTRACTED = {"wq": (1,), "wk": (1,), "wv": (1,), "wo": (1, 2), "w_gate": (1,),
              "w_up": (1,), "w_down": (1,)}
SHARED = ("embed", "lm_head")  # taken from the target when the pack is loaded


def is_draft_pack(path: str) -> bool:
    return os.path.isfile(os.path.join(path, PACK_SIDECAR))


def embed_fingerprint(embed) -> str:
    """sha256 of the embedding rounded to bfloat16: the same for the target loaded in
    float32 or bfloat16, different for any other model's embedding."""
    return hashlib.sha256(np.ascontiguousarray(
        np.asarray(embed).astype(ml_dtypes.bfloat16)).tobytes()).hexdigest()


def quantize_int8(w: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 with a float32 scale per output channel (max |w| over `axes`)."""
    w = np.asarray(w, np.float32)
    scale = np.max(np.abs(w), axis=axes, keepdims=True) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


def save_draft_pack(out_dir: str, cfg: ModelConfig, params: dict, extra: dict, *,
                    target_embed, target_name: str = "", weights: str = "int8",
                    overwrite: bool = False) -> None:
    """Write `params` minus the shared weights to `out_dir` (atomically)."""
    if weights not in WEIGHT_FORMATS:
        raise S2DError(f"draft pack weights {weights!r} are not supported; use one of "
                       f"{', '.join(WEIGHT_FORMATS)}")
    if np.shape(target_embed) != np.shape(params["embed"]):
        raise S2DError(f"the target's embedding {np.shape(target_embed)} does not match the "
                       f"draft's {np.shape(params['embed'])}; pack a draft of this target")
    fingerprint = embed_fingerprint(target_embed)
    if embed_fingerprint(params["embed"]) != fingerprint:
        raise S2DError("the draft's embedding differs from the target's (was it trained "
                       "with the embedding unfrozen?); a pack shares the target's, so keep "
                       "this draft as a full model instead")
    tensors = {"final_norm": np.asarray(params["final_norm"], np.float32)}
    for name, w in params["layers"].items():
        w = np.asarray(w, np.float32)
        if name in CONTRACTED and weights == "int8":
            tensors[f"layers.{name}"], tensors[f"layers.{name}.scale"] = quantize_int8(
                w, CONTRACTED[name])
        elif name in CONTRACTED:
            tensors[f"layers.{name}"] = w.astype(ml_dtypes.bfloat16)
        else:  # norms: tiny, kept exact
            tensors[f"layers.{name}"] = w
    sidecar = {"format": PACK_FORMAT, "version": PACK_VERSION,
               "model": dataclasses.asdict(cfg), "extra": dict(extra or {}),
               "weights": weights, "embed_sha256": fingerprint,
               "target": target_name}
    json.dumps(sidecar)  # fail before writing anything if extra is not JSON
    with atomic_output_dir(out_dir, overwrite, DRAFT_PACK) as tmp:
        save_file(tensors, os.path.join(tmp, PACK_WEIGHTS))
        with open(os.path.join(tmp, PACK_SIDECAR), "w") as f:
            json.dump(sidecar, f, indent=1)


def read_pack_config(path: str) -> tuple[ModelConfig, dict, dict]:
    """(cfg, extra, sidecar) of a draft pack."""
    sidecar = read_json(os.path.join(path, PACK_SIDECAR), "draft pack sidecar")
    if not isinstance(sidecar, dict) or sidecar.get("format") != PACK_FORMAT \
            or not isinstance(sidecar.get("model"), dict):
        raise S2DError(f"{path}/{PACK_SIDECAR} is not an s2d-jax draft pack sidecar; "
                       f"re-create the pack with python -m infer.convert pack-draft")
    if sidecar.get("version") != PACK_VERSION:
        raise S2DError(f"draft pack {path} has version {sidecar.get('version')}; this "
                       f"s2d-jax reads version {PACK_VERSION}: re-create the pack")
    return build(ModelConfig, sidecar["model"], "model"), dict(sidecar.get("extra") or {}), \
        sidecar


def _pack_layers(path: str, cfg: ModelConfig) -> dict:
    file = os.path.join(path, PACK_WEIGHTS)
    if not os.path.isfile(file):
        raise S2DError(f"draft pack {path} has no {PACK_WEIGHTS}; re-create the pack")
    try:
        t = load_file(file)
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise S2DError(f"cannot read {file} ({type(e).__name__}: {e}); re-create the pack")
    want = param_shapes(cfg)
    layers = {}
    for name, shape in want["layers"].items():
        w = t.get(f"layers.{name}")
        if w is None or tuple(w.shape) != tuple(shape):
            raise S2DError(f"draft pack {path}: layers.{name} is missing or not {shape}; "
                           f"re-create the pack")
        w = w.astype(np.float32)
        if f"layers.{name}.scale" in t:
            w = w * t[f"layers.{name}.scale"]
        layers[name] = w
    if tuple(t.get("final_norm", np.zeros(0)).shape) != tuple(want["final_norm"]):
        raise S2DError(f"draft pack {path}: final_norm is missing or not "
                       f"{want['final_norm']}; re-create the pack")
    return {"layers": layers, "final_norm": t["final_norm"].astype(np.float32)}


def load_draft_pack(path: str, target_params: dict, dtype=None, shardings=None
                    ) -> tuple[ModelConfig, dict, dict]:
    """(cfg, params, extra): the pack's layers completed with the target's shared weights
    (its embedding must be the one the pack was made with)."""
    from s2d_jax.io.checkpoint import normalize_dtype

    cfg, extra, sidecar = read_pack_config(path)
    embed = target_params.get("embed") if isinstance(target_params, dict) else None
    if embed is None or tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise S2DError(f"draft pack {path} needs its target's embedding "
                       f"[{cfg.vocab_size}, {cfg.hidden_size}]; pass the target it was "
                       f"packed for ({sidecar.get('target') or 'see ' + PACK_SIDECAR})")
    if embed_fingerprint(embed) != sidecar.get("embed_sha256"):
        raise S2DError(f"draft pack {path} was made for another target's embedding; pass "
                       f"the target it was packed for "
                       f"({sidecar.get('target') or 'see ' + PACK_SIDECAR})")
    dtype = normalize_dtype(dtype or cfg.param_dtype)
    cfg = dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype)
    own = jax.tree.map(lambda x: jnp.asarray(x, dtype), _pack_layers(path, cfg))
    params = {**own, **{k: jnp.asarray(target_params[k], dtype) for k in SHARED
                        if k in target_params}}
    if shardings is not None:
        params = jax.device_put(params, jax.tree.map(
            lambda s: getattr(s, "sharding", s), shardings,
            is_leaf=lambda s: hasattr(s, "sharding")))
    return cfg, params, extra


def with_head_ids(params: dict, cfg: ModelConfig, extra: dict, source: str) -> dict:
    """params plus "head_ids" when the draft has a sub-vocabulary head (`s2d_head_vocab`)."""
    ids = extra.get("s2d_head_vocab")
    if not ids:
        return params
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.min() < 0 \
            or arr.max() >= cfg.vocab_size or len(np.unique(arr)) != len(arr):
        raise S2DError(f"{source}: s2d_head_vocab must list distinct token ids in "
                       f"[0, {cfg.vocab_size}); re-export the draft")
    return {**params, "head_ids": jnp.asarray(arr, jnp.int32)}


def load_draft(path: str, target, dtype=None, shardings=None
               ) -> tuple[ModelConfig, dict, dict]:
    """(cfg, params, extra) of a `--draft`: a draft pack (completed with `target`: its
    params, or a model path whose shared weights are read) or any model `load_model` reads.
    """
    from s2d_jax.io.checkpoint import load_model

    path = expand_path(path)
    if os.path.isdir(path) and is_draft_pack(path):
        if isinstance(target, str):  # only the shared weights are needed: one layer
            target = load_model(target, num_layers=1)[1]
        cfg, params, extra = load_draft_pack(path, target, dtype, shardings)
    else:
        cfg, params, extra = load_model(path, dtype=dtype, shardings=shardings)
    return cfg, with_head_ids(params, cfg, extra, path), extra


def unpack_draft(path: str, target, out_dir: str, tokenizer_dir: str | None = None,
                 overwrite: bool = False) -> None:
    """A draft pack as a complete HF dir (full head: transformers has no sub-vocabulary
    head), e.g. as `assistant_model` of HF assisted generation."""
    from s2d_jax.io.hf import export_hf

    cfg, params, extra = load_draft(path, target, dtype="float32")
    params = {k: v for k, v in params.items() if k != "head_ids"}
    export_hf(params, cfg, out_dir, extra={k: v for k, v in extra.items()
                                           if k.startswith("s2d_")},
              tokenizer_dir=tokenizer_dir, overwrite=overwrite)
