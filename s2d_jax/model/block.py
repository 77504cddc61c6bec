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


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
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
    w = w.astype(dt)  # a quantized weight dequantized (it has no .size for few_rows)
    if few_rows(x, w, sum(c in x_spec for c in w_spec)):
        return gemm_rows(eq, x, w, extra)
    return jnp.einsum(eq, x, w)


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


def block(w: dict, cfg: ModelConfig, h, cos, sin, attend, kernel: bool = False):
    """One decoder block with weights `w` (one layer's slice of params["layers"]):
    h [B, T, D] -> (h, extra). `attend(q, k_new, v_new) -> (out [B,T,N,H], extra)` attends
    with the new keys/values (and whatever a cache holds, storing them). `kernel`
    (static): the decode path, projections on the small-matmul kernel."""
    dt = h.dtype
    mm = functools.partial(dense, dt=dt, kernel=kernel)
    x = rms_norm(h, w["attn_norm"], cfg.rms_norm_eps)
    # checkpoint_name marks what a layers.REMAT_POLICIES name policy may keep for the
    # backward pass (MaxText's names); outside jax.checkpoint it is the identity.
    q = checkpoint_name(mm("BTD,DNH->BTNH", x, w["wq"], extra=1), "query_proj")
    k = checkpoint_name(mm("BTD,DKH->BTKH", x, w["wk"], extra=2), "key_proj")
    v = checkpoint_name(mm("BTD,DKH->BTKH", x, w["wv"], extra=3), "value_proj")
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    attn, extra = attend(q, k, v)
    attn = checkpoint_name(attn, "context")
    h = h + checkpoint_name(out_projection(attn, w["wo"], dt, kernel), "out_proj")
    x = rms_norm(h, w["mlp_norm"], cfg.rms_norm_eps)
    gate = checkpoint_name(mm("BTD,DF->BTF", x, w["w_gate"], extra=1), "mlpwi_0")
    up = checkpoint_name(mm("BTD,DF->BTF", x, w["w_up"], extra=2), "mlpwi_1")
    h = h + checkpoint_name(mm("BTF,FD->BTD", jax.nn.silu(gate) * up, w["w_down"]), "mlpwo")
    return h, extra
