"""The static Chain (decode/chain.py): built and checked once, equal chains share one
compiled program, and the shared checks of exits (model/exits.py) and of the traced
thresholds (decode/checks.py) refuse bad input alike wherever it comes from."""

import dataclasses
import math

import jax
import pytest

from s2d_jax.decode import engine
from s2d_jax.decode.chain import Chain
from s2d_jax.decode.checks import check_stop_threshold, check_thresholds
from s2d_jax.decode.serving import Decoder
from s2d_jax.decode.state import SpecConfig
from s2d_jax.errors import S2DError
from s2d_jax.model.exits import exits_problem
from test_engine import CFG, PROMPTS, draft, make_decoder, target_params

SPEC = SpecConfig(method="s2d", exits=(1, 2), gamma=2, max_len=32)


def test_two_decoders_with_equal_settings_compile_one_program():
    """Chains are compared by value: a second Decoder built from equal configs (new
    objects) hits the first one's compiled program."""
    def decoder():
        dcfg, dparams = draft()
        return Decoder(dataclasses.replace(CFG), target_params(), method="ar",
                       draft_cfg=dataclasses.replace(dcfg), draft_params=dparams)

    runs = []
    for dec in (decoder(), decoder()):
        spec, prompts, lens = dec.prepare(PROMPTS[:2], 4)
        runs.append(dec.chain_for(spec))
        dp = dec.decode_params(spec, max_new_tokens=4)
        jax.block_until_ready(engine.generate(dec.draft_params, dec.target_params, prompts,
                                              lens, dp, jax.random.key(0),
                                              chain=runs[-1]))
        if len(runs) == 1:
            size = engine.generate._cache_size()
    assert runs[0] == runs[1] and hash(runs[0]) == hash(runs[1])
    assert engine.generate._cache_size() == size


def test_chain_cuts_the_draft_to_its_deepest_exit_and_drops_it_for_ar():
    dcfg, _ = draft()
    assert Chain(dcfg, (), CFG, SPEC).draft.num_layers == 2
    ar = Chain(dcfg, (), CFG, SpecConfig(method="ar", gamma=0))
    assert ar.draft is None and ar.cfgs == (None, CFG)
    assert Chain(dcfg, (CFG,), CFG, dataclasses.replace(SPEC, mus=(2,))).cfgs[1] is CFG


@pytest.mark.parametrize("build,match", [
    (lambda d: Chain(d, (), CFG, SpecConfig(method="sd", exits=(4,))), "deeper than the draft"),
    (lambda d: Chain(d, (CFG,), CFG, SPEC), "one mu per intermediate"),
    (lambda d: Chain(dataclasses.replace(d, vocab_size=65), (), CFG, SPEC), "vocab_size"),
    (lambda d: Chain(None, (), CFG, SPEC), "needs a draft"),
])
def test_bad_chains_raise_one_clear_error(build, match):
    with pytest.raises(S2DError, match=match):
        build(draft()[0])


@pytest.mark.parametrize("exits,layers,to_depth,ok", [
    ((1, 2), 3, False, True), ((1, 3), 3, True, True), ((1, 2), 3, True, False),
    ((2, 1), 3, False, False), ((1, 1), 3, False, False), ((0, 2), 3, False, False),
    ((1, 4), 3, False, False), ((), 3, False, False), ((1.0, 2), 3, False, False),
    ((True, 2), 3, False, False), ((1, 2), None, False, True)])
def test_one_exit_rule(exits, layers, to_depth, ok):
    assert (exits_problem(exits, layers, to_depth=to_depth) is None) == ok


def test_spec_and_decoder_use_the_exit_rule():
    with pytest.raises(S2DError, match="increasing"):
        SpecConfig(method="s2d", exits=(2.5,))
    with pytest.raises(S2DError, match="deeper than the draft"):
        make_decoder("s2d", (1, 4), 2)


def test_threshold_checks():
    assert check_thresholds(None, (1, 2)) == (0.0, 0.0)
    assert check_thresholds([1, 0.5], (1, 2)) == (1.0, 0.5)
    for bad, match in [([0.5], "one threshold per exit"), ([math.nan, 0], r"\[0, 1\]"),
                       ([0.5, math.inf], r"\[0, 1\]"), (["x", 0], "must be a number"),
                       ([-0.1, 0], r"\[0, 1\]")]:
        with pytest.raises(S2DError, match=match):
            check_thresholds(bad, (1, 2))
    assert check_stop_threshold(0.25) == 0.25
    for bad in (math.nan, math.inf, -1, 1.5, "x", None):
        with pytest.raises(S2DError, match="stop threshold"):
            check_stop_threshold(bad)


def test_decoder_refuses_a_bad_stop_threshold_per_call_too():
    dec = make_decoder("ar", (), 0)
    with pytest.raises(S2DError, match="stop threshold"):
        dec.generate([[1, 2]], max_new_tokens=2, stop_threshold=math.nan)
    with pytest.raises(S2DError, match="threshold"):
        make_decoder("s2d", (1, 2), 2, thresholds=[0.5, math.nan])
