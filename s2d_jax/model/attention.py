"""Attention of a decoder block: causal within a call (training, prefill) and over a KV
cache's slots, block by block (decode steps, verify windows).

Einsum letters: B batch, T query tokens, S key slots, K kv heads, G query heads per kv
head, N query heads, H head dim, C slots in a block, L layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from s2d_jax.config import ModelConfig
from s2d_jax.model import decode_scope, gpu_attention, small_matmul, tpu_attention

_KERNELS = {"gpu": gpu_attention, "tpu": tpu_attention}  # decode_scope's kernel -> module

# Slots a decode step's attention reads per block. The cache is a static buffer (max_len
# slots) but a row's keys end at its position: blocks past the batch's last position are
# not read at all (on a 2-core CPU, SmolLM2-135M, 450 of 1280 slots held: the attention of
# a step took 0.54 of its whole-buffer time).
ATTENTION_BLOCK = 256


def causal_mask(batch: int, tokens: int, segment_ids: jnp.ndarray | None = None) -> jnp.ndarray:
    """[B, T, T], True where query t may attend to key s: s <= t (and, for packed training
    rows, s in t's `segment_ids` segment)."""
    tpos = jnp.arange(tokens)
    mask = tpos[None, :, None] >= tpos[None, None, :]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return jnp.broadcast_to(mask, (batch, tokens, tokens))


def attention(q, k, v, mask, cfg: ModelConfig):
    """q [B,T,N,H], k/v [B,S,K,H], mask [B,T,S] (True = may attend) -> [B,T,N,H]."""
    B, T, _, H = q.shape
    q = q.reshape(B, T, cfg.num_kv_heads, cfg.num_groups, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k) * (H ** -0.5)
    scores = jnp.where(mask[:, None, None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(B, T, cfg.num_heads, H)


def cache_attention(q, kc, vc, layer, positions, cfg: ModelConfig, block: int, new_kv=None):
    """Attention of q [B,T,N,H] at positions [B,T] to the slots <= position of cache layer
    `layer` (kc/vc [L, B, K, S, H]) -> [B,T,N,H]. `new_kv`: (k, v) [B,T,K,H] of the query
    tokens, not yet written to the cache (the caller writes them later, outside a `lax.cond`
    that must not copy it): the same result as if they had been, read as one more block
    after the cache's, whose slots at their positions are masked out. (Patching them into
    each block read instead made XLA copy every block before the patch: the whole draft
    cache read and written again per draft step, 0.56 GiB a round for the 70B target's
    12-layer draft, docs/distributed.md.)

    Block by block over the slots up to the batch's largest position, with a running
    softmax (max, normalizer, weighted sum rescaled as the max grows): the same result as
    one softmax over every slot, up to float rounding. block >= S is one block.

    On a single CPU device with the small-matmul kernels built, the cached attention
    kernel (cpu_attention.cc) does the same in one call, reading the cache in place."""
    B, T, _, H = q.shape
    fused, mesh = decode_scope.fused_attention_mesh()
    if fused and _KERNELS[fused].usable(kc, T * cfg.num_groups):
        carry = _KERNELS[fused].cache_softmax(q, kc, vc, layer, positions,
                                              new_kv is not None, mesh)
        return _finish(carry, q, positions, new_kv, S=kc.shape[3], cfg=cfg)
    if small_matmul.usable(B * T) and kc.dtype in (jnp.float32, jnp.bfloat16):
        return _kernel_attention(q, kc, vc, layer, positions, cfg, new_kv)
    if T * cfg.num_groups == 1:
        # One query row per kv head (an AR step of a model without grouped queries, e.g.
        # Vicuna-7B/13B) makes each attention dot a matrix-vector product; XLA:GPU then
        # lays the whole cache out anew for it in every layer (two transposes of
        # [L, B, K, S, H] per layer: the 7B step 42 ms on an H100 against 18 ms for two
        # tokens). The row twice is a matrix product that reads the cache as it lies; the
        # key patched in twice counts once (a position given twice holds one key, below).
        twice = lambda x: jnp.concatenate([x, x], axis=1)  # noqa: E731
        new2 = None if new_kv is None else tuple(twice(x) for x in new_kv)
        out = cache_attention(twice(q), kc, vc, layer, twice(positions), cfg, block, new2)
        return out[:, :1]
    S = kc.shape[3]
    C = min(block, S)
    q = q.reshape(B, T, cfg.num_kv_heads, cfg.num_groups, H)
    n_blocks = jnp.minimum(jnp.max(positions), S - 1) // C + 1

    def body(c, carry):
        lo = c * C
        start = jnp.minimum(lo, S - C)  # the last block may overlap the one before it
        kb, vb = _read_block(kc, vc, layer, start, C, q.dtype)
        slots = start + jnp.arange(C)
        ok = (slots[None, None, :] >= lo) & (slots[None, None, :] <= positions[:, :, None])
        if new_kv is not None:  # those slots' keys are the new ones, read after the cache
            ok = ok & ~jnp.any(slots[None, None, :] == positions[:, :, None], axis=1)[:, None]
        return _softmax_step(carry, q, kb, vb, ok)

    shape = (B, cfg.num_kv_heads, cfg.num_groups, T)
    init = (jnp.full(shape, NEG), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (H,), jnp.float32))
    # One block covers the cache: no loop (a loop of unknown trip count has no cost in
    # XLA's cost analysis, round_cost.py reads the cache this way).
    carry = body(0, init) if C == S else jax.lax.fori_loop(0, n_blocks, body, init)
    return _finish(carry, q, positions, new_kv, S, cfg)


def _finish(carry, q, positions, new_kv, S: int, cfg: ModelConfig):
    """The running softmax over the cache (carry), then over the new keys (new_kv, when
    not yet written) -> the attention output [B,T,N,H]."""
    B, T, H = q.shape[0], q.shape[1], q.shape[-1]
    if new_kv is not None:
        qg = q.reshape(B, T, cfg.num_kv_heads, cfg.num_groups, H)
        carry = _attend_new_keys(carry, qg, positions, new_kv, S)
    _, norm, acc = carry
    out = (acc / norm[..., None]).astype(q.dtype)  # every query holds slot 0: norm > 0
    return jnp.einsum("BKGTH->BTKGH", out).reshape(B, T, cfg.num_heads, H)


def _attend_new_keys(carry, q, positions, new_kv, S: int):
    """The running softmax over the query tokens' own keys/values (new_kv), key t' taken as
    slot positions[t'] (dropped past the cache's end S) -> the updated carry."""
    T = positions.shape[1]
    kn, vn = (jnp.einsum("BTKH->BKTH", x.astype(q.dtype)) for x in new_kv)
    # a position given twice holds the later key, as the cache write (and the CPU
    # kernel's patch) leaves it: a catch-up window pads its rows by repeating one
    same = positions[:, :, None] == positions[:, None, :]  # [B, T key, T later key]
    last = ~jnp.any(same & jnp.triu(jnp.ones((T, T), bool), 1)[None], axis=2)
    ok = ((positions[:, None, :] <= positions[:, :, None])
          & (positions[:, None, :] < S) & last[:, None, :])  # [B, T query, T key]
    return _softmax_step(carry, q, kn, vn, ok)


NEG = jnp.finfo(jnp.float32).min


def _softmax_step(carry, q, kb, vb, ok):
    """The running softmax (max, normalizer, weighted sum) of q [B,T,K,G,H] over one more
    block of keys/values kb, vb [B,K,C,H], where ok [B,T,C] (True = may attend)."""
    m, norm, acc = carry
    with jax.named_scope("attention_block"):  # names its ops in HLO traffic reports
        ok = ok[:, None, None]  # [B, 1, 1, T, C]
        s = jnp.einsum("BTKGH,BKCH->BKGTC", q, kb) * (q.shape[-1] ** -0.5)
        s = jnp.where(ok, s.astype(jnp.float32), NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
        rescale = jnp.exp(m - m_new)
        pv = jnp.einsum("BKGTC,BKCH->BKGTH", p.astype(vb.dtype), vb)
        return (m_new, norm * rescale + jnp.sum(p, axis=-1),
                acc * rescale[..., None] + pv.astype(jnp.float32))


def _read_block(kc, vc, layer, start, C, dtype):
    """Keys/values [B, K, C, H] of slots [start, start + C) of cache layer `layer`, read as
    the layer computes (`dtype`; the cache may be stored narrower)."""
    at, size = (layer, 0, 0, start, 0), (1,) + kc.shape[1:3] + (C, kc.shape[4])
    return tuple(jax.lax.dynamic_slice(x, at, size)[0].astype(dtype) for x in (kc, vc))


def _kernel_attention(q, kc, vc, layer, positions, cfg: ModelConfig, new_kv):
    """cache_attention on the CPU kernel: float32 scores, softmax and sums -> q's dtype."""
    B, T, N, H = q.shape
    shape = (B, T, cfg.num_kv_heads, cfg.num_groups, H)
    fresh = (jnp.zeros((B, T, cfg.num_kv_heads, H), jnp.float32),) * 2 if new_kv is None \
        else tuple(x.astype(jnp.float32) for x in new_kv)
    call = jax.ffi.ffi_call("s2d_decode_attention", jax.ShapeDtypeStruct(shape, jnp.float32),
                            vmap_method="sequential")
    out = call(q.reshape(shape).astype(jnp.float32), kc, vc, jnp.asarray(layer, jnp.int32),
               positions.astype(jnp.int32), *fresh, patch=new_kv is not None)
    return out.astype(q.dtype).reshape(B, T, N, H)
