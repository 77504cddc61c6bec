"""The lookup rung (decode/lookup.py) and the methods built on it: `lookup` (the context
alone, no draft) and `ladder` (the lookup, then the sorted draft's exits).

Greedy: each equals the target's autoregressive tokens, batched rows with and without
matches (ragged) equal the rows run alone, and the draft's cache under the ladder holds
exactly the keys/values of the sequence (its widened catch-up window covers the tokens the
lookup placed before the draft's block). Sampling: tests/test_lookup_distribution.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.decode import engine
from s2d_jax.decode.lookup import lookup_block, point_mass
from s2d_jax.decode.sampling import speculative_verify
from s2d_jax.decode.serving import Decoder
from s2d_jax.decode.serving_config import resolve
from s2d_jax.decode.state import SpecConfig
from s2d_jax.errors import S2DError
from test_engine import CFG, NEW, draft, reference, target_params

# Row 0 repeats itself (matches), row 1 is too short to match anything at first, row 2
# repeats a 2-gram, row 3 is one token.
PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [9, 10], [11, 12, 13, 11, 12], [1]]


def _lookup(rows, ends, length=4, n_min=1, n_max=3):
    S = max(len(r) for r in rows) + 4
    work = np.zeros((len(rows), S), np.int32)
    for i, r in enumerate(rows):
        work[i, :len(r)] = r
        work[i, len(r):] = 99  # junk after the context must never be read
    toks, count, n = lookup_block(jnp.asarray(work), jnp.asarray(ends, jnp.int32), length,
                                  n_min, n_max)
    return np.asarray(toks), np.asarray(count).tolist(), np.asarray(n).tolist()


def test_lookup_finds_the_longest_then_fullest_then_latest_match():
    toks, count, n = _lookup([[1, 2, 3, 4, 1, 2], [5, 6, 7, 8, 9], [7, 7, 7, 7],
                              [1, 2, 5, 1, 2, 6, 2]], [6, 5, 4, 7])
    assert count[0] == 4 and toks[0].tolist() == [3, 4, 1, 2] and n[0] == 2
    assert count[1] == 0 and n[1] == 0  # no earlier occurrence: nothing proposed
    assert count[2] == 1 and toks[2, 0] == 7 and n[2] == 3  # longest match, then its 1 token
    # "2" occurs at 1 and 4: the earlier has 4 tokens after it before E, the later 2
    assert n[3] == 1 and toks[3, :count[3]].tolist() == [5, 1, 2, 6]
    # "8" at 0 and 2, both with a token after it: the latest wins
    toks, count, n = _lookup([[8, 1, 8, 2, 8]], [5], length=1)
    assert (count, n, toks[0, 0]) == ([1], [1], 2)


def test_lookup_n_range_and_length_and_ragged_ends():
    # the last 2 tokens "1 2" occur once; with n_min 3 nothing matches
    assert _lookup([[1, 2, 3, 4, 1, 2]], [6], n_min=3)[1] == [0]
    assert _lookup([[1, 2, 3, 4, 1, 2]], [6], length=2)[0][0, :2].tolist() == [3, 4]
    # ragged: the same buffer cut at different ends gives each row its own answer
    rows = [[4, 5, 6, 4, 5, 6, 4]] * 3
    toks, count, n = _lookup(rows, [7, 4, 1])
    assert (count[0], n[0]) == (3, 3) and toks[0, :3].tolist() == [5, 6, 4]
    assert count[1:] == [3, 0] and toks[1, :3].tolist() == [5, 6, 4]


@pytest.mark.slow
def test_point_mass_in_the_lossless_rule_is_accept_with_p_and_p_without_x():
    p = jnp.asarray([[[0.2, 0.5, 0.3], [0.6, 0.3, 0.1]]], jnp.float32)  # [1, 2, V]
    x = jnp.asarray([[1]], jnp.int32)
    q = point_mass(x, 3)
    accepts = [int(speculative_verify(jax.random.key(s), x, q, p)[0][0]) for s in range(2000)]
    assert abs(np.mean(accepts) - 0.5) < 0.04  # accepted with probability p(x)
    keys = jax.random.split(jax.random.key(1), 4000)
    out = jax.vmap(lambda k: speculative_verify(k, x, q, p))(keys)
    nxt = np.asarray(out[1])[np.asarray(out[0]) == 0]  # corrections: p with x removed
    freq = np.bincount(nxt, minlength=3) / len(nxt)
    assert freq[1] == 0 and abs(freq[0] - 0.4) < 0.05 and abs(freq[2] - 0.6) < 0.05


def test_lookup_settings_are_checked_and_resolved():
    with pytest.raises(S2DError, match="n range"):
        SpecConfig(method="lookup", gamma=3, ngram=(3, 1))
    with pytest.raises(S2DError, match="lookup length"):
        SpecConfig(method="ladder", exits=(1,), gamma=2, lookup_len=3)
    assert SpecConfig(method="lookup", gamma=3, exits=(2,)).exits == ()  # no draft exits
    with pytest.raises(S2DError, match="needs a draft"):
        Decoder(CFG, target_params(), method="ladder", exits=(1,), gamma=2)
    s = resolve("lookup", (2, 4))
    assert (s.exits, s.thresholds, s.gamma, s.ngram) == ((), None, 4, (1, 3))
    cal = {"thresholds": [0.0], "gamma": 1, "exits": [2],
           "ladder": {"exits": [2, 4], "thresholds": [0.4, 0.0], "gamma": 3, "ngram": [2, 3],
                      "lookup_len": 2},
           "lookup": {"gamma": 5, "ngram": [1, 2]}}
    s = resolve("ladder", (2, 4), cal)
    assert (s.exits, s.thresholds, s.gamma, s.ngram, s.lookup_len, s.calibrated) == (
        (2, 4), (0.4, 0.0), 3, (2, 3), 2, True)
    assert resolve("lookup", (2, 4), cal).gamma == 5
    assert not resolve("ladder", (2, 4), cal, thresholds=[0.5, 0]).calibrated


@functools.lru_cache(maxsize=None)
def _decoder(method, gamma, lookup_len=0, ngram=(1, 3), exits=(1, 2, 3)):
    if method == "lookup":
        return Decoder(CFG, target_params(), method="lookup", gamma=gamma, ngram=ngram)
    dcfg, dparams = draft()
    return Decoder(CFG, target_params(), method=method, draft_cfg=dcfg, draft_params=dparams,
                   exits=exits, gamma=gamma, ngram=ngram, lookup_len=lookup_len)


@pytest.mark.parametrize("method,gamma,lookup_len,ngram", [
    ("lookup", 3, 0, (1, 3)),
    ("ladder", 3, 2, (2, 3)),  # n >= 2: some rows match, some climb to the draft (ragged)
])
def test_greedy_equals_ar_batched_and_alone(method, gamma, lookup_len, ngram):
    dec = _decoder(method, gamma, lookup_len, ngram)
    th = None if method == "lookup" else [0.3, 0.3, 0.0]
    batch = dec.generate(PROMPTS, max_new_tokens=NEW, eos_id=-1, thresholds=th)
    rungs = []
    for p, o in zip(PROMPTS, batch):
        assert o["token_ids"] == reference(tuple(p)), (method, p)
        alone = dec.generate([p], max_new_tokens=NEW, eos_id=-1, thresholds=th)[0]
        assert alone["token_ids"] == o["token_ids"]
        if method == "lookup":  # no draft escalation shared across rows: same rounds too
            assert alone["stats"]["accepted_by_rung"] == o["stats"]["accepted_by_rung"]
        rungs.append(o["stats"]["accepted_by_rung"])
    assert any(r["lookup"] > 0 for r in rungs), rungs  # the rung was really used
    if method == "ladder":
        assert any(sum(v for k, v in r.items() if k != "lookup") > 0 for r in rungs), rungs
    mats = [o["stats"]["mean_accepted_tokens"] for o in batch]
    assert max(mats) > 1.3 and all(1.0 <= m <= gamma + 1 for m in mats), mats


def test_ladder_draft_cache_holds_the_sequence():
    """One full-depth exit (no CALM approximation): after a ladder generation the draft's
    cache equals a fresh prefill of the generated sequence at every position it claims,
    although rounds placed lookup tokens the draft never drafted."""
    dec = _decoder("ladder", 3, 0, (1, 3), exits=(3,))
    spec, prompts, lens = dec.prepare(PROMPTS, NEW)
    chain = dec.chain_for(spec)
    dp = dec.decode_params(spec, max_new_tokens=NEW, eos_id=-1)
    state = engine.generate(*dec.prefill_args(prompts, lens, dp, 0), chain=chain)
    assert int(state.stats.lookup_accepted.sum()) > 0
    B, S = state.tokens.shape
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    _, ref = jax.jit(engine._prefill_level, static_argnums=(1, 4, 5))(
        dec.draft_params, chain.draft, state.tokens, pos, S, None)
    held = np.asarray(state.draft_cache.lengths)
    assert (held >= np.asarray(state.length) - 3).all()
    for b in range(B):
        for got, want in ((state.draft_cache.k, ref.k), (state.draft_cache.v, ref.v)):
            np.testing.assert_allclose(np.asarray(got[:, b, :, :held[b]]),  # [L, B, K, S, H]
                                       np.asarray(want[:, b, :, :held[b]]), rtol=2e-4,
                                       atol=2e-5)


def test_bench_expands_lookup_methods_and_reports_rungs_and_the_ladder_bars():
    from s2d_jax.bench import runner as bench
    from s2d_jax.bench.report import ladder_checks, rung_tables

    cal = {"thresholds": [0.0], "gamma": 1, "exits": [2],
           "ladder": {"exits": [2], "thresholds": [0.0], "gamma": 3, "ngram": [2, 3]}}
    specs, notes = bench.method_specs(["ar", "lookup", "ladder", "ladder-cal", "lookup-cal"],
                                      (2, 4), None, 4, cal)
    assert [s.label for s in specs] == ["ar", "lookup", "ladder", "ladder-cal"]
    assert specs[1].exits == () and specs[2].exits == (2, 4) and specs[2].gamma == 4
    assert specs[3].ngram == (2, 3) and specs[3].gamma == 3
    assert len(notes) == 1 and "lookup-cal skipped" in notes[0]
    g = {"lookup": {"method": "lookup", "speedup_vs_ar": 1.3,
                    "per_prompt_tokens_per_second": [13.0, 26.0]},
         "sd@2": {"method": "sd", "speedup_vs_ar": 1.1,
                  "per_prompt_tokens_per_second": [11.0, 22.0]},
         "ladder": {"method": "ladder", "speedup_vs_ar": 1.4,
                    "per_prompt_tokens_per_second": [14.0, 28.0], "new_tokens": 100,
                    "target_tokens": 50, "accepted_by_rung": {"lookup": 30, "exit 2": 20},
                    "lookup_acceptance": 0.5}}
    checks = ladder_checks("t", g, "sd@2")
    assert [c["pass"] for c in checks] == [True, True]  # 1.4x; 14/13 = 1.077 vs lookup
    assert "(lookup)" in checks[1]["check"] and "1.077" in checks[1]["value"]
    table = rung_tables({"targets": {"t": {"results": {"0.0": g}}}})
    assert "| ladder | 0.30 | 0.20 | 0.50 | 0.50 |" in table


@pytest.mark.slow
def test_lookup_under_a_polybasic_chain_equals_ar():
    """lookup -> an intermediate model (the draft's 3 layers, verifying and accumulating
    mu = 2) -> the target: still the target's greedy tokens."""
    dcfg, dparams = draft()
    dec = Decoder(CFG, target_params(), method="lookup", gamma=2,
                  intermediates=[(dcfg, dparams)], mus=[2])
    out = dec.generate(PROMPTS, max_new_tokens=NEW, eos_id=-1)
    for p, o in zip(PROMPTS, out):
        assert o["token_ids"] == reference(tuple(p)), p
    assert sum(o["stats"]["accepted_by_rung"]["lookup"] for o in out) > 0


def test_target_setting_of_lookup_needs_no_draft(tmp_path):
    """A target dir with a serving config: `lookup` resolves without a draft config."""
    import json

    from s2d_jax.decode.serving_config import SERVING_CONFIG, target_setting
    (tmp_path / SERVING_CONFIG).write_text(json.dumps(
        {"thresholds": [0.0], "gamma": 1, "lookup": {"gamma": 3, "ngram": [2, 3]}}))
    s = target_setting("lookup", str(tmp_path), CFG)
    assert (s.gamma, s.ngram, s.calibrated) == (3, (2, 3), True)
