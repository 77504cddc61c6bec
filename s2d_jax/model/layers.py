"""Running a range of decoder layers `[start, end)` of the stacked params.

Two functions, one per way a call attends:
- `run_layers`: causal within the call. Training (no cache) and a prefill (the call's
  tokens are the first a cache holds, at positions 0..T-1: their keys/values are written
  to it, and they attend to each other only, the same keys as the slots <= position).
- `decode_layers`: each query attends to every cache slot <= its position (decode steps,
  verify windows, draft steps), block by block (`attention.cache_attention`).
Both scan `block.block` over the layer axis (a KV-cache carry, a static unroll and remat
policies). `start`/`end` are static; exits of a sorted draft and early-exit
self-speculation are slices of one stack, never copies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from s2d_jax.config import ModelConfig
from s2d_jax.model import small_matmul
from s2d_jax.model.decode_scope import (decode_unrolled, for_platform,  # noqa: F401
                                        fused_attention_mesh, static_decode_slices)
from s2d_jax.model import attention as attention_mod
from s2d_jax.model.attention import attention, cache_attention, causal_mask
from s2d_jax.model.block import MATRIX_NAMES, block, mean_square
from s2d_jax.model.kvcache import KVCache, write_slots
from s2d_jax.model.rope import cos_sin

# The projections block.block names (checkpoint_name), as MaxText names them.
_PROJECTIONS = ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1",
                "mlpwo")
# What the backward pass of a layer keeps (the rest is recomputed): "none" keeps everything
# (no jax.checkpoint); "minimal" the projections' outputs; "minimal_with_context" those and
# the attention's output (MaxText's default); "save_dot_with_context_except_mlp" those but
# the MLP's two [B, T, F] inputs, its largest; "full" only the layer's input. The memory and
# compiler's time of each at the pod shape: docs/distributed.md.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(*_PROJECTIONS),
    "minimal_with_context": jax.checkpoint_policies.save_only_these_names(*_PROJECTIONS,
                                                                          "context"),
    "save_dot_with_context_except_mlp": jax.checkpoint_policies.save_only_these_names(
        "query_proj", "key_proj", "value_proj", "context", "out_proj"),
}

# A short range of small layers runs unrolled (the loop's per-iteration cost dominates them);
# larger layers run as a loop, which was faster on CPU even for 2 layers: SmolLM2-135M
# (3.5M parameters a layer), a 2-layer draft segment 2.0 ms looped vs 3.4 ms unrolled; the
# demo models (<= 1.6M a layer) 0.11 ms unrolled vs 0.19 ms looped (3 layers).
UNROLL_LAYERS = 4
UNROLL_MAX_LAYER_PARAMS = 2_000_000
# Unrolled draft segments (the layers of a sorted draft's exits) index their weight stacks
# and caches at indices the compiler does not see (round_cost's one-round TPU program): the
# loop's dynamic slices, which the TPU compiler reads into VMEM; their static slices of `wo`
# it copied into HBM first. (The target's static slices it streams as the loop does: AR
# 1.000x the loop's round on the 70B, and 1.17x here with opaque slices on a small model.)
OPAQUE_LAYER_INDEX = False
# The cacheless layer scan (training) as a loop; train/aot.py's compiler step estimate
# unrolls it (XLA's cost analysis counts a loop body once).
TRAIN_UNROLL = 1


def layer_param_count(cfg: ModelConfig) -> int:
    D, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return 2 * D * q + 2 * D * kv + 3 * D * cfg.intermediate_size + 2 * D


def unroll_layers(cfg: ModelConfig, count: int) -> bool:
    return count <= UNROLL_LAYERS and layer_param_count(cfg) <= UNROLL_MAX_LAYER_PARAMS


def layer_slice(params: dict, start: int, end: int) -> dict:
    return jax.tree.map(lambda x: x[start:end], params["layers"])


def _layer_range(cfg: ModelConfig, start: int, end: int | None) -> int:
    end = cfg.num_layers if end is None else end
    if not 0 <= start <= end <= cfg.num_layers:
        raise ValueError(f"layer range [{start}, {end}) outside [0, {cfg.num_layers}]")
    return end


def run_layers(params: dict, cfg: ModelConfig, h: jnp.ndarray, positions: jnp.ndarray,
               start: int = 0, end: int | None = None, cache: KVCache | None = None,
               segment_ids: jnp.ndarray | None = None, remat: str = "none",
               layers: dict | None = None):
    """Layers `[start, end)` on h [B, T, D] at positions [B, T], attending causally within
    the call (and within each `segment_ids` segment, for packed training rows) -> (h, cache).

    `cache`: a prefill. The call's tokens are the first the cache holds, at positions
    0..T-1 of every row; their keys/values go to slot == position of layer `start + i`
    and the attention uses them as stored (cache dtype), as a later step reads them. The
    same keys as a cached step's slots <= position, without scoring all max_len slots (on
    a 2-core CPU a 300-token prefill into a 1024-slot cache took 2.6x as long that way).
    Cache lengths are left to the caller. `layers`: the weights of exactly those layers,
    sliced beforehand (default: sliced here from params["layers"]). `remat` (training):
    a `REMAT_POLICIES` name."""
    end = _layer_range(cfg, start, end)
    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; use one of {list(REMAT_POLICIES)}")
    if start == end:
        return h, cache
    mask = causal_mask(*positions.shape, segment_ids)
    if cache is None:
        cos, sin = cos_sin(cfg, positions)

        def body(h, lp):
            return block(lp, cfg, h, cos, sin,
                         lambda q, k, v: (attention(q, k, v, mask, cfg), None))[0], None

        if remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[remat])
        layers = layer_slice(params, start, end) if layers is None else layers
        return jax.lax.scan(body, h, layers, unroll=TRAIN_UNROLL)[0], None

    def attend(q, k, v, kc, vc, li):
        kc, vc = write_slots(kc, vc, li, positions, k, v)
        k, v = (x.astype(kc.dtype).astype(q.dtype) for x in (k, v))
        return attention(q, k, v, mask, cfg), (kc, vc)

    return _cache_scan(params, cfg, h, positions, start, end, cache, layers, attend)


def decode_layers(params: dict, cfg: ModelConfig, h: jnp.ndarray, positions: jnp.ndarray,
                  start: int, end: int, cache: KVCache, layers: dict | None = None,
                  attention_block: int | None = None, defer_writes: bool = False):
    """Layers `[start, end)` on h [B, T, D] at positions [B, T] with a cache -> (h, cache):
    the new keys/values go to slot == position of layer `start + i` (positions past the
    cache are dropped) and each query attends to every slot <= its position.

    `layers`: as in `run_layers` (inside a loop body a slice made here re-executes every
    iteration, a weight copy). `attention_block` (static): slots read per block (>=
    max_len reads the whole buffer in one; default attention.ATTENTION_BLOCK, read per
    call so a one-round cost compile can read the cache in one block, round_cost.py). `defer_writes` (static): the cache is only
    read and the new keys/values are returned instead, (h, (k, v) [end - start, B, T, K,
    H]), for the caller to write (`kvcache.write_layers`) after a `lax.cond` (a cache
    written inside a cond branch is copied whole on entry to it) and after every read
    (`kvcache.ordered_after`). Cache lengths are left to the caller."""
    end = _layer_range(cfg, start, end)
    if start == end:
        return h, cache
    attention_block = attention_block or attention_mod.ATTENTION_BLOCK
    if defer_writes:
        def read_only(q, k, v, kc, vc, li):
            return cache_attention(q, kc, vc, li, positions, cfg, attention_block, (k, v)), (k, v)

        return _cache_scan(params, cfg, h, positions, start, end, cache, layers, read_only,
                           carry_cache=False, decode=True)

    def attend(q, k, v, kc, vc, li):
        kc, vc = write_slots(kc, vc, li, positions, k, v)
        return cache_attention(q, kc, vc, li, positions, cfg, attention_block), (kc, vc)

    return _cache_scan(params, cfg, h, positions, start, end, cache, layers, attend,
                       decode=True)


def _cache_scan(params, cfg, h, positions, start, end, cache, layers, attend,
                carry_cache: bool = True, decode: bool = False):
    """Scan the blocks of layers [start, end) with a cache. `attend(q, k, v, kc, vc, li)
    -> (out, extra)` sees cache layer li of the buffers kc, vc. carry_cache: the buffers
    are the scan's carry, `extra` their new value -> (h, cache with them); otherwise they
    are only read and `extra` is stacked over the layers -> (h, stacked extra)."""
    cos, sin = cos_sin(cfg, positions)
    stack = layers if layers is not None else params.get("layers", {})
    kernel = small_matmul.usable(positions.size, stack.get("wq") if isinstance(stack, dict) else None)
    xs, stacked = _scanned_layers(params, layers, start, end, kernel)
    unroll = unroll_layers(cfg, end - start) or (decode and static_decode_slices())

    tpu = decode and tpu_decode()

    def run_block(hs, x, kc, vc):
        lp, li, si = x  # the matrices the kernel reads in place, as layer si of their stack
        lp = {**lp, **{n: small_matmul.StackedWeight(w, si) if kernel
                       else jax.lax.dynamic_index_in_dim(w, si, keepdims=False)
                       for n, w in stacked.items()}}
        h, ms = hs if tpu else (hs, None)
        h, extra = block(lp, cfg, h, cos, sin, lambda q, k, v: attend(q, k, v, kc, vc, li),
                         kernel, ms, norm_once=tpu)
        return ((h, mean_square(h)) if tpu else h), extra

    # A TPU decode scan carries each layer's output with its RMSNorm statistic, computed
    # in the fusion that writes the output (the MLP's residual add): the next layer's
    # norm then reads its input once, not twice (v5p 70B SD verify at batch 8: 0.05 GiB
    # a round, docs/distributed.md). The same float32 mean of the same values.
    hs = (h, mean_square(h)) if tpu else h
    if not carry_cache:
        hs, extra = jax.lax.scan(lambda h, x: run_block(h, x, cache.k, cache.v), hs, xs,
                                 unroll=unroll)
        return (hs[0] if tpu else hs), extra

    def body(carry, x):
        hs, kc, vc = carry
        hs, (kc, vc) = run_block(hs, x, kc, vc)
        return (hs, kc, vc), None

    (hs, k, v), _ = jax.lax.scan(body, (hs, cache.k, cache.v), xs, unroll=unroll)
    return (hs[0] if tpu else hs), cache.replace(k=k, v=v)


def tpu_decode() -> bool:
    """Whether decode layers traced now are a TPU program's (decode_scope's TPU attention
    kernel scope: a TPU mesh's programs, or the default backend a TPU)."""
    return fused_attention_mesh()[0] == "tpu"


def _scanned_layers(params: dict, layers: dict | None, start: int, end: int, kernel: bool):
    """What a cached layer scan iterates over: (per-layer params, cache layer index, index
    into the stacks), and the weight stacks the small-matmul kernel reads in place (so the
    scan does not slice a copy of each layer's matrices every step)."""
    idx = jnp.arange(start, end, dtype=jnp.int32)
    opaque = OPAQUE_LAYER_INDEX and layers is not None  # a draft's exit segment
    if opaque:
        idx = jax.lax.optimization_barrier(idx)
    stack, first = (params["layers"], start) if layers is None else (layers, 0)
    stacked = {n: w for n, w in stack.items() if n in MATRIX_NAMES and (
        (kernel and small_matmul.serves(w)) or opaque)}
    rest = {n: w for n, w in stack.items() if n not in stacked}
    if layers is None:
        rest = jax.tree.map(lambda x: x[start:end], rest)
    return (rest, idx, idx - start + first), stacked
