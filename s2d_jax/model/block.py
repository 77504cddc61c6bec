"""One decoder block as a plain function of its weights: RMSNorm, the projections (XLA's
dots or the small-matmul kernel), rotary embeddings, attention, the SwiGLU MLP.

Einsum letters: B batch, T query tokens, D model dim, N query heads, K kv heads, H head
dim, F mlp hidden.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from s2d_jax.config import ModelConfig
from s2d_jax.model import small_matmul
from s2d_jax.model.decode_scope import few_rows, gemm_rows
from s2d_jax.model.params import LAYER_PARAMS
from s2d_jax.model.rope import apply_rope

# The decoder block's matrices (the rows with input axes), as opposed to its norm weights.
MATRIX_NAMES = frozenset(p.name for p in LAYER_PARAMS if p.n_in)


def mean_square(x: jnp.ndarray) -> jnp.ndarray:
    """Float32 mean of x's squares over its last axis (kept): RMSNorm's statistic."""
    x32 = x.astype(jnp.float32)
    return jnp.mean(x32 * x32, axis=-1, keepdims=True)


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float, ms=None) -> jnp.ndarray:
    """RMSNorm of x; `ms`: its mean_square, when the caller computed it already."""
    ms = mean_square(x) if ms is None else ms
    normed = x.astype(jnp.float32) * jax.lax.rsqrt(ms + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def dense(eq: str, x: jnp.ndarray, w, dt, kernel: bool = False, extra: int = 1) -> jnp.ndarray:
    """einsum(eq, x, w) contracting x's trailing axes with w's leading ones. `w` is an
    array, a small_matmul.StackedWeight (one layer of the stack) or a
    quantize.QuantizedWeight: weight-only ones dequantize (astype), w8a8 ones run an int8
    matmul on the fly-quantized x. `kernel` (static): the caller decided this is a
    decode-path call the small-matmul kernel serves (`small_matmul.usable`). `extra`: the
    rows a GPU decode program appends to a few-row x (decode_scope.gemm_rows; projections
    of one input each get their own count)."""
    if kernel and small_matmul.serves(w):
        x_spec, w_spec = eq.split("->")[0].split(",")
        contract = sum(c in x_spec for c in w_spec)
        return small_matmul.matmul(x, w, "kn", contract).astype(dt)
    if getattr(w, "act_bits", 0):
        return w.matmul(x).astype(dt)
    x_spec, w_spec = eq.split("->")[0].split(",")
    n_in = sum(c in x_spec for c in w_spec)
    # per-channel int8 on an accelerator: x @ q, then the scale (QuantizedWeight.output_scaled)
    scaled = (w.output_scaled(dt) if hasattr(w, "output_scaled") and eq.endswith(w_spec[n_in:])
              else None)
    # else a quantized weight dequantized (it has no .size for few_rows)
    w = scaled[0] if scaled else w.astype(dt)
    y = gemm_rows(eq, x, w, extra) if few_rows(x, w, n_in) else jnp.einsum(eq, x, w)
    return y if scaled is None else (y.astype(jnp.float32) * scaled[1]).astype(dt)


def shared_input(x: jnp.ndarray, ws: list, dt, kernel: bool) -> list | None:
    """[x @ w for w in ws] (each contracting x's last axis) as one call of the CPU kernel
    where it takes them together (small_matmul.shares_input: block-quantized layers, int8
    activations): x quantized once, one hand-off to the threads instead of one per weight
    (SmolLM2: 210 matmul calls a step become 120). None: apply them one by one."""
    if not (kernel and small_matmul.shares_input(ws)):
        return None
    return [y.astype(dt) for y in small_matmul.matmul_shared(x, ws, 1)]


def out_projection(attn: jnp.ndarray, wo, dt, kernel: bool) -> jnp.ndarray:
    """attn [B,T,N,H] @ wo [N,H,D]. A plain matrix is applied as [N*H, D] to the flattened
    heads: contracting (N, H) as two axes, the CPU backend transposed the whole weight on
    every call (~6% of a SmolLM2 decode step)."""
    if kernel and small_matmul.serves(wo):
        return dense("BTNH,NHD->BTD", attn, wo, dt, kernel)
    if isinstance(wo, small_matmul.StackedWeight):
        wo = wo.value
    if isinstance(wo, jax.Array):
        B, T, N, H = attn.shape
        return dense("BTE,ED->BTD", attn.reshape(B, T, N * H), wo.reshape(N * H, -1), dt)
    return dense("BTNH,NHD->BTD", attn, wo, dt)


def block(w: dict, cfg: ModelConfig, h, cos, sin, attend, kernel: bool = False,
          ms=None, norm_once: bool = False):
    """One decoder block with weights `w` (one layer's slice of params["layers"]):
    h [B, T, D] -> (h, extra). `attend(q, k_new, v_new) -> (out [B,T,N,H], extra)` attends
    with the new keys/values (and whatever a cache holds, storing them). `kernel`
    (static): the decode path, projections on the small-matmul kernel. `ms`: h's
    mean_square, computed by the caller (a TPU decode scan carries it from the layer
    before). `norm_once` (static): the attention's normed input is computed once, before
    q/k/v read it (TPU decode programs, see below)."""
    dt = h.dtype
    mm = functools.partial(dense, dt=dt, kernel=kernel)
    x = rms_norm(h, w["attn_norm"], cfg.rms_norm_eps, ms)
    if norm_once:
        # XLA:TPU fuses the norm into each of the q, k and v matmuls, each reading the
        # layer's input from HBM again; computed once, the normed input lies in VMEM for
        # all three (v5p 70B SD verify at batch 8: 2 of the 14 [rows, D] activation
        # reads and writes of a layer, 0.1 GiB a round; docs/distributed.md). The same
        # values: the barrier only bounds fusion.
        x = jax.lax.optimization_barrier(x)
    # checkpoint_name marks what a layers.REMAT_POLICIES name policy may keep for the
    # backward pass (MaxText's names); outside jax.checkpoint it is the identity.
    qkv = shared_input(x, [w["wq"], w["wk"], w["wv"]], dt, kernel)
    q = checkpoint_name(qkv[0] if qkv else mm("BTD,DNH->BTNH", x, w["wq"], extra=1), "query_proj")
    k = checkpoint_name(qkv[1] if qkv else mm("BTD,DKH->BTKH", x, w["wk"], extra=2), "key_proj")
    v = checkpoint_name(qkv[2] if qkv else mm("BTD,DKH->BTKH", x, w["wv"], extra=3), "value_proj")
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    attn, extra = attend(q, k, v)
    attn = checkpoint_name(attn, "context")
    h = h + checkpoint_name(out_projection(attn, w["wo"], dt, kernel), "out_proj")
    x = rms_norm(h, w["mlp_norm"], cfg.rms_norm_eps)
    gate_up = shared_input(x, [w["w_gate"], w["w_up"]], dt, kernel)
    gate = checkpoint_name(gate_up[0] if gate_up else mm("BTD,DF->BTF", x, w["w_gate"], extra=1),
                           "mlpwi_0")
    up = checkpoint_name(gate_up[1] if gate_up else mm("BTD,DF->BTF", x, w["w_up"], extra=2),
                         "mlpwi_1")
    h = h + checkpoint_name(mm("BTF,FD->BTD", jax.nn.silu(gate) * up, w["w_down"]), "mlpwo")
    return h, extra
