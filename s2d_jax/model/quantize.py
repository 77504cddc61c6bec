"""Int8 / int4 quantization of a model's params: a cheaper model of the same architecture,
usable as a chain's intermediate level (or as a plain target).

Every quantized matrix of model.py has its contracted (input) axes first and its output
axes last after the optional leading layer axis: wq/wk/wv [D | N,H], wo [N,H | D],
w_gate/w_up [D | F], w_down [F | D], lm_head [D | V]. A `QuantizedWeight` stores it as
`q [..., in, out]` with symmetric scales per output channel and per group of `group`
input rows (`scale [..., in/group, 1, out]`):
  int8: one group over the whole input dim (per-output-channel scales), values in [-127, 127];
  int4: groups of `group` input rows, values in [-8, 7], two per byte (uint8 `q [..., in/2, out]`).
  GGUF's blocks (io/gguf_weights.py) in the same layout, group 32: Q8_0 as int8, Q4_0 as
  int4, Q4_1 as int4 of unsigned values [0, 15] with an `offset` beside the scale.
`QuantizedWeight.astype(dtype)` dequantizes, so model.py's `lp["wq"].astype(dt)` works
unchanged; its leaves keep the leading layer axis, so `layer_slice` and `lax.scan` slice
them like plain arrays. Norms and the embedding table (a gather, and ~2% of a 7B model)
stay in full precision.

  int8 / int4 (weight-only) save memory (params bytes). On the CPU decode path (a few rows:
    steps, verify windows, draft steps) the small-matmul kernels read them as stored
    (small_matmul.py; 8/4-bit blocks: quant_matmul.cc); elsewhere the weight is dequantized
    before each matmul.
  w8a8 (the int8 weights of int8, plus int8 activations quantized per token on the fly,
    symmetric absmax, as in the polybasic paper's W4A4 intermediate) multiplies int8 by
    int8 into int32 (`QuantizedWeight.matmul`). It is lossy twice (weights and
    activations), which a chain's verification absorbs.
Greedy AR of demo target-l on this 2-core CPU (16 prompts, 128 tokens, 256-slot buffer):
float32 158 tok/s, int8 241, w8a8 260 (less in a longer buffer, where attention weighs
more); greedy outputs equal float32's on 81% (int8) and 75% (w8a8) of the prompts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from s2d_jax.errors import S2DError
from s2d_jax.model.params import LAYER_PARAMS

MODES = ("int8", "int4", "w8a8")
# Number of contracted (input) axes of each quantized param, after the layer axis: the
# decoder-block linear weights of the param table.
INPUT_AXES = {row.name: row.n_in for row in LAYER_PARAMS if row.n_in}


@struct.dataclass
class QuantizedWeight:
    q: jnp.ndarray  # int8 [..., in, out] (int8 mode) or uint8 [..., in/2, out] (int4, packed)
    scale: jnp.ndarray  # float32 [..., in/group, 1, out]
    shape: tuple = struct.field(pytree_node=False)  # per-layer (unstacked) original shape
    group: int = struct.field(pytree_node=False)
    bits: int = struct.field(pytree_node=False)
    act_bits: int = struct.field(pytree_node=False, default=0)  # 8: int8 activations (w8a8)
    # float32 like scale, or None: an asymmetric int4 weight (GGUF Q4_1) stores UNSIGNED
    # nibbles 0..15 and w = scale * q + offset; None: w = scale * q (signed q).
    offset: jnp.ndarray | None = None

    def astype(self, dtype) -> jnp.ndarray:
        """The dequantized weight in `dtype`, with any leading (layer) axes kept."""
        lead = self.scale.shape[:-3]
        if self.bits == 4:
            q = _unpack_int4(self.q, signed=self.offset is None)
        else:
            q = self.q
        n_in, n_out = q.shape[-2], q.shape[-1]
        grouped = q.reshape(lead + (n_in // self.group, self.group, n_out)).astype(jnp.float32)
        w = grouped * self.scale
        if self.offset is not None:
            w = w + self.offset
        return w.reshape(lead + tuple(self.shape)).astype(dtype)

    def matmul(self, x: jnp.ndarray) -> jnp.ndarray:
        """x [..., in axes] @ W -> float32 [..., out axes] as an int8 x int8 -> int32 matmul
        (act_bits 8): x is quantized per row (its trailing `in` axes) with a symmetric
        absmax scale, and the int32 product is rescaled by both scales."""
        n_in, n_out = self.q.shape[-2], self.q.shape[-1]
        k = next(i for i in range(len(self.shape) + 1) if math.prod(self.shape[:i]) == n_in)
        lead = x.shape[:x.ndim - k]
        x2 = x.reshape(lead + (n_in,)).astype(jnp.float32)
        absmax = jnp.max(jnp.abs(x2), axis=-1, keepdims=True)
        x_scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
        xq = jnp.round(x2 / x_scale).astype(jnp.int8)
        acc = jax.lax.dot_general(xq, self.q, (((xq.ndim - 1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.int32)
        y = acc.astype(jnp.float32) * x_scale * self.scale.reshape(n_out)
        return y.reshape(lead + tuple(self.shape[k:]))

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + (0 if self.offset is None
                                                    else self.offset.nbytes)


def _pack_int4(q: jnp.ndarray) -> jnp.ndarray:
    """int values in [-8, 7], [..., in, out] with even `in` -> uint8 [..., in/2, out]."""
    u = (q.astype(jnp.int32) & 0xF).astype(jnp.uint8)
    return u[..., 0::2, :] | (u[..., 1::2, :] << 4)


def _unpack_int4(packed: jnp.ndarray, signed: bool = True) -> jnp.ndarray:
    lo = (packed & 0xF).astype(jnp.int8)
    hi = (packed >> 4).astype(jnp.int8)
    both = jnp.stack([lo, hi], axis=-2)  # [..., in/2, 2, out]
    if signed:
        both = jnp.where(both >= 8, both - 16, both)  # sign-extend the 4-bit values
    return both.reshape(packed.shape[:-2] + (2 * packed.shape[-2], packed.shape[-1]))


def quantize_weight(w: jnp.ndarray, n_in_axes: int, bits: int = 8, group: int = 0,
                    n_lead: int = 0, act_bits: int = 0) -> QuantizedWeight:
    """Quantize w [lead..., in_axes..., out_axes...] symmetrically per (input group, output
    channel). group = 0 means the whole input dim (per-output-channel)."""
    lead = w.shape[:n_lead]
    inner = w.shape[n_lead:]
    n_in = math.prod(inner[:n_in_axes])
    n_out = math.prod(inner[n_in_axes:])
    group = n_in if group <= 0 else group
    if n_in % group or (bits == 4 and group % 2):
        raise S2DError(f"quantization group {group} does not divide input dim {n_in} of a "
                       f"{tuple(inner)} weight (int4 also needs an even group); pick a divisor")
    qmax = 127 if bits == 8 else 7
    w32 = w.astype(jnp.float32).reshape(lead + (n_in // group, group, n_out))
    absmax = jnp.max(jnp.abs(w32), axis=-2, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / qmax, 1.0)
    q = jnp.clip(jnp.round(w32 / scale), -qmax - (bits == 4), qmax).astype(jnp.int8)
    q = q.reshape(lead + (n_in, n_out))
    if bits == 4:
        q = _pack_int4(q)
    return QuantizedWeight(q=q, scale=scale, shape=tuple(inner), group=group, bits=bits,
                           act_bits=act_bits)


def quantize_params(params: dict, mode: str = "int8", group: int = 64) -> dict:
    """Quantize the layer matrices (and an untied lm_head) of a model.py params dict.

    int8 and w8a8 ignore `group` (per-output-channel scales); int4 uses `group` input rows
    per scale (falls back to the whole input dim when a dim is smaller than the group).
    """
    if mode not in MODES:
        raise S2DError(f"unknown quantization {mode!r}; use one of {', '.join(MODES)}")
    bits = 4 if mode == "int4" else 8
    act_bits = 8 if mode == "w8a8" else 0

    def pick_group(n_in):
        if bits == 8:
            return 0
        return group if n_in % group == 0 else n_in

    layers = dict(params["layers"])
    for name, n_axes in INPUT_AXES.items():
        w = layers[name]
        n_in = math.prod(w.shape[1:1 + n_axes])
        layers[name] = quantize_weight(w, n_axes, bits, pick_group(n_in), n_lead=1,
                                       act_bits=act_bits)
    out = dict(params, layers=layers)
    if "lm_head" in params:
        out["lm_head"] = quantize_weight(params["lm_head"], 1, bits,
                                         pick_group(params["lm_head"].shape[0]),
                                         act_bits=act_bits)
    return out


def params_nbytes(params) -> int:
    """Bytes held by a params pytree (quantized weights count their int and scale bytes)."""
    return int(sum(x.nbytes for x in jax.tree.leaves(params)))
