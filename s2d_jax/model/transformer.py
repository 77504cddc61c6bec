"""The one Llama-family transformer every model in s2d-jax uses.

It is written as Flax Linen modules (`Block`, `Transformer`) whose parameters come from
the rows of `params.PARAMS`, each created with its logical axes; callers keep plain
functions of a plain params dict, which apply the modules with those params. The decoder
blocks' params are stacked on a leading layer axis and `run_layers(..., start, end)`
scans `Block.apply` over any layer range `[start, end)` from a given hidden state: exits
of a sorted draft and early-exit self-speculation are slices of one stack, never copies.

Einsum letters: B batch, T query tokens, S key slots, D model dim, N query heads,
K kv heads, G query heads per kv head, H head dim, F mlp hidden, V vocab, L layers.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import flax.linen as nn

from s2d_jax.config import ModelConfig
from s2d_jax.model import small_matmul
from s2d_jax.model.kvcache import KVCache
from s2d_jax.model.rope import apply_rope, cos_sin
from s2d_jax.model.params import BY_PATH, LAYER_PARAMS, Param, shape_of
from s2d_jax.model.params import param_shapes  # noqa: F401  (callers use model.param_shapes)
from s2d_jax.parallel.mesh import logical_to_mesh_sharding


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def _attention(q, k, v, mask, cfg: ModelConfig):
    """q [B,T,N,H], k/v [B,S,K,H], mask [B,T,S] (True = may attend) -> [B,T,N,H]."""
    B, T, _, H = q.shape
    q = q.reshape(B, T, cfg.num_kv_heads, cfg.num_groups, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k) * (H ** -0.5)
    scores = jnp.where(mask[:, None, None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(B, T, cfg.num_heads, H)


# Slots a decode step's attention reads per block. The cache is a static buffer (max_len
# slots) but a row's keys end at its position: blocks past the batch's last position are
# not read at all (on a 2-core CPU, SmolLM2-135M, 450 of 1280 slots held: the attention of
# a step took 0.54 of its whole-buffer time).
ATTENTION_BLOCK = 256


def _cache_attention(q, kc, vc, layer, positions, cfg: ModelConfig, block: int,
                     new_kv=None):
    """Attention of q [B,T,N,H] at positions [B,T] to the slots <= position of cache layer
    `layer` (kc/vc [L, B, K, S, H]) -> [B,T,N,H]. `new_kv`: (k, v) [B,T,K,H] of the query
    tokens, not yet written to the cache: each block read is patched with them as if they
    had been (the caller writes them later, outside a `lax.cond` that must not copy it).

    Block by block over the slots up to the batch's largest position, with a running
    softmax (max, normalizer, weighted sum rescaled as the max grows): the same result as
    one softmax over every slot, up to float rounding. block >= S is one block."""
    B, T, _, H = q.shape
    S = kc.shape[3]
    C = min(block, S)
    q = q.reshape(B, T, cfg.num_kv_heads, cfg.num_groups, H)
    neg = jnp.finfo(jnp.float32).min
    last = jnp.minimum(jnp.max(positions), S - 1)
    n_blocks = last // C + 1

    def body(c, carry):
        m, norm, acc = carry
        lo = c * C
        start = jnp.minimum(lo, S - C)  # the last block may overlap the one before it
        at, size = (layer, 0, 0, start, 0), (1,) + kc.shape[1:3] + (C, H)
        # read as the layer computes (the cache may be stored narrower)
        kb = jax.lax.dynamic_slice(kc, at, size)[0].astype(q.dtype)
        vb = jax.lax.dynamic_slice(vc, at, size)[0].astype(q.dtype)
        if new_kv is not None:  # slots outside this block go to C, which "drop" skips
            rel = jnp.where((positions >= start) & (positions < start + C), positions - start, C)
            bidx = jnp.arange(B)[:, None]
            kb = kb.at[bidx, :, rel].set(new_kv[0].astype(kb.dtype), mode="drop")
            vb = vb.at[bidx, :, rel].set(new_kv[1].astype(vb.dtype), mode="drop")
        slots = start + jnp.arange(C)
        ok = (slots[None, None, :] >= lo) & (slots[None, None, :] <= positions[:, :, None])
        ok = ok[:, None, None]  # [B, 1, 1, T, C]
        s = jnp.einsum("BTKGH,BKCH->BKGTC", q, kb) * (H ** -0.5)
        s = jnp.where(ok, s.astype(jnp.float32), neg)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
        rescale = jnp.exp(m - m_new)
        pv = jnp.einsum("BKGTC,BKCH->BKGTH", p.astype(vb.dtype), vb)
        return (m_new, norm * rescale + jnp.sum(p, axis=-1),
                acc * rescale[..., None] + pv.astype(jnp.float32))

    shape = (B, cfg.num_kv_heads, cfg.num_groups, T)
    init = (jnp.full(shape, neg), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (H,), jnp.float32))
    _, norm, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out = (acc / norm[..., None]).astype(q.dtype)  # every query holds slot 0: norm > 0
    return jnp.einsum("BKGTH->BTKGH", out).reshape(B, T, cfg.num_heads, H)


def dense(eq: str, x: jnp.ndarray, w, dt, kernel: bool = False) -> jnp.ndarray:
    """einsum(eq, x, w) contracting x's trailing axes with w's leading ones. `w` is an
    array, a small_matmul.StackedWeight (one layer of the stack) or a
    quantize.QuantizedWeight: weight-only ones dequantize (astype), w8a8 ones run an int8
    matmul on the fly-quantized x. `kernel` (static): the caller decided this is a
    decode-path call the small-matmul kernel serves (`small_matmul.usable`)."""
    if kernel and small_matmul.serves(w):
        x_spec, w_spec = eq.split("->")[0].split(",")
        contract = sum(c in x_spec for c in w_spec)
        return small_matmul.matmul(x, w, "kn", contract).astype(dt)
    if getattr(w, "act_bits", 0):
        return w.matmul(x).astype(dt)
    return jnp.einsum(eq, x, w.astype(dt))


def _weight(module: nn.Module, row: Param) -> nn.Variable:
    """`row`'s parameter as a "params" variable of `module`, created at init as normal(std)
    (drawn in float32) or ones, in cfg.param_dtype, carrying its logical axes.

    A variable rather than `module.param`: at apply time a matrix may be a
    `quantize.QuantizedWeight`, whose leaves are not shaped like the row, and `param`
    would reject it."""
    cfg, std = module.cfg, module.std

    def init(key, shape, dtype):
        if row.init == "ones":
            return jnp.ones(shape, dtype)
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    boxed = nn.with_logical_partitioning(init, row.axes)
    return module.variable("params", row.name, lambda: boxed(
        module.make_rng("params"), shape_of(row, cfg), jnp.dtype(cfg.param_dtype)))


def _out_projection(attn: jnp.ndarray, wo, dt, kernel: bool) -> jnp.ndarray:
    """attn [B,T,N,H] @ wo [N,H,D]. A plain matrix is applied as [N*H, D] to the flattened
    heads: contracting (N, H) as two axes, the CPU backend transposed the whole weight on
    every call (~6% of a SmolLM2 decode step)."""
    if kernel and small_matmul.serves(wo):
        return dense("BTNH,NHD->BTD", attn, wo, dt, kernel)
    if isinstance(wo, small_matmul.StackedWeight):
        wo = wo.value
    if isinstance(wo, jax.Array):
        B, T, N, H = attn.shape
        return jnp.einsum("BTE,ED->BTD", attn.reshape(B, T, N * H),
                          wo.reshape(N * H, -1).astype(dt))
    return dense("BTNH,NHD->BTD", attn, wo, dt)


class Block(nn.Module):
    """One decoder block, params = one layer's slice of `params["layers"]`."""

    cfg: ModelConfig
    std: float = 0.02
    kernel: bool = False  # decode path: projections on the small-matmul kernel

    def setup(self):
        self.w = {row.name: _weight(self, row) for row in LAYER_PARAMS}

    def weights(self) -> dict:
        return {name: var.value for name, var in self.w.items()}

    def __call__(self, h, cos, sin, attend):
        """h [B, T, D] -> (h, extra). `attend(q, k_new, v_new) -> (out [B,T,N,H], extra)`
        attends with the new keys/values (and whatever a cache holds, storing them)."""
        cfg, w, dt = self.cfg, self.weights(), h.dtype
        mm = functools.partial(dense, dt=dt, kernel=self.kernel)
        x = rms_norm(h, w["attn_norm"], cfg.rms_norm_eps)
        q = mm("BTD,DNH->BTNH", x, w["wq"])
        k = mm("BTD,DKH->BTKH", x, w["wk"])
        v = mm("BTD,DKH->BTKH", x, w["wv"])
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn, extra = attend(q, k, v)
        h = h + _out_projection(attn, w["wo"], dt, self.kernel)
        x = rms_norm(h, w["mlp_norm"], cfg.rms_norm_eps)
        gate = mm("BTD,DF->BTF", x, w["w_gate"])
        up = mm("BTD,DF->BTF", x, w["w_up"])
        h = h + mm("BTF,FD->BTD", jax.nn.silu(gate) * up, w["w_down"])
        return h, extra


class Transformer(nn.Module):
    """The whole parameter tree: embedding, the stack of blocks (a leading "layers" axis
    added by `nn.vmap`), and the final norm + LM head a sorted draft's exits share.

    Its methods embed tokens and compute logits; the blocks run through `run_layers`,
    which scans `Block.apply` over any layer range (a KV-cache carry, a static unroll and
    remat policies that `nn.scan` would only re-implement)."""

    cfg: ModelConfig
    std: float = 0.02

    def setup(self):
        cfg = self.cfg
        self.embed = _weight(self, BY_PATH["embed"])
        self.layers = nn.vmap(
            Block, variable_axes={"params": 0}, split_rngs={"params": True},
            axis_size=cfg.num_layers, metadata_params={nn.PARTITION_NAME: "layers"},
            methods=["weights"])(cfg, self.std)
        self.final_norm = _weight(self, BY_PATH["final_norm"])
        if not cfg.tie_word_embeddings:
            self.lm_head = _weight(self, BY_PATH["lm_head"])

    def weights(self) -> dict:
        out = {"embed": self.embed.value, "layers": self.layers.weights(),
               "final_norm": self.final_norm.value}
        if not self.cfg.tie_word_embeddings:
            out["lm_head"] = self.lm_head.value
        return out

    def embed_tokens(self, tokens):
        return self.embed.value[tokens].astype(jnp.dtype(self.cfg.dtype))

    def lm_logits(self, h, kernel: bool = False):
        x = rms_norm(h, self.final_norm.value, self.cfg.rms_norm_eps)
        if self.cfg.tie_word_embeddings:
            return _head_nk(x, self.embed.value, kernel)
        return dense("...D,DV->...V", x, self.lm_head.value, x.dtype, kernel).astype(jnp.float32)


def _head_nk(x: jnp.ndarray, rows: jnp.ndarray, kernel: bool) -> jnp.ndarray:
    """Float32 logits x [..., D] @ rows [V, D]^T (a tied embedding, a sub-vocabulary head)."""
    if kernel and small_matmul.serves(rows):
        return small_matmul.matmul(x, rows, "nk", 1)
    return jnp.einsum("...D,VD->...V", x, rows.astype(x.dtype)).astype(jnp.float32)


def _init_boxed(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> dict:
    """Params with their logical axes attached (`nn.LogicallyPartitioned` leaves)."""
    return Transformer(cfg, std).init(key, method=Transformer.weights)["params"]


@functools.partial(jax.jit, static_argnames=("cfg", "std"))
def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> dict:
    """Random params (normal(std) matrices, unit norms) in `cfg.param_dtype`: a plain dict.

    Jitted so that one compile builds every tensor (eagerly, each draw compiles its own).
    """
    return nn.unbox(_init_boxed(cfg, key, std))


def abstract_params(cfg: ModelConfig) -> dict:
    """Param shapes/dtypes as ShapeDtypeStructs, with no memory allocated."""
    return jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))


@functools.lru_cache(maxsize=64)
def logical_param_specs(cfg: ModelConfig) -> dict:
    """Params-shaped tree of PartitionSpecs of logical axis names, read off the modules."""
    boxed = jax.eval_shape(functools.partial(_init_boxed, cfg), jax.random.key(0))
    return nn.get_partition_spec(boxed)


def param_shardings(cfg: ModelConfig, mesh):
    """Params-shaped tree of NamedShardings from the one rule table (`mesh.RULES`)."""
    return logical_to_mesh_sharding(logical_param_specs(cfg), mesh)


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# A short range of small layers runs unrolled (the loop's per-iteration cost dominates them);
# larger layers run as a loop, which was faster on CPU even for 2 layers: SmolLM2-135M
# (3.5M parameters a layer), a 2-layer draft segment 2.0 ms looped vs 3.4 ms unrolled; the
# demo models (<= 1.6M a layer) 0.11 ms unrolled vs 0.19 ms looped (3 layers).
UNROLL_LAYERS = 4
UNROLL_MAX_LAYER_PARAMS = 2_000_000


def layer_param_count(cfg: ModelConfig) -> int:
    D, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return 2 * D * q + 2 * D * kv + 3 * D * cfg.intermediate_size + 2 * D


def unroll_layers(cfg: ModelConfig, count: int) -> bool:
    return count <= UNROLL_LAYERS and layer_param_count(cfg) <= UNROLL_MAX_LAYER_PARAMS


# The decoder block's matrices (the rows with input axes), as opposed to its norm weights.
MATRIX_NAMES = frozenset(p.name for p in LAYER_PARAMS if p.n_in)


def layer_slice(params: dict, start: int, end: int) -> dict:
    return jax.tree.map(lambda x: x[start:end], params["layers"])


def run_layers(params: dict, cfg: ModelConfig, h: jnp.ndarray, positions: jnp.ndarray,
               start: int = 0, end: int | None = None, cache: KVCache | None = None,
               segment_ids: jnp.ndarray | None = None, remat: str = "none",
               layers: dict | None = None, fresh: bool = False,
               attention_block: int = ATTENTION_BLOCK, defer_writes: bool = False):
    """Run decoder layers `[start, end)` on hidden states h [B, T, D] at positions [B, T].

    `layers`: the weights of exactly those layers, sliced beforehand (default: sliced here
    from params["layers"]; inside a loop body XLA re-executes that slice, a weight copy,
    every iteration).

    With a cache, the new keys/values go to slot == position of layer `start + i`, and each
    query attends to every slot <= its position. Without a cache, attention is causal
    within the call (and within each `segment_ids` segment, for packed training rows).
    `fresh` (static; with a cache): the call's tokens are the first the cache holds, at
    positions 0..T-1 of every row (a prefill), so they attend to each other only, causally:
    the same keys as slots <= position, without scoring all max_len slots (on a 2-core CPU a
    300-token prefill into a 1024-slot cache took 2.6x as long that way).
    `attention_block` (static): slots a cached step's attention reads per block
    (`_cache_attention`; >= max_len reads the whole buffer in one).
    `defer_writes` (static; with a cache, not fresh): the cache is only read and the new
    keys/values are returned instead, (h, (k, v) [end - start, B, T, K, H]), for the caller
    to write (`kvcache.write_layers`) after a `lax.cond` (a cache written inside a cond
    branch is copied whole on entry to it) and after every read (`kvcache.ordered_after`).
    `start`/`end` are static. Returns (h, cache); cache lengths are left to the caller.
    """
    end = cfg.num_layers if end is None else end
    if not 0 <= start <= end <= cfg.num_layers:
        raise ValueError(f"layer range [{start}, {end}) outside [0, {cfg.num_layers}]")
    if start == end:
        return h, cache
    cos, sin = cos_sin(cfg, positions)

    if cache is None:
        layers = layer_slice(params, start, end) if layers is None else layers
        idx = jnp.arange(start, end, dtype=jnp.int32)
        block = Block(cfg)
        B, T = positions.shape
        tpos = jnp.arange(T)
        mask = tpos[None, :, None] >= tpos[None, None, :]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        mask = jnp.broadcast_to(mask, (B, T, T))

        def body(h, xs):
            lp, _ = xs
            h, _ = block.apply({"params": lp}, h, cos, sin,
                               lambda q, k, v: (_attention(q, k, v, mask, cfg), None))
            return h, None

        if remat not in REMAT_POLICIES:
            raise ValueError(f"unknown remat policy {remat!r}; use one of {list(REMAT_POLICIES)}")
        if remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[remat])
        h, _ = jax.lax.scan(body, h, (layers, idx))
        return h, None

    B, T = positions.shape
    bidx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    if fresh:
        tpos = jnp.arange(T)
        mask = jnp.broadcast_to(tpos[None, :, None] >= tpos[None, None, :], (B, T, T))
    kernel = small_matmul.usable(B * T)
    block = Block(cfg, kernel=kernel)
    xs, stacked = _scanned_layers(params, layers, start, end, kernel)

    def with_stacked(lp, si):  # the matrices the kernel reads in place, as layer si of their stack
        return {**lp, **{n: small_matmul.StackedWeight(w, si) for n, w in stacked.items()}}

    if defer_writes:
        def read_only(h, xs):
            lp, li, si = xs
            return block.apply({"params": with_stacked(lp, si)}, h, cos, sin,
                               lambda q, k, v: (_cache_attention(
                                   q, cache.k, cache.v, li, positions, cfg, attention_block,
                                   (k, v)), (k, v)))

        h, kv = jax.lax.scan(read_only, h, xs, unroll=unroll_layers(cfg, end - start))
        return h, kv

    def body(carry, xs):
        h, k_cache, v_cache = carry
        lp, li, si = xs
        lp = with_stacked(lp, si)

        def attend(q, k, v):
            # Scatter the new keys into their slots (positions past the cache are dropped).
            kc = k_cache.at[li, bidx, :, positions].set(k.astype(k_cache.dtype), mode="drop")
            vc = v_cache.at[li, bidx, :, positions].set(v.astype(v_cache.dtype), mode="drop")
            if fresh:  # the keys as stored (cache dtype), as a later step reads them
                k, v = (x.astype(kc.dtype).astype(h.dtype) for x in (k, v))
                return _attention(q, k, v, mask, cfg), (kc, vc)
            return _cache_attention(q, kc, vc, li, positions, cfg, attention_block), (kc, vc)

        h, (kc, vc) = block.apply({"params": lp}, h, cos, sin, attend)
        return (h, kc, vc), None

    (h, k, v), _ = jax.lax.scan(body, (h, cache.k, cache.v), xs,
                                unroll=unroll_layers(cfg, end - start))
    return h, cache.replace(k=k, v=v)


def _scanned_layers(params: dict, layers: dict | None, start: int, end: int, kernel: bool):
    """What a cached layer scan iterates over: (per-layer params, cache layer index, index
    into the stacks), and the weight stacks the small-matmul kernel reads in place (so the
    scan does not slice a copy of each layer's matrices every step)."""
    idx = jnp.arange(start, end, dtype=jnp.int32)
    stack, first = (params["layers"], start) if layers is None else (layers, 0)
    stacked = {n: w for n, w in stack.items()
               if kernel and n in MATRIX_NAMES and small_matmul.serves(w)}
    rest = {n: w for n, w in stack.items() if n not in stacked}
    if layers is None:
        rest = jax.tree.map(lambda x: x[start:end], rest)
    return (rest, idx, idx - start + first), stacked


def embed_tokens(params: dict, cfg: ModelConfig, tokens: jnp.ndarray) -> jnp.ndarray:
    return Transformer(cfg).apply({"params": params}, tokens, method=Transformer.embed_tokens)


def lm_logits(params: dict, cfg: ModelConfig, h: jnp.ndarray, decode: bool = False) -> jnp.ndarray:
    """Final norm + LM head (tied or untied) -> float32 logits [..., V].

    A draft with a sub-vocabulary head (params["head_ids"], see `sub_vocab_logits`) scores
    only those tokens; every other token gets logit SUB_VOCAB_FLOOR (probability 0).
    `decode` (static): a decode step's few rows, which the small-matmul kernel may serve."""
    if "head_ids" in params:
        full = jnp.full(h.shape[:-1] + (cfg.vocab_size,), SUB_VOCAB_FLOOR, jnp.float32)
        return full.at[..., params["head_ids"]].set(sub_vocab_logits(params, cfg, h, decode))
    kernel = decode and small_matmul.usable(math.prod(h.shape[:-1]))
    return Transformer(cfg).apply({"params": params}, h, kernel, method=Transformer.lm_logits)


# Finite, so temperature scaling and softmax stay NaN-free; exp(floor - max) is exactly 0.
SUB_VOCAB_FLOOR = -1e9


def head_rows(params: dict) -> jnp.ndarray:
    """[V', D] rows of the LM head for the sub-vocabulary params["head_ids"] (all [V, D]
    rows without one); pre-gathered as params["head_rows"] outside a decode loop (a
    gather in the loop body re-runs)."""
    if "head_rows" in params:
        return params["head_rows"]
    ids = params.get("head_ids", slice(None))
    return params["lm_head"][:, ids].T if "lm_head" in params else params["embed"][ids]


def sub_vocab_logits(params: dict, cfg: ModelConfig, h: jnp.ndarray,
                     decode: bool = False) -> jnp.ndarray:
    """Float32 logits [..., V'] over the sub-vocabulary params["head_ids"] [V'].

    A draft's head over the target's most frequent output tokens costs V'/V of the full
    head (SmolLM2's 49152 x 576 head costs about eight of its layers). Speculative
    sampling stays exact: the draft's q is 0 outside the sub-vocabulary, so those tokens
    are simply never proposed (the target still emits them on rejection)."""
    x = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    return _head_nk(x, head_rows(params), decode and small_matmul.usable(math.prod(h.shape[:-1])))


def forward(params: dict, cfg: ModelConfig, tokens: jnp.ndarray, positions=None,
            cache: KVCache | None = None, segment_ids=None, remat: str = "none",
            fresh: bool = False):
    """Full model: tokens [B, T] -> (float32 logits [B, T, V], cache).

    Positions default to the cache's next positions (or 0..T-1 without a cache); the
    returned cache holds the new keys/values but its lengths are not advanced. `fresh`:
    see run_layers (a prefill into an empty cache).
    """
    if positions is None:
        T = tokens.shape[1]
        positions = (cache.next_positions(T) if cache is not None
                     else jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens.shape))
    h = embed_tokens(params, cfg, tokens)
    h, cache = run_layers(params, cfg, h, positions, 0, cfg.num_layers, cache, segment_ids, remat,
                          fresh=fresh)
    return lm_logits(params, cfg, h, decode=cache is not None), cache
