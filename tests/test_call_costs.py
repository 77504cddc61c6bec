"""In-loop per-call cost probes (s2d_jax/call_costs.py): the timed loop really makes the
calls it claims (same results as the calls made one by one), one draft probe per exit,
and results only after sampling."""

import jax
import jax.numpy as jnp
import pytest

from s2d_jax.bench import call_costs
from s2d_jax.model import transformer as model
from s2d_jax.decode.drafting import draft_token
from s2d_jax.errors import S2DError
from s2d_jax.model.kvcache import init_cache
from s2d_jax.bench.loop_costs import forced_exit_thresholds
from s2d_jax.decode.sampling import SamplingParams, probs_from_logits, speculative_verify
from s2d_jax.decode.state import DecodeParams
from test_engine import CFG, draft, target_params


@pytest.mark.slow
def test_verify_loop_equals_the_calls_made_one_by_one():
    params, window, block, n, start, S = target_params(), 2, 3, 3, 10, 32
    chain = call_costs.verify_chain(CFG, window, block, S)
    spec = chain.spec
    assert spec.num_levels - 1 == window  # level 1 of this chain feeds `window` tokens
    toks = (jnp.arange(S, dtype=jnp.int32)[None] * 5 + 1) % CFG.vocab_size
    q = jax.nn.softmax(jax.random.normal(jax.random.key(1), (1, block, CFG.vocab_size)), -1)
    dp, key = DecodeParams.make(spec, [0.0], temperature=1.0), jax.random.key(7)
    got = call_costs._verify_loop(params, init_cache(CFG, 1, S), toks, jnp.int32(start), q,
                                  key, dp, jnp.int32(n), chain=chain)
    # the same calls by hand: a forward over the window + block, the accept rule
    pos = (start - window + jnp.arange(window + block, dtype=jnp.int32))[None]
    cache, want = init_cache(CFG, 1, S), 0
    for i in range(n):
        logits, cache = model.forward(params, CFG, toks[:, start - window:start + block], pos,
                                      cache)
        p = probs_from_logits(logits[:, window - 1:], dp.sampling)
        # the intermediate's key: (round key, 1 + level), then its call count this round
        k, nxt = speculative_verify(
            jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, i), 2), i),
            toks[:, start:start + block], q, p, greedy=False)
        want += int(k[0]) + int(nxt[0])
    assert int(got) == want
    assert int(call_costs._verify_loop(params, init_cache(CFG, 1, S), toks, jnp.int32(start),
                                       q, key, dp, jnp.int32(0), chain=chain)) == 0


@pytest.mark.slow
def test_draft_loop_feeds_each_drafted_token_to_the_next_step():
    dcfg, dparams = draft()
    exits, j, n = (1, 3), 0, 4
    th = jnp.asarray(forced_exit_thresholds(len(exits), j), jnp.float32)
    sp, key = SamplingParams.make(0.0), jax.random.key(0)
    tok, pos = jnp.array([5], jnp.int32), jnp.full((1, 1), 6, jnp.int32)
    got = call_costs._draft_loop(dparams, init_cache(dcfg, 1, 32), tok, pos, key, sp, th,
                                 jnp.int32(n), cfg=dcfg, exits=exits, conf_kind="max_prob",
                                 kv_fill="calm")
    cache, prev = init_cache(dcfg, 1, 32), tok
    for i in range(n):
        prev, _, exit_idx, _, cache = draft_token(dparams, dcfg, cache, prev[:, None], pos + i,
                                                  jax.random.fold_in(key, i), sp, th, exits)
        assert int(exit_idx[0]) == j  # the forced exit
    assert int(got[0]) == int(prev[0])


def test_probes_one_per_exit_and_results_only_after_sampling():
    dcfg, dparams = draft()
    # calls: enough that a loop of these tiny models' calls outlasts the timing noise
    probes = call_costs.draft_step_probes(dparams, dcfg, (1, 2, 3), start=4, max_len=96,
                                          calls=64)
    assert len(probes) == 3
    verify = call_costs.verify_probe(target_params(), CFG, window=1, block=2, start=4,
                                     max_len=96, calls=64)
    with pytest.raises(S2DError, match="before any sample"):
        verify.result()
    verify.times = {0: [1.0], verify.calls: [0.5]}  # a loop faster than an empty one
    with pytest.raises(S2DError, match="measured no time"):
        verify.result()
    verify.times = {0: [], verify.calls: []}
    for p in probes + [verify]:
        for _ in range(5):  # medians of 5: these tiny calls are near a loaded machine's noise
            p.sample()
        assert len(p.times[0]) == len(p.times[p.calls]) == 5
        # on a loaded machine a tiny call's loop can time no slower than an empty one: then
        # result() must say so rather than return a cost <= 0 (all that holds under any load)
        try:
            assert p.result() > 0
        except S2DError as e:
            assert "measured no time" in str(e)
