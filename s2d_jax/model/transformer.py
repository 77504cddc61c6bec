"""The one Llama-family transformer every model in s2d-jax uses, as plain functions of a
plain params dict (the rows of `params.PARAMS`; docs/design.md says why not Flax modules).

The pieces live in single-purpose files, re-exported here so `transformer.<name>` keeps
naming the whole model: `attention.py` (causal and cached attention), `block.py` (one
decoder block, RMSNorm, the projections), `layers.py` (a layer range `[start, end)` of the
stacked blocks: `run_layers` for training and prefills, `decode_layers` with a KV cache),
`param_init.py` (random params, their shapes and shardings). This file adds the
embedding, the final norm + LM head a sorted draft's exits share, and `forward`.

Einsum letters: B batch, T query tokens, S key slots, D model dim, N query heads,
K kv heads, G query heads per kv head, H head dim, F mlp hidden, V vocab, L layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from s2d_jax.config import ModelConfig
from s2d_jax.model import small_matmul
from s2d_jax.model.attention import ATTENTION_BLOCK  # noqa: F401  (re-exported)
from s2d_jax.model.block import MATRIX_NAMES, block, dense, rms_norm  # noqa: F401
from s2d_jax.model.kvcache import KVCache
from s2d_jax.model.layers import (REMAT_POLICIES, UNROLL_LAYERS, decode_layers,  # noqa: F401
                                  layer_param_count, layer_slice, run_layers, unroll_layers)
from s2d_jax.model.param_init import (abstract_params, init_params,  # noqa: F401
                                      logical_param_specs, param_shardings)
from s2d_jax.model.params import param_shapes  # noqa: F401  (callers use model.param_shapes)


def embed_tokens(params: dict, cfg: ModelConfig, tokens: jnp.ndarray) -> jnp.ndarray:
    table = params["embed"]
    if tokens.size == 1:
        # One index is a dynamic-slice to XLA, which the SPMD partitioner serves by
        # all-gathering a vocab-sharded table onto every device (a 70B's whole 500 MiB table
        # for each token of a batch-1 step, on the H100 compiler); two indices stay a
        # gather, partitioned as each device's masked rows and an all-reduce of one row.
        twice = jnp.concatenate([tokens.reshape(1)] * 2)
        return table[twice][:1].reshape(tokens.shape + table.shape[1:]).astype(cfg.dtype)
    return table[tokens].astype(jnp.dtype(cfg.dtype))


def lm_logits(params: dict, cfg: ModelConfig, h: jnp.ndarray, decode: bool = False) -> jnp.ndarray:
    """Final norm + LM head (tied or untied) -> float32 logits [..., V].

    A draft with a sub-vocabulary head (params["head_ids"], see `sub_vocab_logits`) scores
    only those tokens; every other token gets logit SUB_VOCAB_FLOOR (probability 0).
    `decode` (static): a decode step's few rows, which the small-matmul kernel may serve."""
    if "head_ids" in params:
        full = jnp.full(h.shape[:-1] + (cfg.vocab_size,), SUB_VOCAB_FLOOR, jnp.float32)
        return full.at[..., params["head_ids"]].set(sub_vocab_logits(params, cfg, h, decode))
    kernel = decode and small_matmul.usable(math.prod(h.shape[:-1]), params.get("lm_head"))
    x = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    if cfg.tie_word_embeddings:
        return _head_nk(x, params["embed"], kernel, decode)
    return dense("...D,DV->...V", x, params["lm_head"], x.dtype, kernel).astype(jnp.float32)


# Rows of a decode call whose head XLA:CPU computes as a reduction (see _head_nk).
REDUCED_HEAD_ROWS = (2, 16)


def _head_nk(x: jnp.ndarray, rows: jnp.ndarray, kernel: bool, decode: bool = False) -> jnp.ndarray:
    """Float32 logits x [..., D] @ rows [V, D]^T (a tied embedding, a sub-vocabulary head)."""
    if kernel and small_matmul.serves(rows):
        return small_matmul.matmul(x, rows, "nk", 1)
    m = math.prod(x.shape[:-1])
    if decode and jax.default_backend() == "cpu" and REDUCED_HEAD_ROWS[0] <= m <= REDUCED_HEAD_ROWS[1]:
        # XLA:CPU runs one row as a matrix-vector product at memory speed but 2..16 as a
        # general matmul that packs the whole [V, D] head on every call (SmolLM2's head:
        # 4.2 ms at 1 row, 9-14.5 ms at 2-16); as products summed over D, laid out [V, M],
        # it streams the head once for all rows (5.4 ms at 4, 9.6 at 16; float32 sums, the
        # same accuracy; one row stays a matrix-vector product: 107 ms this way).
        xf = x.reshape(m, x.shape[-1]).astype(jnp.float32)
        out = jnp.sum(rows.astype(jnp.float32)[:, None, :] * xf[None], axis=-1)  # [V, M]
        return out.T.reshape(x.shape[:-1] + (rows.shape[0],))
    return jnp.einsum("...D,VD->...V", x, rows.astype(x.dtype)).astype(jnp.float32)


# Finite, so temperature scaling and softmax stay NaN-free; exp(floor - max) is exactly 0.
SUB_VOCAB_FLOOR = -1e9


def head_rows(params: dict) -> jnp.ndarray:
    """[V', D] rows of the LM head for the sub-vocabulary params["head_ids"] (all [V, D]
    rows without one); pre-gathered as params["head_rows"] outside a decode loop (a
    gather in the loop body re-runs)."""
    if "head_rows" in params:
        return params["head_rows"]
    ids = params.get("head_ids", slice(None))
    if "lm_head" not in params:
        return params["embed"][ids]
    head = params["lm_head"]
    if not isinstance(head, jax.Array | jax.core.Tracer):  # quantized: its values, then rows
        head = head.astype(jnp.float32)
    return head[:, ids].T


def sub_vocab_logits(params: dict, cfg: ModelConfig, h: jnp.ndarray,
                     decode: bool = False) -> jnp.ndarray:
    """Float32 logits [..., V'] over the sub-vocabulary params["head_ids"] [V'].

    A draft's head over the target's most frequent output tokens costs V'/V of the full
    head (SmolLM2's 49152 x 576 head costs about eight of its layers). Speculative
    sampling stays exact: the draft's q is 0 outside the sub-vocabulary, so those tokens
    are simply never proposed (the target still emits them on rejection)."""
    x = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    return _head_nk(x, head_rows(params), decode and small_matmul.usable(math.prod(h.shape[:-1])),
                    decode)


def forward(params: dict, cfg: ModelConfig, tokens: jnp.ndarray, positions=None,
            cache: KVCache | None = None, segment_ids=None, remat: str = "none"):
    """Full model: tokens [B, T] -> (float32 logits [B, T, V], cache).

    Without a cache: causal within the call (training), positions default 0..T-1. With a
    cache: a cached step (`decode_layers`), positions default to the cache's next ones;
    the returned cache holds the new keys/values but its lengths are not advanced."""
    if positions is None:
        T = tokens.shape[1]
        positions = (cache.next_positions(T) if cache is not None
                     else jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens.shape))
    h = embed_tokens(params, cfg, tokens)
    if cache is None:
        h, _ = run_layers(params, cfg, h, positions, segment_ids=segment_ids, remat=remat)
    else:
        h, cache = decode_layers(params, cfg, h, positions, 0, cfg.num_layers, cache)
    return lm_logits(params, cfg, h, decode=cache is not None), cache
