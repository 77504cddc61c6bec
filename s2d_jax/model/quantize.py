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

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as PS

from s2d_jax.config import ModelConfig
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

    def output_scaled(self, dtype):
        """(q in `dtype` shaped as the weight, scale over the output axes, float32) where
        x @ W == (x @ q) * scale: an int8 weight-only weight with per-output-channel scales
        and a 16-bit compute dtype (an accelerator's); None otherwise (dequantize with
        astype). Scaling the product, not the weight, leaves the matmul's operand a bare
        int8 -> bf16 convert, which XLA:GPU fuses into the GEMM (it reads the int8 bytes):
        with the scale on the weight it wrote a dequantized bf16 copy of every layer each
        round (the 70B's AR round on h100:8, 4.9x its int8 floor at 8 layers)."""
        n_in = self.q.shape[-2]
        if (self.bits != 8 or self.act_bits or self.offset is not None or self.group != n_in
                or jnp.dtype(dtype).itemsize != 2):
            return None
        lead = self.q.shape[:-2]
        k = next(i for i in range(len(self.shape) + 1) if math.prod(self.shape[:i]) == n_in)
        return (self.q.reshape(lead + tuple(self.shape)).astype(dtype),
                self.scale.reshape(lead + tuple(self.shape[k:])))

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


@dataclasses.dataclass(frozen=True)
class QuantizedConfig(ModelConfig):
    """A model whose matrices and head are stored quantized (`weights`: int8), as
    an AOT compile plans it: decode/aot.abstract_params gives its params as
    `abstract_quantized`'s, so every compile, memory report and floor of the config reads
    the quantized bytes. The activations stay in `dtype`."""

    weights: str = "int8"


def with_weights(cfg: ModelConfig, weights: str | None) -> ModelConfig:
    """cfg with its weights stored as `weights` (None or "": as cfg's param_dtype)."""
    if not weights:
        return cfg
    if weights != "int8":  # the one mode whose compiled programs were checked (aot.py)
        raise S2DError(f"unknown weights {weights!r}; ahead-of-time plans take int8")
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)}
    return QuantizedConfig(**fields, weights=weights)


def abstract_quantized(params: dict, mode: str = "int8") -> dict:
    """`quantize_params(params, mode)` for abstract params (ShapeDtypeStructs, an AOT
    compile's: no weight read or allocated), each quantized leaf placed like the weight it
    replaces: q's flattened in / out axes take the sharding of their group's leading axis
    (heads for wq's N*H, wo's N*H), the scale's out axis the weight's out sharding."""
    plain = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    out = jax.eval_shape(lambda p: quantize_params(p, mode), plain)

    def place(name, w, qw, n_lead):
        sharding = getattr(w, "sharding", None)
        if not isinstance(qw, QuantizedWeight):
            return w  # a norm or the embedding, as it was
        if sharding is None:
            return qw
        spec = tuple(sharding.spec) + (None,) * (len(w.shape) - len(sharding.spec))
        lead, inner = spec[:n_lead], spec[n_lead:]
        n_in = INPUT_AXES.get(name, 1)
        q_spec = lead + (_flat_spec(inner[:n_in], name), _flat_spec(inner[n_in:], name))
        s_spec = lead + (None, None, q_spec[-1])
        put = lambda a, s: jax.ShapeDtypeStruct(  # noqa: E731
            a.shape, a.dtype, sharding=jax.sharding.NamedSharding(sharding.mesh, PS(*s)))
        return dataclasses.replace(qw, q=put(qw.q, q_spec), scale=put(qw.scale, s_spec))

    layers = {k: place(k, params["layers"][k], v, 1) for k, v in out["layers"].items()}
    out = {k: place(k, params[k], v, 0) for k, v in out.items() if k != "layers"}
    return dict(out, layers=layers)


def _flat_spec(group: tuple, name: str):
    """The mesh axes of axes `group` flattened into one: its leading axis's, which is the
    same split only while the axes after it are whole."""
    if any(s is not None for s in group[1:]):
        raise S2DError(f"{name}'s sharding {group} splits an inner axis of a quantized "
                       f"weight's flattened in/out axes; shard its leading axis instead")
    return group[0] if group else None
