"""Float weights -> quantize.QuantizedWeight in GGUF's block layouts, as ggml quantizes
(ggml-quants.c's reference rounding, scales and minimums through float16 as a GGUF stores
them), for the quantized matmul's tests and benchmark without a GGUF file at hand.

Blocks of `group` (GGUF: 32) consecutive input elements per output column:
    Q8_0  d = absmax / 127, q = round(x / d) in [-127, 127]             w = d * q
    Q4_0  d = -(signed max) / 8, q = min(15, int(x / d + 8.5)) - 8       w = d * q
    Q4_1  d = (max - min) / 15, m = min, q = min(15, int((x - m) / d + 0.5))  w = d * q + m
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from s2d_jax.model.quantize import INPUT_AXES, QuantizedWeight, _pack_int4

FORMATS = ("Q8_0", "Q4_0", "Q4_1")


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)


def _round_away(v: np.ndarray) -> np.ndarray:  # C's roundf: halves away from zero
    return np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))


def quantize_blocks(w, n_in_axes: int, fmt: str, group: int = 32, n_lead: int = 0) -> QuantizedWeight:
    """w [lead..., in axes..., out axes...] -> a QuantizedWeight of format `fmt` with blocks
    of `group` along the flattened input dim."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown block format {fmt!r}; use one of {FORMATS}")
    w = np.asarray(w, np.float32)
    lead, inner = w.shape[:n_lead], w.shape[n_lead:]
    n_in, n_out = math.prod(inner[:n_in_axes]), math.prod(inner[n_in_axes:])
    if n_in % group or group % 2:
        raise ValueError(f"group {group} must be even and divide the input dim {n_in}")
    x = w.reshape(lead + (n_in // group, group, n_out))
    offset = None
    if fmt == "Q8_0":
        d = np.abs(x).max(axis=-2, keepdims=True) / np.float32(127)
        q = _round_away(x * _inverse(d))
        scale = _f16(d)
    elif fmt == "Q4_0":
        idx = np.abs(x).argmax(axis=-2)[..., None, :]
        d = np.take_along_axis(x, idx, axis=-2) / np.float32(-8)
        q = np.minimum(15, np.trunc(x * _inverse(d) + np.float32(8.5))) - 8
        scale = _f16(d)
    else:
        lo, hi = x.min(axis=-2, keepdims=True), x.max(axis=-2, keepdims=True)
        d = (hi - lo) / np.float32(15)
        q = np.minimum(15, np.trunc((x - lo) * _inverse(d) + np.float32(0.5)))
        scale, offset = _f16(d), jnp.asarray(_f16(lo))
    q = jnp.asarray(q.astype(np.int8).reshape(lead + (n_in, n_out)))
    bits = 8 if fmt == "Q8_0" else 4
    return QuantizedWeight(q=q if bits == 8 else _pack_int4(q), scale=jnp.asarray(scale),
                           shape=tuple(inner), group=group, bits=bits, offset=offset)


def quantize_model(params: dict, fmt: str, group: int = 32) -> dict:
    """The layer matrices and an untied lm_head of a model.py params dict in `fmt` (norms and
    the embedding stay as they are)."""
    layers = dict(params["layers"])
    for name, n_axes in INPUT_AXES.items():
        layers[name] = quantize_blocks(layers[name], n_axes, fmt, group, n_lead=1)
    out = dict(params, layers=layers)
    if "lm_head" in params:
        out["lm_head"] = quantize_blocks(params["lm_head"], 1, fmt, group)
    return out


def untied(params: dict) -> dict:
    """A tied model's params with the embedding copied as an lm_head [D, V] (to be quantized
    like GGUF's output weight; the model config then needs tie_word_embeddings=False)."""
    return dict(params, lm_head=jnp.asarray(params["embed"]).T)
