"""Cached attention of a decode step or verify window as one Mosaic kernel (Pallas), for TPU
decode programs: each (row, kv head) program streams its cache layer block by block through
VMEM and keeps the scores, probabilities and running softmax there.

Written in XLA ops, XLA:TPU fuses the scores' matmul and the softmax's pieces apart: at
batch 8 the 70B target's SD verify on v5p:2x2x2 wrote and read its float32 scores and
probabilities in HBM, ~1 GiB a round beside the caches' own bytes (docs/distributed.md).
Here a round reads each cache layer once, and nothing past a row's last position.

It is gpu_attention.py's kernel in TPU terms: the layer index and each row's last block are
scalar-prefetched, so a cache block's index map picks layer `layer` of the whole stack (no
slice is copied out for the call) and repeats the last needed block for the grid steps past
it (Pallas skips a copy whose block index does not change: nothing more is read). Under a
mesh it runs per device on its rows and kv heads (shard_map), as the GPU kernel does.
On a CPU it runs in Pallas's interpreter, which the tests use to check it against XLA ops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from s2d_jax.model.gpu_attention import per_device

NEG = float(jnp.finfo(jnp.float32).min)
MAX_SLOTS = 2048  # cache slots per grid step: K+V blocks, double-buffered, 2 MiB at H=128 bf16
LANES = 128  # the running max / normalizer are kept lane-replicated, as TPU vectors hold them
MAX_ROWS = 256  # query rows a kv head's program holds ([256, 128] f32 sum in VMEM)


def _block(slots: int) -> int:
    """Slots a grid step reads: the largest power of two <= MAX_SLOTS dividing the cache."""
    blk = MAX_SLOTS
    while slots % blk:
        blk //= 2
    return blk


def usable(kc, rows: int) -> bool:
    """Whether the kernel serves `rows` query rows a kv head over this cache: its slots in
    blocks of a multiple of 128 (a TPU vector's lanes), and not a prefill's rows."""
    return _block(kc.shape[3]) >= LANES and rows <= MAX_ROWS


def _kernel(layer_ref, last_ref, qpos_ref, q_ref, rowpos_ref, k_ref, v_ref,
            acc_ref, m_ref, l_ref, acc_sc, m_sc, l_sc, *, tokens: int, skip_own: bool,
            scale: float, blk: int):
    """Grid step (b, kv head, s): the running softmax of the query rows [R, H] over cache
    block s of layer layer_ref[0] (slots <= each row's position, and with skip_own not at
    any of the row's query positions: their keys are attended separately)."""
    b, s = pl.program_id(0), pl.program_id(2)

    @pl.when(s == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(s <= last_ref[b])
    def _():
        q = q_ref[...]
        kb = k_ref[...].astype(q.dtype)
        vb = v_ref[...].astype(q.dtype)
        sc = jax.lax.dot_general(q, kb, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * scale  # [R, blk]
        slots = s * blk + jax.lax.broadcasted_iota(jnp.int32, sc.shape, 1)
        ok = slots <= rowpos_ref[...]  # [R, 1]: -1 on padding rows (nothing to attend)
        if skip_own:
            for t in range(tokens):
                ok = ok & (slots != qpos_ref[b * tokens + t])
        sc = jnp.where(ok, sc, NEG)
        m_prev = m_sc[...]  # [R, LANES], every lane the same
        m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
        p = jnp.where(ok, jnp.exp(sc - m_new[:, :1]), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        pv = jax.lax.dot_general(p.astype(vb.dtype), vb, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [R, H]
        acc_sc[...] = acc_sc[...] * alpha[:, :1] + pv
        m_sc[...] = m_new

    @pl.when(s == pl.num_programs(2) - 1)
    def _():
        acc_ref[...] = acc_sc[...]
        m_ref[...] = m_sc[...]
        l_ref[...] = l_sc[...]


def _local(q, kc, vc, layer, positions, skip_own: bool, interpret: bool):
    """The kernel over one device's rows and kv heads: q [B,T,N,H], kc/vc [L,B,K,S,H],
    positions [B,T] -> (m, norm [B,K,G,T], acc [B,K,G,T,H]) in attention.py's carry."""
    B, T, N, H = q.shape
    K, S = kc.shape[2], kc.shape[3]
    G = N // K
    used = T * G
    rows = -(-used // 16) * 16  # a bf16 tile's sublanes
    blk = _block(S)
    # rows of a kv head ordered (token, group); padded rows sit at position -1
    qr = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, used, H)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows - used), (0, 0)))
    pos = positions.astype(jnp.int32)
    rowpos = jnp.pad(jnp.repeat(pos, G, axis=1), ((0, 0), (0, rows - used)),
                     constant_values=-1)[:, :, None]
    last = jnp.clip(jnp.max(pos, axis=1), 0, S - 1) // blk  # [B]: the row's last block

    def cache_block(b, k, s, layer_ref, last_ref, qpos_ref):
        return layer_ref[0], b, k, jnp.minimum(s, last_ref[b]), 0

    kern = functools.partial(_kernel, tokens=T, skip_own=skip_own, scale=H ** -0.5, blk=blk)
    carry_spec = pl.BlockSpec((None, None, rows, LANES), lambda b, k, s, *_: (b, k, 0, 0))
    acc, m, norm = pl.pallas_call(
        kern,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(B, K, S // blk),
            in_specs=[pl.BlockSpec((None, None, rows, H), lambda b, k, s, *_: (b, k, 0, 0)),
                      pl.BlockSpec((None, rows, 1), lambda b, k, s, *_: (b, 0, 0)),
                      pl.BlockSpec((None, None, None, blk, H), cache_block),
                      pl.BlockSpec((None, None, None, blk, H), cache_block)],
            out_specs=[pl.BlockSpec((None, None, rows, H), lambda b, k, s, *_: (b, k, 0, 0)),
                       carry_spec, carry_spec],
            scratch_shapes=[pltpu.VMEM((rows, H), jnp.float32),
                            pltpu.VMEM((rows, LANES), jnp.float32),
                            pltpu.VMEM((rows, LANES), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((B, K, rows, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, rows, LANES), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, rows, LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        # what the TPU compiler's cost model counts for the call (the one-round estimate):
        # a cache layer's keys and values read once, both matmuls over every slot
        cost_estimate=pl.CostEstimate(
            flops=4 * B * K * rows * S * H, transcendentals=B * K * rows * S,
            bytes_accessed=2 * B * K * S * H * kc.dtype.itemsize
            + B * K * rows * (2 * H + 2 * LANES) * 4),
        interpret=interpret, name="cache_attention_kernel",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), last, pos.reshape(-1), qr, rowpos, kc, vc)

    def carry_order(x):  # [B, K, rows, ...] -> [B, K, G, T, ...]
        x = x[:, :, :used].reshape(B, K, T, G, *x.shape[3:])
        return jnp.swapaxes(x, 2, 3)
    return carry_order(m[..., 0]), carry_order(norm[..., 0]), carry_order(acc)


cache_softmax = functools.partial(per_device, _local)  # per device under a mesh
