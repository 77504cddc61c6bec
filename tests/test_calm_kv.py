"""The CALM K/V fill: when no row escalates past an exit, the skipped layers' keys/values
at the fed positions must be the exit's hidden state projected through each skipped
layer's attn_norm + wk / wv (+ rope on the keys). Computed here directly with the model's
own functions and compared with what the drafting step and the engine write into the
draft cache. The first skipped layer's input IS the exit's hidden state, so there CALM is
exact; deeper layers' true K/V are checked to differ, so a fill that ran the layers (or
wrote nothing) would fail."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.config import ModelConfig
from s2d_jax.decode import engine
from s2d_jax.decode.chain import Chain
from s2d_jax.decode.drafting import draft_token
from s2d_jax.decode.sampling import SamplingParams
from s2d_jax.decode.state import DecodeParams, SpecConfig
from s2d_jax.model import transformer as model
from s2d_jax.model.kvcache import init_cache
from s2d_jax.model.rope import apply_rope, cos_sin
from tiny_models import numpy_params

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=96)
EXITS = (1, 4)  # stopping at exit 1 skips layers 1, 2 and 3
SKIPPED = (1, 2, 3)
STOP_AT_FIRST = [0.0, 0.0]  # confidence >= 0 always: every row keeps exit 1's token
TARGET = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, max_position_embeddings=96)


@functools.lru_cache(maxsize=None)
def params():
    """Random weights, with per-layer attn_norm weights that differ from 1 (so a fill that
    ignored them, or took another layer's, would show)."""
    p = numpy_params(CFG, 0, 0.5)
    norm = np.random.default_rng(2).uniform(0.5, 1.5, p["layers"]["attn_norm"].shape)
    return dict(p, layers=dict(p["layers"], attn_norm=jnp.asarray(norm, jnp.float32)))


def calm_kv(p, h_exit, positions, layer):
    """What CALM says layer `layer`'s K/V are for hidden states h_exit [B, T, D] at
    positions [B, T]: the layer's own attn_norm, wk/wv and rope, no attention, no MLP."""
    lp = jax.tree.map(lambda w: w[layer], p["layers"])
    x = model.rms_norm(h_exit, lp["attn_norm"], CFG.rms_norm_eps)
    k = model.dense("BTD,DKH->BTKH", x, lp["wk"], h_exit.dtype)
    v = model.dense("BTD,DKH->BTKH", x, lp["wv"], h_exit.dtype)
    cos, sin = cos_sin(CFG, positions)
    return np.asarray(apply_rope(k, cos, sin)), np.asarray(v)


def at(cache_kv, layer, positions):
    """cache_kv [L, B, K, S, H] at `layer` and positions [B, T] -> [B, T, K, H]."""
    return np.stack([np.asarray(cache_kv[layer, b, :, positions[b]])
                     for b in range(positions.shape[0])])


@pytest.mark.slow
def test_draft_step_fills_skipped_layers_from_the_exit_hidden_state():
    p = params()
    B, P, S = 2, 6, 16
    rng = np.random.default_rng(1)
    history = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, P)), jnp.int32)
    cache = init_cache(CFG, B, S)
    hist_pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    _, cache = model.decode_layers(p, CFG, model.embed_tokens(p, CFG, history), hist_pos, 0, 4,
                                   cache)
    # The draft step feeds two tokens, as its first step in a round does.
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, 2)), jnp.int32)
    positions = jnp.asarray([[P, P + 1], [P - 1, P]], jnp.int32)
    step = functools.partial(draft_token, p, CFG, cache, tokens, positions, jax.random.key(0),
                             SamplingParams.make(), jnp.asarray(STOP_AT_FIRST, jnp.float32),
                             EXITS)
    *_, exit_idx, _, filled = step(kv_fill="calm")
    *_, exit_full, _, full = step(kv_fill="full")
    assert np.asarray(exit_idx).tolist() == [0, 0] == np.asarray(exit_full).tolist()

    # Directly: the exit's hidden state (layer 0 over the same cache), then the projection.
    h_exit, _ = model.decode_layers(p, CFG, model.embed_tokens(p, CFG, tokens), positions, 0, 1,
                                    cache)
    pos = np.asarray(positions)
    for layer in SKIPPED:
        k_want, v_want = calm_kv(p, h_exit, positions, layer)
        np.testing.assert_allclose(at(filled.k, layer, pos), k_want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(at(filled.v, layer, pos), v_want, rtol=1e-5, atol=1e-5)
        # The true K/V (kv_fill="full"): the same for the first skipped layer, whose input
        # is the exit's hidden state; something else deeper.
        gap = max(np.abs(at(full.k, layer, pos) - k_want).max(),
                  np.abs(at(full.v, layer, pos) - v_want).max())
        assert gap < 1e-5 if layer == SKIPPED[0] else gap > 1e-2
    # The exit's own layer holds true K/V in both schemes; untouched slots keep theirs.
    np.testing.assert_allclose(at(filled.k, 0, pos), at(full.k, 0, pos), rtol=1e-6, atol=1e-6)
    untouched = np.ones((B, S), bool)
    untouched[np.arange(B)[:, None], pos] = False
    for arr, ref in ((filled.k, cache.k), (filled.v, cache.v)):
        slots_last = [np.moveaxis(np.asarray(a), 3, 2) for a in (arr, ref)]  # [L, B, S, K, H]
        np.testing.assert_array_equal(slots_last[0][:, untouched], slots_last[1][:, untouched])


def test_engine_round_writes_calm_kv_for_every_drafted_position():
    """One S2D round of the engine: every draft step stops at exit 1, so the draft cache
    at the positions the round fed (the 2-token catch-up window, then each drafted token
    but the last) must hold the CALM K/V of the skipped layers."""
    p = params()
    tparams = numpy_params(TARGET, 1, 0.5)
    gamma = 3
    spec = SpecConfig(method="s2d", exits=EXITS, gamma=gamma, max_len=32)
    dp = DecodeParams.make(spec, STOP_AT_FIRST, max_new_tokens=16)
    prompts = jnp.asarray([[5, 9, 2, 7, 11, 3], [4, 8, 1, 0, 0, 0]], jnp.int32)
    lens = jnp.asarray([6, 3], jnp.int32)
    kw = dict(chain=Chain(CFG, (), TARGET, spec))
    state = engine.prefill(p, tparams, prompts, lens, dp, jax.random.key(0), **kw)
    tokens0, L = np.asarray(state.tokens), np.asarray(state.length)
    state = engine.decode_chunk(state, p, tparams, dp, jnp.int32(1), **kw)
    assert np.asarray(state.stats.exit_counts)[:, 1].sum() == 0  # nothing escalated
    assert np.asarray(state.stats.proposed_at).tolist() == [[1] * gamma] * 2

    first_layer = jax.jit(lambda t: model.run_layers(
        p, CFG, model.embed_tokens(p, CFG, t[None]),
        jnp.arange(t.shape[0], dtype=jnp.int32)[None], 0, 1)[0])
    for b in range(2):
        seq = [int(t) for t in tokens0[b, :L[b]]]
        for _ in range(gamma):  # the greedy exit-1 drafts, recomputed without a cache
            h = first_layer(jnp.asarray(seq, jnp.int32))
            seq.append(int(jnp.argmax(model.lm_logits(p, CFG, h[0, -1]))))
        # window L-2 (the last prompt token: exact K/V from the prefill, kept), L-1, then
        # L .. L+gamma-2 (the drafts fed back): CALM from L-1 on
        fed = np.arange(L[b] - 2, L[b] + gamma - 1)
        h_exit = first_layer(jnp.asarray(seq[:fed[-1] + 1], jnp.int32))[:, fed]
        true_h = model.embed_tokens(p, CFG, jnp.asarray(seq[:fed[-1] + 1])[None])
        cache_true = init_cache(CFG, 1, spec.max_len)
        _, cache_true = model.decode_layers(
            p, CFG, true_h, jnp.arange(fed[-1] + 1, dtype=jnp.int32)[None], 0, 4, cache_true)
        for layer in SKIPPED:
            k_want, v_want = calm_kv(p, h_exit, jnp.asarray(fed)[None], layer)
            got_k = np.asarray(state.draft_cache.k[layer, b, :, fed])
            got_v = np.asarray(state.draft_cache.v[layer, b, :, fed])
            np.testing.assert_allclose(got_k[1:], k_want[0, 1:], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(got_v[1:], v_want[0, 1:], rtol=1e-4, atol=1e-4)
            # the prefilled position keeps its exact K/V
            np.testing.assert_allclose(got_k[0], np.asarray(cache_true.k[layer, 0, :, fed[0]]),
                                       rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(got_v[0], np.asarray(cache_true.v[layer, 0, :, fed[0]]),
                                       rtol=1e-4, atol=1e-4)
            gap = np.abs(np.asarray(cache_true.k[layer, 0, :, fed]) - k_want[0]).max()
            assert gap < 1e-4 if layer == SKIPPED[0] else gap > 1e-2


@pytest.mark.slow
def test_fully_accepted_block_gets_calm_kv_at_its_last_draft_next_round():
    """The last drafted token of a fully accepted block was never fed to the draft: the next
    round's window must fill its skipped layers (its position is below length - 1, where an
    exact value would otherwise be assumed)."""
    p = params()
    # The target is the draft's exit-1 model itself (layer 0, same norm and head): greedy
    # drafts from exit 1 are then always accepted.
    one = dict(p, layers=jax.tree.map(lambda w: w[:1], p["layers"]))
    tcfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=96)
    gamma = 3
    spec = SpecConfig(method="s2d", exits=EXITS, gamma=gamma, max_len=32)
    dp = DecodeParams.make(spec, STOP_AT_FIRST, max_new_tokens=16)
    prompts = jnp.asarray([[5, 9, 2, 7, 11, 3]], jnp.int32)
    kw = dict(chain=Chain(CFG, (), tcfg, spec))
    state = engine.prefill(p, one, prompts, jnp.asarray([6]), dp, jax.random.key(0), **kw)
    L0 = int(state.length[0])
    state = engine.decode_chunk(state, p, one, dp, jnp.int32(1), **kw)
    assert int(state.length[0]) == L0 + gamma + 1  # the whole block and the bonus
    state = engine.decode_chunk(state, p, one, dp, jnp.int32(1), **kw)
    seq = jnp.asarray(state.tokens[0, :int(state.length[0])])
    pos = L0 + gamma - 1  # the block's last draft
    h = model.run_layers(p, CFG, model.embed_tokens(p, CFG, seq[None]),
                         jnp.arange(seq.shape[0], dtype=jnp.int32)[None], 0, 1)[0]
    for layer in SKIPPED:
        k_want, v_want = calm_kv(p, h[:, pos:pos + 1], jnp.asarray([[pos]]), layer)
        np.testing.assert_allclose(np.asarray(state.draft_cache.k[layer, 0, :, pos]), k_want[0, 0],
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(state.draft_cache.v[layer, 0, :, pos]), v_want[0, 0],
                                   rtol=1e-4, atol=1e-4)
