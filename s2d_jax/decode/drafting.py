"""The draft's proposal: tokens with early-exit escalation over a sorted draft (S2D).

The draft is one layer stack with exits e_1 < ... < e_m sharing the final norm and head.
For each token: run layers [0, e_1), score the exit's prediction; a row keeps it when its
confidence reaches the exit's threshold, otherwise the next slice [e_i, e_{i+1}) continues
from the same hidden state (nothing recomputed). The last exit always keeps its token.
A deeper slice is computed only if ANY row of the batch needs it (`lax.cond`); rows that
had already decided keep their earlier token (compute-then-select per row).

Keys/values of skipped layers (the K/V scheme). When no row needs a deeper slice, the
layers [e_i, e_m) are skipped for this position, but later tokens that go deeper will
attend to this position in those layers. We fill them CALM-style (Schuster et al. 2022):
for each skipped layer, K/V = rope(norm_l(h_exit) @ wk_l), norm_l(h_exit) @ wv_l, from
the exit's hidden state. This is a cheap projection (no attention, no MLP) and keeps the
cache complete with no extra state. When the batch does go deeper, every row (also rows
that already decided) gets the true deeper K/V. `kv_fill="full"` instead always runs every
slice (true K/V everywhere, tokens still chosen at the exit): the reference that measures
what the CALM approximation costs in accepted tokens.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from s2d_jax.model import transformer as model
from s2d_jax.config import ModelConfig
from s2d_jax.model.kvcache import KVCache, ordered_after, write_layers
from s2d_jax.model.decode_scope import gemm_rows
from s2d_jax.model.layers import static_decode_slices, tpu_decode
from s2d_jax.model.rope import apply_rope, cos_sin
from s2d_jax.decode.sampling import SamplingParams, confidence, probs_from_logits, sample
from s2d_jax.decode.state import DecodeParams, SpecConfig


# Trace the conditionals below as their dearest branch alone (round_cost's one-round
# program: one round at its dearest, as the walk's `hi` counts it). Unrolled inside a
# conditional, the TPU compiler copied a draft layer's static `wo` slice into HBM (read,
# written and read again) where the loop prefetches a layer's slice into VMEM: the 70B's
# one-round SD program walked 1.08x the loop's round (tests/test_tpu_aot.py).
_dearest: list[bool] = [False]


@contextlib.contextmanager
def dearest_branches():
    """Trace drafting's skips (rows finished, no row escalating) as always taken."""
    _dearest.append(True)
    try:
        yield
    finally:
        _dearest.pop()


def _cond(pred, dearest, cheapest, *args):
    return dearest(*args) if _dearest[-1] else jax.lax.cond(pred, dearest, cheapest, *args)


def with_exit_segments(params: dict, exits: tuple[int, ...]) -> dict:
    """params plus "exit_segments": the layer weights of [0, e_1), [e_1, e_2), ... sliced
    once. Call it outside the decode loop: a slice inside the loop body is a weight copy
    XLA re-executes every draft step (measured ~20% of a small draft's step on CPU)."""
    bounds = (0,) + tuple(exits)
    out = dict(params)
    if not static_decode_slices():
        # (On a GPU the layer ranges read static slices of the stacks in place, layers.py;
        # sliced segments would be arrays whose layout XLA picks for the loop, and it picked
        # transposed ones, re-copied for every draft step.)
        out["exit_segments"] = tuple(model.layer_slice(params, lo, hi)
                                     for lo, hi in zip(bounds[:-1], bounds[1:]))
    if "head_ids" in params:  # the sub-vocabulary head's rows, gathered once
        out["head_rows"] = model.head_rows(params)
    return out


def _segment(params: dict, exits: tuple[int, ...], i: int) -> dict:
    """Layer weights of exit segment i ([e_{i-1}, e_i), e_0 = 0), pre-sliced if available."""
    if "exit_segments" in params:
        return params["exit_segments"][i]
    return model.layer_slice(params, exits[i - 1] if i else 0, exits[i])


def calm_kv(params: dict, cfg: ModelConfig, h: jnp.ndarray, positions: jnp.ndarray,
            start: int, end: int, cache: KVCache, layers: dict | None = None):
    """CALM K/V for layers [start, end) from hidden states h [B, T, D] at positions [B, T]
    (`layers`: those layers' weights if already sliced) -> (k, v [end - start, B, T, K, H],
    the positions to write them at [B, T]); `cache` is only read (its lengths).

    Only positions >= cache.lengths are written (the others go to slot max_len, which the
    write skips): below it the cache already holds K/V for these very tokens (exact from
    the prefill or a deeper pass, or an earlier fill), and an approximation must not
    overwrite an exact value (re-feeding the catch-up window's first position would
    otherwise replace its prefill K/V)."""
    lp = model.layer_slice(params, start, end) if layers is None else layers
    dt = h.dtype
    x = model.rms_norm(h, lp["attn_norm"][:, None, None, :], cfg.rms_norm_eps)  # [L, B, T, D]
    L, B, T, D = x.shape
    _, _, K, H = lp["wk"].shape
    # One batched [B*T, D] x [D, K*H] matmul per layer with the weights in their stored
    # layout: an einsum whose output puts L after B, T made XLA:CPU transpose both weight
    # stacks on every draft step (~0.6 ms of a 3 ms step of the 8-layer draft, measured).
    x = x.reshape(L, B * T, D)
    if static_decode_slices():
        # A GPU program: each layer's GEMMs over static slices, its rows padded (gemm_rows:
        # the batched form read a transposed copy of the layers; unpadded, one row of a 7B
        # draft's fill crashed XLA:GPU's compiler, "Reshape input and output shapes")
        k = jnp.stack([gemm_rows("ND,DM->NM", x[i], lp["wk"][i].reshape(D, K * H).astype(dt), 1)
                       for i in range(L)])
        v = jnp.stack([gemm_rows("ND,DM->NM", x[i], lp["wv"][i].reshape(D, K * H).astype(dt), 2)
                       for i in range(L)])
    elif tpu_decode():
        # A TPU program: the weights as stored, [L, D, K, H]. Their tiles span (K, H), so
        # the [L, D, K*H] view above is a relayout the TPU compiler copies out of every
        # fill (the 70B's 12-layer draft at batch 1: ~0.4 GiB a round on the S2D lo path)
        k = jnp.einsum("LND,LDKH->LNKH", x, lp["wk"].astype(dt))
        v = jnp.einsum("LND,LDKH->LNKH", x, lp["wv"].astype(dt))
    else:
        k = jnp.einsum("LND,LDM->LNM", x, lp["wk"].reshape(L, D, K * H).astype(dt))
        v = jnp.einsum("LND,LDM->LNM", x, lp["wv"].reshape(L, D, K * H).astype(dt))
    k = k.reshape(L, B, T, K, H).transpose(1, 2, 0, 3, 4)
    cos, sin = cos_sin(cfg, positions)
    k = apply_rope(k.reshape(B, T, L * K, H), cos, sin).reshape(B, T, L, K, H)
    held = positions < cache.lengths[:, None]
    return jnp.moveaxis(k, 2, 0), v.reshape(L, B, T, K, H), \
        jnp.where(held, cache.max_len, positions)


def fill_skipped_kv(params: dict, cfg: ModelConfig, h: jnp.ndarray, positions: jnp.ndarray,
                    start: int, end: int, cache: KVCache, layers: dict | None = None) -> KVCache:
    """`calm_kv` written into the cache."""
    if start == end:
        return cache
    k, v, at = calm_kv(params, cfg, h, positions, start, end, cache, layers)
    return write_layers(cache, start, k, v, at)


def draft_token_kv(params: dict, cfg: ModelConfig, cache: KVCache, tokens: jnp.ndarray,
                   positions: jnp.ndarray, key: jax.Array, sp: SamplingParams,
                   thresholds: jnp.ndarray, exits: tuple[int, ...],
                   conf_kind: str = "max_prob", kv_fill: str = "calm", rows=None):
    """`draft_token` that only reads the cache (`rows` [B]: the rows whose token is used;
    the others never send the batch deeper: a finished row, a free slot of the slot
    engine): it returns the new keys/values of layers
    [0, exits[-1]) instead, (k, v [exits[-1], B, T, K, H], positions [exits[-1], B, T]),
    and the cache to write them into (`write_layers(cache, 0, ...)`; the keys/values are
    computed after every read of it, `kvcache.ordered_after`). Why: every `lax.cond` here (and the caller's) then
    carries only what its branch changes; a cache updated inside a branch is copied whole
    on entry to it (measured in the compiled HLO, tests/test_loop_copies.py)."""
    m = len(exits)
    B = tokens.shape[0]
    h = model.embed_tokens(params, cfg, tokens)
    h, (k, v) = model.decode_layers(params, cfg, h, positions, 0, exits[0], cache,
                                    layers=_segment(params, exits, 0), defer_writes=True)
    ks, vs, ps = [k], [v], [jnp.broadcast_to(positions, k.shape[:3])]
    logits = model.lm_logits(params, cfg, h[:, -1], decode=True)
    conf = confidence(logits, sp, conf_kind)
    exit_idx = jnp.zeros((B,), jnp.int32)
    # threshold 1 means "never stop here", even if the confidence rounds to exactly 1.
    decided = (conf >= thresholds[0]) & (thresholds[0] < 1.0) if m > 1 else jnp.ones((B,), bool)
    if rows is not None:
        decided = decided | ~rows

    for i in range(1, m):  # static, small: one graph node per exit
        lo, hi, seg = exits[i - 1], exits[i], _segment(params, exits, i)

        def deeper(h, lo=lo, hi=hi, seg=seg):
            h, (k, v) = model.decode_layers(params, cfg, h, positions, lo, hi, cache,
                                            layers=seg, defer_writes=True)
            return h, k, v, jnp.broadcast_to(positions, k.shape[:3]), \
                model.lm_logits(params, cfg, h[:, -1], decode=True)

        def skip(h, lo=lo, hi=hi, seg=seg):
            k, v, at = calm_kv(params, cfg, h, positions, lo, hi, cache, seg)
            return h, k, v, jnp.broadcast_to(at, k.shape[:3]), logits * 0

        need = ~decided
        if kv_fill == "full":
            h, k, v, at, new_logits = deeper(h)
        else:
            h, k, v, at, new_logits = _cond(jnp.any(need), deeper, skip, h)
        ks, vs, ps = ks + [k], vs + [v], ps + [at]
        new_conf = confidence(new_logits, sp, conf_kind)
        logits = jnp.where(need[:, None], new_logits, logits)
        conf = jnp.where(need, new_conf, conf)
        exit_idx = jnp.where(need, i, exit_idx)
        keep = (new_conf >= thresholds[i]) & (thresholds[i] < 1.0) if i < m - 1 else True
        decided = decided | (need & keep)

    q = probs_from_logits(logits, sp)
    # written after the last read of the cache (the final h depends on every read)
    k, v = ordered_after(h, *(jnp.concatenate(x, axis=0) for x in (ks, vs)))
    kv = (k, v, jnp.concatenate(ps, axis=0))
    return sample(key, q, sp.greedy), q, exit_idx, conf, kv, cache


def draft_token(params: dict, cfg: ModelConfig, cache: KVCache, tokens: jnp.ndarray,
                positions: jnp.ndarray, key: jax.Array, sp: SamplingParams,
                thresholds: jnp.ndarray, exits: tuple[int, ...], conf_kind: str = "max_prob",
                kv_fill: str = "calm"):
    """Feed tokens [B, T] at positions [B, T]; propose the token after the last one.

    Returns (token [B], q [B, V] the distribution it was drawn from, exit index [B],
    confidence [B] of the kept exit, cache with the new keys/values).
    """
    d, q, e, c, kv, cache = draft_token_kv(params, cfg, cache, tokens, positions, key, sp,
                                           thresholds, exits, conf_kind, kv_fill)
    return d, q, e, c, write_layers(cache, 0, *kv)


def _no_step(like: tuple, kv_shape: tuple, max_len: int):
    """What a skipped draft step returns: zeros shaped like (token, q, exit, confidence)
    and keys/values aimed at slot max_len, which the cache write drops."""
    k, v, at = kv_shape
    return (*(jnp.zeros_like(x) for x in like),
            (jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype),
             jnp.full(at.shape, max_len, at.dtype)))


def draft_block(params: dict, cfg: ModelConfig, cache: KVCache, work: jnp.ndarray,
                start: jnp.ndarray, key: jax.Array, rows: jnp.ndarray, dp: DecodeParams,
                spec: SpecConfig, limit: jnp.ndarray | None = None, window: int | None = None):
    """Propose up to gamma tokens after the sequences work[b, :start[b]], one draft_token
    step each, for the rows that need them (`rows` [B]; other rows compute and are ignored).
    `limit` [B]: a row needs at most this many (the room left in the buffer, round.py).
    `window` (static): the tokens the first step feeds, default the chain's catch-up window
    (num_levels); the ladder widens it by the lookup's tokens placed before `start`.

    Returns (tokens [B, G], q [B, G, V] their draws' laws, count [B], exits [B, G], cache).
    """
    n, G, S = spec.num_levels, spec.gamma, work.shape[1]
    # K/V held for the tokens now in `work`: at most up to start - 1 (that token is new:
    # the verifier's correction or bonus); less if the last call's drafts were not all fed.
    cache = cache.with_lengths(jnp.where(rows, jnp.minimum(cache.lengths, start - 1),
                                         cache.lengths))
    step = functools.partial(draft_token_kv, params, cfg, sp=dp.sampling,
                             thresholds=dp.thresholds, exits=spec.exits,
                             conf_kind=spec.confidence, kv_fill=spec.kv_fill, rows=rows)
    # The first step feeds the last n tokens (the catch-up window, round.py). Positions
    # are clamped to the buffer: only finished rows can reach past it, and a larger
    # position would change dynamic-NTK rope (batch max position) for every row.
    W = n if window is None else window
    pos_w = jnp.maximum((start - W)[:, None] + jnp.arange(W, dtype=jnp.int32), 0)
    tok_w = jnp.take_along_axis(work, pos_w, axis=1)
    d0, q0, e0, c0, kv0, cache = step(cache, tok_w, pos_w, jax.random.fold_in(key, 0))
    cache = write_layers(cache, 0, *kv0)
    # Dynamic draft length (off when stop_threshold = 0): a row stops proposing after a
    # token whose confidence is below stop_threshold; a step no row needs is skipped.
    active0 = (c0 >= dp.stop_threshold) & rows
    kv_shape = jax.eval_shape(lambda: step(cache, work[:, :1], pos_w[:, :1], key)[4])

    def body(carry, g):
        cache, prev, active = carry
        if limit is not None:
            active = active & (g < limit)

        # The branches only read the cache; the step's keys/values are written after
        # (a cache written inside a branch is copied whole on entry to it).
        def run():
            pos = jnp.minimum(start - 1 + g, S - 1)[:, None]
            return step(cache, prev[:, None], pos, jax.random.fold_in(key, g))[:5]

        def skip():
            return _no_step((prev, q0, e0, c0), kv_shape, cache.max_len)

        d, q, e, c, kv = _cond(jnp.any(active), run, skip)
        cache = write_layers(cache, 0, *kv)
        return (cache, d, active & (c >= dp.stop_threshold)), (d, q, e, active)

    (cache, _, _), (ds, qs, es, act) = jax.lax.scan(
        body, (cache, d0, active0), jnp.arange(1, G, dtype=jnp.int32), unroll=True)
    tokens, q, exit_idx = (jnp.concatenate([first[:, None], jnp.moveaxis(later, 0, 1)], axis=1)
                           for first, later in ((d0, ds), (q0, qs), (e0, es)))
    count = 1 + jnp.sum(act.T, axis=1).astype(jnp.int32)
    # The cache now holds K/V for the window and for the drafted tokens fed back (all but
    # the last): positions < start - 1 + count; the next call lowers it to what the
    # verifier accepted.
    cache = cache.with_lengths(jnp.where(rows, start - 1 + count, cache.lengths))
    return tokens, q, count, exit_idx, cache
