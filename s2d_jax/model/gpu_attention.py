"""Cached attention of a decode step or verify window as one Triton kernel (Pallas), for GPU
decode programs: each (row, kv head) program streams its cache layer block by block and
keeps the scores, probabilities and running softmax on chip.

Written in XLA ops, the scores and probabilities of every cache block go to HBM between
the two matmuls and are read back (written, converted, reduced, exponentiated): on the
H100 compiler that was ~1.5x the cache's own bytes, 2.5 GiB a round of the 70B target's
SD verify at batch 8 (docs/distributed.md). Here a round reads each cache layer once.

The kernel takes the whole cache stack and the layer index as operands (a layer's slice
would be copied out for the call) and returns the running softmax (max, normalizer,
weighted sum) over the cache's slots, which attention.py combines with the new keys. Under
a mesh it runs per device on its rows and kv heads (shard_map). On a CPU it runs in
Pallas's interpreter, which the tests use to check it against the XLA-ops path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.sharding import PartitionSpec as P

from s2d_jax.parallel.mesh import partition_spec

NEG = float(jnp.finfo(jnp.float32).min)
SLOTS = 64  # cache slots a kernel step reads (a [rows, 64] score tile stays in registers)
MIN_ROWS = 16  # Triton's dot wants at least 16 rows: query rows are padded up to it


def _kernel(layer_ref, rowpos_ref, qpos_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *,
            tokens: int, skip_own: bool, scale: float):
    """One (row b, kv head k) program: the running softmax of its query rows [R, H] over
    slots <= each row's position of cache layer layer_ref[0] (and, with skip_own, not at
    any of the row's query positions: their keys are attended separately)."""
    b, kh = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    q = q_ref[...]
    rowpos = rowpos_ref[...]  # [R]; -1 for padding rows (nothing to attend)
    qpos = [qpos_ref[t] for t in range(tokens)] if skip_own else []
    n_blocks = jnp.maximum(jnp.max(rowpos), 0) // SLOTS + 1

    def step(i, carry):
        m, norm, acc = carry
        start = pl.multiple_of(i * SLOTS, SLOTS)
        kb = k_ref[layer, b, kh, pl.ds(start, SLOTS), :].astype(q.dtype)
        vb = v_ref[layer, b, kh, pl.ds(start, SLOTS), :].astype(q.dtype)
        s = plt.dot(q, kb, trans_b=True) * scale  # [R, SLOTS] f32
        slots = start + jnp.arange(SLOTS, dtype=jnp.int32)
        ok = slots[None, :] <= rowpos[:, None]
        for p in qpos:
            ok = ok & (slots[None, :] != p)
        s = jnp.where(ok, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        rescale = jnp.exp(m - m_new)
        pv = plt.dot(p.astype(vb.dtype), vb)
        return m_new, norm * rescale + jnp.sum(p, axis=1), acc * rescale[:, None] + pv

    rows, dim = q.shape
    init = (jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, dim), jnp.float32))
    m, norm, acc = jax.lax.fori_loop(0, n_blocks, step, init)
    acc_ref[...], m_ref[...], l_ref[...] = acc, m, norm


def _local(q, kc, vc, layer, positions, skip_own: bool, interpret: bool):
    """The kernel over one device's rows and kv heads: q [B,T,N,H], kc/vc [L,B,K,S,H],
    positions [B,T] -> (m, norm [B,K,G,T], acc [B,K,G,T,H]) in attention.py's carry."""
    B, T, N, H = q.shape
    K = kc.shape[2]
    G = N // K
    used = T * G
    rows = max(MIN_ROWS, 1 << (used - 1).bit_length())
    # rows of a kv head ordered (token, group); padded rows sit at position -1
    qr = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, used, H)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows - used), (0, 0)))
    rowpos = jnp.pad(jnp.repeat(positions, G, axis=1), ((0, 0), (0, rows - used)),
                     constant_values=-1)
    # a block's dims are powers of two in Triton: the query positions padded with -1
    qpos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, (1 << (T - 1).bit_length()) - T)),
                   constant_values=-1)
    kern = functools.partial(_kernel, tokens=T, skip_own=skip_own, scale=H ** -0.5)
    whole = pl.BlockSpec(memory_space=pl.ANY)  # indexed in the kernel: nothing copied
    acc, m, norm = pl.pallas_call(
        kern, grid=(B, K),
        in_specs=[pl.BlockSpec((1,), lambda b, k: (0,)),
                  pl.BlockSpec((None, rows), lambda b, k: (b, 0)),
                  pl.BlockSpec((None, qpos.shape[1]), lambda b, k: (b, 0)),
                  pl.BlockSpec((None, None, rows, H), lambda b, k: (b, k, 0, 0)),
                  whole, whole],
        out_specs=[pl.BlockSpec((None, None, rows, H), lambda b, k: (b, k, 0, 0)),
                   pl.BlockSpec((None, None, rows), lambda b, k: (b, k, 0)),
                   pl.BlockSpec((None, None, rows), lambda b, k: (b, k, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, K, rows, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, rows), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, rows), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret, name="cache_attention_kernel",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), rowpos, qpos, qr, kc, vc)

    def carry_order(x):  # [B, K, rows, ...] -> [B, K, G, T, ...]
        x = x[:, :, :used].reshape(B, K, T, G, *x.shape[3:])
        return jnp.swapaxes(x, 2, 3)
    return carry_order(m), carry_order(norm), carry_order(acc)


MAX_ROWS = 128  # query rows a kv head's program holds (a [128, head_dim] f32 sum on chip)


def usable(kc, rows: int) -> bool:
    """Whether the kernel serves `rows` query rows a kv head (tokens x groups; a prefill or
    a long catch-up window keeps the XLA ops) over this cache (slots a multiple of its
    step)."""
    return kc.shape[3] % SLOTS == 0 and rows <= MAX_ROWS


def per_device(local, q, kc, vc, layer, positions, skip_own: bool, mesh=None):
    """(m, norm, acc): attention.py's running softmax of q [B,T,N,H] over the slots <=
    position of cache layer `layer` (skip_own: not those at the query positions), as the
    kernel wrapper `local` (this file's, or tpu_attention.py's) computes it on each device
    of `mesh` (rows and kv heads as the mesh's rules place them)."""
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    fn = functools.partial(local, skip_own=skip_own, interpret=platform == "cpu")
    if mesh is None or mesh.devices.size == 1:
        return fn(q, kc, vc, layer, positions)
    qs = partition_spec(("batch", "seq", "heads", "head_dim"))
    cs = partition_spec(("layers", "batch", "kv_heads", "cache_seq", "head_dim"))
    ps = partition_spec(("batch", "seq"))
    carry = partition_spec(("batch", "kv_heads", "norm", "seq"))
    acc = partition_spec(("batch", "kv_heads", "norm", "seq", "head_dim"))
    return jax.shard_map(fn, mesh=mesh, in_specs=(qs, cs, cs, P(), ps),
                         out_specs=(carry, carry, acc), check_vma=False)(
        q, kc, vc, layer, positions)


cache_softmax = functools.partial(per_device, _local)
