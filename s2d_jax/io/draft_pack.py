"""Draft packs: a sorted draft stored without the weights it shares with its target.

A draft made of the target's first layers shares the target's (tied) embedding and LM
head; storing them again would cost more than the draft's own layers (SmolLM2-135M: 28 M
embedding parameters vs 3.5 M per layer). A pack holds only the draft's layers and final
norm, int8 (symmetric, one scale per output channel) or bfloat16, and a fingerprint of the
embedding it was trained against, so it can only be completed with that target's:

    s2d_draft_pack.json   {"format", "version", "model": ModelConfig, "extra": {s2d_exits,
                           s2d_head_vocab, ...}, "weights", "embed_sha256", "target"}
    weights.safetensors   layers.<name> (+ layers.<name>.scale for int8), final_norm

The int8 layers are `model/quantize.py`'s int8 weights (`quantize_weight`), stored with `q`
in the weight's own shape and `scale` broadcastable to it. `io/checkpoint.load_draft` is
the loader of a `--draft` argument, pack or not.
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

from s2d_jax.config import ModelConfig, build, with_dtype
from s2d_jax.errors import S2DError
from s2d_jax.io.atomic import atomic_output_dir
from s2d_jax.io.outputs import DRAFT_PACK
from s2d_jax.model.params import param_shapes
from s2d_jax.model.quantize import INPUT_AXES, quantize_weight
from s2d_jax.readers import read_json

PACK_SIDECAR = "s2d_draft_pack.json"
PACK_WEIGHTS = "weights.safetensors"
PACK_FORMAT, PACK_VERSION = "s2d-jax-draft-pack", 1
WEIGHT_FORMATS = ("int8", "bfloat16")
SHARED = ("embed", "lm_head")  # taken from the target when the pack is loaded


def is_draft_pack(path: str) -> bool:
    return os.path.isfile(os.path.join(path, PACK_SIDECAR))


def embed_fingerprint(embed) -> str:
    """sha256 of the embedding rounded to bfloat16: the same for the target loaded in
    float32 or bfloat16, different for any other model's embedding."""
    return hashlib.sha256(np.ascontiguousarray(
        np.asarray(embed).astype(ml_dtypes.bfloat16)).tobytes()).hexdigest()


def quantize_int8(w: np.ndarray, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """A stacked layer matrix w [L, in axes (n_in of them)..., out axes...] as the pack
    stores it: int8 q of w's shape and a float32 scale per layer and output channel
    (shape [L, 1 (per input axis)..., out axes...]), by `model/quantize`'s int8 rule."""
    qw = quantize_weight(jnp.asarray(w, jnp.float32), n_in, bits=8, n_lead=1)
    lead, out = w.shape[:1], w.shape[1 + n_in:]
    return np.asarray(qw.q).reshape(w.shape), \
        np.asarray(qw.scale).reshape(lead + (1,) * n_in + out)


def dequantize_int8(q: np.ndarray, scale: np.ndarray, n_in: int) -> np.ndarray:
    """Inverse of `quantize_int8` (up to rounding), as `model/quantize` dequantizes (the
    same float32 product, in numpy: JAX's eager ops cost ~0.7 s of a warm start here)."""
    if q.shape[:1] + (1,) * n_in + q.shape[1 + n_in:] != scale.shape:
        raise S2DError(f"an int8 weight {q.shape} needs one scale per layer and output "
                       f"channel, got {scale.shape}; re-create the pack")
    return q.astype(np.float32) * scale.astype(np.float32)


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
        if name in INPUT_AXES and weights == "int8":
            tensors[f"layers.{name}"], tensors[f"layers.{name}.scale"] = quantize_int8(
                w, INPUT_AXES[name])
        elif name in INPUT_AXES:
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
    layers = {name: _pack_layer(t, name, shape, path)
              for name, shape in want["layers"].items()}
    if tuple(t.get("final_norm", np.zeros(0)).shape) != tuple(want["final_norm"]):
        raise S2DError(f"draft pack {path}: final_norm is missing or not "
                       f"{want['final_norm']}; re-create the pack")
    return {"layers": layers, "final_norm": t["final_norm"].astype(np.float32)}


def _pack_layer(t: dict, name: str, shape: tuple[int, ...], path: str) -> np.ndarray:
    """One stacked layer param of the pack as float32 (an int8 one dequantized)."""
    w, scale = t.get(f"layers.{name}"), t.get(f"layers.{name}.scale")
    if w is None or tuple(w.shape) != tuple(shape):
        raise S2DError(f"draft pack {path}: layers.{name} is missing or not {shape}; "
                       f"re-create the pack")
    if scale is None:
        return w.astype(np.float32)
    n_in = INPUT_AXES.get(name, 0)
    if not n_in or w.dtype != np.int8 or \
            tuple(scale.shape) != shape[:1] + (1,) * n_in + tuple(shape[1 + n_in:]):
        raise S2DError(f"draft pack {path}: layers.{name} has a scale but is not an int8 "
                       f"matrix with one scale per output channel; re-create the pack")
    return dequantize_int8(w, scale, n_in)


def load_draft_pack(path: str, target_params: dict, dtype=None, shardings=None
                    ) -> tuple[ModelConfig, dict, dict]:
    """(cfg, params, extra): the pack's layers completed with the target's shared weights
    (its embedding must be the one the pack was made with); `dtype` as
    `config.with_dtype`, the stored dtype being the draft's own (its sidecar's)."""
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
    cfg = with_dtype(cfg, dtype, cfg.param_dtype)
    dtype = cfg.param_dtype
    own = jax.tree.map(lambda x: jnp.asarray(x, dtype), _pack_layers(path, cfg))
    params = {**own, **{k: jnp.asarray(target_params[k], dtype) for k in SHARED
                        if k in target_params}}
    if shardings is not None:
        params = jax.device_put(params, jax.tree.map(
            lambda s: getattr(s, "sharding", s), shardings,
            is_leaf=lambda s: hasattr(s, "sharding")))
    return cfg, params, extra
